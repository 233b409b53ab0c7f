"""A value head dim of its own (Ev != E, as PyTorch's SDPA allows) in the NumPy and PyTorch
implementations, the float64 reference and the drop-in, against PyTorch on the same inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import flashedu
from flashedu import naive, reference, tiled, torch_tiled, traffic
from flashedu.testing import assert_close


def _qkv(rng, B, H, H_kv, N_q, N_k, d, d_v, dtype="float64"):
    q, k, v, do = (
        rng.standard_normal(s).astype(dtype)
        for s in ((B, H, N_q, d), (B, H_kv, N_k, d), (B, H_kv, N_k, d_v), (B, H, N_q, d_v))
    )
    return q, k, v, do


def test_reference_matches_pytorch_autograd_with_value_head_dim(rng):
    """The oracle itself, against float64 autograd through PyTorch's SDPA (bottom-right causal)."""
    q, k, v, do = _qkv(rng, 2, 2, 2, 7, 11, 5, 9)
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    mask = torch.ones(7, 11, dtype=torch.bool).tril(11 - 7)
    o_t = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask)
    o_t.backward(torch.from_numpy(do))
    o, _ = reference.forward(q, k, v, causal=True)
    assert o.shape == (2, 2, 7, 9)
    assert_close(o, o_t.detach(), "float64", name="o")
    for name, g, t in zip(("dq", "dk", "dv"), reference.backward(do, q, k, v, causal=True),
                          (tq, tk, tv)):  # fmt: skip
        assert_close(g, t.grad, "float64", grad=True, name=name)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,d_v", [(5, 11), (12, 3)])
def test_numpy_and_torch_implementations_take_a_value_head_dim(d, d_v, causal, dtype, rng):
    q, k, v, do = _qkv(rng, 2, 4, 2, 17, 23, d, d_v, dtype)
    o_ref, lse_ref = reference.forward(q, k, v, causal=causal)
    g_ref = reference.backward(do, q, k, v, causal=causal)
    runs = {
        "naive": (naive, {}),
        "tiled fa2": (tiled, dict(block_m=4, block_n=8)),
        "tiled fa1": (tiled, dict(block_m=4, block_n=8, order="fa1")),
    }
    for name, (mod, kw) in runs.items():
        o, lse = mod.forward(q, k, v, causal=causal, **kw)
        assert o.shape == (2, 4, 17, d_v), name
        assert_close(o, o_ref, dtype, name=f"{name} o")
        assert_close(lse, lse_ref, dtype, name=f"{name} lse")
        if "fa1" in name:
            continue  # one backward serves both loop orders
        kw.pop("order", None)
        for g_name, g, r in zip(("dq", "dk", "dv"), mod.backward(do, q, k, v, o, lse, causal=causal,
                                **kw), g_ref):  # fmt: skip
            assert g.shape == r.shape
            assert_close(g, r, dtype, grad=True, name=f"{name} {g_name}")
    t = [torch.from_numpy(x) for x in (q, k, v, do)]
    o, lse = torch_tiled.forward(*t[:3], causal=causal, block_m=8, block_n=8)
    assert_close(o, o_ref, dtype, name="torch_tiled o")
    grads = torch_tiled.backward(t[3], *t[:3], o, lse, causal=causal, block_m=8, block_n=8)
    for g_name, g, r in zip(("dq", "dk", "dv"), grads, g_ref):
        assert_close(g, r, dtype, grad=True, name=f"torch_tiled {g_name}")


def test_tiled_ledger_counts_value_bytes_with_the_value_head_dim(rng):
    """V and O move d_v columns, Q and K d: the forward's bytes are those of the closed form for
    each head dim (no mask, so every tile is visited)."""
    q, k, v, _ = _qkv(rng, 1, 2, 2, 24, 40, 8, 20, "float32")
    ledger = traffic.Ledger()
    tiled.forward(q, k, v, block_m=8, block_n=16, ledger=ledger)
    got = ledger.traffic()
    for d, tensors in ((8, ("Q", "K")), (20, ("V",))):
        model = traffic.flash_forward(1, 2, 24, 40, d, block_m=8, block_n=16, itemsize=4)
        for t in tensors:
            assert got.reads[t] == model.reads[t], t
    assert got.writes["O"] == 1 * 2 * 24 * 20 * 4


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("L,S,E,Ev", [(7, 7, 8, 5), (5, 9, 6, 12), (9, 4, 8, 3)])
def test_drop_in_takes_a_value_head_dim_as_pytorch_does(L, S, E, Ev, is_causal, rng):
    shapes = ((2, 3, L, E), (2, 3, S, E), (2, 3, S, Ev))
    outs = []
    for sdpa in (F.scaled_dot_product_attention, flashedu.scaled_dot_product_attention):
        ts = [torch.from_numpy(np.random.default_rng(0).standard_normal(s)).requires_grad_()
              for s in shapes]  # fmt: skip
        o = sdpa(*ts, is_causal=is_causal)
        o.backward(torch.ones_like(o))
        outs.append((o.detach(), *(t.grad for t in ts)))
    for name, a, b in zip(("o", "dquery", "dkey", "dvalue"), outs[1], outs[0]):
        assert a.shape == b.shape, name
        assert_close(a, b, "float64", grad=name != "o", name=name)


def test_value_head_dim_errors_name_the_shapes(rng):
    q, k, v, do = _qkv(rng, 1, 2, 2, 5, 6, 4, 3)
    with pytest.raises(ValueError, match="k and v must have the same shape up to the head dim"):
        naive.forward(q, k, v[:, :, :5])
    o, lse = naive.forward(q, k, v)
    with pytest.raises(ValueError, match=r"do must have shape \(B, H, N_q, d_v\) \(1, 2, 5, 3\)"):
        naive.backward(do[..., :2], q, k, v, o, lse)


@pytest.mark.parametrize("d", [1, 40, 59, 96, 192])
def test_numpy_and_torch_implementations_take_any_head_dim(d, rng):
    """The head dims the Triton kernels pad (tests/kernels/test_tiles.py), here in float64."""
    q, k, v, do = _qkv(rng, 1, 2, 1, 13, 9, d, d)
    o_ref, lse_ref = reference.forward(q, k, v, causal=True)
    g_ref = reference.backward(do, q, k, v, causal=True)
    t = [torch.from_numpy(x) for x in (q, k, v, do)]
    for name, fwd, bwd in (
        ("naive", lambda: naive.forward(q, k, v, causal=True), naive.backward),
        ("tiled", lambda: tiled.forward(q, k, v, causal=True, block_m=4, block_n=4),
         lambda *a, **kw: tiled.backward(*a, **kw, block_m=4, block_n=4)),
    ):  # fmt: skip
        o, lse = fwd()
        assert_close(o, o_ref, "float64", name=f"{name} o")
        for g, r in zip(bwd(do, q, k, v, o, lse, causal=True), g_ref):
            assert_close(g, r, "float64", grad=True, name=name)
    o, lse = torch_tiled.forward(*t[:3], causal=True, block_m=4, block_n=4)
    assert_close(o, o_ref, "float64", name="torch_tiled o")
    for g, r in zip(torch_tiled.backward(t[3], *t[:3], o, lse, causal=True, block_m=4, block_n=4),
                    g_ref):  # fmt: skip
        assert_close(g, r, "float64", grad=True, name="torch_tiled")
