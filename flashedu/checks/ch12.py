"""Graders for notebooks/12_serving.ipynb: a paged KV cache, attention through its block table,
attention sinks in the online softmax, and MLA's absorbed decode step.

Exercise 12.1 grades the cache's bookkeeping by running a workload the grader scripts, with its
own page size and a pool that holds no page more than the workload needs at its peak, on a
`serving.PagedKVCache`: after every append or free it checks that the pools are the same arrays
(never reallocated), each sequence holds ceil(len / page_size) pages, the pages it held before are
still its first pages (nothing copied), every page is in exactly one table or the free list, and
each token sits where the block table says. Between steps the grader changes one stored key in
the pool: an append that rewrites old tokens from a copy kept aside undoes it, and is named.

Exercise 12.2 hands the learner's paged attention a pool whose pages are in a random order, whose
slots no sequence owns hold large keys, and sequences several pages long with ragged last pages
(and an empty one). Every array the learner's code makes is recorded (`_watch`): one holding more
than a page of K or V per sequence, as a gather of the pages into one contiguous cache does, is a
named shortcut. Exercise 12.3, the Triton page lookup the paged kernel calls, is graded by
`_ch12_kernel.paged_kernel` (re-exported here; without Triton, a stand-in that says so in one
line). Exercise 12.4 asks for the running state after every tile as well as (o, lse): the sink
must be in that state from the first tile on (a sink added after the loop is named), and a sink
of +100 in float32 overflows any exp(sink) that is not shifted by the running max.
Exercise 12.5 may make no array that spans the cached tokens and a per-head width (128 or 192):
that is the naive step's expanded K or V. Every exercise runs with flashedu's own implementations
off limits (12.5 may call `decoding.forward` for the attention itself), and a wrong answer is
matched against planted bugs (`_ch12_cases`).
"""

from __future__ import annotations

import numpy as np

from .. import reference, serving
from .._env import is_triton_missing
from ..testing import Tolerance
from ._ch12_cases import contiguous_attention, paged_pool, paged_twin, sink_twin
from ._core import Case, compare, grade, grader, rng_for, same
from ._shared import Shortcut, triton_stand_in
from ._watch import shape_text, watched_call

__all__ = ["paged_cache", "paged_attention", "paged_kernel", "sink_attention", "mla_absorbed"]

try:  # the Triton exercise; without Triton it says so in one line and the others still grade
    from ._ch12_kernel import paged_kernel
except ImportError as e:
    if not is_triton_missing(e):
        raise
    paged_kernel = triton_stand_in("paged_kernel")

_F64 = Tolerance(1e-10, 1e-10)


class _ShapeRule:
    """An `ArrayWatch` rule that judges every float array's shape with `why(shape)` ('' if fine);
    it counts no score pairs."""

    heads = n_q = n_k = passes = 1

    def __init__(self, why):
        self.why = why

    def judge(self, shape, kind: str) -> str:
        return self.why(tuple(int(n) for n in shape)) if kind == "f" else ""


# ---------------------------------------------------------------------------------------- 12.1

_NOT_FULL = "a new page is taken only when the last page is full"
_EVERY_APPEND = "a new page was taken at every append, even when the last page had room"
_EARLY = (
    "the last page was counted full one token early: a page holds page_size tokens, slots 0 to "
    "page_size - 1"
)
_REALLOCATED = (
    "the pools k_pages / v_pages were replaced by new arrays: a paged cache never reallocates, "
    "it writes new tokens into free pages"
)
_MOVED = (
    "pages already written were moved (copied to other pages): an append writes only the new "
    "tokens, into the last page and then into pages from the free list"
)
_REWROTE = (
    "append rewrote tokens already in the cache from a copy kept aside: write only the new rows, "
    "leave the pages that hold the old ones alone"
)
_LOST = "pages are neither in a sequence's table nor in the free list"
_NOT_FROM_FREE = (
    "a page in use is still in the free list: take pages with cache.free_pages.pop(), so each "
    "page is either free or in exactly one table"
)
_NOT_FREED = (
    "free did not give the sequence's pages back: append them to cache.free_pages, so later "
    "sequences reuse them"
)
_STILL_THERE = "free left the sequence in cache.tables or cache.lengths: delete its entries"


def _workloads(rng):
    """(label, page_size, ops): each op ("append", seq, n_tokens) or ("free", seq)."""
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))
    ps = [r(3, 5) for _ in range(5)]
    n1 = 2 * ps[0] + r(1, ps[0] - 1)
    n2 = 2 * ps[1] + r(1, ps[1] - 1)
    mixed = []
    lens = {"a": 0, "b": 0, "c": 0}
    for _ in range(9):
        s = "abc"[r(0, 2)]
        n = r(1, ps[2] + 1)
        mixed.append(("append", s, n))
        lens[s] += n
    a, b = 3 * ps[3], ps[3] + 1
    return [
        (f"one sequence, {n1} tokens one at a time", ps[0], [("append", "a", 1)] * n1),
        (
            f"a prompt of {n2} tokens in one append, then 4 more one by one",
            ps[1],
            [("append", "a", n2)] + [("append", "a", 1)] * 4,
        ),
        (
            f"exactly {2 * ps[4]} tokens (2 full pages), then one more",
            ps[4],
            [("append", "a", ps[4]), ("append", "a", ps[4]), ("append", "a", 1)],
        ),
        ("three sequences, appends of 1 to page_size + 1 tokens interleaved", ps[2], mixed),
        (
            "free a sequence, then a new one reuses its pages (the pool has no page to spare)",
            ps[3],
            [
                ("append", "a", a),
                ("append", "b", b),
                ("free", "a"),
                ("append", "c", a),
                ("append", "b", ps[3]),
                ("free", "b"),
                ("free", "c"),
                ("append", "d", 2),
            ],
        ),
    ]


def _peak_pages(page_size, ops) -> int:
    lens, peak = {}, 0
    for op in ops:
        if op[0] == "append":
            lens[op[1]] = lens.get(op[1], 0) + op[2]
        else:
            lens.pop(op[1])
        peak = max(peak, sum(-(-n // page_size) for n in lens.values()))
    return peak


def _op_text(op) -> str:
    return f"append {op[2]} to {op[1]!r}" if op[0] == "append" else f"free {op[1]!r}"


def _script_text(ops) -> str:
    """The workload in words, runs of the same step counted: "append 1 to 'a' (x9); free 'a'"."""
    runs: list[list] = []
    for op in ops:
        if runs and runs[-1][0] == op:
            runs[-1][1] += 1
        else:
            runs.append([op, 1])
    return "; ".join(_op_text(op) + (f" (x{n})" if n > 1 else "") for op, n in runs)


def _page_count(s, n, got, appends, ps):
    need = -(-n // ps)
    if got == need:
        return ""
    pages = f"{got} page" + ("" if got == 1 else "s")
    enough = f"ceil({n} / {ps}) = {need} " + ("is" if need == 1 else "are") + " enough"
    detail = f"sequence {s!r} holds {n} tokens in {pages}; {enough}"
    if got > need and got == appends[s]:
        return detail, _EVERY_APPEND
    if got == -(-(n + 1) // ps):
        return detail, _EARLY
    return detail, _NOT_FULL if got > need else ""


def _inspect(cache, pools, rows, before, op, appends):
    """'' if the cache is consistent after `op`, else (detail, diagnosis)."""
    ps, num_pages = cache.page_size, pools[0].shape[0]
    if cache.k_pages is not pools[0] or cache.v_pages is not pools[1]:
        return "the pools are new arrays", _REALLOCATED
    if op[0] == "free" and (op[1] in cache.tables or op[1] in cache.lengths):
        return f"{op[1]!r} is still in the cache", _STILL_THERE
    used = {}
    for s, (k, _) in rows.items():
        n, table = len(k), list(cache.tables.get(s, []))
        if cache.lengths.get(s) != n:
            return f"cache.lengths[{s!r}] = {cache.lengths.get(s)!r}, expected {n}", ""
        wrong = _page_count(s, n, len(table), appends, ps)
        if wrong:
            return wrong
        if s in before and table[: len(before[s])] != before[s]:
            return f"the pages of {s!r} were {before[s]}, now {table}", _MOVED
        for p in table:
            if p in used:
                return f"page {p} is in the tables of {used[p]!r} and {s!r}", _NOT_FROM_FREE
            used[p] = s
    free = [int(p) for p in cache.free_pages]
    if len(set(free)) != len(free) or set(free) & set(used):
        p = next(p for p in free if free.count(p) > 1 or p in used)
        return f"page {p} is in the free list and in use (or twice free)", _NOT_FROM_FREE
    missing = sorted(set(range(num_pages)) - set(free) - set(used))
    if missing:
        return f"pages {missing} {_LOST}", _NOT_FREED if op[0] == "free" else ""
    return _contents(cache, rows)


def _contents(cache, rows):
    ps = cache.page_size
    for s, (k, v) in rows.items():
        table = np.array(cache.tables[s], int)
        for name, pool, want in (("K", cache.k_pages, k), ("V", cache.v_pages, v)):
            got = pool[table].reshape((-1,) + pool.shape[2:])[: len(want)]
            bad = np.flatnonzero(~np.isclose(got, want, rtol=0, atol=1e-12).all(axis=(1, 2)))
            if bad.size:
                i = int(bad[0])
                where = f"page {table[i // ps]}, slot {i % ps}"
                detail = f"{name} row {i} of {s!r} is not at {where}, where the table says"
                why = _REWROTE if np.allclose(got[i], want[i] - 1.0) else ""
                return detail, why
    return ""


def _cache_call(cache, ops, seed, free_fn):
    """Run the workload on `cache` (made before grading starts: flashedu's own code may not run
    while the learner's does), checking it after every step."""
    H_kv, d, num_pages = cache.k_pages.shape[2], cache.k_pages.shape[3], cache.k_pages.shape[0]

    def free(cache, s):
        if free_fn is None:
            raise TypeError("paged_cache needs both functions: checks.paged_cache(append, free)")
        try:
            free_fn(cache, s)
        except NotImplementedError:
            raise RuntimeError("free is not written yet (it raised NotImplementedError)") from None

    def call(append_fn):
        rng = np.random.default_rng(seed)
        pools = (cache.k_pages, cache.v_pages)
        rows, appends = {}, {}
        for i, op in enumerate(ops):
            before = {s: list(t) for s, t in dict(cache.tables).items()}
            if op[0] == "append":
                k, v = rng.standard_normal((2, op[2], H_kv, d))
                append_fn(cache, op[1], k.copy(), v.copy())
                old = rows.get(op[1], (k[:0], v[:0]))
                rows[op[1]] = (np.concatenate([old[0], k]), np.concatenate([old[1], v]))
                appends[op[1]] = appends.get(op[1], 0) + 1
            else:
                free(cache, op[1])
                rows.pop(op[1])
            wrong = _inspect(cache, pools, rows, before, op, appends)
            if wrong:
                return False, f"step {i + 1} ({_op_text(op)}): {wrong[0]}", wrong[1]
            if op[0] == "append" and op[1] in rows:  # change one stored key, the grader's too
                page = cache.tables[op[1]][0]
                cache.k_pages[page, 0] += 1.0
                rows[op[1]][0][0] += 1.0
        return True, f"{len(ops)} steps, {num_pages} pages; every step consistent"

    return call


_CACHE_FORMULA = """
append(cache, seq, k, v):   n = cache.lengths.get(seq, 0); table = cache.tables.setdefault(seq, [])
    for each new row i:   slot = (n + i) % page_size
                          if slot == 0: table.append(cache.free_pages.pop())   # last page full
                          cache.k_pages[table[-1], slot] = k[i]  (and v)
    cache.lengths[seq] = n + len(k)
free(cache, seq):   cache.free_pages.extend(cache.tables.pop(seq)); del cache.lengths[seq]
"""


@grader(
    "flashedu.serving.append_tokens",
    "flashedu.serving._take_page",
    "flashedu.serving.free_sequence",
    formula=_CACHE_FORMULA,
)
def paged_cache(fn, free=None, *, seed=None, out=print):
    """Grade a paged KV cache's bookkeeping, called as `paged_cache(append, free)`:
    `append(cache, seq, k, v)` adds rows k, v (n, H_kv, d) to sequence `seq` (new or not) of a
    `serving.PagedKVCache`, and `free(cache, seq)` removes it. The cache's fields: k_pages,
    v_pages (num_pages, page_size, H_kv, d), page_size, free_pages (a list), tables (seq -> list of
    pages), lengths (seq -> tokens)."""
    rng = rng_for(seed)
    cases = []
    for label, ps, ops in _workloads(rng):
        num_pages = _peak_pages(ps, ops) + (0 if "no page to spare" in label else 1)
        cases.append(
            Case(
                f"{label}, page_size={ps}",
                (),
                None,
                hint="after every step each sequence's tokens must sit where its table says, in "
                "ceil(len / page_size) pages, and every page be in one table or the free list",
                check=lambda got, _: got,
                inputs=f"PagedKVCache(num_pages={num_pages}, page_size={ps}, H_kv=2, d=4); "
                + _script_text(ops),
                call=_cache_call(
                    serving.PagedKVCache(num_pages, ps, 2, 4, dtype=np.float64),
                    ops,
                    int(rng.integers(2**31)),
                    free,
                ),
            )
        )
    return grade("paged_cache", fn, cases, out=out, forbid=True)


# ---------------------------------------------------------------------------------------- 12.2

_PAGED_MISTAKES = {
    "pages were read in logical order (pool page j) instead of through the block table "
    "(block_table[b, j])": "logical",
    "all page_size slots of the last page were read; it holds only len - (pages - 1) * page_size "
    "keys, the rest is stale": "whole last page",
    "the last, partly filled page was skipped: len keys span ceil(len / page_size) pages": (
        "last page dropped"
    ),
    "the last page's keys were counted as len % page_size, which is 0 when the last page is full: "
    "it holds len - (pages - 1) * page_size": "n % page_size",
    "the running sum and output were not rescaled when the row max grew "
    "(alpha = exp(m_old - m_new))": "no rescale",
    "lse is log l without the running max m": "lse",
    "query head h read K/V head h % H_kv; the H / H_kv heads h // (H / H_kv) share one": "gqa",
}

_GATHER = (
    "paged attention reads one page at a time through the block table; gathering the pages into "
    "one contiguous K or V is the copy that paging exists to avoid"
)


def _gather_rule(limit, page_size):
    def why(shape):
        n = int(np.prod(shape)) if shape else 1
        if n < limit:
            return ""
        return (
            f"built a {shape_text(shape)} array ({n:,} values, more than a page of K or V per "
            f"sequence at page_size = {page_size}): {_GATHER}"
        )

    return _ShapeRule(why)


def _paged_call(args, limit, page_size):
    def call(fn):
        try:
            got = watched_call(lambda w: fn(*w.wrap(args)), rule=_gather_rule(limit, page_size))[0]
        except Shortcut as e:
            text = str(e)
            if text.startswith(("built a", "held")) and _GATHER not in text:
                raise Shortcut(f"{text}: {_GATHER}") from None
            raise
        return got

    return call


def _paged_specs(rng):
    """(label, lens, page_size, H, H_kv, N_q, d): each a few pages long, ragged."""
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))
    ps = [r(3, 6) for _ in range(7)]
    tail = lambda p: r(1, p - 1)
    return [
        ("one sequence in one page", [r(2, ps[0] - 1)], ps[0], 2, 2, 1, 8),
        ("one sequence, the last page part full", [3 * ps[1] + tail(ps[1])], ps[1], 2, 2, 1, 8),
        (
            "three sequences, a scrambled block table",
            [8 * ps[2] + tail(ps[2]), 2 * ps[2], tail(ps[2])], ps[2], 2, 2, 1, 8,
        ),
        ("GQA: 4 query heads, 2 K/V heads", [5 * ps[3] + tail(ps[3])], ps[3], 4, 2, 1, 8),
        ("an empty sequence in the batch", [7 * ps[4] + 1, 0], ps[4], 2, 2, 1, 8),
        ("two query rows per sequence", [6 * ps[5] + tail(ps[5])], ps[5], 2, 1, 2, 16),
        (
            "long sequences: 12 pages and more",
            [12 * ps[6] + tail(ps[6]), 9 * ps[6]], ps[6], 2, 2, 1, 8,
        ),
    ]  # fmt: skip


def _paged_expected(q, ks, vs):
    o = np.zeros(q.shape[:3] + (vs[0].shape[-1],))
    lse = np.full(q.shape[:3], -np.inf)
    for b, (k, v) in enumerate(zip(ks, vs)):
        if len(k):  # the test-side gather: contiguous K/V per sequence, then the oracle
            o_b, lse_b = reference.forward(
                q[b : b + 1], k.transpose(1, 0, 2)[None], v.transpose(1, 0, 2)[None]
            )
            o[b], lse[b] = o_b[0], lse_b[0]
    return o, lse


_PAGED_FORMULA = """
for each sequence b with n = cache_seqlens[b] keys:  m = -inf, l = 0, acc = 0
    for j in range(ceil(n / page_size)):
        p = block_table[b, j];  valid = min(page_size, n - j * page_size)
        k_j = k_pages[p, :valid];  v_j = v_pages[p, :valid]        # (valid, H_kv, d): ONE page
        s = q[b, h] @ k_j[:, h // (H / H_kv)].T * scale              # per query head h
        m_new = max(m, rowmax(s)); p_ = exp(s - m_new); alpha = exp(m - m_new)
        l = alpha l + rowsum(p_);  acc = alpha acc + p_ @ v_j;  m = m_new
    o[b] = acc / l;  lse[b] = m + log l         (n = 0: o = 0, lse = -inf)
"""


@grader("flashedu.serving.paged_attention", "flashedu.serving._online", formula=_PAGED_FORMULA)
def paged_attention(fn, *, seed=None, out=print):
    """Grade `fn(q, k_pages, v_pages, block_table, cache_seqlens) -> (o, lse)`: q (B, H, N_q, d),
    k_pages and v_pages (num_pages, page_size, H_kv, d), block_table (B, max_pages) ints,
    cache_seqlens (B,) ints; not causal, softmax scale 1 / sqrt(d), float64."""
    rng = rng_for(seed)
    cases = []
    for label, lens, ps, H, H_kv, N_q, d in _paged_specs(rng):
        k_pages, v_pages, table, seqlens, ks, vs = paged_pool(rng, lens, ps, H_kv, d, d)
        q = rng.standard_normal((len(lens), H, N_q, d))
        args = (q, k_pages, v_pages, table, seqlens)
        limit = 2 * len(lens) * H * max(N_q, ps) * d
        cases.append(
            Case(
                f"{label}: lengths {lens}, page_size={ps}",
                args,
                _paged_expected(q, ks, vs),
                hint="each sequence's keys are in pages block_table[b, 0], block_table[b, 1], "
                "..., the last one holding only the keys left",
                tol=_F64,
                names=("o", "lse"),
                mistakes={
                    why: (lambda bug=bug, a=args: paged_twin(bug, *a))
                    for why, bug in _PAGED_MISTAKES.items()
                },
                inputs=f"q {q.shape}, k_pages and v_pages {k_pages.shape}, block_table "
                f"{table.tolist()}, cache_seqlens {lens}",
                call=_paged_call(args, limit, ps),
            )
        )
    return grade("paged_attention", fn, cases, out=out, forbid=True)


# ---------------------------------------------------------------------------------------- 12.4

_SINK_MISTAKES = {
    "the sink was added after normalisation: the output over the keys must shrink by their "
    "share, o * exp(lse_keys - lse)": "after normalisation",
    "exp(sink) was added without subtracting the running max: the sink is a score like the "
    "others, exp(sink - m)": "unshifted",
    "the sink joined the sum at every tile; it is one column, counted once": "every tile",
    "lse leaves the sink out: it is the log-sum-exp of the whole row, sink included": (
        "lse without sink"
    ),
}
_POST_HOC = (
    "the sink is not in the running state: the states describe the keys alone, so the sink was "
    "added after the loop; start the state at (m, l, o) = (sink, 1, 0) so it joins the running "
    "max and sum from the first tile"
)


def sink_states(q, k, v, sink, block_n):
    """One head's attention with a sink, by tiles of block_n keys: (o, lse, states), states the
    running (m, l, o) after each tile, o unnormalised. q (N_q, d), k (N_k, d), v (N_k, d_v)."""
    N_q, N_k = q.shape[0], k.shape[0]
    m = np.full(N_q, sink, dtype=q.dtype)  # the sink is a score: it starts the running max
    l = np.where(np.isneginf(m), 0.0, 1.0).astype(q.dtype)  # exp(sink - m) = 1; it has no value
    o = np.zeros((N_q, v.shape[1]), q.dtype)
    states = []
    for c0 in range(0, N_k, block_n):
        s = q @ k[c0 : c0 + block_n].T / np.sqrt(q.shape[1]).astype(q.dtype)  # (N_q, n)
        m_new = np.maximum(m, s.max(axis=1))
        alpha = np.exp(m - m_new)  # rescale what is summed so far, the sink included
        p = np.exp(s - m_new[:, None])
        l = alpha * l + p.sum(axis=1)
        o = alpha[:, None] * o + p @ v[c0 : c0 + block_n]
        m = m_new
        states.append((m, l, o))
    return o / l[:, None], m + np.log(l), states


def _sink_expected(q, k, v, sink, block_n):
    """(o, lse) and, per tile, (o, lse) with the sink and lse without it, in float64."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    tile = lambda c1, s: contiguous_attention(
        q[None], k[:c1, None], v[:c1, None], sink=None if s is None else np.array([float(s)])
    )
    per_tile = []
    for c0 in range(0, k.shape[0], block_n):
        c1 = min(c0 + block_n, k.shape[0])
        (o_t, lse_t), (_, lse_keys) = tile(c1, sink), tile(c1, None)
        per_tile.append((o_t[0], lse_t[0], lse_keys[0]))
    o, lse = tile(k.shape[0], sink)
    return (o[0], lse[0]), per_tile


def _sink_check(tol, twin_args):
    def named(got):
        for why, bug in _SINK_MISTAKES.items():
            with np.errstate(all="ignore"):
                if same(tuple(got[:2]), sink_twin(bug, *twin_args)):
                    return why
        return ""

    def check(got, expected):
        (want, per_tile) = expected
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            what = type(got).__name__
            return False, f"expected (o, lse, states), got {what}", ""
        ok, detail = compare(tuple(got[:2]), want, tol, ("o", "lse"))
        if not ok:
            return False, detail, named(got)
        states = got[2]
        if not isinstance(states, (list, tuple)) or len(states) != len(per_tile):
            n = len(states) if isinstance(states, (list, tuple)) else type(states).__name__
            return (
                False,
                f"{n} states for {len(per_tile)} tiles",
                "return the running state (m, l, o) after each tile of block_n keys, one per tile",
            )
        for t, (state, (o_t, lse_t, lse_keys)) in enumerate(zip(states, per_tile)):
            m, l, o = (np.asarray(x, np.float64) for x in state)
            with np.errstate(all="ignore"):
                lse_got, o_got = m + np.log(l), o / l[:, None]
            ok, text = compare((o_got, lse_got), (o_t, lse_t), tol, ("o / l", "m + log l"))
            if not ok:
                post = compare(lse_got, lse_keys, tol)[0]
                return False, f"state after tile {t + 1}: {text}", _POST_HOC if post else ""
        return True, f"{detail}; {len(states)} states"

    return check


def _sink_specs(rng):
    """(label, N_q, N_k, d, block_n, sink, dtype, key scale)."""
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))
    bn = r(3, 6)
    return [
        ("one tile, sink 0.5", 2, bn, 8, bn, 0.5, "float64", 1.0),
        ("4 tiles, the last one short, sink 1.5", 3, 3 * bn + r(1, bn - 1), 8, bn, 1.5,
         "float64", 1.0),
        ("a sink of +100 above every score, float32", 2, 3 * bn + 1, 8, bn, 100.0, "float32", 1.0),
        ("no sink (-inf): plain attention", 2, 2 * bn + 1, 8, bn, -np.inf, "float64", 1.0),
        ("a sink of 6 that later scores overtake", 3, 4 * bn, 8, bn, 6.0, "float64", 4.0),
        ("a sink of -30 far below every score", 1, 2 * bn + 2, 16, bn, -30.0, "float64", 1.0),
    ]  # fmt: skip


_SINK_FORMULA = """
start:        m = sink,  l = 1 (0 if sink = -inf),  o = 0    # a column: score sink, no value
every tile:   s = q k_j^T / sqrt(d);  m_new = max(m, rowmax(s));  alpha = exp(m - m_new)
              p = exp(s - m_new);  l = alpha l + rowsum(p);  o = alpha o + p v_j;  m = m_new
end:          return o / l,  m + log l,  [the (m, l, o) after each tile]
"""


@grader("flashedu.checks.ch12.sink_states", formula=_SINK_FORMULA)
def sink_attention(fn, *, seed=None, out=print):
    """Grade `fn(q, k, v, sink, block_n) -> (o, lse, states)`: one head's attention with an
    attention sink (a logit joining every row as a column with no value), by tiles of block_n
    keys; q (N_q, d), k (N_k, d), v (N_k, d_v); states: the running (m, l, o) after each tile."""
    rng = rng_for(seed)
    cases = []
    for label, N_q, N_k, d, bn, sink, dtype, scale in _sink_specs(rng):
        q, k, v = (rng.standard_normal(shape) for shape in ((N_q, d), (N_k, d), (N_k, d)))
        k[N_k // 2 :] *= scale
        q, k, v = (x.astype(dtype) for x in (q, k, v))
        s = np.float32(sink) if dtype == "float32" else float(sink)
        tol = Tolerance(2e-5, 2e-5) if dtype == "float32" else _F64
        args64 = tuple(x.astype(np.float64) for x in (q, k, v))
        cases.append(
            Case(
                f"{label}, N_k={N_k}, block_n={bn}",
                (q, k, v, s, bn),
                _sink_expected(q, k, v, sink, bn),
                hint="the sink is one more score in every row, with no value: it joins the max "
                "and the sum, never the output",
                tol=tol,
                check=_sink_check(tol, (*args64, s, bn)),
                inputs=f"q {q.shape}, k {k.shape}, v {v.shape} {dtype}; sink={sink}, block_n={bn}",
            )
        )
    return grade("sink_attention", fn, cases, out=out, forbid=True)


# ---------------------------------------------------------------------------------------- 12.5

D_NOPE, D_ROPE, D_V = 128, 64, 128  # DeepSeek-V2's per-head widths
_EXPANDED = (
    "per-head keys or values expanded from the latent for every cached token, the naive step; "
    "the absorbed step folds W_uk into the query and W_uv into the output, so attention reads "
    "only the latent cache (d_c + d_rope per token)"
)


def _mla_rule(N):
    def why(shape):
        if N not in shape:
            return ""
        i = shape.index(N)
        others = shape[:i] + shape[i + 1 :]
        if any(a >= D_NOPE and (a % D_NOPE == 0 or a % (D_NOPE + D_ROPE) == 0) for a in others):
            return f"built a {shape_text(shape)} array: {_EXPANDED}"
        return ""

    return _ShapeRule(why)


def _mla_call(args, N):
    def call(fn):
        return watched_call(lambda w: fn(*w.wrap(args)), rule=_mla_rule(N))[0]

    return call


def _mla_mistakes(args):
    q_nope, q_rope, c_kv, k_rope, w_uk, w_uv = args
    d_c = c_kv.shape[-1]
    no_rope = (q_nope, 0 * q_rope, c_kv, 0 * k_rope, w_uk, w_uv)
    return {
        "the scores were scaled by 1/sqrt(d_c + d_rope), the latent's width; they are the scores "
        "of the 192-wide keys: 1/sqrt(d_nope + d_rope)": lambda: serving.mla_absorbed(
            *args, softmax_scale=1 / np.sqrt(d_c + D_ROPE)
        )[0],
        "the RoPE part was left out: each key is [W_uk^T c, k_rope], and q_rope . k_rope adds to "
        "every score": lambda: serving.mla_naive(*no_rope, softmax_scale=1 / np.sqrt(192))[0],
    }


_MLA_FORMULA = """
q_lat[b, h] = q_nope[b, h] @ W_uk[h].T              (N_q, d_c)      # W_uk folded into the query
scores      = (q_lat @ c_kv[b].T + q_rope[b, h] @ k_rope[b].T) / sqrt(d_nope + d_rope)
o_lat       = softmax(scores) @ c_kv[b]              (N_q, d_c)      # attention on the latent
o[b, h]     = o_lat @ W_uv[h]                        (N_q, d_v)      # W_uv applied after
"""


@grader("flashedu.serving.mla_absorbed", formula=_MLA_FORMULA)
def mla_absorbed(fn, *, seed=None, out=print):
    """Grade `fn(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv) -> o`: one MLA step with the
    up-projections absorbed. q_nope (B, H, N_q, 128), q_rope (B, H, N_q, 64), c_kv (B, N, d_c),
    k_rope (B, N, 64), w_uk (H, d_c, 128), w_uv (H, d_c, 128); o (B, H, N_q, 128); not causal,
    scale 1 / sqrt(192). decoding.forward may do the attention itself."""
    rng = rng_for(seed)
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))
    specs = [  # (label, B, H, N_q, N, d_c)
        ("one head, one query", 1, 1, 1, r(40, 60), 16),
        ("4 heads", 1, 4, 1, r(60, 90), 32),
        ("B=2, 8 heads", 2, 8, 1, r(40, 60), 24),
        ("2 query rows, 4 heads", 1, 4, 2, r(40, 60), 16),
    ]
    cases = []
    for label, B, H, N_q, N, d_c in specs:
        args = (
            rng.standard_normal((B, H, N_q, D_NOPE)),
            rng.standard_normal((B, H, N_q, D_ROPE)),
            rng.standard_normal((B, N, d_c)),
            rng.standard_normal((B, N, D_ROPE)),
            rng.standard_normal((H, d_c, D_NOPE)) / np.sqrt(d_c),
            rng.standard_normal((H, d_c, D_V)) / np.sqrt(d_c),
        )
        cases.append(
            Case(
                f"{label}: N={N} cached tokens, d_c={d_c}",
                args,
                serving.mla_naive(*args)[0],
                hint="the absorbed step must give the naive step's output: check which side each "
                "up-projection moved to, and the scale",
                tol=Tolerance(1e-9, 1e-9),
                mistakes=_mla_mistakes(args),
                inputs=f"q_nope {args[0].shape}, c_kv {args[2].shape}, w_uk {args[4].shape}",
                call=_mla_call(args, N),
            )
        )
    return grade(
        "mla_absorbed", fn, cases, out=out, forbid=True, allow=("flashedu.decoding.forward",)
    )
