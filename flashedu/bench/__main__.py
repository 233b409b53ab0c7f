"""The benchmark's command line: `python -m flashedu.bench [options]` (or `make bench`).

    python -m flashedu.bench [--quick] [--out PATH] [--impls naive,tiled] [--N 1024 4096] [--d 64]
                             [--causal] [--bwd] [--repeats 3] [--block 64] [--cpu]

Picks the sweep: on a machine with CUDA, `flashedu.bench.gpu.run` unless `--cpu` is given (there
only --quick and --out apply); elsewhere the CPU sweep `flashedu.bench.cpu.run_cpu`. Every flag is
checked before anything runs (unknown implementations, sizes that are not positive, ...), with
argparse's usage line and exit status 2. The exit status is 0 when every implementation passed its
check and something was timed, 1 when an implementation was refused or nothing ran.
(`python -m flashedu.bench.gpu_check` adds the full GPU correctness matrix and the memory sweep.)

Introduced in notebooks/08_benchmarks.ipynb.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..registry import IMPLEMENTATIONS
from .cpu import CPU_IMPLS, run_cpu
from .results import RESULTS

IMPL_CHOICES = tuple(dict.fromkeys([*CPU_IMPLS, *(n for n in IMPLEMENTATIONS if n != "reference")]))


def _positive(kind):
    """An argparse type: a number of `kind` that is > 0."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            what = "an int" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = f"positive {kind.__name__}"
    return parse


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _impls(text: str) -> list[str]:
    """'naive, tiled' -> ['naive', 'tiled']; every name one of IMPL_CHOICES."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in IMPL_CHOICES]
    if unknown or not names:
        got = ", ".join(map(repr, unknown)) if unknown else "nothing"
        raise argparse.ArgumentTypeError(f"choose from {', '.join(IMPL_CHOICES)}; got {got}")
    return names


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flashedu.bench",
        description="Check every implementation against the float64 reference, then time the "
        "ones that pass.",
    )
    p.add_argument("--quick", action="store_true", help="a small sweep that takes seconds")
    p.add_argument("--out", help="JSON file or directory (default notebooks/results/)")
    p.add_argument(
        "--impls",
        type=_impls,
        default=list(CPU_IMPLS),
        help=f"comma-separated, from {', '.join(IMPL_CHOICES)} (CPU sweep)",
    )
    p.add_argument("--N", type=_positive(int), nargs="+", help="sequence lengths (N_q = N_k)")
    p.add_argument("--d", type=_positive(int), help="head dimension")
    p.add_argument("--B", type=_positive(int), help="batch size")
    p.add_argument("--H", type=_positive(int), help="heads")
    p.add_argument("--causal", action="store_true", help="causal attention")
    p.add_argument("--bwd", action="store_true", help="also time forward + backward")
    p.add_argument(
        "--repeats", type=_positive(int), help="timed calls per case (the median is reported)"
    )
    p.add_argument(
        "--block",
        type=_positive(int),
        help="block_m = block_n for the tiled implementations (default: theirs)",
    )
    p.add_argument(
        "--max-mem-gib",
        type=_positive(float),
        help="skip cases predicted to need more (default 60%% of free RAM)",
    )
    p.add_argument("--seed", type=_non_negative_int, help="seed for the inputs (default: fresh)")
    p.add_argument("--cpu", action="store_true", help="the CPU sweep even when a GPU is present")
    return p


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


def gpu_out(out: str | None, gpu: str) -> Path:
    """A file name from the GPU's name: 'NVIDIA H200' -> notebooks/results/h200_attention.json."""
    slug = "_".join(
        w for w in gpu.lower().replace("nvidia", " ").replace("-", " ").split() if w.isalnum()
    )
    path = Path(out) if out else RESULTS
    return path if path.suffix == ".json" else path / f"{slug}_attention.json"


def _run_gpu(a: argparse.Namespace, gpu_name: str) -> int:
    """The GPU sweep checks each kernel, then times it, printing a table per group as it goes."""
    from . import gpu

    out = gpu_out(a.out, gpu_name)
    result = gpu.run(quick=a.quick, out=out)
    for r in result.get("refused", []):
        print(f"refused {r['impl']} {r['dtype']} d={r['d']} causal={r['causal']}: {r['detail']}")
    if not result.get("timing"):
        print(f"nothing was timed: every kernel was refused; {out} not written", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 1 if any(r["impl"] == "flashedu-triton" for r in result.get("refused", [])) else 0


def _run_cpu(a: argparse.Namespace, argv: list[str]) -> int:
    out = Path(a.out) if a.out else RESULTS
    if out.suffix != ".json":
        out = out / ("cpu_quick.json" if a.quick else "cpu_local.json")
    avail = _available_bytes()
    max_bytes = a.max_mem_gib * 2**30 if a.max_mem_gib else (0.6 * avail if avail else None)
    if avail and max_bytes > avail:
        print(
            f"--max-mem-gib {a.max_mem_gib:g} is more than the {avail / 2**30:.1f} GiB available "
            "now: the available memory is the budget",
            file=sys.stderr,
        )
        max_bytes = avail
    result = run_cpu(
        impls=a.impls,
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
    if not result["timing"]:
        print(
            "nothing was timed: every case was refused, unavailable or skipped",
            file=sys.stderr,
        )
        return 1
    return 1 if result["refused"] else 0


def main(argv: list[str] | None = None) -> int:
    """`python -m flashedu.bench ARGS`: 0 when every implementation passed its check and something
    was timed, 1 otherwise; 2 (argparse) for a bad flag."""
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parser().parse_args(argv)
    gpu_name = None if a.cpu else _gpu_name()
    return _run_gpu(a, gpu_name) if gpu_name else _run_cpu(a, argv)


if __name__ == "__main__":
    sys.exit(main())
