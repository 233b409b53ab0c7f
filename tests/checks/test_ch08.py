"""Chapter 08 graders: learner-style solutions pass, a stub is "not attempted", each planted bug
fails with its name, the formula is shown only by checks.hint; the simulated device behaves as its
docstring says."""

from __future__ import annotations

import statistics

import pytest

from flashedu import bench, checks, profiling
from flashedu.checks.ch08 import FakeDevice
from flashedu.testing import run_grader

# ---------------------------------------------------------------------- 8.1: the timing harness


def harness(
    fn,
    device,
    *,
    warmup,
    repeats,
    warm=True,
    sync=True,
    median=True,
    flush=True,
    settle=True,
    seconds=False,
):
    """A learner's harness; each switch plants one classic mistake."""
    if warm:
        for _ in range(warmup):
            fn()
    times = []
    for _ in range(repeats):
        if flush and device.is_gpu:
            device.flush_l2()
        if settle:
            device.synchronize()
        t0 = device.clock()
        fn()
        if sync:
            device.synchronize()
        times.append(device.clock() - t0)
    t = statistics.median(times) if median else sum(times) / len(times)
    return t if seconds else 1e3 * t


def one_interval(fn, device, *, warmup, repeats):
    """Warm up, then time all repeats at once and divide: a mean, and no flush between calls."""
    for _ in range(warmup):
        fn()
    device.synchronize()
    t0 = device.clock()
    for _ in range(repeats):
        fn()
    device.synchronize()
    return 1e3 * (device.clock() - t0) / repeats


HARNESS_BUGS = {
    "no warm-up": dict(warm=False),
    "no synchronize after fn()": dict(sync=False),
    "the mean of the samples": dict(median=False),
    "no L2 flush before each timed call": dict(flush=False),
    "the clock started while the L2 flush was still running": dict(settle=False),
    "that is seconds": dict(seconds=True),
}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_careful_harness_passes(seed):
    report, text = run_grader(checks.check_timing_harness, harness, seed)
    assert report.passed, text
    assert "all cases pass" in text


@pytest.mark.parametrize("bug", HARNESS_BUGS)
def test_each_harness_bug_is_named(bug):
    def buggy(fn, device, *, warmup, repeats):
        return harness(fn, device, warmup=warmup, repeats=repeats, **HARNESS_BUGS[bug])

    report, text = run_grader(checks.check_timing_harness, buggy, seed=5)
    assert not report.passed
    assert f"what is wrong: {bug}" in text, text
    assert "device.clock() - start" not in text  # the formula stays behind checks.hint


def test_timing_all_repeats_in_one_interval_is_named():
    report, text = run_grader(checks.check_timing_harness, one_interval, seed=5)
    assert not report.passed
    assert "the repeats were timed as one interval and divided" in text, text


def test_the_event_log_names_what_no_planted_variant_matches():
    def two_bugs(fn, device, *, warmup, repeats):  # no synchronize and a mean: no single variant
        return harness(fn, device, warmup=warmup, repeats=repeats, sync=False, median=False)

    report, text = run_grader(checks.check_timing_harness, two_bugs, seed=5)
    assert not report.passed
    assert "no synchronize after fn()" in text, text

    def wall_clock(fn, device, *, warmup, repeats):
        import time

        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)

    report, text = run_grader(checks.check_timing_harness, wall_clock, seed=5)
    assert "device.clock() was never read" in text, text


def test_calling_the_package_harness_is_a_named_shortcut():
    report, text = run_grader(checks.check_timing_harness, profiling.time_ms)
    assert not report.passed
    assert "shortcut: called flashedu.profiling.time_ms" in text, text


def test_harness_hint_shows_the_steps(capsys):
    checks.hint(checks.check_timing_harness)
    out = capsys.readouterr().out
    assert "device.flush_l2()" in out and "median" in out


# ---------------------------------------------------------------------- the simulated device


@pytest.mark.parametrize("gpu", [True, False])
def test_the_package_harness_measures_what_the_fake_device_promises(gpu):
    dev = FakeDevice(gpu=gpu, kernel_ms=1.25)
    assert profiling.time_ms(dev.kernel, dev, warmup=5, repeats=10) == pytest.approx(
        dev.expected_ms, rel=1e-12
    )
    assert dev.problems() == []


def test_fake_gpu_queues_work_until_synchronised():
    dev = FakeDevice(gpu=True, kernel_ms=2.0, compile_ms=0.0, ramp_calls=0, slow_every=0)
    t0 = dev.clock()
    dev.kernel()
    assert dev.clock() - t0 == pytest.approx(5e-6)  # the launch only
    dev.synchronize()
    assert dev.clock() - t0 == pytest.approx(5e-6 + 2e-3)


def test_fake_cpu_runs_each_call_to_completion_and_flushes_nothing():
    dev = FakeDevice(gpu=False, kernel_ms=2.0, compile_ms=0.0, ramp_calls=0, slow_every=0)
    t0 = dev.clock()
    dev.kernel()
    dev.kernel()  # no L2 effect on the CPU
    dev.flush_l2()
    assert dev.clock() - t0 == pytest.approx(4e-3)


def test_fake_gpu_first_call_compiles_clock_ramps_and_l2_remembers():
    dev = FakeDevice(gpu=True, kernel_ms=1.0, ramp_calls=2, ramp=1.5, slow_every=5, slow=3.0)
    assert dev.call_seconds(0, False) == pytest.approx(1.5e-3)
    assert dev.call_seconds(2, False) == pytest.approx(1e-3)
    assert dev.call_seconds(4, False) == pytest.approx(3e-3)  # every fifth call is slow
    assert dev.call_seconds(2, True) == pytest.approx(0.7e-3)  # inputs still in L2
    t0 = dev.clock()
    dev.kernel()
    assert dev.clock() - t0 == pytest.approx(0.2 + 5e-6)  # compiling happens on the host


def test_fake_device_rejects_a_kernel_without_duration():
    with pytest.raises(ValueError, match="kernel_ms"):
        FakeDevice(kernel_ms=0)


# ---------------------------------------------------------------------- 8.2 and 8.3


def _tflops(B, H, N, d, ms, causal=False, pass_="fwd"):
    flops = 4 * B * H * N * N * d * (0.5 if causal else 1.0) * {"fwd": 1.0, "fwd_bwd": 3.5}[pass_]
    return flops / (ms / 1e3) / 1e12


def _memory(B, H, N, d, itemsize):
    return (4 * N * d + 2 * N * N) * B * H * itemsize


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_learner_style_solutions_pass(seed):
    for grader, solution in [(checks.check_tflops, _tflops), (checks.check_naive_memory, _memory)]:
        report, text = run_grader(grader, solution, seed)
        assert report.passed, text
        assert "all cases pass" in text


def test_the_package_solutions_give_the_graded_answers():
    assert checks.ch08.tflops(4, 16, 4096, 64, 0.7, True) == pytest.approx(
        _tflops(4, 16, 4096, 64, 0.7, True)
    )
    assert bench.memory_model("naive", 2, 8, 300, 64, itemsize=4) == _memory(2, 8, 300, 64, 4)


@pytest.mark.parametrize(
    "grader,solution",
    [
        (checks.check_tflops, checks.ch08.tflops),
        (checks.check_naive_memory, lambda *a: bench.memory_model("naive", *a[:4], itemsize=a[4])),
    ],
)
def test_calling_flashedu_is_a_named_shortcut(grader, solution):
    report, text = run_grader(grader, solution)
    assert not report.passed and "shortcut: called flashedu." in text, text


def test_fresh_inputs_unless_seeded():
    labels = {
        tuple(label for label, _, _ in run_grader(checks.check_tflops, _tflops, seed=s)[0].results)
        for s in (None, None, None)
    }
    assert len(labels) > 1
    assert (
        run_grader(checks.check_tflops, _tflops, 5)[0].results
        == run_grader(checks.check_tflops, _tflops, 5)[0].results
    )


def test_stubs_report_not_attempted():
    def stub(*args, **kwargs):
        raise NotImplementedError("Exercise 8.2: fill me in")

    for grader in (checks.check_timing_harness, checks.check_tflops, checks.check_naive_memory):
        report, text = run_grader(grader, stub)
        assert not report.attempted and not report.passed
        assert text == f"{grader.__name__}: not attempted yet"


def _scaled(factor=1.0, **kw):
    def bug(B, H, N, d, ms, causal=False, pass_="fwd"):
        args = {"causal": causal, "pass_": pass_, **kw}
        return _tflops(B, H, N, d, ms, **args) * factor

    return bug


def _one_pair(B, H, N, d, ms, causal=False, pass_="fwd"):
    return _tflops(1, 1, N, d, ms, causal, pass_)


def _bwd_as(x):
    def bug(B, H, N, d, ms, causal=False, pass_="fwd"):
        return _tflops(B, H, N, d, ms, causal) * (x if pass_ != "fwd" else 1)

    return bug


TFLOPS_BUGS = {
    "ms was used as seconds": _scaled(1e-3),
    "that is GFLOP/s": _scaled(1e3),
    "there are two matmuls": _scaled(0.5),
    "left out: every (batch, head) pair does the work": _one_pair,
    "causal was not halved": _scaled(causal=False),
    "the backward was counted as 1x the forward": _bwd_as(2),
    "2.5x is the backward alone": _bwd_as(2.5),
    "expected a finite number": lambda *a, **k: float("nan"),
}


@pytest.mark.parametrize("bug", TFLOPS_BUGS)
def test_tflops_bugs_are_named(bug):
    report, text = run_grader(checks.check_tflops, TFLOPS_BUGS[bug], seed=7)
    assert not report.passed
    assert bug in text, text
    assert "4 B H N^2 d" not in text  # the formula only with checks.hint


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


def test_a_crash_is_reported_not_raised_and_the_formula_waits_for_hint(capsys):
    report, text = run_grader(checks.check_naive_memory, lambda *a: 1 / 0)
    assert not report.passed and "ZeroDivisionError" in text
    assert "(4 N d + 2 N^2)" not in text and "checks.hint(checks.check_naive_memory)" in text
    checks.hint(checks.check_naive_memory)
    assert "(4 N d + 2 N^2) * B * H * itemsize" in capsys.readouterr().out
