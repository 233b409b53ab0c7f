"""Chapter 08 graders: the solutions pass, a stub is "not attempted", each planted bug fails with
its name."""

from __future__ import annotations

import pytest

from flashedu import bench, checks
from flashedu.testing import run_grader


def _tflops(B, H, N, d, ms, causal=False, pass_="fwd"):
    flops = 4 * B * H * N * N * d * (0.5 if causal else 1.0) * {"fwd": 1.0, "fwd_bwd": 3.5}[pass_]
    return flops / (ms / 1e3) / 1e12


def _memory(B, H, N, d, itemsize):
    return (4 * N * d + 2 * N * N) * B * H * itemsize


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_solutions_pass(seed):
    for grader, solution in [
        (checks.check_tflops, bench.tflops),
        (checks.check_tflops, _tflops),
        (checks.check_naive_memory, lambda *a: bench.memory_model("naive", *a[:4], itemsize=a[4])),
        (checks.check_naive_memory, _memory),
    ]:
        report, text = run_grader(grader, solution, seed)
        assert report.passed, text
        assert "all cases pass" in text


def test_fresh_inputs_unless_seeded():
    labels = {
        tuple(
            label
            for label, _, _ in run_grader(checks.check_tflops, bench.tflops, seed=None)[0].results
        )
        for _ in range(3)
    }
    assert len(labels) > 1
    assert (
        run_grader(checks.check_tflops, bench.tflops, 5)[0].results
        == run_grader(checks.check_tflops, bench.tflops, 5)[0].results
    )


def test_stub_reports_not_attempted_and_names_the_solution():
    def stub(*args, **kwargs):
        raise NotImplementedError("Exercise 8.1: fill me in")

    for grader, name in [
        (checks.check_tflops, "flashedu.bench.tflops"),
        (checks.check_naive_memory, "flashedu.bench.memory_model"),
    ]:
        report, text = run_grader(grader, stub)
        assert not report.attempted and not report.passed
        assert text == f"{grader.__name__}: not attempted yet"  # no pointer to {name}


TFLOPS_BUGS = {
    "ms was used as seconds": lambda B, H, N, d, ms, causal=False, pass_="fwd": _tflops(
        B, H, N, d, ms * 1e3, causal, pass_
    ),
    "that is GFLOP/s": lambda B, H, N, d, ms, causal=False, pass_="fwd": (
        _tflops(B, H, N, d, ms, causal, pass_) * 1e3
    ),
    "there are two matmuls": lambda B, H, N, d, ms, causal=False, pass_="fwd": (
        _tflops(B, H, N, d, ms, causal, pass_) / 2
    ),
    "left out: every (batch, head) pair does the work": (
        lambda B, H, N, d, ms, causal=False, pass_="fwd": _tflops(1, 1, N, d, ms, causal, pass_)
    ),
    "causal was not halved": lambda B, H, N, d, ms, causal=False, pass_="fwd": _tflops(
        B, H, N, d, ms, False, pass_
    ),
    "the backward was counted as 1x the forward": (
        lambda B, H, N, d, ms, causal=False, pass_="fwd": (
            _tflops(B, H, N, d, ms, causal) * (2 if pass_ != "fwd" else 1)
        )
    ),
    "2.5x is the backward alone": lambda B, H, N, d, ms, causal=False, pass_="fwd": (
        _tflops(B, H, N, d, ms, causal) * (2.5 if pass_ != "fwd" else 1)
    ),
    "expected a finite number": lambda *a, **k: float("nan"),
}


@pytest.mark.parametrize("bug", TFLOPS_BUGS)
def test_tflops_bugs_are_named(bug):
    report, text = run_grader(checks.check_tflops, TFLOPS_BUGS[bug], seed=7)
    assert not report.passed
    assert bug in text, text


MEMORY_BUGS = {
    "standard attention keeps both S and P": lambda B, H, N, d, e: (4 * N * d + N * N) * B * H * e,
    "S and P were left out": lambda B, H, N, d, e: 4 * N * d * B * H * e,
    "Q, K, V and O were left out": lambda B, H, N, d, e: 2 * N * N * B * H * e,
    "every (batch, head) pair has its own S and P": lambda B, H, N, d, e: _memory(1, 1, N, d, e),
    "elements, not bytes": lambda B, H, N, d, e: _memory(B, H, N, d, 1),
    "that is GiB": lambda B, H, N, d, e: _memory(B, H, N, d, e) / 2**30,
    "that is GB": lambda B, H, N, d, e: _memory(B, H, N, d, e) / 1e9,
    "expected a finite number": lambda *a: "a lot",
}


@pytest.mark.parametrize("bug", MEMORY_BUGS)
def test_memory_bugs_are_named(bug):
    report, text = run_grader(checks.check_naive_memory, MEMORY_BUGS[bug], seed=7)
    assert not report.passed
    assert bug in text, text


def test_a_crash_is_reported_not_raised():
    report, text = run_grader(checks.check_naive_memory, lambda *a: 1 / 0)
    assert not report.passed and "ZeroDivisionError" in text and "hint" not in text
    assert "(4 N d + 2 N^2) * B * H * itemsize" in text
