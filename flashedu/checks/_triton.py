"""Running a learner's Triton kernel under a grader: the grader launches it, into outputs that
show what was never stored, on inputs that expose a missing mask, and measures what it moved.

A grader hands this module the learner's `@triton.jit` kernel and launches it itself, with the
exercise's signature, its own grid and its own BLOCK_M / BLOCK_N (launchers in
`flashedu.kernels.exercises`); a Python function is not graded when the kernel is the lesson (its
return value could come from anywhere), and is named as such. Then:

- The inputs are views into buffers with a gap of NaN rows after each head's last row, so a load
  past the ragged edge without a mask reads NaN (and `traffic.measure` charges it to no tensor).
  The outputs are pre-filled with NaN carrying a payload (`NAN_FILL`) that no arithmetic produces,
  gap included: rows never stored, and stores past the last row (or column), show up exactly, and
  a computed NaN is told apart from an untouched entry. A kernel that stores nothing on the first
  case is "not attempted yet".
- The kernel must not be flashedu's, nor a copy of one (compared by code, `_method`), nor call
  one; every kernel launched or called as a device function during the run is checked, and the
  run happens under `forbid_flashedu`.
- Under the interpreter the run is measured (`traffic.measure`): each load and store instruction
  with the region it touched, so `tile_problem` can hold every tile to the grader's block sizes
  ("your kernel read all 45 keys of K in one tile; the grader asked for BLOCK_N = 16"), and
  `ownership_problem` each program of a one-program-per-tile grid to its own tile.
- A kernel decorated before flashedu set up the interpreter (`import triton` first, no GPU) is
  re-wrapped for the interpreter when it can be, else the report says in one line what to restart.

Used by the graders in ch06.py and ch07.py; tested in tests/checks/test_ch06.py, test_ch07.py,
test_ch06_shortcuts.py and test_ch07_shortcuts.py.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import triton

from .. import traffic
from ..kernels.launch import INTERPRETER
from ._method import Shortcut, copy_message, forbid_flashedu, same_code_as_flashedu

# A quiet NaN with a payload: no arithmetic result carries it (computed NaNs are canonical), so an
# entry that still holds it was never stored.
NAN_FILL = {torch.float32: (0x7FC05A5A, torch.int32), torch.float16: (0x7E5A, torch.int16)}
LAUNCH_PLUMBING = (
    "flashedu.kernels.launch.check_inputs",
    "flashedu.kernels.launch.rows_contiguous",
)
GAP = 64  # NaN rows after each head's rows: more than a block can reach past the last row


# --------------------------------------------------------------------------------------- layouts


def gapped(a: np.ndarray, dtype, fill: float = float("nan")) -> torch.Tensor:
    """a (B, H, N, ...) as a torch view of a (B, H, N + GAP, ...) buffer whose extra rows hold
    `fill`; on the GPU when there is one."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    B, H, N, *rest = a.shape
    buf = torch.full((B, H, N + GAP, *rest), fill, dtype=dtype, device=device)
    buf[:, :, :N] = torch.from_numpy(np.ascontiguousarray(a)).to(dtype)
    return buf[:, :, :N]


def _payload_nan(shape, dtype, device) -> torch.Tensor:
    bits, itype = NAN_FILL[dtype]
    if bits > torch.iinfo(itype).max:
        bits -= 1 << (8 * torch.tensor([], dtype=itype).element_size())
    return torch.full(shape, bits, dtype=itype, device=device).view(dtype)


def unstored(t: torch.Tensor) -> torch.Tensor:
    """Bool mask of the entries of t that still hold the fill (never stored)."""
    bits, itype = NAN_FILL[t.dtype]
    if bits > torch.iinfo(itype).max:
        bits -= 1 << (8 * torch.tensor([], dtype=itype).element_size())
    return t.detach().contiguous().view(itype) == bits


def nan_output(shape, dtype) -> torch.Tensor:
    """An output of `shape` for a kernel to store into: a view of a larger buffer (GAP more rows
    per head for (B, H, N, ...) outputs; GAP more rows and columns for an (N_q, N_k) matrix), all
    of it NaN with the fill's payload."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = tuple(shape)
    if len(shape) == 2:
        buf = _payload_nan((shape[0] + GAP, shape[1] + GAP), dtype, device)
        return buf[: shape[0], : shape[1]]
    B, H, N, *rest = shape
    buf = _payload_nan((B, H, N + GAP, *rest), dtype, device)
    return buf[:, :, :N]


def full_buffer(view: torch.Tensor) -> torch.Tensor:
    """The whole buffer behind a view made by `gapped` / `nan_output`."""
    if view.ndim == 2:
        return torch.as_strided(view, (view.shape[0] + GAP, view.shape[1] + GAP), view.stride())
    B, H, N = view.shape[:3]
    return torch.as_strided(view, (B, H, N + GAP, *view.shape[3:]), view.stride())


def output_problem(view: torch.Tensor, name: str, N: int) -> str:
    """'' or what is wrong with an output buffer: a store past row N - 1 (or past the last
    column of a matrix), or rows never stored."""
    buf = full_buffer(view).detach().cpu()
    fresh = unstored(buf)
    if view.ndim == 2:
        n_k = view.shape[1]
        if not fresh[N:].all():
            return (
                f"your kernel stored past the last row of {name} (row {N - 1}): mask the store "
                "with the rows that exist"
            )
        if not fresh[:, n_k:].all():
            return (
                f"your kernel stored past the last column of {name} (column {n_k - 1}): mask the "
                "store with the columns that exist"
            )
        never = fresh[:N, :n_k].all(-1).nonzero().flatten().tolist()
        part = fresh[:N, :n_k].any(-1).nonzero().flatten().tolist()
        never = never or part
    else:
        flat = fresh.reshape(buf.shape[0] * buf.shape[1], N + GAP, -1)
        if not flat[:, N:].all():
            return (
                f"your kernel stored past the last row of {name} (row {N - 1}): mask the store "
                "with the rows (or keys) that exist"
            )
        empty = flat[:, :N].all(-1).all(-1)  # (B * H,): heads with nothing stored
        if empty.any() and not empty.all():
            B, H = buf.shape[:2]
            bh = int(empty.nonzero()[0])
            return (
                f"nothing was stored for batch {bh // H}, head {bh % H} of {name} (of B={B}, "
                f"H={H}): each program's (batch, head) comes from tl.program_id(1) = b * H + h; "
                "move every pointer to it with the batch and head strides"
            )
        never = flat[:, :N].any(-1).any(0).nonzero().flatten().tolist()
    if never:
        span = f"row {never[0]}" if len(never) == 1 else f"rows {never[0]}..{never[-1]}"
        return (
            f"{span} of {name} were never stored, or only in part ({len(never)} of {N}): every "
            "program must store all of its entries that exist, even where nothing was added"
        )
    return ""


def nothing_stored(views) -> bool:
    return all(bool(unstored(v).all()) for v in views)


# ------------------------------------------------------------------------------ running kernels


def is_kernel(obj) -> bool:
    return isinstance(obj, triton.runtime.KernelInterface) and hasattr(obj, "fn")


def _dotted(kernel) -> str:
    return f"{kernel.fn.__module__}.{kernel.fn.__qualname__}"


class NotAKernel(Shortcut):
    """The learner passed a Python function where the grader launches a kernel."""


def require_kernel(obj, grader: str, example: str) -> None:
    """Raise NotAKernel (a named shortcut) unless obj is a @triton.jit kernel; a Python stub that
    raises NotImplementedError at once is "not attempted" (its NotImplementedError passes on)."""
    if is_kernel(obj):
        return
    if _is_stub(obj):
        raise NotImplementedError("a Python stub")
    what = getattr(obj, "__name__", type(obj).__name__)
    raise NotAKernel(
        f"{what} is a Python function: checks.{grader} grades your @triton.jit kernel itself "
        f"(pass it, e.g. checks.{grader}({example})); the grader launches it with its own "
        "BLOCK_M and BLOCK_N into outputs filled with NaN, and grades what the kernel stored"
    )


def _is_stub(obj) -> bool:
    """obj raises NotImplementedError when called with placeholder arguments (an untouched stub);
    anything else it does is ignored, and its return value is never graded."""
    import inspect

    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return False
    required = [
        p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                                                  p.POSITIONAL_OR_KEYWORD)
    ]  # fmt: skip
    try:
        with forbid_flashedu(trace=False):
            obj(*[None] * len(required))
    except NotImplementedError:
        return True
    except Exception:
        return False
    return False


RESTART = (
    "your kernel was decorated before flashedu set up Triton's interpreter (there is no GPU and "
    "`import triton` ran first): restart the notebook's kernel and run its first cell, which "
    "imports flashedu, before the cell that defines the kernel"
)


def runnable(kernel):
    """The kernel, ready to launch here: on CPU a kernel decorated before TRITON_INTERPRET was set
    is re-made for the interpreter when it calls no other such kernel; else Shortcut(RESTART)."""
    if not INTERPRETER:
        return kernel
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(kernel, InterpretedFunction):
        return kernel
    g = kernel.fn.__globals__
    for n in kernel.fn.__code__.co_names:
        v = g.get(n)
        if isinstance(v, triton.runtime.KernelInterface) and not isinstance(v, InterpretedFunction):
            if not getattr(v, "fn", None) or v is kernel:
                continue
            raise Shortcut(RESTART)
    try:
        return InterpretedFunction(kernel.fn)
    except Exception as e:
        raise Shortcut(RESTART) from e


@contextlib.contextmanager
def count_launches():
    """Yield a list that collects the dotted name of every Triton kernel launched in the block;
    a launch or device call of flashedu's kernel, or of a copy of one, raises Shortcut."""
    from triton.runtime import interpreter, jit

    seen: list[str] = []
    vetted: set[int] = set()  # kernels already checked in this run (a device call runs per tile)
    classes = [interpreter.InterpretedFunction, jit.JITFunction]
    saved = [(cls, cls.__dict__["run"], cls.__dict__.get("__call__")) for cls in classes]

    def vet(self):
        if id(self) in vetted:
            return
        dotted = _dotted(self)
        if dotted.startswith("flashedu.") and not dotted.startswith("flashedu.kernels.exercises"):
            raise Shortcut(f"launched {dotted}, flashedu's own kernel")
        copied = same_code_as_flashedu(self)
        if copied:
            raise Shortcut(copy_message(copied))
        vetted.add(id(self))

    def counting(run):
        def wrapped(self, *args, **kwargs):
            if not kwargs.get("warmup", False):
                vet(self)
                seen.append(_dotted(self))
            return run(self, *args, **kwargs)

        return wrapped

    def calling(call):
        def wrapped(self, *args, **kwargs):
            vet(self)
            return call(self, *args, **kwargs)

        return wrapped

    for cls, run, call in saved:
        cls.run = counting(run)
        if call is not None:
            cls.__call__ = calling(call)
    try:
        yield seen
    finally:
        for cls, run, call in saved:
            cls.run = run
            if call is not None:
                cls.__call__ = call


@dataclass
class Run:
    """One graded call: the outputs, the kernels launched, and the bytes (None on a GPU)."""

    outputs: tuple
    launches: list[str]
    measured: Any = None
    names: dict[int, str] = field(default_factory=dict)  # data_ptr -> model name


def check_learner(learner) -> None:
    """Shortcut when the kernel is flashedu's, or a copy of flashedu's code (or calls one)."""
    if is_kernel(learner) and learner.fn.__module__.startswith("flashedu."):
        if not learner.fn.__module__.startswith("flashedu.kernels.exercises"):
            raise Shortcut(
                f"passed {_dotted(learner)}, flashedu's own kernel: pass the one you wrote"
            )
    copied = same_code_as_flashedu(learner)
    if copied:
        raise Shortcut(copy_message(copied))


def run_learner(work: Callable[[], tuple], learner, names: dict[int, str]) -> Run:
    """Call `work()` (which launches the learner's kernel), measured under the interpreter,
    launches counted and vetted, flashedu's own implementations forbidden."""
    check_learner(learner)
    measuring = traffic.measure() if INTERPRETER else contextlib.nullcontext()
    with count_launches() as launches, measuring as m:
        with forbid_flashedu(LAUNCH_PLUMBING, trace=False):
            outputs = work()
    if not launches:
        raise Shortcut("no Triton kernel was launched: the exercise is a @triton.jit kernel")
    return Run(tuple(outputs), launches, m, names)


def _renames(run: Run, outputs: dict[str, torch.Tensor]) -> dict[str, str]:
    """The measurement's tensor names (the learner's parameter names) -> the model's names,
    found by address, so a learner's own parameter names do not matter."""
    by_ptr = dict(run.names) | {t.data_ptr(): name for name, t in outputs.items()}
    return {i.name: by_ptr.get(i.base, i.name) for i in run.measured.tensors.values()}


def measured_traffic(run: Run, outputs: dict[str, torch.Tensor]) -> traffic.Traffic | None:
    """The run's bytes by tensor, each tensor named by the model; None when not measured (on a
    GPU)."""
    if run.measured is None:
        return None
    rename = _renames(run, outputs)
    t = run.measured.traffic()
    reads: dict[str, int] = {}
    writes: dict[str, int] = {}
    for src, dst in ((t.reads, reads), (t.writes, writes)):
        for name, n in src.items():
            key = rename.get(name, name)
            dst[key] = dst.get(key, 0) + n
    return traffic.Traffic(reads, writes)


@dataclass(frozen=True)
class Tile:
    """The most one load (or store) of `tensor` may span along `axis`: the grader's block."""

    tensor: str  # the model's name, e.g. "K"
    axis: int
    block: int
    what: str  # "keys", "query rows"
    param: str  # "BLOCK_N"
    direction: str = "read"


TILE_ADVICE = {
    "keys": "loop over the keys in blocks of BLOCK_N (tl.arange(0, BLOCK_N)), one block at a time",
    "query rows": "loop over the query rows in blocks of BLOCK_M, one block at a time",
    "rows": "each program handles BLOCK_M rows (tl.arange(0, BLOCK_M))",
    "columns": "each program handles BLOCK_N columns (tl.arange(0, BLOCK_N))",
}


def tile_problem(run: Run, outputs: dict[str, torch.Tensor], tiles: list[Tile]) -> str:
    """'' or the first load or store that spans more than the grader's block along its axis:
    "your kernel read all 45 keys of K in one tile; the grader asked for BLOCK_N = 16"."""
    if run.measured is None or not tiles:
        return ""
    rename = _renames(run, outputs)
    infos = run.measured.tensors
    for a in run.measured.accesses:
        name = rename.get(a.tensor, a.tensor)
        for t in tiles:
            if (name, a.direction) != (t.tensor, t.direction) or len(a.region) <= t.axis:
                continue
            lo, hi = a.region[t.axis]
            if hi - lo <= t.block:
                continue
            n = infos[a.tensor].shape[t.axis] if a.tensor in infos else hi - lo
            verb = "read" if a.direction == "read" else "wrote"
            many = f"all {n} {t.what}" if hi - lo >= n else f"{hi - lo} {t.what}"
            return (
                f"your kernel {verb} {many} of {name} in one tile; the grader asked for "
                f"{t.param} = {t.block}: {TILE_ADVICE[t.what]}"
            )
    return ""


def ownership_problem(
    run: Run, outputs: dict[str, torch.Tensor], name: str, axes: list[tuple[int, int, int, str]]
) -> str:
    """'' or the first program that stored `name` outside its own tile. axes: (tensor axis, block,
    grid axis, what) for each axis the grid tiles, e.g. (0, BLOCK_M, 0, "rows")."""
    if run.measured is None:
        return ""
    rename = _renames(run, outputs)
    for a in run.measured.accesses:
        if a.direction != "write" or rename.get(a.tensor, a.tensor) != name:
            continue
        for axis, block, pid_axis, what in axes:
            lo, hi = a.region[axis]
            start = a.program[pid_axis] * block
            if lo < start or hi > start + block:
                pid = ", ".join(str(p) for p in a.program[: max(ax[2] for ax in axes) + 1])
                return (
                    f"program ({pid}) stored {what} {lo}..{hi - 1} of {name}, outside its own "
                    f"{what} {start}..{start + block - 1}: one program per tile, its {what} from "
                    f"tl.program_id({pid_axis}) * the block size the grader passes"
                )
    return ""


# ------------------------------------------------------------------------------------ timing


def gpu_timing(what: str, contenders: dict[str, Callable[[], Any]], out=print, bench=None):
    """On a GPU, time each contender (the learner's kernel first) and print one line of ratios,
    information only; on CPU do nothing and return None. Returns {name: milliseconds}."""
    if not torch.cuda.is_available() and bench is None:
        return None
    if bench is None:
        import triton.testing

        def bench(fn):
            return triton.testing.do_bench(fn, return_mode="median")

    ms = {name: float(bench(fn)) for name, fn in contenders.items()}
    (mine, t_mine), *others = ms.items()
    ratios = "; ".join(
        f"{name} {t:.3f} ms (yours / {name} = {t_mine / t:.2f})" for name, t in others
    )
    out(f"timing, {what} (information, not graded): {mine} {t_mine:.3f} ms; {ratios}")
    return ms
