"""The course's command line: `python -m flashedu <command> ...`.

    python -m flashedu bench [--quick] [--out PATH] [--impls naive,tiled] [--N 1024 4096] [--d 64]
                             [--causal]
    python -m flashedu course [check|list|book]

`python -m flashedu.bench` is the same as `python -m flashedu bench`. The benchmark itself (check,
then time, then write JSON) is `flashedu.bench`; this module parses arguments and picks the CPU or
GPU sweep. On a machine with CUDA it calls `flashedu.bench_gpu.run` unless `--cpu` is given; there
only --quick and --out apply. (`python -m flashedu.gpu_check` adds the full correctness matrix and
the memory sweep.)

Introduced in notebooks/08_benchmarks.ipynb.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import bench


def _available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux); None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            return next(
                int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")
            )
    except (OSError, StopIteration):
        return None


def _gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def _gpu_out(out: str | None, gpu: str) -> Path:
    """A file name from the GPU's name: 'NVIDIA H200' -> notebooks/results/h200_attention.json."""
    slug = "_".join(
        w for w in gpu.lower().replace("nvidia", " ").replace("-", " ").split() if w.isalnum()
    )
    path = Path(out) if out else bench.RESULTS
    return path if path.suffix == ".json" else path / f"{slug}_attention.json"


def _run_gpu(a: argparse.Namespace, gpu: str) -> int:
    """bench_gpu checks each kernel, then times it, printing a table per group as it goes."""
    from . import bench_gpu

    out = _gpu_out(a.out, gpu)
    result = bench_gpu.run(quick=a.quick, out=out)
    for r in result.get("refused", []):
        print(f"refused {r['impl']} {r['dtype']} d={r['d']} causal={r['causal']}: {r['detail']}")
    print(f"wrote {out}")
    return 1 if any(r["impl"] == "flashedu-triton" for r in result.get("refused", [])) else 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flashedu.bench",
        description="Check every implementation "
        "against the float64 reference, then time the ones that pass.",
    )
    p.add_argument("--quick", action="store_true", help="a small sweep that takes seconds")
    p.add_argument("--out", help="JSON file or directory (default notebooks/results/)")
    p.add_argument("--impls", default=",".join(bench.CPU_IMPLS), help="comma-separated (CPU sweep)")
    p.add_argument("--N", type=int, nargs="+", help="sequence lengths (N_q = N_k)")
    p.add_argument("--d", type=int, help="head dimension")
    p.add_argument("--B", type=int, help="batch size")
    p.add_argument("--H", type=int, help="heads")
    p.add_argument("--causal", action="store_true", help="causal attention")
    p.add_argument("--bwd", action="store_true", help="also time forward + backward")
    p.add_argument("--repeats", type=int, help="timed calls per case (the median is reported)")
    p.add_argument(
        "--block",
        type=int,
        help="block_m = block_n for the tiled implementations (default: theirs)",
    )
    p.add_argument(
        "--max-mem-gib",
        type=float,
        help="skip cases predicted to need more (default 60%% of free RAM)",
    )
    p.add_argument("--seed", type=int, help="seed for the inputs (default: fresh)")
    p.add_argument("--cpu", action="store_true", help="the CPU sweep even when a GPU is present")
    return p


def bench_main(argv: list[str]) -> int:
    """`python -m flashedu.bench ARGS`: 0 when every implementation passed its check, 1 when one was
    refused."""
    a = _parser().parse_args(argv)
    gpu = None if a.cpu else _gpu_name()
    if gpu:
        return _run_gpu(a, gpu)
    out = Path(a.out) if a.out else bench.RESULTS
    out = (
        out if out.suffix == ".json" else out / ("cpu_quick.json" if a.quick else "cpu_local.json")
    )
    avail = _available_bytes()
    max_bytes = a.max_mem_gib * 2**30 if a.max_mem_gib else (0.6 * avail if avail else None)
    result = bench.run_cpu(
        impls=[s.strip() for s in a.impls.split(",") if s.strip()],
        quick=a.quick,
        causal=a.causal,
        bwd=a.bwd,
        block=a.block,
        max_bytes=max_bytes,
        out=out,
        seed=a.seed,
        command=" ".join(["python -m flashedu.bench", *argv]),
        N=a.N,
        B=a.B,
        H=a.H,
        d=a.d,
        repeats=a.repeats,
    )
    return 1 if result["refused"] else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    commands = {
        "bench": bench_main,
        "course": lambda rest: __import__("flashedu.course").course.main(rest),
    }
    if not argv or argv[0] not in commands:
        got = repr(argv[0]) if argv else "nothing"
        print(f"usage: python -m flashedu {{{'|'.join(commands)}}} ..., got {got}", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
