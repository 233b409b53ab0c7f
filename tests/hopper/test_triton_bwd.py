"""The Hopper backward kernel and the registry's "hopper" entry.

Without CUDA the kernels run under TRITON_INTERPRET=1 with 16 x 16 tiles over CPU tensors, so each
shape below crosses several query and key blocks and ends on a ragged one; tests marked `gpu` need
an sm_90 GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

import flashedu
from flashedu import api, kernels, reference
from flashedu.hopper import dispatch as hopper_dispatch
from flashedu.hopper import triton_bwd as tb
from flashedu.hopper import triton_fwd as th
from flashedu.testing import assert_close, random_qkv

from .test_triton_fwd import CASES  # the forward's matrix: ragged, GQA, N_q != N_k, N_q = 1

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
on_hopper = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="needs an sm_90 GPU (H100/H200)",
)


def _qkv(B, H, N_q, N_k, d=64, dtype="float16", H_kv=None, seed=0):
    return random_qkv(B, H, N_q, N_k, d, dtype, H_kv=H_kv, seed=seed, kind="torch", device=DEVICE)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", CASES)
def test_backward_matches_reference(dtype, case):
    B, H, H_kv, N_q, N_k, causal = case
    q, k, v = _qkv(B, H, N_q, N_k, 64, dtype, H_kv=H_kv, seed=N_q * N_k)
    o, lse = th.forward(q, k, v, causal=causal)
    do = torch.randn_like(o)
    grads = tb.backward(do, q, k, v, o, lse, causal=causal)
    for name, g, g_ref in zip("qkv", grads, reference.backward(do, q, k, v, causal=causal)):
        assert g.dtype == q.dtype and g.shape == {"q": q, "k": k, "v": v}[name].shape
        assert torch.isfinite(g).all(), f"d{name} has non-finite entries"
        assert_close(g, g_ref, dtype=dtype, grad=True)


def test_fully_masked_rows_get_zero_dq():
    """N_q > N_k, causal: the first N_q - N_k queries see nothing (lse = -inf)."""
    q, k, v = _qkv(1, 2, 50, 20, 64, "bfloat16", seed=5)
    o, lse = th.forward(q, k, v, causal=True)
    dq, dk, dv = tb.backward(torch.randn_like(o), q, k, v, o, lse, causal=True)
    assert (lse[:, :, :30] == -math.inf).all()
    assert (dq[:, :, :30] == 0).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()


def test_softmax_scale_reaches_every_gradient():
    q, k, v = _qkv(1, 2, 33, 40, 64, "float16", seed=9)
    o, lse = th.forward(q, k, v, causal=True, softmax_scale=0.3)
    do = torch.randn_like(o)
    grads = tb.backward(do, q, k, v, o, lse, causal=True, softmax_scale=0.3)
    for g, g_ref in zip(grads, reference.backward(do, q, k, v, causal=True, softmax_scale=0.3)):
        assert_close(g, g_ref, dtype="float16", grad=True)


def test_config_table_covers_every_head_dim_and_mask():
    for d in th.HEAD_DIMS:
        for causal in (False, True):
            bm, bn, warps, stages = tb.CONFIGS[(d, causal)]
            assert bm % 16 == 0 and bn % 16 == 0 and warps in (4, 8) and stages >= 1


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(d=96), th.HopperUnsupported, "head dim must be one of"),
        (dict(dtype="float32"), th.HopperUnsupported, "dtype must be float16 or bfloat16"),
    ],
)
def test_unsupported_inputs_are_named(change, error, match):
    args = dict(d=64, dtype="float16") | change
    q, k, v = _qkv(1, 2, 20, 20, args["d"], args["dtype"])
    o = torch.zeros_like(q)
    lse = torch.zeros(q.shape[:-1])
    with pytest.raises(error, match=match):
        tb.backward(torch.ones_like(o), q, k, v, o, lse)


def test_bad_gradient_inputs_are_named():
    q, k, v = _qkv(1, 2, 20, 20)
    o, lse = th.forward(q, k, v)
    with pytest.raises(ValueError, match="do"):
        tb.backward(torch.ones(1, 2, 19, 64, dtype=q.dtype), q, k, v, o, lse)


# ---- the registry entry -------------------------------------------------------------------------
def test_registry_lists_the_hopper_entry_with_its_chapter():
    impl = flashedu.IMPLEMENTATIONS["hopper"]
    assert impl.module is hopper_dispatch and impl.chapter == "11" and "gqa" in impl.features


def test_takes_hopper_shapes_and_hands_the_rest_over():
    q, k, v = _qkv(1, 2, 20, 20, 64)
    assert hopper_dispatch.takes(q, k, v) is (DEVICE == "cpu" or th.supports(
        torch.cuda.get_device_capability(), q.dtype, 64))  # fmt: skip
    assert not hopper_dispatch.takes(*_qkv(1, 2, 20, 20, 48))
    assert not hopper_dispatch.takes(*_qkv(1, 2, 20, 20, 64, "float32"))
    assert not hopper_dispatch.takes(q, k, v[..., :32])
    assert not hopper_dispatch.takes(q.numpy() if DEVICE == "cpu" else None, k, v)


def test_dispatch_runs_a_hopper_forward_where_it_takes_the_inputs(monkeypatch):
    calls = []
    monkeypatch.setattr(
        th, "forward", lambda *a, **kw: calls.append("triton_hopper") or (a[0], a[0][..., 0])
    )
    monkeypatch.setattr(kernels, "backward", lambda *a, **kw: calls.append("fa2 bwd"))
    q, k, v = _qkv(1, 2, 20, 20, 64)
    hopper_dispatch.forward(q, k, v, causal=True)
    hopper_dispatch.backward(q, q, k, v, q, q[..., 0], causal=True)
    if DEVICE == "cpu":  # the interpreter runs the Triton Hopper kernel (Gluon cannot run there)
        assert calls == ["triton_hopper", "fa2 bwd"]


def test_dispatch_hands_other_head_dims_and_options_to_fa2():
    q, k, v = _qkv(1, 2, 24, 30, 40, H_kv=1, seed=2)  # d = 40: FA2 only
    o, lse = hopper_dispatch.forward(q, k, v, causal=True)
    do = torch.randn_like(o)
    grads = hopper_dispatch.backward(do, q, k, v, o, lse, causal=True)
    for g, g_ref in zip(grads, reference.backward(do, q, k, v, causal=True)):
        assert_close(g, g_ref, dtype="float16", grad=True)
    q, k, v = _qkv(1, 2, 24, 30, 64, seed=3)  # a window: an option only FA2 takes
    o, _ = hopper_dispatch.forward(q, k, v, window_size=(4, 0))
    o_ref, _ = reference.forward(q, k, v, window_size=(4, 0))
    assert_close(o, o_ref, dtype="float16")


def test_attention_with_impl_hopper_differentiates():
    q, k, v = (x.requires_grad_() for x in _qkv(1, 2, 33, 45, 64, "bfloat16", H_kv=1, seed=4))
    o = flashedu.attention(q, k, v, causal=True, impl="hopper")
    do = torch.randn_like(o)
    o.backward(do)
    for g, g_ref in zip((q.grad, k.grad, v.grad), reference.backward(do, q, k, v, causal=True)):
        assert_close(g, g_ref, dtype="bfloat16", grad=True)


def test_preferred_only_on_a_gpu_at_measured_head_dims():
    q, k, v = _qkv(1, 2, 20, 20, 64)
    if DEVICE == "cpu":
        assert not hopper_dispatch.preferred(q, k, v)  # the interpreter: never auto
    assert not hopper_dispatch.preferred(*_qkv(1, 2, 20, 20, 48))
    assert set(hopper_dispatch.MEASURED_FASTER) <= set(th.HEAD_DIMS)


def test_auto_picks_hopper_only_where_preferred_says_so(monkeypatch):
    q, k, v = _qkv(1, 2, 20, 20, 64)
    if DEVICE == "cpu":
        assert api._auto_impl(q, k, v) == "torch_tiled"  # CPU tensors never reach a kernel
        return
    monkeypatch.setattr(hopper_dispatch, "preferred", lambda *a: True)
    assert api._auto_impl(q, k, v) == "hopper"
    monkeypatch.setattr(hopper_dispatch, "preferred", lambda *a: False)
    assert api._auto_impl(q, k, v) == "triton"


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_backward_matches_reference_at_1k(dtype, d, causal):
    q, k, v = _qkv(1, 4, 1000, 1300, d, dtype, H_kv=2, seed=d)
    o, lse = th.forward(q, k, v, causal=causal)
    do = torch.randn_like(o)
    grads = tb.backward(do, q, k, v, o, lse, causal=causal)
    ref = reference.backward(do, q, k, v, causal=causal)
    fa2 = kernels.backward(do, q, k, v, o, lse, causal=causal)
    for g, g_ref, g_fa2 in zip(grads, ref, fa2):
        assert_close(g, g_ref, dtype=dtype, grad=True)
        assert_close(g_fa2, g_ref, dtype=dtype, grad=True)
