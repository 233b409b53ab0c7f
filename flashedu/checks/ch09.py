"""Graders for notebooks/09_beyond.ipynb: which blocks a mask hides, split-KV decoding, bytes on
the ring.

Exercise 9.1 teaches a block's kind from its corners. Its last cases are blocks of a few hundred
rows and keys in sequences of thousands: there the learner's code may make no array of
8 (N_q + N_k) elements or more (a table of visible pairs, for the sequence or for the block) and run
no more than 10 (rows + keys) lines of its own (a walk over the pairs); either is a named shortcut.

Exercise 9.2 is graded in pieces so that the split is real: the grader cuts the keys itself and
calls the learner's `split_state(q, k_s, v_s)` on each split's keys alone (a copy: nothing else is
reachable), checks every partial state (m, l, o), then hands the list of states, as plain float64
copies and nothing else, to the learner's `combine(states)`, whose (o, lse) must be exact
attention. A last case hands the combine the states of keys split_state never saw: a combine that
recomputes attention from keys kept aside answers for the wrong keys, and is named. All three
exercises run with flashedu's own implementations off limits, and a wrong answer is matched against
planted bugs.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from contextlib import contextmanager

import numpy as np

from .. import decoding, reference, ring
from ..testing import Tolerance, random_qkv
from ._core import Case, compare, grade, grader, rng_for, same
from ._shared import Shortcut
from ._watch import shape_text, watch_arrays

__all__ = ["block_kind", "split_kv_decode", "ring_bytes"]

_F64 = Tolerance(1e-10, 1e-10)


def _same(got, expected):
    ok = type(got) is type(expected) and got == expected
    return ok, f"{got!r}"[:60] + ("" if ok else f", expected {expected!r}")


def _block_specs(rng):
    """(label, rows, cols, N_q, N_k, causal, window_size, hint) with fresh sizes; each targets one
    mistake."""
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))
    bm, bn, n, e, left = (
        r(2, 5),
        r(2, 5),
        r(20, 30),
        r(3, 9),
        r(2, 6),
    )  # n >= 20: every block below fits
    row = r(left + bn + 2, n - bm - 1)  # a query row far right of the first keys
    return [
        (
            "no mask",
            (r(0, 4), r(5, 9)),
            (r(0, 4), r(5, 9)),
            n,
            n,
            False,
            None,
            "with no causal mask and no window every key is visible: full",
        ),
        (
            f"causal N={n}, keys right of the diagonal",
            (0, bm),
            (bm, bm + bn),
            n,
            n,
            True,
            None,
            "causal hides key j > i + N_k - N_q: "
            "a block whose first key is right of its last row's diagonal is hidden",
        ),
        (
            f"causal N={n}, keys left of the diagonal",
            (bn + 1, bn + 1 + bm),
            (0, bn),
            n,
            n,
            True,
            None,
            "full: every row of the block sees every key, so no mask is needed",
        ),
        (
            f"causal N={n}, on the diagonal",
            (0, bm),
            (0, bm),
            n,
            n,
            True,
            None,
            "a block the diagonal cuts through needs the mask: partial",
        ),
        (
            f"causal N={n}, just right of the diagonal",
            (0, bm),
            (1, 1 + bn),
            n,
            n,
            True,
            None,
            "a block is hidden only if even its last row sees none of its keys: "
            "compare its first key with the LAST row's diagonal",
        ),
        (
            f"causal N_q={n} < N_k={n + e}",
            (0, 1),
            (1, e + 1),
            n,
            n + e,
            True,
            None,
            "bottom-right alignment: query i sits at key position i + N_k - N_q",
        ),
        (
            f"causal N_q={n + e} > N_k={n}",
            (0, e),
            (0, n),
            n + e,
            n,
            True,
            None,
            "bottom-right alignment: with N_q > N_k the first N_q - N_k rows see no key at all",
        ),
        (
            f"window ({left}, 0), keys far left",
            (row, row + bm),
            (0, bn),
            n,
            n,
            False,
            (left, 0),
            "window_size=(left, right): keys more than `left` before the diagonal are hidden too",
        ),
        (
            f"window ({left}, 0), last key on the edge",
            (row, row + 1),
            (row - left - bn + 1, row - left + 1),
            n,
            n,
            False,
            (left, 0),
            "the window is inclusive: query i sees key i + N_k - N_q - left",
        ),
        (
            f"window (-1, {left}), keys far right",
            (0, bm),
            (bm + left, bm + left + bn),
            n,
            n,
            False,
            (-1, left),
            "keys more than `right` after the diagonal are hidden; -1 leaves the left side open",
        ),
    ]


def _block_kind(rows, cols, N_q, N_k, causal=False, window_size=None, *, offset=True,
                corner="bottom-left", inclusive=True, window=True, full=True):  # fmt: skip
    """A block classifier by corners, with switches for the classic mistakes."""
    (r0, r1), (c0, c1) = rows, cols
    off = N_k - N_q if offset else 0
    left, right = window_size if (window and window_size is not None) else (-1, -1)
    if causal:
        right = 0
    last_row = r1 - 1 if corner == "bottom-left" else r0
    smallest, largest = c0 - (last_row + off), (c1 - 1) - (r0 + off)
    hidden_left = left >= 0 and (largest < -left if inclusive else largest <= -left)
    if hidden_left or (right >= 0 and smallest > right):
        return "skip"
    if full and (left < 0 or smallest >= -left) and (right < 0 or largest <= right):
        return "full"
    return "partial"


_BLOCK_MISTAKES = {
    "the causal mask is top-left aligned; flashedu's is bottom-right": {"offset": False},
    "a block was judged by its first row's diagonal; a block is hidden only if its last row "
    "sees none of its keys": {"corner": "top-left"},
    "the window edge is exclusive; the window is inclusive": {"inclusive": False},
    "window_size was ignored": {"window": False},
    "no block is ever reported full": {"full": False},
}

_BLOCK_FORMULA = """
Key j is visible from query row i iff  -left <= j - (i + N_k - N_q) <= right
(causal: right = 0; -1 leaves a side open). For rows r0..r1-1 and keys c0..c1-1:
  skip    if no (i, j) pair is visible: compare c0 with the LAST row and c1 - 1 with the FIRST
  full    if every pair is visible
  partial otherwise
"""


_TABLE = (
    "a block's kind follows from its corners (the first and last row against the first and last "
    "key): no table of which (query, key) pairs are visible is needed"
)


def _long_specs(rng):
    """(label, rows, cols, N_q, N_k, causal, window_size, hint): sequences thousands of keys
    long and blocks of hundreds, where a table of visible pairs (N_q x N_k, or one block's
    rows x keys) is far larger than the grader's limit of 8 (N_q + N_k) elements."""
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))
    n, bm, bn, left = r(3000, 5000), r(200, 300), r(200, 300), r(900, 1200)
    r0 = r(3 * bm, n - 2 * bm)
    return [
        (
            f"causal N={n}, a {bm}x{bn} block on the diagonal",
            (r0, r0 + bm),
            (r0 - bn // 2, r0 - bn // 2 + bn),
            n,
            n,
            True,
            None,
            "a block the diagonal cuts through needs the mask: partial",
        ),
        (
            f"window ({left}, 0), N_q={n} < N_k={n + bn}, a {bm}x{bn} block inside",
            (r0, r0 + bm),
            (r0 + 1 - bn, r0 + 1),
            n,
            n + bn,
            False,
            (left, 0),
            "every row of the block sees every key of it: full",
        ),
    ]


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OURS = (_PACKAGE, sysconfig.get_paths()["stdlib"])


@contextmanager
def _line_budget(budget: int):
    """Count the lines the learner's own code runs in the block (not flashedu's, the standard
    library's or an installed package's); past `budget` the run stops. Yields [count, over]."""
    state = [0, False]

    def local(frame, event, arg):
        if event == "line":
            state[0] += 1
            if state[0] > budget:
                state[1] = True
                raise Shortcut("over the line budget")
        return local

    def call(frame, event, arg):
        name = frame.f_code.co_filename
        ours = name.startswith(_OURS) or "site-packages" in name or name.startswith("<frozen")
        return None if ours else local

    previous = sys.gettrace()
    sys.settrace(call)
    try:
        yield state
    finally:
        sys.settrace(previous)


_PAIRS = (
    "ran {n:,} lines of your code for one {bm}x{bn} block, as if it visited every (query, key) "
    "pair: a block's kind follows from its corners (the first and last row against the first and "
    "last key), a few comparisons whatever the block's size"
)


def _small_call(rows, cols, N_q, N_k, kw):
    """Run fn on one block of a long sequence, every array it makes recorded: one as large as
    8 (N_q + N_k) elements (NumPy, torch or many Python objects) is a table of visible pairs. The
    lines it runs are counted too: more than 10 (rows + keys) of them is a walk over the pairs."""
    limit = 8 * (N_q + N_k)
    (r0, r1), (c0, c1) = rows, cols
    budget = 10 * ((r1 - r0) + (c1 - c0)) + 200

    def call(fn):
        w = None
        try:
            with watch_arrays(limit) as w, _line_budget(budget) as lines:
                got = fn(rows, cols, N_q, N_k, **kw)
            if lines[1]:
                raise Shortcut("over the line budget")
            return got
        except Exception:
            if "lines" in locals() and lines[1]:
                msg = _PAIRS.format(n=lines[0], bm=r1 - r0, bn=c1 - c0)
                raise Shortcut(msg) from None
            if w is None or not w.over:
                raise
            shape = w.largest_shape if w.largest_elems >= limit else None
            if shape is None:  # NumPy memory made from scalars: find the array among the locals
                shape = _find_large_local(fn, (rows, cols, N_q, N_k), kw, limit)
            if shape is not None:
                made = f"built a {shape_text(shape)} array"
            else:
                made = f"held {w.peak_bytes / 2**20:,.1f} MiB of arrays or lists at once"
            where = f"to classify one block of N_q={N_q}, N_k={N_k}"
            raise Shortcut(f"{made} {where}: {_TABLE}") from None

    return call


def _find_large_local(fn, args, kwargs, limit_elems: int) -> tuple | None:
    """Rerun fn with a line tracer: the shape of the first local NumPy array of the learner's code
    with at least limit_elems elements (where the memory total alone cannot say which array it
    was)."""
    found: list[tuple] = []

    def local(frame, event, arg):
        if not found and event in ("line", "return"):
            for v in list(frame.f_locals.values()):
                if isinstance(v, np.ndarray) and v.size >= limit_elems:
                    found.append(v.shape)
                    break
        return local

    def call(frame, event, arg):
        name = frame.f_code.co_filename
        return None if ("site-packages" in name or name.startswith(_PACKAGE)) else local

    previous = sys.gettrace()
    sys.settrace(call)
    try:
        fn(*args, **kwargs)
    except Exception:
        pass
    finally:
        sys.settrace(previous)
    return found[0] if found else None


@grader("flashedu.decoding.block_kind", formula=_BLOCK_FORMULA)
def block_kind(fn, *, seed=None, out=print):
    """Grade `fn(rows, cols, N_q, N_k, causal=False, window_size=None) -> "skip" | "partial" |
    "full"`: rows = (r0, r1) query rows and cols = (c0, c1) keys of one block, half-open."""
    cases = []
    rng = rng_for(seed)
    specs = _block_specs(rng)
    specs += _long_specs(rng)  # drawn after the short ones: their seeds give the cases they gave
    for label, rows, cols, N_q, N_k, causal, window, hint in specs:
        expected = decoding.block_kind(rows, cols, N_q, N_k, causal=causal, window_size=window)
        kw = dict(causal=causal, window_size=window)
        is_long = N_k >= 1000
        cases.append(
            Case(
                f"{label}: rows {rows[0]}:{rows[1]}, keys {cols[0]}:{cols[1]}",
                (rows, cols, N_q, N_k),
                expected,
                hint=hint,
                kwargs=kw,
                check=_same,
                mistakes={
                    why: _block_kind(rows, cols, N_q, N_k, **kw, **bug)
                    for why, bug in _BLOCK_MISTAKES.items()
                },
                call=_small_call(rows, cols, N_q, N_k, kw) if is_long else None,
            )
        )
    return grade("block_kind", fn, cases, out=out, forbid=True)


# --------------------------------------------------------------------------------------------- 9.2


def split_state(q, k, v):
    """The partial state (m, l, o) of every query row of q (B, H, N_q, d) against ONE split's keys
    k, v (B, H, n, d), n >= 0: m (B, H, N_q), l (B, H, N_q), o (B, H, N_q, d) unnormalised."""
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])  # (B, H, N_q, n)
    m = s.max(axis=-1, initial=-np.inf)  # -inf for a split with no keys
    m_ref = np.where(np.isneginf(m), 0.0, m)
    p = np.exp(s - m_ref[..., None])
    return m, p.sum(axis=-1), p @ v  # o stays unnormalised: it is divided by l only at the end


def combine_states(states):
    """Merge the splits' states [(m, l, o), ...] into (o, lse) over all the keys."""
    m = np.max([m_s for m_s, _, _ in states], axis=0)  # the common max
    m_ref = np.where(np.isneginf(m), 0.0, m)
    l = sum(np.exp(m_s - m_ref) * l_s for m_s, l_s, _ in states)  # each split's share, rescaled
    o = sum(np.exp(m_s - m_ref)[..., None] * o_s for m_s, _, o_s in states)
    safe = np.where(l > 0, l, 1.0)
    return o / safe[..., None], np.where(l > 0, m_ref + np.log(safe), -np.inf)


def _state_bug(q, k, v, *, m0=-np.inf, normalised=False, shift=True):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    with np.errstate(all="ignore"):
        m = np.maximum(s.max(axis=-1, initial=-np.inf), m0)
        ref = np.where(np.isneginf(m), 0.0, m) if shift else np.zeros_like(m)
        p = np.exp(s - ref[..., None])
        l, o = p.sum(axis=-1), p @ v
        return m, l, (o / l[..., None] if normalised else o)


_STATE_MISTAKES = {
    "the split's max started at 0 instead of -inf": {"m0": 0.0},
    "the split's o was divided by l; a partial state keeps o unnormalised": {"normalised": True},
    "exp was taken of the raw scores, not of the scores minus the split's max": {"shift": False},
}


def _combine_bug(states, *, weighted=True, rescale=True, lse="m + log l", divide=True):
    m = np.max([m_s for m_s, _, _ in states], axis=0)
    m_ref = np.where(np.isneginf(m), 0.0, m)
    with np.errstate(all="ignore"):
        if not weighted:
            o = np.mean([o_s / l_s[..., None] for _, l_s, o_s in states], axis=0)
            return o, m_ref + np.log(sum(np.exp(m_s - m_ref) * l_s for m_s, l_s, _ in states))
        w = [np.exp(m_s - m_ref) if rescale else np.ones_like(m_s) for m_s, _, _ in states]
        l = sum(w_s * l_s for w_s, (_, l_s, _) in zip(w, states))
        o = sum(w_s[..., None] * o_s for w_s, (_, _, o_s) in zip(w, states))
        out_lse = {"m + log l": m_ref + np.log(l), "log l": np.log(l), "m + l": m_ref + l}[lse]
        return (o / l[..., None] if divide else o), out_lse


_COMBINE_MISTAKES = {
    "the splits' outputs were averaged instead of weighted by how much each one holds": {
        "weighted": False
    },
    "the states were added without rescaling them to the common max": {"rescale": False},
    "lse is log l without the common max m": {"lse": "log l"},
    "lse = m + l instead of m + log l": {"lse": "m + l"},
    "o was not divided by l at the end": {"divide": False},
}


def _state_check(i, n, bounds, g, e, args):
    if not isinstance(g, (tuple, list)) or len(g) != 3:
        what = type(g).__name__
        return False, f"split {i + 1}: expected (m, l, o), got {what}", ""
    ok, detail = compare(tuple(g), e, _F64, ("m", "l", "o"))
    if ok:
        return True, "", ""
    with np.errstate(all="ignore"):
        why = next((w for w, kw in _STATE_MISTAKES.items() if same(g, _state_bug(*args, **kw))), "")
    return False, f"split {i + 1} of {n} (keys {bounds[0]}:{bounds[1]}): {detail}", why


def _decode_check(got, expected):
    states, out, splits = got
    want_states, want, args = expected
    for i, (g, e, (c0, c1)) in enumerate(zip(states, want_states, splits)):
        q, k, v = args
        ok, detail, why = _state_check(
            i, len(splits), (c0, c1), g, e, (q, k[..., c0:c1, :], v[..., c0:c1, :])
        )
        if not ok:
            return False, detail, why
    ok, detail = compare(out, want, _F64, ("o", "lse"))
    if ok:
        return True, f"{len(states)} states; {detail}"
    why = next(
        (w for w, kw in _COMBINE_MISTAKES.items() if same(out, _combine_bug(want_states, **kw))), ""
    )
    return False, f"combine: {detail}", why


def _plain(state):
    """A state as the combine receives it: plain float64 copies of m, l and o, nothing attached
    (an array subclass or an attribute could carry the split's keys along)."""
    if isinstance(state, (tuple, list)) and len(state) == 3:
        try:
            return tuple(np.array(np.asarray(x), dtype=np.float64, copy=True) for x in state)
        except (TypeError, ValueError):
            pass
    return state


def _carries(states) -> bool:
    """Whether a state holds more than three plain arrays (a subclass, attributes)."""
    return any(
        isinstance(s, (tuple, list))
        and any(
            (isinstance(x, np.ndarray) and type(x) is not np.ndarray) or bool(vars(x))
            for x in s
            if hasattr(x, "__dict__") or isinstance(x, np.ndarray)
        )
        for s in states
    )


_CARRIED = (
    "split_state's states carry more than (m, l, o) (array subclasses or attributes), and combine "
    "failed on plain arrays: combine receives m, l and o alone and must merge them"
)


def _run_combine(combine, states):
    if combine is None:
        raise TypeError(
            "split_kv_decode needs both functions: checks.split_kv_decode(split_state, combine)"
        )
    try:
        return combine([_plain(s) for s in states])
    except NotImplementedError:
        raise RuntimeError("combine is not written yet (it raised NotImplementedError)") from None
    except Exception:
        if _carries(states):
            raise Shortcut(_CARRIED) from None
        raise


def _split_call(q, k, v, splits, combine):
    def call(split_fn):
        states = [
            split_fn(q.copy(), k[..., c0:c1, :].copy(), v[..., c0:c1, :].copy())
            for c0, c1 in splits
        ]
        return states, _run_combine(combine, states), splits

    return call


_KEPT_KEYS = (
    "combine did not merge the states it was handed: its (o, lse) is attention over the keys "
    "split_state saw before; combine gets only the (m, l, o) states and must merge them"
)


def _alone_call(seen, handed, combine):
    """Run split_state on the splits of `seen` (q, k, v, splits), then hand combine the grader's
    own states of other keys: a combine that merges them is right, one that recomputes attention
    from keys kept aside by split_state answers for `seen`."""
    q, k, v, splits = seen

    def call(split_fn):
        for c0, c1 in splits:
            split_fn(q.copy(), k[..., c0:c1, :].copy(), v[..., c0:c1, :].copy())
        return _run_combine(combine, handed)

    return call


def _alone_check(seen_out):
    def check(got, expected):
        want_states, want = expected
        ok, detail = compare(got, want, _F64, ("o", "lse"))
        if ok:
            return True, f"{len(want_states)} states merged; {detail}"
        if same(got, seen_out):
            return False, f"combine: {detail}", _KEPT_KEYS
        bugs = _COMBINE_MISTAKES.items()
        why = next((w for w, kw in bugs if same(got, _combine_bug(want_states, **kw))), "")
        return False, f"combine: {detail}", why

    return check


_DECODE_FORMULA = """
split_state: s = q k^T / sqrt(d);  m = rowmax(s) (-inf if no keys);  p = exp(s - m)
             return m, rowsum(p), p v                       (o unnormalised)
combine:     m = max over splits of m_s;  w_s = exp(m_s - m)
             l = sum_s w_s l_s;  o = sum_s w_s o_s;  return o / l, m + log(l)
"""


@grader(
    "flashedu.checks.ch09.split_state",
    "flashedu.checks.ch09.combine_states",
    "flashedu.decoding.forward",
    formula=_DECODE_FORMULA,
)
def split_kv_decode(fn, combine=None, *, seed=None, out=print):
    """Grade split-KV decoding in two functions, called as `split_kv_decode(split_state, combine)`:
    `split_state(q, k, v) -> (m, l, o)` for q (B, H, N_q, d) against ONE split's keys k, v
    (B, H, n, d), n >= 0, with m, l (B, H, N_q) and o (B, H, N_q, d) unnormalised; and
    `combine(states) -> (o, lse)` merging the list of every split's state. float64, no mask."""
    rng = rng_for(seed)
    n = int(rng.integers(20, 60))
    specs = [  # (label, (B, H, N_q, N_k, d), splits as (c0, c1), k scale)
        ("one split", (1, 2, 1, n, 8), decoding.split_bounds(n, 1), 1.0),
        ("4 splits", (2, 2, 1, n, 8), decoding.split_bounds(n, 4), 3.0),
        ("3 splits, the last one short", (1, 3, 2, 3 * (n // 3) + 1, 16), None, 3.0),
        ("one key per split", (1, 1, 1, 5, 8), decoding.split_bounds(5, 5), 1.0),
        ("a split with no keys", (1, 2, 2, 9, 4), [(0, 4), (4, 4), (4, 9)], 1.0),
        ("every score below -1000", (1, 1, 1, 12, 4), decoding.split_bounds(12, 3), -40.0),
    ]
    hint = (
        "each split's (m, l, o) and the merged (o, lse) must be exact"
        if combine is not None
        else "pass your combine function too: checks.split_kv_decode(split_state, combine)"
    )
    cases = []
    for label, shape, splits, k_scale in specs:
        splits = splits or decoding.split_bounds(shape[3], 3)
        q, k, v = random_qkv(*shape, "float64", seed=rng)
        if k_scale < 0:  # q >= 40, k <= -40 elementwise: scores <= -1600 d / sqrt(d)
            q, k = (abs(q) + 1) * -k_scale, -(abs(k) + 1) * -k_scale
        else:
            k = k * k_scale
        states = [split_state(q, k[..., c0:c1, :], v[..., c0:c1, :]) for c0, c1 in splits]
        cases.append(
            Case(
                f"{label}, N_k={shape[3]}",
                (),
                (states, reference.forward(q, k, v), (q, k, v)),
                hint=hint,
                check=_decode_check,
                inputs=f"q {q.shape}, k and v {k.shape}; splits {splits}",
                call=_split_call(q, k, v, splits, combine),
            )
        )
    # the combine alone: states of keys split_state never saw, the same shapes as keys it did see
    shape, splits = (1, 2, 2, 3 * n + 2, 8), decoding.split_bounds(3 * n + 2, 3)
    q, k, v = random_qkv(*shape, "float64", seed=rng)
    q2, k2, v2 = random_qkv(*shape, "float64", seed=rng)
    handed = [split_state(q2, k2[..., c0:c1, :], v2[..., c0:c1, :]) for c0, c1 in splits]
    cases.append(
        Case(
            f"combine alone: the states of {shape[3]} other keys",
            (),
            (handed, reference.forward(q2, k2, v2)),
            hint="combine must merge the states it is handed, whatever keys they came from",
            check=_alone_check(reference.forward(q, k, v)),
            inputs=f"split_state on q {q.shape}, k and v {k.shape}, splits {splits}; then "
            f"combine on the states of other q, k, v of the same shapes",
            call=_alone_call((q, k, v, splits), handed, combine),
        )
    )
    return grade("split_kv_decode", fn, cases, out=out, forbid=True)


# --------------------------------------------------------------------------------------------- 9.3


def _ring_bytes(B, H, H_kv, N_k, d, W, itemsize, *, tensors=2, heads="kv", rows="all",
                last_sends=False):  # fmt: skip
    n = {"all": N_k, "shard": N_k // W, "padded": -(-N_k // W) * W}[rows]
    per_step = tensors * B * (H_kv if heads == "kv" else H) * n * d * itemsize
    return [per_step] * (W if last_sends else W - 1) + ([] if last_sends else [0])


_RING_MISTAKES = {
    "only K was counted; V travels too": {"tensors": 1},
    "the last step sends too; after it every rank has seen every shard": {"last_sends": True},
    "one shard was counted per step; every rank passes its shard at once": {"rows": "shard"},
    "the H query heads were counted; only the H_kv K/V heads travel": {"heads": "q"},
    "the shards were padded to equal sizes; together they hold exactly N_k rows": {
        "rows": "padded"
    },
}

_RING_FORMULA = """
bytes at each of the first W - 1 steps = 2 B H_kv N_k d itemsize (K and V, all shards, one hop);
0 at the last step.
"""


@grader("flashedu.ring.traffic_per_step", formula=_RING_FORMULA)
def ring_bytes(fn, *, seed=None, out=print):
    """Grade `fn(B, H, H_kv, N_k, d, world_size, itemsize) -> list[int]`: bytes sent over all ring
    links at each step of the ring forward (one entry per step, world_size steps)."""
    rng = rng_for(seed)
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))
    specs = [  # (label, (B, H, H_kv, N_k, d, world_size, itemsize))
        ("2 ranks, fp16", (1, 1, 1, 2 * r(8, 64), 64, 2, 2)),
        ("4 ranks, fp32", (2, 4, 4, 4 * r(8, 64), 32, 4, 4)),
        ("GQA: H=8, H_kv=2", (1, 8, 2, 3 * r(8, 64), 64, 3, 2)),
        ("ragged: N_k not a multiple of W", (1, 2, 2, 3 * r(8, 64) + 1, 16, 3, 2)),
    ]
    cases = [
        Case(
            label,
            args,
            ring.traffic_per_step(*(args[:1] + args[2:])),
            hint="count what crosses the ring links at each step",
            check=_same,
            mistakes={why: _ring_bytes(*args, **kw) for why, kw in _RING_MISTAKES.items()},
        )
        for label, args in specs
    ]
    return grade("ring_bytes", fn, cases, out=out, forbid=True)
