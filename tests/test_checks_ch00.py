"""The chapter 00 graders: the reference solutions pass, and each planted bug fails with its
name."""

from __future__ import annotations

import pytest

from flashedu import checks, traffic
from flashedu.checks import ch00
from flashedu.testing import run_grader


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_solutions_pass(seed):
    for grader, solution in [
        (checks.check_matmul_intensity, ch00.matmul_intensity),
        (checks.check_naive_attention_time, ch00.naive_attention_time),
    ]:
        report, text = run_grader(grader, solution, seed)
        assert report.passed, text
        assert "all cases pass" in text


def test_matmul_intensity_matches_the_closed_form():
    assert ch00.matmul_intensity(4096, 4096, 4096, 2) == pytest.approx(
        2 * 4096 / 6
    )  # 2 n / (3 itemsize)
    assert ch00.matmul_intensity(1, 1, 1, 4) == pytest.approx(2 / 12)


def test_naive_attention_time_uses_the_traffic_model():
    gpu = traffic.GPUS["H200"]
    t, bound = ch00.naive_attention_time(4096, 64, gpu)
    nbytes = 4 * 4096 * 4096 * 2 + 4 * 4096 * 64 * 2 + 4096 * 4  # S, P twice each; Q, K, V, O; lse
    assert t == pytest.approx(nbytes / gpu.hbm_bandwidth)
    assert bound == "memory"


def test_stub_reports_not_attempted():
    def stub(*args):
        raise NotImplementedError("Exercise 0.1: fill me in")

    for grader in (checks.check_matmul_intensity, checks.check_naive_attention_time):
        report, text = run_grader(grader, stub)
        assert not report.attempted and not report.passed
        assert text == f"{grader.__name__}: not attempted yet"  # no pointer to the answer


MATMUL_BUGS = {
    "a multiply-add is 2 FLOPs": lambda M, N, K, e: M * N * K / ((M * K + K * N + M * N) * e),
    "the write of C was not counted": lambda M, N, K, e: 2 * M * N * K / ((M * K + K * N) * e),
    "multiply by itemsize": lambda M, N, K, e: 2 * M * N * K / (M * K + K * N + M * N),
    "expected a finite number": lambda M, N, K, e: None,
}


@pytest.mark.parametrize("bug", MATMUL_BUGS)
def test_matmul_bugs_are_named(bug):
    report, text = run_grader(checks.check_matmul_intensity, MATMUL_BUGS[bug], seed=3)
    assert not report.passed
    assert bug in text, text


def _naive_parts(N, d, e):
    t = traffic.naive_forward(1, 1, N, N, d, itemsize=e)
    return t.total_bytes, 4.0 * N * N * d


def _roof(nbytes, flops, gpu):
    return max(nbytes / gpu.hbm_bandwidth, flops / gpu.dense_flops), (
        "memory" if nbytes / gpu.hbm_bandwidth >= flops / gpu.dense_flops else "compute"
    )


def _no_sp(N, d, g, e):
    nbytes, flops = _naive_parts(N, d, e)
    return _roof(nbytes - 4 * N * N * e, flops, g)


def _sp_once(N, d, g, e):
    nbytes, flops = _naive_parts(N, d, e)
    return _roof(nbytes - 2 * N * N * e, flops, g)


def _half_flops(N, d, g, e):
    nbytes, flops = _naive_parts(N, d, e)
    return _roof(nbytes, flops / 2, g)


def _summed(N, d, g, e):
    nbytes, flops = _naive_parts(N, d, e)
    return nbytes / g.hbm_bandwidth + flops / g.dense_flops, _roof(nbytes, flops, g)[1]


def _no_lse(N, d, g, e):
    nbytes, flops = _naive_parts(N, d, e)
    return _roof(nbytes - 4 * N, flops, g)


def _always_memory(N, d, g, e):
    return ch00.naive_attention_time(N, d, g, e)[0], "memory"


NAIVE_BUGS = {
    "S and P were left out": _no_sp,
    "S and P were counted once each": _sp_once,
    "FLOPs counted as 2 N^2 d": _half_flops,
    "the roofline takes their max": _summed,
    "the lse write": _no_lse,
    "bound 'memory', expected 'compute'": _always_memory,
}


@pytest.mark.parametrize("bug", NAIVE_BUGS)
def test_naive_time_bugs_are_named(bug):
    report, text = run_grader(checks.check_naive_attention_time, NAIVE_BUGS[bug], seed=4)
    assert not report.passed
    assert bug in text, text


def test_graders_are_exported_and_show_their_solution(capsys):
    assert checks.GRADERS["check_matmul_intensity"] is checks.check_matmul_intensity
    assert (
        checks.check_naive_attention_time.solution_name
        == "flashedu.checks.ch00.naive_attention_time"
    )
    checks.solution(checks.check_matmul_intensity)
    assert "def matmul_intensity" in capsys.readouterr().out
