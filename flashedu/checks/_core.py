"""The grading machinery shared by every chapter's graders."""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..testing import Tolerance, max_error, to_numpy


@dataclass
class Case:
    """One input for a learner's function.

    label: what the case tries, e.g. "N_q=5 > N_k=3, causal".
    expected: the right answer (an array, a tuple of arrays, or a number).
    hint: printed when this case fails; names the likely mistake (e.g. "l was not rescaled when m grew").
    check: optional custom comparison (got, expected) -> (ok, detail) replacing the tolerance test.
    """

    label: str
    args: tuple
    expected: Any
    hint: str = ""
    kwargs: dict = field(default_factory=dict)
    tol: Tolerance = Tolerance(1e-6, 1e-6)
    check: Callable[[Any, Any], tuple[bool, str]] | None = None


@dataclass
class Report:
    name: str
    attempted: bool
    results: list[tuple[str, bool, str]]   # (label, ok, detail)

    @property
    def passed(self) -> bool:
        return self.attempted and bool(self.results) and all(ok for _, ok, _ in self.results)

    @property
    def text(self) -> str:
        return "\n".join(f"{label}: {detail}" for label, _, detail in self.results)

    def _ipython_display_(self) -> None:
        """Show nothing: the grader already printed its lines. (A trailing `;` does not reliably
        silence a cell's result under nbval, so the report silences itself.)"""

    def __repr__(self) -> str:
        if not self.attempted:
            return f"<{self.name}: not attempted>"
        n_ok = sum(ok for _, ok, _ in self.results)
        return f"<{self.name}: {n_ok}/{len(self.results)} cases passed>"


def _shape(x) -> str:
    if isinstance(x, tuple):
        return " ".join(_shape(t) for t in x)
    return str(tuple(np.shape(x)))


def _compare(got, expected, tol: Tolerance) -> tuple[bool, str]:
    if isinstance(expected, tuple):
        if not isinstance(got, tuple) or len(got) != len(expected):
            return False, f"expected a tuple of {len(expected)} results, got {type(got).__name__}"
        worst = (True, "")
        details = []
        for g, e in zip(got, expected):
            ok, detail = _compare(g, e, tol)
            details.append(detail)
            if not ok and worst[0]:
                worst = (False, detail)
        return worst if not worst[0] else (True, "; ".join(details))
    g = to_numpy(got)
    e = to_numpy(expected)
    if g.shape != e.shape:
        return False, f"shape {g.shape}, expected {e.shape}"
    if np.isnan(g).any():
        return False, f"shape={g.shape}  {int(np.isnan(g).sum())} NaN entries"
    if (np.isinf(g) != np.isinf(e)).any():
        return False, f"shape={g.shape}  infinities where finite values belong (or the reverse)"
    abs_err, _ = max_error(g, e)
    fin = np.isfinite(e)
    ok = bool(np.all(np.abs(np.where(fin, g - e, 0)) <= tol.atol + tol.rtol * np.abs(np.where(fin, e, 0))))
    return ok, f"shape={g.shape}  max|diff|={abs_err:.1e}"


def grade(name: str, fn: Callable, cases: list[Case], *, solution_name: str, out: Callable = print) -> Report:
    """Run `fn` on every case and print one line each. Returns a Report (`.passed`, `.text`)."""
    results: list[tuple[str, bool, str]] = []
    width = max(len(c.label) for c in cases)
    for i, case in enumerate(cases):
        try:
            got = fn(*case.args, **case.kwargs)
        except NotImplementedError:
            if i == 0:
                out(f"{name}: not attempted yet (reference: {solution_name})")
                return Report(name, False, [])
            ok, detail = False, "raised NotImplementedError"
        except Exception as e:  # the learner's bug, reported, not raised
            ok, detail = False, f"raised {type(e).__name__}: {e}"
        else:
            ok, detail = (case.check or (lambda g, x: _compare(g, x, case.tol)))(got, case.expected)
        if not ok and case.hint:
            detail = f"{detail}  <- {case.hint}"
        results.append((case.label, ok, f"{'ok' if ok else 'WRONG'}  {detail}"))
        out(f"  {case.label:<{width}}  {'ok   ' if ok else 'WRONG'}  {detail}")
    n_ok = sum(ok for _, ok, _ in results)
    verdict = "all cases pass" if n_ok == len(results) else f"{len(results) - n_ok} case(s) wrong"
    out(f"{name}: {n_ok}/{len(results)} cases passed: {verdict}")
    return Report(name, True, results)


def grader(solution_name: str):
    """Decorate a grader `g(fn, *, seed=None, out=print) -> Report` with the dotted name of its solution."""

    def wrap(g):
        @functools.wraps(g)
        def run(fn, *args, **kwargs):
            return g(fn, *args, **kwargs)

        run.solution_name = solution_name
        return run

    return wrap


def solution(g) -> None:
    """Show the package function that solves the exercise graded by `g`."""
    from .. import nb

    module, _, attr = g.solution_name.rpartition(".")
    nb.show_source(getattr(importlib.import_module(module), attr))


def rng_for(seed) -> np.random.Generator:
    """Fresh inputs each call unless a seed is given (tests pass one)."""
    return np.random.default_rng(seed)
