"""FlashAttention-2 backward in Triton: a preprocess, a dK/dV pass and a dQ pass, no atomics.

The forward kept only o and the log-sum-exp; P is recomputed tile by tile from q, k and lse
(Dao et al. 2022, Sec. 3.1; Dao 2023, Alg. 2). With D_i = rowsum(dO_i * O_i):

    P_ij  = exp(scale * q_i . k_j + bias_ij - lse_i)     dV_j = sum_i P_ij dO_i
    dP_ij = dO_i . v_j                                   dK_j = scale sum_i dS_ij q_i
    dS_ij = P_ij (dP_ij - D_i)                           dQ_i = scale sum_j dS_ij k_j

`_attn_bwd_dkdv` owns BLOCK_N keys and streams the query blocks that see them (for GQA, over every
query head of the group, so dK and dV are summed without atomics); `_attn_bwd_dq` owns BLOCK_M
queries and streams keys. Each recomputes S and dP, so the pair does 7 block matmuls where a single
pass with atomic dQ updates does 5: the price of a deterministic result with no read-modify-write
traffic on dQ.

Introduced in notebooks/07_triton_backward.ipynb. Supports what `triton_attention.forward` supports.
"""

from __future__ import annotations

import torch
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from ._validate import check_backward
from .triton_common import LOG2E, alibi, block_range, visible
from .triton_launch import (
    MASK_KEY,
    autotuned,
    check_inputs,
    kernel_flags,
    launch,
    launch_config,
    n_key,
    out_dtype,
    rows_contiguous,
)


@triton.jit(do_not_specialize=["N_q", "H"])
def _attn_bwd_preprocess(
    O,
    DO,
    DELTA,
    stride_ob,
    stride_oh,
    stride_om,
    stride_db,
    stride_dh,
    stride_dm,
    H,
    N_q,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """D_i = rowsum(dO_i * O_i) in fp32 (equals rowsum(P_ij dP_ij)). Grid (cdiv(N_q, BLOCK_M),
    B * H)."""
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    mask = rows[:, None] < N_q
    o = tl.load(
        O + b.to(tl.int64) * stride_ob + h * stride_oh + rows[:, None] * stride_om + dims[None, :],
        mask=mask,
        other=0.0,
    ).to(tl.float32)  # HBM: read BLOCK_M * d of O
    do = tl.load(
        DO + b.to(tl.int64) * stride_db + h * stride_dh + rows[:, None] * stride_dm + dims[None, :],
        mask=mask,
        other=0.0,
    ).to(tl.float32)  # HBM: read BLOCK_M * d of dO
    tl.store(
        DELTA + bh.to(tl.int64) * N_q + rows, tl.sum(o * do, 1), mask=rows < N_q
    )  # HBM: write BLOCK_M


@triton.jit
def _visible_t(
    rows, cols, N_q, offset, LEFT, RIGHT, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr
):
    """`triton_common.visible` transposed, (len(cols), len(rows)): query row exists and key col
    lies in its window."""
    diag = rows[None, :] + offset
    keep = rows[None, :] < N_q
    if HAS_LEFT:
        keep = keep & (cols[:, None] >= diag - LEFT)
    if HAS_RIGHT:
        keep = keep & (cols[:, None] <= diag + RIGHT)
    return keep


@triton.jit
def _dkdv_inner(
    dk,
    dv,
    k,
    v,
    Q,
    DO,
    LSE,
    DELTA,
    stride_qm,
    stride_dm,
    start,
    end,
    cols,
    slope2,
    qk_scale,
    N_q,
    N_k,
    offset,
    LEFT,
    RIGHT,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    MASK: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    dims = tl.arange(0, HEAD_DIM)
    for start_m in tl.range(start, end, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        q_ptrs = Q + rows[:, None] * stride_qm + dims[None, :]
        do_ptrs = DO + rows[:, None] * stride_dm + dims[None, :]
        if (
            MASK
        ):  # HBM: read BLOCK_M * d of Q and of dO, BLOCK_M of lse and D (rows past N_q read as 0)
            q = tl.load(q_ptrs, mask=rows[:, None] < N_q, other=0.0)
            lse2 = tl.load(LSE + rows, mask=rows < N_q, other=0.0) * 1.4426950408889634
        else:
            q = tl.load(q_ptrs)
            lse2 = tl.load(LSE + rows) * 1.4426950408889634
        if UPCAST:
            q = q.to(tl.float32)
        s_t = (
            tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale
        )  # (BLOCK_N, BLOCK_M) = S^T in log2 units
        if HAS_ALIBI:
            s_t += alibi(slope2, cols, rows, -offset)  # the bias, transposed
        p_t = tl.math.exp2(s_t - lse2[None, :])  # P^T recomputed from lse
        if MASK:
            p_t = tl.where(
                _visible_t(rows, cols, N_q, offset, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT), p_t, 0.0
            )
        if MASK:
            do = tl.load(do_ptrs, mask=rows[:, None] < N_q, other=0.0)
            delta = tl.load(DELTA + rows, mask=rows < N_q, other=0.0)
        else:
            do = tl.load(do_ptrs)
            delta = tl.load(DELTA + rows)
        if UPCAST:
            do = do.to(tl.float32)
        # forward: o_i = sum_j p_ij v_j  ->  backward: dv_j += p_ij * do_i
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)  # (BLOCK_N, d)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # (BLOCK_N, BLOCK_M) = dP^T
        ds_t = p_t * (dp_t - delta[None, :])  # softmax Jacobian, row by row
        dk = tl.dot(
            ds_t.to(q.dtype), q, dk, input_precision=PRECISION
        )  # (BLOCK_N, d), scaled at the end
    return dk, dv


@triton.jit(do_not_specialize=["N_q", "N_k", "LEFT", "RIGHT", "H", "GROUP", "N_KEY", "stride_sb"])
def _attn_bwd_dkdv(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    SLOPES,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_db,
    stride_dh,
    stride_dm,
    stride_dkb,
    stride_dkh,
    stride_dkn,
    stride_dvb,
    stride_dvh,
    stride_dvn,
    stride_sb,
    qk_scale,
    sm_scale,
    H,
    GROUP,
    N_q,
    N_k,
    LEFT,
    RIGHT,
    N_KEY,
    HEAD_DIM: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program: BLOCK_N keys of one (batch, K/V head). Grid (cdiv(N_k, BLOCK_N), B * H_kv)."""
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    H_kv = H // GROUP
    b = bh // H_kv
    h_kv = bh % H_kv
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    offset = N_k - N_q
    kv_mask = cols[:, None] < N_k
    # k_j and v_j stay in SRAM while every query block that sees them streams past.  HBM: read 2
    # BLOCK_N d
    k = tl.load(
        K
        + b.to(tl.int64) * stride_kb
        + h_kv.to(tl.int64) * stride_kh
        + cols[:, None] * stride_kn
        + dims[None, :],
        mask=kv_mask,
        other=0.0,
    )
    v = tl.load(
        V
        + b.to(tl.int64) * stride_vb
        + h_kv.to(tl.int64) * stride_vh
        + cols[:, None] * stride_vn
        + dims[None, :],
        mask=kv_mask,
        other=0.0,
    )
    if UPCAST:
        k, v = k.to(tl.float32), v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    last = tl.minimum(pid_n * BLOCK_N + BLOCK_N, N_k) - 1
    # Queries seeing key j: j - offset - RIGHT <= i <= j - offset + LEFT (the forward's range,
    # mirrored).
    lo, full_lo, full_hi, hi = block_range(
        pid_n * BLOCK_N, last, N_q, -offset, RIGHT, LEFT, HAS_RIGHT, HAS_LEFT, BLOCK_M
    )
    for g in range(GROUP):  # GQA: the query heads sharing this K/V head add into one dK, dV
        h = h_kv * GROUP + g
        Qh = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
        DOh = DO + b.to(tl.int64) * stride_db + h.to(tl.int64) * stride_dh
        row0 = (b * H + h).to(tl.int64) * N_q
        slope2 = 0.0
        if HAS_ALIBI:
            slope2 = tl.load(SLOPES + b * stride_sb + h) * 1.4426950408889634
        if HAS_RIGHT:  # queries on the causal diagonal (or the window's right edge)
            dk, dv = _dkdv_inner(
                dk,
                dv,
                k,
                v,
                Qh,
                DOh,
                LSE + row0,
                DELTA + row0,
                stride_qm,
                stride_dm,
                lo,
                full_lo,
                cols,
                slope2,
                qk_scale,
                N_q,
                N_k,
                offset,
                LEFT,
                RIGHT,
                HAS_LEFT,
                HAS_RIGHT,
                HAS_ALIBI,
                True,
                UPCAST,
                PRECISION,
                BLOCK_M,
                HEAD_DIM,
            )
        dk, dv = _dkdv_inner(
            dk,
            dv,
            k,
            v,
            Qh,
            DOh,
            LSE + row0,
            DELTA + row0,
            stride_qm,
            stride_dm,
            full_lo,
            full_hi,
            cols,
            slope2,
            qk_scale,
            N_q,
            N_k,
            offset,
            LEFT,
            RIGHT,
            HAS_LEFT,
            HAS_RIGHT,
            HAS_ALIBI,
            False,
            UPCAST,
            PRECISION,
            BLOCK_M,
            HEAD_DIM,
        )
        dk, dv = _dkdv_inner(
            dk,
            dv,
            k,
            v,
            Qh,
            DOh,
            LSE + row0,
            DELTA + row0,
            stride_qm,
            stride_dm,
            full_hi,
            hi,
            cols,
            slope2,
            qk_scale,
            N_q,
            N_k,
            offset,
            LEFT,
            RIGHT,
            HAS_LEFT,
            HAS_RIGHT,
            HAS_ALIBI,
            True,
            UPCAST,
            PRECISION,
            BLOCK_M,
            HEAD_DIM,
        )
    DK += b.to(tl.int64) * stride_dkb + h_kv.to(tl.int64) * stride_dkh
    DV += b.to(tl.int64) * stride_dvb + h_kv.to(tl.int64) * stride_dvh
    tl.store(
        DK + cols[:, None] * stride_dkn + dims[None, :],
        (dk * sm_scale).to(DK.dtype.element_ty),
        mask=kv_mask,
    )
    tl.store(
        DV + cols[:, None] * stride_dvn + dims[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask
    )


@triton.jit
def _dq_inner(
    dq,
    q,
    do,
    lse2,
    delta,
    K,
    V,
    stride_kn,
    stride_vn,
    start,
    end,
    rows,
    slope2,
    qk_scale,
    N_k,
    offset,
    LEFT,
    RIGHT,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    MASK: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    dims = tl.arange(0, HEAD_DIM)
    for start_n in tl.range(start, end, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = K + cols[:, None] * stride_kn + dims[None, :]
        v_ptrs = V + cols[:, None] * stride_vn + dims[None, :]
        if MASK:  # HBM: read BLOCK_N * d of K and of V
            k = tl.load(k_ptrs, mask=cols[:, None] < N_k, other=0.0)
            v = tl.load(v_ptrs, mask=cols[:, None] < N_k, other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = (
            tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        )  # (BLOCK_M, BLOCK_N), log2 units
        if HAS_ALIBI:
            s += alibi(slope2, rows, cols, offset)
        p = tl.math.exp2(s - lse2[:, None])  # P recomputed from lse
        if MASK:
            p = tl.where(visible(rows, cols, N_k, offset, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # (BLOCK_M, BLOCK_N)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(
            ds.to(k.dtype), k, dq, input_precision=PRECISION
        )  # (BLOCK_M, d), scaled at the end
    return dq


@triton.jit(do_not_specialize=["N_q", "N_k", "LEFT", "RIGHT", "H", "GROUP", "N_KEY", "stride_sb"])
def _attn_bwd_dq(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    SLOPES,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_db,
    stride_dh,
    stride_dm,
    stride_dqb,
    stride_dqh,
    stride_dqm,
    stride_sb,
    qk_scale,
    sm_scale,
    H,
    GROUP,
    N_q,
    N_k,
    LEFT,
    RIGHT,
    N_KEY,
    HEAD_DIM: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (batch, head). Grid (cdiv(N_q, BLOCK_M), B * H)."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    offset = N_k - N_q
    row_mask = rows < N_q
    # q_i, dO_i, lse_i and D_i stay on chip for the whole K/V loop.  HBM: read 2 BLOCK_M d + 2
    # BLOCK_M
    q = tl.load(
        Q
        + b.to(tl.int64) * stride_qb
        + h.to(tl.int64) * stride_qh
        + rows[:, None] * stride_qm
        + dims[None, :],
        mask=row_mask[:, None],
        other=0.0,
    )
    do = tl.load(
        DO
        + b.to(tl.int64) * stride_db
        + h.to(tl.int64) * stride_dh
        + rows[:, None] * stride_dm
        + dims[None, :],
        mask=row_mask[:, None],
        other=0.0,
    )
    lse2 = (
        tl.load(LSE + bh.to(tl.int64) * N_q + rows, mask=row_mask, other=0.0) * 1.4426950408889634
    )
    delta = tl.load(DELTA + bh.to(tl.int64) * N_q + rows, mask=row_mask, other=0.0)
    if UPCAST:
        q, do = q.to(tl.float32), do.to(tl.float32)
    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = tl.load(SLOPES + b * stride_sb + h) * 1.4426950408889634
    K += b.to(tl.int64) * stride_kb + (h // GROUP).to(tl.int64) * stride_kh
    V += b.to(tl.int64) * stride_vb + (h // GROUP).to(tl.int64) * stride_vh
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    last = tl.minimum(pid_m * BLOCK_M + BLOCK_M, N_q) - 1
    lo, full_lo, full_hi, hi = block_range(
        pid_m * BLOCK_M, last, N_k, offset, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT, BLOCK_N
    )
    if HAS_LEFT:
        dq = _dq_inner(
            dq,
            q,
            do,
            lse2,
            delta,
            K,
            V,
            stride_kn,
            stride_vn,
            lo,
            full_lo,
            rows,
            slope2,
            qk_scale,
            N_k,
            offset,
            LEFT,
            RIGHT,
            HAS_LEFT,
            HAS_RIGHT,
            HAS_ALIBI,
            True,
            UPCAST,
            PRECISION,
            BLOCK_N,
            HEAD_DIM,
        )
    dq = _dq_inner(
        dq,
        q,
        do,
        lse2,
        delta,
        K,
        V,
        stride_kn,
        stride_vn,
        full_lo,
        full_hi,
        rows,
        slope2,
        qk_scale,
        N_k,
        offset,
        LEFT,
        RIGHT,
        HAS_LEFT,
        HAS_RIGHT,
        HAS_ALIBI,
        False,
        UPCAST,
        PRECISION,
        BLOCK_N,
        HEAD_DIM,
    )
    dq = _dq_inner(
        dq,
        q,
        do,
        lse2,
        delta,
        K,
        V,
        stride_kn,
        stride_vn,
        full_hi,
        hi,
        rows,
        slope2,
        qk_scale,
        N_k,
        offset,
        LEFT,
        RIGHT,
        HAS_LEFT,
        HAS_RIGHT,
        HAS_ALIBI,
        True,
        UPCAST,
        PRECISION,
        BLOCK_N,
        HEAD_DIM,
    )
    DQ += b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh
    tl.store(
        DQ + rows[:, None] * stride_dqm + dims[None, :],
        (dq * sm_scale).to(DQ.dtype.element_ty),
        mask=row_mask[:, None],
    )


def _dkdv_table(d, wide):
    """(BLOCK_M, BLOCK_N, warps, stages) for the dK/dV kernel: BLOCK_N keys per program, BLOCK_M
    queries a step."""
    if wide:
        return [(16, 64, 8, 1)] if d <= 128 else [(16, 16, 4, 1)]
    if d <= 64:
        return [(64, 64, 4, 3), (32, 64, 4, 2), (64, 128, 8, 2)]
    if d == 128:
        return [(32, 64, 4, 2), (64, 128, 8, 2), (32, 128, 8, 2)]
    return [(32, 64, 8, 2)]


def _dq_table(d, wide):
    """(BLOCK_M, BLOCK_N, warps, stages) for the dQ kernel: BLOCK_M queries per program, BLOCK_N
    keys a step."""
    if wide:
        return [(32, 16, 4, 2)]
    if d <= 64:
        return [(128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3)]
    if d == 128:
        return [(128, 64, 8, 3), (64, 32, 4, 3), (128, 64, 8, 2)]
    return [(32, 32, 4, 2)]


_attn_bwd_dkdv_tuned = autotuned(_attn_bwd_dkdv, _dkdv_table, MASK_KEY)
_attn_bwd_dq_tuned = autotuned(_attn_bwd_dq, _dq_table, MASK_KEY)


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
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of sum(o * do), recomputing P from the forward's lse.

    Args: do, o: (B, H, N_q, d) like q; lse: (B, H, N_q) float32 from `triton_attention.forward`
        with the same options. Everything else as in `triton_attention.forward`.
    Returns: dq (B, H, N_q, d), dk and dv (B, H_kv, N_k, d) in the inputs' dtype; zero for fully
        masked rows.
    """
    name = "triton_attention.backward"
    dims, scale, bounds, slopes, stride_sb = check_inputs(
        q, k, v, causal, softmax_scale, window_size, alibi_slopes, name
    )
    check_backward(do, o, lse, q, name=name, kind="torch")
    config = launch_config(block_m, block_n, num_warps, num_stages)
    return _launch(do, q, k, v, o, lse, dims, scale, bounds, slopes, stride_sb, config, config)


def preprocess(o: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """D = rowsum(dO * O), (B, H, N_q) float32, by `_attn_bwd_preprocess`: one program per 64 rows
    of a head."""
    if o.shape != do.shape or o.ndim != 4:
        raise ValueError(
            f"triton_backward.preprocess: o and do must share a (B, H, N_q, d) shape, got "
            f"{tuple(o.shape)} and {tuple(do.shape)}"
        )
    o, do = rows_contiguous(o), rows_contiguous(do)
    B, H, N_q, d = o.shape
    delta = torch.empty((B, H, N_q), device=o.device, dtype=torch.float32)
    block = 64 if d <= 128 else 32
    _attn_bwd_preprocess[(triton.cdiv(N_q, block), B * H)](
        o, do, delta, *o.stride()[:3], *do.stride()[:3], H, N_q, HEAD_DIM=d, BLOCK_M=block
    )
    return delta


def _launch(
    do,
    q,
    k,
    v,
    o,
    lse,
    dims,
    scale,
    bounds,
    slopes,
    stride_sb,
    cfg_dkdv,
    cfg_dq,
    kernels=("dkdv", "dq"),
):
    """Preprocess, then the dK/dV and dQ kernels, each with a fixed config or autotuned (config
    None)."""
    B, H, H_kv, N_q, N_k, d = dims
    q, k, v, o, do = (rows_contiguous(x) for x in (q, k, v, o, do))
    lse = lse.contiguous()
    delta = preprocess(o, do)
    flags, left, right = kernel_flags(q, scale, bounds, slopes is not None)
    dq, dk, dv = (
        torch.empty(x.shape, device=x.device, dtype=out_dtype(q, flags)) for x in (q, k, v)
    )
    slopes = lse if slopes is None else slopes  # any float32 pointer when there is no ALiBi
    common = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3])
    tail = (scale * LOG2E, scale, H, H // H_kv, N_q, N_k, left, right, n_key(N_q, N_k))
    if "dkdv" in kernels:
        grid = lambda meta: (triton.cdiv(N_k, meta["BLOCK_N"]), B * H_kv)  # noqa: E731
        launch(
            _attn_bwd_dkdv_tuned,
            _attn_bwd_dkdv,
            grid,
            (
                q,
                k,
                v,
                do,
                lse,
                delta,
                dk,
                dv,
                slopes,
                *common,
                *dk.stride()[:3],
                *dv.stride()[:3],
                stride_sb,
                *tail,
            ),
            flags,
            cfg_dkdv,
        )
    if "dq" in kernels:
        grid = lambda meta: (triton.cdiv(N_q, meta["BLOCK_M"]), B * H)  # noqa: E731
        launch(
            _attn_bwd_dq_tuned,
            _attn_bwd_dq,
            grid,
            (q, k, v, do, lse, delta, dq, slopes, *common, *dq.stride()[:3], stride_sb, *tail),
            flags,
            cfg_dq,
        )
    return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)
