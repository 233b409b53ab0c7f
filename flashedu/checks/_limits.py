"""The limits a learner's function runs under in a grader: a time limit per case, and its inputs
left alone.

Time. Each case gets `case_seconds()`: the `time_limit=` a grader was called with, else the
environment variable FLASHEDU_TIME_LIMIT, else its chapter's default: DEFAULT_SECONDS (10 s), or
CHAPTER_SECONDS for the two chapters whose first case pays a one-time warm-up (45 s), several
times the slowest honest case measured (see CHAPTER_SECONDS). A function still running at the
limit is stopped: `TimeLimitExceeded` is raised inside it, the grader reports that case as timed
out, does not run the cases after it, and returns; the notebook's kernel goes on as before.

How it is stopped, and what that can and cannot reach:
* In the main thread on Linux and macOS (where a notebook's cells and the checks CLI run) a SIGALRM
  timer raises the exception from its signal handler. Python runs a handler between bytecodes, so
  a pure-Python loop stops within milliseconds, and so does `time.sleep`. A single long call into
  C (one huge NumPy or torch operation) is stopped when it returns to Python, not before. The timer
  fires again every quarter second; should the function have swallowed the first exception (an
  `except BaseException: pass` in a loop), every line it runs from then on raises again (a trace
  function, installed only then), which no handler can absorb.
* Elsewhere (Windows, or a grader called from another thread) a watchdog thread raises the
  exception in the grading thread with `PyThreadState_SetAsyncExc`, again every quarter second:
  the same reach, but neither `time.sleep` nor a function that swallows every exception forever
  (a trace function cannot be installed in another thread).
* Neither can stop a GPU kernel. A Triton launch that never finishes on a GPU blocks the next
  synchronising call inside C; only restarting the kernel (the notebook's, which also frees the GPU)
  ends it. Under TRITON_INTERPRET=1 (no GPU) a launch is Python code and is stopped like any loop.
A trace function from the start would reach no further, would slow every line the learner runs,
and would clash with the graders' own tracers (`_watch.numpy_held`): it is used only for
that escalation.

Inputs. `on_copies(fn)` gives the learner copies of a case's arrays and tensors and afterwards
compares them with the originals: a function that writes into an input is a failed case that names
the argument (a caller's arrays must not change under it). A case with its own runner (`Case.call`,
which may hand over instrumented arrays that a copy would disturb) runs on the case's arrays, and
`watched` compares them with a copy taken before: the same verdict, though the arrays themselves
were not protected.

Used by `_core.grade`; tested in tests/faults/test_faults_hangs.py and test_faults_silent.py.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import math
import os
import signal
import sys
import threading
from typing import Any, Callable

import numpy as np

ENV = "FLASHEDU_TIME_LIMIT"
# The slowest case of an honest solution, per chapter (tests/test_checks_chNN.py's learner-style
# and package solutions, on a 2-core CPU shared with other work): ch05 14.0 s and ch10 9.9 s (their
# first case, which pays a one-time warm-up: torch's autograd machinery, the interpreter's first
# launch), ch03, ch04, ch06, ch07 at most 2.1 s, every other chapter at most 0.2 s. The limits
# leave a slower machine several times that.
DEFAULT_SECONDS = 10.0
CHAPTER_SECONDS: dict[str, float] = {"ch05": 45.0, "ch10": 45.0}
REFIRE_SECONDS = 0.25

_OVERRIDE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "flashedu_time_limit", default=None
)
_CHAPTER: contextvars.ContextVar[str] = contextvars.ContextVar("flashedu_chapter", default="")


class TimeLimitExceeded(BaseException):
    """Raised inside a learner's function that ran past its limit. A BaseException, so a learner's
    `except Exception` does not swallow it."""


def check_seconds(value, *, arg: str = "time_limit", name: str = "checks") -> float:
    """A positive, finite number of seconds (a bool or a string is refused)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise TypeError(
            f"{name}: {arg} must be a positive number of seconds, got {type(value).__name__} "
            f"{value!r}"
        )
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"{name}: {arg} must be a positive, finite number of seconds, got {value!r}"
        )
    return float(value)


def case_seconds() -> float:
    """The limit for one case: time_limit=, else FLASHEDU_TIME_LIMIT, else the chapter's default
    (CHAPTER_SECONDS, else DEFAULT_SECONDS)."""
    override = _OVERRIDE.get()
    if override is not None:
        return override
    text = os.environ.get(ENV, "").strip()
    if not text:
        return CHAPTER_SECONDS.get(_CHAPTER.get(), DEFAULT_SECONDS)
    try:
        return check_seconds(float(text), arg=ENV)
    except (TypeError, ValueError):
        raise ValueError(
            f"checks: the environment variable {ENV} must be a positive number of seconds, "
            f"got {text!r}"
        ) from None


@contextlib.contextmanager
def seconds_per_case(value, chapter: str = ""):
    """Within the block, every case gets `value` seconds (None: the default of `chapter`, a
    grader's module such as "flashedu.checks.ch05")."""
    if value is None:
        case_seconds()  # a bad FLASHEDU_TIME_LIMIT is refused before any case runs
    token = _OVERRIDE.set(None if value is None else check_seconds(value))
    chapter_token = _CHAPTER.set(chapter.rsplit(".", 1)[-1])
    try:
        yield
    finally:
        _CHAPTER.reset(chapter_token)
        _OVERRIDE.reset(token)


def _raise_everywhere(seconds: float, frame, start) -> None:
    """Escalation for a function that swallowed the exception and kept going: from now on every
    line it runs raises again, so an `except` that catches it raises from its own first line and
    the exception climbs out of every handler. The frame that entered the limit and its callers
    (the grader) are left alone, as are this module and contextlib (the limit's own exit)."""
    protected, f = set(), start
    while f is not None:
        protected.add(id(f))
        f = f.f_back
    ours = (__file__, contextlib.__file__)

    def tracer(f, event, arg):
        if event in ("line", "call") and id(f) not in protected:
            if f.f_code.co_filename not in ours:
                raise TimeLimitExceeded(seconds)
        return tracer

    sys.settrace(tracer)
    while frame is not None and id(frame) not in protected:
        frame.f_trace = tracer
        frame = frame.f_back


@contextlib.contextmanager
def _alarm(seconds: float):
    state = {"armed": True, "fired": 0}
    old_trace, start = sys.gettrace(), sys._getframe(2)  # the frame that entered the limit

    def handler(signum, frame):
        if not state["armed"]:
            return
        state["fired"] += 1
        if state["fired"] > 1:  # the first one was swallowed
            _raise_everywhere(seconds, frame, start)
        raise TimeLimitExceeded(seconds)

    old_handler = signal.signal(signal.SIGALRM, handler)
    old_timer = signal.setitimer(signal.ITIMER_REAL, seconds, REFIRE_SECONDS)
    try:
        yield
    finally:
        state["armed"] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if state["fired"] > 1:
            sys.settrace(old_trace)
        if old_timer[0] > 0:  # an enclosing limit keeps running
            signal.setitimer(signal.ITIMER_REAL, *old_timer)


def _exiting(target: int) -> bool:
    """Whether thread `target` is running `_watchdog`'s own code (its exit): no exception then."""
    frame = sys._current_frames().get(target)
    while frame is not None:
        if frame.f_code is _WATCHDOG_CODE:
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def _watchdog(seconds: float):
    target, done = threading.get_ident(), threading.Event()
    raise_in = ctypes.pythonapi.PyThreadState_SetAsyncExc

    def watch():
        wait = seconds
        while not done.wait(wait):
            if not _exiting(target):  # an exception in the exit would leave this thread firing
                raise_in(ctypes.c_ulong(target), ctypes.py_object(TimeLimitExceeded))
            wait = REFIRE_SECONDS

    thread = threading.Thread(target=watch, name="flashedu-time-limit", daemon=True)
    thread.start()
    try:
        yield
    finally:
        while True:  # one exception may still land here, between the check and the raise
            try:
                done.set()
                thread.join()
                raise_in(ctypes.c_ulong(target), None)  # drop one raised but not yet delivered
                break
            except TimeLimitExceeded:
                continue


_WATCHDOG_CODE = _watchdog.__wrapped__.__code__


def time_limit(seconds: float):
    """A context manager that raises TimeLimitExceeded in this thread after `seconds`."""
    seconds = check_seconds(seconds)
    main = threading.current_thread() is threading.main_thread()
    return _alarm(seconds) if main and hasattr(signal, "setitimer") else _watchdog(seconds)


# ---------------------------------------------------------------------------- inputs left alone


def _is_tensor(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "clone")


def _copy(x):
    if isinstance(x, np.ndarray):
        return x.copy()
    if _is_tensor(x):
        return x.detach().clone().requires_grad_(x.requires_grad)
    if isinstance(x, (tuple, list)):
        return type(x)(_copy(i) for i in x)
    if isinstance(x, dict):
        return {k: _copy(i) for k, i in x.items()}
    return x


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    if _is_tensor(a):
        import torch

        a, b = a.detach(), b.detach()
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.is_floating_point():
            return bool(((a == b) | (a.isnan() & b.isnan())).all())
        return torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(i, j) for i, j in zip(a, b))
    if isinstance(a, dict):
        return all(_same(a[k], b.get(k)) for k in a)
    return True


def _names(fn, n_args: int) -> list[str]:
    """The learner's parameter names for the first n_args positions (arg0, arg1, ... if unknown)."""
    import inspect

    try:
        params = [
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        params = []
    return [params[i] if i < len(params) else f"argument {i}" for i in range(n_args)]


def first_changed(fn: Callable, before: tuple, args: tuple, kwargs: dict) -> str:
    """The name of the first of args / kwargs that differs from `before` = _copy((args, kwargs)),
    named as fn names its parameters; "" when none changed."""
    old_args, old_kwargs = before
    for name, a, c in zip(_names(fn, len(args)), old_args, args):
        if not _same(a, c):
            return name
    for key, a in old_kwargs.items():
        if not _same(a, kwargs.get(key)):
            return key
    return ""


def watched(fn: Callable, call: Callable, args: tuple, kwargs: dict) -> tuple[Any, str]:
    """For a case with its own runner, which hands fn the case's own arrays: (call(fn), the name
    of the first of them fn changed, or "")."""
    before = _copy((args, kwargs))
    got = call(fn)
    return got, first_changed(fn, before, args, kwargs)


def on_copies(fn: Callable, args: tuple, kwargs: dict) -> tuple[Any, str]:
    """(fn's answer on copies of args and kwargs, "" or the name of the first input it changed)."""
    args_c, kwargs_c = _copy(args), _copy(kwargs)
    got = fn(*args_c, **kwargs_c)
    return got, first_changed(fn, (args, kwargs), args_c, kwargs_c)
