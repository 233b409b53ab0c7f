"""Running a learner's Triton kernel under a grader: inputs that expose a missing mask, outputs
that show what was never stored, launch counting, bytes measured, and the GPU timing.

A grader hands this module the learner's `@triton.jit` kernel (launched through the package's
launcher in `flashedu.kernels.exercises`, the same host code for everyone) or a Python function of
theirs that launches their own kernels. Either way:

- The inputs are views into buffers with a gap of NaN rows after each head's last row, so a load
  past the ragged edge without a mask reads NaN (and `traffic.measure` charges it to no tensor).
  The outputs are filled with a sentinel, gap included: rows never stored, and stores past the
  last row, show up exactly. A kernel that stores nothing at all on the first case is "not
  attempted yet".
- Every launch is counted: a function that launches no Triton kernel, or one of flashedu's own
  kernels, is a named shortcut; the whole run happens under `forbid_flashedu`.
- Under the interpreter the run is measured (`traffic.measure`), for `_triton_bytes.judge`.

Used by the graders in ch06.py and ch07.py; tested in tests/checks/test_ch06.py and ch07.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import triton

from .. import traffic
from ..kernels.launch import INTERPRETER
from ._method import Shortcut, forbid_flashedu

SENTINEL = -12288.0  # exact in fp16 and fp32; no attention output or gradient here comes near it
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


def sentinel_like(shape, dtype) -> torch.Tensor:
    """An output buffer of `shape`, gap included, filled with SENTINEL."""
    return gapped(np.full(shape, SENTINEL), dtype, fill=SENTINEL)


def full_buffer(view: torch.Tensor) -> torch.Tensor:
    """The whole gapped buffer behind a view made by `gapped` / `sentinel_like`."""
    B, H, N = view.shape[:3]
    return torch.as_strided(view, (B, H, N + GAP, *view.shape[3:]), view.stride())


def output_problem(view: torch.Tensor, name: str, N: int) -> str:
    """'' or what is wrong with an output buffer: a store past row N - 1, or rows never stored."""
    buf = full_buffer(view).detach().to("cpu", torch.float64)
    flat = buf.reshape(buf.shape[0] * buf.shape[1], N + GAP, -1)
    if (flat[:, N:] != SENTINEL).any():
        return (
            f"your kernel stored past the last row of {name} (row {N - 1}): mask the store with "
            "the rows (or keys) that exist"
        )
    never = (flat[:, :N] == SENTINEL).all(-1).any(0).nonzero().flatten().tolist()
    if never:
        span = f"row {never[0]}" if len(never) == 1 else f"rows {never[0]}..{never[-1]}"
        return (
            f"{span} of {name} were never stored ({len(never)} of {N}): every program must store "
            "all of its rows that exist, even where nothing was added"
        )
    return ""


def nothing_stored(views) -> bool:
    return all(bool((v == SENTINEL).all()) for v in views)


# ------------------------------------------------------------------------------ running kernels


def is_kernel(obj) -> bool:
    return isinstance(obj, triton.runtime.KernelInterface) and hasattr(obj, "fn")


def _dotted(kernel) -> str:
    return f"{kernel.fn.__module__}.{kernel.fn.__qualname__}"


@contextlib.contextmanager
def count_launches():
    """Yield a list that collects the dotted name of every Triton kernel launched in the block."""
    from triton.runtime import interpreter, jit

    seen: list[str] = []
    classes = [interpreter.InterpretedFunction, jit.JITFunction]
    saved = [(cls, cls.__dict__["run"]) for cls in classes]

    def counting(run):
        def wrapped(self, *args, **kwargs):
            if not kwargs.get("warmup", False):
                seen.append(_dotted(self))
            return run(self, *args, **kwargs)

        return wrapped

    for cls, run in saved:
        cls.run = counting(run)
    try:
        yield seen
    finally:
        for cls, run in saved:
            cls.run = run


@dataclass
class Run:
    """One graded call: the outputs, the kernels launched, and the bytes (None on a GPU)."""

    outputs: tuple
    launches: list[str]
    measured: Any = None
    names: dict[int, str] = field(default_factory=dict)  # data_ptr -> model name


def run_learner(work: Callable[[], tuple], learner, names: dict[int, str]) -> Run:
    """Call `work()` (which launches the learner's kernel or calls their function), measured
    under the interpreter, launches counted, flashedu's own implementations forbidden."""
    if is_kernel(learner) and learner.fn.__module__.startswith("flashedu."):
        raise Shortcut(f"passed {_dotted(learner)}, flashedu's own kernel: pass the one you wrote")
    measuring = traffic.measure() if INTERPRETER else contextlib.nullcontext()
    with count_launches() as launches, measuring as m, forbid_flashedu(LAUNCH_PLUMBING):
        outputs = work()
    ours = [k for k in launches if k.startswith("flashedu.")]
    if ours:
        raise Shortcut(f"launched {ours[0]}, flashedu's own kernel")
    if not launches:
        raise Shortcut("no Triton kernel was launched: the exercise is a @triton.jit kernel")
    return Run(tuple(outputs), launches, m, names)


def launched(fn: Callable) -> Callable:
    """fn wrapped for `grade`: each call must launch a Triton kernel of the learner's own (see
    `run_learner`); returns fn's result."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return run_learner(lambda: (fn(*args, **kwargs),), fn, {}).outputs[0]

    return call


def measured_traffic(run: Run, outputs: dict[str, torch.Tensor]) -> traffic.Traffic | None:
    """The run's bytes by tensor, each tensor named by the model (found by its address, so a
    learner's own parameter names do not matter); None when not measured (on a GPU)."""
    if run.measured is None:
        return None
    by_ptr = dict(run.names) | {t.data_ptr(): name for name, t in outputs.items()}
    rename = {i.name: by_ptr.get(i.base, i.name) for i in run.measured.tensors.values()}
    t = run.measured.traffic()
    reads: dict[str, int] = {}
    writes: dict[str, int] = {}
    for src, dst in ((t.reads, reads), (t.writes, writes)):
        for name, n in src.items():
            key = rename.get(name, name)
            dst[key] = dst.get(key, 0) + n
    return traffic.Traffic(reads, writes)


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
