"""The tile problem shared by the NumPy FlashAttention forward (`flashedu.tiled`) and backward
(`flashedu.tiled_backward`): validated inputs, block sizes, and the scores of one tile.

`setup` validates q, k, v and the options once and settles the block sizes (explicit, or the
paper's rule from an SRAM size, `traffic.block_sizes`); the resulting `Problem` carries what the
tile loops need. `scores` computes one (block_m, block_n) tile of scaled scores with the ALiBi bias
and the mask, and the forward and the backward both call it, so they recompute exactly the same P.

Introduced in notebooks/03_tiled_forward.ipynb.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .dtypes import acc_dtype
from .masks import band, kv_blocks
from .traffic import DEFAULT_SRAM_BYTES
from .traffic.tiles import block_sizes
from .validation import (
    check_block,
    check_causal,
    check_qkv,
    check_slopes,
    check_window,
    resolve_scale,
)


@dataclass(frozen=True)
class Problem:
    """Everything the tile loops need, validated once. Arrays are grouped (B, H_kv, g, N, d),
    g = H // H_kv, so one K/V head broadcasts over the g query heads that share it (GQA) without
    copies."""

    B: int
    H: int
    H_kv: int
    N_q: int
    N_k: int
    d: int
    scale: float
    causal: bool
    window_size: tuple[int, int] | None
    slopes: np.ndarray | None  # (1, H_kv, g, 1, 1) ALiBi slopes in the accumulation dtype, or None
    block_m: int
    block_n: int
    dtype: np.dtype  # input dtype (storage in HBM)
    acc: np.dtype  # accumulation dtype
    d_v: int  # value head dim (V, O, dO, dV), d unless v has its own

    def hbm(self, rows: int, itemsize: int | None = None, d: int | None = None) -> int:
        """Bytes of `rows` rows of a (B, H, N, d) tensor (or of head dim `d`, e.g. d_v), over all
        (batch, head) programs."""
        return self.B * self.H * rows * (d or self.d) * (itemsize or self.dtype.itemsize)

    def stat(self, rows: int) -> int:
        """Bytes of `rows` entries of a (B, H, N) statistic (m, l, lse, D) in the accumulation
        dtype."""
        return self.B * self.H * rows * self.acc.itemsize

    def grouped(self, x: np.ndarray) -> np.ndarray:
        """(B, H, N, ...) -> (B, H_kv, g, N, ...), a view."""
        return x.reshape(self.B, self.H_kv, self.H // self.H_kv, *x.shape[2:])

    def kv_blocks(self, r0: int, r1: int) -> range:
        return kv_blocks(
            r0,
            r1,
            self.N_q,
            self.N_k,
            self.block_n,
            causal=self.causal,
            window_size=self.window_size,
        )


def setup(
    name,
    q,
    k,
    v,
    *,
    causal,
    softmax_scale,
    window_size,
    alibi_slopes,
    block_m,
    block_n,
    sram_bytes=None,
) -> Problem:
    """Validate the inputs of `forward` / `backward` and settle block sizes; raises
    ValueError / TypeError."""
    B, H, H_kv, N_q, N_k, d = check_qkv(q, k, v, name=name, kind="numpy", value_dim=True)
    scale = resolve_scale(softmax_scale, d, name=name)
    window = check_window(window_size, name=name)
    causal = check_causal(causal, name=name)
    slopes = check_slopes(alibi_slopes, H, name=name)
    acc = acc_dtype(q.dtype)
    if sram_bytes is not None and (
        not isinstance(sram_bytes, (int, np.integer)) or sram_bytes < q.dtype.itemsize
    ):
        raise ValueError(f"{name}: sram_bytes must be a positive int, got {sram_bytes!r}")
    rule_m, rule_n = block_sizes(int(sram_bytes or DEFAULT_SRAM_BYTES), d, q.dtype.itemsize)
    bm = check_block(rule_m if block_m is None else block_m, "block_m", name=name)
    bn = check_block(rule_n if block_n is None else block_n, "block_n", name=name)
    if slopes is not None:
        slopes = np.asarray(slopes, dtype=acc).reshape(1, H_kv, H // H_kv, 1, 1)
    return Problem(
        B,
        H,
        H_kv,
        N_q,
        N_k,
        d,
        scale,
        bool(causal),
        window,
        slopes,
        min(bm, N_q),
        min(bn, N_k),
        q.dtype,
        acc,
        v.shape[-1],
    )


def _tile_keep(p: Problem, r0: int, r1: int, c0: int, c1: int) -> np.ndarray | None:
    """(r1 - r0, c1 - c0) bool, True where query i may see key j; None when the whole tile is
    visible."""
    off, left, right = band(p.N_q, p.N_k, causal=p.causal, window_size=p.window_size)
    if (left < 0 or c0 >= r1 - 1 + off - left) and (right < 0 or c1 - 1 <= r0 + off + right):
        return None
    diag = np.arange(r0, r1)[:, None] + off  # key position aligned with each query row
    j = np.arange(c0, c1)[None, :]
    keep = np.ones((r1 - r0, c1 - c0), dtype=bool)
    if left >= 0:
        keep &= j >= diag - left
    if right >= 0:
        keep &= j <= diag + right
    return keep


def scores(p: Problem, qs_i, k_j, r0: int, r1: int, c0: int, c1: int) -> np.ndarray:
    """s_ij: scaled scores of one tile, ALiBi bias added, hidden entries -inf. qs_i is
    q_i * scale."""
    s_ij = qs_i @ np.swapaxes(
        k_j, -1, -2
    )  # (B, H_kv, g, bm, d) @ (B, H_kv, 1, d, bn) -> (.., bm, bn)
    if p.slopes is not None:
        dist = np.abs(
            np.arange(r0, r1)[:, None] + (p.N_k - p.N_q) - np.arange(c0, c1)[None, :]
        )  # (bm, bn)
        s_ij = s_ij - p.slopes * dist.astype(p.acc)
    keep = _tile_keep(p, r0, r1, c0, c1)
    return s_ij if keep is None else np.where(keep, s_ij, -np.inf)
