"""The benchmark wing: check every implementation against the float64 reference, then time it,
then write JSON that notebooks/08_benchmarks.ipynb reads.

    python -m flashedu.bench                 # CPU sweep here, or the GPU sweep when CUDA is present
    python -m flashedu.bench --quick         # a small sweep that takes seconds
    python -m flashedu.bench.gpu_check       # on a GPU: the correctness matrix, timing and memory

Modules: `cpu` (the CPU check-then-time sweep), `results` (TFLOP/s, the memory model, the table and
the JSON files), `gpu` (Triton against PyTorch SDPA's backends on a CUDA GPU), `gpu_check` (the GPU
correctness matrix) and `__main__` (the command line). The CPU sweep and the results are
re-exported here, so `from flashedu import bench; bench.run_cpu(...)` works as the notebooks use
it; `gpu` and `gpu_check` import triton and load on demand (`from flashedu.bench import gpu`).

Introduced in notebooks/08_benchmarks.ipynb.
"""

from __future__ import annotations

from .cpu import (
    CHECK_CASES,
    CPU_IMPLS,
    FULL,
    QUICK,
    SDPA,
    Backend,
    Progress,
    backends,
    check,
    run_cpu,
    sweep,
)
from .results import (
    RESULTS,
    add_ratios,
    load_results,
    memory_model,
    meta,
    table,
    tflops,
    write,
)

__all__ = [
    "CHECK_CASES",
    "CPU_IMPLS",
    "FULL",
    "QUICK",
    "RESULTS",
    "SDPA",
    "Backend",
    "Progress",
    "add_ratios",
    "backends",
    "check",
    "load_results",
    "memory_model",
    "meta",
    "run_cpu",
    "sweep",
    "table",
    "tflops",
    "write",
]
