"""The numbers and the drawings behind the traffic widgets, as pure functions.

`flashedu.widgets` only wires sliders to these functions, so every number a widget shows can be
checked without a browser: `explorer_state` (bytes by tensor and direction, the standard/flash
ratio, the roofline with its exponentials' ceiling, the tiles and whether they fit),
`default_tiles` (the tiles each rule picks for a preset), `roofline_points` (where standard and
flash attention sit on a preset's roofline) and `stepper_frames` (the tile-by-tile replay of a
`traffic.Ledger` filled by `tiled.forward`). The `draw_*` functions turn those results into
matplotlib Figures (no pyplot, no global state), `png` into bytes for an image widget. Re-exported
here: the measured-run replay (`flashedu.replay`) and the chapter figures (`flashedu.figures`:
`show_block_map`, `tflops_panels`, `cpu_table`).

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
from ._validate import check_int, check_real
from .figures import (  # noqa: F401  (re-exported: the chapters call them as viz.*)
    KIND_CODE,
    KIND_COLORS,
    cpu_table,
    show_block_map,
    tflops_panels,
)
from .replay import draw_measured, draw_program, measured_state, program_frames  # noqa: F401

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


TILE_RULES = {
    "fit": "largest powers of two that fit the SRAM budget",
    "paper": "the paper's rule B_c = ceil(M / 4d), B_r = min(B_c, d)",
}


def _one_of(name: str, arg: str, value, options) -> None:
    if value not in options:
        raise ValueError(f"{name}: {arg} must be one of {list(options)}, got {value!r}")


MAX_SRAM_KIB = 1024  # shared memory per thread block: 227 KiB on an H100, so 1 MiB is ample


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
    tile_rule: str = "fit",
) -> dict:
    """Everything the traffic explorer shows, for N queries and N keys of width d.

    block_m / block_n default to tiles chosen for the SRAM budget (sram_kib, default the preset's
    shared memory per thread block) by `tile_rule` (`traffic.tile_choice`):
    "fit" (default) picks the largest powers of two from 16 to 128 whose tiles fit, the outer
    loop's block first (Q's for FA2, K/V's for FA1 and the backward): tiles a tensor core can use;
    "paper" is FlashAttention's rule B_c = ceil(M / 4d), B_r = min(B_c, d), the large B_c for the
    tensor of the outer loop, which stays in SRAM. The paper's rule sizes tiles to the order of the
    SRAM, so they may overflow it (454 x 64 at d = 64 on an H200, 34% over). The standard algorithm
    is compared with FA2. Causal: the tiled passes skip masked blocks (fewer bytes and FLOPs); the
    standard one computes all of S anyway. Costs O(N / block_m), so N = 10^7 answers at once.

    Returns a dict with `traffic` (the chosen algorithm's Traffic), `standard` and `flash`
    (the pair being compared), `ratio` (standard / flash bytes), `roofline` (with the
    exponentials' ceiling where the preset cites one), `flops`, `exps`, `block_m`, `block_n`,
    `auto_blocks` (whether the rule chose any of them), `tile_rule`, `tiles` (the TileChoice),
    `sram_bytes`, `sram_tiles` (bytes resident in SRAM per thread block, by tile) and `fits`
    (whether those tiles fit the budget).
    """
    _one_of("explorer_state", "algorithm", algorithm, ALGORITHMS)
    _one_of("explorer_state", "dtype", dtype, ITEMSIZE)
    _one_of("explorer_state", "tile_rule", tile_rule, TILE_RULES)
    for arg, value in (("N", N), ("d", d), ("B", B), ("H", H)):
        check_int(value, arg, name="explorer_state", low=1)
    if sram_kib is not None:
        check_real(sram_kib, "sram_kib", name="explorer_state", low=1, high=MAX_SRAM_KIB)
    g, e = traffic.gpu_preset(gpu), ITEMSIZE[dtype]
    sram = int(sram_kib * 1024) if sram_kib is not None else g.smem_per_block
    choice = traffic.tile_choice(
        sram,
        d,
        e,
        algorithm="fa2" if algorithm == "naive" else algorithm,
        rule=tile_rule,
        block_m=block_m,
        block_n=block_n,
    )
    bm, bn = choice.block_m, choice.block_n
    traffic.check_query_blocks("explorer_state", N, bm, arg="N")
    shape = (B, H, N, N, d)
    if algorithm == "backward":
        standard = traffic.naive_backward(*shape, itemsize=e)
        flash = traffic.flash_backward(*shape, block_m=bm, block_n=bn, causal=causal, itemsize=e)
    else:
        standard = traffic.naive_forward(*shape, itemsize=e)
        order = "fa1" if algorithm == "fa1" else "fa2"
        flash = traffic.flash_forward(
            *shape, block_m=bm, block_n=bn, order=order, causal=causal, itemsize=e
        )
    shown = standard if algorithm == "naive" else flash
    # Standard attention computes all of S even when causal; the tiled kernels skip masked blocks.
    pass_, masked = ("bwd" if algorithm == "backward" else "fwd"), causal and algorithm != "naive"
    flops = traffic.attention_flops(*shape, causal=masked, pass_=pass_)
    exps = traffic.exp_count(B, H, N, N, causal=masked, pass_=pass_)
    tiles = {} if algorithm == "naive" else choice.tiles
    return {
        "N": N,
        "d": d,
        "dtype": dtype,
        "itemsize": e,
        "gpu": gpu if isinstance(gpu, str) else g.name,
        "algorithm": algorithm,
        "causal": causal,
        "B": B,
        "H": H,
        "block_m": bm,
        "block_n": bn,
        "auto_blocks": block_m is None or block_n is None,
        "tile_rule": tile_rule,
        "tiles": choice,
        "sram_bytes": sram,
        "sram_tiles": tiles,
        "fits": sum(tiles.values()) <= sram,
        "traffic": shown,
        "standard": standard,
        "flash": flash,
        "ratio": standard.total_bytes / flash.total_bytes,
        "flops": flops,
        "exps": exps,
        "roofline": traffic.roofline(flops, shown.total_bytes, g, exps=exps),
    }


def default_tiles(
    gpu: str = "H200", d: int = 64, dtype: str = "float16", *, algorithm: str = "fa2"
) -> dict:
    """The explorer's default tiles for a preset under both rules, and whether they fit: the one
    story chapters 00, 03 and 08 tell. Returns {"fit": TileChoice, "paper": TileChoice}; print
    `choice.explain()` for one line each."""
    _one_of("default_tiles", "dtype", dtype, ITEMSIZE)
    g = traffic.gpu_preset(gpu)
    return {
        rule: traffic.tile_choice(
            g.smem_per_block, d, ITEMSIZE[dtype], algorithm=algorithm, rule=rule
        )
        for rule in TILE_RULES
    }


sram_tiles = traffic.sram_tiles  # the SRAM bytes of each algorithm's tiles (now in tiles.py)


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
