"""The grading machinery shared by every chapter's graders: `Case`, `grade`, `grader`, `solution`.

A chapter's grader builds a list of `Case`s, simplest first, from fresh ragged inputs (seeded: the
`grader` decorator draws a seed when none is given, and a failing report prints it), with the
expected answer from the float64 reference, and hands them to `grade`. `grade` calls the learner's
function on each case and prints a compact report, at most 100 columns wide, that leads with one
failure and ONE diagnosis:

    tiled_attention: wrong (1 of 7 cases pass)
      case 2: N_q=13, N_k=27, blocks 3x5
        o: max|diff|=3.1e-01
      what is wrong: the running sum and the accumulator were not rescaled when the row max grew
      inputs: q (13, 8), k (27, 8), v (27, 8), causal=False, block_m=3, block_n=5; seed=48213
       #  case                             result
       1  one tile holds everything        ok     o: max|diff|=2.2e-16; lse: max|diff|=4.4e-16
       2  N_q=13, N_k=27, blocks 3x5       WRONG  o: max|diff|=3.1e-01
      ...

The diagnosis comes, in this order, from a shortcut (`Shortcut`, raised by `_method`'s guards: a
call into flashedu, an N_q x N_k array, a second pass), from mistake matching (the answer equals
the output of a known buggy variant listed in `Case.mistakes`; the name most consistent with every
case wins), from the case's own check, or else from the failing case's `hint` (what is wrong, never
the formula). The formula comes only with `hint(grader)`, the package's answer only with
`solution(grader)`. A stub that raises NotImplementedError on the first case prints "<name>: not
attempted yet" and nothing else, so the committed notebooks run under nbval with their exercises
open. Every graded run is recorded for `progress()` (see `_progress.py`); the report's layout and
the mistake matching are in `_report.py`.

Used from every notebook's exercises (first in notebooks/01_naive_attention.ipynb); tested in
tests/checks/test_core.py.

Limits: comparisons are elementwise against a tolerance, so an answer that is right only up to a
permutation fails; a grader that needs another notion of right passes `Case.check`.
"""

from __future__ import annotations

import contextvars
import functools
import math
import secrets
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..testing import Tolerance, max_error, to_numpy
from . import _progress
from ._limits import (
    TimeLimitExceeded,
    case_seconds,
    on_copies,
    seconds_per_case,
    time_limit,
    watched,
)
from ._method import forbid_flashedu
from ._report import WIDTH, candidates, choose, lead_block, same, table  # noqa: F401
from ._shared import Shortcut, solution_function


@dataclass
class Case:
    """One input for a learner's function.

    label: what the case tries, e.g. "N_q=5 > N_k=3, causal".
    expected: the right answer (an array, a tuple of arrays, or a number).
    hint: what is wrong when this case fails and no known mistake matches (never the formula).
    check: optional comparison (got, expected) -> (ok, detail) or (ok, detail, diagnosis).
    names: names of the parts of a tuple answer, e.g. ("o", "lse").
    mistakes: known bugs, {what is wrong: the output of the buggy variant on this input}; a value
        may be a zero-argument function (computed only when needed) or `candidates(a, b, ...)`.
    inputs: how to reproduce the case, printed on failure (default: from args and kwargs).
    call: optional runner `call(fn) -> got` replacing fn(*args, **kwargs) (streams, watchers).
    """

    label: str
    args: tuple
    expected: Any
    hint: str = ""
    kwargs: dict = field(default_factory=dict)
    tol: Tolerance = Tolerance(1e-6, 1e-6)
    check: Callable[[Any, Any], tuple] | None = None
    names: tuple[str, ...] = ()
    mistakes: dict[str, Any] = field(default_factory=dict)
    inputs: str = ""
    call: Callable[[Callable], Any] | None = None


@dataclass
class Report:
    name: str
    attempted: bool
    results: list[tuple[str, bool, str]]  # (label, ok, detail)
    diagnosis: str = ""
    lead: int | None = None  # index of the case the report leads with
    seed: int | None = None
    lines: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.attempted and bool(self.results) and all(ok for _, ok, _ in self.results)

    @property
    def status(self) -> str:
        """'passed', 'wrong' or 'not attempted'."""
        return "passed" if self.passed else "wrong" if self.attempted else "not attempted"

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def _ipython_display_(self) -> None:
        """Show nothing: the grader already printed its lines. (A trailing `;` does not reliably
        silence a cell's result under nbval, so the report silences itself.)"""

    def __repr__(self) -> str:
        if not self.attempted:
            return f"<{self.name}: not attempted>"
        n_ok = sum(ok for _, ok, _ in self.results)
        return f"<{self.name}: {n_ok}/{len(self.results)} cases passed>"


# ---------------------------------------------------------------------------- comparing answers


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
        return False, f"{int(np.isnan(g).sum())} NaN entries"
    g_inf, e_inf = np.isinf(g), np.isinf(e)
    if (g_inf != e_inf).any():
        n = int((g_inf != e_inf).sum())
        return False, f"{n} entries infinite where finite values belong (or the reverse)"
    if (g_inf & (g != e)).any():
        return False, "infinities of the wrong sign (+inf where -inf belongs, or the reverse)"
    abs_err, _ = max_error(g, e)
    fin = np.isfinite(e)  # matching infinities were checked above
    ok = bool(np.all(np.abs(g[fin] - e[fin]) <= tol.atol + tol.rtol * np.abs(e[fin])))
    return ok, f"max|diff|={abs_err:.1e}"


def compare(got, expected, tol: Tolerance, names: tuple[str, ...] = ()) -> tuple[bool, str]:
    """(ok, detail): an answer against the expected one within `tol`; a tuple is compared part by
    part, each part named. What `grade` does when a case has no `check`; a grader's own check
    calls it on the parts it compares."""
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


def _raised(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"raised {type(e).__name__}" + (f": {msg[:160]}" if msg else "")


# ---------------------------------------------------------------------------- running the cases


@dataclass
class _Outcome:
    ok: bool
    detail: str
    got: Any = None
    shortcut: str = ""
    diagnosis: str = ""  # from the case's own check
    ran: bool = False  # fn returned (got is its answer)


_CALLED = "the exercise asks for your own code, so flashedu's implementations are off limits"


class _ChangedInput(Exception):
    """The learner's function wrote into one of its inputs (the argument's name)."""


def _call(fn, case: Case):
    """fn on the case within the time limit, on copies of the case's inputs (a case with its own
    runner hands over its own, compared afterwards); raises _ChangedInput for a function that
    wrote into one."""
    with time_limit(case_seconds()):
        if case.call:
            got, changed = watched(fn, case.call, case.args, case.kwargs)
        else:
            got, changed = on_copies(fn, case.args, case.kwargs)
    if changed:
        raise _ChangedInput(changed)
    return got


def _timed_out(cases: list[Case], i: int) -> list[_Outcome]:
    """Outcomes for case i, stopped at the time limit, and for the cases after it (not run)."""
    limit = case_seconds()
    why = (
        f"case {i + 1} ({cases[i].label}) was still running after {limit:g} s and was stopped: "
        "an endless loop, or far more work than the case needs? (the limit is per case; "
        "time_limit=SECONDS changes it)"
    )
    rest = [_Outcome(False, "not run: an earlier case timed out") for _ in cases[i + 1 :]]
    return [_Outcome(False, f"timed out after {limit:g} s", shortcut=why), *rest]


def _run(fn, case: Case, forbid: bool, allow) -> _Outcome:
    try:
        if forbid:
            with forbid_flashedu(allow):
                got = _call(fn, case)
        else:
            got = _call(fn, case)
    except _ChangedInput as e:
        why = (
            f"it changed its input {e} in place; a caller's arrays must stay as they were "
            "(work on a copy, or write into new arrays)"
        )
        return _Outcome(False, f"changed its input {e}", shortcut=why)
    except Shortcut as e:
        why = f"{e}: {_CALLED}" if str(e).startswith("called flashedu") else str(e)
        return _Outcome(False, f"shortcut: {e}", shortcut=why)
    except NotImplementedError:
        raise
    except Exception as e:  # the learner's bug, reported, not raised
        return _Outcome(False, _raised(e))
    try:
        check = case.check or (lambda g, x: compare(g, x, case.tol, case.names))
        result = check(got, case.expected)
    except Exception as e:  # an answer of a kind the check cannot even compare
        return _Outcome(False, f"an answer of type {type(got).__name__} ({_raised(e)})", got)
    ok, detail = result[0], result[1]
    diagnosis = result[2] if len(result) > 2 else getattr(detail, "mistake", "")
    return _Outcome(bool(ok), str(detail), got, diagnosis=diagnosis or "", ran=True)


def grade(
    name: str,
    fn: Callable,
    cases: list[Case],
    *,
    solution_name: str = "",
    out: Callable = print,
    forbid: bool = False,
    allow: tuple[str, ...] = (),
) -> Report:
    """Run `fn` on every case (simplest first) and print the report. Returns a Report.

    forbid: run fn under `forbid_flashedu(allow)`, so a call into flashedu's own implementations
    is a named shortcut. solution_name is kept for older callers; the report never prints it.
    """
    if not cases:
        raise ValueError(f"grade({name!r}): no cases to run")
    outcomes: list[_Outcome] = []
    for i, case in enumerate(cases):
        try:
            outcomes.append(_run(fn, case, forbid, allow))
        except NotImplementedError:
            if i == 0:
                out(f"{name}: not attempted yet")
                return Report(name, False, [], lines=[f"{name}: not attempted yet"])
            outcomes.append(_Outcome(False, "raised NotImplementedError"))
        except TimeLimitExceeded:
            outcomes += _timed_out(cases, i)
            break
    run = _RUN.get(None)
    seed, formula = (run.seed, run.formula) if run else (None, "")
    results = [(c.label, r.ok, r.detail) for c, r in zip(cases, outcomes)]
    n_ok = sum(r.ok for r in outcomes)
    if n_ok == len(cases):
        lines = [f"{name}: all cases pass ({n_ok} of {n_ok})"] + table(cases, outcomes)
        report = Report(name, True, results, seed=seed, lines=lines)
    else:
        lead, diagnosis = choose(cases, outcomes)
        lines = [f"{name}: wrong ({n_ok} of {len(cases)} cases pass)"]
        lines += lead_block(name, fn, cases, outcomes, lead, diagnosis, seed, formula)
        lines += table(cases, outcomes)
        report = Report(name, True, results, diagnosis, lead, seed, lines)
    for line in report.lines:
        out(line)
    return report


# ---------------------------------------------------------------------------- graders, hints


@dataclass
class _Run:
    seed: int
    formula: str


_RUN: contextvars.ContextVar[_Run] = contextvars.ContextVar("flashedu_grading_run")


def _check_dotted(dotted: str) -> None:
    module, _, attr = dotted.rpartition(".")
    if not module.startswith("flashedu") or not attr.isidentifier():
        raise ValueError(
            f"grader: solution_name must be a dotted flashedu function such as "
            f"'flashedu.tiled.forward', got {dotted!r}"
        )


def grader(solution_name: str, *more_solutions: str, formula: str = ""):
    """Decorate a grader `g(fn, *, seed=None, out=print) -> Report`.

    solution_name (and more_solutions): dotted names of the package code that solves the exercise,
    shown by `solution(g)`. formula: the rule the exercise asks for, shown only by `hint(g)`.
    The decorated grader draws a seed when none is given (so a failing report can print it) and
    records the outcome for `progress()`. It takes `time_limit=SECONDS` per case (`_limits.py`:
    a function still running at the limit is stopped and the case reported as timed out).
    """
    for dotted in (solution_name, *more_solutions):
        _check_dotted(dotted)

    def wrap(g):
        @functools.wraps(g)
        def run(fn, *args, seed=None, out=print, time_limit=None, **kwargs):
            seed = secrets.randbelow(10**6) if seed is None else seed
            token = _RUN.set(_Run(seed, run.formula))
            try:
                with seconds_per_case(time_limit, g.__module__):
                    report = g(fn, *args, seed=seed, out=out, **kwargs)
            finally:
                _RUN.reset(token)
            _progress.record(run.__name__, g.__module__, report, say=out)
            return report

        run.solution_name = solution_name
        run.solution_names = (solution_name, *more_solutions)
        run.formula = textwrap.dedent(formula).strip()
        return run

    return wrap


def solution(g) -> None:
    """Show the package code that solves the exercise graded by `g` (the tests cover exactly
    this code)."""
    from .. import nb

    names = getattr(g, "solution_names", None)
    if names is None:
        nb.show_source(solution_function(g))  # raises the TypeError for a non-grader
        return
    for dotted in names:
        nb.show_source(solution_function(dotted))


def hint(g, out: Callable = print) -> None:
    """Print the formula behind the exercise graded by `g`: the second step after the report."""
    if not hasattr(g, "solution_name"):
        raise TypeError(f"hint: expected a grader from flashedu.checks, got {g!r}")
    text = getattr(g, "formula", "") or (
        "This exercise has no formula beyond its description; "
        f"checks.solution(checks.{g.__name__}) shows the package's answer."
    )
    for line in text.splitlines():
        out(line)


# ---------------------------------------------------------------------------- small helpers


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


def exact_bytes(got, expected) -> tuple[bool, str]:
    """(ok, detail) for a byte count that must be exact: got and expected as ints, detail in
    bytes. A `Case.check` for the HBM byte exercises."""
    try:
        ok = int(got) == int(expected)
    except (TypeError, ValueError):
        return False, f"expected an int, got {got!r}"
    return ok, f"{int(got):,} bytes" + ("" if ok else f", expected {int(expected):,}")


class _Detail(str):
    """A case's detail line that also names the mistake it found (read by `grade`)."""

    mistake = ""


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
            named = _Detail(f"{detail}: {why}")
            named.mistake = why
            return False, named
    return False, detail
