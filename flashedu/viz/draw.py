"""The drawings behind the traffic widgets: matplotlib Figures (no pyplot, no global state) from
the results of `viz.explorer`, `png` into bytes for an image widget, and readable units.

Introduced in notebooks/00_memory_hierarchy.ipynb; the tile drawing in
notebooks/03_tiled_forward.ipynb.
"""

from __future__ import annotations

import io
import math

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from .. import traffic
from .explorer import ALGORITHMS

READ, WRITE, CURRENT, DONE, SKIPPED = "#4c72b0", "#dd8452", "#c44e52", "#a1c9f4", "#d0d0d0"
STANDARD, FLASH = "#8c8c8c", "#55a868"


def fmt_time(seconds: float) -> str:
    """2.84e-05 -> '28.4 µs'; three significant figures in s, ms, µs or ns."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def describe(r: traffic.Roofline) -> str:
    """One line on a roofline result, times in readable units: intensity vs ridge, bound, the
    memory and matmul times, and the exponentials' time where it was counted."""
    exp = f", exponentials {fmt_time(r.t_exp)}" if r.t_exp else ""
    return (
        f"{r.intensity:.1f} FLOP/byte vs ridge {r.ridge:.0f}: {r.bound}-bound, "
        f"memory {fmt_time(r.t_memory)}, "
        f"compute {fmt_time(r.t_compute)}{exp}"
    )


def byte_unit(nbytes: float) -> tuple[str, float]:
    """("GiB", 2**30) for the largest binary unit not above nbytes (B below 1 KiB): one unit per
    axis, so its ticks and labels agree."""
    for unit, scale in (("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10)):
        if nbytes >= scale:
            return unit, scale
    return "B", 1.0


def png(fig: Figure, dpi: int = 80) -> bytes:
    """The figure as PNG bytes (for an ipywidgets.Image)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def draw_traffic(state: dict) -> Figure:
    """Left: HBM bytes by tensor, read and written, for the chosen algorithm. Right: standard vs
    flash totals. Each axis carries its unit (KiB, MiB or GiB, whichever fits its largest bar) and
    the totals are labelled in that same unit."""
    t = state["traffic"]
    names = sorted(set(t.reads) | set(t.writes), key=traffic.tensor_order)
    unit, scale = byte_unit(max([*t.reads.values(), *t.writes.values(), 1]))
    fig = Figure(figsize=(8.4, 3.0), layout="constrained")
    ax, tot = fig.subplots(1, 2, width_ratios=[3, 1.3])
    x = range(len(names))
    ax.bar(
        [i - 0.2 for i in x],
        [t.reads.get(n, 0) / scale for n in names],
        0.4,
        color=READ,
        label="read (HBM → SRAM)",
    )
    ax.bar(
        [i + 0.2 for i in x],
        [t.writes.get(n, 0) / scale for n in names],
        0.4,
        color=WRITE,
        label="written (SRAM → HBM)",
    )
    ax.set_xticks(list(x), names)
    ax.set_ylabel(f"HBM bytes ({unit})")
    ax.set_title(ALGORITHMS[state["algorithm"]], fontsize=9)
    ax.legend(fontsize=8, frameon=False)
    totals = [state["standard"].total_bytes, state["flash"].total_bytes]
    unit, scale = byte_unit(max(totals))
    pair = [v / scale for v in totals]
    tot.bar(["standard", "flash"], pair, color=[STANDARD, FLASH])
    tot.set_ylabel(f"HBM bytes ({unit})")
    tot.set_title(f"total HBM bytes\nflash moves {state['ratio']:.1f}x less", fontsize=9)
    for i, v in enumerate(pair):
        tot.annotate(f"{v:.3g} {unit}", (i, v), ha="center", va="bottom", fontsize=8)
    tot.set_ylim(0, max(pair) * 1.18)
    return fig


def draw_roofline(gpu: str, points: dict[str, traffic.Roofline]) -> Figure:
    """Attainable FLOP/s against arithmetic intensity on `gpu`, with each point placed on the
    roof, and, where the preset cites a special-function rate, the exponentials' ceiling: the
    matmul FLOP/s the exponentials allow (rate x FLOPs per exponential, 4 d for the forward)."""
    g = traffic.gpu_preset(gpu)
    lo = min(min(r.intensity for r in points.values()) / 4, 1.0)
    hi = max(max(r.intensity for r in points.values()) * 4, g.ridge * 8)
    xs = [lo * (hi / lo) ** (k / 200) for k in range(201)]
    fig = Figure(figsize=(6.4, 3.6), layout="constrained")
    ax = fig.subplots()
    ax.loglog(xs, [min(g.dense_flops, x * g.hbm_bandwidth) / 1e12 for x in xs], color="k", lw=1.5)
    ax.axvline(g.ridge, color="grey", ls=":", lw=1)
    ax.annotate(
        f"ridge {g.ridge:.0f} FLOP/B",
        (g.ridge, 0),
        xycoords=("data", "axes fraction"),
        fontsize=8,
        color="grey",
        ha="left",
        va="bottom",
        xytext=(4, 4),
        textcoords="offset points",
    )
    ceilings = [r.flops / r.t_exp for r in points.values() if r.t_exp]
    if ceilings:
        cap = min(ceilings) / 1e12
        ax.axhline(cap, color=CURRENT, ls="--", lw=1)
        ax.annotate(
            f"exponentials: {g.sfu_tflops:.1f} T exp/s cap the matmuls at {cap:.0f} TFLOP/s",
            (0, cap),
            xycoords=("axes fraction", "data"),
            xytext=(4, 3),
            textcoords="offset points",
            fontsize=8,
            color=CURRENT,
        )
    for (name, r), color in zip(points.items(), (STANDARD, FLASH, CURRENT)):
        y = r.flops / r.time / 1e12
        ax.plot([r.intensity], [y], "o", ms=9, color=color)
        right = r.intensity < g.ridge
        ax.annotate(
            f"{name}: {r.intensity:.0f} FLOP/B, {r.bound}-bound\nat least {fmt_time(r.time)}",
            (r.intensity, y),
            xytext=(10 if right else -10, -26),
            textcoords="offset points",
            fontsize=8,
            ha="left" if right else "right",
        )
    top = max([g.dense_flops / 1e12 * 3, *(c / 1e12 * 1.5 for c in ceilings)])
    ax.set_ylim(min(lo * g.hbm_bandwidth, g.dense_flops) / 1e12 / 2, top)
    ax.set_xlabel("arithmetic intensity (FLOP per HBM byte)")
    ax.set_ylabel("attainable TFLOP/s")
    ax.set_title(
        f"{g.name}: {g.hbm_bandwidth / 1e12:.2f} TB/s HBM, "
        f"{g.dense_flops / 1e12:.0f} TFLOP/s dense fp16",
        fontsize=9,
    )
    return fig


def draw_tiles(
    frame: dict, N_q: int, N_k: int, block_m: int, block_n: int, order: str = "fa2"
) -> Figure:
    """The S matrix cut into tiles: computed, current (red edge), skipped by the causal mask
    (hatched) and still to come; beside it the Q blocks (left) and K/V blocks (top), filled where
    the block sits in SRAM."""
    n_i, n_j = math.ceil(N_q / block_m), math.ceil(N_k / block_n)
    fig = Figure(figsize=(4.8, 0.9 + 4.0 * (n_i + 1.4) / (n_j + 1.4)), layout="constrained")
    ax = fig.subplots()
    cur, skipped = (frame["i"], frame["j"]), frame.get("skipped", False)
    for i in range(n_i):
        for j in range(n_j):
            gone = (i, j) in frame["skipped_tiles"]
            face = SKIPPED if gone else DONE if (i, j) in frame["done"] else "white"
            edge, lw = (CURRENT, 3) if (i, j) == cur else ("grey", 0.6)
            ax.add_patch(
                Rectangle(
                    (j + 1.4, i + 1.4),
                    0.9,
                    0.9,
                    facecolor=face,
                    edgecolor=edge,
                    lw=lw,
                    hatch="//" if gone else None,
                )
            )
    # A skipped tile loads nothing: only the outer loop's block (Q for FA2, K/V for FA1) stays in
    # SRAM.
    q_in = not skipped or order == "fa2"
    kv_in = not skipped or order == "fa1"
    for i in range(n_i):
        ax.add_patch(
            Rectangle(
                (0, i + 1.4),
                0.9,
                0.9,
                facecolor=READ if q_in and i == cur[0] else "white",
                edgecolor="grey",
            )
        )
    for j in range(n_j):
        ax.add_patch(
            Rectangle(
                (j + 1.4, 0),
                0.9,
                0.9,
                facecolor=READ if kv_in and j == cur[1] else "white",
                edgecolor="grey",
            )
        )
    ax.text(0.45, 0.7, "Q ↓", ha="center", va="center", fontsize=9)
    ax.text(0.45, 0.2, "K, V →", ha="center", va="center", fontsize=8)
    ax.set_xlim(-0.1, n_j + 1.4)
    ax.set_ylim(n_i + 1.4, -0.1)
    ax.set_aspect("equal")
    ax.axis("off")
    legend = [
        Rectangle((0, 0), 1, 1, facecolor=READ, label="in SRAM"),
        Rectangle((0, 0), 1, 1, facecolor=DONE, edgecolor="grey", label="S tile done"),
        Rectangle((0, 0), 1, 1, facecolor="white", edgecolor=CURRENT, lw=2, label="this step"),
        Rectangle(
            (0, 0), 1, 1, facecolor=SKIPPED, hatch="//", edgecolor="grey", label="skipped (masked)"
        ),
    ]
    ax.legend(
        handles=legend,
        loc="upper center",
        bbox_to_anchor=(0.5, 0.0),
        ncol=2,
        fontsize=8,
        frameon=False,
    )
    what = "skipped: fully masked" if skipped else "computed in SRAM"
    ax.set_title(f"step {frame['step'] + 1}: S tile ({cur[0]}, {cur[1]}) {what}", fontsize=9)
    return fig
