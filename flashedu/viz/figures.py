"""Figures and tables the chapters draw from data: the block map of a mask, the measured TFLOP/s
panels and the CPU benchmark table. Pure functions (matplotlib Figures or Axes given in, text out),
re-exported by `flashedu.viz`, so a chapter calls one line instead of defining them in a cell.

Introduced in notebooks/08_benchmarks.ipynb (benchmarks) and notebooks/09_beyond.ipynb (block maps).
"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from .. import masks
from ..nb import fmt_bytes

KIND_CODE = {"skip": 0, "partial": 1, "full": 2}
KIND_COLORS = ("white", "#f4a259", "#5b8e7d")  # skip, partial, full


def show_block_map(ax, N_q: int, N_k: int, block_m: int, block_n: int, **mask):
    """Draw `masks.block_map` on a matplotlib Axes: skipped tiles white, tiles on a mask edge
    orange, fully visible tiles green, the block grid in grey; the title names the mask and counts
    the tiles computed. mask: causal=, window_size= as in `masks.visible`. Returns the
    (ceil(N_q / block_m), ceil(N_k / block_n)) array of kinds.

    Introduced in notebooks/09_beyond.ipynb."""
    from matplotlib.colors import ListedColormap

    unknown = set(mask) - {"causal", "window_size"}
    if unknown:
        raise TypeError(f"show_block_map: mask takes causal= and window_size=, got {unknown}")
    kinds = masks.block_map(N_q, N_k, block_m, block_n, **mask)
    codes = np.vectorize(KIND_CODE.get)(kinds)
    ax.imshow(
        codes,
        cmap=ListedColormap(list(KIND_COLORS)),
        vmin=0,
        vmax=2,
        extent=(0, N_k, N_q, 0),
        interpolation="nearest",
    )
    ax.set_xticks(range(0, N_k + 1, block_n), minor=True)
    ax.set_yticks(range(0, N_q + 1, block_m), minor=True)
    ax.grid(which="minor", color="grey", lw=0.3)
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")
    label = ", ".join(f"{k}={v}" for k, v in mask.items())
    ax.set_title(f"{label}\n{(kinds != 'skip').sum()} of {kinds.size} tiles computed", fontsize=9)
    return kinds


def tflops_panels(timing: list[dict], dtype: str, *, gpu: str = "H200") -> Figure:
    """Measured TFLOP/s against N from a benchmark JSON's "timing" rows, for one dtype: a row of
    panels per pass ("fwd", "fwd_bwd"), a column per head dim d, one line per implementation
    (dashed when causal). `gpu` only labels the title. Display the returned Figure.

    Introduced in notebooks/08_benchmarks.ipynb."""
    ds = sorted({r["d"] for r in timing if r["dtype"] == dtype})
    if not ds:
        raise ValueError(f"tflops_panels: no timing rows with dtype={dtype!r}")
    fig = Figure(figsize=(5 * len(ds), 6.4), layout="tight")
    axes = fig.subplots(2, len(ds), sharex=True, squeeze=False)
    impls = sorted({r["impl"] for r in timing})
    for row, pass_ in enumerate(("fwd", "fwd_bwd")):
        for col, d in enumerate(ds):
            ax = axes[row, col]
            for n, impl in enumerate(impls):
                for causal, style in ((False, "o-"), (True, "s--")):
                    key = (impl, pass_, causal, dtype, d)
                    pts = sorted(
                        (r["N"], r["tflops"])
                        for r in timing
                        if (r["impl"], r["pass"], r["causal"], r["dtype"], r["d"]) == key
                    )
                    if pts:
                        label = f"{impl}{', causal' if causal else ''}"
                        ax.plot(*zip(*pts), style, color=f"C{n}", label=label)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{pass_}, d={d}")
            ax.set_ylabel("TFLOP/s")
            ax.grid(True, alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("sequence length N (batch B = 16k / N)")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(f"{gpu}, {dtype}: measured")
    return fig


CPU_IMPLS = ("naive", "tiled", "torch_tiled", "sdpa")


def cpu_table(result: dict) -> str:
    """The CPU benchmark as a fixed-width table (print it): forward milliseconds per
    implementation and N, the tiled / naive time ratio, and the peak bytes naive and tiled
    allocated; then one line per skipped case with its reason.

    Introduced in notebooks/08_benchmarks.ipynb."""
    rows = [r for r in result["timing"] if r["pass"] == "fwd"]
    impls = [i for i in CPU_IMPLS if any(r["impl"] == i for r in rows)]
    lines = [
        f"{'N':>6}"
        + "".join(f"{i + ' ms':>15}" for i in impls)
        + f"{'tiled/naive':>13}"
        + f"{'naive peak':>13}{'tiled peak':>13}"
    ]
    for N in sorted({r["N"] for r in rows}):
        at = {r["impl"]: r for r in rows if r["N"] == N}
        ms = "".join(f"{at[i]['ms']:>15.1f}" if i in at else f"{'skipped':>15}" for i in impls)
        both = {"tiled", "naive"} <= set(at)
        ratio = f"{at['tiled']['ms'] / at['naive']['ms']:>13.2f}" if both else f"{'-':>13}"
        peaks = "".join(
            f"{fmt_bytes(at[i]['peak_bytes']):>13}" if i in at else f"{'-':>13}"
            for i in ("naive", "tiled")
        )
        lines.append(f"{N:>6}{ms}{ratio}{peaks}")
    for s in result["skipped"]:
        lines.append(f"skipped: {s['impl']} at N={s['N']} ({s['pass']}): {s['reason']}")
    return "\n".join(lines)
