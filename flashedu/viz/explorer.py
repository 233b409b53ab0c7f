"""The numbers behind the traffic widgets, as pure functions (the drawings are in `viz.draw`).

`flashedu.widgets` only wires sliders to these functions, so every number a widget shows can be
checked without a browser: `explorer_state` (bytes by tensor and direction, the standard/flash
ratio, the roofline with its exponentials' ceiling, the tiles and whether they fit),
`default_tiles` (the tiles each rule picks for a preset), `roofline_points` (where standard and
flash attention sit on a preset's roofline) and `stepper_frames` (the tile-by-tile replay of a
`traffic.Ledger` filled by `tiled.forward`).

Limits: the byte counts are the closed forms of `flashedu.traffic` (HBM traffic only; caches, L2
reuse and achievable bandwidth are out of scope), and the roofline gives a lower bound on time, not
a prediction.

Introduced in notebooks/00_memory_hierarchy.ipynb; the tile stepper in
notebooks/03_tiled_forward.ipynb.
"""

from __future__ import annotations

from collections import defaultdict

from .. import traffic
from ..traffic.closed_forms import check_query_blocks
from ..validation import check_int, check_real

ALGORITHMS = {
    "naive": "standard attention, forward (S and P through HBM)",
    "fa1": "FlashAttention forward, FA1 loop order (outer loop over K, V)",
    "fa2": "FlashAttention forward, FA2 loop order (outer loop over Q)",
    "backward": "FlashAttention backward (recomputes P from Q, K and lse)",
}
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


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
    check_query_blocks("explorer_state", N, bm, arg="N")
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
