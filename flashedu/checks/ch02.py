"""Graders for notebooks/02_online_softmax.ipynb: the one-pass softmax and the merge of partial
states.

Exercise 2.1 asks for the online softmax of each row (running max m, running sum l, one pass over
the columns); exercise 2.2 for the merge of two partial states (m, l, o) with o unnormalised, the
rule of `flashedu.softmax.merge`. Each case draws fresh sizes and values and targets one classic
mistake: l not rescaled when the max moves, m started at 0 instead of -inf, exp of an unshifted huge
logit, NaN from a fully masked row or state.
"""

from __future__ import annotations

import numpy as np

from .. import softmax
from ..testing import Tolerance
from ._core import Case, grade, grader, rng_for

__all__ = ["online_softmax", "merge_states"]

_F64 = Tolerance(1e-10, 1e-10)
_RESCALE = (
    "when the running max grows from m to m', rescale l by exp(m - m') before adding the new terms"
)


@grader("flashedu.softmax.online_softmax")
def online_softmax(fn, *, seed=None, out=print):
    """Grade `fn(x) -> p`: the softmax of every row of a 2-D float64 array x (M, N), by one pass
    over the columns keeping a running max and a running sum per row. A row of -inf gives zeros."""
    rng = rng_for(seed)
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))  # noqa: E731
    M, N = r(2, 5), r(9, 40)
    rising = np.sort(rng.standard_normal((r(2, 4), r(8, 16))) * 20, axis=1)
    huge = rng.standard_normal((r(2, 4), r(6, 12)))
    huge[:, r(0, huge.shape[1] - 1)] = 1e4
    masked = rng.standard_normal((3, r(4, 9)))
    masked[1] = -np.inf
    specs = [
        (
            "one entry",
            np.array([[rng.standard_normal()]]),
            "a single entry has probability exactly 1",
        ),
        (f"random ({M}, {N})", rng.standard_normal((M, N)) * 3, _RESCALE),
        (f"max rises at every column {rising.shape}", rising, _RESCALE),
        (
            "rows all near -1e4",
            np.full((2, r(3, 8)), -1e4) + rng.standard_normal((2, 1)),
            (
                "start the running max at -inf, not 0: with m = 0, exp(x - m) underflows to 0 for "
                "very negative rows"
            ),
        ),
        (
            f"one logit of 1e4 per row {huge.shape}",
            huge,
            "subtract the running max inside exp (and rescale l when it moves): exp(1e4) overflows",
        ),
        (
            "a row of -inf (fully masked)",
            masked,
            "a row with no finite entry must give zeros: guard l = 0 and exp(-inf - (-inf)) = NaN",
        ),
    ]
    cases = [
        Case(label, (x,), softmax.safe_softmax(x), hint=hint, tol=_F64) for label, x, hint in specs
    ]
    return grade("online_softmax", fn, cases, solution_name=online_softmax.solution_name, out=out)


def _states(rng, R, n_a, n_b, d, shift_a=0.0, shift_b=0.0):
    """Two partial states over disjoint key sets of random scores, and their merge by the
    package."""
    s = rng.standard_normal((R, n_a + n_b)) * 2
    s[:, :n_a] += shift_a
    s[:, n_a:] += shift_b
    v = rng.standard_normal((n_a + n_b, d))
    return softmax.state(s[:, :n_a], v[:n_a]), softmax.state(s[:, n_a:], v[n_a:])


def _empty(R, d):
    return np.full(R, -np.inf), np.zeros(R), np.zeros((R, d))


@grader("flashedu.softmax.merge")
def merge_states(fn, *, seed=None, out=print):
    """Grade `fn(a, b) -> (m, l, o)`: the partial state over the union of two disjoint key sets,
    each state (m (R,), l (R,), o (R, d)) with m = max score, l = sum exp(s - m), o = sum exp(s - m)
    v (unnormalised)."""
    rng = rng_for(seed)
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))  # noqa: E731
    R, d = r(2, 5), r(2, 6)
    a, b = _states(rng, R, r(2, 9), r(2, 9), d)
    far_a, far_b = _states(rng, R, r(2, 6), r(2, 6), d, shift_a=1e4)
    full = _states(rng, R, r(2, 6), 1, d)[0]
    specs = [
        (
            "two random halves",
            (a, b),
            "rescale BOTH l and o of each side by exp(m_side - m_new), m_new = max(m_a, m_b)",
        ),
        ("the same halves, b first", (b, a), "the merge must not depend on which side comes first"),
        (
            "maxima 1e4 apart",
            (far_a, far_b),
            "take m = max(m_a, m_b) and use exp(m_a - m), exp(m_b - m): exp(m_a) alone overflows",
        ),
        (
            "one side fully masked",
            (full, _empty(R, d)),
            (
                "a fully masked side (m = -inf, l = 0, o = 0) must contribute nothing: "
                "exp(-inf - m) = 0"
            ),
        ),
        (
            "both sides fully masked",
            (_empty(R, d), _empty(R, d)),
            "two fully masked sides give m = -inf, l = 0, o = 0: guard exp(-inf - (-inf)) = NaN",
        ),
    ]
    cases = [
        Case(label, args, softmax.merge(*args), hint=hint, tol=_F64, names=("m", "l", "o"))
        for label, args, hint in specs
    ]
    return grade("merge_states", fn, cases, solution_name=merge_states.solution_name, out=out)
