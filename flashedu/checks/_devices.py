"""A simulated GPU or CPU on which a timing harness can be graded on any machine.

`FakeDevice` has the interface of `flashedu.profiling.Device` (clock, synchronize, flush_l2,
is_gpu) and a `kernel()` to time. Its clock is simulated time, so the same harness always reads
the same numbers, and every classic timing mistake changes the answer:

- the first call compiles the kernel (`compile_ms`, on the host) and the first `ramp_calls` calls
  run `ramp` times slower, as a GPU's clock ramps up from idle: time without a warm-up and most
  samples are slow;
- every `slow_every`-th call is `slow` times slower (another process, a clock dip): a mean moves,
  a median does not;
- on the GPU, `kernel()` only queues the kernel and returns after `launch_us`; the kernel runs
  when the queue is free, and `synchronize()` moves the host clock to when the queue drains: read
  the clock without synchronising and you time the launch;
- on the GPU, a call whose inputs the previous call left in the L2 cache (no `flush_l2()` in
  between) takes `warm_l2` of the time; `flush_l2()` queues a flush kernel of `flush_ms`, which is
  still running unless the harness synchronises before it starts the clock.

`expected_ms` is what a careful harness reports: one call at full clock, inputs not in L2, launch
included. `events` logs every call to the device, for the grader's diagnosis. Used by
`flashedu.checks.ch08.check_timing_harness`; tested in tests/checks/test_ch08.py.
"""

from __future__ import annotations


class FakeDevice:
    """A simulated device (see the module docstring). All times are in simulated seconds."""

    def __init__(
        self,
        *,
        gpu: bool = True,
        kernel_ms: float = 1.0,
        launch_us: float = 5.0,
        compile_ms: float = 200.0,
        ramp_calls: int = 5,
        ramp: float = 1.5,
        slow_every: int = 5,
        slow: float = 3.0,
        warm_l2: float = 0.7,
        flush_ms: float = 0.5,
    ):
        if not kernel_ms > 0:
            raise ValueError(f"FakeDevice: kernel_ms must be > 0, got {kernel_ms!r}")
        self.is_gpu = bool(gpu)
        self.name = f"fake {'GPU' if gpu else 'CPU'} ({kernel_ms:g} ms kernel)"
        self.kernel_ms, self.launch_us, self.compile_ms = kernel_ms, launch_us, compile_ms
        self.ramp_calls, self.ramp, self.slow_every, self.slow = ramp_calls, ramp, slow_every, slow
        self.warm_l2, self.flush_ms = warm_l2, flush_ms
        self.events: list[str] = []  # "call", "clock", "sync", "flush", in order
        self.calls = 0
        self._host = 0.0  # the host's clock
        self._idle_at = 0.0  # when the GPU's queue drains
        self._inputs_in_l2 = False

    @property
    def expected_ms(self) -> float:
        """One call at full clock with its inputs in HBM, as a careful harness measures it."""
        return self.kernel_ms + (self.launch_us / 1e3 if self.is_gpu else 0.0)

    def call_seconds(self, i: int, inputs_in_l2: bool) -> float:
        """How long call number i (from 0) runs on the device."""
        t = self.kernel_ms / 1e3
        t *= self.ramp if i < self.ramp_calls else 1.0
        t *= self.slow if self.slow_every and i % self.slow_every == self.slow_every - 1 else 1.0
        return t * (self.warm_l2 if self.is_gpu and inputs_in_l2 else 1.0)

    # ------------------------------------------------------------------ the Device interface

    def clock(self) -> float:
        self.events.append("clock")
        return self._host

    def synchronize(self) -> None:
        self.events.append("sync")
        self._host = max(self._host, self._idle_at)

    def flush_l2(self) -> None:
        self.events.append("flush")
        if self.is_gpu:
            self._queue(self.flush_ms / 1e3)
            self._inputs_in_l2 = False

    def kernel(self) -> None:
        """One call of the kernel being timed."""
        self.events.append("call")
        i, self.calls = self.calls, self.calls + 1
        if i == 0:
            self._host += self.compile_ms / 1e3  # JIT compilation happens on the host
        seconds = self.call_seconds(i, self._inputs_in_l2)
        if self.is_gpu:
            self._queue(seconds)
        else:
            self._host += seconds
        self._inputs_in_l2 = True  # the call loaded Q, K, V; they stay in L2 until flushed

    def _queue(self, seconds: float) -> None:
        self._host += self.launch_us / 1e6  # the launch returns; the work waits in the queue
        self._idle_at = max(self._host, self._idle_at) + seconds

    # ------------------------------------------------------------------------ the diagnosis

    def problems(self) -> list[str]:
        """What the event log shows a harness did wrong, most basic first."""
        ev, found = self.events, []
        if "clock" not in ev:
            return [
                "device.clock() was never read: time with the device's clock (on a real GPU, "
                "time.perf_counter() is the same host clock)"
            ]
        if "call" in ev and "clock" in ev and ev.index("call") > ev.index("clock"):
            found.append(
                "no warm-up: the first timed call compiles the kernel and the first few "
                "run at a low clock; call fn a few times before timing"
            )
        if self.is_gpu:
            found += _gpu_problems(ev)
        return found


class DeviceView:
    """What a timing harness is handed: the Device interface of a FakeDevice (clock, synchronize,
    flush_l2, is_gpu, name) and nothing else, so the answer cannot be read off the simulation's
    settings (`expected_ms`, `kernel_ms`) instead of measured."""

    __slots__ = ("clock", "synchronize", "flush_l2", "is_gpu", "name")

    def __init__(self, dev: FakeDevice):
        self.clock, self.synchronize = _call(dev.clock), _call(dev.synchronize)
        self.flush_l2 = _call(dev.flush_l2)
        self.is_gpu, self.name = dev.is_gpu, dev.name

    def __repr__(self) -> str:
        return f"<{self.name}>"


def _call(method):
    """A plain function that calls `method` (no __self__ that leads back to the device)."""

    def call():
        return method()

    return call


def kernel_of(dev: FakeDevice):
    """The kernel to time as a plain function."""

    def kernel() -> None:
        dev.kernel()

    return kernel


def _gpu_problems(ev: list[str]) -> list[str]:
    found = []
    timed = [i for i, e in enumerate(ev) if e == "clock"]
    if any(_last(ev[:i], ("call", "sync")) == "call" for i in timed):
        found.append(
            "no synchronize after fn(): on a GPU the call returns once the kernel is "
            "queued, so the clock stopped before the kernel ran"
        )
    timed_calls = [i for i, e in enumerate(ev) if e == "call" and timed and i > timed[0]]
    if any(_last(ev[:i], ("call", "flush")) == "call" for i in timed_calls):
        found.append(
            "no L2 flush between timed calls: each found its inputs in the L2 cache the "
            "call before left there"
        )
    if any(_last(ev[:i], ("flush", "sync")) == "flush" for i in timed):
        found.append(
            "the clock started while the L2 flush was still running: synchronize after flush_l2()"
        )
    return found


def _last(events: list[str], kinds: tuple[str, ...]) -> str | None:
    """The last event among `kinds`, or None."""
    for e in reversed(events):
        if e in kinds:
            return e
    return None
