"""Measure the HBM bytes a Triton kernel really moves, by watching Triton's interpreter.

Under the interpreter (TRITON_INTERPRET=1) every `tl.load`, `tl.store` and atomic of a
`@triton.jit` kernel reaches one Python object, `triton.runtime.interpreter.interpreter_builder`,
with the addresses it touches and its mask. `measure()` wraps those few methods (and the launch
and grid hooks) while its `with` block runs, and charges each access to the argument tensor whose
memory the addresses fall in, by the tensors' `data_ptr`, sizes and strides, so pointer arithmetic
on any argument, helper `@triton.jit` functions and block pointers are all counted. It restores
the interpreter on exit.

What counts as a byte moved (the model's convention, `flashedu.traffic`):
* only unmasked elements; an address touched several times by one instruction counts once (a GPU
  coalesces it into one transaction), while a second instruction that loads it again counts again;
* the element size is the pointer's element type (what the instruction moves);
* an atomic counts a read and a write of each unmasked element;
* an address inside no argument is charged to "unknown" (an out-of-bounds access in a real kernel);
  an address shared by two arguments goes to the first in the kernel's parameter order.

Names: a pointer argument takes the model's name when it matches one case-insensitively, after
dropping a `_ptr` / `_ptrs` suffix or a tensor descriptor's `desc_` prefix (`Q`, `q_ptr`, `desc_q`
-> "Q"; `LSE` -> "lse"; `DO` -> "dO"); `delta` is the model's "D"; any other name is kept as
written. A tuple argument's tensors are `name[i]`.

Limits: it measures the interpreter's run, so it cannot see caches (every load is an HBM load, as
in the model), and it does not work on kernels compiled for a GPU: there it raises `MeasureError`.
The interpreter itself runs one launch at a time, so measure one thread's kernels at a time;
a measurement only records kernels launched from the thread that opened it.

Introduced in notebooks/06_triton_forward.ipynb (the forward's bytes, measured).
"""

from __future__ import annotations

import inspect
import os
import threading
from dataclasses import dataclass, field

import numpy as np

from .ledger import Ledger, Traffic

MODEL_NAMES = ("Q", "K", "V", "O", "lse", "dO", "dQ", "dK", "dV", "D", "S", "P")
_ALIASES = {name.lower(): name for name in MODEL_NAMES} | {"delta": "D"}
UNKNOWN = "unknown"


class MeasureError(RuntimeError):
    """`traffic.measure` cannot watch these kernels (Triton's interpreter is not running them)."""


def model_name(param: str) -> str:
    """The model's name for a kernel parameter: 'q_ptr' -> 'Q', 'DO' -> 'dO', 'out' -> 'out'; a
    tensor descriptor's 'desc_q' -> 'Q'."""
    low = param.lower()
    if low.startswith("desc_") and low[5:] in _ALIASES:
        low = low[5:]
    for suffix in ("_ptrs", "_ptr"):
        if low.endswith(suffix) and len(low) > len(suffix):
            low = low[: -len(suffix)]
            break
    return _ALIASES.get(low, param)


# ------------------------------------------------------------------------ where an address belongs


@dataclass(frozen=True)
class TensorInfo:
    """An argument tensor as the kernel saw it: name, shape, element size, bytes, address range."""

    name: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    itemsize: int
    base: int  # data_ptr()
    end: int  # one past the last byte any element occupies

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.itemsize

    def locate(self, addrs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(inside, index): which addresses are elements of this tensor, and their (n, ndim)
        indices. Walks the dims from the largest stride down, as for any non-overlapping view."""
        inside = (addrs >= self.base) & (addrs < self.end)
        off = addrs.astype(np.int64) - self.base
        inside &= off % self.itemsize == 0
        rem = np.where(inside, off // self.itemsize, 0)
        index = np.zeros((addrs.size, len(self.shape)), dtype=np.int64)
        dims = sorted(
            (k for k, (n, s) in enumerate(zip(self.shape, self.strides)) if n > 1 and s > 0),
            key=lambda k: -self.strides[k],
        )
        for k in dims:
            index[:, k] = rem // self.strides[k]
            inside &= index[:, k] < self.shape[k]
            rem = rem - index[:, k] * self.strides[k]
        inside &= rem == 0
        return inside, index


def _tensor_info(name: str, t) -> TensorInfo | None:
    t = getattr(t, "base", t) if type(t).__name__ == "TensorWrapper" else t
    if not hasattr(t, "data_ptr") or not hasattr(t, "stride"):
        return None
    shape, strides, item = tuple(t.shape), tuple(t.stride()), t.element_size()
    span = 1 + sum((n - 1) * abs(s) for n, s in zip(shape, strides)) if t.numel() else 0
    return TensorInfo(name, shape, strides, item, t.data_ptr(), t.data_ptr() + span * item)


def _launch_tensors(fn, args, kwargs) -> list[TensorInfo]:
    """The tensors passed to one launch, named by the kernel's parameters, in parameter order."""
    try:
        bound = inspect.getcallargs(fn, *args, **kwargs)
    except TypeError:  # the interpreter reports the bad call itself
        return []
    infos = []
    for param, value in bound.items():
        values = value if isinstance(value, tuple) else (value,)
        for k, v in enumerate(values):
            v = getattr(v, "base", v) if type(v).__name__ == "TensorDescriptor" else v
            name = model_name(param) + (f"[{k}]" if isinstance(value, tuple) else "")
            info = _tensor_info(name, v)
            if info is not None:
                infos.append(info)
    return infos


# ----------------------------------------------------------------------------------- the record


@dataclass(frozen=True)
class Access:
    """One load or store instruction of one program, charged to one tensor.

    region: per dimension of the tensor, the (first, last + 1) index the instruction touched."""

    launch: int
    program: tuple[int, int, int]
    tensor: str
    direction: str  # "read" (HBM -> SRAM) or "write" (SRAM -> HBM)
    nbytes: int
    region: tuple[tuple[int, int], ...]


@dataclass
class Measurement:
    """What `measure()` saw: `ledger` (every access, one ledger step per program run),
    `launches` [(kernel name, grid as (x, y, z))], `tensors` (name -> TensorInfo of the last launch
    that passed it), `accesses` (each instruction with the region it touched), and, when
    per_program=True, `by_program` ((x, y, z) -> Ledger, summed over launches) and
    `by_launch_program` ((launch, (x, y, z)) -> Ledger)."""

    per_program: bool = False
    ledger: Ledger = field(default_factory=Ledger)
    launches: list[tuple[str, tuple[int, int, int]]] = field(default_factory=list)
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    accesses: list[Access] = field(default_factory=list)
    by_program: dict[tuple[int, int, int], Ledger] = field(default_factory=dict)
    by_launch_program: dict[tuple[int, tuple[int, int, int]], Ledger] = field(default_factory=dict)

    def __post_init__(self):
        self._thread = threading.get_ident()
        self._current: list[Ledger] = []
        self._pid = (0, 0, 0)
        self._addrs: dict[tuple, list[np.ndarray]] = {}  # (launch, pid, tensor, dir) -> addresses

    def traffic(self) -> Traffic:
        """Bytes by tensor and direction, the form the closed forms of `flashedu.traffic` return."""
        return self.ledger.traffic()

    def table(self) -> str:
        return self.traffic().table()

    def reuse(self, tensor: str, direction: str = "read") -> tuple[float, float, int]:
        """(within, across, programs) for one tensor: how many times a program moved each element
        it touched, on average; how many programs touched each element, on average; and how
        many programs touched the tensor. A FlashAttention-2 forward reads K with within = 1 and
        across = the number of query blocks; a kernel that re-reads Q per key block has within =
        the number of key blocks."""
        moved = distinct = 0
        union = []
        for (_, _, name, dn), chunks in self._addrs.items():
            if (name, dn) == (tensor, direction):
                every = np.concatenate(chunks)
                mine = np.unique(every)
                moved, distinct = moved + every.size, distinct + mine.size
                union.append(mine)
        if not union:
            return 0.0, 0.0, 0
        total = np.unique(np.concatenate(union)).size
        return moved / distinct, distinct / total, len(union)

    def __enter__(self) -> Measurement:
        _start(self)
        return self

    def __exit__(self, *exc) -> None:
        _stop(self)

    # called by the hooks, on this measurement's thread
    def _launch(self, name: str, tensors: list[TensorInfo]) -> None:
        self.launches.append((name, (1, 1, 1)))
        self.tensors.update({t.name: t for t in tensors})

    def _grid(self, grid) -> None:
        self.launches[-1] = (self.launches[-1][0], tuple(int(g) for g in grid))

    def _program(self, pid: tuple[int, int, int]) -> None:
        launch = len(self.launches) - 1
        name = self.launches[launch][0] if self.launches else "?"
        self.ledger.step(kernel=name, launch=launch, program=pid)
        self._pid = pid
        self._current = [self.ledger]
        if self.per_program:
            own = self.by_launch_program.setdefault((launch, pid), Ledger())
            merged = self.by_program.setdefault(pid, Ledger())
            own.step(kernel=name, launch=launch, program=pid)
            merged.step(kernel=name, launch=launch, program=pid)
            self._current += [own, merged]

    def _access(self, tensor: str, direction: str, nbytes: int, region, addrs) -> None:
        access = Access(len(self.launches) - 1, self._pid, tensor, direction, nbytes, region)
        self.accesses.append(access)
        key = (access.launch, self._pid, tensor, direction)
        self._addrs.setdefault(key, []).append(addrs)
        for ledger in self._current:
            (ledger.read if access.direction == "read" else ledger.write)(
                access.tensor, access.nbytes
            )


def measure(per_program: bool = False) -> Measurement:
    """Record every tl.load / tl.store of the Triton kernels run (under the interpreter) inside
    the `with` block, by argument tensor and direction, unmasked elements only.

        with traffic.measure() as m:
            kernels.forward(q, k, v, block_m=16, block_n=16)
        m.ledger.traffic() == traffic.flash_forward(..., block_m=16, block_n=16)

    Raises MeasureError on entry when Triton is not running kernels in its interpreter
    (TRITON_INTERPRET=1 must be set before triton is imported; flashedu sets it when there is no
    CUDA device)."""
    return Measurement(per_program=per_program)


# ------------------------------------------------------------------------------------- the hooks

_lock = threading.Lock()
_active: list[Measurement] = []
_saved: list[tuple[object, str, object]] = []
_local = threading.local()  # .tensors (this launch's TensorInfo list), .grid, .launch
_MISSING = object()


def _interpreter():
    try:
        import triton
        from triton.runtime import interpreter
    except ImportError as e:
        raise MeasureError(f"traffic.measure needs triton, which did not import: {e}") from e
    knobs = getattr(triton, "knobs", None)
    on = knobs.runtime.interpret if knobs else os.environ.get("TRITON_INTERPRET") == "1"
    if not on:
        raise MeasureError(
            "traffic.measure watches Triton's interpreter, and kernels here are compiled for the "
            "GPU: run with TRITON_INTERPRET=1 set before triton is imported (flashedu sets it on a "
            "machine without CUDA), on CPU tensors"
        )
    return interpreter


def _mine() -> list[Measurement]:
    me = threading.get_ident()
    return [m for m in _active if m._thread == me]


def _start(m: Measurement) -> None:
    interp = _interpreter()
    with _lock:
        if not _active:
            _install(interp)
        _active.append(m)


def _stop(m: Measurement) -> None:
    with _lock:
        if m in _active:
            _active.remove(m)
        if not _active:
            for obj, name, old in reversed(_saved):
                if old is _MISSING:
                    delattr(obj, name)
                else:
                    setattr(obj, name, old)
            _saved.clear()


def _patch(obj, name: str, make) -> None:
    old = obj.__dict__.get(name, _MISSING)
    _saved.append((obj, name, old))
    setattr(obj, name, make(getattr(obj, name)))


def _install(interp) -> None:
    builder = interp.interpreter_builder

    def init_args(orig):
        def wrapped(self, args_dev, kwargs):
            args_hst, kwargs_hst = orig(self, args_dev, kwargs)
            _local.tensors = _launch_tensors(self.fn, args_hst, kwargs_hst)
            for m in _mine():
                m._launch(self.fn.__name__, _local.tensors)
            return args_hst, kwargs_hst

        return wrapped

    def grid_dim(orig):
        def wrapped(nx, ny, nz):
            for m in _mine():
                m._grid((nx, ny, nz))
            return orig(nx, ny, nz)

        return wrapped

    def grid_idx(orig):
        def wrapped(x, y, z):
            out = orig(x, y, z)
            for m in _mine():
                m._program((int(x), int(y), int(z)))
            return out

        return wrapped

    def load(orig):
        def wrapped(ptrs, mask, *rest, **kw):
            _record(ptrs, mask, ("read",))
            return orig(ptrs, mask, *rest, **kw)

        return wrapped

    def store(orig):
        def wrapped(ptrs, value, mask, *rest, **kw):
            _record(ptrs, mask, ("write",))
            return orig(ptrs, value, mask, *rest, **kw)

        return wrapped

    def rmw(orig):
        def wrapped(op, ptr, val, mask, *rest, **kw):
            _record(ptr, mask, ("read", "write"))
            return orig(op, ptr, val, mask, *rest, **kw)

        return wrapped

    def cas(orig):
        def wrapped(ptr, *rest, **kw):
            _record(ptr, None, ("read", "write"))
            return orig(ptr, *rest, **kw)

        return wrapped

    _patch(interp.GridExecutor, "_init_args_hst", init_args)
    _patch(builder, "set_grid_dim", grid_dim)
    _patch(builder, "set_grid_idx", grid_idx)
    _patch(builder, "create_masked_load", load)
    _patch(builder, "create_masked_store", store)
    _patch(builder, "create_atomic_rmw", rmw)
    _patch(builder, "create_atomic_cas", cas)


def _record(ptrs, mask, directions) -> None:
    """Charge one instruction's unmasked addresses to the tensors they belong to."""
    ms = _mine()
    if not ms:
        return
    addrs = np.asarray(ptrs.data)
    keep = np.ones(addrs.shape, bool) if mask is None else np.asarray(mask.data, dtype=bool)
    addrs, keep = np.broadcast_arrays(addrs, keep)
    addrs = np.unique(addrs[keep].astype(np.uint64))
    item = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
    for name, n, region, mine in _charge(addrs, getattr(_local, "tensors", [])):
        for direction in directions:
            for m in ms:
                m._access(name, direction, n * item, region, mine)


def _charge(addrs: np.ndarray, tensors: list[TensorInfo]):
    """[(tensor name, elements, region, addresses)] for a set of distinct addresses."""
    left = np.ones(addrs.size, bool)
    out = []
    for t in tensors:
        if not left.any():
            break
        inside, index = t.locate(addrs)
        inside &= left
        if inside.any():
            idx = index[inside]
            region = tuple((int(a), int(b) + 1) for a, b in zip(idx.min(0), idx.max(0)))
            out.append((t.name, int(inside.sum()), region, addrs[inside]))
            left &= ~inside
    if left.any():
        out.append((UNKNOWN, int(left.sum()), (), addrs[left]))
    return out


__all__ = [
    "Access",
    "MeasureError",
    "Measurement",
    "MODEL_NAMES",
    "TensorInfo",
    "UNKNOWN",
    "measure",
    "model_name",
]
