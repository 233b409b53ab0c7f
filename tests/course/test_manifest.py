"""The course check (`python -m flashedu.course check`): the real course passes, and each kind of
inconsistency, planted in a small copy of a course, is reported by a sentence that names it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flashedu import course
from flashedu.course import __main__ as course_cli

ROOT = Path(__file__).resolve().parents[2]

# A one-chapter course built on real package modules: flashedu.nb names
# notebooks/00_memory_hierarchy.ipynb and flashedu.checks.ch00 exports chapter 00's graders.
TOML = (ROOT / "tests" / "fixtures" / "toy_book.toml").read_text()
FIRST = (
    "# 00 · The GPU memory hierarchy\n\n- Tell HBM from SRAM\n- Place a kernel on a roofline\n\n"
    "Estimated time: 25 minutes"
)
EXERCISES = (
    'def f(M, N, K, itemsize):\n    raise NotImplementedError("Exercise 0.1: one line")\n'
    "checks.check_matmul_intensity(f)\n"
    'def g(N, d, gpu, itemsize):\n    raise NotImplementedError("Exercise 0.2: two lines")\n'
    "checks.check_naive_attention_time(g)\n"
)


def _notebook(first=FIRST, code=EXERCISES, first_type="markdown"):
    cells = [
        {"cell_type": first_type, "metadata": {}, "source": first},
        {
            "cell_type": "code",
            "metadata": {},
            "source": code,
            "outputs": [],
            "execution_count": None,
        },
        {
            "cell_type": "markdown",
            "metadata": {},
            "source": "Stuck? `checks.solution(checks.check_matmul_intensity)`",
        },
    ]
    return {"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


@pytest.fixture
def toy(tmp_path):
    """A consistent one-chapter course in tmp_path; tests break one thing each."""
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "tests" / "checks").mkdir(parents=True)
    (tmp_path / "tests" / "checks" / "test_ch00.py").write_text("")
    (tmp_path / "book.toml").write_text(TOML)
    (tmp_path / "notebooks" / "00_memory_hierarchy.ipynb").write_text(json.dumps(_notebook()))
    return tmp_path


def _only(problems, *words):
    assert len(problems) == 1, problems
    for w in words:
        assert w in problems[0], problems[0]
    return problems[0]


def test_the_course_is_consistent():
    problems = course.check()
    assert problems == [], "\n".join(problems)


def test_the_toy_course_is_consistent(toy):
    assert course.check(toy) == []


def test_manifest_lists_the_chapters_in_order():
    _, chapters = course.load()
    assert len(chapters) >= 10
    assert [c.id[:2] for c in chapters] == [f"{i:02d}" for i in range(len(chapters))]


@pytest.mark.parametrize(
    "edit,words",
    [
        (("minutes = 25", "minutes = 0"), ["minutes must be a positive whole number, got 0"]),
        (
            (
                'objectives = ["Tell HBM from SRAM", "Place a kernel on a roofline"]',
                "objectives = []",
            ),
            ["objectives is empty"],
        ),
        (("minutes = 25\n", ""), ["lacks minutes"]),
        (('title = "Toy course"', ""), ["[book] table needs a title"]),
        (('id = "00-memory-hierarchy"', 'id = "memory"'), ["id 'memory' should start with '00-'"]),
        (
            ('modules = ["flashedu.nb"]', 'modules = ["flashedu.nope"]'),
            ["module flashedu.nope does not import"],
        ),
        (
            ('modules = ["flashedu.nb"]', 'modules = ["flashedu.reference"]'),
            [
                "docstring of flashedu.reference names notebooks/01_naive_attention.ipynb, "
                "which book.toml does not list"
            ],
        ),
    ],
)
def test_manifest_problems_are_named(toy, edit, words):
    (toy / "book.toml").write_text(TOML.replace(*edit))
    _only(course.check(toy), *words)


def test_notebooks_on_disk_and_in_the_manifest_must_agree(toy):
    (toy / "notebooks" / "05_extra.ipynb").write_text(json.dumps(_notebook()))
    _only(course.check(toy), "notebooks/05_extra.ipynb is not listed in book.toml")
    (toy / "notebooks" / "05_extra.ipynb").unlink()
    (toy / "notebooks" / "00_memory_hierarchy.ipynb").unlink()
    _only(
        course.check(toy),
        "chapter 00 (00-memory-hierarchy): "
        "notebook notebooks/00_memory_hierarchy.ipynb does not exist",
    )


@pytest.mark.parametrize(
    "first,first_type,words",
    [
        (FIRST, "code", ["must be markdown", "it is a code cell"]),
        (
            FIRST.replace("Place a kernel", "Put a kernel"),
            "markdown",
            ["objective 'Place a kernel on a roofline'"],
        ),
        (FIRST.replace("25 minutes", "20 minutes"), "markdown", ["'Estimated time: 25 minutes'"]),
        (
            FIRST.replace("The GPU memory hierarchy", "Memory"),
            "markdown",
            ["title 'The GPU memory hierarchy'"],
        ),
    ],
)
def test_first_cell_must_state_title_objectives_and_minutes(toy, first, first_type, words):
    (toy / "notebooks" / "00_memory_hierarchy.ipynb").write_text(
        json.dumps(_notebook(first, first_type=first_type))
    )
    _only(course.check(toy), "chapter 00", *words)


def test_a_broken_notebook_file_is_reported_not_raised(toy):
    (toy / "notebooks" / "00_memory_hierarchy.ipynb").write_text("{not json")
    _only(course.check(toy), "00_memory_hierarchy.ipynb is not valid JSON")


@pytest.mark.parametrize(
    "code,words",
    [
        (
            EXERCISES.replace("checks.check_naive_attention_time(g)", ""),
            ["calls 1 of its graders (check_matmul_intensity)"],
        ),
        (
            EXERCISES.replace('raise NotImplementedError("Exercise 0.2: two lines")', "return 0"),
            ["has 1 exercise stub(s)"],
        ),
    ],
)
def test_each_chapter_needs_two_graded_exercises(toy, code, words):
    (toy / "notebooks" / "00_memory_hierarchy.ipynb").write_text(json.dumps(_notebook(code=code)))
    _only(course.check(toy), "chapter 00", *words)


def test_graders_need_tests_and_the_solution_must_be_shown(toy):
    (toy / "tests" / "checks" / "test_ch00.py").unlink()
    _only(course.check(toy), "tests/checks/test_ch00.py is missing")
    (toy / "tests" / "checks" / "test_ch00.py").write_text("")
    nb = _notebook()
    nb["cells"].pop()
    (toy / "notebooks" / "00_memory_hierarchy.ipynb").write_text(json.dumps(nb))
    _only(course.check(toy), "never shows how to reveal a solution")


def test_command_line_lists_chapters_and_rejects_unknown_commands():
    proc = subprocess.run(
        [sys.executable, "-m", "flashedu.course", "list"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    assert proc.stdout.splitlines()[0].startswith("00-memory-hierarchy")
    for bad in (["frobnicate"], ["check", "--bogus"], ["list", "extra"]):
        with pytest.raises(SystemExit) as exit_:
            course_cli.main(bad)
        assert exit_.value.code == 2


def test_book_command_hands_its_flags_to_the_builder(monkeypatch):
    from flashedu.course import book

    seen = []
    monkeypatch.setattr(book, "main", lambda argv: seen.append(argv) or 0)
    assert course_cli.main(["book", "--no-execute", "--all"]) == 0
    assert seen == [["--no-execute", "--all"]]


def test_notebooks_command_is_the_manifest_in_order(capsys):
    """The Makefile takes its notebook list from here: book.toml has one reader."""
    assert course_cli.main(["notebooks"]) == 0
    listed = capsys.readouterr().out.split()
    assert listed == [c.notebook for c in course.load()[1]] == course.notebooks()
    assert listed[0].startswith("notebooks/00_") and all(p.endswith(".ipynb") for p in listed)


def test_exercise_stubs_are_raising_functions_and_kernels_that_store_nothing():
    src = """
%matplotlib inline
def my_softmax(x):
    raise NotImplementedError("Exercise 2.1: three lines")

def helper(x):
    raise NotImplementedError("not an exercise")

@triton.jit
def my_kernel(X, Y, N):
    x = tl.load(X + tl.arange(0, 16))   # yours: the store

@triton.jit
def done_kernel(X, Y, N):
    tl.store(Y, tl.load(X))

@triton.jit
def atomic_kernel(X, Y, N):
    tl.atomic_add(Y, tl.load(X))
"""
    assert course.exercise_stubs(src) == {"my_softmax", "my_kernel"}
    assert course.exercise_stubs("def broken(:\n") == set()
