"""Naive attention against the float64 reference and PyTorch's SDPA; its traffic against the closed
form."""

import numpy as np
import pytest
import torch

from flashedu import naive, reference, tiled, traffic
from flashedu.testing import assert_close, max_error, tolerance

SHAPES = [
    (1, 1, 1, 1, 16),
    (2, 3, 17, 17, 16),
    (1, 2, 33, 65, 32),
    (1, 2, 65, 33, 32),
    (2, 1, 97, 5, 8),
]


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,H,N_q,N_k,d", SHAPES)
def test_forward_and_backward_match_reference(B, H, N_q, N_k, d, causal, dtype, make_qkv):
    q, k, v = make_qkv(B, H, N_q, N_k, d, dtype)
    do = np.random.default_rng(N_q).standard_normal(q.shape).astype(dtype)
    o, lse = naive.forward(q, k, v, causal=causal)
    o_ref, lse_ref = reference.forward(q, k, v, causal=causal)
    assert o.dtype == np.dtype(dtype) and lse.dtype == (
        np.float64 if dtype == "float64" else np.float32
    )
    assert_close(o, o_ref, dtype, name="o")
    assert_close(lse, lse_ref, dtype, name="lse")
    grads = naive.backward(do, q, k, v, o, lse, causal=causal)
    for name, g, g_ref in zip(
        ("dq", "dk", "dv"), grads, reference.backward(do, q, k, v, causal=causal)
    ):
        assert g.dtype == np.dtype(dtype)
        assert_close(g, g_ref, dtype, grad=True, name=name)


@pytest.mark.parametrize("causal", [False, True])
def test_matches_torch_sdpa(causal, make_qkv):
    q, k, v = make_qkv(2, 4, 33, 33, 16, "float32")
    o, _ = naive.forward(q, k, v, causal=causal)
    expected = torch.nn.functional.scaled_dot_product_attention(
        *map(torch.from_numpy, (q, k, v)), is_causal=causal
    )
    np.testing.assert_allclose(o, expected.numpy(), rtol=2e-5, atol=2e-6)


def test_stored_p_and_rebuilt_p_give_the_same_gradients(make_qkv):
    q, k, v = make_qkv(1, 2, 19, 23, 8, "float64")
    o, lse, p = naive.forward(q, k, v, causal=True, return_p=True)
    do = np.ones_like(o)
    for a, b in zip(
        naive.backward(do, q, k, v, o, lse, causal=True, p=p),
        naive.backward(do, q, k, v, o, lse, causal=True),
    ):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-14)


def test_gqa_and_window(make_qkv):
    q, k, v = make_qkv(2, 4, 13, 21, 8, "float64", H_kv=2)
    o, lse = naive.forward(q, k, v, window_size=(4, 2))
    o_ref, lse_ref = reference.forward(q, k, v, window_size=(4, 2))
    assert_close(o, o_ref, "float64")
    do = np.random.default_rng(0).standard_normal(q.shape)
    for g, g_ref in zip(
        naive.backward(do, q, k, v, o, lse, window_size=(4, 2)),
        reference.backward(do, q, k, v, window_size=(4, 2)),
    ):
        assert_close(g, g_ref, "float64", grad=True)


def _with_largest_score(q, k, target):
    """q, k rescaled (in float64, then back to their dtype) so that max |q . k| is about target."""
    s = np.abs(q.astype(np.float64) @ np.swapaxes(k, -1, -2).astype(np.float64)).max()
    c = np.sqrt(target / s)
    return (q * c).astype(q.dtype), (k * c).astype(k.dtype)


@pytest.mark.parametrize("dtype,largest", [("float32", 1e4), ("float16", 3e4)])
def test_fully_masked_rows_and_huge_logits_never_nan(dtype, largest, make_qkv):
    """Scores near 1e4 in float32, and near 3e4 in float16 (half its largest value, 65504)."""
    q, k, v = make_qkv(1, 2, 9, 4, 8, dtype)
    q, k = _with_largest_score(q, k, largest)
    o, lse = naive.forward(q, k, v, causal=True, softmax_scale=1.0)
    assert np.isfinite(o).all() and not np.isnan(lse).any()
    assert np.all(o[:, :, :5] == 0) and np.all(lse[:, :, :5] == -np.inf)
    grads = naive.backward(np.ones_like(o), q, k, v, o, lse, causal=True, softmax_scale=1.0)
    assert all(np.isfinite(g).all() for g in grads)
    assert np.all(grads[0][:, :, :5] == 0)


def test_float16_scores_beyond_its_range_raise_by_name_not_nan():
    """q = k = 66, d = 16, scale 1: every score is 16 * 66^2 = 69696 > 65504. Stored in float16,
    S would be inf and the output NaN; naive says so instead. float32 storage, and FlashAttention's
    float32 tile (tiled) in float16, give the exact answer."""
    q = np.full((1, 1, 4, 16), 66.0, dtype=np.float16)
    v = np.random.default_rng(0).standard_normal((1, 1, 4, 16)).astype(np.float16)
    with pytest.raises(naive.Float16OverflowError, match="S reaches 6.97e\\+04, beyond float16"):
        naive.forward(q, q, v, softmax_scale=1.0)
    o_ref, _ = reference.forward(q, q, v, softmax_scale=1.0)
    o32, _ = naive.forward(q.astype(np.float32), q.astype(np.float32), v.astype(np.float32),
                           softmax_scale=1.0)  # fmt: skip
    assert_close(o32, o_ref, "float32")
    o_tiled, _ = tiled.forward(q, q, v, softmax_scale=1.0)
    assert_close(o_tiled, o_ref, "float16")


def test_float16_dp_beyond_its_range_raises_in_backward(make_qkv):
    q, k, v = make_qkv(1, 1, 5, 5, 16, "float16")
    v = np.full_like(v, 300.0)
    o, lse = naive.forward(q, k, v)
    with pytest.raises(naive.Float16OverflowError, match="dP reaches 1.44e\\+06"):
        naive.backward(np.full_like(o, 300.0), q, k, v, o, lse)


def test_float16_error_at_logits_near_1e3_is_the_rounding_of_stored_s(make_qkv):
    """The lesson of storing S in float16: near 1e3 its spacing is 0.5, so naive's output errs far
    beyond float16's tolerance, by exactly what rounding S costs; tiled keeps S in float32."""
    q, k, v = make_qkv(1, 2, 64, 64, 16, "float16")
    q, k = _with_largest_score(q, k, 1e3)
    o_ref, _ = reference.forward(q, k, v, softmax_scale=1.0)
    o, _ = naive.forward(q, k, v, softmax_scale=1.0)
    s16 = (q.astype(np.float32) @ np.swapaxes(k, -1, -2).astype(np.float32)).astype(np.float16)
    p = np.exp(s16 - s16.max(-1, keepdims=True)).astype(np.float64)  # softmax of the stored S
    o_stored = (p / p.sum(-1, keepdims=True)) @ v.astype(np.float64)
    assert max_error(o, o_ref)[0] > 2 * tolerance("float16").atol
    assert_close(o, o_stored, "float16")  # the stored S explains the error
    assert_close(tiled.forward(q, k, v, softmax_scale=1.0)[0], o_ref, "float16")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,H,N_q,N_k,d", [(2, 3, 17, 33, 16), (1, 4, 65, 7, 8)])
def test_traffic_model_matches_instrumented_count(B, H, N_q, N_k, d, causal, make_qkv):
    q, k, v = make_qkv(B, H, N_q, N_k, d, "float32")
    fwd = traffic.Ledger()
    o, lse = naive.forward(q, k, v, causal=causal, ledger=fwd)
    assert fwd.traffic() == traffic.naive_forward(B, H, N_q, N_k, d, itemsize=4)
    bwd = traffic.Ledger()
    naive.backward(np.ones_like(o), q, k, v, o, lse, causal=causal, ledger=bwd)
    assert bwd.traffic() == traffic.naive_backward(B, H, N_q, N_k, d, itemsize=4)


def test_naive_traffic_grows_quadratically():
    t1 = traffic.naive_forward(1, 1, 1024, 1024, 64).total_bytes
    t2 = traffic.naive_forward(1, 1, 2048, 2048, 64).total_bytes
    assert 3.5 < t2 / t1 < 4.0  # N^2 dominates, the N d terms keep it just under 4
