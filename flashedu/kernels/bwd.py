"""FlashAttention-2 backward in Triton: a preprocess, a dK/dV pass and a dQ pass, no atomics.

The forward kept only o and the log-sum-exp; P is recomputed tile by tile from q, k and lse
(Dao et al. 2022, Sec. 3.1; Dao 2023, Alg. 2). With D_i = rowsum(dO_i * O_i):

    P_ij  = exp(mod(scale * q_i . k_j) - lse_i)          dV_j = sum_i P_ij dO_i
    dP_ij = dO_i . v_j                                   dK_j = scale sum_i dS_ij q_i
    dS_ij = P_ij (dP_ij - D_i) mod'(scale * q_i . k_j)   dQ_i = scale sum_j dS_ij k_j

where mod is the score mod (`flashedu.kernels.score_mods`; ALiBi is one, with mod' = 1) or nothing.
`attn_bwd_dkdv` owns BLOCK_N keys and streams the query blocks that see them (for GQA, over every
query head of the group, so dK and dV are summed without atomics); `attn_bwd_dq` owns BLOCK_M
queries and streams keys. Each recomputes S and dP, so the pair does 7 block matmuls where a single
pass with atomic dQ updates does 5: the price of a deterministic result with no read-modify-write
traffic on dQ.

Introduced in notebooks/07_triton_backward.ipynb. Supports what `kernels.forward` supports
(any head dims d and d_v up to 256, packed sequences through `flashedu.kernels.varlen`); a score mod
needs its gradient (`ScoreMod.grad`, or `additive=True`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..validation import check_backward
from .common import block_range, visible
from .launch import (
    MASK_KEY,
    Plan,
    autotuned,
    launch,
    launch_config,
    n_key,
    out_dtype,
    plan,
    rows_contiguous,
    separate_dkdv,
    strides,
)
from .score_mods import identity
from .tiles import load_tile, pad_dim, store_tile


@triton.jit(do_not_specialize=["N_q", "H"])
def attn_bwd_preprocess(
    O, DO, DELTA, stride_ob, stride_oh, stride_om, stride_db, stride_dh, stride_dm, H, N_q,
    V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """D_i = rowsum(dO_i * O_i) in fp32 (equals rowsum(P_ij dP_ij)). Grid (cdiv(N_q, BLOCK_M),
    B * H)."""
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_DV)
    O += b.to(tl.int64) * stride_ob + h * stride_oh
    DO += b.to(tl.int64) * stride_db + h * stride_dh
    # HBM: read BLOCK_M * d_v of O and of dO
    o = load_tile(O + rows[:, None] * stride_om + dims[None, :], rows, N_q, dims, V_DIM, BLOCK_DV,
                  True).to(tl.float32)  # fmt: skip
    do = load_tile(DO + rows[:, None] * stride_dm + dims[None, :], rows, N_q, dims, V_DIM,
                   BLOCK_DV, True).to(tl.float32)  # fmt: skip
    tl.store(DELTA + bh.to(tl.int64) * N_q + rows, tl.sum(o * do, 1), mask=rows < N_q)  # HBM: write


@triton.jit
def _visible_t(
    rows, cols, N_q, offset, LEFT, RIGHT, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr
):
    """`visible` transposed, (len(cols), len(rows)): query row exists and key col lies in its
    window."""
    diag = rows[None, :] + offset
    keep = rows[None, :] < N_q
    if HAS_LEFT:
        keep = keep & (cols[:, None] >= diag - LEFT)
    if HAS_RIGHT:
        keep = keep & (cols[:, None] <= diag + RIGHT)
    return keep


@triton.jit
def dkdv_inner(
    dk, dv, dk2, dv2, k, v, k2, v2, Q, DO, LSE, DELTA, stride_qm, stride_dm, start, end, cols, b,
    h, ARGS, sm_scale, N_q, N_k, offset, LEFT, RIGHT,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SCORE_MOD: tl.constexpr,
    HAS_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr, HAS_GRAD: tl.constexpr, MASK: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_D2: tl.constexpr, BLOCK_DV2: tl.constexpr, PARTS: tl.constexpr,
):  # fmt: skip
    """Stream query blocks start..end past the key tile. k2, v2, dk2, dv2: the head dims' second
    chunks (`tiles.chunk_dims`) when BLOCK_D2 / BLOCK_DV2 > 0, else unused. PARTS: which
    gradients to accumulate, 1 dV, 2 dK, 3 both."""
    dims = tl.arange(0, BLOCK_D)
    dims_v = tl.arange(0, BLOCK_DV)
    for start_m in tl.range(start, end, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        q_ptrs = Q + rows[:, None] * stride_qm + dims[None, :]
        do_ptrs = DO + rows[:, None] * stride_dm + dims_v[None, :]
        # HBM: read BLOCK_M * d of Q, BLOCK_M * d_v of dO, BLOCK_M of lse and D
        q = load_tile(q_ptrs, rows, N_q, dims, HEAD_DIM, BLOCK_D, MASK)
        if MASK:
            lse2 = tl.load(LSE + rows, mask=rows < N_q, other=0.0) * 1.4426950408889634
        else:
            lse2 = tl.load(LSE + rows) * 1.4426950408889634
        if HAS_MOD:  # a row the mod hid entirely (lse = -inf) gets P = 0, not NaN
            lse2 = tl.where(lse2 == -float("inf"), float("inf"), lse2)
        if UPCAST:
            q = q.to(tl.float32)
        qk_t = tl.dot(k, tl.trans(q), input_precision=PRECISION)  # (BLOCK_N, BLOCK_M) = S^T
        q2 = q  # one chunk: an unused stand-in
        if BLOCK_D2 > 0:  # the second chunk of q . k, into the same scores
            dims2 = BLOCK_D + tl.arange(0, BLOCK_D2)
            q2 = load_tile(Q + rows[:, None] * stride_qm + dims2[None, :], rows, N_q, dims2,
                           HEAD_DIM, BLOCK_D + BLOCK_D2, MASK)  # fmt: skip
            if UPCAST:
                q2 = q2.to(tl.float32)
            qk_t = tl.dot(k2, tl.trans(q2), qk_t, input_precision=PRECISION)
        if HAS_MOD:
            s_nat = qk_t * sm_scale
            s_t = SCORE_MOD(s_nat, b, h, rows[None, :] + offset, cols[:, None], ARGS)
            s_t = s_t * 1.4426950408889634
        else:
            s_t = qk_t * (sm_scale * 1.4426950408889634)  # log2 units
        p_t = tl.math.exp2(s_t - lse2[None, :])  # P^T recomputed from lse
        if MASK:
            keep = _visible_t(rows, cols, N_q, offset, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT)
            p_t = tl.where(keep, p_t, 0.0)
        do = load_tile(do_ptrs, rows, N_q, dims_v, V_DIM, BLOCK_DV, MASK)
        if PARTS & 2:
            if MASK:
                delta = tl.load(DELTA + rows, mask=rows < N_q, other=0.0)
            else:
                delta = tl.load(DELTA + rows)
        if UPCAST:
            do = do.to(tl.float32)
        # forward: o_i = sum_j p_ij v_j  ->  backward: dv_j += p_ij * do_i
        if PARTS & 1:
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)  # (BLOCK_N, d_v)
        if PARTS & 2:
            dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # (BLOCK_N, BLOCK_M) = dP^T
        if BLOCK_DV2 > 0:  # the value's second chunk: its own dV, and its share of dP
            dims_v2 = BLOCK_DV + tl.arange(0, BLOCK_DV2)
            do2 = load_tile(DO + rows[:, None] * stride_dm + dims_v2[None, :], rows, N_q, dims_v2,
                            V_DIM, BLOCK_DV + BLOCK_DV2, MASK)  # fmt: skip
            if UPCAST:
                do2 = do2.to(tl.float32)
            if PARTS & 1:
                dv2 = tl.dot(p_t.to(do2.dtype), do2, dv2, input_precision=PRECISION)
            if PARTS & 2:
                dp_t = tl.dot(v2, tl.trans(do2), dp_t, input_precision=PRECISION)
        if PARTS & 2:
            ds_t = p_t * (dp_t - delta[None, :])  # softmax Jacobian, row by row
            if HAS_GRAD:  # chain rule through the score mod
                ds_t = ds_t * SCORE_GRAD(s_nat, b, h, rows[None, :] + offset, cols[:, None], ARGS)
            # (BLOCK_N, d), scaled by sm_scale at the store
            dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PRECISION)
            if BLOCK_D2 > 0:
                dk2 = tl.dot(ds_t.to(q2.dtype), q2, dk2, input_precision=PRECISION)
    return dk, dv, dk2, dv2


@triton.jit(do_not_specialize=["N_q", "N_k", "LEFT", "RIGHT", "H", "GROUP", "N_KEY", "stride_lb",
                               "stride_lh", "stride_ab", "stride_ah"])  # fmt: skip
def attn_bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV, MOD_ARGS, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh,
    stride_vn, stride_db, stride_dh, stride_dm, stride_dkb, stride_dkh, stride_dkn, stride_dvb,
    stride_dvh, stride_dvn, stride_lb, stride_lh, stride_ab, stride_ah,
    sm_scale, H, GROUP, N_q, N_k, LEFT, RIGHT, N_KEY,
    HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SCORE_MOD: tl.constexpr,
    HAS_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr, HAS_GRAD: tl.constexpr,
    VARLEN: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D2: tl.constexpr = 0, BLOCK_DV2: tl.constexpr = 0,
    PARTS: tl.constexpr = 3,
):  # fmt: skip
    """One program: BLOCK_N keys of one (batch, K/V head). Grid (cdiv(N_k, BLOCK_N), B * H_kv).
    VARLEN: as in `_attn_fwd`, batch b is packed sequence b. BLOCK_D2, BLOCK_DV2 > 0: the head
    dims in two chunks each (`tiles.chunk_dims`). PARTS: 3 computes dK and dV; 1 dV alone and 2
    dK alone (`launch.SEPARATE_DKDV_DIMS`), each with one accumulator."""
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    H_kv = H // GROUP
    b = bh // H_kv
    h_kv = bh % H_kv
    q_start = 0  # first row and key of the sequence (packed sequences only)
    k_start = 0
    if VARLEN:
        q_start = tl.load(CU_Q + b).to(tl.int64)
        k_start = tl.load(CU_K + b).to(tl.int64)
        N_q = (tl.load(CU_Q + b + 1) - q_start).to(tl.int32)
        N_k = (tl.load(CU_K + b + 1) - k_start).to(tl.int32)
        if pid_n * BLOCK_N >= N_k:
            return
    K += b.to(tl.int64) * stride_kb + h_kv.to(tl.int64) * stride_kh + k_start * stride_kn
    V += b.to(tl.int64) * stride_vb + h_kv.to(tl.int64) * stride_vh + k_start * stride_vn
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    dims_v = tl.arange(0, BLOCK_DV)
    offset = N_k - N_q
    # k_j and v_j stay in SRAM while every query block that sees them streams past.
    # HBM: read BLOCK_N * (d + d_v)
    k = load_tile(K + cols[:, None] * stride_kn + dims[None, :], cols, N_k, dims, HEAD_DIM,
                  BLOCK_D, True)  # fmt: skip
    v = load_tile(V + cols[:, None] * stride_vn + dims_v[None, :], cols, N_k, dims_v, V_DIM,
                  BLOCK_DV, True)  # fmt: skip
    if UPCAST:
        k, v = k.to(tl.float32), v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    k2, dk2, v2, dv2 = k, dk, v, dv  # one chunk: unused stand-ins
    if BLOCK_D2 > 0:  # second chunks of k and v (columns BLOCK_D.., masked past d) and of dK, dV
        dims2 = BLOCK_D + tl.arange(0, BLOCK_D2)
        k2 = load_tile(K + cols[:, None] * stride_kn + dims2[None, :], cols, N_k, dims2, HEAD_DIM,
                       BLOCK_D + BLOCK_D2, True)  # fmt: skip
        if UPCAST:
            k2 = k2.to(tl.float32)
        dk2 = tl.zeros([BLOCK_N, BLOCK_D2], dtype=tl.float32)
    if BLOCK_DV2 > 0:
        dims_v2 = BLOCK_DV + tl.arange(0, BLOCK_DV2)
        v2 = load_tile(V + cols[:, None] * stride_vn + dims_v2[None, :], cols, N_k, dims_v2, V_DIM,
                       BLOCK_DV + BLOCK_DV2, True)  # fmt: skip
        if UPCAST:
            v2 = v2.to(tl.float32)
        dv2 = tl.zeros([BLOCK_N, BLOCK_DV2], dtype=tl.float32)
    last = tl.minimum(pid_n * BLOCK_N + BLOCK_N, N_k) - 1
    # Queries seeing key j: j - offset - RIGHT <= i <= j - offset + LEFT (the forward's range,
    # mirrored).
    lo, full_lo, full_hi, hi = block_range(
        pid_n * BLOCK_N, last, N_q, -offset, RIGHT, LEFT, HAS_RIGHT, HAS_LEFT, BLOCK_M
    )
    for g in range(GROUP):  # GQA: the query heads sharing this K/V head add into one dK, dV
        h = h_kv * GROUP + g
        Qh = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + q_start * stride_qm
        DOh = DO + b.to(tl.int64) * stride_db + h.to(tl.int64) * stride_dh + q_start * stride_dm
        row0 = b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + q_start  # lse and D
        LSEh = LSE + row0
        DELTAh = DELTA + row0
        ARGS = MOD_ARGS + b * stride_ab + h * stride_ah
        if HAS_RIGHT:  # queries on the causal diagonal (or the window's right edge)
            dk, dv, dk2, dv2 = dkdv_inner(
                dk, dv, dk2, dv2, k, v, k2, v2, Qh, DOh, LSEh, DELTAh, stride_qm, stride_dm, lo,
                full_lo, cols, b, h, ARGS, sm_scale, N_q, N_k, offset, LEFT, RIGHT, HAS_LEFT,
                HAS_RIGHT, SCORE_MOD, HAS_MOD, SCORE_GRAD, HAS_GRAD, True, UPCAST, PRECISION,
                BLOCK_M, HEAD_DIM, V_DIM, BLOCK_D, BLOCK_DV, BLOCK_D2, BLOCK_DV2, PARTS,
            )  # fmt: skip
        dk, dv, dk2, dv2 = dkdv_inner(
            dk, dv, dk2, dv2, k, v, k2, v2, Qh, DOh, LSEh, DELTAh, stride_qm, stride_dm, full_lo,
            full_hi, cols, b, h, ARGS, sm_scale, N_q, N_k, offset, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT,
            SCORE_MOD, HAS_MOD, SCORE_GRAD, HAS_GRAD, False, UPCAST, PRECISION, BLOCK_M, HEAD_DIM,
            V_DIM, BLOCK_D, BLOCK_DV, BLOCK_D2, BLOCK_DV2, PARTS,
        )  # fmt: skip
        dk, dv, dk2, dv2 = dkdv_inner(
            dk, dv, dk2, dv2, k, v, k2, v2, Qh, DOh, LSEh, DELTAh, stride_qm, stride_dm, full_hi,
            hi, cols, b, h, ARGS, sm_scale, N_q, N_k, offset, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT,
            SCORE_MOD, HAS_MOD, SCORE_GRAD, HAS_GRAD, True, UPCAST, PRECISION, BLOCK_M, HEAD_DIM,
            V_DIM, BLOCK_D, BLOCK_DV, BLOCK_D2, BLOCK_DV2, PARTS,
        )  # fmt: skip
    DK += b.to(tl.int64) * stride_dkb + h_kv.to(tl.int64) * stride_dkh + k_start * stride_dkn
    DV += b.to(tl.int64) * stride_dvb + h_kv.to(tl.int64) * stride_dvh + k_start * stride_dvn
    # HBM: write BLOCK_N * (d + d_v)
    if PARTS & 2:
        store_tile(DK + cols[:, None] * stride_dkn + dims[None, :], (dk * sm_scale).to(
            DK.dtype.element_ty), cols, N_k, dims, HEAD_DIM, BLOCK_D)  # fmt: skip
    if PARTS & 1:
        store_tile(DV + cols[:, None] * stride_dvn + dims_v[None, :], dv.to(DV.dtype.element_ty),
                   cols, N_k, dims_v, V_DIM, BLOCK_DV)  # fmt: skip
    if BLOCK_D2 > 0 and PARTS & 2:
        store_tile(DK + cols[:, None] * stride_dkn + dims2[None, :], (dk2 * sm_scale).to(
            DK.dtype.element_ty), cols, N_k, dims2, HEAD_DIM, BLOCK_D + BLOCK_D2)  # fmt: skip
    if BLOCK_DV2 > 0 and PARTS & 1:
        store_tile(DV + cols[:, None] * stride_dvn + dims_v2[None, :], dv2.to(
            DV.dtype.element_ty), cols, N_k, dims_v2, V_DIM, BLOCK_DV + BLOCK_DV2)  # fmt: skip


@triton.jit
def dq_inner(
    dq, dq2, q, q2, do, do2, lse2, delta, K, V, stride_kn, stride_vn, start, end, rows, b, h, ARGS,
    sm_scale, N_k, offset, LEFT, RIGHT,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SCORE_MOD: tl.constexpr,
    HAS_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr, HAS_GRAD: tl.constexpr, MASK: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_D2: tl.constexpr, BLOCK_DV2: tl.constexpr,
):  # fmt: skip
    """Stream key blocks start..end past the query tile. q2, do2, dq2: the head dims' second
    chunks (`tiles.chunk_dims`) when BLOCK_D2 / BLOCK_DV2 > 0, else unused."""
    dims = tl.arange(0, BLOCK_D)
    dims_v = tl.arange(0, BLOCK_DV)
    for start_n in tl.range(start, end, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        # HBM: read BLOCK_N * d of K and BLOCK_N * d_v of V
        k = load_tile(K + cols[:, None] * stride_kn + dims[None, :], cols, N_k, dims, HEAD_DIM,
                      BLOCK_D, MASK)  # fmt: skip
        v = load_tile(V + cols[:, None] * stride_vn + dims_v[None, :], cols, N_k, dims_v, V_DIM,
                      BLOCK_DV, MASK)  # fmt: skip
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (BLOCK_M, BLOCK_N)
        k2 = k  # one chunk: an unused stand-in
        if BLOCK_D2 > 0:  # the second chunk of q . k, into the same scores
            dims2 = BLOCK_D + tl.arange(0, BLOCK_D2)
            k2 = load_tile(K + cols[:, None] * stride_kn + dims2[None, :], cols, N_k, dims2,
                           HEAD_DIM, BLOCK_D + BLOCK_D2, MASK)  # fmt: skip
            if UPCAST:
                k2 = k2.to(tl.float32)
            qk = tl.dot(q2, tl.trans(k2), qk, input_precision=PRECISION)
        if HAS_MOD:
            s_nat = qk * sm_scale
            s = SCORE_MOD(s_nat, b, h, rows[:, None] + offset, cols[None, :], ARGS)
            s = s * 1.4426950408889634
        else:
            s = qk * (sm_scale * 1.4426950408889634)  # log2 units
        p = tl.math.exp2(s - lse2[:, None])  # P recomputed from lse
        if MASK:
            keep = visible(rows, cols, N_k, offset, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT)
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # (BLOCK_M, BLOCK_N)
        if BLOCK_DV2 > 0:  # the value's second chunk's share of dP
            dims_v2 = BLOCK_DV + tl.arange(0, BLOCK_DV2)
            v2 = load_tile(V + cols[:, None] * stride_vn + dims_v2[None, :], cols, N_k, dims_v2,
                           V_DIM, BLOCK_DV + BLOCK_DV2, MASK)  # fmt: skip
            if UPCAST:
                v2 = v2.to(tl.float32)
            dp = tl.dot(do2, tl.trans(v2), dp, input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        if HAS_GRAD:  # chain rule through the score mod
            ds = ds * SCORE_GRAD(s_nat, b, h, rows[:, None] + offset, cols[None, :], ARGS)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)  # (BLOCK_M, d), scaled later
        if BLOCK_D2 > 0:
            dq2 = tl.dot(ds.to(k2.dtype), k2, dq2, input_precision=PRECISION)
    return dq, dq2


@triton.jit(do_not_specialize=["N_q", "N_k", "LEFT", "RIGHT", "H", "GROUP", "N_KEY", "stride_lb",
                               "stride_lh", "stride_ab", "stride_ah"])  # fmt: skip
def attn_bwd_dq(
    Q, K, V, DO, LSE, DELTA, DQ, MOD_ARGS, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh,
    stride_vn, stride_db, stride_dh, stride_dm, stride_dqb, stride_dqh, stride_dqm, stride_lb,
    stride_lh, stride_ab, stride_ah,
    sm_scale, H, GROUP, N_q, N_k, LEFT, RIGHT, N_KEY,
    HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SCORE_MOD: tl.constexpr,
    HAS_MOD: tl.constexpr, SCORE_GRAD: tl.constexpr, HAS_GRAD: tl.constexpr,
    VARLEN: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D2: tl.constexpr = 0, BLOCK_DV2: tl.constexpr = 0,
):  # fmt: skip
    """One program: BLOCK_M query rows of one (batch, head). Grid (cdiv(N_q, BLOCK_M), B * H).
    BLOCK_D2, BLOCK_DV2 > 0: the head dims in two chunks each (`tiles.chunk_dims`)."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    q_start = 0  # first row and key of the sequence (packed sequences only)
    k_start = 0
    if VARLEN:
        q_start = tl.load(CU_Q + b).to(tl.int64)
        k_start = tl.load(CU_K + b).to(tl.int64)
        N_q = (tl.load(CU_Q + b + 1) - q_start).to(tl.int32)
        N_k = (tl.load(CU_K + b + 1) - k_start).to(tl.int32)
        if pid_m * BLOCK_M >= N_q:
            return
    Q += b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + q_start * stride_qm
    DO += b.to(tl.int64) * stride_db + h.to(tl.int64) * stride_dh + q_start * stride_dm
    row0 = b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + q_start  # lse and D
    K += b.to(tl.int64) * stride_kb + (h // GROUP).to(tl.int64) * stride_kh + k_start * stride_kn
    V += b.to(tl.int64) * stride_vb + (h // GROUP).to(tl.int64) * stride_vh + k_start * stride_vn
    ARGS = MOD_ARGS + b * stride_ab + h * stride_ah
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    dims_v = tl.arange(0, BLOCK_DV)
    offset = N_k - N_q
    row_mask = rows < N_q
    # q_i, dO_i, lse_i and D_i stay on chip for the whole K/V loop.
    # HBM: read BLOCK_M * (d + d_v + 2)
    q = load_tile(Q + rows[:, None] * stride_qm + dims[None, :], rows, N_q, dims, HEAD_DIM,
                  BLOCK_D, True)  # fmt: skip
    do = load_tile(DO + rows[:, None] * stride_dm + dims_v[None, :], rows, N_q, dims_v, V_DIM,
                   BLOCK_DV, True)  # fmt: skip
    lse2 = tl.load(LSE + row0 + rows, mask=row_mask, other=0.0) * 1.4426950408889634
    if HAS_MOD:  # a row the mod hid entirely (lse = -inf) gets P = 0, not NaN
        lse2 = tl.where(lse2 == -float("inf"), float("inf"), lse2)
    delta = tl.load(DELTA + row0 + rows, mask=row_mask, other=0.0)
    if UPCAST:
        q, do = q.to(tl.float32), do.to(tl.float32)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    q2, dq2, do2 = q, dq, do  # one chunk: unused stand-ins
    if BLOCK_D2 > 0:  # second chunks of q (columns BLOCK_D.., masked past d) and of dQ
        dims2 = BLOCK_D + tl.arange(0, BLOCK_D2)
        q2 = load_tile(Q + rows[:, None] * stride_qm + dims2[None, :], rows, N_q, dims2, HEAD_DIM,
                       BLOCK_D + BLOCK_D2, True)  # fmt: skip
        if UPCAST:
            q2 = q2.to(tl.float32)
        dq2 = tl.zeros([BLOCK_M, BLOCK_D2], dtype=tl.float32)
    if BLOCK_DV2 > 0:
        dims_v2 = BLOCK_DV + tl.arange(0, BLOCK_DV2)
        do2 = load_tile(DO + rows[:, None] * stride_dm + dims_v2[None, :], rows, N_q, dims_v2,
                        V_DIM, BLOCK_DV + BLOCK_DV2, True)  # fmt: skip
        if UPCAST:
            do2 = do2.to(tl.float32)
    last = tl.minimum(pid_m * BLOCK_M + BLOCK_M, N_q) - 1
    lo, full_lo, full_hi, hi = block_range(
        pid_m * BLOCK_M, last, N_k, offset, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT, BLOCK_N
    )
    if HAS_LEFT:
        dq, dq2 = dq_inner(
            dq, dq2, q, q2, do, do2, lse2, delta, K, V, stride_kn, stride_vn, lo, full_lo, rows, b,
            h, ARGS, sm_scale, N_k, offset, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT, SCORE_MOD, HAS_MOD,
            SCORE_GRAD, HAS_GRAD, True, UPCAST, PRECISION, BLOCK_N, HEAD_DIM, V_DIM, BLOCK_D,
            BLOCK_DV, BLOCK_D2, BLOCK_DV2,
        )  # fmt: skip
    dq, dq2 = dq_inner(
        dq, dq2, q, q2, do, do2, lse2, delta, K, V, stride_kn, stride_vn, full_lo, full_hi, rows, b,
        h, ARGS, sm_scale, N_k, offset, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT, SCORE_MOD, HAS_MOD,
        SCORE_GRAD, HAS_GRAD, False, UPCAST, PRECISION, BLOCK_N, HEAD_DIM, V_DIM, BLOCK_D, BLOCK_DV,
        BLOCK_D2, BLOCK_DV2,
    )  # fmt: skip
    dq, dq2 = dq_inner(
        dq, dq2, q, q2, do, do2, lse2, delta, K, V, stride_kn, stride_vn, full_hi, hi, rows, b, h,
        ARGS, sm_scale, N_k, offset, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT, SCORE_MOD, HAS_MOD,
        SCORE_GRAD, HAS_GRAD, True, UPCAST, PRECISION, BLOCK_N, HEAD_DIM, V_DIM, BLOCK_D, BLOCK_DV,
        BLOCK_D2, BLOCK_DV2,
    )  # fmt: skip
    DQ += b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh + q_start * stride_dqm
    # HBM: write BLOCK_M * d
    store_tile(DQ + rows[:, None] * stride_dqm + dims[None, :], (dq * sm_scale).to(
        DQ.dtype.element_ty), rows, N_q, dims, HEAD_DIM, BLOCK_D)  # fmt: skip
    if BLOCK_D2 > 0:
        store_tile(DQ + rows[:, None] * stride_dqm + dims2[None, :], (dq2 * sm_scale).to(
            DQ.dtype.element_ty), rows, N_q, dims2, HEAD_DIM, BLOCK_D + BLOCK_D2)  # fmt: skip


def dkdv_table(d, wide):
    """(BLOCK_M, BLOCK_N, warps, stages) for the dK/dV kernel (BLOCK_N keys per program, BLOCK_M
    queries a step) at tile width d; as `fwd.fwd_table`, the first entry runs untuned
    and the GPU check checks every entry."""
    if wide:
        return [(16, 64, 8, 1)] if d <= 128 else [(16, 16, 4, 1)]
    if d == 48:  # 48 = 32 + 16 in two chunks (as below), spill-free first
        return [(32, 64, 4, 2), (32, 64, 8, 2), (64, 64, 4, 3)]
    if d <= 64:
        return [(64, 64, 4, 3), (32, 64, 4, 2), (64, 128, 8, 2)]
    if d == 128:
        return [(32, 64, 4, 2), (64, 128, 8, 2), (32, 128, 8, 2)]
    # two-chunk widths, as in `fwd.fwd_table`: tiles that fit shared memory on sm_90a, fastest first
    # by the H200 sweep (h200_headdims.json, non-causal + causal: 3.44 ms at d = 96 against 8.98
    # for (32, 64, 8, 2); 12.46 ms at d = 192 against 17.84 for (16, 64, 8, 3))
    if d < 128:
        return [(32, 64, 4, 2), (32, 128, 8, 2), (32, 64, 8, 2)]
    if d <= 192:
        return [(32, 64, 8, 2), (32, 64, 8, 1), (16, 64, 8, 3), (16, 64, 8, 2)]
    # d 129-256 padded: the fastest of six tiles on the H200 (GPU_NOTES.md, "Gluon backward",
    # run 4), though it spills (136 bytes at d = 192); every tile tried spills at this width
    return [(32, 64, 8, 2)]


def dq_table(d, wide):
    """(BLOCK_M, BLOCK_N, warps, stages) for the dQ kernel (BLOCK_M queries per program, BLOCK_N
    keys a step) at tile width d; as `fwd.fwd_table`, the first entry runs untuned
    and the GPU check checks every entry."""
    if wide:
        return [(32, 16, 4, 2)]
    if d <= 64:
        return [(128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3)]
    if d == 128:
        return [(128, 64, 8, 3), (64, 32, 4, 3), (128, 64, 8, 2)]
    # two-chunk widths, as in `fwd.fwd_table`: tiles that fit shared memory on sm_90a, fastest first
    # by the H200 sweep (h200_headdims.json, non-causal + causal: 1.71 ms at d = 80 against 1.87
    # for (128, 64, 8, 3); 3.55 ms at d = 192 against 4.67 for (128, 32, 8, 2))
    if d < 128:
        return [(64, 32, 4, 3), (128, 64, 8, 3), (128, 64, 8, 2)]
    if d <= 192:
        return [(128, 64, 8, 2), (128, 32, 8, 3), (128, 32, 8, 2)]
    # d 129-256 padded: run 4's fastest tile (GPU_NOTES.md, "Gluon backward": 3.39 ms at d = 192
    # against 9.04 for the former (32, 32, 4, 2)) with three stages, measured faster at d = 256
    # (h200_headdims.json: 2.91 / 1.65 ms non-causal / causal against 3.86 / 2.07 with two)
    return [(128, 32, 8, 3), (128, 32, 8, 2)]


def dkdv_parts_table(d, wide):
    """(BLOCK_M, BLOCK_N, warps, stages) for the dK/dV kernel run as two launches, dV alone then
    dK alone (`launch.SEPARATE_DKDV_DIMS`), both with the same config; `dkdv_table`'s entries up
    to width 128. Above it 128 keys a program, which the fused kernel cannot hold: at
    (32, 128, 8, 2) sm_90a compiles of d = 192 in two chunks spill nothing but the causal dK
    launch (116 B), d = 256 padded 0-232 B, against 136-280 B for the fused (32, 64, 8, 2)
    (notebooks/results/sm90_compile_headdims.json). Timed on the H200 (h200_headdims.json,
    non-causal + causal): 8.50 ms at d = 192 in two chunks and 10.47 at d = 256 padded, against
    9.35 and 11.45 for (64, 128, 8, 1)."""
    if wide or d <= 128:
        return dkdv_table(d, wide)
    return [(32, 128, 8, 2), (32, 64, 8, 2), (64, 128, 8, 1)]


_attn_bwd_dkdv_tuned = autotuned(attn_bwd_dkdv, dkdv_table, MASK_KEY)
_attn_bwd_dkdv_parts_tuned = autotuned(attn_bwd_dkdv, dkdv_parts_table, MASK_KEY + ["PARTS"])
_attn_bwd_dq_tuned = autotuned(attn_bwd_dq, dq_table, MASK_KEY)
# The autotuned kernels by pass, for the GPU check (as `fwd.AUTOTUNED`).
AUTOTUNED = {"dkdv": _attn_bwd_dkdv_tuned, "dkdv_parts": _attn_bwd_dkdv_parts_tuned,
             "dq": _attn_bwd_dq_tuned}  # fmt: skip


def backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size=None,
    alibi_slopes=None,
    score_mod=None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of sum(o * do), recomputing P from the forward's lse.

    Args: do, o: (B, H, N_q, d_v) like the forward's o; lse: (B, H, N_q) float32 from
        `kernels.forward` with the same options. Everything else as in
        `kernels.forward`; a score_mod needs its gradient (`score_mods.ScoreMod`).
    Returns: dq (B, H, N_q, d), dk (B, H_kv, N_k, d) and dv (B, H_kv, N_k, d_v) in the inputs'
        dtype; zero for fully masked rows.
    """
    name = "kernels.backward"
    pl = plan(q, k, v, causal, softmax_scale, window_size, alibi_slopes, score_mod, name)
    check_grad_inputs(do, o, lse, q, v, name)
    config = launch_config(block_m, block_n, num_warps, num_stages)
    return run_backward(do, q, k, v, o, lse, pl, config, config, name=name)


def check_grad_inputs(do, o, lse, q, v, name) -> None:
    """do, o (B, H, N_q, d_v) and lse (B, H, N_q) float32, all on q's device, lse without NaN or
    +inf (the shared check of every backward)."""
    check_backward(do, o, lse, q, name=name, kind="torch", v=v)


def preprocess(o: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """D = rowsum(dO * O), (B, H, N_q) float32, by `attn_bwd_preprocess`: one program per 64 rows
    of a head."""
    if o.shape != do.shape or o.ndim != 4:
        raise ValueError(
            f"kernels.bwd.preprocess: o and do must share a (B, H, N_q, d) shape, got "
            f"{tuple(o.shape)} and {tuple(do.shape)}"
        )
    o, do = rows_contiguous(o), rows_contiguous(do)
    B, H, N_q, d_v = o.shape
    delta = torch.empty((B, H, N_q), device=o.device, dtype=torch.float32)
    block = 64 if d_v <= 128 else 32
    attn_bwd_preprocess[(triton.cdiv(N_q, block), B * H)](
        o, do, delta, *o.stride()[:3], *do.stride()[:3], H, N_q, V_DIM=d_v, BLOCK_DV=pad_dim(d_v),
        BLOCK_M=block,
    )  # fmt: skip
    return delta


def _grad_flags(pl: Plan, name: str) -> dict:
    """The score mod's gradient as the kernels take it; a mod without one cannot run backward."""
    mod = pl.mod
    if mod is not None and mod.grad is None and not mod.additive:
        raise NotImplementedError(
            f"{name}: score_mod {mod.name!r} has no gradient: pass "
            "score_mods.ScoreMod(fn, grad=...) with d fn / d score, or additive=True when fn "
            "adds a bias that does not depend on the score"
        )
    has_grad = mod is not None and mod.grad is not None
    return dict(pl.flags, SCORE_GRAD=mod.grad if has_grad else identity, HAS_GRAD=has_grad)


def run_backward(
    do, q, k, v, o, lse, pl: Plan, cfg_dkdv, cfg_dq, kernels=("dkdv", "dq"), cu=None,
    max_seqlen=None, name="kernels.backward",
):  # fmt: skip
    """Preprocess, then the dK/dV and dQ kernels, each with a fixed config or autotuned (config
    None). Packed sequences: as `fwd.run_forward`, with max_seqlen = (q's, k's)."""
    flags = _grad_flags(pl, name)
    q, k, v, o, do = (rows_contiguous(x) for x in (q, k, v, o, do))
    lse = lse.contiguous()
    delta = preprocess(o, do)  # the layout of lse, (B, H, N_q)
    # the gradients take the inputs' strides (a packed layout stays packed)
    dq, dk, dv = (torch.empty_like(x, dtype=out_dtype(q, flags)) for x in (q, k, v))
    packed = cu is not None
    cu_q, cu_k = cu if packed else (lse, lse)  # any pointer when not packed
    rows_q, rows_k = (pl.N_q, pl.N_k) if cu is None else max_seqlen
    common = tuple(st for x in (q, k, v, do) for st in strides(x, packed))
    tail = (
        0 if packed else lse.stride(0), lse.stride(1), pl.stride_ab, pl.stride_ah,
        pl.scale, pl.H, pl.H // pl.H_kv, pl.N_q, pl.N_k, pl.left, pl.right, n_key(rows_q, rows_k),
    )  # fmt: skip
    mod_args = pl.mod_pointer(lse)
    if "dkdv" in kernels:
        grid = lambda meta: (triton.cdiv(rows_k, meta["BLOCK_N"]), pl.B * pl.H_kv)
        args = (q, k, v, do, lse, delta, dk, dv, mod_args, cu_q, cu_k, *common,
                *strides(dk, packed), *strides(dv, packed), *tail)  # fmt: skip
        if separate_dkdv(flags):  # dV, then dK: one accumulator a launch
            for parts in (1, 2):
                launch(_attn_bwd_dkdv_parts_tuned, attn_bwd_dkdv, grid, args,
                       dict(flags, PARTS=parts), cfg_dkdv)  # fmt: skip
        else:
            launch(_attn_bwd_dkdv_tuned, attn_bwd_dkdv, grid, args, flags, cfg_dkdv)
    if "dq" in kernels:
        grid = lambda meta: (triton.cdiv(rows_q, meta["BLOCK_M"]), pl.B * pl.H)
        args = (q, k, v, do, lse, delta, dq, mod_args, cu_q, cu_k, *common,
                *strides(dq, packed), *tail)  # fmt: skip
        launch(_attn_bwd_dq_tuned, attn_bwd_dq, grid, args, flags, cfg_dq)
    return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)
