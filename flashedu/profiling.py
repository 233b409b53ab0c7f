"""Measuring a kernel instead of modelling it: a timing harness, a per-operator profile, peak
memory.

* `Device`, `CPUDevice`, `CUDADevice`, `device()`: what a timing harness needs from a machine: a
  host clock, a way to wait for queued work (`synchronize`), a way to evict the inputs from the L2
  cache (`flush_l2`), and whether the machine is a GPU.
* `time_ms(fn, device, *, warmup, repeats)`: the harness chapter 08 has the learner write. Warm up
  untimed; then, per repeat, flush the L2 (GPU), synchronise, read the clock, call, synchronise,
  read the clock; report the median in milliseconds.
* `profile_ops(fn)`, `op_rows(prof)`, `op_table(rows)`: `torch.profiler` around one call, reduced to
  one row per operator: calls, self time, memory allocated.
* `peak_bytes(fn)`: the most torch memory live at once during one call, relative to before it;
  `largest_allocation(fn)`: the largest single block it allocated.
* `cuda_memory_snapshot(fn, path)`: on a CUDA GPU, the caching allocator's history during one call,
  saved for https://pytorch.org/memory_viz.

Introduced in notebooks/08_benchmarks.ipynb.

Limits: `time_ms` reads the host clock, so on a GPU each sample includes the kernel launch (a few
microseconds); CUDA events, as `triton.testing.do_bench` uses, would leave it out. `CPUDevice`
flushes nothing (`flush_l2` is a no-op and `is_gpu` is False). `peak_bytes` and the profile's memory
column see the torch allocator only, not NumPy's (`tracemalloc` sees NumPy's). On a CPU the
profiler's times are wall times of the operators as they ran, noise included.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Protocol

__all__ = [
    "Device",
    "CPUDevice",
    "CUDADevice",
    "device",
    "time_ms",
    "OpRow",
    "profile_ops",
    "op_rows",
    "op_table",
    "peak_bytes",
    "largest_allocation",
    "cuda_memory_snapshot",
]


# ------------------------------------------------------------------------------------ devices


class Device(Protocol):
    name: str
    is_gpu: bool

    def clock(self) -> float: ...  # host time, seconds

    def synchronize(self) -> None: ...  # return once all queued work has finished

    def flush_l2(self) -> None: ...  # evict what the last call left in the L2 cache


class CPUDevice:
    """The CPU: a call returns when its work is done, so there is nothing to wait for."""

    name = "cpu"
    is_gpu = False

    def clock(self) -> float:
        return time.perf_counter()

    def synchronize(self) -> None:
        """Nothing is queued on a CPU: each call has finished when it returns."""

    def flush_l2(self) -> None:
        """A no-op: the harness flushes only on a GPU (see the module's limits)."""


class CUDADevice:
    """A CUDA GPU: kernels run asynchronously after the call that launched them returns.

    flush_l2 overwrites a buffer of `flush_bytes` (256 MiB by default, as `triton.testing.do_bench`
    uses; several times the L2 of a Hopper GPU) so that the next call finds none of its inputs in
    the L2.
    """

    is_gpu = True

    def __init__(self, index: int = 0, *, flush_bytes: int = 256 * 2**20):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("CUDADevice: no CUDA device is available (use CPUDevice)")
        if not isinstance(flush_bytes, int) or flush_bytes < 1:
            raise ValueError(f"CUDADevice: flush_bytes must be a positive int, got {flush_bytes!r}")
        self._torch, self.index, self.flush_bytes = torch, index, flush_bytes
        self.name = torch.cuda.get_device_name(index)
        self._buffer = None

    def clock(self) -> float:
        return time.perf_counter()

    def synchronize(self) -> None:
        self._torch.cuda.synchronize(self.index)

    def flush_l2(self) -> None:
        if self._buffer is None:
            self._buffer = self._torch.empty(
                self.flush_bytes, dtype=self._torch.int8, device=f"cuda:{self.index}"
            )
        self._buffer.zero_()  # a kernel: it runs after whatever is queued before it


def device(kind: str = "auto") -> Device:
    """ "cpu", "cuda", or "auto" (the GPU when torch sees one, else the CPU)."""
    if kind not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device: kind must be 'auto', 'cpu' or 'cuda', got {kind!r}")
    if kind == "cpu":
        return CPUDevice()
    import torch

    if kind == "cuda" or torch.cuda.is_available():
        return CUDADevice()
    return CPUDevice()


# ----------------------------------------------------------------------------------- the harness


def _count(name: str, value, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"time_ms: {name} must be an int >= {least}, got {value!r}")
    return value


def time_ms(fn: Callable[[], object], device: Device, *, warmup: int = 3, repeats: int = 10):
    """Median milliseconds of one call `fn()` on `device`.

    warmup: untimed calls first (the first call may compile; clocks and caches settle).
    repeats: timed calls, each alone between two synchronisations, after an L2 flush on a GPU.
    """
    _count("warmup", warmup, 0)
    _count("repeats", repeats, 1)
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if device.is_gpu:
            device.flush_l2()  # the inputs come from HBM, as in a model where they are not hot
        device.synchronize()  # nothing queued (the flush included) when the clock starts
        start = device.clock()
        fn()
        device.synchronize()  # wait for the work, not only for its launch
        samples.append(device.clock() - start)
    return 1e3 * statistics.median(samples)  # one slow sample cannot move a median


# ---------------------------------------------------------------------------------- profiling


@contextlib.contextmanager
def _quiet_native_stderr():
    """Silence what C++ writes to file descriptor 2 (the profiler's start and stop lines)."""
    fd = 2  # where native code writes, whatever Python's sys.stderr has become
    sys.stderr.flush()
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), fd)
            yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


def profile_ops(fn: Callable[[], object], *, cuda: bool = False):
    """Run `fn()` once under torch.profiler (CPU activity, and CUDA when `cuda`), recording shapes
    and memory. Returns the profiler object; `op_rows` reads it."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=activities, record_shapes=True, profile_memory=True)
    with _quiet_native_stderr():
        prof.start()
    try:
        fn()
        if cuda:
            import torch

            torch.cuda.synchronize()
    finally:
        with _quiet_native_stderr():
            prof.stop()
    return prof


@dataclass(frozen=True)
class OpRow:
    name: str  # aten operator, e.g. "aten::bmm"
    calls: int
    self_ms: float  # time inside the operator itself, children excluded
    self_bytes: int  # CPU memory the operator allocated itself in all its calls, net of what it
    # freed inside them (a result freed later, outside the operator, still counts)


def op_rows(prof) -> list[OpRow]:
    """One row per operator of a `profile_ops` run, in the profiler's order. The profiler's
    "[memory]" rows (frees outside any operator) are left out: they are not operators."""
    return [
        OpRow(e.key, e.count, e.self_cpu_time_total / 1e3, int(e.self_cpu_memory_usage))
        for e in prof.key_averages()
        if not e.key.startswith("[")
    ]


def op_table(rows: list[OpRow], *, by: str = "time", limit: int = 8, times: bool = True) -> str:
    """The top `limit` operators by self time ("time") or memory allocated ("memory"), as a table:
    calls, self ms, bytes allocated in all calls and per call. times=False leaves the time column
    out (the memory columns repeat from run to run; times do not)."""
    keys = {"time": lambda r: (-r.self_ms, r.name), "memory": lambda r: (-r.self_bytes, r.name)}
    if by not in keys:
        raise ValueError(f"op_table: by must be 'time' or 'memory', got {by!r}")
    top = sorted(rows, key=keys[by])[:limit]
    width = max([len("operator")] + [len(r.name) for r in top])
    head = f"{'operator':<{width}}  {'calls':>6}" + (f"  {'self ms':>9}" if times else "")
    lines = [head + f"  {'allocated':>11}  {'per call':>10}"]
    for r in top:
        ms = f"  {r.self_ms:>9.2f}" if times else ""
        each = _fmt_bytes(r.self_bytes // r.calls) if r.calls else "-"
        lines.append(
            f"{r.name:<{width}}  {r.calls:>6}{ms}  {_fmt_bytes(r.self_bytes):>11}  {each:>10}"
        )
    return "\n".join(lines)


def _fmt_bytes(n: int) -> str:
    sign, n = ("-" if n < 0 else ""), abs(n)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{sign}{n / scale:.2f} {unit}"
    return f"{sign}{n} B"


# ----------------------------------------------------------------------------------- memory


def _cpu_allocations(prof) -> list[tuple[int, int]]:
    """(time ns, bytes) of every CPU allocation (+) and free (-) the profiler saw, in time order."""
    events = prof.profiler.kineto_results.events()
    return sorted(
        (e.start_ns(), e.nbytes())
        for e in events
        if e.name() == "[memory]" and str(e.device_type()).endswith("CPU")
    )


def peak_bytes(fn: Callable[[], object], *, cuda: bool = False) -> int:
    """The most memory the torch allocator held at once during `fn()`, above what it held before.

    CPU: from the profiler's allocation and free events, in order. CUDA: from
    torch.cuda.max_memory_allocated after resetting the peak. NumPy memory is not seen.
    """
    import torch

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated() - before)
    live = peak = 0
    for _, nbytes in _cpu_allocations(profile_ops(fn)):
        live += nbytes
        peak = max(peak, live)
    return int(peak)


def largest_allocation(fn: Callable[[], object]) -> int:
    """The largest single CPU allocation (bytes) the torch allocator made during `fn()`."""
    return max([n for _, n in _cpu_allocations(profile_ops(fn))] + [0])


def cuda_memory_snapshot(fn: Callable[[], object], path: str, *, max_entries: int = 100_000):
    """Record the CUDA caching allocator's history during `fn()` and save it to `path` (a pickle
    that https://pytorch.org/memory_viz draws). Returns the peak bytes allocated during the call."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("cuda_memory_snapshot: no CUDA device is available")
    torch.cuda.memory._record_memory_history(max_entries=max_entries)
    try:
        peak = peak_bytes(fn, cuda=True)
        torch.cuda.memory._dump_snapshot(path)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return peak
