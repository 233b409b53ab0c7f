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
    return _load(path, RESULTS, ("rows", "steps", "matmul_tflops"), "Hopper results")


def _load(path, default: Path, keys: tuple[str, ...], what: str) -> dict | None:
    """The JSON at path (default: `default`), or None if it is absent; a file without every key
    in `keys` is a ValueError that names what it lacks."""
    p = Path(path) if path is not None else default
    if not p.exists():
        return None
    data = json.loads(p.read_text())
    missing = [k for k in keys if k not in data]
    if missing:
        raise ValueError(f"{p.name}: not a {what} file, it lacks {', '.join(missing)}")
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


# ------------------------------------------------------------------------------------------------
# The backward: notebooks/results/h200_backward.json (scripts/hopper/h200_backward.py)
# ------------------------------------------------------------------------------------------------
BACKWARD_RESULTS = RESULTS.parent / "h200_backward.json"


def load_backward(path: str | Path | None = None) -> dict | None:
    """The measured Gluon backward results (`ladder`, `auto`, `correctness`, `determinism`,
    `backward_rows`, `ncu`, ...), or None if the file is absent.

    Introduced in notebooks/11_hopper.ipynb.
    """
    return _load(path, BACKWARD_RESULTS, ("ladder", "correctness", "matmul_bf16_tflops"),
                 "backward results")  # fmt: skip


def ladder_table(result: dict) -> str:
    """The backward's ablation ladder from one run: one line per step with the backward's TFLOP/s
    for each (head dim, mask) measured and its ratio to the first step (the FA2 kernels); then
    what each step changes, and the steps the file lists as not built, with the reason. Under 100
    columns.

    Introduced in notebooks/11_hopper.ipynb.
    """
    rows = result["ladder"]
    settings = sorted({(r["d"], r["causal"]) for r in rows}, key=lambda s: (-s[0], s[1]))
    steps = list(dict.fromkeys(r["kernel"] for r in rows))
    rate = {(r["kernel"], r["d"], r["causal"]): r["tflops"] for r in rows}
    heads = [f"d={d}{' causal' if c else ''}" for d, c in settings]
    lines = [f"{'step':<22}" + "".join(f"{h:>14}" for h in heads)]
    for step in steps:
        cells = []
        for d, c in settings:
            x, base = rate.get((step, d, c)), rate.get((steps[0], d, c))
            ok = isinstance(x, (int, float)) and x == x
            ratio = f"{x / base:.2f}x" if ok and base else ""
            cells.append(f"{x:5.0f} {ratio:>6}" if ok else "-")
        lines.append(f"{step[:21]:<22}" + "".join(f"{c:>14}" for c in cells))
    lines.append("TFLOP/s of the backward alone (10 B H N^2 d, halved when causal); x = over fa2.")
    for step in steps:
        what = next((r.get("what", "") for r in rows if r["kernel"] == step), "")
        lines.append(f"  {step}: {what}"[:99])
    for miss in result.get("ladder_not_built", []):
        lines.append(f"  not built - {miss['step']}: {miss['why']}"[:99])
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Head dims other than 64 and 128: notebooks/results/h200_headdims.json
# (scripts/hopper/h200_headdims.py, merged by scripts/hopper/merge_headdims.py)
# ------------------------------------------------------------------------------------------------
HEADDIMS_RESULTS = RESULTS.parent / "h200_headdims.json"
# the columns of `headdims_table`: the row kernels each shows (the faster of several)
HEADDIM_COLUMNS = (
    ("auto", ("flashedu_auto",)),
    ("padded", ("fa2_padded", "fa2_padded_sep")),
    ("2 chunks", ("fa2_split", "fa2_split_sep")),
    ("Hopper", ("hopper_padded",)),
    ("FLASH", ("sdpa_flash",)),
    ("cuDNN", ("sdpa_cudnn",)),
)


def load_headdims(path: str | Path | None = None) -> dict | None:
    """The head-dim results (`runs`, `head_dims`: the run each head dim's rows come from, `sweep`,
    `best`, `rows`), or None if the file is absent.

    Introduced in notebooks/11_hopper.ipynb.
    """
    return _load(path, HEADDIMS_RESULTS, ("runs", "head_dims", "rows"), "head-dim results")


def headdims_table(result: dict, dtype: str = "bf16") -> str:
    """TFLOP/s by head dim, mask and pass: impl="auto" as the library ran in that run; the FA2
    kernels with the head dim padded to a power of two and in two chunks (each with its fastest
    swept configs, dK/dV in one launch or two, whichever was faster); q, k, v zero-padded to the
    Hopper kernels' width; SDPA's FLASH and cuDNN backends; auto's ratio to each. One run per head
    dim (the `run` column), so each line compares kernels measured side by side. Under 100 columns.

    Introduced in notebooks/11_hopper.ipynb.
    """
    rows = [r for r in result["rows"] if r["dtype"] == dtype]
    rate: dict = {}
    for r in rows:
        if r.get("ok", True) is False or not r["tflops"] == r["tflops"]:
            continue  # a row that failed its check, or that did not run, is not shown
        key = (r["d"], r["causal"], r["pass"], r["kernel"])
        rate[key] = max(rate.get(key, 0.0), r["tflops"])
    head = f"{'d':>4} {'mask':<7}{'pass':<8}" + "".join(f"{c:>9}" for c, _ in HEADDIM_COLUMNS)
    lines = [head + f"{'/ FLASH':>8}{'/ cuDNN':>8}{'run':>4}"]
    for d, causal, pass_ in sorted({(r["d"], r["causal"], r["pass"]) for r in rows}):
        cells = []
        for _, kernels in HEADDIM_COLUMNS:
            got = [rate[(d, causal, pass_, k)] for k in kernels if (d, causal, pass_, k) in rate]
            cells.append(max(got) if got else None)
        auto, flash, cudnn = cells[0], cells[4], cells[5]
        ratios = [f"{auto / x:8.2f}" if auto and x else f"{'-':>8}" for x in (flash, cudnn)]
        mask = "causal" if causal else "-"
        line = f"{d:>4} {mask:<7}{pass_:<8}" + "".join(
            f"{c:9.0f}" if c is not None else f"{'-':>9}" for c in cells
        )
        lines.append(line + "".join(ratios) + f"{result['head_dims'].get(str(d), '?'):>4}")
    return "\n".join(lines)
