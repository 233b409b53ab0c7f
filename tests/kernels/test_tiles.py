"""Any head dim in the Triton kernels: tiles padded to a power of two with masked loads and stores,
and a value head dim d_v of its own, forward and backward against the float64 reference.

Under the interpreter (no CUDA) with 16x16 tiles; the GPU compile of the same dims is checked by
`python -m flashedu.bench.gpu_check --new-dims` on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from flashedu import api, decoding, kernels, reference
from flashedu.kernels import fwd
from flashedu.kernels.tiles import pad_dim
from flashedu.testing import assert_close, random_qkv

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(rng, B, H, H_kv, N_q, N_k, d, d_v, dtype):
    q, k, v = random_qkv(B, H, N_q, N_k, d, dtype, H_kv=H_kv, seed=rng, kind="torch", device=DEVICE)
    if d_v != d:
        v = torch.from_numpy(rng.standard_normal((B, H_kv, N_k, d_v))).to(DEVICE, q.dtype)
    return q, k, v


def _grad_out(rng, o):
    return torch.from_numpy(rng.standard_normal(tuple(o.shape))).to(o.device, o.dtype)


def test_tile_width_is_the_next_power_of_two_at_least_16():
    assert [pad_dim(d) for d in (1, 15, 16, 17, 40, 59, 64, 80, 96, 111, 128, 192, 256)] == [
        16, 16, 16, 32, 64, 64, 64, 128, 128, 128, 128, 256, 256,
    ]  # fmt: skip


# (B, H, H_kv, N_q, N_k, d, d_v, dtype, causal): head dims that are not powers of two, the smallest,
# and v with a head dim of its own (wider, narrower, and much narrower than k's).
CASES = [
    (1, 2, 1, 19, 23, 1, 1, "float32", True),
    (1, 2, 2, 33, 21, 40, 40, "float16", True),
    (1, 2, 2, 20, 35, 59, 59, "float32", False),
    (1, 1, 1, 24, 24, 96, 96, "bfloat16", True),
    (1, 1, 1, 17, 18, 192, 192, "float32", True),
    (1, 4, 2, 21, 30, 16, 48, "float32", True),
    (1, 2, 2, 30, 17, 40, 24, "float16", False),
    (1, 1, 1, 18, 20, 96, 8, "float32", True),
]


@pytest.mark.parametrize("B,H,H_kv,N_q,N_k,d,d_v,dtype,causal", CASES)
def test_any_head_dim_and_value_head_dim_match_reference(
    B, H, H_kv, N_q, N_k, d, d_v, dtype, causal, rng
):
    q, k, v = _inputs(rng, B, H, H_kv, N_q, N_k, d, d_v, dtype)
    o, lse = kernels.forward(q, k, v, causal=causal)
    assert o.shape == (B, H, N_q, d_v) and o.dtype == q.dtype
    o_ref, lse_ref = reference.forward(q, k, v, causal=causal)
    assert_close(o, o_ref, dtype=dtype, name="o")
    assert_close(lse, lse_ref, dtype="float32", name="lse")
    do = _grad_out(rng, o)
    grads = kernels.backward(do, q, k, v, o, lse, causal=causal)
    for name, g, g_ref, x in zip(
        ("dq", "dk", "dv"), grads, reference.backward(do, q, k, v, causal=causal), (q, k, v)
    ):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        assert_close(g, g_ref, dtype=dtype, grad=True, name=name)


def test_padding_columns_are_never_read(rng):
    """q, k, v, o and do with d = 40 as views into 64-wide buffers whose other 24 columns hold NaN:
    a load that touched the padding would spread NaN into the results."""

    def view(x):  # x (B, H, N, d) -> the same values, in a NaN-filled buffer 64 columns wide
        buf = torch.full((*x.shape[:3], 64), float("nan"), device=x.device, dtype=x.dtype)
        buf[..., : x.shape[-1]] = x
        return buf[..., : x.shape[-1]]

    q, k, v = _inputs(rng, 1, 2, 1, 29, 37, 40, 40, "float32")
    o, lse = kernels.forward(view(q), view(k), view(v), causal=True, window_size=(9, -1))
    assert_close(o, reference.forward(q, k, v, causal=True, window_size=(9, -1))[0], "float32")
    do = _grad_out(rng, o)
    grads = kernels.backward(view(do), view(q), view(k), view(v), view(o), lse, causal=True,
                        window_size=(9, -1))  # fmt: skip
    g_ref = reference.backward(do, q, k, v, causal=True, window_size=(9, -1))
    for name, g, r in zip(("dq", "dk", "dv"), grads, g_ref):
        assert_close(g, r, "float32", grad=True, name=name)


def test_value_head_dim_through_autograd_and_gqa(rng):
    q, k, v = (x.requires_grad_() for x in _inputs(rng, 2, 4, 1, 13, 19, 24, 40, "float32"))
    o = api.attention(q, k, v, causal=True, impl="triton")
    do = _grad_out(rng, o)
    o.backward(do)
    for name, x, g_ref in zip("qkv", (q, k, v), reference.backward(do, q, k, v, causal=True)):
        assert_close(x.grad, g_ref, dtype="float32", grad=True, name="d" + name)


@pytest.mark.parametrize(
    "d,d_v,dtype",
    [(40, 40, "float32"), (59, 24, "float16"), (1, 1, "float32"), (192, 96, "float32")],
)
def test_split_kv_decoding_takes_any_head_dims(d, d_v, dtype, rng):
    q, k, v = _inputs(rng, 1, 4, 2, 2, 45, d, d_v, dtype)
    o, lse = decoding.triton_forward(q, k, v, causal=True, num_splits=3)
    o_ref, lse_ref = reference.forward(q, k, v, causal=True)
    assert o.shape == (1, 4, 2, d_v)
    assert_close(o, o_ref, dtype=dtype, name="o")
    assert_close(lse, lse_ref, dtype="float32", name="lse")
    np_args = [x.cpu().float().numpy() for x in (q, k, v)]
    o_np, _ = decoding.forward(*np_args, causal=True, num_splits=3)
    assert_close(o_np, reference.forward(*np_args, causal=True)[0], dtype="float32", name="numpy o")


TUNING = [(64, 64, True), (128, 128, True), (40, 40, False), (96, 96, False), (192, 192, False),
          (128, 64, False)]  # fmt: skip


@pytest.mark.parametrize("d,d_v,tuned", TUNING)
def test_autotune_tables_give_untuned_head_dims_their_width_s_first_entry(d, d_v, tuned):
    """What the autotuner may try on a GPU (tested here without one): the whole table where it was
    measured (d = 64, 128 with Ev = E), else the first entry for the tile width."""
    from flashedu.kernels import bwd as tb
    from flashedu.kernels import launch as tl_

    q = torch.empty(1, 1, 1, d, dtype=torch.float16)
    for table in (fwd.fwd_table, tb.dkdv_table, tb.dq_table):
        configs = tl_._all_configs(table)
        flags = dict(HEAD_DIM=d, V_DIM=d_v, BLOCK_D=pad_dim(d), BLOCK_DV=pad_dim(d_v),
                     HAS_LEFT=False, HAS_RIGHT=True, HAS_MOD=False, VARLEN=False)  # fmt: skip
        kept = tl_._prune(table)(configs, {"Q": q}, **flags)
        listed = table(max(pad_dim(d), pad_dim(d_v)), False)
        got = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in kept]
        assert sorted(got) == sorted(listed if tuned else listed[:1])
        if not tuned:  # a score mod, a window or packed sequences are untuned too
            assert got == listed[:1]
        flags.update(HAS_MOD=True)
        assert len(tl_._prune(table)(configs, {"Q": q}, **flags)) == 1


def test_the_host_power_of_two_is_tritons():
    """`tiles._next_power_of_2` replaces triton.next_power_of_2 on the host path of every call."""
    import triton

    from flashedu.kernels import tiles

    assert all(tiles._next_power_of_2(n) == triton.next_power_of_2(n) for n in range(1, 4097))
