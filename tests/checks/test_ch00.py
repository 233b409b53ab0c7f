"""The chapter 00 graders: learner-style solutions pass, each planted bug fails with its name, the
formula is shown only by checks.hint, and flashedu's own functions are a named shortcut."""

from __future__ import annotations

import pytest

from flashedu import checks, traffic
from flashedu.checks import ch00
from flashedu.testing import run_grader


def _intensity(M, N, K, e):
    return 2 * M * N * K / ((M * K + K * N + M * N) * e)


def _parts(N, d, e):
    """Bytes and FLOPs of standard attention, one head, written out as a learner would."""
    nbytes = (3 * N * d + N * d) * e + 4 * N * N * e + 4 * N  # Q, K, V, O; S, P twice; lse
    return nbytes, 4 * N * N * d


def _roof(nbytes, flops, g):
    t_mem, t_flop = nbytes / g.hbm_bandwidth, flops / g.dense_flops
    return max(t_mem, t_flop), "memory" if t_mem >= t_flop else "compute"


def _time(N, d, g, e):
    return _roof(*_parts(N, d, e), g)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_learner_style_solutions_pass(seed):
    for grader, solution in [
        (checks.check_matmul_intensity, _intensity),
        (checks.check_naive_attention_time, _time),
    ]:
        report, text = run_grader(grader, solution, seed)
        assert report.passed, text
        assert "all cases pass" in text


def test_the_package_solutions_agree_with_the_learner_style_ones():
    g = traffic.GPUS["H200"]
    assert ch00.matmul_intensity(4096, 4096, 4096, 2) == pytest.approx(2 * 4096 / 6)
    assert ch00.matmul_intensity(1, 1, 1, 4) == pytest.approx(2 / 12)
    t, bound = ch00.naive_attention_time(4096, 64, g)
    assert (t, bound) == (pytest.approx(_time(4096, 64, g, 2)[0]), "memory")


@pytest.mark.parametrize(
    "grader,solution",
    [
        (checks.check_matmul_intensity, ch00.matmul_intensity),
        (checks.check_naive_attention_time, ch00.naive_attention_time),
        (
            checks.check_naive_attention_time,
            lambda N, d, g, e: (
                traffic.roofline(
                    traffic.attention_flops(1, 1, N, N, d),
                    traffic.naive_forward(1, 1, N, N, d, itemsize=e).total_bytes,
                    g,
                ).time,
                "memory",
            ),
        ),
    ],
)
def test_calling_flashedu_is_a_named_shortcut(grader, solution):
    report, text = run_grader(grader, solution)
    assert not report.passed
    assert "shortcut: called flashedu." in text, text


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
    "as if each term fetched its operands": lambda M, N, K, e: 2 * M * N * K / (2 * M * N * K * e),
    "expected a finite number": lambda M, N, K, e: None,
}


@pytest.mark.parametrize("bug", MATMUL_BUGS)
def test_matmul_bugs_are_named_and_the_formula_is_not_printed(bug):
    report, text = run_grader(checks.check_matmul_intensity, MATMUL_BUGS[bug], seed=3)
    assert not report.passed
    assert bug in text, text
    assert "(M K + K N + M N)" not in text and "FLOPs = 2 M N K" not in text, text


def _minus(nbytes_off=0, flops_scale=1.0):
    def bug(N, d, g, e):
        nbytes, flops = _parts(N, d, e)
        return _roof(nbytes - nbytes_off(N, e) if nbytes_off else nbytes, flops * flops_scale, g)

    return bug


def _summed(N, d, g, e):
    nbytes, flops = _parts(N, d, e)
    return nbytes / g.hbm_bandwidth + flops / g.dense_flops, _roof(nbytes, flops, g)[1]


NAIVE_BUGS = {
    "S and P were left out": _minus(lambda N, e: 4 * N * N * e),
    "S and P were counted once each": _minus(lambda N, e: 2 * N * N * e),
    "the lse write (N floats of 4 bytes) was left out": _minus(lambda N, e: 4 * N),
    "lse was counted in the input itemsize": _minus(lambda N, e: 4 * N - e * N),
    "FLOPs counted as 2 N^2 d": _minus(flops_scale=0.5),
    "the roofline takes their max": _summed,
    "bound 'memory' where made-up GPU with 1 TFLOP/s is compute-bound": lambda N, d, g, e: (
        _time(N, d, g, e)[0],
        "memory",
    ),
    "expected a pair (seconds, bound)": lambda N, d, g, e: _time(N, d, g, e)[0],
}


@pytest.mark.parametrize("bug", NAIVE_BUGS)
def test_naive_time_bugs_are_named_and_the_formula_is_not_printed(bug):
    report, text = run_grader(checks.check_naive_attention_time, NAIVE_BUGS[bug], seed=4)
    assert not report.passed
    assert bug in text, text
    assert "4 N^2 d" not in text.replace("FLOPs counted as 2 N^2 d", ""), text
    assert "max(bytes" not in text, text


def test_a_failing_report_names_the_gpu_briefly_not_its_whole_preset():
    _, text = run_grader(checks.check_naive_attention_time, lambda N, d, g, e: (1.0, "memory"))
    assert "gpu=traffic.GPUS[" in text or "gpu=dataclasses.replace(" in text, text
    assert "datasheet" not in text  # the preset's source string stays out of the report
    assert max(len(line) for line in text.splitlines()) <= 100


def test_hint_prints_the_formula(capsys):
    checks.hint(checks.check_matmul_intensity)
    assert "FLOPs = 2 M N K" in capsys.readouterr().out
    checks.hint(checks.check_naive_attention_time)
    assert "time  = max(bytes / gpu.hbm_bandwidth, FLOPs / gpu.dense_flops)" in (
        capsys.readouterr().out
    )


def test_graders_are_exported_and_show_their_solution(capsys):
    assert checks.GRADERS["check_matmul_intensity"] is checks.check_matmul_intensity
    assert (
        checks.check_naive_attention_time.solution_name
        == "flashedu.checks.ch00.naive_attention_time"
    )
    checks.solution(checks.check_matmul_intensity)
    assert "def matmul_intensity" in capsys.readouterr().out
