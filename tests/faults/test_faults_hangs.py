"""Faults that could hang a notebook or the checks CLI, or end it in a traceback: a learner's
function that never returns (in a grader, in a notebook cell), a kernel that dies, notebooks that
are not notebooks, and a benchmark size that would exhaust memory. Each must end, within its
limit, with one line that names the cause.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import nbformat
import numpy as np
import pytest

from flashedu import checks
from flashedu.checks import __main__ as cli
from flashedu.checks import _limits

LIMIT = 0.3  # seconds per case in these tests


def _forever(*args, **kwargs):
    while True:
        pass


def _forever_swallowing(*args, **kwargs):
    while True:
        try:
            while True:
                pass
        except BaseException:  # a learner's catch-all must not defeat the limit
            pass


def _sleeps(*args, **kwargs):
    time.sleep(3600)


@pytest.mark.parametrize("fn", [_forever, _forever_swallowing, _sleeps], ids=lambda f: f.__name__)
def test_an_endless_function_is_stopped_and_the_case_named(fn):
    lines = []
    t0 = time.perf_counter()
    report = checks.naive_attention(fn, seed=0, out=lines.append, time_limit=LIMIT)
    assert time.perf_counter() - t0 < 10 * LIMIT + 2
    assert report.status == "wrong" and report.lead == 0
    assert "timed out after 0.3 s" in lines[1] and "case 1 (one query, one key)" in report.text
    assert "time_limit=SECONDS" in report.text
    assert [d for _, _, d in report.results[1:]] == ["not run: an earlier case timed out"] * (
        len(report.results) - 1
    )


def _attention(q, k, v, causal=False):
    """A learner's honest naive attention."""
    d, N_q, N_k = q.shape[-1], q.shape[-2], k.shape[-2]
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(d)
    if causal:
        s = np.where(np.arange(N_k)[None, :] <= np.arange(N_q)[:, None] + N_k - N_q, s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ v


@pytest.mark.parametrize("fn", [_forever, _forever_swallowing], ids=lambda f: f.__name__)
def test_the_kernel_stays_usable_after_a_timeout(fn):
    trace = sys.gettrace()
    checks.naive_attention(fn, seed=1, out=lambda line: None, time_limit=LIMIT)
    assert sys.gettrace() is trace  # the escalation's tracer is gone
    report = checks.naive_attention(_attention, seed=1, out=lambda line: None)
    assert report.status == "passed"  # nothing left armed: the next grader runs as usual
    time.sleep(2 * LIMIT)  # and no stray alarm fires afterwards


def test_a_function_that_finishes_within_the_limit_is_not_stopped():
    def slow_but_in_time(*args, **kwargs):
        time.sleep(0.05)
        raise ValueError("wrong, but it returned")

    report = checks.naive_attention(slow_but_in_time, seed=0, out=lambda line: None, time_limit=1)
    assert {d for _, _, d in report.results} == {"raised ValueError: wrong, but it returned"}


OFF_MAIN_THREAD = """
import threading
from flashedu import checks

def forever(*args, **kwargs):
    while True:
        pass

found = {}

def grade():
    found["report"] = checks.naive_attention(forever, seed=0, out=lambda line: None, time_limit=0.3)

t = threading.Thread(target=grade)
t.start()
t.join(30)
print("alive" if t.is_alive() else found["report"].results[0][2])
"""


def test_the_limit_also_works_off_the_main_thread():
    """In a process of its own: a grading thread stopped by an asynchronous exception leaves no
    state behind that another test could trip over."""
    proc = subprocess.run(
        [sys.executable, "-c", OFF_MAIN_THREAD], capture_output=True, text=True, timeout=120
    )
    assert proc.stdout.strip().splitlines()[-1:] == ["timed out after 0.3 s"], proc.stderr[-2000:]


def test_the_limit_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(_limits.ENV, "0.25")
    report = checks.naive_attention(_forever, seed=0, out=lambda line: None)
    assert report.results[0][2] == "timed out after 0.25 s"
    monkeypatch.setenv(_limits.ENV, "soon")
    with pytest.raises(ValueError, match="FLASHEDU_TIME_LIMIT must be a positive number"):
        checks.naive_attention(_forever, seed=0, out=lambda line: None)


# ---------------------------------------------------------------------------- the checks CLI


def _notebook(path, *sources, kernel="python3"):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": kernel, "display_name": kernel, "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    nbformat.write(nb, path)
    return path


def test_the_cli_grades_every_notebook_whatever_happens_to_one(tmp_path, capsys):
    bad = {
        "not_json.ipynb": "this is not JSON",
        "empty.ipynb": "",
        "wrong_json.ipynb": "[1, 2]",
    }
    for name, text in bad.items():
        (tmp_path / name).write_text(text)
    _notebook(tmp_path / "unknown_kernel.ipynb", "1", kernel="no-such-kernel")
    _notebook(tmp_path / "dies.ipynb", "import os\nos._exit(1)")
    _notebook(
        tmp_path / "errors_and_loops.ipynb",
        "1 / 0",
        "while True:\n    pass",
        "print('after the timeout')",
    )
    names = [*bad, "unknown_kernel.ipynb", "dies.ipynb", "errors_and_loops.ipynb"]
    status = cli.main([str(tmp_path / n) for n in names] + ["--timeout", "3"])
    out = capsys.readouterr().out.splitlines()
    assert status == 1
    failed = [line for line in out if line.startswith("FAILED ")]
    causes = {line.split(": ", 1)[0].rsplit("/", 1)[-1]: line.split(": ", 1)[1] for line in failed}
    assert causes["not_json.ipynb"].startswith("not JSON")
    assert causes["empty.ipynb"] == "not a notebook: the file is empty"
    assert causes["wrong_json.ipynb"].startswith("not a notebook")
    assert causes["unknown_kernel.ipynb"].startswith("unknown kernel 'no-such-kernel'")
    assert causes["dies.ipynb"].startswith("the kernel died")
    assert len(failed) == 5  # one line each; the notebook that ran is reported in its scorecard
    assert "  cell 0 raised ZeroDivisionError: division by zero" in out
    assert "  cell 1 timed out after 3 s and was interrupted" in out
    assert out[-1] == "0 passed, 0 wrong, 0 not attempted, 0 not run"


def test_in_a_kernel_a_timed_out_grader_leaves_the_notebook_usable(tmp_path, monkeypatch):
    """The limit runs inside ipykernel (cells execute in its main thread, where SIGALRM works):
    the endless exercise is reported as timed out and the next cells run as usual."""
    from nbclient import NotebookClient

    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))  # this checkout
    endless = "def mine(q, k, v, causal=False):\n    while True:\n        pass\n"
    nb = nbformat.read(
        _notebook(
            tmp_path / "endless.ipynb",
            "from flashedu import checks",
            endless + "checks.naive_attention(mine, time_limit=0.5);",
            "print('still alive')",
        ),
        as_version=4,
    )
    NotebookClient(nb, timeout=120, kernel_name="python3").execute()  # raises if a cell does
    text = ["".join(o.get("text", "") for o in c.outputs) for c in nb.cells]
    assert "case 1: one query, one key: timed out after 0.5 s" in text[1]
    assert text[2] == "still alive\n"


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_cli_timeout_must_be_a_positive_number(value, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["nothing.ipynb", "--timeout", value])
    assert e.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert "--timeout" in err and value in err


def test_range_headings_number_the_graders_in_order():
    nb = nbformat.v4.new_notebook()
    md, code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell
    nb.cells = [
        md("### Exercises 10.1-10.3 — score mods"),
        code("checks.alibi_mod(f)"),
        code("checks.softcap_mod(g)"),
        code("checks.relative_bias_mod(h)"),
        md("### Exercises 2.1–2 and more"),
        code("checks.online_softmax(a)\nchecks.merge_states(b)"),
        md("### Exercise 3.1"),
        code("checks.tiled_attention(t)\nchecks.fa2_hbm_bytes(u)"),
    ]
    assert cli.exercises(nb) == [
        ("10.1", "alibi_mod"),
        ("10.2", "softcap_mod"),
        ("10.3", "relative_bias_mod"),
        ("2.1", "online_softmax"),
        ("2.2", "merge_states"),
        ("3.1", "tiled_attention"),
        ("3.1", "fa2_hbm_bytes"),
    ]


# ---------------------------------------------------------------------------- the benchmark


@pytest.mark.parametrize("impl", ["naive", "tiled", "torch_tiled", "sdpa"])
def test_bench_refuses_an_impossible_size_before_allocating(impl, monkeypatch, capsys):
    from flashedu.bench import __main__ as bench
    from flashedu.bench import cpu

    def no_allocation(*args, **kwargs):
        raise AssertionError("inputs were drawn for a size that cannot fit")

    real = cpu._inputs
    monkeypatch.setattr(
        cpu, "_inputs", lambda B, H, N_q, *a: (real if N_q < 1000 else no_allocation)(B, H, N_q, *a)
    )
    status = bench.main(["--cpu", "--N", "10000000", "--impls", impl, "--max-mem-gib", "4"])
    assert status == 1
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("skipped"))
    assert f"skipped {impl} N=10000000 fwd: needs about " in line and "GiB" in line + "TiB"
