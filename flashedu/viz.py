"""The numbers and the drawings behind the traffic widgets, as pure functions.

`flashedu.widgets` only wires sliders to these functions, so every number a widget shows can be
checked without a browser: `explorer_state` (bytes by tensor and direction, the standard/flash
ratio, the roofline), `roofline_points` (where standard and flash attention sit on a preset's
roofline) and `stepper_frames` (the tile-by-tile replay of a `traffic.Ledger` filled by
`tiled.forward`). The `draw_*` functions turn those results into matplotlib Figures (no pyplot, no
global state), `png` into bytes for an image widget.

Limits: the byte counts are the closed forms of `flashedu.traffic` (HBM traffic only; caches, L2
reuse and achievable bandwidth are out of scope), and the roofline gives a lower bound on time, not
a prediction.

Introduced in notebooks/00_memory_hierarchy.ipynb; the tile stepper in
notebooks/03_tiled_forward.ipynb.
"""

from __future__ import annotations

import io
import math
from collections import defaultdict

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from . import traffic
from .nb import fmt_bytes

ALGORITHMS = {
    "naive": "standard attention, forward (S and P through HBM)",
    "fa1": "FlashAttention forward, FA1 loop order (outer loop over K, V)",
    "fa2": "FlashAttention forward, FA2 loop order (outer loop over Q)",
    "backward": "FlashAttention backward (recomputes P from Q, K and lse)",
}
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
READ, WRITE, CURRENT, DONE, SKIPPED = "#4c72b0", "#dd8452", "#c44e52", "#a1c9f4", "#d0d0d0"
STANDARD, FLASH = "#8c8c8c", "#55a868"


# ------------------------------------------------------------------------------------------ numbers


def explorer_state(
    *,
    N: int = 4096,
    d: int = 64,
    dtype: str = "float16",
    gpu: str = "H200",
    algorithm: str = "fa2",
    block_m: int | None = None,
    block_n: int | None = None,
    sram_kib: float | None = None,
    causal: bool = False,
    B: int = 1,
    H: int = 1,
) -> dict:
    """Everything the traffic explorer shows, for N queries and N keys of width d.

    block_m / block_n default to the paper's rule (`traffic.block_sizes`) for the SRAM budget
    (sram_kib, default the preset's shared memory per thread block): the large block
    B_c = ceil(M / 4d) goes to the tensor of the outer loop, which stays in SRAM (K/V for FA1 and
    the backward, Q for FA2), and B_r = min(B_c, d) to the tensor streamed past it. The standard
    algorithm is compared with FA2. Causal: the tiled passes skip masked blocks
    (fewer bytes and FLOPs); the standard one computes all of S anyway.

    Returns a dict with `traffic` (the chosen algorithm's Traffic), `standard` and `flash`
    (the pair being compared), `ratio` (standard / flash bytes), `roofline`, `flops`, `block_m`,
    `block_n`, `auto_blocks` (whether the rule chose any of them), `sram_bytes`, `sram_tiles` (bytes
    resident in SRAM per thread block, by tile) and `fits` (whether those tiles fit the budget).
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(
            f"explorer_state: algorithm must be one of {list(ALGORITHMS)}, got {algorithm!r}"
        )
    if dtype not in ITEMSIZE:
        raise ValueError(f"explorer_state: dtype must be one of {list(ITEMSIZE)}, got {dtype!r}")
    g, e = traffic.GPUS[gpu], ITEMSIZE[dtype]
    sram = int(sram_kib * 1024) if sram_kib else g.smem_per_block
    b_r, b_c = traffic.block_sizes(sram, d, e)
    auto_m, auto_n = (b_c, b_r) if algorithm in ("naive", "fa2") else (b_r, b_c)
    bm, bn = block_m or auto_m, block_n or auto_n
    shape = (B, H, N, N, d)
    if algorithm == "backward":
        standard = traffic.naive_backward(*shape, itemsize=e)
        flash = traffic.flash_backward(*shape, block_m=bm, block_n=bn, causal=causal, itemsize=e)
    else:
        standard = traffic.naive_forward(*shape, itemsize=e)
        flash = traffic.flash_forward(
            *shape,
            block_m=bm,
            block_n=bn,
            order="fa1" if algorithm == "fa1" else "fa2",
            causal=causal,
            itemsize=e,
        )
    shown = standard if algorithm == "naive" else flash
    # Standard attention computes all of S even when causal; the tiled kernels skip masked blocks.
    flops = traffic.attention_flops(
        *shape,
        causal=causal and algorithm != "naive",
        pass_="bwd" if algorithm == "backward" else "fwd",
    )
    tiles = sram_tiles(algorithm, bm, bn, d, e)
    return {
        "N": N,
        "d": d,
        "dtype": dtype,
        "itemsize": e,
        "gpu": gpu,
        "algorithm": algorithm,
        "causal": causal,
        "B": B,
        "H": H,
        "block_m": bm,
        "block_n": bn,
        "auto_blocks": block_m is None or block_n is None,
        "sram_bytes": sram,
        "sram_tiles": tiles,
        "fits": sum(tiles.values()) <= sram,
        "traffic": shown,
        "standard": standard,
        "flash": flash,
        "ratio": standard.total_bytes / flash.total_bytes,
        "flops": flops,
        "roofline": traffic.roofline(flops, shown.total_bytes, g),
    }


def sram_tiles(algorithm: str, block_m: int, block_n: int, d: int, itemsize: int) -> dict[str, int]:
    """Bytes one thread block keeps in SRAM at once, by tile: `traffic.tile_bytes` for the forward;
    for the backward, q_i, k_j, v_j, do_i in `itemsize` and s_ij, dp_ij, lse_i, D_i, the dK_j, dV_j
    accumulators in fp32.

    Standard attention streams rows and keeps no tile worth counting, so it returns {}.
    """
    if algorithm == "naive":
        return {}
    tiles = traffic.tile_bytes(block_m, block_n, d, itemsize=itemsize)
    if algorithm != "backward":
        return tiles
    f = 4
    return {
        "q_i": tiles["q_i"],
        "k_j": tiles["k_j"],
        "v_j": tiles["v_j"],
        "do_i": block_m * d * itemsize,
        "s_ij": tiles["s_ij"],
        "dp_ij": block_m * block_n * f,
        "lse_i": block_m * f,
        "D_i": block_m * f,
        "dk_j": block_n * d * f,
        "dv_j": block_n * d * f,
    }


def roofline_points(
    gpu: str = "H200",
    *,
    N: int = 4096,
    d: int = 64,
    dtype: str = "float16",
    causal: bool = False,
    B: int = 1,
    H: int = 1,
) -> dict[str, traffic.Roofline]:
    """Standard and flash (FA2 order, preset block sizes) attention forward on the roofline of
    `gpu`."""
    out = {}
    for name, algorithm in (("standard", "naive"), ("flash", "fa2")):
        s = explorer_state(
            N=N, d=d, dtype=dtype, gpu=gpu, algorithm=algorithm, causal=causal, B=B, H=H
        )
        out[name] = s["roofline"]
    return out


def stepper_frames(ledger: traffic.Ledger) -> list[dict]:
    """One frame per `ledger.step(...)`: the step's state (i, j, skipped, rows, cols, m, l, ...),
    the transfers made during it (`moved`: (tensor, direction, bytes)), the cumulative HBM bytes
    read and written up to the end of the step, and the sets of (i, j) tiles computed (`done`) and
    skipped (`skipped_tiles`) so far, this step's included.

    Transfers logged before the first step are counted in the first frame, so the last frame's
    totals equal `ledger.traffic()`.
    """
    moved = defaultdict(list)
    for t in ledger.transfers:
        moved[max(t.step, 0)].append((t.tensor, t.direction, t.nbytes))
    frames, read, written, done, skipped = [], 0, 0, frozenset(), frozenset()
    for k, state in enumerate(ledger.steps):
        read += sum(n for _, direction, n in moved[k] if direction == "read")
        written += sum(n for _, direction, n in moved[k] if direction == "write")
        if state.get("skipped", False):
            skipped = skipped | {(state["i"], state["j"])}
        else:
            done = done | {(state["i"], state["j"])}
        frames.append(
            {
                **state,
                "step": k,
                "moved": moved[k],
                "read_bytes": read,
                "write_bytes": written,
                "done": done,
                "skipped_tiles": skipped,
            }
        )
    return frames


# ----------------------------------------------------------------------------------------- drawings


def fmt_time(seconds: float) -> str:
    """2.84e-05 -> '28.4 µs'; three significant figures in s, ms, µs or ns."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def describe(r: traffic.Roofline) -> str:
    """One line on a roofline result, times in readable units: intensity vs ridge, bound, both
    times."""
    return (
        f"{r.intensity:.1f} FLOP/byte vs ridge {r.ridge:.0f}: {r.bound}-bound, "
        f"memory {fmt_time(r.t_memory)}, "
        f"compute {fmt_time(r.t_compute)}"
    )


def png(fig: Figure, dpi: int = 80) -> bytes:
    """The figure as PNG bytes (for an ipywidgets.Image)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def draw_traffic(state: dict) -> Figure:
    """Left: HBM bytes by tensor, read and written, for the chosen algorithm. Right: standard vs
    flash totals."""
    t, mib = state["traffic"], 2.0**20
    names = sorted(set(t.reads) | set(t.writes), key=traffic._order)
    fig = Figure(figsize=(8.4, 3.0), layout="constrained")
    ax, tot = fig.subplots(1, 2, width_ratios=[3, 1.3])
    x = range(len(names))
    ax.bar(
        [i - 0.2 for i in x],
        [t.reads.get(n, 0) / mib for n in names],
        0.4,
        color=READ,
        label="read (HBM → SRAM)",
    )
    ax.bar(
        [i + 0.2 for i in x],
        [t.writes.get(n, 0) / mib for n in names],
        0.4,
        color=WRITE,
        label="written (SRAM → HBM)",
    )
    ax.set_xticks(list(x), names)
    ax.set_ylabel("MiB")
    ax.set_title(ALGORITHMS[state["algorithm"]], fontsize=9)
    ax.legend(fontsize=8, frameon=False)
    pair = [state["standard"].total_bytes / mib, state["flash"].total_bytes / mib]
    tot.bar(["standard", "flash"], pair, color=[STANDARD, FLASH])
    tot.set_title(f"total HBM bytes\nflash moves {state['ratio']:.1f}x less", fontsize=9)
    for i, v in enumerate(pair):
        tot.annotate(fmt_bytes(v * mib), (i, v), ha="center", va="bottom", fontsize=8)
    tot.set_ylim(0, max(pair) * 1.18)
    return fig


def draw_roofline(gpu: str, points: dict[str, traffic.Roofline]) -> Figure:
    """Attainable FLOP/s against arithmetic intensity on `gpu`, with each point placed on the
    roof."""
    g = traffic.GPUS[gpu]
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
    ax.set_ylim(min(lo * g.hbm_bandwidth, g.dense_flops) / 1e12 / 2, g.dense_flops / 1e12 * 3)
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
