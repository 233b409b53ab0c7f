"""flashedu.softmax: safe and online softmax, and the exact merge of partial (m, l, o) states."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashedu import reference, softmax
from flashedu.testing import assert_close


def _softmax64(x):
    """Softmax by the textbook formula in float64 (no max subtraction): the value to compare
    with."""
    e = np.exp(np.asarray(x, dtype=np.float64))
    return e / e.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (5, 130), (2, 3, 7)])
def test_safe_softmax_matches_formula(shape, rng):
    x = rng.standard_normal(shape)
    assert_close(softmax.safe_softmax(x), _softmax64(x), np.float64)


def test_safe_softmax_is_shift_invariant_and_survives_huge_logits(rng):
    x = rng.standard_normal((4, 9))
    big = x + 1e4
    with np.errstate(over="ignore", invalid="ignore"):
        assert not np.isfinite(_softmax64(big)).all()  # the textbook formula overflows
    assert_close(softmax.safe_softmax(big), _softmax64(x), np.float64)
    assert_close(
        softmax.safe_softmax((x * 1e4).astype(np.float32)),
        softmax.safe_softmax(x * 1e4),
        np.float32,
    )


def test_safe_softmax_along_other_axis(rng):
    x = rng.standard_normal((6, 5))
    assert_close(softmax.safe_softmax(x, axis=0), softmax.safe_softmax(x.T).T, np.float64)


def test_fully_masked_row_is_zero_not_nan():
    x = np.array([[-np.inf, -np.inf, -np.inf], [0.0, -np.inf, 1.0]])
    for y in (softmax.safe_softmax(x), softmax.online_softmax(x)):
        assert not np.isnan(y).any()
        np.testing.assert_array_equal(y[0], 0.0)
        assert_close(y[1], _softmax64([0.0, -np.inf, 1.0]), np.float64)


@pytest.mark.parametrize("block", [1, 2, 5, 64])
@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (5, 130)])
def test_online_softmax_matches_safe(shape, block, rng):
    x = rng.standard_normal(shape) * 5
    assert_close(softmax.online_softmax(x, block=block), softmax.safe_softmax(x), np.float64)
    m, l = softmax.online_stats(x, block=block)
    assert_close(m, x.max(axis=1), np.float64)
    assert_close(l, np.exp(x - x.max(axis=1, keepdims=True)).sum(axis=1), np.float64)


def test_online_softmax_handles_rising_max_and_very_negative_rows(rng):
    rising = np.arange(20, dtype=np.float64)[None] * 50.0  # the max moves at every column
    negative = np.full((1, 6), -1e4)  # m initialised to 0 would underflow l to 0
    for x in (rising, negative, np.vstack([rng.standard_normal(6) * 1e4, negative[0]])):
        y = softmax.online_softmax(x.astype(np.float32))
        assert np.isfinite(y).all()
        assert_close(y, softmax.safe_softmax(x), np.float32)


def test_online_step_rescales_by_the_max_change():
    m, l = np.array([1.0]), np.array([2.0])
    m_new, l_new, p, alpha = softmax.online_step(m, l, np.array([[3.0, 0.0]]))
    assert m_new[0] == 3.0
    assert alpha[0] == pytest.approx(np.exp(-2.0))
    assert l_new[0] == pytest.approx(2.0 * np.exp(-2.0) + 1.0 + np.exp(-3.0))
    assert_close(p, np.exp(np.array([[0.0, -3.0]])), np.float64)


def test_online_stats_rejects_bad_input():
    with pytest.raises(ValueError, match="2-D"):
        softmax.online_stats(np.zeros(3))
    with pytest.raises(ValueError, match="block"):
        softmax.online_stats(np.zeros((2, 3)), block=0)


# ----------------------------------------------------------------------------------- merging states


def _split_states(s, v, cuts):
    """Partial states of s (R, N) against v (N, d) over the key ranges between consecutive cuts."""
    edges = [0, *cuts, s.shape[1]]
    return [softmax.state(s[:, a:b], v[a:b]) for a, b in zip(edges[:-1], edges[1:])]


def _fold(states, order):
    out = states[order[0]]
    for i in order[1:]:
        out = softmax.merge(out, states[i])
    return out


@st.composite
def _problem(draw):
    rows = draw(st.integers(1, 4))
    n = draw(st.integers(2, 24))
    d = draw(st.integers(1, 4))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), min_size=1, max_size=min(4, n - 1))))
    seed = draw(st.integers(0, 2**32 - 1))
    scale = draw(st.sampled_from([1.0, 30.0, 1e4]))
    masked = draw(st.booleans())
    order = draw(st.permutations(range(len(cuts) + 1)))
    return rows, n, d, cuts, seed, scale, masked, order


def _make(rows, n, d, seed, scale, masked):
    g = np.random.default_rng(seed)
    s = g.standard_normal((rows, n)) * scale
    if masked:  # a fully masked first row and random holes elsewhere
        s[0] = -np.inf
        s[g.random((rows, n)) < 0.3] = -np.inf
    return s, g.standard_normal((n, d))


def _expected(s, v):
    """(o, lse) of scores s (R, N) against v (N, d) from the float64 reference: s = q @ I, -inf by
    the mask."""
    keep = np.isfinite(s)
    q, k = np.where(keep, s, 0.0)[None, None], np.eye(s.shape[1])[None, None]
    p, lse = reference.probabilities(q, k, softmax_scale=1.0, attn_mask=keep[None, None])
    return p[0, 0] @ v, lse[0, 0]


@settings(max_examples=40, deadline=None)
@given(_problem())
def test_merge_in_any_order_equals_full_softmax(problem):
    rows, n, d, cuts, seed, scale, masked, order = problem
    s, v = _make(rows, n, d, seed, scale, masked)
    o, lse = softmax.finalize(*_fold(_split_states(s, v, cuts), order))
    o_ref, lse_ref = _expected(s, v)
    assert_close(o, o_ref, np.float64, name="o")
    assert_close(lse, lse_ref, np.float64, name="lse")


@settings(max_examples=40, deadline=None)
@given(_problem())
def test_merge_is_associative_and_commutative(problem):
    rows, n, d, cuts, seed, scale, masked, _ = problem
    s, v = _make(rows, n, d, seed, scale, masked)
    a, b, c = _split_states(s, v, [cuts[0], cuts[0]] if len(cuts) == 1 else cuts[:2])
    left = softmax.merge(softmax.merge(a, b), c)
    right = softmax.merge(a, softmax.merge(b, c))
    swapped = softmax.merge(c, softmax.merge(b, a))
    for x, y in ((left, right), (left, swapped)):
        for name, p, q in zip("mlo", x, y):
            assert_close(p, q, np.float64, name=name)


def test_merging_fully_masked_states_gives_no_nan():
    empty = (np.array([-np.inf]), np.array([0.0]), np.zeros((1, 3)))
    full = softmax.state(np.array([[0.5, -1.0]]), np.arange(6.0).reshape(2, 3))
    both = softmax.merge(empty, empty)
    assert np.isneginf(both[0]).all() and (both[1] == 0).all() and (both[2] == 0).all()
    o, lse = softmax.finalize(*both)
    assert (o == 0).all() and np.isneginf(lse).all()
    for merged in (softmax.merge(empty, full), softmax.merge(full, empty)):
        for p, q in zip(merged, full):
            np.testing.assert_array_equal(p, q)


def test_from_output_round_trips_and_merges_shards(rng):
    s, v = rng.standard_normal((3, 10)) * 3, rng.standard_normal((10, 2))
    s[1] = -np.inf
    o, lse = _expected(s, v)
    back = softmax.finalize(*softmax.from_output(o, lse))
    assert_close(back[0], o, np.float64)
    assert_close(back[1], lse, np.float64)
    shards = [softmax.from_output(*_expected(s[:, a:b], v[a:b])) for a, b in ((0, 4), (4, 10))]
    merged = softmax.finalize(*softmax.merge(*shards))
    assert_close(merged[0], o, np.float64)
    assert_close(merged[1], lse, np.float64)
