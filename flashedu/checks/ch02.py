"""Graders for notebooks/02_online_softmax.ipynb: the one-pass statistics and the merge of states.

Exercise 2.1 hands the learner the columns of x in blocks, through an iterator that can be walked
once (`_method.OnePass`: a block is gone when the next one arrives), and asks for each row's
running max m and running sum l = sum_j exp(x_j - m). A second pass is impossible, and trying one
is a named shortcut; so is keeping the blocks (the last case is long enough that a kept row shows
in memory: a NumPy, torch or memory-mapped copy of the row, or more than half of it held in
NumPy's own allocations) and reading the stream's private copy of the row. Exercise 2.2 asks for
the merge of two partial states (m, l, o), o unnormalised. Both run with flashedu's own softmax
functions off limits. A wrong answer is matched against the classic mistakes: l not rescaled when
the max moves, m started at 0, exp of an unshifted logit, NaN from a fully masked row or state.
Shortcuts are tested in tests/checks/test_ch02_shortcuts.py.
"""

from __future__ import annotations

import numpy as np

from .. import softmax
from ..testing import Tolerance
from ._core import Case, candidates, grade, grader, rng_for
from ._method import OnePass, Shortcut
from ._watch import watched_call

__all__ = ["online_softmax", "merge_states"]

_F64 = Tolerance(1e-10, 1e-10)


# --------------------------------------------------------------------------------------------- 2.1


def online_stats(blocks):
    """The running max m (M,) and running sum l (M,) of every row, in ONE pass over `blocks`, an
    iterable of (M, c) column blocks of a 2-D array. A row with no finite entry gives m = -inf,
    l = 0."""
    M = blocks.shape[0]
    m = np.full(M, -np.inf)  # -inf, not 0: a row may be all very negative
    l = np.zeros(M)
    for b in blocks:  # b: (M, c), the next c columns; it is gone once the loop moves on
        m_new = np.maximum(m, b.max(axis=1))
        m_ref = np.where(np.isneginf(m_new), 0.0, m_new)  # nothing finite yet: avoid -inf - -inf
        l = np.exp(m - m_ref) * l + np.exp(b - m_ref[:, None]).sum(axis=1)  # rescale, then add
        m = m_new
    return m, l


def _stats(x, block, *, rescale=True, m0=-np.inf, shift=True, guard=True):
    """online_stats over x (M, N) in blocks of `block`, with switches that plant the mistakes."""
    m, l = np.full(x.shape[0], m0), np.zeros(x.shape[0])
    with np.errstate(all="ignore"):
        for c0 in range(0, x.shape[1], block):
            b = x[:, c0 : c0 + block]
            m_new = np.maximum(m, b.max(axis=1))
            m_ref = np.where(np.isneginf(m_new), 0.0, m_new) if guard else m_new
            ref = m_ref if shift else np.zeros_like(m_ref)
            alpha = np.exp(m - ref) if (rescale and shift) else 1.0
            l = alpha * l + np.exp(b - ref[:, None]).sum(axis=1)
            m = m_new
    return m, l


_STATS_MISTAKES = {
    "the running sum l was not rescaled when the running max grew": {"rescale": False},
    "the running max started at 0 instead of -inf": {"m0": 0.0},
    "exp was taken of the raw scores, not of the scores minus the running max": {"shift": False},
    "a row of -inf gives NaN: a fully masked row must end with m = -inf and l = 0": {
        "guard": False
    },
}


def _stats_mistakes(x, block) -> dict:
    """Each mistake's output, per block and (short rows only) per column: a learner may loop
    over either."""
    sizes = (block, 1) if x.shape[1] <= 64 else (block,)
    return {
        why: (lambda kw=kw: candidates(*(_stats(x, b, **kw) for b in sizes)))
        for why, kw in _STATS_MISTAKES.items()
    }


_ONE_PASS = "an online softmax keeps only m and l per row, and reads each block once"


def _one_pass(x, block, limit):
    """Run fn on a OnePass stream of x, watching its arrays when `limit` is set."""

    def call(fn):
        streams = [OnePass(x, block), OnePass(x, block)]  # made outside the watch; one spare
        used = []

        def run(w):
            used.append(streams.pop(0))
            return fn(used[-1])

        try:
            got, _ = watched_call(
                run, limit_elems=limit, what=f"the whole {x.shape[0]}x{x.shape[1]} row"
            )
        except Shortcut as e:
            if str(e).startswith("called"):
                raise
            raise Shortcut(f"{e}: {_ONE_PASS}") from None
        stream = used[0]
        stream.close()
        if stream.violations:  # a Shortcut the learner's code swallowed
            raise Shortcut(f"read the row twice ({stream.violations[0]}): {_ONE_PASS}")
        return got

    return call


_STATS_FORMULA = """
For each block b of columns, with m = -inf and l = 0 before the first:
    m_new = max(m, max_j b_j)
    l     = exp(m - m_new) * l + sum_j exp(b_j - m_new)
    m     = m_new
Where m_new is still -inf (nothing finite seen), use 0 in its place inside exp.
"""


@grader("flashedu.checks.ch02.online_stats", formula=_STATS_FORMULA)
def online_softmax(fn, *, seed=None, out=print):
    """Grade `fn(blocks) -> (m, l)`: blocks yields the (M, c) column blocks of a float64 array x
    (M, N) once (`blocks.shape` is x's); return each row's max m (M,) and l = sum_j exp(x_j - m)
    (M,), in one pass. A row of -inf gives m = -inf, l = 0."""
    rng = rng_for(seed)
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))
    M, N, b = r(2, 5), r(9, 40), r(3, 5)
    rising = np.sort(rng.standard_normal((r(2, 4), r(8, 16))) * 20, axis=1)
    huge = rng.standard_normal((r(2, 4), r(6, 12)))
    huge[:, r(0, huge.shape[1] - 1)] = 1e4
    masked = rng.standard_normal((3, r(4, 9)))
    masked[1] = -np.inf
    long_row = rng.standard_normal((64, 4096)) * 3  # 2 MiB: a kept copy shows above the noise
    specs = [  # (label, x, block, memory limit in elements, hint)
        ("one column", rng.standard_normal((r(2, 4), 1)), 1, None, "one entry: m is it, l = 1"),
        (f"random ({M}, {N}), blocks of {b}", rng.standard_normal((M, N)) * 3, b, None, ""),
        (f"max rises at every column {rising.shape}", rising, 1, None, ""),
        (
            "rows all near -1e4",
            np.full((2, r(3, 8)), -1e4) + rng.standard_normal((2, 1)),
            2,
            None,
            "",
        ),
        (f"one logit of 1e4 per row {huge.shape}", huge, 3, None, "exp(1e4) overflows"),
        ("a row of -inf (fully masked)", masked, 2, None, "a masked row: m = -inf, l = 0"),
        ("one pass over 64 x 4096, blocks of 64", long_row, 64, 64 * 4096 // 2, ""),
    ]
    cases = [
        Case(
            label,
            (),
            softmax.online_stats(x),
            hint=hint or "m must be each row's max and l the sum of exp(x - m) over the row",
            tol=_F64,
            names=("m", "l"),
            mistakes=_stats_mistakes(x, block),
            inputs=f"x {x.shape} in blocks of {block} columns",
            call=_one_pass(x, block, limit),
        )
        for label, x, block, limit, hint in specs
    ]
    return grade("online_softmax", fn, cases, out=out, forbid=True)


# --------------------------------------------------------------------------------------------- 2.2


def _states(rng, R, n_a, n_b, d, shift_a=0.0, shift_b=0.0):
    """Two partial states over disjoint key sets of random scores."""
    s = rng.standard_normal((R, n_a + n_b)) * 2
    s[:, :n_a] += shift_a
    s[:, n_a:] += shift_b
    v = rng.standard_normal((n_a + n_b, d))
    return softmax.state(s[:, :n_a], v[:n_a]), softmax.state(s[:, n_a:], v[n_a:])


def _empty(R, d):
    return np.full(R, -np.inf), np.zeros(R), np.zeros((R, d))


def _merge(a, b, *, rescale_o=True, rescale_l=True, guard=True, shift=True):
    """The merge with switches that plant the mistakes."""
    (m_a, l_a, o_a), (m_b, l_b, o_b) = a, b
    m = np.maximum(m_a, m_b)
    ref = (np.where(np.isneginf(m), 0.0, m) if guard else m) if shift else np.zeros_like(m)
    with np.errstate(all="ignore"):
        alpha, beta = np.exp(m_a - ref), np.exp(m_b - ref)
        l = alpha * l_a + beta * l_b if rescale_l else l_a + l_b
        o = alpha[:, None] * o_a + beta[:, None] * o_b if rescale_o else o_a + o_b
    return m, l, o


_MERGE_MISTAKES = {
    "o was added without rescaling (l was rescaled; o needs the same factors)": {
        "rescale_o": False
    },
    "neither l nor o was rescaled to the new max before adding": {
        "rescale_o": False,
        "rescale_l": False,
    },
    "two fully masked sides give NaN instead of m = -inf, l = 0, o = 0": {"guard": False},
    "the weights were not taken relative to the new max, so they overflow": {"shift": False},
}

_MERGE_FORMULA = """
m = max(m_a, m_b);  alpha = exp(m_a - m);  beta = exp(m_b - m)
l = alpha * l_a + beta * l_b
o = alpha * o_a + beta * o_b      (o stays unnormalised)
Where m = -inf (both sides empty), use 0 in its place inside exp.
"""


@grader("flashedu.softmax.merge", formula=_MERGE_FORMULA)
def merge_states(fn, *, seed=None, out=print):
    """Grade `fn(a, b) -> (m, l, o)`: the partial state over the union of two disjoint key sets,
    each state (m (R,), l (R,), o (R, d)) with m = max score, l = sum exp(s - m),
    o = sum exp(s - m) v (unnormalised)."""
    rng = rng_for(seed)
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))
    R, d = r(2, 5), r(2, 6)
    a, b = _states(rng, R, r(2, 9), r(2, 9), d)
    far_a, far_b = _states(rng, R, r(2, 6), r(2, 6), d, shift_a=1e4)
    full = _states(rng, R, r(2, 6), 1, d)[0]
    specs = [
        ("two random halves", (a, b), "l and o must both be rescaled to the common max"),
        ("the same halves, b first", (b, a), "the merge must not depend on which side comes first"),
        ("maxima 1e4 apart", (far_a, far_b), "exp of a raw maximum of 1e4 overflows"),
        ("one side fully masked", (full, _empty(R, d)), "a fully masked side adds nothing"),
        ("both sides fully masked", (_empty(R, d), _empty(R, d)), "two empty sides give empty"),
    ]
    cases = [
        Case(
            label,
            args,
            softmax.merge(*args),
            hint=hint,
            tol=_F64,
            names=("m", "l", "o"),
            mistakes={why: _merge(*args, **kw) for why, kw in _MERGE_MISTAKES.items()},
            inputs=f"R={R} rows, d={d}; m, l, o of each side",
        )
        for label, args, hint in specs
    ]
    return grade("merge_states", fn, cases, out=out, forbid=True)
