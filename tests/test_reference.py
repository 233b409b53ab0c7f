"""The float64 oracle against independent formulations: torch's float64 SDPA and finite
differences."""

import numpy as np
import pytest
import torch

from flashedu import masks, reference

SHAPES = [
    (1, 1, 1, 1, 16),
    (2, 3, 17, 17, 16),
    (1, 2, 33, 65, 32),
    (1, 2, 65, 33, 8),
]  # (B, H, N_q, N_k, d)


def _sdpa64(q, k, v, *, causal, scale=None):
    t = [torch.from_numpy(x) for x in (q, k, v)]
    mask = torch.from_numpy(masks.visible(q.shape[2], k.shape[2], causal=causal))
    return torch.nn.functional.scaled_dot_product_attention(*t, attn_mask=mask, scale=scale).numpy()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,H,N_q,N_k,d", SHAPES)
def test_forward_matches_torch_float64(B, H, N_q, N_k, d, causal, make_qkv):
    q, k, v = make_qkv(B, H, N_q, N_k, d, "float64")
    o, lse = reference.forward(q, k, v, causal=causal)
    keep_any = masks.visible(N_q, N_k, causal=causal).any(axis=1)
    expected = _sdpa64(q, k, v, causal=causal)
    np.testing.assert_allclose(
        o[..., keep_any, :], expected[..., keep_any, :], rtol=1e-12, atol=1e-12
    )
    assert lse.dtype == np.float64 and lse.shape == (B, H, N_q)


def test_lse_is_logsumexp_of_scaled_scores(make_qkv):
    q, k, v = make_qkv(2, 2, 9, 13, 8, "float64")
    _, lse = reference.forward(q, k, v, softmax_scale=0.3)
    s = np.einsum("bhid,bhjd->bhij", q, k) * 0.3
    np.testing.assert_allclose(lse, np.log(np.exp(s).sum(-1)), rtol=1e-13)


def test_fully_masked_rows_give_zero_output_and_minus_inf_lse(make_qkv):
    q, k, v = make_qkv(1, 2, 6, 3, 8, "float64")  # causal, N_q > N_k: the first 3 rows see nothing
    o, lse = reference.forward(q, k, v, causal=True)
    assert np.all(o[:, :, :3] == 0) and np.all(lse[:, :, :3] == -np.inf)
    assert np.isfinite(o).all() and np.isfinite(lse[:, :, 3:]).all()
    dq, dk, dv = reference.backward(np.ones_like(o), q, k, v, o, lse, causal=True)
    assert np.all(dq[:, :, :3] == 0) and all(np.isfinite(g).all() for g in (dq, dk, dv))


def test_huge_logits_stay_finite(make_qkv):
    q, k, v = make_qkv(1, 1, 8, 8, 4, "float64", scale=100.0)  # scores around +-1e4
    o, lse = reference.forward(q, k, v, softmax_scale=1.0)
    assert np.isfinite(o).all() and np.isfinite(lse).all()


@pytest.mark.parametrize("causal", [False, True])
def test_backward_matches_torch_autograd(causal, make_qkv):
    q, k, v = make_qkv(2, 4, 11, 7, 8, "float64", H_kv=2)
    do = np.random.default_rng(1).standard_normal(q.shape)
    o, lse = reference.forward(q, k, v, causal=causal)
    got = reference.backward(do, q, k, v, o, lse, causal=causal)
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    ke, ve = (t.repeat_interleave(2, dim=1) for t in (tk, tv))
    mask = torch.from_numpy(masks.visible(11, 7, causal=causal))
    s = (tq @ ke.transpose(-1, -2)) / np.sqrt(8)
    p = torch.softmax(s.masked_fill(~mask, -torch.inf), dim=-1).nan_to_num(0.0)
    (p @ ve).backward(torch.from_numpy(do))
    for g, t in zip(got, (tq, tk, tv)):
        np.testing.assert_allclose(g, t.grad.numpy(), rtol=1e-11, atol=1e-12)


def test_gqa_equals_repeated_heads(make_qkv):
    q, k, v = make_qkv(1, 6, 5, 9, 4, "float64", H_kv=3)
    o, lse = reference.forward(q, k, v)
    o2, lse2 = reference.forward(q, np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1))
    np.testing.assert_array_equal(o, o2)


def test_window_and_alibi_match_explicit_bias(make_qkv):
    q, k, v = make_qkv(1, 2, 7, 12, 4, "float64")
    slopes = masks.alibi_slopes(2)
    o, _ = reference.forward(q, k, v, window_size=(3, 1), alibi_slopes=slopes)
    s = np.einsum("bhid,bhjd->bhij", q, k) / 2 + masks.alibi_bias(slopes, 7, 12)[None]
    s = np.where(masks.visible(7, 12, window_size=(3, 1)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    np.testing.assert_allclose(o, (p / p.sum(-1, keepdims=True)) @ v, rtol=1e-12, atol=1e-13)


def test_causal_is_bottom_right_aligned():
    keep = masks.visible(2, 4, causal=True)
    assert keep.tolist() == [[True, True, True, False], [True, True, True, True]]
    assert np.array_equal(masks.visible(3, 3, causal=True), np.tril(np.ones((3, 3), bool)))
