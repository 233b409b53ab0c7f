"""The CPU benchmark: check every implementation against the float64 reference, then time it, then
write JSON.

    python -m flashedu.bench                 # CPU sweep here, or the GPU sweep when CUDA is present
    python -m flashedu.bench --quick         # a small sweep that takes seconds
    python -m flashedu.bench --impls naive,tiled --N 1024 4096 --d 64 --causal --bwd --out my.json

llm.c's order, "validate, then benchmark": each implementation first runs on fresh ragged inputs
(N_q != N_k, causal and not, fully masked rows) against `flashedu.reference`; one that fails is
refused: reported, not timed. Then a sweep with a plain-text progress bar, a table of wall time,
TFLOP/s (`traffic.attention_flops`) and the time ratio to a baseline timed in the same run, and JSON
in `notebooks/results/` (`flashedu.bench.results`) with the date, the machine and the versions.
CPU sweep: NumPy `naive` and `tiled`, `torch_tiled`, PyTorch's SDPA. On a CUDA machine
`flashedu.bench.gpu.run` times Triton against SDPA's FLASH, cuDNN and EFFICIENT backends.

Limits: CPU time is the median wall time of a few calls after a warm-up call, so it is noisy on a
shared machine. Peak extra memory comes from tracemalloc during the warm-up call, which sees NumPy's
allocations and not torch's: torch rows have none. A case predicted to exceed the memory budget is
skipped and listed. Triton on CPU runs in the interpreter (a simulator), so it is not in the default
CPU sweep.

Introduced in notebooks/08_benchmarks.ipynb.
"""

from __future__ import annotations

import inspect
import statistics
import sys
import time
import tracemalloc
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .. import masks, reference
from ..registry import IMPLEMENTATIONS
from ..testing import assert_close, convert, max_error
from .results import add_ratios, meta, table, tflops, write

CPU_IMPLS = ("naive", "tiled", "torch_tiled", "sdpa")
FULL = dict(N=[1024, 2048, 4096, 8192, 16384], B=1, H=1, d=64, repeats=3)
QUICK = dict(N=[256, 512], B=1, H=2, d=64, repeats=2)
# (B, H, N_q, N_k, causal): ragged, both N_q > N_k and N_q < N_k; the last one has fully masked
# rows.
CHECK_CASES = [
    (1, 2, 33, 65, False),
    (2, 1, 65, 65, True),
    (1, 3, 17, 1, False),
    (1, 2, 97, 33, True),
]


# --------------------------------------------------------------------------------------- backends


@dataclass(frozen=True)
class Backend:
    """One timed implementation: forward(q, k, v, causal) -> (o, lse or None); fwd_bwd(q, k, v, do,
    causal)."""

    name: str
    kind: str  # "numpy" or "torch"
    forward: Callable
    fwd_bwd: Callable
    masked_rows: bool = True  # follows flashedu's rule for fully masked rows (o = 0, lse = -inf)


def _registry_backend(name: str, block: int | None) -> Backend:
    impl = IMPLEMENTATIONS[name]
    module = impl.module  # ImportError here -> reported as unavailable
    params = inspect.signature(module.forward).parameters
    kw = {b: block for b in ("block_m", "block_n") if b in params and block is not None}

    def fwd(q, k, v, causal):
        return module.forward(q, k, v, causal=causal, **kw)

    def fwd_bwd(q, k, v, do, causal):
        o, lse = module.forward(q, k, v, causal=causal, **kw)
        return module.backward(do, q, k, v, o, lse, causal=causal, **kw)

    return Backend(name, impl.kind, fwd, fwd_bwd)


def _sdpa_call(q, k, v, causal):
    import torch
    import torch.nn.functional as F

    N_q, N_k = q.shape[2], k.shape[2]
    if causal and N_q != N_k:  # SDPA's is_causal is top-left; flashedu's causal is bottom-right
        mask = torch.from_numpy(masks.visible(N_q, N_k, causal=True)).to(q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _sdpa_fwd_bwd(q, k, v, do, causal):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    _sdpa_call(q, k, v, causal).backward(do)
    return q.grad, k.grad, v.grad


SDPA = Backend(
    "sdpa",
    "torch",
    lambda q, k, v, causal: (_sdpa_call(q, k, v, causal), None),
    _sdpa_fwd_bwd,
    masked_rows=False,
)


def backends(names, *, block: int | None = None) -> tuple[list[Backend], dict[str, str]]:
    """Backends by name (or Backend objects, passed through), and {name: reason} for those that
    cannot load."""
    found, unavailable = [], {}
    for name in names:
        if isinstance(name, Backend):
            found.append(name)
        elif name == "sdpa":
            found.append(SDPA)
        elif name not in IMPLEMENTATIONS or name == "reference":
            unavailable[name] = f"unknown: choose from {', '.join(CPU_IMPLS + ('triton',))}"
        else:
            try:
                found.append(_registry_backend(name, block))
            except (ImportError, AttributeError) as e:
                unavailable[name] = f"does not import: {type(e).__name__}: {e}"
    return found, unavailable


# --------------------------------------------------------------------------------- check, then time


def _inputs(B, H, N_q, N_k, d, dtype, kind, rng):
    arrays = [
        rng.standard_normal(s)
        for s in ((B, H, N_q, d), (B, H, N_k, d), (B, H, N_k, d), (B, H, N_q, d))
    ]
    return [convert(a, dtype, kind=kind) for a in arrays]  # q, k, v, do


def _compare(got, want, dtype, name, grad=False) -> tuple[bool, float, str]:
    err = max_error(got, want)[0]
    try:
        assert_close(got, want, dtype, grad=grad, name=name)
    except AssertionError as e:
        return False, err, str(e)
    return True, err, ""


def _check_case(backend, q, k, v, do, causal, pass_, dtype, ref) -> tuple[bool, float, str]:
    if pass_ == "fwd":
        o, lse = backend.forward(q, k, v, causal)
        pairs = [("o", o, ref[0], False)] + (
            [("lse", lse, ref[1], False)] if lse is not None else []
        )
    else:
        pairs = [
            (n, g, r, True)
            for n, g, r in zip(("dq", "dk", "dv"), backend.fwd_bwd(q, k, v, do, causal), ref[2])
        ]
    results = [
        _compare(g, r, "float32" if n == "lse" else dtype, n, grad) for n, g, r, grad in pairs
    ]
    return (
        all(r[0] for r in results),
        max(r[1] for r in results),
        "; ".join(r[2] for r in results if r[2]),
    )


def check(backend: Backend, *, d: int, dtype: str, passes, rng) -> list[dict]:
    """Compare `backend` with the float64 reference on CHECK_CASES; one record per (case, pass)."""
    records = []
    for B, H, N_q, N_k, causal in CHECK_CASES:
        if not backend.masked_rows and causal and N_q > N_k:
            continue
        q, k, v, do = _inputs(B, H, N_q, N_k, d, dtype, backend.kind, rng)
        ref = (
            *reference.forward(q, k, v, causal=causal),
            reference.backward(do, q, k, v, causal=causal),
        )
        for pass_ in passes:
            try:
                ok, err, detail = _check_case(backend, q, k, v, do, causal, pass_, dtype, ref)
            except Exception as e:  # a crash is a failed check, reported rather than raised
                ok, err, detail = False, float("inf"), f"raised {type(e).__name__}: {e}"
            records.append(
                {
                    "impl": backend.name,
                    "dtype": dtype,
                    "d": d,
                    "causal": causal,
                    "N_q": N_q,
                    "N_k": N_k,
                    "pass": pass_,
                    "ok": ok,
                    "err": err,
                    "detail": detail,
                }
            )
    return records


def _measure(fn, *, repeats: int, trace: bool) -> tuple[float, float, int | None]:
    """(median seconds, fastest seconds, peak extra bytes during the warm-up call or None)."""
    if trace:
        tracemalloc.start()  # traces only what fn allocates: inputs exist already
    fn()
    peak = tracemalloc.get_traced_memory()[1] if trace else None
    if trace:
        tracemalloc.stop()
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times), peak


def _predicted_bytes(backend: Backend, B, H, N, d, dtype) -> int:
    """A generous upper estimate of peak memory, used only to skip runs that would not fit."""
    acc = 8 if dtype == "float64" else 4
    n2 = (
        B * H * N * N * acc * (4 if backend.name in ("naive", "sdpa") else 0)
    )  # S, P and NumPy temporaries
    return n2 + 16 * B * H * N * d * acc


def input_bytes(B, H, N, d, dtype) -> int:
    """Peak bytes of drawing one kind's q, k, v, do: float64 draws, then the converted copies."""
    return 4 * B * H * N * d * (8 + (8 if dtype == "float64" else 4))


def gib(n: float) -> str:
    """Bytes for a reader: '1.5 GiB', '910.0 TiB', '8.3e+06 TiB'."""
    for unit, size in (("GiB", 2**30), ("TiB", 2**40)):
        if n < 1024 * size or unit == "TiB":
            return f"{n / size:.1f} {unit}" if n / size < 1e6 else f"{n / size:.1e} {unit}"
    raise AssertionError("unreachable")


def plan(bks, *, N, B, H, d, passes, dtype="float32", max_bytes=None):
    """Which (backend, pass) runs at each N, decided from the sizes alone before anything is
    allocated: ({N: [(backend, pass)]}, skipped rows). A run needs the predicted peak of the
    implementation plus the inputs of every array kind that N draws."""
    runs, skipped = {}, []
    for n in N:
        fits = []
        for b, pass_ in ((b, p) for b in bks for p in passes):
            need = _predicted_bytes(b, B, H, n, d, dtype) * (2 if pass_ == "fwd_bwd" else 1)
            need += input_bytes(B, H, n, d, dtype)
            if max_bytes is not None and need > max_bytes:
                skipped.append(
                    {
                        "impl": b.name,
                        "N": n,
                        "pass": pass_,
                        "need_bytes": need,
                        "reason": f"needs about {gib(need)} (predicted peak with its inputs), "
                        f"more than the budget of {gib(max_bytes)}: not run",
                    }
                )
            else:
                fits.append((b, pass_))
        runs[n] = fits
    return runs, skipped


class Progress:
    """A plain-text progress bar on stderr: `[#####-----] 5/10 naive N=4096 fwd`."""

    def __init__(self, total: int, stream=sys.stderr, width: int = 24):
        self.total, self.done, self.stream, self.width = total, 0, stream, width

    def step(self, label: str) -> None:
        self.done += 1
        filled = self.width * self.done // max(self.total, 1)
        end = (
            "\n" if self.done == self.total else ""
        )  # "\r" redraws the line in terminals and notebooks
        self.stream.write(
            f"\r[{'#' * filled}{'-' * (self.width - filled)}] {self.done}/{self.total} "
            f"{label:<32}{end}"
        )
        self.stream.flush()


def sweep(
    bks: list[Backend],
    *,
    N,
    B,
    H,
    d,
    causal,
    passes,
    dtype="float32",
    repeats=3,
    max_bytes=None,
    rng=None,
    progress=None,
) -> tuple[list[dict], list[dict]]:
    """Time every backend on the same inputs for each N; returns (timing rows, skipped rows).

    What fits in `max_bytes` is decided by `plan` first: an N nothing fits allocates nothing."""
    rng = np.random.default_rng() if rng is None else rng
    runs, skipped = plan(bks, N=N, B=B, H=H, d=d, passes=passes, dtype=dtype, max_bytes=max_bytes)
    timing = []
    for n in N:
        draw = rng.integers(2**32)
        if not runs[n]:
            continue
        inputs = {
            kind: _inputs(B, H, n, n, d, dtype, kind, np.random.default_rng(draw))
            for kind in dict.fromkeys(b.kind for b, _ in runs[n])
        }
        for b, pass_ in runs[n]:
            q, k, v, do = inputs[b.kind]
            if progress:
                progress.step(f"{b.name} N={n} {pass_}")
            call = (
                (lambda: b.forward(q, k, v, causal))
                if pass_ == "fwd"
                else (lambda: b.fwd_bwd(q, k, v, do, causal))
            )
            sec, fastest, peak = _measure(call, repeats=repeats, trace=b.kind == "numpy")
            timing.append(
                {
                    "impl": b.name,
                    "dtype": dtype,
                    "causal": causal,
                    "B": B,
                    "H": H,
                    "N": n,
                    "d": d,
                    "pass": pass_,
                    "ms": sec * 1e3,
                    "ms_min": fastest * 1e3,
                    "peak_bytes": peak,
                    "tflops": tflops(B, H, n, d, sec * 1e3, causal=causal, pass_=pass_),
                }
            )
        del inputs
    return timing, skipped


def _check_all(bks, cfg, rng, log) -> tuple[list[dict], list[Backend]]:
    correctness, good = [], []
    for b in bks:
        rows = check(b, d=cfg["d"], dtype=cfg["dtype"], passes=cfg["passes"], rng=rng)
        correctness += rows
        bad = [r for r in rows if not r["ok"]]
        log(
            f"check {b.name:<12} {'FAILED: refused, not timed' if bad else 'ok'}  "
            f"max err {max(r['err'] for r in rows):.1e} over {len(rows)} cases"
        )
        for r in bad:
            log(
                f"    N_q={r['N_q']} N_k={r['N_k']} causal={r['causal']} {r['pass']}: {r['detail']}"
            )
        if not bad:
            good.append(b)
    return correctness, good


def run_cpu(
    *,
    impls=CPU_IMPLS,
    quick=False,
    causal=False,
    bwd=False,
    block=None,
    max_bytes=None,
    out=None,
    seed=None,
    command="",
    log=print,
    **sizes,
) -> dict:
    """Check, then time the CPU sweep; write JSON to `out` (a path, or None) and return the result
    dict. `out` is written atomically, and only when at least one row was timed.

    sizes: N (list), B, H, d, repeats; defaults from QUICK or FULL.
    """
    cfg = {**(QUICK if quick else FULL), **{k: v for k, v in sizes.items() if v is not None}}
    cfg.update(
        causal=causal,
        passes=["fwd", "fwd_bwd"] if bwd else ["fwd"],
        block=block,
        quick=quick,
        impls=[getattr(i, "name", i) for i in impls],
        dtype="float32",
        max_bytes=max_bytes,
    )
    seed = int(np.random.SeedSequence().entropy % 2**32) if seed is None else seed
    rng = np.random.default_rng(seed)
    bks, unavailable = backends(impls, block=block)
    for name, why in unavailable.items():
        log(f"unavailable: {name}: {why}")
    correctness, good = _check_all(bks, cfg, rng, log)
    sizes = {k: cfg[k] for k in ("N", "B", "H", "d", "passes", "dtype")}
    total = sum(map(len, plan(good, **sizes, max_bytes=max_bytes)[0].values()))
    timing, skipped = sweep(
        good,
        N=cfg["N"],
        B=cfg["B"],
        H=cfg["H"],
        d=cfg["d"],
        causal=causal,
        passes=cfg["passes"],
        repeats=cfg["repeats"],
        max_bytes=max_bytes,
        rng=rng,
        progress=Progress(total) if total else None,
    )
    baseline = "naive" if "naive" in [b.name for b in good] else (good[0].name if good else "")
    add_ratios(timing, baseline)
    result = {
        "meta": meta(command, seed, cfg),
        "correctness": correctness,
        "unavailable": unavailable,
        "refused": [b.name for b in bks if b not in good],
        "baseline": baseline,
        "timing": timing,
        "skipped": skipped,
    }
    if timing:
        log(table(timing, baseline))
    for s in skipped:
        log(f"skipped {s['impl']} N={s['N']} {s['pass']}: {s['reason']}")
    if out is not None and timing:
        log(f"wrote {write(result, out)}")
    elif out is not None:
        log(f"nothing was timed, so {out} was not written (an existing file is left as it was)")
    return result
