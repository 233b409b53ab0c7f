"""The grading machinery (flashedu/checks/_core.py) and claims every chapter's graders must meet."""

import importlib
import inspect
from pathlib import Path

import numpy as np
import pytest

from flashedu import checks, nb
from flashedu.checks import Case, grade, grader
from flashedu.testing import Tolerance

ROOT = Path(__file__).resolve().parent.parent


def _lines():
    lines = []
    return lines, lines.append


def _cases(expected, **kw):
    return [Case("first", (1,), expected, **kw), Case("second", (2,), expected, **kw)]


def _stub(*args, **kwargs):
    raise NotImplementedError("Exercise 9.9: fill me in")


def test_stub_is_reported_as_not_attempted_and_nothing_else():
    lines, out = _lines()
    report = grade(
        "toy", _stub, _cases(np.zeros(3)), solution_name="flashedu.naive.forward", out=out
    )
    assert not report.attempted and not report.passed
    assert lines == ["toy: not attempted yet (reference: flashedu.naive.forward)"]
    assert repr(report) == "<toy: not attempted>"


def test_right_answer_passes_with_one_line_per_case_and_a_verdict():
    lines, out = _lines()
    report = grade(
        "toy",
        lambda x: np.full(3, float(x)),
        [Case("x=1", (1,), np.ones(3))],
        solution_name="flashedu.naive.forward",
        out=out,
    )
    assert report.passed
    assert lines[0].split() == ["x=1", "ok", "shape=(3,)", "max|diff|=0.0e+00"]
    assert lines[-1] == "toy: 1/1 cases passed: all cases pass"


@pytest.mark.parametrize(
    "answer,words",
    [
        (lambda x: np.ones(4), "shape (4,), expected (3,)"),
        (lambda x: np.array([1.0, np.nan, np.nan]), "2 NaN entries"),
        (lambda x: np.array([1.0, np.inf, 0.0]), "infinite where finite values belong"),
        (lambda x: np.ones(3) * 1.1, "max|diff|=1.0e-01"),
        (lambda x: None, "returned None"),
        (lambda x: "one", "expected an array or a number"),
        (lambda x: [][1], "raised IndexError: list index out of range"),
    ],
)
def test_wrong_answers_say_what_is_wrong_and_give_the_hint(answer, words):
    lines, out = _lines()
    report = grade(
        "toy",
        answer,
        _cases(np.ones(3), hint="the likely mistake"),
        solution_name="flashedu.naive.forward",
        out=out,
    )
    assert report.attempted and not report.passed
    assert words in lines[0] and "WRONG" in lines[0] and lines[0].endswith("<- the likely mistake")
    assert lines[-1] == "toy: 0/2 cases passed: 2 case(s) wrong"


def test_infinities_must_match_in_sign():
    expected = np.array([0.5, -np.inf])  # e.g. lse with a fully masked row
    ok = grade(
        "lse",
        lambda x: expected.copy(),
        _cases(expected),
        solution_name="flashedu.naive.forward",
        out=lambda s: None,
    )
    wrong = grade(
        "lse",
        lambda x: -expected,
        _cases(expected),
        solution_name="flashedu.naive.forward",
        out=lambda s: None,
    )
    assert ok.passed and not wrong.passed
    assert "wrong sign" in wrong.text


def test_tuple_answers_name_the_part_that_is_wrong():
    o, lse = np.ones((2, 3)), np.zeros(2)
    lines, out = _lines()
    grade(
        "pair",
        lambda x: (o, lse + 1),
        _cases((o, lse), names=("o", "lse")),
        solution_name="flashedu.naive.forward",
        out=out,
    )
    assert "lse: shape=(2,)  max|diff|=1.0e+00" in lines[0] and "o:" not in lines[0]
    lines.clear()
    grade(
        "pair",
        lambda x: o,
        _cases((o, lse), names=("o", "lse")),
        solution_name="flashedu.naive.forward",
        out=out,
    )
    assert "expected a tuple of 2 results (o, lse), got ndarray" in lines[0]


def test_tolerance_and_custom_check_are_honoured():
    near = grade(
        "tol",
        lambda x: np.ones(3) + 1e-4,
        _cases(np.ones(3), tol=Tolerance(1e-3, 0)),
        solution_name="flashedu.naive.forward",
        out=lambda s: None,
    )
    exact = grade(
        "int",
        lambda x: 7,
        _cases(7, check=lambda g, e: (g == e, f"{g} vs {e}")),
        solution_name="flashedu.naive.forward",
        out=lambda s: None,
    )
    assert near.passed and exact.passed and "7 vs 7" in exact.text


def test_a_later_not_implemented_counts_as_wrong_not_as_not_attempted():
    def partial(x):
        if x == 2:
            raise NotImplementedError
        return np.ones(3)

    report = grade(
        "toy",
        partial,
        _cases(np.ones(3)),
        solution_name="flashedu.naive.forward",
        out=lambda s: None,
    )
    assert report.attempted and not report.passed and "raised NotImplementedError" in report.text


def test_report_shows_nothing_in_a_notebook_and_summarises_in_its_repr():
    report = grade(
        "toy",
        lambda x: np.ones(3),
        _cases(np.ones(3)),
        solution_name="flashedu.naive.forward",
        out=lambda s: None,
    )
    assert report._ipython_display_() is None
    assert repr(report) == "<toy: 2/2 cases passed>"


def test_grader_rejects_a_solution_name_outside_the_package():
    with pytest.raises(ValueError, match="dotted flashedu function"):
        grader("numpy.linalg.norm")


def test_solution_shows_the_package_source(monkeypatch):
    shown = []
    monkeypatch.setattr(nb, "show_source", shown.append)
    g = grader("flashedu.masks.visible")(lambda fn, *, seed=None, out=print: None)
    checks.solution(g)
    assert shown == [importlib.import_module("flashedu.masks").visible]
    with pytest.raises(TypeError, match="expected a grader"):
        checks.solution(len)


# ------------------------------------------------------------- claims about every registered grader


GRADER_NAMES = sorted(checks.GRADERS)


def test_graders_are_registered_for_several_chapters():
    assert len({checks.CHAPTER_OF[name] for name in GRADER_NAMES}) >= 2


@pytest.mark.parametrize("name", GRADER_NAMES)
def test_every_grader_takes_seed_and_out_and_names_a_real_solution(name):
    g = checks.GRADERS[name]
    params = inspect.signature(g).parameters
    assert "seed" in params and params["seed"].default is None, (
        f"{name}: needs seed=None (fresh inputs by default)"
    )
    assert "out" in params, f"{name}: needs out= so tests can capture its lines"
    assert callable(checks.solution_function(g)), (
        f"{name}: solution {g.solution_name} is not callable"
    )
    assert (g.__doc__ or "").strip(), f"{name}: the docstring is the exercise's spec; it is empty"


@pytest.mark.parametrize("name", GRADER_NAMES)
def test_every_grader_reports_an_unattempted_stub_without_raising(name):
    lines, out = _lines()
    report = checks.GRADERS[name](_stub, seed=0, out=out)
    assert not report.attempted
    assert lines == [f"{name}: not attempted yet (reference: {checks.GRADERS[name].solution_name})"]


@pytest.mark.parametrize("module", sorted({checks.CHAPTER_OF[n] for n in GRADER_NAMES}))
def test_every_grader_module_has_its_tests(module):
    nn = module.rsplit(".ch", 1)[1]
    assert (ROOT / "tests" / f"test_checks_ch{nn}.py").exists(), (
        f"{module} has no tests/test_checks_ch{nn}.py"
    )
