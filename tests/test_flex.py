"""flashedu.flex: each mod, run through torch's FlexAttention (eager, CPU) and through the
explicit float64 oracle, equals flashedu.reference fed the explicit mask or bias; converters and
block maps."""

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import and_masks, create_block_mask, or_masks

from flashedu import decoding, flex, masks, reference
from flashedu.testing import Tolerance, assert_close, max_error

F64 = Tolerance(1e-12, 1e-12)
SHAPES = [
    (1, 2, 1, 1, 8),
    (2, 4, 23, 23, 8),
    (1, 2, 17, 40, 16),
    (1, 2, 40, 17, 16),
]  # B H N_q N_k d


def _qkv(rng, B, H, N_q, N_k, d, H_kv=None, scale=1.0):
    H_kv = H if H_kv is None else H_kv
    shapes = ((B, H, N_q, d), (B, H_kv, N_k, d), (B, H_kv, N_k, d))
    return tuple(torch.from_numpy(rng.standard_normal(s) * scale) for s in shapes)


def _both(q, k, v, **mods):
    """(o, lse) from FlexAttention (eager, float64) and from the explicit oracle."""
    flex_out = flex.flex_forward(q, k, v, block_size=16, **mods)
    return flex_out, flex.explicit_forward(q, k, v, **mods)


def _assert_all_close(pairs, expected):
    o_ref, lse_ref = expected
    for o, lse in pairs:
        assert_close(o, o_ref, tol=F64, name="o")
        assert_close(lse, lse_ref, tol=F64, name="lse")


@pytest.mark.parametrize("B,H,N_q,N_k,d", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_alibi_mod_matches_reference_alibi(B, H, N_q, N_k, d, causal, rng):
    q, k, v = _qkv(rng, B, H, N_q, N_k, d)
    slopes = masks.alibi_slopes(H)
    mods = dict(score_mod=flex.alibi(slopes, offset=N_k - N_q))
    if causal:
        mods["mask_mod"] = flex.causal(offset=N_k - N_q)
    expected = reference.forward(q, k, v, causal=causal, alibi_slopes=slopes)
    _assert_all_close(_both(q, k, v, **mods), expected)


def test_alibi_bias_array_is_masks_alibi_bias():
    slopes = masks.alibi_slopes(4)
    bias = flex.bias_array(flex.alibi(slopes, offset=7), 1, 4, 9, 16)
    np.testing.assert_array_equal(bias[0], masks.alibi_bias(slopes, 9, 16))


@pytest.mark.parametrize("B,H,N_q,N_k,d", SHAPES)
@pytest.mark.parametrize(
    "make,kw",
    [
        (lambda N_q, N_k: flex.causal(offset=N_k - N_q), dict(causal=True)),
        (lambda N_q, N_k: flex.sliding_window(5, offset=N_k - N_q), dict(window_size=(5, 0))),
        (lambda N_q, N_k: flex.sliding_window(0, offset=N_k - N_q), dict(window_size=(0, 0))),
    ],
    ids=["causal", "window5", "window0"],
)
def test_position_masks_match_reference_masks(B, H, N_q, N_k, d, make, kw, rng):
    q, k, v = _qkv(rng, B, H, N_q, N_k, d)
    mask_mod = make(N_q, N_k)
    explicit = flex.mask_array(mask_mod, B, H, N_q, N_k)
    np.testing.assert_array_equal(explicit[0, 0], masks.visible(N_q, N_k, **kw))
    _assert_all_close(_both(q, k, v, mask_mod=mask_mod), reference.forward(q, k, v, **kw))


@pytest.mark.parametrize("N,prefix", [(1, 0), (30, 0), (30, 7), (30, 30), (33, 40)])
def test_prefix_lm_sees_the_prefix_both_ways_and_the_rest_causally(N, prefix, rng):
    q, k, v = _qkv(rng, 1, 2, N, N, 8)
    i, j = np.arange(N)[:, None], np.arange(N)[None, :]
    explicit = (j <= i) | (j < prefix)
    np.testing.assert_array_equal(
        flex.mask_array(flex.prefix_lm(prefix), 1, 1, N, N)[0, 0], explicit
    )
    expected = reference.forward(q, k, v, attn_mask=explicit)
    _assert_all_close(_both(q, k, v, mask_mod=flex.prefix_lm(prefix)), expected)


def _document_reference(q, k, v, cu_q, cu_k, causal):
    """Per-document reference outputs along the sequence (zeros for documents without keys)."""
    o = np.zeros(q.shape)
    for q0, q1, k0, k1 in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]):
        if q1 > q0 and k1 > k0:
            sl = (slice(None), slice(None))
            o[..., q0:q1, :] = reference.forward(
                q[sl + (slice(q0, q1),)],
                k[sl + (slice(k0, k1),)],
                v[sl + (slice(k0, k1),)],
                causal=causal,
            )[0]
    return o


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "lens_q,lens_k", [([1, 17, 64, 3], None), ([5, 0, 9, 12], [8, 4, 3, 12]), ([7], None)]
)
def test_document_mask_is_attention_per_sequence(lens_q, lens_k, causal, rng):
    lens_k = lens_q if lens_k is None else lens_k
    cu_q, cu_k = np.cumsum([0, *lens_q]).tolist(), np.cumsum([0, *lens_k]).tolist()
    q, k, v = _qkv(rng, 1, 2, cu_q[-1], cu_k[-1], 8)
    mask_mod = flex.document(torch.tensor(cu_q), torch.tensor(cu_k), causal=causal)
    o, lse = flex.explicit_forward(q, k, v, mask_mod=mask_mod)
    assert_close(o, _document_reference(q, k, v, cu_q, cu_k, causal), tol=F64)
    o_flex, lse_flex = flex.flex_forward(q, k, v, mask_mod=mask_mod, block_size=16)
    assert_close(o_flex, o, tol=F64)
    assert_close(lse_flex, lse, tol=F64)


def test_document_ids_follow_cu_seqlens_with_empty_documents():
    ids = flex.document_ids(torch.tensor([0, 2, 2, 5], dtype=torch.int32))
    assert ids.tolist() == [0, 0, 2, 2, 2]


@pytest.mark.parametrize("cap", [5.0, 50.0])
def test_softcap_bounds_the_scores_and_matches_the_formula(cap, rng):
    q, k, v = _qkv(rng, 1, 2, 19, 19, 8, scale=4.0)  # scores of tens: the cap bites at 5
    s = flex.dense_scores(q, k)
    capped = flex.dense_scores(q, k, score_mod=flex.softcap(cap))
    np.testing.assert_allclose(capped, cap * np.tanh(s / cap), rtol=1e-14, atol=1e-14)
    assert np.abs(capped).max() < cap
    flex_out, explicit = _both(q, k, v, score_mod=flex.softcap(cap))
    _assert_all_close([flex_out], explicit)


def test_relative_bias_indexes_the_table_by_clipped_offset(rng):
    H, N, D = 2, 12, 3
    table = torch.from_numpy(rng.standard_normal((H, 2 * D + 1)))
    bias = flex.bias_array(flex.relative_bias(table, max_distance=D), 1, H, N, N)[0]
    rel = np.clip(np.arange(N)[None, :] - np.arange(N)[:, None], -D, D) + D  # (N, N)
    np.testing.assert_array_equal(bias, table.numpy()[:, rel])
    q, k, v = _qkv(rng, 1, H, N, N, 8)
    flex_out, explicit = _both(q, k, v, score_mod=flex.relative_bias(table, max_distance=D))
    _assert_all_close([flex_out], explicit)


def test_combined_masks_and_gqa(rng):
    N, H, H_kv = 40, 4, 2
    q, k, v = _qkv(rng, 1, H, N, N, 8, H_kv=H_kv)
    sink = lambda b, h, q_idx, kv_idx: kv_idx < 3
    mod = or_masks(and_masks(flex.causal(), flex.sliding_window(6)), sink)
    explicit = masks.visible(N, N, window_size=(6, 0)) | (np.arange(N)[None, :] < 3)
    expected = reference.forward(q, k, v, attn_mask=explicit)
    _assert_all_close(_both(q, k, v, mask_mod=mod), expected)


def test_fully_masked_rows_give_zero_and_minus_inf(rng):
    q, k, v = _qkv(rng, 1, 2, 20, 20, 8)
    mod = lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) & (q_idx >= 5)
    for o, lse in _both(q, k, v, mask_mod=mod):
        assert np.all(np.asarray(o)[:, :, :5] == 0) and np.all(
            np.isneginf(np.asarray(lse)[:, :, :5])
        )
        assert np.isfinite(np.asarray(o)).all()


def test_explicit_forward_without_mods_is_the_reference(rng):
    q, k, v = _qkv(rng, 2, 3, 11, 29, 16)
    _assert_all_close(
        [flex.explicit_forward(q, k, v, softmax_scale=0.3)],
        reference.forward(q, k, v, softmax_scale=0.3),
    )


def _agree_but_on_ragged_edges(flex_map, ours, N_q, N_k, block):
    """Skipped tiles agree everywhere; full/partial differ only on a ragged last row or column."""
    assert flex_map.shape == ours.shape
    np.testing.assert_array_equal(flex_map == "skip", ours == "skip")
    differ = np.argwhere(flex_map != ours)
    for i, j in differ:
        ragged_row = N_q % block and i == flex_map.shape[0] - 1
        ragged_col = N_k % block and j == flex_map.shape[1] - 1
        assert (ragged_row or ragged_col) and (flex_map[i, j], ours[i, j]) == ("partial", "full")


@pytest.mark.parametrize("N_q,N_k", [(64, 64), (50, 50), (40, 70), (70, 40), (128, 96)])
@pytest.mark.parametrize("window", [None, 0, 20, 33])
def test_block_mask_map_agrees_with_flashedu_block_kind(N_q, N_k, window):
    block, offset = 16, N_k - N_q
    mod = (
        flex.causal(offset=offset) if window is None else flex.sliding_window(window, offset=offset)
    )
    bm = create_block_mask(mod, 1, 1, N_q, N_k, device="cpu", BLOCK_SIZE=block)
    kw = dict(causal=True) if window is None else dict(window_size=(window, 0))
    ours = decoding.block_map(N_q, N_k, block, block, **kw)
    _agree_but_on_ragged_edges(flex.block_map(bm), ours, N_q, N_k, block)
    if N_q % block == 0 and N_k % block == 0:
        np.testing.assert_array_equal(flex.block_map(bm), ours)


def test_converters_name_their_errors():
    with pytest.raises(TypeError, match="must return booleans"):
        flex.mask_array(lambda b, h, q_idx, kv_idx: q_idx - kv_idx, 1, 1, 4, 4)
    with pytest.raises(ValueError, match="cap must be a positive number"):
        flex.softcap(0.0)
    with pytest.raises(ValueError, match=r"table must have shape \(H, 2 \* max_distance \+ 1\)"):
        flex.relative_bias(torch.zeros(2, 5), max_distance=3)
    q = torch.zeros(1, 1, 4, 8)
    with pytest.raises(ValueError, match="mask_mod or block_mask, not both"):
        flex.flex_forward(q, q, q, mask_mod=flex.causal(), block_mask=object())


def test_flex_forward_silences_the_eager_warning(recwarn, rng):
    q, k, v = _qkv(rng, 1, 1, 8, 8, 8)
    flex.flex_forward(q, k, v)
    assert not [w for w in recwarn if flex.EAGER_WARNING in str(w.message)]
    assert max_error(flex.flex_forward(q, k, v)[0], reference.forward(q, k, v)[0])[0] < 1e-12


def test_compiled_flex_forward_equals_eager(rng):
    q, k, v = (x.float() for x in _qkv(rng, 1, 2, 64, 64, 16))
    o_eager, lse_eager = flex.flex_forward(q, k, v, mask_mod=flex.sliding_window(9), block_size=32)
    o, lse = flex.flex_forward(
        q, k, v, mask_mod=flex.sliding_window(9), block_size=32, compiled=True
    )
    assert flex.compiled_flex_attention() is flex.compiled_flex_attention()  # compiled once
    assert_close(o, o_eager, dtype="float32")
    assert lse is None  # torch's compiled CPU kernel returns no lse


def test_draw_block_map_titles_the_tiles_computed():
    from matplotlib.figure import Figure

    kinds = decoding.block_map(64, 64, 16, 16, causal=True)
    ax = Figure().subplots()
    flex.draw_block_map(ax, kinds, 64, 64, 16, 16, "causal")
    assert ax.get_title() == "causal\n10 of 16 tiles computed"
