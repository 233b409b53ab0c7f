"""Benchmark results: the closed forms they are reported in, the table, and the JSON on disk.

`tflops` turns a time into TFLOP/s with `traffic.attention_flops` (matmul FLOPs only),
`memory_model` gives the peak HBM bytes of a naive and a flash forward, `table` prints a sweep, and
`write` / `load_results` keep the result files in `RESULTS`: notebooks/results/ in the repository,
or the folder the environment variable FLASHEDU_RESULTS names. `meta` records the date, the
machine, the versions and the command of a run.

Introduced in notebooks/08_benchmarks.ipynb.
"""

from __future__ import annotations

import json
import os
import platform
import re
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from .._atomic import write_atomic
from .._env import ROOT
from ..traffic import attention_flops

RESULTS = Path(
    os.environ.get("FLASHEDU_RESULTS") or ROOT / "notebooks" / "results"
)  # where results are read and written


def tflops(
    B: int, H: int, N: int, d: int, ms: float, *, causal: bool = False, pass_: str = "fwd"
) -> float:
    """Achieved TFLOP/s of one attention call that took `ms` milliseconds (matmul FLOPs only)."""
    return attention_flops(B, H, N, N, d, causal=causal, pass_=pass_) / (ms * 1e-3) / 1e12


def memory_model(impl: str, B: int, H: int, N: int, d: int, *, itemsize: int = 2) -> int:
    """Bytes a forward pass keeps in HBM at its peak: a model, not a measurement.

    Both keep Q, K, V and O, which is 4 B H N d elements. "naive" also keeps S and P, which is 2 B H
    N^2 elements (Dao et al. 2022, Algorithm 0). "flash" keeps only the float32 lse, B H N values
    (Dao et al. 2022, Sec. 3.1).
    """
    qkvo = 4 * B * H * N * d * itemsize
    if impl == "naive":
        return qkvo + 2 * B * H * N * N * itemsize
    if impl == "flash":
        return qkvo + B * H * N * 4
    raise ValueError(f"memory_model: impl must be 'naive' or 'flash', got {impl!r}")


def add_ratios(timing: list[dict], baseline: str) -> None:
    """Set row["ratio"] = ms / ms of `baseline` at the same (N, d, causal, pass, dtype) in this
    run."""

    def key(r):
        return r["N"], r["d"], r["causal"], r["pass"], r["dtype"]

    base = {key(r): r["ms"] for r in timing if r["impl"] == baseline}
    for r in timing:
        r["ratio"] = r["ms"] / base[key(r)] if key(r) in base else None


def table(timing: list[dict], baseline: str) -> str:
    """Fixed-width: impl, N, causal, pass, ms, TFLOP/s, peak extra memory, time ratio to the
    baseline."""
    lines = [
        f"{'impl':<16}{'N':>7}{'causal':>8}{'pass':>9}{'ms':>11}{'TFLOP/s':>10}{'peak MiB':>10}"
        f"{'time / ' + baseline:>18}"
    ]
    for r in timing:
        peak = "-" if r.get("peak_bytes") is None else f"{r['peak_bytes'] / 2**20:.1f}"
        ratio = "-" if r.get("ratio") is None else f"{r['ratio']:.2f}"
        lines.append(
            f"{r['impl']:<16}{r['N']:>7}{str(r['causal']):>8}{r['pass']:>9}{r['ms']:>11.3f}"
            f"{r['tflops']:>10.4f}{peak:>10}{ratio:>18}"
        )
    return "\n".join(lines)


def meta(command: str, seed: int, config: dict) -> dict:
    """Date, machine, GPU (None on the CPU path), versions, the command line and the sweep
    settings."""
    from .. import __version__

    versions = {
        "python": platform.python_version(),
        "flashedu": __version__,
        "numpy": np.__version__,
    }
    for mod in ("torch", "triton"):
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:
            versions[mod] = None
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "machine": platform.machine(),
            "processor": platform.processor() or None,
            "cpu_count": os.cpu_count(),
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        },
        "gpu": None,
        "versions": versions,
        "command": command,
        "seed": seed,
        "config": config,
    }


def write(result: dict, out) -> Path:
    """Write `result` to `out` atomically (`flashedu._atomic`): a run killed half way leaves the
    previous file whole."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(out, json.dumps(result, indent=1) + "\n")


# Modules a recorded run named that have since moved: old name -> the name that runs today.
MOVED_MODULES = {"flashedu.gpu_check": "flashedu.bench.gpu_check"}
# run scripts that have moved since a recorded run, by folder
MOVED_SCRIPTS = {"notebooks/results/h200_hopper_runs/": "scripts/hopper/"}


def portable_command(command: str) -> str:
    """A recorded command with each `--out` path cut to its file name, as a reader would type it
    (the GPU runs write to a scratch folder whose absolute path means nothing elsewhere), and a
    module or run script that has moved since the run under the name it has now (`MOVED_MODULES`,
    `MOVED_SCRIPTS`)."""
    for old, new in MOVED_MODULES.items():
        command = re.sub(rf"(-m ){re.escape(old)}(?=\s|$)", rf"\g<1>{new}", command)
    for old, new in MOVED_SCRIPTS.items():
        command = re.sub(rf"(?<![\w/.]){re.escape(old)}(?=\w+\.py\b)", new, command)
    return re.sub(r"(--out[ =])\S*/([^/\s]+)", r"\1\2", command)


def load_results(directory=RESULTS) -> dict[str, dict]:
    """Every result file in `directory` by file name; {} when there are none."""
    return {p.name: json.loads(p.read_text()) for p in sorted(Path(directory).glob("*.json"))}
