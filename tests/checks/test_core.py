"""The grading machinery (flashedu/checks/_core.py, _progress.py) and claims every chapter's graders
must meet."""

import importlib
import inspect
import json
from pathlib import Path

import numpy as np
import pytest

from flashedu import checks, nb, reference
from flashedu.checks import Case, grade, grader
from flashedu.checks._core import WIDTH, candidates
from flashedu.testing import Tolerance

ROOT = Path(__file__).resolve().parents[2]


def _lines():
    lines = []
    return lines, lines.append


def _cases(expected, **kw):
    return [Case("first", (1,), expected, **kw), Case("second", (2,), expected, **kw)]


def _stub(*args, **kwargs):
    raise NotImplementedError("Exercise 9.9: fill me in")


def test_stub_is_reported_as_not_attempted_and_nothing_else():
    lines, out = _lines()
    report = grade("toy", _stub, _cases(np.zeros(3)), out=out)
    assert not report.attempted and not report.passed and report.status == "not attempted"
    assert lines == ["toy: not attempted yet"]  # nothing that points at the answer
    assert repr(report) == "<toy: not attempted>"


def test_right_answer_passes_with_a_verdict_and_one_row_per_case():
    lines, out = _lines()
    report = grade("toy", lambda x: np.full(3, float(x)), [Case("x=1", (1,), np.ones(3))], out=out)
    assert report.passed and report.status == "passed"
    assert lines[0] == "toy: all cases pass (1 of 1)"
    assert lines[2].split() == ["1", "x=1", "ok", "max|diff|=0.0e+00"]


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
def test_a_wrong_answer_leads_with_its_case_and_one_diagnosis(answer, words):
    lines, out = _lines()
    report = grade("toy", answer, _cases(np.ones(3), hint="the likely mistake"), out=out)
    assert report.attempted and not report.passed and report.status == "wrong"
    assert lines[0] == "toy: wrong (0 of 2 cases pass)"
    assert lines[1].startswith("  case 1: first") and words in lines[1]
    assert lines[2] == "  what is wrong: the likely mistake"
    assert report.diagnosis == "the likely mistake" and report.lead == 0
    assert sum("what is wrong" in line for line in lines) == 1  # one diagnosis, not one per case


def test_the_report_fits_100_columns_and_names_the_inputs_and_seed():
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((13, 8)), rng.standard_normal((27, 8))
    cases = [
        Case("a case with a long label " * 4, (q, k), np.ones(3), hint="words " * 40),
        Case("N_q=13", (q, k), np.ones(3), kwargs={"causal": True, "block_m": 3}),
    ]
    g = grader("flashedu.tiled.forward")(
        lambda fn, *, seed=None, out=print: grade("toy", fn, cases, out=out)
    )

    def my_fn(q, k, causal=False, block_m=16):
        return np.full(3, 1.0 + 1e-3 * np.arange(3))

    lines, out = _lines()
    report = g(my_fn, seed=123, out=out)
    assert all(len(line) <= WIDTH for line in lines), max(lines, key=len)
    text = report.text
    assert "inputs: q (13, 8), k (27, 8); seed=123" in text
    assert "checks.toy(your_function, seed=123)" in text and report.seed == 123


def test_a_known_mistake_is_named_once_for_every_case_it_explains():
    x = np.arange(1.0, 4.0)
    mistakes = {"forgot to double": lambda: x, "added one": lambda: x + 1}
    cases = [
        Case("small", (x,), 2 * x, hint="hint one", mistakes=mistakes),
        Case("large", (x * 10,), 20 * x, hint="hint two", mistakes={"forgot to double": x * 10}),
    ]
    lines, out = _lines()
    report = grade("double", lambda v: v, cases, out=out)
    assert report.diagnosis == "forgot to double" and report.lead == 0
    assert "hint one" not in report.text and "hint two" not in report.text


def test_the_mistake_consistent_with_every_case_wins():
    x = np.arange(1.0, 4.0)
    # Both variants explain case 1; only "negated" also explains case 2.
    cases = [
        Case("c1", (x,), x, mistakes={"zeroed": np.zeros(3) - x, "negated": -x}),
        Case("c2", (x,), x, mistakes={"zeroed": np.zeros(3), "negated": -x}),
    ]
    report = grade("sign", lambda v: -v, cases, out=lambda s: None)
    assert report.diagnosis == "negated"


def test_candidates_let_one_mistake_have_several_outputs():
    x = np.arange(1.0, 4.0)
    cases = [Case("c", (x,), x, mistakes={"off by a block": candidates(x + 1, x + 2)})]
    report = grade("blocks", lambda v: v + 2, cases, out=lambda s: None)
    assert report.diagnosis == "off by a block"


def test_a_shortcut_is_the_diagnosis_whatever_else_is_wrong():
    def cheat(x):
        return reference.forward(x, x, x)[0]

    q = np.ones((1, 1, 2, 2))
    cases = [Case("c", (q,), q, hint="a hint"), Case("d", (q,), q)]
    report = grade("cheat", cheat, cases, out=lambda s: None, forbid=True)
    assert report.diagnosis.startswith("called flashedu.reference.forward: ")
    assert "shortcut: called flashedu.reference.forward" in report.results[0][2]


def test_infinities_must_match_in_sign():
    expected = np.array([0.5, -np.inf])  # e.g. lse with a fully masked row
    ok = grade("lse", lambda x: expected.copy(), _cases(expected), out=lambda s: None)
    wrong = grade("lse", lambda x: -expected, _cases(expected), out=lambda s: None)
    assert ok.passed and not wrong.passed
    assert "wrong sign" in wrong.text


def test_tuple_answers_name_the_part_that_is_wrong():
    o, lse = np.ones((2, 3)), np.zeros(2)
    lines, out = _lines()
    grade("pair", lambda x: (o, lse + 1), _cases((o, lse), names=("o", "lse")), out=out)
    assert "lse: max|diff|=1.0e+00" in lines[1] and "o:" not in lines[1]
    lines.clear()
    grade("pair", lambda x: o, _cases((o, lse), names=("o", "lse")), out=out)
    assert "expected a tuple of 2 results (o, lse), got ndarray" in lines[1]


def test_tolerance_and_custom_checks_are_honoured():
    near = grade(
        "tol", lambda x: np.ones(3) + 1e-4, _cases(np.ones(3), tol=Tolerance(1e-3, 0)), out=len
    )
    exact = grade(
        "int", lambda x: 7, _cases(7, check=lambda g, e: (g == e, f"{g} vs {e}")), out=len
    )
    named = grade(
        "int",
        lambda x: 8,
        _cases(7, check=lambda g, e: (g == e, f"{g} vs {e}", "one too many")),
        out=lambda s: None,
    )
    assert near.passed and exact.passed and "7 vs 7" in exact.text
    assert named.diagnosis == "one too many"


def test_a_later_not_implemented_counts_as_wrong_not_as_not_attempted():
    def partial(x):
        if x == 2:
            raise NotImplementedError
        return np.ones(3)

    report = grade("toy", partial, _cases(np.ones(3)), out=lambda s: None)
    assert report.attempted and not report.passed and "raised NotImplementedError" in report.text


def test_report_shows_nothing_in_a_notebook_and_summarises_in_its_repr():
    report = grade("toy", lambda x: np.ones(3), _cases(np.ones(3)), out=lambda s: None)
    assert report._ipython_display_() is None
    assert repr(report) == "<toy: 2/2 cases passed>"


def test_grader_rejects_a_solution_name_outside_the_package():
    with pytest.raises(ValueError, match="dotted flashedu function"):
        grader("numpy.linalg.norm")


def test_solution_shows_every_named_solution(monkeypatch):
    shown = []
    monkeypatch.setattr(nb, "show_source", shown.append)
    g = grader("flashedu.masks.visible", "flashedu.reference.forward")(
        lambda fn, *, seed=None, out=print: None
    )
    checks.solution(g)
    masks = importlib.import_module("flashedu.masks")
    assert shown == [masks.visible, reference.forward]
    with pytest.raises(TypeError, match="expected a grader"):
        checks.solution(len)


def test_hint_prints_the_formula_only_when_asked():
    g = grader("flashedu.masks.visible", formula="  y = 2 x\n  (for every x)")(
        lambda fn, *, seed=None, out=print: grade("g", fn, _cases(np.ones(3)), out=out)
    )
    lines, out = _lines()
    g(lambda x: np.zeros(3), seed=1, out=out)
    assert "y = 2 x" not in "\n".join(lines) and "checks.hint(checks.g)" in lines[5]
    lines.clear()
    checks.hint(g, out=out)
    assert lines == ["y = 2 x", "(for every x)"]
    with pytest.raises(TypeError, match="expected a grader"):
        checks.hint(len)


def test_progress_is_recorded_where_the_environment_says(tmp_path, monkeypatch):
    target = tmp_path / "progress.json"
    monkeypatch.setenv("FLASHEDU_PROGRESS", str(target))
    g = checks.GRADERS["naive_hbm_bytes"]
    g(_stub, out=lambda s: None)
    assert json.loads(target.read_text())["naive_hbm_bytes"]["status"] == "not attempted"
    lines, out = _lines()
    status = checks.progress(out=out)
    assert status["naive_hbm_bytes"] == "not attempted"
    assert lines[0].startswith("progress: 0 passed")
    assert len(lines) == 1 + len(checks.GRADERS)


def test_nothing_is_recorded_under_pytest_without_the_variable(monkeypatch):
    from flashedu.checks import _progress

    monkeypatch.delenv("FLASHEDU_PROGRESS", raising=False)
    assert _progress.path() is None


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
    for dotted in getattr(g, "solution_names", (g.solution_name,)):
        assert callable(checks.solution_function(dotted)), f"{name}: {dotted} is not callable"
    assert (g.__doc__ or "").strip(), f"{name}: the docstring is the exercise's spec; it is empty"


@pytest.mark.parametrize("name", GRADER_NAMES)
def test_every_grader_reports_an_unattempted_stub_without_raising(name):
    lines, out = _lines()
    report = checks.GRADERS[name](_stub, seed=0, out=out)
    assert not report.attempted
    assert lines == [f"{name}: not attempted yet"]


@pytest.mark.parametrize("module", sorted({checks.CHAPTER_OF[n] for n in GRADER_NAMES}))
def test_every_grader_module_has_its_tests(module):
    nn = module.rsplit(".ch", 1)[1]
    assert (ROOT / "tests" / "checks" / f"test_ch{nn}.py").exists(), (
        f"{module} has no tests/checks/test_ch{nn}.py"
    )


def test_an_answer_the_check_cannot_compare_is_reported_not_raised():
    def check(got, expected):
        return bool(got == expected), "compared"  # ambiguous for an array

    report = grade("kind", lambda x: np.zeros(3), _cases("full", check=check), out=len)
    assert not report.passed and "an answer of type ndarray" in report.text


@pytest.mark.parametrize("name", GRADER_NAMES)
def test_every_report_fits_100_columns(name):
    def crash(*args, **kwargs):
        return 1 / 0

    lines, out = _lines()
    checks.GRADERS[name](crash, seed=1, out=out)
    assert all(len(line) <= WIDTH for line in lines), max(lines, key=len)
