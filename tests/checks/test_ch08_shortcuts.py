"""Chapter 08's timing-harness grader against harnesses that give the right number without timing
what the exercise asks: the answer read off the simulated device's settings, one sample instead
of `repeats`, no warm-up call left out but a timed call missing. Each is rejected with a diagnosis
that names it; honest harnesses written other ways (NumPy's median, samples gathered first and
sorted) are accepted.
"""

import statistics

import numpy as np
import pytest

from flashedu import checks
from flashedu.testing import run_grader


def _sample(fn, device):
    if device.is_gpu:
        device.flush_l2()
    device.synchronize()
    start = device.clock()
    fn()
    device.synchronize()
    return device.clock() - start


def harness(fn, device, *, warmup, repeats):
    for _ in range(warmup):
        fn()
    return 1e3 * statistics.median(_sample(fn, device) for _ in range(repeats))


def harness_sorted(fn, device, *, warmup, repeats):
    """Honest, another way: samples gathered first, the middle of the sorted list by NumPy."""
    [fn() for _ in range(warmup)]
    samples = np.sort([_sample(fn, device) for _ in range(repeats)])
    return float(np.median(samples) * 1000)


def read_expected(fn, device, *, warmup, repeats):
    """Shortcut: the simulated device knows the answer."""
    return device.expected_ms


def read_through_kernel(fn, device, *, warmup, repeats):
    """Shortcut: the device behind the bound kernel method."""
    return fn.__self__.kernel_ms


def one_sample(fn, device, *, warmup, repeats):
    """Shortcut: one timed call instead of `repeats` (right whenever that call is not slow)."""
    for _ in range(warmup):
        fn()
    return 1e3 * _sample(fn, device)


@pytest.mark.parametrize("mine", [harness, harness_sorted])
def test_honest_harnesses_pass(mine):
    for seed in range(3):
        report, text = run_grader(checks.check_timing_harness, mine, seed)
        assert report.passed, text


@pytest.mark.parametrize(
    "shortcut,words",
    [
        (read_expected, "read expected_ms off the device or the kernel instead of timing"),
        (read_through_kernel, "read __self__ off the device or the kernel instead of timing"),
        (one_sample, "fn was called"),
    ],
    ids=["expected_ms", "fn.__self__", "one sample"],
)
def test_a_harness_that_does_not_time_repeats_calls_is_rejected_and_named(shortcut, words):
    for seed in range(3):
        report, text = run_grader(checks.check_timing_harness, shortcut, seed)
        assert not report.passed, text
        assert words in report.diagnosis, text
