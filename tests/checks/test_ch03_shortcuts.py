"""Chapter 03, exercise 3.1 (the tiled forward of one head): shortcuts a learner in a hurry
writes, each rejected with the diagnosis that names it, beside honest tiled loops (FA2 order,
FA1 order, smaller tiles, torch tiles, masks built per tile) that are accepted."""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
import torch

from flashedu import checks
from flashedu.testing import run_grader

SEED = 7


def _finish(m, l, acc):
    with np.errstate(divide="ignore", invalid="ignore"):
        o = acc / np.where(l > 0, l, 1.0)[:, None]
        lse = np.where(l > 0, np.where(np.isneginf(m), 0.0, m) + np.log(l), -np.inf)
    return o, lse


def _tile_scores(q, k, rows, cols, causal):
    """The scores of one tile, the causal mask computed for that tile only."""
    s = q[rows] @ k[cols].T / np.sqrt(q.shape[1])
    if causal:
        shift = k.shape[0] - q.shape[0]
        s = np.where(cols[None, :] <= rows[:, None] + shift, s, -np.inf)
    return s


def _fa2(q, k, v, *, causal=False, block_m, block_n):
    """Honest: query blocks outside, key blocks inside, online softmax."""
    N_q, N_k, d = q.shape[0], k.shape[0], q.shape[1]
    o, lse = np.zeros((N_q, d)), np.zeros(N_q)
    for r0 in range(0, N_q, block_m):
        rows = np.arange(r0, min(r0 + block_m, N_q))
        m, l, acc = np.full(rows.size, -np.inf), np.zeros(rows.size), np.zeros((rows.size, d))
        for c0 in range(0, N_k, block_n):
            cols = np.arange(c0, min(c0 + block_n, N_k))
            s = _tile_scores(q, k, rows, cols, causal)
            m_new = np.maximum(m, s.max(axis=1))
            ref = np.where(np.isneginf(m_new), 0.0, m_new)
            p, alpha = np.exp(s - ref[:, None]), np.exp(m - ref)
            l, acc, m = alpha * l + p.sum(axis=1), alpha[:, None] * acc + p @ v[cols], m_new
        o[rows], lse[rows] = _finish(m, l, acc)
    return o, lse


def _fa1(q, k, v, *, causal=False, block_m, block_n):
    """Honest: key blocks outside (FA1 order), every row's m, l and acc kept across them."""
    N_q, N_k, d = q.shape[0], k.shape[0], q.shape[1]
    m, l, acc = np.full(N_q, -np.inf), np.zeros(N_q), np.zeros((N_q, d))
    for c0 in range(0, N_k, block_n):
        cols = np.arange(c0, min(c0 + block_n, N_k))
        for r0 in range(0, N_q, block_m):
            rows = np.arange(r0, min(r0 + block_m, N_q))
            s = _tile_scores(q, k, rows, cols, causal)
            m_new = np.maximum(m[rows], s.max(axis=1))
            ref = np.where(np.isneginf(m_new), 0.0, m_new)
            p, alpha = np.exp(s - ref[:, None]), np.exp(m[rows] - ref)
            l[rows] = alpha * l[rows] + p.sum(axis=1)
            acc[rows] = alpha[:, None] * acc[rows] + p @ v[cols]
            m[rows] = m_new
    return _finish(m, l, acc)


def _smaller_tiles(q, k, v, *, causal=False, block_m, block_n):
    """Honest: tiles half the size the grader asked for."""
    return _fa2(q, k, v, causal=causal, block_m=max(1, block_m // 2), block_n=max(1, block_n // 2))


def _torch_tiles(q, k, v, *, causal=False, block_m, block_n):
    """Honest: the same loop on torch views of the arrays, slices instead of index arrays."""
    q, k, v = (torch.from_numpy(np.ascontiguousarray(x)) for x in (q, k, v))
    N_q, N_k, d = q.shape[0], k.shape[0], q.shape[1]
    o, lse = torch.zeros(N_q, d, dtype=q.dtype), torch.zeros(N_q, dtype=q.dtype)
    for r0 in range(0, N_q, block_m):
        r1 = min(r0 + block_m, N_q)
        m = torch.full((r1 - r0,), -torch.inf, dtype=q.dtype)
        l, acc = torch.zeros_like(m), torch.zeros(r1 - r0, d, dtype=q.dtype)
        for c0 in range(0, N_k, block_n):
            c1 = min(c0 + block_n, N_k)
            s = q[r0:r1] @ k[c0:c1].T / d**0.5
            if causal:
                keep = torch.arange(c0, c1)[None] <= torch.arange(r0, r1)[:, None] + N_k - N_q
                s = s.masked_fill(~keep, -torch.inf)
            m_new = torch.maximum(m, s.amax(dim=1))
            ref = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p, alpha = torch.exp(s - ref[:, None]), torch.exp(m - ref)
            l, acc, m = alpha * l + p.sum(dim=1), alpha[:, None] * acc + p @ v[c0:c1], m_new
        o_blk, lse_blk = _finish(m.numpy(), l.numpy(), acc.numpy())
        o[r0:r1], lse[r0:r1] = torch.from_numpy(o_blk), torch.from_numpy(lse_blk)
    return o.numpy(), lse.numpy()


@pytest.mark.parametrize(
    "fn", [_fa2, _fa1, _smaller_tiles, _torch_tiles],
    ids=["FA2 order", "FA1 order", "smaller tiles", "torch tiles"],
)  # fmt: skip
def test_honest_tiled_loops_are_accepted(fn):
    report, text = run_grader(checks.tiled_attention, fn, seed=SEED)
    assert report.passed, text


# ---------------------------------------------------------------------------- shortcuts


def _row_chunks(q, k, v, *, causal=False, block_m, block_n):
    """A block of query rows meets all N_k keys at once; a two-pass softmax over the row."""
    N_q, N_k, d = q.shape[0], k.shape[0], q.shape[1]
    o, lse = np.zeros((N_q, d)), np.zeros(N_q)
    for r0 in range(0, N_q, block_m):
        rows = np.arange(r0, min(r0 + block_m, N_q))
        s = _tile_scores(q, k, rows, np.arange(N_k), causal)
        m = s.max(axis=1)
        ref = np.where(np.isneginf(m), 0.0, m)
        p = np.exp(s - ref[:, None])
        o[rows], lse[rows] = _finish(m, p.sum(axis=1), p @ v)
    return o, lse


def _row_by_row(q, k, v, *, causal=False, block_m, block_n):
    """One query row at a time against every key: no N_q x N_k array, no tiling either."""
    N_q, N_k, d = q.shape[0], k.shape[0], q.shape[1]
    o, lse = np.zeros((N_q, d)), np.zeros(N_q)
    for i in range(N_q):
        s = k @ q[i] / np.sqrt(d)
        if causal:
            s = np.where(np.arange(N_k) <= i + N_k - N_q, s, -np.inf)
        m = s.max()
        if np.isneginf(m):
            o[i], lse[i] = 0.0, -np.inf
            continue
        p = np.exp(s - m)
        o[i], lse[i] = p @ v / p.sum(), m + np.log(p.sum())
    return o, lse


def _two_pass_tiles(q, k, v, *, causal=False, block_m, block_n):
    """Tiles of the right size, but the max first (one pass), then the sums (a second)."""
    N_q, N_k, d = q.shape[0], k.shape[0], q.shape[1]
    o, lse = np.zeros((N_q, d)), np.zeros(N_q)
    for r0 in range(0, N_q, block_m):
        rows = np.arange(r0, min(r0 + block_m, N_q))
        starts = range(0, N_k, block_n)
        m = np.full(rows.size, -np.inf)
        for c0 in starts:
            cols = np.arange(c0, min(c0 + block_n, N_k))
            m = np.maximum(m, _tile_scores(q, k, rows, cols, causal).max(axis=1))
        ref = np.where(np.isneginf(m), 0.0, m)
        l, acc = np.zeros(rows.size), np.zeros((rows.size, d))
        for c0 in starts:
            cols = np.arange(c0, min(c0 + block_n, N_k))
            p = np.exp(_tile_scores(q, k, rows, cols, causal) - ref[:, None])
            l, acc = l + p.sum(axis=1), acc + p @ v[cols]
        o[rows], lse[rows] = _finish(m, l, acc)
    return o, lse


def _sdpa(q, k, v, *, causal=False, block_m, block_n):
    """torch's fused attention on the whole arrays; lse from a second call on a one-column V."""
    tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(x))[None, None] for x in (q, k, v))
    N_q, N_k = q.shape[0], k.shape[0]
    mask = torch.arange(N_k)[None] <= torch.arange(N_q)[:, None] + N_k - N_q if causal else None
    o = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask)
    return o[0, 0].nan_to_num().numpy(), np.zeros(N_q)


def _memmap_scores(q, k, v, *, causal=False, block_m, block_n, scratch=[]):
    """Scores written tile by tile into a memory-mapped file, then a plain softmax over it."""
    N_q, N_k = q.shape[0], k.shape[0]
    scratch.append(tempfile.NamedTemporaryFile(suffix=".dat"))
    s = np.memmap(scratch[-1].name, dtype=np.float64, mode="w+", shape=(N_q, N_k))
    for r0 in range(0, N_q, block_m):
        rows = np.arange(r0, min(r0 + block_m, N_q))
        for c0 in range(0, N_k, block_n):
            cols = np.arange(c0, min(c0 + block_n, N_k))
            s[r0 : r0 + rows.size, c0 : c0 + cols.size] = _tile_scores(q, k, rows, cols, causal)
    m = s.max(axis=1)
    ref = np.where(np.isneginf(m), 0.0, m)
    p = np.exp(s - ref[:, None])
    return _finish(np.asarray(m), np.asarray(p.sum(axis=1)), np.asarray(p @ v))


def _torch_scores(q, k, v, *, causal=False, block_m, block_n):
    """The whole score matrix made in torch (NumPy never sees it), then read in tiles."""
    s = torch.from_numpy(np.ascontiguousarray(q)) @ torch.from_numpy(np.ascontiguousarray(k)).T
    s = (s / q.shape[1] ** 0.5).numpy()
    N_q, N_k = s.shape
    if causal:
        s = np.where(np.arange(N_k)[None] <= np.arange(N_q)[:, None] + N_k - N_q, s, -np.inf)
    m = s.max(axis=1)
    ref = np.where(np.isneginf(m), 0.0, m)
    p = np.exp(s - ref[:, None])
    return _finish(m, p.sum(axis=1), p @ v)


def _full_mask(q, k, v, *, causal=False, block_m, block_n):
    """Honest tiles, but the causal mask built once for all N_q x N_k pairs."""
    N_q, N_k = q.shape[0], k.shape[0]
    keep = np.arange(N_k)[None, :] <= np.arange(N_q)[:, None] + (N_k - N_q if causal else N_k)
    o, lse = _fa2(q, k, v, causal=causal, block_m=block_m, block_n=block_n)
    return o + 0.0 * keep.any(), lse


_CACHE: dict = {}


def _module_copy(q, k, v, *, causal=False, block_m, block_n):
    """The whole K and V copied into a module-level cache; tiles are read from the cache."""
    _CACHE["k"], _CACHE["v"] = np.array(k), np.array(v)
    return _fa2(q, _CACHE["k"], _CACHE["v"], causal=causal, block_m=block_m, block_n=block_n)


def _closure_copy():
    kept = {}

    def attention(q, k, v, *, causal=False, block_m, block_n):
        kept["k"], kept["v"] = np.array(k), np.array(v)
        return _fa2(q, kept["k"], kept["v"], causal=causal, block_m=block_m, block_n=block_n)

    return attention


@pytest.mark.parametrize(
    "fn,words",
    [
        (_row_chunks, "your code held a "),
        (_row_by_row, "your code held a "),
        (_two_pass_tiles, "two passes over the keys"),
        (_sdpa, "called scaled_dot_product_attention"),
        (_memmap_scores, "built a 256x256 array"),
        (_torch_scores, "built a 256x256 array"),
        (_module_copy, "kept a copy of the whole K in a module-level variable `_CACHE`"),
        (_closure_copy(), "kept a copy of the whole K in a closure variable `kept`"),
    ],
    ids=[
        "row chunks",
        "row by row",
        "two-pass tiles",
        "SDPA",
        "memmap",
        "torch S",
        "module copy",
        "closure copy",
    ],
)
def test_each_shortcut_is_rejected_by_name(fn, words):
    report, text = run_grader(checks.tiled_attention, fn, seed=SEED)
    assert not report.passed and report.diagnosis.startswith(words), text
    assert "alpha = exp(m - m_new)" not in text  # the formula waits for checks.hint


def test_key_blocks_wider_than_asked_are_named_with_the_grader_block():
    report, text = run_grader(checks.tiled_attention, _row_chunks, seed=SEED)
    assert "block of scores" in report.diagnosis, text
    assert "the grader asked for block_n =" in report.diagnosis


def test_the_method_case_names_a_memory_mapped_matrix_of_scores():
    """The method case alone (the 256 x 256 case leads otherwise) names where the matrix lived."""
    report, _ = run_grader(checks.tiled_attention, _memmap_scores, seed=SEED)
    last = report.results[-1][2]
    assert "memory-mapped" in last and "matrix of all scores" in last, last


def test_a_full_mask_is_named_as_a_mask():
    report, _ = run_grader(checks.tiled_attention, _full_mask, seed=SEED)
    last = report.results[-1][2]
    assert "mask over all N_q x N_k pairs" in last, last


def _own_tiles(q, k, v, *, causal=False, block_m, block_n):
    """Ignores the grader's tiles and uses 16 x 16 whatever it asks."""
    return _fa2(q, k, v, causal=causal, block_m=16, block_n=16)


def test_tiles_of_the_learners_own_choosing_are_named():
    report, text = run_grader(checks.tiled_attention, _own_tiles, seed=SEED)
    assert not report.passed and "the grader asked for block_n = " in report.diagnosis, text


def _two_pass_dot(q, k, v, *, causal=False, block_m, block_n):
    """The two-pass tiles again, written with the .dot method instead of @."""
    N_q, N_k, d = q.shape[0], k.shape[0], q.shape[1]
    o, lse = np.zeros((N_q, d)), np.zeros(N_q)
    for r0 in range(0, N_q, block_m):
        qi = q[r0 : r0 + block_m]
        m = np.full(qi.shape[0], -np.inf)
        for c0 in range(0, N_k, block_n):
            m = np.maximum(m, qi.dot(k[c0 : c0 + block_n].T).max(axis=1) / np.sqrt(d))
        l, acc = np.zeros(qi.shape[0]), np.zeros((qi.shape[0], d))
        for c0 in range(0, N_k, block_n):
            p = np.exp(qi.dot(k[c0 : c0 + block_n].T) / np.sqrt(d) - m[:, None])
            l, acc = l + p.sum(axis=1), acc + p.dot(v[c0 : c0 + block_n])
        o[r0 : r0 + block_m], lse[r0 : r0 + block_m] = acc / l[:, None], m + np.log(l)
    return o, lse


def test_a_second_pass_written_with_dot_is_named():
    report, text = run_grader(checks.tiled_attention, _two_pass_dot, seed=SEED)
    assert report.results[-1][2].startswith("shortcut: two passes over the keys"), text
