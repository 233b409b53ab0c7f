"""The array watcher and the one-pass stream behind `_method`'s checks (re-exported there).

`watch_arrays(limit_elems, rule=...)` records every NumPy array and torch tensor the code in its
block creates:

- torch: a `TorchDispatchMode` sees every aten operation, so views, `out=` results and tensors
  made inside a custom `autograd.Function.backward` are all recorded with their shapes; a fused
  attention operation (`scaled_dot_product_attention`) is a named shortcut.
- NumPy: arrays handed in are `WatchedArray`s, whose results are WatchedArrays too; while the
  watch is on, `np.array`, `np.asarray`, `np.zeros`, `np.empty`, ..., and `np.memmap` keep that
  type and record what they make. NumPy memory made past them is caught by tracemalloc, read in
  NumPy's own domain (`np.lib.tracemalloc_domain`): when the total peak is over the limit, the
  call is rerun under a line tracer that counts only NumPy's allocations (autograd's Python
  objects do not count) and names the largest array it finds.

A `TileRule` (the grader's N_q, N_k, d, block_m, block_n) judges every recorded shape: an array
with an axis longer than the tiles allow that is not a query axis is a block of scores held
across more keys than the grader asked for ("your code held a 16x600 block of scores, 600 keys at
once: the grader asked for block_n = 12"). The rule also counts passes: q and k are registered
as sources, every copy and view of them keeps the row ids of its elements (by address), and each
product of a q-derived with a k-derived operand adds one to every (query row, key row) pair it
covers; a pair computed more often than the rule allows is a second pass over the keys.

`OnePass` hands out the columns of a 2-D array in blocks, once; it keeps no attribute that holds
the whole array. Tested in tests/checks/test_method.py, tests/checks/test_watch_records.py and
tests/checks/test_ch0*_shortcuts.py.
"""

from __future__ import annotations

import math
import sys
import tracemalloc
import weakref
from contextlib import ExitStack, contextmanager

import numpy as np

from ._shared import Shortcut

_NP_DOMAIN = np.lib.tracemalloc_domain
_BUSY = [0]  # > 0 while the watcher's own bookkeeping runs: nothing it makes is recorded


def _quietly(f):
    def run(*args, **kwargs):
        _BUSY[0] += 1
        try:
            return f(*args, **kwargs)
        finally:
            _BUSY[0] -= 1

    run.__name__, run.__doc__ = f.__name__, f.__doc__
    return run


# ---------------------------------------------------------------------------- the tile rule


def shape_text(shape) -> str:
    """(300, 300) -> '300x300'; () -> 'scalar'."""
    return "x".join(str(int(n)) for n in shape) or "scalar"


class TileRule:
    """What a tiled method may hold, from the grader's sizes.

    n_q, n_k: the query and key lengths of the watched call; d: the head dim (an array with an
    axis of length d is a row-vector array such as q, k, o or dq, never scores); block_m,
    block_n: the grader's tiles. passes: how often each (query row, key row) score may be
    computed (1 for a forward, 2 for a backward that may rebuild P for dQ separately).
    """

    def __init__(self, n_q, n_k, d, block_m, block_n, *, passes=1, phase="the loop", heads=1):
        self.n_q, self.n_k, self.d, self.heads = int(n_q), int(n_k), int(d), int(heads)
        self.block_m, self.block_n = int(block_m), int(block_n)
        self.passes, self.phase = passes, phase
        self._seen: dict[tuple, str] = {}

    def judge(self, shape, kind: str) -> str:
        """'' if an array of this shape fits the tiles, else what is wrong. kind: 'f' (floats),
        'b' (a mask) or 'i' (indices: never judged)."""
        key = (tuple(shape), kind)
        if key not in self._seen:
            self._seen[key] = self._judge(shape, kind)
        return self._seen[key]

    def _judge(self, shape, kind: str) -> str:
        if kind == "i":
            return ""
        dims = [int(n) for n in shape if n > 1]
        if self.d in dims:
            return ""
        tile = max(self.block_m, self.block_n)
        long = [n for n in dims if n > tile and n != self.n_q]
        if not long:
            return ""
        what = "mask" if kind == "b" else "block of scores"
        if self.n_q in dims and self.n_k in dims:
            what = "mask over all N_q x N_k pairs" if kind == "b" else "matrix of all scores"
        return (
            f"your code held a {shape_text(dims)} {what}, {max(long)} keys at once: the grader "
            f"asked for block_n = {self.block_n}"
        )


# ---------------------------------------------------------------------------- row provenance


class _Rows:
    """Buffers whose elements are rows of q or k: (start address, end, itemsize, name, rowmap).

    rowmap[i] is the row id of the element i items past the start (-1: none). A view of any
    registered buffer, NumPy or torch, gets its row ids from its address and strides. Entries
    are dropped when their owner is freed, so a reused address is never mistaken for one."""

    def __init__(self):
        self.entries: dict[int, tuple] = {}
        self._key = 0

    def register(self, x, name: str, rows) -> None:
        """Register x (array or tensor) as holding rows `rows` (broadcastable to x.shape)."""
        info = _layout(x)
        if info is None:
            return
        start, itemsize, strides, shape = info
        if any(s < 0 for s in strides):
            return
        span = 1 + sum((n - 1) * s for n, s in zip(shape, strides)) if all(shape) else 0
        if span <= 0:
            return
        rowmap = np.full(span, -1, dtype=np.int64)
        offsets = np.zeros(shape, dtype=np.int64)
        for axis, (n, s) in enumerate(zip(shape, strides)):
            ix = [1] * len(shape)
            ix[axis] = n
            offsets = offsets + (np.arange(n, dtype=np.int64) * s).reshape(ix)
        rowmap[offsets.ravel()] = np.broadcast_to(rows, shape).ravel()
        self._key += 1
        key = self._key
        self.entries[key] = (start, start + span * itemsize, itemsize, name, rowmap)
        try:
            weakref.finalize(x, self.entries.pop, key, None)
        except TypeError:  # pragma: no cover (arrays and tensors take weak references)
            pass

    def of(self, x):
        """(name, row ids shaped like x) for a view or copy of a source, else None."""
        if not self.entries:
            return None
        info = _layout(x)
        if info is None:
            return None
        start, itemsize, strides, shape = info
        for lo, hi, size, name, rowmap in self.entries.values():
            if lo <= start < hi and size == itemsize and (start - lo) % itemsize == 0:
                off = (start - lo) // itemsize
                if any(s < 0 for s in strides):
                    return None
                last = off + sum((n - 1) * s for n, s in zip(shape, strides)) if all(shape) else 0
                if last >= rowmap.size:
                    return None
                step = rowmap.itemsize
                view = np.ndarray(shape, np.int64, rowmap, off * step, [t * step for t in strides])
                return name, view
        return None

    def clear(self) -> None:
        self.entries.clear()


def _layout(x):
    """(address, itemsize, strides in items, shape) of an ndarray or a CPU tensor, else None."""
    if isinstance(x, np.ndarray):
        size = x.itemsize
        if size == 0 or any(s % size for s in x.strides):
            return None
        return x.ctypes.data, size, [s // size for s in x.strides], x.shape
    if _is_tensor(x):
        if not x.is_cpu or x.layout is not _torch().strided:
            return None
        return x.data_ptr(), x.element_size(), list(x.stride()), tuple(x.shape)
    return None


def _torch():
    import torch

    return torch


def _is_tensor(x) -> bool:
    t = sys.modules.get("torch")
    return t is not None and isinstance(x, t.Tensor)


# ---------------------------------------------------------------------------- array watcher


class ArrayWatch:
    """What `watch_arrays` saw: the largest array (shape, elements), the NumPy peak (bytes),
    the first shape the TileRule rejected, and the score pairs computed."""

    def __init__(self, limit_elems: int | None, what: str, rule: TileRule | None = None):
        self.limit_elems, self.what, self.rule = limit_elems, what, rule
        self.largest_shape: tuple | None = None
        self.largest_elems = 0
        self.peak_bytes = 0
        self.numpy_confirmed = False
        self.violation = ""
        self.rows = _Rows()
        self.pairs: np.ndarray | None = None
        self.unused: dict[str, bool] = {}  # name -> still untouched (inputs that must be used)
        self.wide = ""  # a product of more q rows or k rows than one tile holds
        if rule is not None:
            self.pairs = np.zeros((rule.heads * rule.n_q, rule.heads * rule.n_k), np.uint16)

    def record(self, x, how: str = "") -> None:
        shape = tuple(x.shape)
        n = x.size if isinstance(x, np.ndarray) else x.numel()
        if n >= self.largest_elems:
            if n > self.largest_elems or len(shape) > len(self.largest_shape or ()):
                self.largest_shape, self.largest_elems = shape, n
        if self.rule is not None and not self.violation:
            why = self.rule.judge(shape, _kind(x))
            if why:
                self.violation = why.replace("held a", f"held a{how}", 1) if how else why

    def shortcut(self, message: str) -> None:
        if not self.violation:
            self.violation = message

    def wrap(self, x):
        """x as a watched array: NumPy arrays become WatchedArray views; anything else is
        returned as it is (torch operations are watched anyway)."""
        if isinstance(x, np.ndarray) and not isinstance(x, WatchedArray):
            return x.view(WatchedArray)
        if isinstance(x, (tuple, list)):
            return type(x)(self.wrap(v) for v in x)
        return x

    @_quietly
    def source(self, x, name: str):
        """Register x (handed in, shape (..., N, d)) as the rows of q or k; returns x. Only a
        watch with a TileRule counts pairs (a rerun that measures memory registers nothing)."""
        if self.rule is None:
            return x
        n = x.shape[-2]
        lead = math.prod(x.shape[:-2])
        rows = np.arange(lead * n).reshape(*x.shape[:-2], n, 1) if lead else 0
        self.rows.register(x, name, rows)
        return x

    def must_use(self, x, name: str):
        """Remember that x (a WatchedArray handed in) has to be read by the call."""
        if isinstance(x, WatchedArray):
            x._flag = name
            self.unused[name] = True
        return x

    def count_pairs(self, operands) -> None:
        """One more computation of the scores of the q rows x k rows among `operands`."""
        if self.pairs is None:
            return
        found: dict[str, list] = {}
        for x in operands:
            hit = self.rows.of(x)
            if hit is not None:
                found.setdefault(hit[0], []).append(hit[1])
        if "q" not in found or "k" not in found:
            return
        rq = np.unique(np.concatenate([r.ravel() for r in found["q"]]))
        rk = np.unique(np.concatenate([r.ravel() for r in found["k"]]))
        rq = rq[(rq >= 0) & (rq < self.pairs.shape[0])]
        rk = rk[(rk >= 0) & (rk < self.pairs.shape[1])]
        if rq.size and rk.size:
            self.pairs[np.ix_(rq, rk)] += 1
            self._judge_product(rq, rk)

    def _judge_product(self, rq, rk) -> None:
        """A product of q rows with k rows is one tile: at most block_m x block_n per head."""
        rule = self.rule
        heads = max(1, np.unique(rk // rule.n_k).size)
        n_q, n_k = rq.size // heads, rk.size // heads
        if self.wide or (n_k <= rule.block_n and n_q <= rule.block_m):
            return
        if n_k > rule.block_n:
            self.wide = (
                f"your code multiplied {n_q} query rows by {n_k} keys at once: the grader "
                f"asked for block_n = {rule.block_n}"
            )
        else:
            self.wide = (
                f"your code multiplied {n_q} query rows by {n_k} keys at once: the grader "
                f"asked for block_m = {rule.block_m}"
            )

    def check_passes(self) -> str:
        if self.pairs is None or self.rule is None or not self.pairs.size:
            return ""
        most = int(self.pairs.max())
        if most <= self.rule.passes:
            return ""
        i, j = np.unravel_index(int(self.pairs.argmax()), self.pairs.shape)
        i, j = i % self.rule.n_q, j % self.rule.n_k
        times = {2: "twice", 3: "three times"}.get(most, f"{most} times")
        count = {2: "two", 3: "three"}.get(most, str(most))
        if self.rule.passes == 1:
            return (
                f"{count} passes over the keys: {self.rule.phase} computed the score of query "
                f"row {i} and key {j} {times}; the online softmax takes one"
            )
        return (
            f"{count} passes over the keys: {self.rule.phase} computed the score of query row {i} "
            f"and key {j} {times}; rebuild each tile of P once from the saved lse (a separate "
            "pass for dQ at most)"
        )

    @property
    def over(self) -> bool:
        if self.violation:
            return True
        if self.limit_elems is None:
            return False
        return self.largest_elems >= self.limit_elems or self.numpy_confirmed

    @property
    def message(self) -> str:
        if self.violation:
            return self.violation
        if self.limit_elems is not None and self.largest_elems >= self.limit_elems:
            return f"built a {shape_text(self.largest_shape)} array"
        kib = self.peak_bytes / 1024
        return (
            f"held {kib:,.0f} KiB of NumPy arrays at once, more than half the size of {self.what}"
        )


_WATCHES: list[ArrayWatch] = []


_KINDS: dict = {}


def _kind(x) -> str:
    dt = x.dtype
    if dt not in _KINDS:
        name = str(dt)
        _KINDS[dt] = "b" if "bool" in name else "i" if "int" in name else "f"
    return _KINDS[dt]


def _record_all(out, how: str = "") -> None:
    if isinstance(out, (tuple, list)):
        for x in out:
            _record_all(x, how)
    elif _WATCHES and not _BUSY[0] and hasattr(out, "shape") and hasattr(out, "dtype"):
        for w in _WATCHES:
            w.record(out, how)


@_quietly
def _propagate(inputs, out) -> None:
    """out (a fresh array or tensor) takes the row ids of the one source-derived input of its
    shape: a scaled, cast or copied q stays q."""
    if not _WATCHES or not hasattr(out, "shape"):
        return
    for w in _WATCHES:
        if not w.rows.entries:
            continue
        hits = [w.rows.of(x) for x in inputs if hasattr(x, "shape") and x.shape == out.shape]
        hits = [h for h in hits if h is not None]
        if len(hits) == 1 and w.rows.of(out) is None:
            w.rows.register(out, hits[0][0], np.array(hits[0][1]))


@_quietly
def _count(operands) -> None:
    for w in _WATCHES:
        w.count_pairs(operands)


_PRODUCTS = {"matmul", "dot", "einsum", "inner", "tensordot", "vdot", "outer", "multi_dot"}


@_quietly
def _register_index(src, idx, out) -> None:
    for w in _WATCHES:
        hit = w.rows.of(src)
        if hit is not None:
            w.rows.register(out, hit[0], np.array(hit[1][idx]))


class WatchedArray(np.ndarray):
    """A NumPy array whose operations are recorded by the active `watch_arrays` (shape only).

    Results of operations on it are WatchedArrays too, so a whole computation is followed. A block
    of a `OnePass` stream is one as well (`_stream` set): using it after it expired raises.
    """

    __slots__ = ("_stream", "_index", "_flag")  # no per-array __dict__: blocks stay cheap

    def __array_finalize__(self, obj):
        self._stream = getattr(obj, "_stream", None)
        self._index = getattr(obj, "_index", -1)
        self._flag = getattr(obj, "_flag", None)

    def _touch(self) -> None:
        stream = getattr(self, "_stream", None)
        if stream is not None:
            stream._check(self._index)
        flag = getattr(self, "_flag", None)
        if flag is not None:
            for w in _WATCHES:
                w.unused.pop(flag, None)

    def __getitem__(self, idx):
        self._touch()
        out = super().__getitem__(idx)
        if isinstance(out, np.ndarray) and _WATCHES and not np.may_share_memory(out, self):
            _record_all(out)
            _register_index(self, idx, out)
        return out

    def dot(self, b, out=None):
        """a.dot(b) as np.dot(a, b), so the product is recorded and counted like a @ b."""
        return np.dot(self, b, out=out)

    def copy(self, *args, **kwargs):
        out = super().copy(*args, **kwargs)
        _record_all(out)
        _propagate((self,), out)
        return out

    def astype(self, *args, **kwargs):
        out = super().astype(*args, **kwargs)
        if out is not self:
            _record_all(out)
            _propagate((self,), out)
        return out

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        _touch_all(inputs + (out or ()))
        args = [_plain(x) for x in inputs]
        if out is not None:
            kwargs["out"] = tuple(_plain(x) for x in out)
        result = getattr(ufunc, method)(*args, **kwargs)
        if ufunc.__name__ in _PRODUCTS:
            _count(inputs)
        if out is not None:
            return out[0] if len(out) == 1 else out
        wrapped = _rewrap(result)
        if method == "__call__" and ufunc.__name__ not in _PRODUCTS:
            _propagate(inputs, wrapped)
        return wrapped

    def __array_function__(self, func, types_, args, kwargs):
        flat = _flatten(args) + _flatten(tuple(kwargs.values()))
        _touch_all(flat)
        result = func(*_unwrap(args), **dict(zip(kwargs, _unwrap(tuple(kwargs.values())))))
        if func.__name__ in _PRODUCTS:
            _count(flat)
        wrapped = _rewrap(result)
        if func.__name__ in ("copy", "ascontiguousarray", "asfortranarray", "array", "require"):
            _propagate(flat, wrapped)
        return wrapped


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
        if result.base is None:
            _record_all(result)
        return result if isinstance(result, WatchedArray) else result.view(WatchedArray)
    return result


# ---------------------------------------------------------------------------- NumPy creators


_CREATORS = (
    "array", "asarray", "asanyarray", "ascontiguousarray", "copy", "zeros", "ones", "empty",
    "full", "zeros_like", "ones_like", "empty_like", "full_like", "eye", "arange", "linspace",
    "frombuffer", "fromiter", "stack", "concatenate",
)  # fmt: skip


_COPIES = ("array", "asarray", "asanyarray", "ascontiguousarray", "copy")


def _creator(name, f):
    def made(*args, **kwargs):
        if _BUSY[0]:
            return f(*args, **kwargs)
        source = args[0] if args else None
        if isinstance(source, WatchedArray):
            source._touch()
        if name in ("asarray", "asanyarray") and isinstance(source, WatchedArray):
            if not kwargs and len(args) == 1:
                return source  # keeps being watched
        out = f(*[_plain(a) for a in args], **kwargs)
        if not isinstance(out, np.ndarray):
            return out
        fresh = not (isinstance(source, np.ndarray) and np.may_share_memory(out, source))
        if fresh:
            _record_all(out)
        wrapped = out.view(WatchedArray)
        if fresh and isinstance(source, np.ndarray) and name in _COPIES:
            _propagate((source,), wrapped)
        return wrapped

    made.__name__ = name
    made.__wrapped__ = f
    return made


class _MemmapWatch:
    """np.memmap while a watch is on: creates the map, records it as a memory-mapped array."""

    def __init__(self, cls):
        self.cls = cls

    def __call__(self, *args, **kwargs):
        out = self.cls(*args, **kwargs)
        for w in _WATCHES:
            w.record(out, " memory-mapped")
        return out

    def __instancecheck__(self, x):  # pragma: no cover (isinstance(x, np.memmap) still works)
        return isinstance(x, self.cls)


@contextmanager
def _numpy_patched():
    saved = {name: getattr(np, name) for name in _CREATORS}
    saved_memmap = np.memmap
    try:
        for name, f in saved.items():
            setattr(np, name, _creator(name, f))
        np.memmap = _MemmapWatch(saved_memmap)
        yield
    finally:
        for name, f in saved.items():
            setattr(np, name, f)
        np.memmap = saved_memmap


# ---------------------------------------------------------------------------- torch


_TORCH_PRODUCTS = ("mm", "bmm", "matmul", "addmm", "baddbmm", "addbmm", "dot", "mv", "einsum")
_COPY_OPS = {
    "clone", "_to_copy", "copy", "mul", "div", "add", "sub", "neg", "contiguous", "masked_fill",
    "where", "_unsafe_view", "to", "type_as", "detach",
}  # fmt: skip
_FUSED_SEEN: dict[str, bool] = {}


def _fused(packet: str) -> bool:
    if packet not in _FUSED_SEEN:
        _FUSED_SEEN[packet] = any(f in packet for f in _FUSED)
    return _FUSED_SEEN[packet]


_FUSED = ("scaled_dot_product", "_flash_attention", "_efficient_attention", "_cudnn_attention")


def _torch_spy():
    """A fresh dispatch mode that records every tensor an aten operation returns (a fused
    attention among them is a named shortcut)."""
    global _SPY_CLASSES
    if _SPY_CLASSES is None:
        _SPY_CLASSES = _spy_classes()
    return _SPY_CLASSES()


@contextmanager
def _sdpa_named():
    """torch.nn.functional.scaled_dot_product_attention, while the watch is on, names itself
    (it may decompose into plain operations before the dispatch mode sees it)."""
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention

    def refused(*args, **kwargs):
        for w in _WATCHES:
            w.shortcut(_SDPA)
        return original(*args, **kwargs)

    F.scaled_dot_product_attention = refused
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


_SPY_CLASSES = None
_SDPA = (
    "called scaled_dot_product_attention: a fused attention does the tiling for you; the "
    "exercise asks for your own loop over key blocks"
)


def _tensors(items) -> list:
    """The tensors among items, looking one level into tuples and lists."""
    found = []
    for x in items:
        if isinstance(x, (tuple, list)):
            found += [y for y in x if _is_tensor(y)]
        elif _is_tensor(x):
            found.append(x)
    return found


def _spy_classes():
    from torch import Tensor as tensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Spy(TorchDispatchMode):
        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return False  # no torch._dynamo import (seconds) for a plain recording mode

        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not _WATCHES or _BUSY[0]:
                return out
            packet = func._opname
            if packet in _TORCH_PRODUCTS:
                _count(_tensors(args))
            elif packet in _COPY_OPS and isinstance(out, tensor):
                if any(w.rows.entries for w in _WATCHES):
                    _propagate(_tensors(args), out)
            elif _fused(packet):
                for w in _WATCHES:
                    w.shortcut(_SDPA)
            if isinstance(out, tensor):
                for w in _WATCHES:
                    w.record(out)
            elif isinstance(out, (tuple, list)):
                _record_all(out)
            return out

    return _Spy


# ---------------------------------------------------------------------------- the watch


@contextmanager
def watch_arrays(
    limit_elems: int | None = None, what: str = "an N_q x N_k array", rule: TileRule | None = None
):
    """Record every array made in the block; raise Shortcut at the end when one reaches
    `limit_elems` elements, when the TileRule rejects one, or when NumPy's own allocations
    (checked by `largest_array`'s rerun) reach that many float64s. Yields the ArrayWatch."""
    w = ArrayWatch(limit_elems, what, rule)
    spy = _torch_spy()
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    _WATCHES.append(w)
    try:
        with ExitStack() as stack:
            stack.enter_context(_numpy_patched())
            stack.enter_context(_sdpa_named())
            stack.enter_context(spy)
            yield w
    finally:
        w.peak_bytes = max(0, tracemalloc.get_traced_memory()[1] - base)
        _WATCHES.remove(w)
        if not tracing:
            tracemalloc.stop()
    if w.violation or w.wide:
        raise Shortcut(w.violation or w.wide)
    passes = w.check_passes()
    if passes:
        raise Shortcut(passes)
    if w.unused:
        name = next(iter(w.unused))
        raise Shortcut(f"never read the {name} handed in")
    if limit_elems is not None and w.largest_elems >= limit_elems:
        raise Shortcut(w.message)


def numpy_held(thunk, limit_bytes: int):
    """Rerun thunk() under a line tracer; (bytes, shape or None) of the NumPy memory it
    held at once, counted in NumPy's tracemalloc domain only, when that reaches limit_bytes;
    else None. Python objects (an autograd graph, lists) never count."""
    domain = [tracemalloc.DomainFilter(True, _NP_DOMAIN)]
    state = {"trigger": None, "found": None}
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    before = tracemalloc.take_snapshot().filter_traces(domain)
    held0 = sum(t.size for t in before.traces)
    base = tracemalloc.get_traced_memory()[0]
    state["trigger"] = base + limit_bytes

    def local(frame, event, arg):
        if state["found"] is None and tracemalloc.get_traced_memory()[0] >= state["trigger"]:
            snap = tracemalloc.take_snapshot().filter_traces(domain)
            held = sum(t.size for t in snap.traces) - held0
            now = tracemalloc.get_traced_memory()[0]
            if held >= limit_bytes:
                state["found"] = (held, _largest_local(frame, held))
            else:
                state["trigger"] = now + limit_bytes - max(held, 0)
        return local

    def call(frame, event, arg):
        name = frame.f_code.co_filename
        if "site-packages" in name or "/flashedu/" in name or name.startswith("<frozen"):
            return None
        return local

    previous = sys.gettrace()
    sys.settrace(call)
    try:
        thunk()
    except Exception:
        pass
    finally:
        sys.settrace(previous)
        if not tracing:
            tracemalloc.stop()
    return state["found"]


def _largest_local(frame, held) -> tuple | None:
    best = None
    f = frame
    while f is not None:
        name = f.f_code.co_filename
        if "site-packages" in name or "/flashedu/" in name:
            f = f.f_back
            continue
        for v in list(f.f_locals.values()):
            for x in v if isinstance(v, (list, tuple)) else (v,):
                if isinstance(x, np.ndarray) and (best is None or x.nbytes > best.nbytes):
                    best = x
        f = f.f_back
    return tuple(best.shape) if best is not None and best.nbytes * 4 >= held else None


def watched_call(thunk, *, limit_elems=None, what="an N_q x N_k array", rule=None, prepare=None):
    """thunk(w) under `watch_arrays`, then NumPy's own memory checked: (result, ArrayWatch).

    prepare(w) runs inside the watch before thunk (to register sources). When the total traced
    peak reaches limit_elems float64s, thunk is rerun (under a fresh watch, its shortcuts
    ignored) with NumPy's domain counted alone; only NumPy memory is reported."""
    with watch_arrays(limit_elems, what, rule) as w:
        if prepare is not None:
            prepare(w)
        result = thunk(w)
    if limit_elems is not None and w.peak_bytes >= 8 * limit_elems:

        def again():
            with watch_arrays(None, what) as w2:
                if prepare is not None:
                    prepare(w2)
                thunk(w2)

        found = numpy_held(again, 8 * limit_elems)
        if found is not None:
            w.peak_bytes, w.numpy_confirmed = found[0], True
            if found[1] is not None and math.prod(found[1]) >= limit_elems:
                raise Shortcut(f"built a {shape_text(found[1])} array")
            raise Shortcut(w.message)
    return result, w


def largest_array(fn, *args, limit_elems: int | None = None, what="an N_q x N_k array", **kwargs):
    """Call fn(*args, **kwargs) with its NumPy arguments watched: (result, ArrayWatch).

    With `limit_elems`, raises Shortcut("built a 300x300 array") when fn made an array that large,
    or held that many float64s of NumPy memory at once (NumPy's allocations only).
    """
    return watched_call(lambda w: fn(*w.wrap(args), **kwargs), limit_elems=limit_elems, what=what)


# ---------------------------------------------------------------------------- one pass


class OnePass:
    """The columns of x (M, N), `block` at a time, through an iterator that can be walked once.

    `shape` is x's. Each block is a fresh (M, c) WatchedArray; when the next one is handed out, the
    previous one expires: its values become NaN, and using it raises Shortcut("read the row
    twice"). Walking the blocks a second time raises the same. The stream keeps no attribute
    holding x: the columns live in a closure, as a WatchedArray that refuses to be used whole.
    """

    def __init__(self, x: np.ndarray, block: int):
        whole = np.ndarray.copy(np.asarray(x, dtype=np.float64)).view(WatchedArray)
        whole._stream, whole._index = self, -2  # any use of it is reading the whole row
        self.shape = whole.shape
        block = int(block)
        self._started = False
        self._current = -1
        self._live: list[WatchedArray] = []
        self.violations: list[str] = []

        def cut(c0):
            b = np.ndarray.copy(np.ndarray.view(whole, np.ndarray)[:, c0 : c0 + block])
            return b.view(WatchedArray)

        self._starts = range(0, self.shape[1], block)
        self._cut = cut

    def __iter__(self):
        if self._started:
            self._fail("walked the blocks a second time")
        self._started = True
        return self._blocks()

    def _blocks(self):
        for i, c0 in enumerate(self._starts):
            self._expire()
            self._current = i
            b = self._cut(c0)
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
        if index == -2:
            self._fail("used the stream's private copy of the whole row")
        if index < self._current:
            self._fail(f"used block {index} again after moving past it")

    def _fail(self, what: str):
        self.violations.append(what)
        raise Shortcut(f"read the row twice ({what})")

    def close(self) -> None:
        """Expire every block (call when the learner's function has returned)."""
        self._expire()
        self._current = max(self._current, 0) + 1


# ---------------------------------------------------------------------------- kept copies


def _functions_of(fn, depth=0) -> list:
    """fn and the Python functions behind it: a bound method's class (an autograd Function's
    forward and backward), a decorator's __wrapped__, a partial's func."""
    import types

    found = []
    if depth > 3:
        return found
    if isinstance(fn, types.FunctionType):
        found.append(fn)
    for attr in ("__wrapped__", "func", "__func__"):
        inner = getattr(fn, attr, None)
        if inner is not None and inner is not fn:
            found += _functions_of(inner, depth + 1)
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, type):
        for v in vars(owner).values():
            v = getattr(v, "__func__", v)
            if isinstance(v, types.FunctionType):
                found.append(v)
    return found


def kept_copy(fn, named: dict, n_q: int, n_k: int) -> str:
    """'' unless a module-level variable or a closure cell of fn's code holds, after the call, a
    copy of one of the arrays in `named` (name -> array, e.g. {'K': k, 'V': v}; equal data, the
    same or transposed shape): what it is, by name. (A kept matrix of scores was made during the
    call, so the TileRule has named it already.) n_q and n_k are kept for the callers."""
    import types

    seen: set[int] = set()
    for f in _functions_of(fn):
        cells = zip(f.__code__.co_freevars, f.__closure__ or ())
        places = [(f"closure variable `{n}`", c.cell_contents) for n, c in cells if _filled(c)]
        places += [(f"module-level variable `{k}`", v) for k, v in f.__globals__.items()]
        for where, value in places:
            if isinstance(value, types.ModuleType) or id(value) in seen:
                continue
            seen.add(id(value))
            items = value.values() if isinstance(value, dict) else value
            items = items if isinstance(items, (list, tuple, type({}.values()))) else (value,)
            for x in list(items)[:64]:
                what = _same_as(x, named, n_q, n_k)
                if what:
                    return f"kept {what} in a {where}"
    return ""


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _same_as(x, named, n_q, n_k) -> str:
    if not (isinstance(x, np.ndarray) or _is_tensor(x)):
        return ""
    try:
        a = x.detach().cpu().numpy() if _is_tensor(x) else np.asarray(x)
    except Exception:
        return ""
    for name, ref in named.items():
        r = np.asarray(ref)
        for cand in (r, np.swapaxes(r, -1, -2)):
            if a.size == cand.size and a.shape[-2:] == cand.shape[-2:]:
                if np.allclose(a.reshape(cand.shape), cand, equal_nan=True):
                    return f"a copy of the whole {name}"
    return ""
