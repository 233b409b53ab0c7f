"""FlashAttention in NumPy: exact attention computed tile by tile, never materialising the N_q x N_k
scores.

The forward pass walks (block_m x block_n) tiles of the score matrix with the online softmax of
`flashedu.softmax`, in either loop order:

* order="fa2" (default; Dao 2023, arXiv:2307.08691, Algorithm 1): outer loop over query blocks. q_i,
  the accumulator o_i and the statistics m_i, l_i stay in SRAM while every K_j, V_j streams past; O
  and lse are written once.
* order="fa1" (Dao et al. 2022, arXiv:2205.14135, Algorithm 1): outer loop over K/V blocks. O, m and
  l live in HBM and every tile reads and rewrites its rows of them (O kept normalised, as in the
  paper).

The backward pass (`backward`, in `flashedu/tiled_backward.py`) recomputes P tile by tile from Q, K
and the saved lse.

Names follow the paper: block_m = B_r (rows of Q per tile), block_n = B_c (rows of K/V per tile).
Block sizes are explicit, or derived from an SRAM size by the paper's rule (`traffic.block_sizes`).
Tiles that a causal or sliding-window mask hides entirely are skipped whole: never loaded, never
computed.

Every HBM <-> SRAM transfer is reported to `ledger` (a `traffic.Ledger`), and
`traffic.flash_forward` / `traffic.flash_backward` give the same byte counts in closed form. A
ledger with `sram_bytes` refuses block sizes whose tiles do not fit. Each (batch, head) program is
counted separately: all B*H of them run at once here (NumPy broadcasting over the leading axes), as
they would in parallel on a GPU.

Honest limits: this is NumPy on a CPU; it shows the structure and the traffic, not GPU speed. A
"transfer" is a slice of a NumPy array that the ledger is told about; the model ignores caches (L2
on a real GPU absorbs many of the repeated K/V reads). Accumulation is float32 (float64 for float64
inputs); the FA1 order stores O in the input dtype between tiles, as a kernel writing to HBM would.

Introduced in notebooks/03_tiled_forward.ipynb; the backward in
notebooks/04_recompute_backward.ipynb; windows, ALiBi and GQA in notebooks/09_beyond.ipynb.
"""

from __future__ import annotations

import numpy as np

from . import softmax
from ._nonfinite import poison_hidden_values_np
from .masks import band, row_blocks
from .tiled_backward import backward
from .tiling import Problem, scores, setup
from .traffic.ledger import NULL_LEDGER, Ledger
from .traffic.tiles import tile_bytes
from .validation import check_order


def _heads(p: Problem, x: np.ndarray) -> np.ndarray:
    """A copy of a grouped (B, H_kv, g, rows) statistic as (B, H, rows), for the ledger's step
    record."""
    return x.reshape(p.B, p.H, -1).copy()


def forward_fa2(p: Problem, qs, k, v, ledger):
    """Outer loop over query blocks: q_i, o_i, m_i, l_i stay in SRAM; K_j, V_j stream past."""
    o = np.empty(qs.shape[:-1] + (p.d_v,), dtype=p.dtype)  # (B, H_kv, g, N_q, d_v) in HBM
    lse = np.empty(qs.shape[:-1], dtype=p.acc)  # (B, H_kv, g, N_q) in HBM
    cols = row_blocks(p.N_k, p.block_n)
    for i, (r0, r1) in enumerate(row_blocks(p.N_q, p.block_m)):
        qs_i = qs[..., r0:r1, :]  # (B, H_kv, g, bm, d)
        m_i = np.full(qs_i.shape[:-1], -np.inf, dtype=p.acc)  # -inf: nothing seen yet
        l_i = np.zeros(qs_i.shape[:-1], dtype=p.acc)
        o_i = np.zeros(qs_i.shape[:-1] + (p.d_v,), dtype=p.acc)
        visible = p.kv_blocks(r0, r1)
        for j, (c0, c1) in enumerate(cols):
            ledger.step(
                i=i,
                j=j,
                skipped=j not in visible,
                rows=(r0, r1),
                cols=(c0, c1),
                m=_heads(p, m_i),
                l=_heads(p, l_i),
            )
            if j not in visible:
                continue
            if j == visible[0]:
                ledger.read("Q", p.hbm(r1 - r0))  # HBM: q_i once; it stays in SRAM for the K/V loop
            ledger.read("K", p.hbm(c1 - c0))  # HBM: k_j, v_j for every visible tile
            ledger.read("V", p.hbm(c1 - c0, d=p.d_v))
            s_ij = scores(p, qs_i, k[..., c0:c1, :], r0, r1, c0, c1)
            m_i, l_i, p_ij, alpha = softmax.online_step(m_i, l_i, s_ij)
            o_i = (
                alpha[..., None] * o_i + p_ij @ v[..., c0:c1, :]
            )  # rescale: the row max moved; (bm, bn) @ (bn, d_v)
        o_i, lse[..., r0:r1] = softmax.finalize(m_i, l_i, o_i)
        o[..., r0:r1, :] = o_i
        ledger.write("O", p.hbm(r1 - r0, d=p.d_v))  # HBM: o_i and lse_i once
        ledger.write("lse", p.stat(r1 - r0))
    return o, lse


def forward_fa1(p: Problem, qs, k, v, ledger):
    """Outer loop over K/V blocks: k_j, v_j stay in SRAM; O, m, l make a round trip to HBM per
    tile."""
    o = np.zeros(qs.shape[:-1] + (p.d_v,), dtype=p.dtype)  # Alg. 1 line 2: O = 0, l = 0, m = -inf
    m = np.full(qs.shape[:-1], -np.inf, dtype=p.acc)
    l = np.zeros(qs.shape[:-1], dtype=p.acc)
    ledger.write("O", p.hbm(p.N_q, d=p.d_v))
    ledger.write("m", p.stat(p.N_q))
    ledger.write("l", p.stat(p.N_q))
    rows = row_blocks(p.N_q, p.block_m)
    visible = [p.kv_blocks(r0, r1) for r0, r1 in rows]
    for j, (c0, c1) in enumerate(row_blocks(p.N_k, p.block_n)):
        loaded = False
        for i, (r0, r1) in enumerate(rows):
            m_i, l_i = m[..., r0:r1], l[..., r0:r1]
            ledger.step(
                i=i,
                j=j,
                skipped=j not in visible[i],
                rows=(r0, r1),
                cols=(c0, c1),
                m=_heads(p, m_i),
                l=_heads(p, l_i),
            )
            if j not in visible[i]:
                continue
            if not loaded:
                ledger.read("K", p.hbm(c1 - c0))
                ledger.read("V", p.hbm(c1 - c0, d=p.d_v))  # HBM: k_j, v_j once
                loaded = True
            for t, n in (
                ("Q", p.hbm(r1 - r0)),
                ("O", p.hbm(r1 - r0, d=p.d_v)),
                ("m", p.stat(r1 - r0)),
                ("l", p.stat(r1 - r0)),
            ):
                ledger.read(t, n)  # HBM: q_i and the running o_i, m_i, l_i
            s_ij = scores(p, qs[..., r0:r1, :], k[..., c0:c1, :], r0, r1, c0, c1)
            m_new, l_new, p_ij, alpha = softmax.online_step(m_i, l_i, s_ij)
            o_i = (alpha * l_i)[..., None] * o[..., r0:r1, :] + p_ij @ v[
                ..., c0:c1, :
            ]  # un-normalise, rescale, add
            o[..., r0:r1, :] = (
                o_i / np.where(l_new > 0, l_new, 1)[..., None]
            )  # Alg. 1 keeps O normalised
            m[..., r0:r1], l[..., r0:r1] = m_new, l_new
            o_bytes = p.hbm(r1 - r0, d=p.d_v)
            for t, n in (("O", o_bytes), ("m", p.stat(r1 - r0)), ("l", p.stat(r1 - r0))):
                ledger.write(t, n)  # HBM: o_i, m_i, l_i back
    ledger.read("m", p.stat(p.N_q))
    ledger.read("l", p.stat(p.N_q))
    ledger.write("lse", p.stat(p.N_q))  # HBM: a last pass turns m, l into lse
    return o, softmax.lse_of(m, l)


def forward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size=None,
    alibi_slopes=None,
    block_m: int | None = None,
    block_n: int | None = None,
    sram_bytes: int | None = None,
    order: str = "fa2",
    ledger=NULL_LEDGER,
):
    """Exact attention by tiles.

    Args:
        q: (B, H, N_q, d); k: (B, H_kv, N_k, d); v: (B, H_kv, N_k, d_v), H % H_kv == 0. float16,
            float32 or float64.
        causal: query i sees key j iff j <= i + N_k - N_q (bottom-right aligned).
        softmax_scale: default 1 / sqrt(d).
        window_size: optional (left, right), -1 for an unbounded side (see `masks.visible`).
        alibi_slopes: optional (H,) slopes; bias -slope * |i + N_k - N_q - j| added to the scaled
            scores.
        block_m, block_n: tile sizes B_r, B_c (clipped to N_q, N_k). Each one not given comes from
            the paper's rule `traffic.block_sizes(sram_bytes, d, itemsize)`.
        sram_bytes: SRAM size M in bytes for the rule (default `traffic.DEFAULT_SRAM_BYTES`,
            100 KiB). When both block sizes are given too, their tiles must fit it (else
            `traffic.SramCapacityError`).
        order: "fa2" (outer loop over query blocks) or "fa1" (outer loop over K/V blocks).
        ledger: a `traffic.Ledger`; receives every HBM transfer, one `step` per tile (skipped ones
            too, with skipped=True), and `fit` of the tile set.
    Returns:
        o (B, H, N_q, d_v) in q's dtype (0 on fully masked rows), lse (B, H, N_q) float32 (float64
        for float64 input; -inf on fully masked rows).
    """
    p = setup(
        "tiled.forward",
        q,
        k,
        v,
        causal=causal,
        softmax_scale=softmax_scale,
        window_size=window_size,
        alibi_slopes=alibi_slopes,
        block_m=block_m,
        block_n=block_n,
        sram_bytes=sram_bytes,
    )
    check_order(order, name="tiled.forward")
    tiles = tile_bytes(
        p.block_m, p.block_n, p.d, itemsize=p.dtype.itemsize, acc_itemsize=p.acc.itemsize
    )
    if p.d_v != p.d:  # v_j and the accumulator o_i have the value head dim
        tiles.update(
            v_j=p.block_n * p.d_v * p.dtype.itemsize, o_i=p.block_m * p.d_v * p.acc.itemsize
        )
    if sram_bytes is not None and block_m is not None and block_n is not None:
        Ledger(sram_bytes=int(sram_bytes)).fit(**tiles)
    ledger.fit(**tiles)
    qs = p.grouped(q.astype(p.acc) * p.acc.type(p.scale))  # scale folded into q once
    k = k.astype(p.acc, copy=False)[:, :, None]  # (B, H_kv, 1, N_k, d)
    v = v.astype(p.acc, copy=False)[:, :, None]
    o, lse = (forward_fa2 if order == "fa2" else forward_fa1)(p, qs, k, v, ledger)
    o = o.reshape(p.B, p.H, p.N_q, p.d_v)
    # the skipped tiles' keys: a non-finite v there is NaN in every row, as in the reference
    _, left, right = band(p.N_q, p.N_k, causal=p.causal, window_size=p.window_size)
    return poison_hidden_values_np(o, v[:, :, 0], p.N_q, left, right), lse.reshape(p.B, p.H, p.N_q)


__all__ = ["forward", "backward", "setup", "scores", "Problem"]
