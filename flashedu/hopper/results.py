"""The Hopper kernel's measurements on the H200, read from `notebooks/results/h200_hopper.json`.

The file holds one run: `rows` (TFLOP/s of each kernel and setting; the bf16 matmul rate of the same
run is in `matmul_tflops`), `fp8_ratio` (the FP8 forward beside the bf16 one with the same tile,
same run); and, from the runs before it, `steps` (the optimisation story, each step's prediction and
outcome) and `fp8` (the FP8 forward's RMSE against float64). `load_results` reads it (None when it
is absent), `steps_table` and `rows_table` print it, `plot_steps` draws the steps. Nothing here
measures; every number shown comes from the file.

Introduced in notebooks/11_hopper.ipynb.
"""

from __future__ import annotations

import json
from pathlib import Path

from .._env import ROOT

RESULTS = ROOT / "notebooks" / "results" / "h200_hopper.json"


def load_results(path: str | Path | None = None) -> dict | None:
    """The measured Hopper results (schema in the file's `rows`, `steps`, `fp8`), or None if absent.

    Introduced in notebooks/11_hopper.ipynb.
    """
    p = Path(path) if path is not None else RESULTS
    if not p.exists():
        return None
    data = json.loads(p.read_text())
    missing = [k for k in ("rows", "steps", "matmul_tflops") if k not in data]
    if missing:
        raise ValueError(f"{p.name}: not a Hopper results file, it lacks {', '.join(missing)}")
    return data


def steps_table(result: dict) -> str:
    """The optimisation steps, one line each: forward TFLOP/s, and the prediction beside it.

    Introduced in notebooks/11_hopper.ipynb.
    """
    lines = [f"{'step':<18}{'fwd':>7}{'fwd+bwd':>9}{'causal':>8}  expected -> note"]
    fmt = lambda x: f"{x:.0f}" if isinstance(x, (int, float)) else "-"
    for s in result["steps"]:
        lines.append(
            f"{s['name'][:17]:<18}{fmt(s.get('fwd_tflops')):>7}"
            f"{fmt(s.get('fwd_bwd_tflops')):>9}{fmt(s.get('causal_fwd_tflops')):>8}"
            f"  {s.get('expected', '')} -> {s.get('note', '')}"
        )
    return "\n".join(lines)


_SHORT = {"hopper_fp8": "hopper8", "sdpa_flash": "flash", "sdpa_cudnn": "cudnn"}  # column names


def rows_table(result: dict) -> str:
    """The measured rows, one line per setting: every kernel's TFLOP/s (hopper8 = hopper_fp8,
    flash and cudnn = SDPA's backends), then the headline kernel's rate over cuDNN's and over the
    bf16 matmul rate measured in the same run ("-" where absent). The headline kernel is "gluon"
    when the file has it (else "hopper"), and hopper_fp8 on the FP8 lines. Under 100 columns.

    Introduced in notebooks/11_hopper.ipynb.
    """
    kernels = sorted({r["kernel"] for r in result["rows"]})
    headline = "gluon" if "gluon" in kernels else "hopper"
    by: dict[tuple, dict[str, float]] = {}
    for r in result["rows"]:
        key = (r["dtype"], r["d"], r["N"], r["pass"], r["causal"])
        by.setdefault(key, {})[r["kernel"]] = r["tflops"]
    mm = (result.get("matmul_tflops") or {}).get("bf16")
    ratio = lambda a, b: f"{a / b:.2f}" if a and b else "-"
    names = "".join(f"{_SHORT.get(k, k[:7]):>8}" for k in kernels)
    lines = [f"{'setting':<33}{names}{'vs cudnn':>9}{'vs mm':>7}"]
    for (dtype, d, N, pass_, causal), rates in sorted(by.items(), key=str):
        mine = rates.get("hopper_fp8" if dtype.startswith("fp8") else headline)
        cells = "".join(f"{rates[k]:>8.0f}" if k in rates else f"{'-':>8}" for k in kernels)
        label = f"{dtype} d={d} N={N} {pass_}{' causal' if causal else ''}"
        vs = f"{ratio(mine, rates.get('sdpa_cudnn')):>9}{ratio(mine, mm):>7}"
        lines.append(f"{label:<33}{cells}{vs}")
    return "\n".join(lines)


def plot_steps(result: dict, ax=None, *, cudnn: float | None = None):
    """Bar chart of the forward TFLOP/s after each step, with the bf16 matmul rate of the same run
    (and cuDNN's forward, if given) as horizontal lines. Returns the axes.

    Introduced in notebooks/11_hopper.ipynb.
    """
    import matplotlib.pyplot as plt

    ax = ax if ax is not None else plt.subplots(figsize=(8, 3.2))[1]
    steps = [s for s in result["steps"] if isinstance(s.get("fwd_tflops"), (int, float))]
    names = [s["name"] for s in steps]
    ax.bar(range(len(steps)), [s["fwd_tflops"] for s in steps], color="#3b75af")
    ax.set_xticks(range(len(steps)), names, rotation=30, ha="right", fontsize=8)
    mm = (result.get("matmul_tflops") or {}).get("bf16")
    for y, label, style in ((mm, "bf16 matmul, same run", "k--"), (cudnn, "cuDNN forward", "r:")):
        if y:
            ax.axhline(y, color=style[0], ls=style[1:], lw=1, label=f"{label}: {y:.0f}")
    ax.set_ylabel("forward TFLOP/s")
    ax.legend(fontsize=8, loc="lower right")
    return ax
