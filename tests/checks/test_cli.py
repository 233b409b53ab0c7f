"""The command-line grader (`python -m flashedu.checks NOTEBOOK...`): a scorecard per notebook and
an exit status that fails only when an attempted exercise is wrong. Each test executes a notebook
in a fresh kernel (tens of seconds on two cores), so only the small fixture and one chapter run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from flashedu.checks import __main__ as cli

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "graded_exercises.ipynb"


def _grade(*notebooks, tmp_path):
    """Run the command as a learner would; (exit status, stdout lines)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLASHEDU_PROGRESS": str(tmp_path / "mine.json")}
    done = subprocess.run(
        [sys.executable, "-m", "flashedu.checks", *map(str, notebooks), "--timeout", "300"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return done.returncode, done.stdout.splitlines()


def test_exercises_are_read_from_the_notebooks_calls_and_headings():
    nb = nbformat.read(FIXTURE, as_version=4)
    assert cli.exercises(nb) == [
        ("1.2", "naive_hbm_bytes"),
        ("2.2", "merge_states"),
        ("4.1", "softmax_backward"),
    ]


@pytest.mark.slow
def test_a_solved_and_a_wrong_exercise_are_both_reported_and_fail_the_run(tmp_path):
    status, lines = _grade(FIXTURE, tmp_path=tmp_path)
    assert status == 1, lines
    assert [line.split() for line in lines[1:4]] == [
        ["1.2", "naive_hbm_bytes", "passed"],
        ["2.2", "merge_states", "wrong", "(2/5", "cases)"],
        ["4.1", "softmax_backward", "not", "attempted"],
    ]
    assert lines[-1] == "1 passed, 1 wrong, 1 not attempted, 0 not run"
    assert not (tmp_path / "mine.json").exists()  # the learner's own record is left alone


@pytest.mark.slow
def test_a_committed_chapter_is_all_not_attempted_and_passes(tmp_path):
    status, lines = _grade(ROOT / "notebooks" / "02_online_softmax.ipynb", tmp_path=tmp_path)
    assert status == 0, lines
    assert lines[1].split() == ["2.1", "online_softmax", "not", "attempted"]
    assert lines[2].split() == ["2.2", "merge_states", "not", "attempted"]


def test_a_cell_that_raises_is_listed_and_fails_the_run(tmp_path, capsys):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nb.cells = [nbformat.v4.new_code_cell("from flashedu import checks\n1 / 0")]
    path = tmp_path / "broken.ipynb"
    nbformat.write(nb, path)
    before = os.environ.get("FLASHEDU_PROGRESS")
    assert cli.main([str(path), "--timeout", "120"]) == 1
    assert os.environ.get("FLASHEDU_PROGRESS") == before  # restored after the run
    out = capsys.readouterr().out
    assert "(no graded exercises)" in out and "cell 0 raised ZeroDivisionError" in out


def test_a_missing_notebook_is_a_usage_error(tmp_path):
    with pytest.raises(SystemExit) as e:
        cli.main([str(tmp_path / "nope.ipynb")])
    assert e.value.code == 2
