"""The GPU timing sweep: flashedu's Triton kernels against PyTorch SDPA's FLASH, cuDNN and EFFICIENT
backends.

    from flashedu.bench import gpu
    result = gpu.run(out="notebooks/results/h200_attention.json")

`python -m flashedu.bench` calls `run` on a CUDA machine; `python -m flashedu.bench.gpu_check`
calls it after the correctness matrix and adds peak memory against context length. The sweep
follows the FlashAttention-2 paper's setting (Dao 2023, Sec. 4.1): B * N = 16k tokens, d = 64 with
H = 32 or d = 128 with H = 16, N from 1k to 16k, causal and not, bf16 and fp16. FLOPs are
`traffic.attention_flops`: forward 4 B H N^2 d, halved when causal; forward + backward 3.5x that.
Each time is the median of `triton.testing.do_bench` (CUDA events, L2 flushed between calls) after
the kernels are compiled and autotuned on the same shapes.

Before a (dtype, d, causal) group is timed, each implementation's output on a small input is
compared with a float64 computation; one that misses the dtype's tolerance is reported and not
timed. Also here: peak memory against context length (`measure_memory`), the bf16 matmul ceiling
(`matmul_tflops`), and `explore`, which times fixed launch configs one kernel at a time (how the
autotuning tables were chosen).

Introduced in notebooks/08_benchmarks.ipynb (the kernels in notebooks/06_triton_forward.ipynb).
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

from .._atomic import write_atomic
from ..api import attention
from ..testing import tolerance
from ..traffic import attention_flops

IMPLS = ("flashedu-triton", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient")
FULL = dict(
    N=(1024, 2048, 4096, 8192, 16384),
    d=(64, 128),
    causal=(False, True),
    dtype=("bfloat16", "float16"),
)
QUICK = dict(N=(1024, 4096), d=(128,), causal=(False, True), dtype=("bfloat16",))
TOKENS = 16384  # B * N
HEAD_MODEL = 2048  # H * d: H = 32 at d = 64, H = 16 at d = 128


def _do_bench(fn, **kwargs) -> float:
    import triton.testing  # imported here, after flashedu has set the interpreter flag

    return triton.testing.do_bench(fn, **kwargs)


def _sdpa(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    which = {
        "sdpa-flash": SDPBackend.FLASH_ATTENTION,
        "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
        "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
    }[backend]

    def call(q, k, v, causal):
        with sdpa_kernel(which):
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=causal
            )  # N_q == N_k: top-left = ours

    return call


def attention_fn(impl: str):
    """(q, k, v, causal) -> o, differentiable, for one of IMPLS."""
    if impl == "flashedu-triton":
        return lambda q, k, v, causal: attention(q, k, v, causal=causal, impl="triton")
    return _sdpa(impl)


def _float64(q, k, v, causal):
    s = (q.double() @ k.double().transpose(-1, -2)) / q.shape[-1] ** 0.5  # (B, H, N, N)
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v.double()


def usable(impl: str, dtype: str, d: int, causal: bool, gen: torch.Generator) -> tuple[bool, str]:
    """Run `impl` on a small input against float64; (ok, detail). Refuses what errors or misses
    tolerance."""
    q, k, v = (
        torch.randn(1, 2, 512, d, generator=gen, device="cuda").to(getattr(torch, dtype))
        for _ in range(3)
    )
    try:
        o = attention_fn(impl)(q, k, v, causal)
    except RuntimeError as e:  # e.g. a backend that does not support this GPU or dtype
        return False, f"unavailable: {str(e).splitlines()[0][:120]}"
    err = (o.double() - _float64(q, k, v, causal)).abs().max().item()
    tol = tolerance(dtype)
    return err <= tol.atol + tol.rtol, f"max err {err:.1e} vs float64"


def time_case(
    impl: str, dtype: str, d: int, causal: bool, N: int, passes, gen: torch.Generator
) -> list[dict]:
    """Median milliseconds and TFLOP/s of one implementation at one size, for each pass."""
    B, H = max(TOKENS // N, 1), HEAD_MODEL // d
    q, k, v, do = (
        torch.randn(B, H, N, d, generator=gen, device="cuda").to(getattr(torch, dtype))
        for _ in range(4)
    )
    fn, rows = attention_fn(impl), []
    for pass_ in passes:
        if pass_ == "fwd":
            call, grads = (lambda: fn(q, k, v, causal)), None
        else:
            q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
            call, grads = (lambda: fn(q, k, v, causal).backward(do)), [q, k, v]
        call()  # compile / autotune outside the timing
        ms = _do_bench(call, warmup=25, rep=100, grad_to_none=grads, return_mode="median")
        tf = attention_flops(B, H, N, N, d, causal=causal, pass_=pass_) / (ms * 1e-3) / 1e12
        rows.append(
            {
                "impl": impl,
                "dtype": dtype,
                "causal": causal,
                "B": B,
                "H": H,
                "N": N,
                "d": d,
                "pass": pass_,
                "ms": ms,
                "tflops": tf,
            }
        )
    return rows


def versions() -> dict:
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": importlib.metadata.version("triton"),
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "python": platform.python_version(),
    }


def run(
    quick: bool = False,
    out=None,
    *,
    impls=IMPLS,
    passes=("fwd", "fwd_bwd"),
    log=print,
    seed: int = 0,
    **sweep,
) -> dict:
    """Check, then time the sweep (QUICK or FULL, overridable by N=, d=, causal=, dtype=); write
    JSON to `out`, atomically and only when something was timed."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "flashedu.bench.gpu.run needs a CUDA GPU; "
            "use `python -m flashedu.bench` for the CPU sweep"
        )
    cfg = {**(QUICK if quick else FULL), **sweep}
    gen = torch.Generator(device="cuda").manual_seed(seed)
    timing, refused = [], []
    for dtype in cfg["dtype"]:
        for d in cfg["d"]:
            for causal in cfg["causal"]:
                for impl in impls:
                    ok, detail = usable(impl, dtype, d, causal, gen)
                    if not ok:
                        refused.append(
                            {
                                "impl": impl,
                                "dtype": dtype,
                                "d": d,
                                "causal": causal,
                                "detail": detail,
                            }
                        )
                        log(f"refused {impl} {dtype} d={d} causal={causal}: {detail}")
                        continue
                    for N in cfg["N"]:
                        timing += time_case(impl, dtype, d, causal, N, passes, gen)
                log(table(timing[-len(cfg["N"]) * len(impls) * len(passes) :]))
    result = {
        "meta": {
            **versions(),
            "command": " ".join(sys.argv),
            "sweep": {k: list(v) for k, v in cfg.items()},
        },
        "timing": timing,
        "refused": refused,
    }
    if out is not None and timing:  # a run that timed nothing leaves an existing file alone
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out, json.dumps(result, indent=1) + "\n")
    return result


def table(rows: list[dict], baseline: str = "sdpa-flash") -> str:
    """One line per (dtype, d, causal, N, pass): TFLOP/s of each implementation and flashedu's speed
    ratios."""
    key = lambda r: (r["dtype"], r["d"], r["causal"], r["N"], r["pass"])
    groups: dict[tuple, dict[str, float]] = {}
    for r in rows:
        groups.setdefault(key(r), {})[r["impl"]] = r["tflops"]
    names = [i for i in IMPLS if any(i in g for g in groups.values())]
    lines = [
        f"{'dtype':<9}{'d':>4}{'causal':>7}{'N':>7}{'pass':>8}"
        + "".join(f"{n:>16}" for n in names)
        + f"{'vs flash':>10}{'vs cudnn':>10}"
    ]
    for (dtype, d, causal, N, pass_), g in groups.items():
        mine = g.get("flashedu-triton")
        ratio = lambda other: f"{mine / g[other]:.2f}" if mine and g.get(other) else "-"
        lines.append(
            f"{dtype:<9}{d:>4}{str(causal):>7}{N:>7}{pass_:>8}"
            + "".join(f"{g[n]:>16.1f}" if n in g else f"{'-':>16}" for n in names)
            + f"{ratio('sdpa-flash'):>10}{ratio('sdpa-cudnn'):>10}"
        )
    return "\n".join(lines)


def _standard(q, k, v):
    """Standard attention: S = scale Q K^T and P = softmax(S) materialised in HBM, (B, H, N, N)
    each."""
    return torch.softmax((q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5, dim=-1) @ v


def measure_memory(
    Ns=(8192, 16384, 32768, 65536, 131072), B=1, H=1, d=128, dtype="bfloat16", log=print
) -> list[dict]:
    """Peak bytes allocated (inputs included) by standard attention and by the flashedu kernel,
    forward and forward + backward, non-causal. A run that does not fit is recorded with
    measured=False."""
    rows = []
    for N in Ns:
        for impl, fn in (
            ("standard", _standard),
            ("flashedu-triton", lambda q, k, v: attention(q, k, v, impl="triton")),
        ):
            for pass_ in ("fwd", "fwd_bwd"):
                torch.cuda.empty_cache()
                q, k, v, do = (
                    torch.randn(B, H, N, d, device="cuda", dtype=getattr(torch, dtype))
                    for _ in range(4)
                )
                if pass_ == "fwd_bwd":
                    q, k, v = (x.requires_grad_() for x in (q, k, v))
                torch.cuda.reset_peak_memory_stats()
                row = {
                    "impl": impl,
                    "N": N,
                    "B": B,
                    "H": H,
                    "d": d,
                    "dtype": dtype,
                    "pass": pass_,
                    "inputs_bytes": torch.cuda.memory_allocated(),
                }
                try:
                    with torch.set_grad_enabled(pass_ == "fwd_bwd"):
                        o = fn(q, k, v)
                        if pass_ == "fwd_bwd":
                            o.backward(do)
                    torch.cuda.synchronize()
                    row.update(peak_bytes=torch.cuda.max_memory_allocated(), measured=True)
                except torch.OutOfMemoryError:
                    row.update(peak_bytes=None, measured=False, note="out of GPU memory")
                o = q = k = v = do = None
                rows.append(row)
                peak = (
                    "out of memory"
                    if row["peak_bytes"] is None
                    else f"{row['peak_bytes'] / 2**30:8.2f} GiB"
                )
                log(f"memory {impl:<16} N={N:<7} {pass_:<8} {peak}")
    torch.cuda.empty_cache()
    return rows


def matmul_tflops(n: int = 8192) -> float:
    """The dense bf16 ceiling measured on this GPU: an n x n x n torch.matmul on random data,
    TFLOP/s."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = _do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
    return 2 * n**3 / (ms * 1e-3) / 1e12


# Fixed launch configs (BLOCK_M, BLOCK_N, num_warps, num_stages) timed one by one with --explore,
# bf16.
EXPLORE = {
    ("fwd", 64): [
        (128, 128, 8, 3),
        (128, 64, 4, 3),
        (128, 64, 8, 3),
        (128, 128, 4, 3),
        (64, 64, 4, 3),
        (128, 128, 8, 2),
        (128, 64, 4, 4),
    ],
    ("fwd", 128): [
        (128, 64, 8, 3),
        (128, 64, 8, 4),
        (128, 128, 8, 2),
        (128, 64, 4, 3),
        (64, 64, 4, 3),
        (128, 32, 4, 4),
        (128, 128, 8, 3),
    ],
    ("dkdv", 64): [
        (32, 128, 8, 2),
        (64, 128, 8, 2),
        (32, 64, 4, 2),
        (32, 128, 8, 3),
        (64, 64, 4, 3),
        (16, 128, 8, 2),
    ],
    ("dkdv", 128): [
        (16, 128, 8, 2),
        (32, 128, 8, 2),
        (32, 128, 8, 1),
        (32, 64, 4, 2),
        (16, 64, 4, 2),
        (64, 128, 8, 2),
    ],
    ("dq", 64): [(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3), (128, 64, 8, 2), (64, 32, 4, 3)],
    ("dq", 128): [
        (128, 64, 8, 2),
        (64, 64, 4, 3),
        (128, 32, 8, 2),
        (64, 32, 4, 3),
        (128, 64, 8, 3),
    ],
}


def run_fixed(kernel, cfg, q, k, v, do, o, lse, causal):
    """Run one kernel ("fwd", "dkdv" or "dq") with a fixed launch config (BLOCK_M, BLOCK_N, warps,
    stages)."""
    from ..kernels import bwd as tb
    from ..kernels import fwd, launch

    if kernel == "fwd":
        return fwd.forward(q, k, v, causal=causal, **_kw(cfg))
    pl = launch.plan(q, k, v, causal, None, None, None, None, "explore")
    return tb.run_backward(do, q, k, v, o, lse, pl, _cfg(cfg), _cfg(cfg), kernels=(kernel,))


def explore(Ns=(2048, 8192), log=print):
    """Time each fixed config of EXPLORE one by one (bf16, B N = 16k tokens, causal and not)."""
    plan = [
        (kernel, d, causal, cfg)
        for (kernel, d), cfgs in EXPLORE.items()
        for causal in (False, True)
        for cfg in cfgs
    ]
    rows = []
    for N in Ns:
        for kernel, d, causal, cfg in plan:
            B, H = 16384 // N, 2048 // d
            q, k, v, do = (
                torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16) for _ in range(4)
            )
            o, lse = run_fixed("fwd", EXPLORE[("fwd", d)][0], q, k, v, do, None, None, causal)
            ms = _do_bench(
                lambda: run_fixed(kernel, cfg, q, k, v, do, o, lse, causal),
                warmup=25,
                rep=100,
                return_mode="median",
            )
            share = {"fwd": 1.0, "dkdv": 4 / 7 * 2.5, "dq": 3 / 7 * 2.5}[
                kernel
            ]  # matmuls each pass does
            tf = attention_flops(B, H, N, N, d, causal=causal) * share / (ms * 1e-3) / 1e12
            rows.append(
                {
                    "kernel": kernel,
                    "d": d,
                    "causal": causal,
                    "N": N,
                    "config": list(cfg),
                    "ms": ms,
                    "tflops": tf,
                }
            )
            log(
                f"explore {kernel:<5} d={d:<4} causal={causal!s:<6} N={N:<6} {cfg}  "
                f"{ms:8.3f} ms  {tf:6.1f} TFLOP/s"
            )
    return rows


def _cfg(t):
    return dict(BLOCK_M=t[0], BLOCK_N=t[1], num_warps=t[2], num_stages=t[3])


def _kw(t):
    return dict(block_m=t[0], block_n=t[1], num_warps=t[2], num_stages=t[3])
