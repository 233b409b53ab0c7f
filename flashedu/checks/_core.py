"""The grading machinery shared by every chapter's graders: `Case`, `grade`, `grader`, `solution`.

A chapter's grader builds a list of `Case`s from fresh ragged inputs (seeded only when a test passes
`seed=`), with the expected answer from the float64 reference, and hands them to `grade`, which
calls the learner's function on each, prints one line per case (shapes, max error, NaN, infinities,
or what it raised) with the case's hint when it fails, and returns a `Report`. A stub that raises
NotImplementedError on the first case is reported as "not attempted yet" and nothing else is
printed, so the committed notebooks run under nbval with their exercises open. Used from every
notebook's exercises (first in notebooks/01_naive_attention.ipynb); tested in
tests/test_checks_core.py.

Limits: comparisons are elementwise against a tolerance, so an answer that is right only up to a
permutation fails; a grader that needs another notion of right passes `Case.check`.
"""

from __future__ import annotations

import functools
import importlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..testing import Tolerance, max_error, to_numpy


@dataclass
class Case:
    """One input for a learner's function.

    label: what the case tries, e.g. "N_q=5 > N_k=3, causal".
    expected: the right answer (an array, a tuple of arrays, or a number).
    hint: printed when this case fails; names the likely mistake (e.g. "l was not rescaled when m
    grew").
    check: optional custom comparison (got, expected) -> (ok, detail) replacing the tolerance test.
    names: optional names of the parts of a tuple answer, e.g. ("o", "lse"), used in the printed
    line.
    """

    label: str
    args: tuple
    expected: Any
    hint: str = ""
    kwargs: dict = field(default_factory=dict)
    tol: Tolerance = Tolerance(1e-6, 1e-6)
    check: Callable[[Any, Any], tuple[bool, str]] | None = None
    names: tuple[str, ...] = ()


@dataclass
class Report:
    name: str
    attempted: bool
    results: list[tuple[str, bool, str]]  # (label, ok, detail)

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


def _compare_array(got, expected, tol: Tolerance) -> tuple[bool, str]:
    """Elementwise |got - expected| <= atol + rtol |expected|; infinities must match, sign
    included."""
    if got is None:
        return False, "returned None (a missing `return`?)"
    try:
        g = to_numpy(got)
    except (TypeError, ValueError):
        return False, f"expected an array or a number, got {type(got).__name__}"
    e = to_numpy(expected)
    if g.shape != e.shape:
        return False, f"shape {g.shape}, expected {e.shape}"
    if np.isnan(g).any():
        return False, f"shape={g.shape}  {int(np.isnan(g).sum())} NaN entries"
    g_inf, e_inf = np.isinf(g), np.isinf(e)
    if (g_inf != e_inf).any():
        n = int((g_inf != e_inf).sum())
        return (
            False,
            f"shape={g.shape}  {n} entries infinite where finite values belong (or the reverse)",
        )
    if (g_inf & (g != e)).any():
        return (
            False,
            f"shape={g.shape}  infinities of the wrong sign "
            "(+inf where -inf belongs, or the reverse)",
        )
    abs_err, _ = max_error(g, e)
    fin = np.isfinite(e)  # matching infinities were checked above
    ok = bool(np.all(np.abs(g[fin] - e[fin]) <= tol.atol + tol.rtol * np.abs(e[fin])))
    return ok, f"shape={g.shape}  max|diff|={abs_err:.1e}"


def _compare(got, expected, tol: Tolerance, names: tuple[str, ...] = ()) -> tuple[bool, str]:
    """Compare an answer with the expected one; a tuple is compared part by part, each part
    named."""
    if not isinstance(expected, tuple):
        return _compare_array(got, expected, tol)
    if not isinstance(got, (tuple, list)) or len(got) != len(expected):
        what = f"{len(got)} results" if isinstance(got, (tuple, list)) else type(got).__name__
        want = f" ({', '.join(names)})" if names else ""
        return False, f"expected a tuple of {len(expected)} results{want}, got {what}"
    parts = [_compare_array(g, e, tol) for g, e in zip(got, expected)]
    labels = names if len(names) == len(expected) else [f"[{i}]" for i in range(len(expected))]
    wrong = [f"{n}: {d}" for n, (ok, d) in zip(labels, parts) if not ok]
    if wrong:
        return False, "; ".join(wrong)
    return True, "; ".join(f"{n}: {d}" for n, (_, d) in zip(labels, parts))


def _raised(e: Exception) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"raised {type(e).__name__}" + (f": {msg[:160]}" if msg else "")


def grade(
    name: str, fn: Callable, cases: list[Case], *, solution_name: str, out: Callable = print
) -> Report:
    """Run `fn` on every case and print one line each. Returns a Report (`.passed`, `.text`)."""
    if not cases:
        raise ValueError(f"grade({name!r}): no cases to run")
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
            ok, detail = False, _raised(e)
        else:
            compare = case.check or (lambda g, x: _compare(g, x, case.tol, case.names))
            ok, detail = compare(got, case.expected)
        if not ok and case.hint:
            detail = f"{detail}  <- {case.hint}"
        results.append((case.label, ok, f"{'ok' if ok else 'WRONG'}  {detail}"))
        out(f"  {case.label:<{width}}  {'ok   ' if ok else 'WRONG'}  {detail}")
    n_ok = sum(ok for _, ok, _ in results)
    verdict = "all cases pass" if n_ok == len(results) else f"{len(results) - n_ok} case(s) wrong"
    out(f"{name}: {n_ok}/{len(results)} cases passed: {verdict}")
    return Report(name, True, results)


def grader(solution_name: str):
    """Decorate a grader `g(fn, *, seed=None, out=print) -> Report` with the dotted name of its
    solution (a function in the flashedu package, e.g. "flashedu.tiled.forward")."""
    module, _, attr = solution_name.rpartition(".")
    if not module.startswith("flashedu") or not attr.isidentifier():
        raise ValueError(
            f"grader: solution_name must be a dotted flashedu function such as "
            f"'flashedu.tiled.forward', got {solution_name!r}"
        )

    def wrap(g):
        @functools.wraps(g)
        def run(fn, *args, **kwargs):
            return g(fn, *args, **kwargs)

        run.solution_name = solution_name
        return run

    return wrap


def solution_function(g) -> Callable:
    """The package function that solves the exercise graded by `g` (a grader or a dotted name)."""
    dotted = g if isinstance(g, str) else getattr(g, "solution_name", None)
    if dotted is None:
        raise TypeError(f"solution: expected a grader from flashedu.checks, got {g!r}")
    module, _, attr = dotted.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def solution(g) -> None:
    """Show the package function that solves the exercise graded by `g` (the tests cover exactly
    this code)."""
    from .. import nb

    nb.show_source(solution_function(g))


def rng_for(seed) -> np.random.Generator:
    """Fresh inputs each call unless a seed is given (tests pass one)."""
    return np.random.default_rng(seed)


def number_or_none(got) -> float | None:
    """got as a finite float, or None if it is not one."""
    try:
        g = float(got)
    except (TypeError, ValueError):
        return None
    return g if math.isfinite(g) else None


def diagnose(
    got: float, expected: float, mistakes: dict[str, float], rel: float
) -> tuple[bool, str]:
    """ok when got matches expected; otherwise name the mistake whose value got reproduces, if
    any."""
    err = abs(got - expected) / abs(expected)
    detail = f"got {got:.6g}, expected {expected:.6g} (rel. error {err:.1e})"
    if err <= rel:
        return True, detail
    for why, value in mistakes.items():
        if abs(got - value) <= rel * abs(value):
            return False, f"{detail}: {why}"
    return False, detail
