"""Rebuild notebooks/results/h200_backward.json from the raw runs in
notebooks/results/h200_backward_runs/.

Run 3 (one H200 run, 2026-12-04 04:37 UTC) gives the committed correctness rows, determinism, the
ablation ladder, `flashedu.attention(impl="auto")` beside SDPA's FLASH and cuDNN, and the head-dim
rows; run 2 (04:30 UTC, same kernels, the tiles then swept and kept) gives the backward-alone
comparison (`rows`) and the tile sweep with per-kernel times. `ncu` holds the Nsight Compute
figures read from ncu_bwd.txt (run 3's machine); `wide` and `gpu_tests` come from run 4 (04:49 UTC:
the FA2 tiles at d = 192/256, and the GPU tests of tests/hopper/test_gluon_bwd.py).
Usage: python3 scripts/hopper/make_backward_results.py
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "notebooks" / "results" / "h200_backward_runs"
OUT = HERE.parent / "h200_backward.json"


def ncu_summary(text: str) -> list:
    """Kernel name, duration, SM throughput, registers, block size, grid, occupancy per kernel."""
    out = []
    for block in re.split(r"\n  (?=\S)", text)[1:]:
        name = block.split(" (", 1)[0].strip()

        def num(label):
            m = re.search(rf"{label}\s+\S*\s+([\d,.]+)\n", block)
            return float(m.group(1).replace(",", "")) if m else None

        if num("Duration") is None:
            continue
        pipe = re.search(r"(\w+) is the highest-utilized pipeline \(([\d.]+)%\)", block)
        out.append(dict(kernel=name, duration_ms=num("Duration"),
                        sm_throughput_pct=num(r"Compute \(SM\) Throughput"),
                        top_pipeline=pipe.group(1) if pipe else None,
                        top_pipeline_pct=float(pipe.group(2)) if pipe else None,
                        registers=num("Registers Per Thread"), block=num("Block Size"),
                        grid=num("Grid Size"), achieved_occupancy_pct=num("Achieved Occupancy"),
                        spill_requests=num("Local Memory Spilling Requests")))  # fmt: skip
    return out


def main():
    r3 = json.loads((HERE / "run3.json").read_text())
    r2 = json.loads((HERE / "run2.json").read_text())
    res = {k: r3[k] for k in ("date", "gpu", "sms", "torch", "triton", "cuda", "cudnn", "python")}
    res["command"] = (
        "python3 scripts/h200_backward.py --phases correct determinism ladder auto headdims"
    )
    res["script"] = "scripts/hopper/h200_backward.py (run from scripts/ when recorded)"
    res["matmul_bf16_tflops"] = r3["matmul_bf16_tflops"]
    res["kv_configs"], res["dq_configs"] = r3["kv_configs"], r3["dq_configs"]
    for key in ("correctness", "determinism", "ladder", "auto", "headdims"):
        res[key] = r3[key]
    res["ladder_not_built"] = [
        dict(step="warp_specialize", why="no producer warp yet; the consumers issue TMA"),
        dict(step="setmaxnreg", why="needs warp specialisation first"),
    ]
    res["backward_rows"] = dict(date=r2["date"], command="python3 scripts/h200_backward.py "
                                "(phases correct determinism sweep compare ladder)",
                                matmul_bf16_tflops=r2["matmul_bf16_tflops"], rows=r2["rows"],
                                sweep=r2["sweep"], best=r2["best"])  # fmt: skip
    r4 = json.loads((HERE / "run4.json").read_text())
    res["wide"] = dict(date=r4["date"], command="python3 scripts/h200_backward.py --phases wide",
                       matmul_bf16_tflops=r4["matmul_bf16_tflops"], rows=r4["wide"],
                       note="FA2 kernels at d = 192/256, bf16, B = 4, H = 16, N = 4096, "
                       "non-causal; each kernel's tile timed alone; err and sdpa_err from a "
                       "ragged causal case (1 x 4/2 heads, 777 x 1301)")  # fmt: skip
    last = (HERE / "run4_pytest_gpu.log").read_text().split("\n")[-2]
    res["gpu_tests"] = dict(date=r4["date"], command="python3 -m pytest -m gpu "
                            "tests/hopper/test_gluon_bwd.py", result=last)  # fmt: skip
    res["ncu"] = dict(command="ncu --clock-control none --kernel-name "
                      "regex:'_gluon_bwd|bprop|dgrad|flash' --launch-count 6 --section "
                      "SpeedOfLight --section Occupancy --section WarpStateStats --section "
                      "ComputeWorkloadAnalysis --section LaunchStats --section "
                      "MemoryWorkloadAnalysis python3 scripts/ncu_backward.py",
                      kernels=ncu_summary((HERE / "ncu_bwd.txt").read_text()))  # fmt: skip
    OUT.write_text(json.dumps(res, indent=1) + "\n")
    print("wrote", OUT)


if __name__ == "__main__":
    main()
