"""Naive attention against the float64 reference and PyTorch's SDPA; its traffic against the closed
form."""

import numpy as np
import pytest
import torch

from flashedu import naive, reference, traffic
from flashedu.testing import assert_close

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


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_fully_masked_rows_and_huge_logits_never_nan(dtype, make_qkv):
    q, k, v = make_qkv(
        1, 2, 9, 4, 8, dtype, scale=40.0 if dtype == "float32" else 8.0
    )  # logits up to ~1e4 / ~1e2
    o, lse = naive.forward(q, k, v, causal=True, softmax_scale=1.0)
    assert np.isfinite(o).all() and not np.isnan(lse).any()
    assert np.all(o[:, :, :5] == 0) and np.all(lse[:, :, :5] == -np.inf)
    grads = naive.backward(np.ones_like(o), q, k, v, o, lse, causal=True, softmax_scale=1.0)
    assert all(np.isfinite(g).all() for g in grads)
    assert np.all(grads[0][:, :, :5] == 0)


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
