"""flashedu.torch_tiled against the float64 reference: ragged shapes, causal both ways, GQA, masked
rows, huge logits, half precision, and the structure of the algorithm (no N_q x N_k tensor, causal
block skipping)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flashedu import reference, torch_tiled
from flashedu.testing import assert_close, max_error

# (B, H, H_kv, N_q, N_k, d)
SHAPES = [
    (1, 1, 1, 1, 1, 8),
    (2, 3, 3, 17, 17, 16),
    (1, 2, 2, 33, 65, 32),
    (1, 2, 2, 65, 33, 32),
    (1, 4, 2, 97, 40, 8),
    (2, 4, 1, 5, 97, 16),
]
BLOCKS = dict(block_m=16, block_n=16)


def _qkv(make_qkv, shape, dtype, scale=1.0):
    B, H, H_kv, N_q, N_k, d = shape
    return make_qkv(B, H, N_q, N_k, d, dtype, H_kv=H_kv, kind="torch", scale=scale)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_and_backward_match_reference(shape, causal, dtype, make_qkv):
    q, k, v = _qkv(make_qkv, shape, dtype)
    o, lse = torch_tiled.forward(q, k, v, causal=causal, **BLOCKS)
    o_ref, lse_ref = reference.forward(q, k, v, causal=causal)
    assert o.dtype == q.dtype and lse.dtype == (
        torch.float64 if dtype == "float64" else torch.float32
    )
    assert_close(o, o_ref, dtype, name="o")
    assert_close(lse, lse_ref, dtype, name="lse")
    do = torch.randn_like(o)
    grads = torch_tiled.backward(do, q, k, v, o, lse, causal=causal, **BLOCKS)
    for name, g, g_ref in zip(
        ("dq", "dk", "dv"), grads, reference.backward(do, q, k, v, causal=causal)
    ):
        assert g.dtype == q.dtype
        assert_close(g, g_ref, dtype, grad=True, name=name)


@pytest.mark.parametrize("block_m,block_n", [(1, 1), (3, 5), (7, 2), (64, 64), (128, 8)])
def test_any_block_sizes_give_the_same_answer(block_m, block_n, make_qkv):
    q, k, v = _qkv(make_qkv, (1, 2, 1, 23, 31, 8), "float64")
    o, lse = torch_tiled.forward(q, k, v, causal=True, block_m=block_m, block_n=block_n)
    o_ref, lse_ref = reference.forward(q, k, v, causal=True)
    assert_close(o, o_ref, "float64")
    do = torch.randn_like(o)
    grads = torch_tiled.backward(do, q, k, v, o, lse, causal=True, block_m=block_m, block_n=block_n)
    for g, g_ref in zip(grads, reference.backward(do, q, k, v, causal=True)):
        assert_close(g, g_ref, "float64", grad=True)


def test_fully_masked_rows_are_zero_with_zero_gradients(make_qkv):
    q, k, v = _qkv(
        make_qkv, (1, 2, 2, 20, 6, 8), "float32"
    )  # causal, N_q > N_k: rows 0..13 see no key
    o, lse = torch_tiled.forward(q, k, v, causal=True, block_m=8, block_n=4)
    assert torch.all(o[:, :, :14] == 0) and torch.all(torch.isneginf(lse[:, :, :14]))
    assert torch.isfinite(lse[:, :, 14:]).all()
    dq, dk, dv = torch_tiled.backward(
        torch.randn_like(o), q, k, v, o, lse, causal=True, block_m=8, block_n=4
    )
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert torch.all(dq[:, :, :14] == 0)


def test_huge_logits_stay_exact_and_finite(make_qkv):
    """Logits of about +-1e4 in float32: no overflow, and no more error than PyTorch's own float32
    softmax."""
    q, k, v = _qkv(make_qkv, (1, 2, 2, 33, 47, 16), "float32", scale=70.0)
    o, lse = torch_tiled.forward(q, k, v, causal=True, **BLOCKS)
    s = (q @ k.transpose(-1, -2) / 4.0).abs().max()
    assert s > 5e3
    o_ref, lse_ref = reference.forward(q, k, v, causal=True)
    mask = torch.ones(33, 47, dtype=torch.bool).tril(47 - 33)
    o_torch = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    err, err_torch = max_error(o, o_ref)[0], max_error(o_torch, o_ref)[0]
    print(f"max|o - ref|: torch_tiled {err:.1e}, PyTorch float32 {err_torch:.1e}")
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    assert err <= 2 * err_torch + 1e-5
    assert_close(lse, lse_ref, "float32", name="lse")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_upcasts_and_returns_input_dtype(dtype, make_qkv):
    q, k, v = _qkv(make_qkv, (1, 2, 1, 17, 33, 16), dtype)
    o, lse = torch_tiled.forward(q, k, v, causal=True, **BLOCKS)
    assert o.dtype == q.dtype and lse.dtype == torch.float32
    assert_close(o, reference.forward(q, k, v, causal=True)[0], dtype)
    do = torch.randn_like(o)
    grads = torch_tiled.backward(do, q, k, v, o, lse, causal=True, **BLOCKS)
    for g, g_ref in zip(grads, reference.backward(do, q, k, v, causal=True)):
        assert g.dtype == q.dtype
        assert_close(g, g_ref, dtype, grad=True)


def test_does_not_build_an_autograd_graph(make_qkv):
    q, k, v = (t.requires_grad_() for t in _qkv(make_qkv, (1, 1, 1, 5, 5, 8), "float64"))
    o, lse = torch_tiled.forward(q, k, v)
    assert not o.requires_grad and not lse.requires_grad


class _Record(TorchDispatchMode):
    """Records the shape of every tensor each aten op returns, and counts batched matmuls."""

    def __init__(self):
        super().__init__()
        self.shapes, self.bmm = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.bmm += func is torch.ops.aten.bmm.default
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def test_no_intermediate_is_as_large_as_the_score_matrix(make_qkv):
    q, k, v = _qkv(make_qkv, (1, 2, 2, 128, 128, 8), "float32")
    with _Record() as rec:
        o, lse = torch_tiled.forward(q, k, v, causal=True, **BLOCKS)
        torch_tiled.backward(torch.randn_like(o), q, k, v, o, lse, causal=True, **BLOCKS)
    largest = max(int(np.prod(s)) for s in rec.shapes)
    assert largest == q.numel() < 2 * 128 * 128  # the biggest tensor is a Q-sized one, not S or P


@pytest.mark.parametrize("N", [64, 128])
def test_causal_skips_the_blocks_above_the_diagonal(N, make_qkv):
    q, k, v = _qkv(make_qkv, (1, 1, 1, N, N, 8), "float32")
    counts = {}
    for causal in (False, True):
        with _Record() as rec:
            torch_tiled.forward(q, k, v, causal=causal, **BLOCKS)
        counts[causal] = rec.bmm
    n = N // 16
    assert counts[False] == 2 * n * n  # S = QK^T and PV for every pair of blocks
    assert counts[True] == 2 * n * (n + 1) // 2  # only blocks on or below the diagonal


def test_bad_arguments_raise_named_errors(make_qkv):
    q, k, v = _qkv(make_qkv, (1, 2, 2, 5, 7, 8), "float32")
    with pytest.raises(TypeError, match="torch.Tensor"):
        torch_tiled.forward(q.numpy(), k, v)
    with pytest.raises(ValueError, match="block_m"):
        torch_tiled.forward(q, k, v, block_m=0)
    with pytest.raises(ValueError, match="block_n"):
        torch_tiled.backward(q, q, k, v, q, q[..., 0], block_n=-2)
    with pytest.raises(ValueError, match="softmax_scale"):
        torch_tiled.forward(q, k, v, softmax_scale=float("nan"))
    with pytest.raises(ValueError, match="lse must have shape"):
        torch_tiled.backward(q, q, k, v, q, q, causal=True)
    with pytest.raises(ValueError, match="heads"):
        torch_tiled.forward(q, k[:, :1].expand(1, 3, 7, 8)[:, :3], v[:, :1].expand(1, 3, 7, 8))
