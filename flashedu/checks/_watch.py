"""The array watcher and the one-pass stream behind `_method`'s checks (re-exported there).

`watch_arrays(limit_elems)` and `largest_array(fn, ...)` find the largest NumPy array or torch
tensor made during a call: NumPy arrays handed in are watched (`ArrayWatch.wrap`), so every result
computed from them is recorded with its shape; torch operations are seen through a
`TorchFunctionMode`; tracemalloc catches NumPy memory made some other way (`np.zeros((N, N))`), and
`largest_array` then reruns the call once to find that array's shape among the frames' locals.
`OnePass` hands out the columns of a 2-D array in blocks, once. Tested in
tests/checks/test_method.py.
"""

from __future__ import annotations

import math
import sys
import tracemalloc
from contextlib import contextmanager

import numpy as np

from ._shared import Shortcut

# ---------------------------------------------------------------------------- array watcher


def shape_text(shape) -> str:
    """(300, 300) -> '300x300'; () -> 'scalar'."""
    return "x".join(str(int(n)) for n in shape) or "scalar"


class ArrayWatch:
    """What `watch_arrays` saw: the largest array (shape, elements) and the NumPy peak (bytes)."""

    def __init__(self, limit_elems: int | None, what: str):
        self.limit_elems, self.what = limit_elems, what
        self.largest_shape: tuple | None = None
        self.largest_elems = 0
        self.peak_bytes = 0

    def record(self, x) -> None:
        shape = tuple(x.shape)
        n = math.prod(shape)
        if n > self.largest_elems:
            self.largest_shape, self.largest_elems = shape, n

    def wrap(self, x):
        """x as a watched array: NumPy arrays become WatchedArray views; anything else is
        returned as it is (torch operations are watched anyway)."""
        if isinstance(x, np.ndarray) and not isinstance(x, WatchedArray):
            return x.view(WatchedArray)
        if isinstance(x, (tuple, list)):
            return type(x)(self.wrap(v) for v in x)
        return x

    @property
    def over(self) -> bool:
        if self.limit_elems is None:
            return False
        return self.largest_elems >= self.limit_elems or self.peak_bytes >= 8 * self.limit_elems

    @property
    def message(self) -> str:
        if self.limit_elems is not None and self.largest_elems >= self.limit_elems:
            return f"built a {shape_text(self.largest_shape)} array"
        kib = self.peak_bytes / 1024
        return f"held {kib:,.0f} KiB of NumPy arrays at once, the size of {self.what}"


_WATCHES: list[ArrayWatch] = []


def _record_all(out) -> None:
    if isinstance(out, (tuple, list)):
        for x in out:
            _record_all(x)
    elif hasattr(out, "shape") and hasattr(out, "dtype") and _WATCHES:
        if isinstance(out, np.ndarray) and out.base is not None:
            return  # a view: no new memory
        if getattr(out, "_base", None) is not None:
            return  # a torch view
        for w in _WATCHES:
            w.record(out)


class WatchedArray(np.ndarray):
    """A NumPy array whose operations are recorded by the active `watch_arrays` (shape only).

    Results of operations on it are WatchedArrays too, so a whole computation is followed. A block
    of a `OnePass` stream is one as well (`_stream` set): using it after it expired raises.
    """

    __slots__ = ("_stream", "_index")  # no per-array __dict__: thousands of blocks stay cheap

    def __array_finalize__(self, obj):
        self._stream = getattr(obj, "_stream", None)
        self._index = getattr(obj, "_index", -1)

    def _touch(self) -> None:
        stream = getattr(self, "_stream", None)
        if stream is not None:
            stream._check(self._index)

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        _touch_all(inputs + (out or ()))
        args = [_plain(x) for x in inputs]
        if out is not None:
            kwargs["out"] = tuple(_plain(x) for x in out)
        result = getattr(ufunc, method)(*args, **kwargs)
        if out is not None:
            return out[0] if len(out) == 1 else out
        return _rewrap(result)

    def __array_function__(self, func, types_, args, kwargs):
        _touch_all(_flatten(args) + _flatten(tuple(kwargs.values())))
        result = func(*_unwrap(args), **dict(zip(kwargs, _unwrap(tuple(kwargs.values())))))
        return _rewrap(result)


def _flatten(items) -> tuple:
    flat = []
    for x in items:
        if isinstance(x, (tuple, list)):
            flat.extend(_flatten(x))
        else:
            flat.append(x)
    return tuple(flat)


def _touch_all(items) -> None:
    for x in items:
        if isinstance(x, WatchedArray):
            x._touch()


def _plain(x):
    return x.view(np.ndarray) if isinstance(x, WatchedArray) else x


def _unwrap(items):
    return tuple(type(x)(_unwrap(x)) if isinstance(x, (tuple, list)) else _plain(x) for x in items)


def _rewrap(result):
    if isinstance(result, tuple):
        return tuple(_rewrap(r) for r in result)
    if isinstance(result, np.ndarray):
        _record_all(result)
        return result.view(WatchedArray)
    return result


def _torch_spy():
    try:
        from torch.overrides import TorchFunctionMode
    except ImportError:  # pragma: no cover (torch is a dependency)
        return None

    class _Spy(TorchFunctionMode):
        def __torch_function__(self, func, types_, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            _record_all(out)
            return out

    return _Spy()


@contextmanager
def watch_arrays(limit_elems: int | None = None, what: str = "an N_q x N_k array"):
    """Record the largest array made in the block; raise Shortcut at the end when it reaches
    `limit_elems` elements (or NumPy's peak reaches that many float64s). Yields the ArrayWatch."""
    w = ArrayWatch(limit_elems, what)
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    spy = _torch_spy()
    _WATCHES.append(w)
    try:
        if spy is not None:
            with spy:
                yield w
        else:  # pragma: no cover
            yield w
    finally:
        w.peak_bytes = max(0, tracemalloc.get_traced_memory()[1] - base)
        _WATCHES.remove(w)
        if not tracing:
            tracemalloc.stop()
    if w.over:
        raise Shortcut(w.message)


def find_large_local(fn, args, kwargs, limit_elems: int) -> tuple | None:
    """Rerun fn with a line tracer; the shape of the first local array of >= limit_elems."""
    found: list[tuple] = []

    def local(frame, event, arg):
        if not found and event in ("line", "return"):
            for v in list(frame.f_locals.values()):
                if isinstance(v, np.ndarray) and v.size >= limit_elems:
                    found.append(v.shape)
                    break
        return local

    def call(frame, event, arg):
        name = frame.f_code.co_filename
        return None if ("site-packages" in name or "/flashedu/" in name) else local

    previous = sys.gettrace()
    sys.settrace(call)
    try:
        fn(*args, **kwargs)
    except Exception:
        pass
    finally:
        sys.settrace(previous)
    return found[0] if found else None


def largest_array(fn, *args, limit_elems: int | None = None, what="an N_q x N_k array", **kwargs):
    """Call fn(*args, **kwargs) with its NumPy arguments watched: (result, ArrayWatch).

    With `limit_elems`, raises Shortcut("built a 300x300 array") when fn made an array that large;
    when only NumPy's memory peak gave it away, the call is rerun once to find the array's shape.
    """
    w: ArrayWatch | None = None
    try:
        with watch_arrays(limit_elems, what) as w:
            result = fn(*w.wrap(args), **kwargs)
    except Exception as e:
        if type(e).__name__ != "Shortcut":
            raise
        if w is not None and w.over and w.largest_elems < (limit_elems or 0):
            shape = find_large_local(fn, args, kwargs, limit_elems)
            if shape is not None:
                w.largest_shape, w.largest_elems = shape, math.prod(shape)
                raise Shortcut(w.message) from None
        raise
    return result, w


# ---------------------------------------------------------------------------- one pass


class OnePass:
    """The columns of x (M, N), `block` at a time, through an iterator that can be walked once.

    `shape` is x's. Each block is a fresh (M, c) WatchedArray; when the next one is handed out, the
    previous one expires: its values become NaN, and using it raises Shortcut("read the row
    twice"). Walking the blocks a second time raises the same.
    """

    def __init__(self, x: np.ndarray, block: int):
        self._x, self._block = np.asarray(x), int(block)
        self.shape = self._x.shape
        self._started = False
        self._current = -1
        self._live: list[WatchedArray] = []
        self.violations: list[str] = []

    def __iter__(self):
        if self._started:
            self._fail("walked the blocks a second time")
        self._started = True
        return self._blocks()

    def _blocks(self):
        for i, c0 in enumerate(range(0, self.shape[1], self._block)):
            self._expire()
            self._current = i
            b = self._x[:, c0 : c0 + self._block].copy().view(WatchedArray)
            b._stream, b._index = self, i
            self._live.append(b)
            yield b
        self._expire()
        self._current += 1

    def _expire(self) -> None:
        for b in self._live:
            b.view(np.ndarray)[...] = np.nan
        self._live.clear()

    def _check(self, index: int) -> None:
        if index < self._current:
            self._fail(f"used block {index} again after moving past it")

    def _fail(self, what: str):
        self.violations.append(what)
        raise Shortcut(f"read the row twice ({what})")

    def close(self) -> None:
        """Expire every block (call when the learner's function has returned)."""
        self._expire()
        self._current = max(self._current, 0) + 1
