"""Tile sizes: which blocks (block_m, block_n) = (B_r, B_c) one thread block can hold in SRAM.

Two rules, both reported with what the tiles need and whether they fit (`tile_choice`):

* "fit" (the default): the largest powers of two between 16 and 128 whose tiles fit the budget,
  the outer loop's block first (Q's block_m for the FA2 order, K/V's block_n for the FA1 order and
  the backward), because that block sets how often the streamed tensor is re-read. Powers of two
  from 16 up are what tensor cores and Triton's `tl.dot` take; 128 is the largest tile flashedu's
  own kernels use (registers, which this model does not count, cap it in practice).
* "paper": FlashAttention's rule (Dao et al. 2022, Algorithm 1, line 1), B_c = ceil(M / 4d) and
  B_r = min(B_c, d) for an SRAM of M elements. It is an order-of-magnitude rule: its tiles need
  0.75 M to 1.25 M elements, so they can overflow the budget, and B_c is rarely a power of two
  (454 for d = 64 on an H100's 227 KiB).

Introduced in notebooks/00_memory_hierarchy.ipynb; `flashedu.traffic` re-exports everything here.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from .ledger import SramCapacityError

MIN_BLOCK, MAX_BLOCK = 16, 128
RULES = ("fit", "paper")
_OUTER_N = ("fa1", "backward")  # algorithms whose outer loop runs over K/V blocks


def _positive(value, arg: str, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}: {arg} must be a positive int, got {value!r}")
    return int(value)


def block_sizes(sram_bytes: int, d: int, itemsize: int = 2) -> tuple[int, int]:
    """(block_m, block_n) = (B_r, B_c) by the paper's rule (Dao et al. 2022, Algorithm 1, line 1):
    B_c = ceil(M / 4d), B_r = min(B_c, d), with M = sram_bytes // itemsize the SRAM size in
    elements.

    The rule is an order-of-magnitude one: the tiles it picks (Q_i, K_j, V_j, O_i, S_ij, m, l) need
    between 0.75 M and 1.25 M elements, so `tile_bytes` of the result can exceed sram_bytes a
    little."""
    d = _positive(d, "d", "block_sizes")
    itemsize = _positive(itemsize, "itemsize", "block_sizes")
    if not isinstance(sram_bytes, numbers.Integral) or sram_bytes < itemsize:
        raise ValueError(
            f"block_sizes: sram_bytes must be an int >= itemsize={itemsize}, got {sram_bytes!r}"
        )
    M = sram_bytes // itemsize
    block_n = -(-M // (4 * d))
    return min(block_n, d), block_n


def tile_bytes(
    block_m: int, block_n: int, d: int, *, itemsize: int = 2, acc_itemsize: int = 4
) -> dict[str, int]:
    """SRAM bytes of the tiles one program of the tiled forward holds at once (for `Ledger.fit`):
    q_i, k_j, v_j in the input dtype; scores s_ij, the output accumulator o_i and the statistics
    m_i, l_i in the accumulation dtype."""
    return {
        "q_i": block_m * d * itemsize,
        "k_j": block_n * d * itemsize,
        "v_j": block_n * d * itemsize,
        "s_ij": block_m * block_n * acc_itemsize,
        "o_i": block_m * d * acc_itemsize,
        "m_i": block_m * acc_itemsize,
        "l_i": block_m * acc_itemsize,
    }


def sram_tiles(algorithm: str, block_m: int, block_n: int, d: int, itemsize: int) -> dict[str, int]:
    """Bytes one thread block keeps in SRAM at once, by tile: `tile_bytes` for the forward;
    for the backward, q_i, k_j, v_j, do_i in `itemsize` and s_ij, dp_ij, lse_i, D_i, the dK_j, dV_j
    accumulators in fp32.

    Standard attention streams rows and keeps no tile worth counting, so it returns {}.
    """
    if algorithm == "naive":
        return {}
    tiles = tile_bytes(block_m, block_n, d, itemsize=itemsize)
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


def fitting_blocks(
    sram_bytes: int, d: int, itemsize: int = 2, *, algorithm: str = "fa2"
) -> tuple[int, int]:
    """(block_m, block_n): the largest powers of two in [16, 128] whose `sram_tiles` fit in
    sram_bytes, the outer loop's block maximised first. Raises SramCapacityError when not even
    16 x 16 tiles fit."""
    sizes = [b for b in (128, 64, 32, 16) if MIN_BLOCK <= b <= MAX_BLOCK]
    for outer in sizes:
        for inner in sizes:
            bm, bn = (inner, outer) if algorithm in _OUTER_N else (outer, inner)
            if sum(sram_tiles(algorithm, bm, bn, d, itemsize).values()) <= sram_bytes:
                return bm, bn
    need = sum(sram_tiles(algorithm, MIN_BLOCK, MIN_BLOCK, d, itemsize).values())
    raise SramCapacityError(
        f"fitting_blocks: even {MIN_BLOCK}x{MIN_BLOCK} tiles need {need:,} bytes of SRAM at "
        f"d={d}, itemsize={itemsize}, more than sram_bytes={sram_bytes:,}"
    )


@dataclass(frozen=True)
class TileChoice:
    """Blocks for one algorithm and SRAM budget, with the tiles they keep in SRAM."""

    block_m: int
    block_n: int
    rule: str  # "fit", "paper" or "given"
    tiles: dict[str, int]  # bytes per tile, for one thread block
    budget: int  # sram_bytes

    @property
    def used(self) -> int:
        return sum(self.tiles.values())

    @property
    def fits(self) -> bool:
        return self.used <= self.budget

    def explain(self) -> str:
        """One line: the blocks, the rule that chose them, and the SRAM they need of the budget."""
        why = {
            "fit": "largest powers of two that fit, the outer loop's block first",
            "paper": "the paper's B_c = ceil(M / 4d), B_r = min(B_c, d); B_c on the outer loop",
            "given": "as given",
        }[self.rule]
        if not self.tiles:
            return f"block_m={self.block_m}, block_n={self.block_n} ({why}); no tiles kept in SRAM"
        verdict = "fits" if self.fits else f"{self.used / self.budget - 1:.0%} over: does NOT fit"
        return (
            f"block_m={self.block_m}, block_n={self.block_n} ({why}): tiles need "
            f"{self.used / 1024:.1f} KiB of {self.budget / 1024:.1f} KiB, {verdict}"
        )


def tile_choice(
    sram_bytes: int,
    d: int,
    itemsize: int = 2,
    *,
    algorithm: str = "fa2",
    rule: str = "fit",
    block_m: int | None = None,
    block_n: int | None = None,
) -> TileChoice:
    """The blocks the traffic explorer uses, and whether their tiles fit `sram_bytes`.

    rule="fit" (default): `fitting_blocks` (16 x 16 if nothing fits, reported as not fitting);
    rule="paper": `block_sizes`, the large B_c for the outer loop's tensor (Q for the FA2 order and
    standard attention, K/V for the FA1 order and the backward). A block given explicitly
    overrides the rule for that side (rule "given" when both are).
    algorithm: "naive", "fa1", "fa2" or "backward" (which tiles one thread block keeps)."""
    if rule not in RULES:
        raise ValueError(f"tile_choice: rule must be one of {list(RULES)}, got {rule!r}")
    d = _positive(d, "d", "tile_choice")
    itemsize = _positive(itemsize, "itemsize", "tile_choice")
    sram_bytes = _positive(sram_bytes, "sram_bytes", "tile_choice")
    if rule == "paper":
        b_r, b_c = block_sizes(sram_bytes, d, itemsize)
        auto = (b_r, b_c) if algorithm in _OUTER_N else (b_c, b_r)
    else:
        try:
            auto = fitting_blocks(sram_bytes, d, itemsize, algorithm=algorithm)
        except SramCapacityError:
            auto = (MIN_BLOCK, MIN_BLOCK)
    bm = auto[0] if block_m is None else _positive(block_m, "block_m", "tile_choice")
    bn = auto[1] if block_n is None else _positive(block_n, "block_n", "tile_choice")
    if block_m is not None and block_n is not None:
        rule = "given"
    return TileChoice(bm, bn, rule, sram_tiles(algorithm, bm, bn, d, itemsize), sram_bytes)
