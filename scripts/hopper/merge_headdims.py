"""Build notebooks/results/h200_headdims.json from the head-dim runs in
notebooks/results/h200_headdims_runs/ (each written by scripts/hopper/h200_headdims.py): for every
head dim, the sweep, best configs and compared rows of the latest run that compared it, each row
tagged with its run; the runs' own metadata beside them. Rows of one head dim always come from one
run, so every ratio the chapter prints is between kernels measured side by side.

Usage (repository root, no GPU needed): python3 scripts/hopper/merge_headdims.py [RUN ...]
(default: runs 2, 3 and 4; run 1 predates the fix of the non-finite rule's cost and is kept for
the record only, notebooks/results/GPU_NOTES.md "Head-dim runs").
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "notebooks" / "results" / "h200_headdims_runs"
OUT = ROOT / "notebooks" / "results" / "h200_headdims.json"
META = ("date", "gpu", "torch", "triton", "cuda", "cudnn", "python", "command",
        "matmul_bf16_tflops", "split_head_dims_default", "separate_dkdv_dims_default")  # fmt: skip


def merge(runs: list[int]) -> dict:
    data = {n: json.loads((RUNS / f"run{n}.json").read_text()) for n in runs}
    latest = {}  # head dim -> the latest run that compared it
    for n in runs:
        for r in data[n]["rows"]:
            if r["kernel"] == "flashedu_auto":
                latest[r["d"]] = n
    out = dict(
        about=__doc__.split("\n\n")[0].replace("\n", " "),
        runs=[dict(run=n, **{k: data[n].get(k) for k in META}) for n in runs],
        head_dims={str(d): n for d, n in sorted(latest.items())},
        sweep=[], best=[], rows=[],
    )  # fmt: skip
    for d, n in sorted(latest.items()):
        for key in ("sweep", "best", "rows"):
            out[key] += [dict(r, run=n) for r in data[n][key] if r["d"] == d]
    return out


def main(argv=None) -> int:
    runs = [int(a) for a in (sys.argv[1:] if argv is None else argv)] or [2, 3, 4]
    OUT.write_text(json.dumps(merge(runs), indent=1) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)} from runs {runs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
