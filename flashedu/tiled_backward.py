"""The FlashAttention backward pass in NumPy: gradients by recomputation, never storing S or P.

Forward: S = scale Q K^T, P = softmax(S) row by row, O = P V. For a loss with gradient dO = dL/dO:

    dV = P^T dO      dP = dO V^T      dS = P * (dP - D)   with D = rowsum(dO * O) = rowsum(P * dP)
    dQ = scale dS K  dK = scale dS^T Q

The standard backward reads the N_q x N_k matrix P that its forward stored. Here the forward kept
only O and the log-sum-exp lse (O(N) memory), and P is rebuilt tile by tile as exp(S_ij - lse_i):
extra FLOPs (Q K^T again), far less memory and HBM traffic. D comes from dO and O in a cheap
preprocess, so no row of P has to be complete before dS can be formed.

Loop structure (Dao 2023, arXiv:2307.08691, Algorithm 2): outer loop over K/V blocks, so dK_j and
dV_j accumulate in SRAM and are written once; inner loop over query blocks, with dQ_i accumulated in
HBM in float32 by read-modify-write (an atomic add on a GPU, where the K/V blocks run in parallel).
The ledger records every transfer; `traffic.flash_backward` gives the same counts in closed form.

Re-exported as `tiled.backward`; shares validation, block sizes and tile scores with the forward
through `flashedu.tiling`.
Limits: as for `tiled.forward` (NumPy on a CPU; caches not modelled).

Introduced in notebooks/04_recompute_backward.ipynb.
"""

from __future__ import annotations

import numpy as np

from .masks import row_blocks
from .tiling import Problem, scores, setup
from .traffic.ledger import NULL_LEDGER
from .validation import check_backward


def _preprocess(p: Problem, do, o, lse, ledger):
    """D = rowsum(dO * O) (B, H_kv, g, N_q), and lse with -inf (fully masked rows) turned into +inf
    so that exp(S - lse) gives P = 0 there instead of NaN."""
    ledger.read("dO", p.hbm(p.N_q, d=p.d_v))
    ledger.read("O", p.hbm(p.N_q, d=p.d_v))  # HBM: read dO, O; write D
    D = np.sum(do * p.grouped(o).astype(p.acc), axis=-1)
    ledger.write("D", p.stat(p.N_q))
    lse = p.grouped(lse).astype(p.acc)
    return D, np.where(np.isneginf(lse), np.inf, lse)


def tile_grads(p: Problem, qs, k, v, do, lse, D, dq, dk_j, dv_j, r0, r1, c0, c1):
    """One tile's contribution: dV_j, dK_j (in SRAM) and dQ_i (in HBM) updated in place."""
    qs_i, do_i, k_j, v_j = qs[..., r0:r1, :], do[..., r0:r1, :], k[..., c0:c1, :], v[..., c0:c1, :]
    s_ij = scores(p, qs_i, k_j, r0, r1, c0, c1)  # recomputed: (B, H_kv, g, bm, bn)
    p_ij = np.exp(s_ij - lse[..., r0:r1, None])  # P rebuilt from the saved lse, never stored
    dv_j += np.swapaxes(p_ij, -1, -2) @ do_i  # o_i = sum_j p_ij v_j -> dv_j += p_ij^T do_i
    dp_ij = do_i @ np.swapaxes(v_j, -1, -2)  # (bm, d_v) @ (d_v, bn) -> (bm, bn)
    ds_ij = p_ij * (dp_ij - D[..., r0:r1, None])  # softmax backward, D_i = rowsum(dO_i * O_i)
    dq[..., r0:r1, :] += ds_ij @ k_j  # (bm, bn) @ (bn, d); times scale at the end
    dk_j += np.swapaxes(ds_ij, -1, -2) @ qs_i  # qs_i = scale q_i: dk_j += scale ds_ij^T q_i


def _fit(p: Problem, ledger) -> None:
    e, a = p.dtype.itemsize, p.acc.itemsize
    bm, bn, d, d_v = p.block_m, p.block_n, p.d, p.d_v
    ledger.fit(
        q_i=bm * d * e,
        do_i=bm * d_v * e,
        k_j=bn * d * e,
        v_j=bn * d_v * e,
        dk_j=bn * d * a,
        dv_j=bn * d_v * a,
        dq_i=bm * d * a,
        s_ij=bm * bn * a,
        dp_ij=bm * bn * a,
        lse_i=bm * a,
        D_i=bm * a,
    )


def _reduce_heads(p: Problem, g: np.ndarray, ledger, name: str) -> np.ndarray:
    """(B, H_kv, g, N_k, d) per-query-head gradients -> (B, H_kv, N_k, d), summed over each group
    (GQA); d is the gradient's own head dim (d_v for dV)."""
    if p.H == p.H_kv:
        return g[:, :, 0]
    d = g.shape[-1]
    ledger.read(name, p.hbm(p.N_k, d=d))  # HBM: one more pass sums the group
    out = g.astype(p.acc).sum(axis=2).astype(p.dtype)
    ledger.write(name, p.B * p.H_kv * p.N_k * d * p.dtype.itemsize)
    return out


def backward(
    do: np.ndarray,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    o: np.ndarray,
    lse: np.ndarray,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size=None,
    alibi_slopes=None,
    block_m: int | None = None,
    block_n: int | None = None,
    ledger=NULL_LEDGER,
):
    """Gradients of sum(o * do) with respect to q, k, v, recomputing P from q, k and lse.

    Args: as `tiled.forward`, plus do (B, H, N_q, d_v) and the forward's o (B, H, N_q, d_v) and
        lse (B, H, N_q). The mask, scale, ALiBi slopes and block-size rule must be those of the
        forward that produced lse.
    Returns:
        dq (B, H, N_q, d), dk (B, H_kv, N_k, d), dv (B, H_kv, N_k, d_v), in q's dtype. Fully
        masked rows contribute nothing (their dq row is 0), never NaN.
    """
    p = setup(
        "tiled.backward",
        q,
        k,
        v,
        causal=causal,
        softmax_scale=softmax_scale,
        window_size=window_size,
        alibi_slopes=alibi_slopes,
        block_m=block_m,
        block_n=block_n,
    )
    check_backward(do, o, lse, q, name="tiled.backward", kind="numpy", v=v)
    _fit(p, ledger)
    qs = p.grouped(q.astype(p.acc) * p.acc.type(p.scale))  # (B, H_kv, g, N_q, d)
    k = k.astype(p.acc, copy=False)[:, :, None]  # (B, H_kv, 1, N_k, d)
    v = v.astype(p.acc, copy=False)[:, :, None]
    do = p.grouped(do.astype(p.acc, copy=False))
    D, lse = _preprocess(p, do, o, lse, ledger)
    dq = np.zeros(qs.shape, dtype=p.acc)  # the dQ accumulator in HBM, zeroed
    ledger.write("dQ", p.hbm(p.N_q, p.acc.itemsize))
    dk = np.empty(qs.shape[:3] + (p.N_k, p.d), p.dtype)
    dv = np.empty(qs.shape[:3] + (p.N_k, p.d_v), p.dtype)
    rows = row_blocks(p.N_q, p.block_m)
    visible = [p.kv_blocks(r0, r1) for r0, r1 in rows]
    for j, (c0, c1) in enumerate(row_blocks(p.N_k, p.block_n)):
        dk_j = np.zeros(
            qs.shape[:3] + (c1 - c0, p.d), p.acc
        )  # dK_j, dV_j stay in SRAM for the whole Q loop
        dv_j, loaded = np.zeros(qs.shape[:3] + (c1 - c0, p.d_v), p.acc), False
        for i, (r0, r1) in enumerate(rows):
            ledger.step(i=i, j=j, skipped=j not in visible[i], rows=(r0, r1), cols=(c0, c1))
            if j not in visible[i]:
                continue
            if not loaded:
                ledger.read("K", p.hbm(c1 - c0))
                ledger.read("V", p.hbm(c1 - c0, d=p.d_v))  # HBM: k_j, v_j once
                loaded = True
            for t, n in (
                ("Q", p.hbm(r1 - r0)),
                ("dO", p.hbm(r1 - r0, d=p.d_v)),
                ("lse", p.stat(r1 - r0)),
                ("D", p.stat(r1 - r0)),
                ("dQ", p.hbm(r1 - r0, p.acc.itemsize)),
            ):
                ledger.read(t, n)  # HBM: q_i, do_i, lse_i, D_i and the dQ_i partial
            tile_grads(p, qs, k, v, do, lse, D, dq, dk_j, dv_j, r0, r1, c0, c1)
            ledger.write(
                "dQ", p.hbm(r1 - r0, p.acc.itemsize)
            )  # HBM: dQ_i += dS_ij K_j (read-modify-write)
        dk[..., c0:c1, :], dv[..., c0:c1, :] = dk_j, dv_j
        ledger.write("dK", p.hbm(c1 - c0))
        ledger.write("dV", p.hbm(c1 - c0, d=p.d_v))  # HBM: dk_j, dv_j once
    ledger.read("dQ", p.hbm(p.N_q, p.acc.itemsize))  # HBM: cast the accumulator to the input dtype
    dq = (dq * p.acc.type(p.scale)).astype(p.dtype)
    ledger.write("dQ", p.hbm(p.N_q))
    return (
        dq.reshape(p.B, p.H, p.N_q, p.d),
        _reduce_heads(p, dk, ledger, "dK"),
        _reduce_heads(p, dv, ledger, "dV"),
    )
