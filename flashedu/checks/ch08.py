"""Graders for chapter 08 (notebooks/08_benchmarks.ipynb): measuring, then reading the numbers.

Exercise 8.1 has the learner write a timing harness. It is graded on a simulated device
(`FakeDevice`, in _devices.py) whose clock is exact, so every classic mistake changes the answer:
no warm-up, no synchronisation on a GPU, a mean instead of a median, no L2 flush between calls, a
flush still running when the clock starts, seconds instead of milliseconds. Exercise 8.2 turns a
measured time into TFLOP/s, exercise 8.3 predicts how much memory standard attention needs at long
context. A wrong answer is matched against planted versions of the usual mistakes and the report
names the one that reproduces it; the event log of the simulated device names what it can when
none does. The harness is handed the kernel as a plain function and the device's
interface alone (`DeviceView`: clock, synchronize, flush_l2, is_gpu), and must call the kernel
warmup + repeats times: an answer read off the simulation's settings, or a right number from fewer
timed calls, is named. The solutions are `flashedu.profiling.time_ms`, `tflops` below and
`flashedu.bench.memory_model`; flashedu's own code is off limits while a learner's answer runs.

Limits: TFLOP/s counts matmul FLOPs only, by the benchmarks' convention (`traffic.benchmark_flops`:
causal halves the forward); the memory model counts the tensors standard attention keeps, not the
allocator's rounding or workspace.
"""

from __future__ import annotations

import statistics

from .. import bench, traffic
from ._core import Case, Report, grade, grader, number_or_none, rng_for
from ._devices import DeviceView, FakeDevice, kernel_of  # also checks.ch08.FakeDevice
from ._shared import Shortcut

__all__ = ["check_timing_harness", "check_tflops", "check_naive_memory"]


def tflops(B: int, H: int, N: int, d: int, ms: float, causal=False, pass_="fwd") -> float:
    """TFLOP/s of one attention call (N_q = N_k = N) that took `ms` milliseconds, counting the
    FLOPs the benchmarks count (`traffic.benchmark_flops`)."""
    return traffic.benchmark_flops(B, H, N, d, causal=causal, pass_=pass_) / (ms / 1e3) / 1e12


def _number(unit: str, rel: float = 1e-9):
    """A check of one number: (ok, "got ..., expected ...")."""

    def check(got, expected):
        g = number_or_none(got)
        if g is None:
            return False, f"expected a finite number{unit}, got {got!r}"
        err = abs(g - expected) / abs(expected)
        return (
            err <= rel,
            f"got {g:.6g}{unit}, expected {expected:.6g}{unit} (rel. error {err:.1e})",
        )

    return check


# ----------------------------------------------------------------------- 8.1 the timing harness


def _planted(fn, dev, warmup, repeats, *, warm=True, sync=True, median=True, flush=True,
             settle=True, ms=True, together=False) -> float:  # fmt: skip
    """A timing harness with switches that plant the classic mistakes."""
    for _ in range(warmup if warm else 0):
        fn()
    samples = []
    if together:
        dev.synchronize()
        start = dev.clock()
        for _ in range(repeats):
            fn()
        dev.synchronize()
        samples = [(dev.clock() - start) / repeats]
    for _ in range(0 if together else repeats):
        if flush and dev.is_gpu:
            dev.flush_l2()
        if settle:
            dev.synchronize()
        start = dev.clock()
        fn()
        if sync:
            dev.synchronize()
        samples.append(dev.clock() - start)
    t = statistics.median(samples) if median else statistics.fmean(samples)
    return t * 1e3 if ms else t


_HARNESS_MISTAKES = {
    "no warm-up: the first calls compile the kernel and run before the clock has ramped up; "
    "call fn `warmup` times before timing": {"warm": False},
    "no synchronize after fn(): on a GPU the call returns once the kernel is queued, so the clock "
    "stopped before the kernel ran": {"sync": False},
    "the mean of the samples: one slow call (another process, a clock dip) pulls a mean up; "
    "report the median": {"median": False},
    "the repeats were timed as one interval and divided: that is a mean, slow calls included, "
    "and nothing evicts the inputs between calls": {"together": True},
    "no L2 flush before each timed call: every call found its inputs in the L2 cache the call "
    "before left there": {"flush": False},
    "the clock started while the L2 flush was still running: synchronize after flush_l2()": {
        "settle": False
    },
    "that is seconds: the harness returns milliseconds": {"ms": False},
}

_HARNESS_FORMULA = """
call fn() `warmup` times, untimed
for each of `repeats` samples:
    on a GPU (device.is_gpu): device.flush_l2()
    device.synchronize(); start = device.clock()
    fn(); device.synchronize()
    sample = device.clock() - start
return 1e3 * the median of the samples   (milliseconds)
"""


def _harness_case(label: str, spec: dict, warmup: int, repeats: int) -> Case:
    used: list[FakeDevice] = []

    def call(fn):
        used.append(FakeDevice(**spec))
        dev = used[-1]
        try:
            return fn(kernel_of(dev), DeviceView(dev), warmup=warmup, repeats=repeats)
        except AttributeError as e:
            attr = next((a for a in _SETTINGS if f"'{a}'" in str(e)), None)
            if attr is None:
                raise
            raise Shortcut(
                f"read {attr} off the device or the kernel instead of timing: a harness gets "
                "clock, synchronize, flush_l2 and is_gpu, and measures with the clock"
            ) from None

    def check(got, expected):
        ok, detail = _number(" ms")(got, expected)
        if not ok:
            return ok, detail, (used[-1].problems() + [""])[0]
        calls, want = used[-1].calls, warmup + repeats
        if calls != want:  # right by luck: a sample or a warm-up call missing, or none timed
            return False, f"{detail}; fn called {calls} times", _calls_why(calls, warmup, repeats)
        return ok, detail

    def variant(bugs):
        dev = FakeDevice(**spec)
        return lambda: _planted(dev.kernel, dev, warmup, repeats, **bugs)

    kind = "gpu=True" if spec["gpu"] else "gpu=False"
    return Case(
        label,
        (),
        _planted((dev := FakeDevice(**spec)).kernel, dev, warmup, repeats),
        hint="the median time of one call differs from the device's; see checks.hint",
        check=check,
        mistakes={why: variant(bugs) for why, bugs in _HARNESS_MISTAKES.items()},
        inputs=f"dev = checks.ch08.FakeDevice({kind}, kernel_ms={spec['kernel_ms']:g}); "
        f"fn(dev.kernel, dev, warmup={warmup}, repeats={repeats})",
        call=call,
    )


_SETTINGS = ("expected_ms", "kernel_ms", "launch_us", "call_seconds", "events", "calls",
             "__self__", "__closure__", "compile_ms")  # fmt: skip


def _calls_why(calls: int, warmup: int, repeats: int) -> str:
    if calls == 0:
        return (
            "fn was never called: the answer did not come from timing it; call fn `warmup` times, "
            "then time `repeats` calls"
        )
    return (
        f"fn was called {calls} times, not warmup + repeats = {warmup + repeats}: `warmup` "
        "untimed calls, then one timed call per sample, and the median of the `repeats` samples"
    )


@grader("flashedu.profiling.time_ms", formula=_HARNESS_FORMULA)
def check_timing_harness(fn, *, seed=None, out=print) -> Report:
    """Exercise 8.1: `fn(kernel, device, *, warmup, repeats)` -> median ms of one `kernel()`,
    graded on simulated CPUs and GPUs."""
    rng = rng_for(seed)
    specs = [
        ("fake CPU, 2 ms kernel", {"gpu": False, "kernel_ms": 2.0}, 5, 9),
        ("fake GPU, 1.25 ms kernel", {"gpu": True, "kernel_ms": 1.25}, 5, 10),
    ]
    for gpu in (True, False):
        ms = float(f"{rng.uniform(0.05, 20.0):.3g}")
        specs.append(
            (
                f"fake {'GPU' if gpu else 'CPU'}, {ms:g} ms kernel",
                {"gpu": gpu, "kernel_ms": ms},
                int(rng.integers(5, 9)),
                int(rng.integers(7, 16)),
            )
        )
    cases = [_harness_case(f"{label}, {w} + {r} calls", s, w, r) for label, s, w, r in specs]
    return grade("check_timing_harness", fn, cases, out=out, forbid=True)


# --------------------------------------------------------------------------- 8.2 TFLOP/s


def _tflops_mistakes(B, H, N, d, ms, causal, pass_) -> dict[str, float]:
    right = tflops(B, H, N, d, ms, causal, pass_)
    wrong = {
        "ms was used as seconds: divide the time by 1e3 first": right / 1e3,
        "that is GFLOP/s: divide FLOP/s by 1e12 for TFLOP/s": right * 1e3,
        "FLOPs counted as 2 B H N^2 d: there are two matmuls (Q K^T and P V), "
        "2 FLOPs per multiply-add": right / 2,
        f"B H = {B * H} left out: every (batch, head) pair does the work": right / (B * H),
    }
    if causal:
        wrong["causal was not halved: a causal mask skips half the scores"] = right * 2
    if pass_ == "fwd_bwd":
        wrong["the backward was counted as 1x the forward: it is 2.5x, so fwd_bwd is 3.5x"] = (
            right * 2 / 3.5
        )
        wrong["fwd_bwd counted as 2.5x: 2.5x is the backward alone; add the forward's 1x"] = (
            right * 2.5 / 3.5
        )
    return wrong


_TFLOPS_FORMULA = """
FLOPs = 4 B H N^2 d          (two matmuls, Q K^T and P V, 2 FLOPs per multiply-add)
        x 0.5 when causal, x 3.5 for "fwd_bwd" (the backward is 2.5x the forward)
TFLOP/s = FLOPs / (ms / 1e3) / 1e12
"""


@grader("flashedu.checks.ch08.tflops", formula=_TFLOPS_FORMULA)
def check_tflops(fn, *, seed=None, out=print) -> Report:
    """Exercise 8.2: `fn(B, H, N, d, ms, causal=False, pass_="fwd")` -> TFLOP/s of one attention
    call."""
    rng = rng_for(seed)
    specs = [
        (4, 16, 4096, 64, 1.25, False, "fwd"),
        (4, 16, 4096, 64, 0.7, True, "fwd"),
        (2, 16, 16384, 128, 9.5, False, "fwd_bwd"),
        (3, 8, 8192, 128, 4.1, True, "fwd_bwd"),
    ]
    specs += [
        (
            int(rng.integers(2, 9)),
            int(rng.integers(3, 33)),
            int(rng.integers(512, 65537)),
            int(rng.choice([64, 128, 256])),
            float(rng.uniform(0.05, 50.0)),
            bool(rng.integers(2)),
            p,
        )
        for p in ("fwd", "fwd_bwd")
    ]
    cases = [
        Case(
            f"B={B} H={H} N={N} d={d} {ms:.3g} ms causal={c} {p}",
            (B, H, N, d, ms),
            tflops(B, H, N, d, ms, c, p),
            kwargs={"causal": c, "pass_": p},
            hint="the TFLOP/s match none of the usual slips: recount the FLOPs, then the units",
            check=_number(" TFLOP/s"),
            mistakes=_tflops_mistakes(B, H, N, d, ms, c, p),
        )
        for B, H, N, d, ms, c, p in specs
    ]
    return grade("check_tflops", fn, cases, out=out, forbid=True)


# --------------------------------------------------------------------------- 8.3 memory


def _memory_mistakes(B, H, N, d, e) -> dict[str, float]:
    right = bench.memory_model("naive", B, H, N, d, itemsize=e)
    nn, qkvo = B * H * N * N * e, 4 * B * H * N * d * e  # one N x N matrix; Q, K, V, O together
    return {
        "only one N x N matrix: standard attention keeps both S and P": qkvo + nn,
        "S and P were left out: they are the N^2 term": qkvo,
        "Q, K, V and O were left out: small next to N^2, but they are there": 2 * nn,
        f"B H = {B * H} left out: every (batch, head) pair has its own S and P": right / (B * H),
        f"elements, not bytes: multiply by itemsize={e}": right / e,
        "that is GiB: return bytes": right / 2**30,
        "that is GB: return bytes": right / 1e9,
    }


_MEMORY_FORMULA = """
bytes = (4 N d + 2 N^2) * B * H * itemsize
        (Q, K, V and O: N x d each; S and P: N x N each)
"""


@grader("flashedu.bench.memory_model", formula=_MEMORY_FORMULA)
def check_naive_memory(fn, *, seed=None, out=print) -> Report:
    """Exercise 8.3: `fn(B, H, N, d, itemsize)` -> bytes standard attention's forward keeps: Q, K,
    V, O, S, P."""
    rng = rng_for(seed)
    specs = [(1, 3, 1, 16, 2), (1, 1, 8192, 64, 2), (2, 8, 32768, 128, 4), (1, 32, 131072, 128, 2)]
    specs += [
        (
            int(rng.integers(1, 9)),
            int(rng.integers(5, 65)),
            int(rng.integers(2, 262145)),
            int(rng.choice([64, 96, 128, 256])),
            int(rng.choice([2, 4])),
        )
        for _ in range(2)
    ]
    cases = [
        Case(
            f"B={B} H={H} N={N} d={d} itemsize={e}",
            (B, H, N, d, e),
            bench.memory_model("naive", B, H, N, d, itemsize=e),
            hint="the bytes match none of the usual slips: list the tensors standard attention "
            "keeps and their shapes",
            check=_number(" bytes"),
            mistakes=_memory_mistakes(B, H, N, d, e),
        )
        for B, H, N, d, e in specs
    ]
    return grade("check_naive_memory", fn, cases, out=out, forbid=True)
