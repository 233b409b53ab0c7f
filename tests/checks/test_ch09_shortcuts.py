"""Chapter 09 graders against solutions that give the right numbers by the wrong method.

Each shortcut is what a learner in a hurry writes: a table of visible (query, key) pairs instead of
the block's corners (9.1), a combine that recomputes attention from keys kept aside instead of
merging the splits' (m, l, o) states (9.2). Each is rejected with a diagnosis that names it; honest
solutions written other ways (per-row bounds, a pairwise merge, a log-sum-exp merge, another
order) are accepted.
"""

from functools import reduce

import numpy as np
import pytest
import torch

from flashedu import checks
from flashedu.testing import run_grader

SEEDS = [0, 1, 2]

# ------------------------------------------------------------------------------------ 9.1 blocks


def _bounds(rows, cols, N_q, N_k, causal, window_size):
    left, right = window_size if window_size is not None else (-1, -1)
    if causal:
        right = 0
    return rows, cols, N_k - N_q, left, right


def corners(rows, cols, N_q, N_k, causal=False, window_size=None):
    """Honest: the block's corners against the diagonal band."""
    (r0, r1), (c0, c1), off, left, right = _bounds(rows, cols, N_q, N_k, causal, window_size)
    lo, hi = c0 - (r1 - 1 + off), (c1 - 1) - (r0 + off)  # smallest and largest j - diag
    if (left >= 0 and hi < -left) or (right >= 0 and lo > right):
        return "skip"
    if (left < 0 or lo >= -left) and (right < 0 or hi <= right):
        return "full"
    return "partial"


def per_row(rows, cols, N_q, N_k, causal=False, window_size=None):
    """Honest, another way: each row's first and last visible key (vectors as long as the block
    has rows), then how many of the block's keys each row sees."""
    (r0, r1), (c0, c1), off, left, right = _bounds(rows, cols, N_q, N_k, causal, window_size)
    diag = np.arange(r0, r1) + off
    first = np.maximum(c0, diag - left if left >= 0 else c0)
    last = np.minimum(c1 - 1, diag + right if right >= 0 else c1 - 1)
    seen = np.clip(last - first + 1, 0, None)
    if seen.sum() == 0:
        return "skip"
    return "full" if (seen == c1 - c0).all() else "partial"


def per_row_loop(rows, cols, N_q, N_k, causal=False, window_size=None):
    """Honest, in plain Python: one pass over the block's rows, each row's visible key range."""
    (r0, r1), (c0, c1), off, left, right = _bounds(rows, cols, N_q, N_k, causal, window_size)
    seen_any, seen_all = False, True
    for i in range(r0, r1):
        lo = max(c0, i + off - left) if left >= 0 else c0
        hi = min(c1 - 1, i + off + right) if right >= 0 else c1 - 1
        seen_any |= hi >= lo
        seen_all &= lo == c0 and hi == c1 - 1
    return "full" if seen_all else "partial" if seen_any else "skip"


def _visible(i, j, N_q, N_k, causal, window_size):
    left, right = window_size if window_size is not None else (-1, -1)
    right = 0 if causal else right
    rel = j - (i + N_k - N_q)
    ok = np.ones(np.broadcast_shapes(np.shape(i), np.shape(j)), bool)
    if left >= 0:
        ok &= rel >= -left
    if right >= 0:
        ok &= rel <= right
    return ok


def _kind(keep):
    return "skip" if not keep.any() else "full" if keep.all() else "partial"


def dense_numpy(rows, cols, N_q, N_k, causal=False, window_size=None):
    """Shortcut: the whole N_q x N_k visibility table in NumPy, then the block's slice."""
    i, j = np.arange(N_q)[:, None], np.arange(N_k)[None, :]
    table = _visible(i, j, N_q, N_k, causal, window_size)
    return _kind(table[rows[0] : rows[1], cols[0] : cols[1]])


def dense_torch(rows, cols, N_q, N_k, causal=False, window_size=None):
    """Shortcut: the same table in torch (tril-style), then the block's slice."""
    i, j = torch.arange(N_q)[:, None], torch.arange(N_k)[None, :]
    rel = j - (i + N_k - N_q)
    left, right = window_size if window_size is not None else (-1, -1)
    right = 0 if causal else right
    table = torch.ones(N_q, N_k, dtype=torch.bool)
    if left >= 0:
        table &= rel >= -left
    if right >= 0:
        table &= rel <= right
    block = table[rows[0] : rows[1], cols[0] : cols[1]]
    return "skip" if not block.any() else "full" if block.all() else "partial"


def block_mask(rows, cols, N_q, N_k, causal=False, window_size=None):
    """Shortcut: the block's own rows x keys mask, then any/all."""
    i, j = np.arange(*rows)[:, None], np.arange(*cols)[None, :]
    return _kind(_visible(i, j, N_q, N_k, causal, window_size))


def every_pair(rows, cols, N_q, N_k, causal=False, window_size=None):
    """Shortcut: visit every (query, key) pair of the block in Python."""
    seen = []
    for i in range(*rows):
        for j in range(*cols):
            seen.append(bool(_visible(i, j, N_q, N_k, causal, window_size)))
    return _kind(np.array(seen))


def pairs_in_lists(rows, cols, N_q, N_k, causal=False, window_size=None):
    """Shortcut: the block's table as a list of lists, built by comprehensions."""
    table = [[bool(_visible(i, j, N_q, N_k, causal, window_size)) for j in range(*cols)]
             for i in range(*rows)]  # fmt: skip
    return _kind(np.array(table))


@pytest.mark.parametrize("solution", [corners, per_row, per_row_loop])
def test_block_kind_accepts_honest_classifiers(solution):
    for seed in SEEDS:
        report, text = run_grader(checks.block_kind, solution, seed)
        assert report.passed, text


@pytest.mark.parametrize("shortcut", [dense_numpy, dense_torch, block_mask])
def test_block_kind_rejects_a_table_of_visible_pairs(shortcut):
    report, text = run_grader(checks.block_kind, shortcut, seed=0)
    assert not report.passed
    assert "to classify one block of N_q=" in report.diagnosis, text
    assert "follows from its corners" in report.diagnosis, text
    assert report.diagnosis.startswith("built a "), text


@pytest.mark.parametrize("shortcut", [every_pair, pairs_in_lists])
def test_block_kind_rejects_a_walk_over_every_pair(shortcut):
    report, text = run_grader(checks.block_kind, shortcut, seed=0)
    assert not report.passed
    assert "as if it visited every (query, key) pair" in report.diagnosis, text


# --------------------------------------------------------------------------------- 9.2 split-KV


def split_state(q, k, v):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    m = s.max(axis=-1, initial=-np.inf)
    m0 = np.where(np.isneginf(m), 0.0, m)
    p = np.exp(s - m0[..., None])
    return m, p.sum(axis=-1), p @ v


def _merge2(a, b):
    (ma, la, oa), (mb, lb, ob) = a, b
    m = np.maximum(ma, mb)
    m0 = np.where(np.isneginf(m), 0.0, m)
    wa, wb = np.exp(ma - m0), np.exp(mb - m0)
    return m, wa * la + wb * lb, wa[..., None] * oa + wb[..., None] * ob


def _finish(m, l, o):
    m0 = np.where(np.isneginf(m), 0.0, m)
    safe = np.where(l > 0, l, 1.0)
    return o / safe[..., None], np.where(l > 0, m0 + np.log(safe), -np.inf)


def combine_pairwise(states):
    """Honest: merge the states two at a time, last split first."""
    return _finish(*reduce(_merge2, states[::-1]))


def combine_logsumexp(states):
    """Honest, another way: each split's lse and normalised output, merged by log-sum-exp."""
    with np.errstate(divide="ignore", invalid="ignore"):
        lses = np.stack([np.where(l > 0, m + np.log(l), -np.inf) for m, l, _ in states])
        outs = [
            np.where((l > 0)[..., None], o / np.where(l > 0, l, 1)[..., None], 0)
            for m, l, o in states
        ]
    top = lses.max(axis=0)
    top0 = np.where(np.isneginf(top), 0.0, top)
    w = np.exp(lses - top0)
    total = w.sum(axis=0)
    lse = np.where(total > 0, top0 + np.log(np.where(total > 0, total, 1)), -np.inf)
    o = sum(w_s[..., None] * o_s for w_s, o_s in zip(w, outs))
    return o / np.where(total > 0, total, 1)[..., None], lse


def _attention(q, k, v):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - m)
    l = p.sum(axis=-1)
    return (p @ v) / l[..., None], m[..., 0] + np.log(l)


KEPT: list = []


def split_keeping_keys(q, k, v):
    """Shortcut, first half: a right state, and the split's keys kept aside in a global list."""
    if not KEPT or KEPT[-1][0] is not q and not np.array_equal(KEPT[-1][0], q):
        KEPT.clear()
    KEPT.append((q, k, v))
    return split_state(q, k, v)


def combine_recomputing(states):
    """Shortcut, second half: ignore the states, attend over every key kept."""
    q = KEPT[0][0]
    k = np.concatenate([k for _, k, _ in KEPT], axis=-2)
    v = np.concatenate([v for _, _, v in KEPT], axis=-2)
    KEPT.clear()
    return _attention(q, k, v)


def _closure_pair():
    """The same shortcut with the keys kept in a closure and the states' m ignored but used as a
    shape check."""
    store = {}

    def split(q, k, v):
        store.setdefault("k", []).append(k)
        store.setdefault("v", []).append(v)
        store["q"] = q
        return split_state(q, k, v)

    def combine(states):
        k, v = np.concatenate(store.pop("k"), axis=-2), np.concatenate(store.pop("v"), axis=-2)
        o, lse = _attention(store["q"], k, v)
        assert o.shape == states[0][2].shape
        return o, lse

    return split, combine


class _Carrying(np.ndarray):
    """An array that carries the split's keys along as attributes."""


def split_carrying(q, k, v):
    m, l, o = split_state(q, k, v)
    m = m.view(_Carrying)
    m.q, m.k, m.v = q, k, v
    return m, l, o


def combine_from_carried(states):
    """Shortcut: read the keys off the states and recompute."""
    q = states[0][0].q
    k = np.concatenate([s[0].k for s in states], axis=-2)
    v = np.concatenate([s[0].v for s in states], axis=-2)
    return _attention(q, k, v)


def _decode(split, combine, seed):
    lines = []
    report = checks.split_kv_decode(split, combine, seed=seed, out=lines.append)
    return report, "\n".join(lines)


@pytest.mark.parametrize("combine", [combine_pairwise, combine_logsumexp])
def test_split_kv_decode_accepts_honest_merges(combine):
    for seed in SEEDS:
        report, text = _decode(split_state, combine, seed)
        assert report.passed, text


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_combine_that_recomputes_from_kept_keys_is_rejected_and_named():
    for split, combine in [(split_keeping_keys, combine_recomputing), _closure_pair()]:
        report, text = _decode(split, combine, 0)
        assert not report.passed
        assert "combine did not merge the states it was handed" in report.diagnosis, text
        assert "combine alone" in text, text


def test_states_that_carry_the_keys_reach_the_combine_as_plain_arrays():
    report, text = _decode(split_carrying, combine_from_carried, 0)
    assert not report.passed
    assert "split_state's states carry more than (m, l, o)" in report.diagnosis, text
