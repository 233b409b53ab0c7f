"""Worked solutions of the kernel exercises, written as a learner fills the skeletons: the scores
kernel (6.1) and the whole FlashAttention-2 forward kernel (6.3) of chapter 06; the preprocess
(7.1), P rebuilt from lse (7.2), and the dK/dV and dQ kernels (7.3, 7.4) of chapter 07.

Each kernel keeps the skeleton's signature and given prologue (`flashedu.kernels.exercises`) and
fills the rest the plain way: every key (or query) block goes through one masked path, `tl.exp`
in natural units, no block-range split. That is what `checks.solution(...)` shows for exercises
6.1, 6.3, 7.1-7.4. The package's own kernels (`flashedu.kernels.fwd`, `flashedu.kernels.bwd`) are
the tuned versions of the same algorithm: base-2 exponentials with log2(e) folded into the scale,
mask arithmetic only on the blocks that need it, windows, ALiBi and autotuning.

`forward` and `backward` run these kernels through the launchers; tests/kernels/test_solutions.py
holds them to the float64 reference on the cases `kernels.fwd` is tested on (ragged lengths,
causal with N_q != N_k, rows that see no key, GQA, float16 and float32).

Introduced in notebooks/06_triton_forward.ipynb (forward) and notebooks/07_triton_backward.ipynb
(backward). Limits: those of `flashedu.kernels.exercises`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .exercises import (
    dkdv_head,
    dkdv_program,
    dq_program,
    fwd_program,
    launch_dkdv,
    launch_dq,
    launch_forward,
)


@triton.jit
def scores_kernel(
    Q, K, S, stride_qm, stride_kn, stride_sm, N_q, N_k, sm_scale,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Tile (program_id(0), program_id(1)) of s = q k^T * sm_scale, -inf where hidden."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + rows[:, None] * stride_qm + dims[None, :], mask=rows[:, None] < N_q, other=0.0)
    k = tl.load(K + cols[:, None] * stride_kn + dims[None, :], mask=cols[:, None] < N_k, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale  # (BLOCK_M, BLOCK_N)
    if CAUSAL:  # bottom-right: query i sees keys j <= i + N_k - N_q
        s = tl.where(cols[None, :] <= rows[:, None] + (N_k - N_q), s, -float("inf"))
    inside = (rows[:, None] < N_q) & (cols[None, :] < N_k)
    tl.store(S + rows[:, None] * stride_sm + cols[None, :], s, mask=inside)


@triton.jit
def probabilities_kernel(
    Q, K, LSE, P, stride_qm, stride_kn, stride_pm, N_q, N_k, sm_scale,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Tile (program_id(0), program_id(1)) of p = exp(s - lse), 0 where hidden and on rows with
    lse = -inf; base 2, log2(e) folded into both terms."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + rows[:, None] * stride_qm + dims[None, :], mask=rows[:, None] < N_q, other=0.0)
    k = tl.load(K + cols[:, None] * stride_kn + dims[None, :], mask=cols[:, None] < N_k, other=0.0)
    lse = tl.load(LSE + rows, mask=rows < N_q, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * (sm_scale * 1.4426950408889634)
    p = tl.math.exp2(s - lse[:, None] * 1.4426950408889634)
    keep = cols[None, :] < N_k
    if CAUSAL:
        keep = keep & (cols[None, :] <= rows[:, None] + (N_k - N_q))
    p = tl.where(keep, p, 0.0)  # after the exponential: -inf - (-inf) never reaches the output
    inside = (rows[:, None] < N_q) & (cols[None, :] < N_k)
    tl.store(P + rows[:, None] * stride_pm + cols[None, :], p, mask=inside)


@triton.jit
def preprocess_kernel(
    O, DO, DELTA, stride_ob, stride_oh, stride_om, stride_db, stride_dh, stride_dm,
    stride_deltab, stride_deltah, N, H, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """delta = rowsum(do * o) in float32 for BLOCK_M rows of one (batch, head)."""
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    in_n = rows[:, None] < N
    o = tl.load(O + b * stride_ob + h * stride_oh + rows[:, None] * stride_om + dims[None, :],
                mask=in_n, other=0.0)  # fmt: skip
    do = tl.load(DO + b * stride_db + h * stride_dh + rows[:, None] * stride_dm + dims[None, :],
                 mask=in_n, other=0.0)  # fmt: skip
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + b * stride_deltab + h * stride_deltah + rows, delta, mask=rows < N)


@triton.jit
def flash_forward_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh,
    stride_vn, stride_ob, stride_oh, stride_om, stride_lb, stride_lh,
    N_q, N_k, H, GROUP, sm_scale,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """o and lse for BLOCK_M query rows of one (batch, head): the online softmax over key blocks."""
    Q, K, V, O, LSE, rows = fwd_program(
        Q, K, V, O, LSE, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
        stride_ob, stride_oh, stride_lb, stride_lh, H, GROUP, BLOCK_M,
    )  # fmt: skip
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + rows[:, None] * stride_qm + dims[None, :], mask=rows[:, None] < N_q, other=0.0)
    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)  # running row max
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp(s - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # running sum of p v, not yet / l_i
    offset = N_k - N_q  # causal, bottom-right: row i sees keys j <= i + offset
    end = N_k
    if CAUSAL:  # the block's last row sees keys up to last + offset: later blocks are skipped
        end = tl.minimum(tl.maximum(tl.program_id(0) * BLOCK_M + BLOCK_M + offset, 0), N_k)
    for start in range(0, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        in_k = cols[:, None] < N_k  # rows of K and V past N_k are not loaded
        k = tl.load(K + cols[:, None] * stride_kn + dims[None, :], mask=in_k, other=0.0)
        v = tl.load(V + cols[:, None] * stride_vn + dims[None, :], mask=in_k, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale  # (BLOCK_M, BLOCK_N)
        keep = cols[None, :] < N_k  # the ragged last block
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None] + offset)
        s = tl.where(keep, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == -float("inf"), 0.0, m_new)  # a row that saw nothing yet
        p = tl.exp(s - m_use[:, None])
        alpha = tl.exp(m_i - m_use)  # rescale: the row max moved from m_i to m_new
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    empty = l_i == 0.0  # a row that sees no key: o = 0, lse = -inf
    l_use = tl.where(empty, 1.0, l_i)
    o = acc / l_use[:, None]
    in_q = rows[:, None] < N_q
    tl.store(O + rows[:, None] * stride_om + dims[None, :], o.to(O.dtype.element_ty), mask=in_q)
    tl.store(LSE + rows, tl.where(empty, -float("inf"), m_i + tl.log(l_use)), mask=rows < N_q)


@triton.jit
def dq_kernel(
    Q, K, V, DO, LSE, D, DQ,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh,
    stride_vn, stride_db, stride_dh, stride_dm, stride_dqb, stride_dqh, stride_dqm,
    stride_lb, stride_lh,
    N_q, N_k, H, GROUP, sm_scale,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """dq for BLOCK_M query rows of one (batch, head): P rebuilt from lse, key block by block."""
    Q, K, V, DO, LSE, D, DQ, rows = dq_program(
        Q, K, V, DO, LSE, D, DQ, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
        stride_db, stride_dh, stride_dqb, stride_dqh, stride_lb, stride_lh, H, GROUP, BLOCK_M,
    )  # fmt: skip
    dims = tl.arange(0, HEAD_DIM)
    in_q = rows[:, None] < N_q
    q = tl.load(Q + rows[:, None] * stride_qm + dims[None, :], mask=in_q, other=0.0)
    do = tl.load(DO + rows[:, None] * stride_dm + dims[None, :], mask=in_q, other=0.0)
    lse = tl.load(LSE + rows, mask=rows < N_q, other=0.0)
    delta = tl.load(D + rows, mask=rows < N_q, other=0.0)  # D_i = rowsum(dO_i * O_i)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    offset = N_k - N_q
    end = N_k
    if CAUSAL:
        end = tl.minimum(tl.maximum(tl.program_id(0) * BLOCK_M + BLOCK_M + offset, 0), N_k)
    for start in range(0, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        in_k = cols[:, None] < N_k  # rows of K and V past N_k are not loaded
        k = tl.load(K + cols[:, None] * stride_kn + dims[None, :], mask=in_k, other=0.0)
        v = tl.load(V + cols[:, None] * stride_vn + dims[None, :], mask=in_k, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale  # (BLOCK_M, BLOCK_N)
        keep = cols[None, :] < N_k
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None] + offset)
        p = tl.where(keep, tl.exp(s - lse[:, None]), 0.0)  # 0 where masked, and on lse = -inf rows
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # (BLOCK_M, BLOCK_N)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)  # (BLOCK_M, d)
    dq = dq * sm_scale
    tl.store(DQ + rows[:, None] * stride_dqm + dims[None, :], dq.to(DQ.dtype.element_ty), mask=in_q)


@triton.jit
def dkdv_kernel(
    Q, K, V, DO, LSE, D, DK, DV,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh,
    stride_vn, stride_db, stride_dh, stride_dm, stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn, stride_lb, stride_lh,
    N_q, N_k, H, GROUP, sm_scale,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """dk, dv for BLOCK_N keys of one (batch, K/V head), summed over the query heads that read
    them: P^T rebuilt from lse, query block by query block."""
    K, V, DK, DV, b, h0, cols = dkdv_program(
        K, V, DK, DV, stride_kb, stride_kh, stride_vb, stride_vh, stride_dkb, stride_dkh,
        stride_dvb, stride_dvh, H, GROUP, BLOCK_N,
    )  # fmt: skip
    dims = tl.arange(0, HEAD_DIM)
    in_k = cols[:, None] < N_k
    k = tl.load(K + cols[:, None] * stride_kn + dims[None, :], mask=in_k, other=0.0)
    v = tl.load(V + cols[:, None] * stride_vn + dims[None, :], mask=in_k, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    offset = N_k - N_q
    begin = 0
    if CAUSAL:  # query i sees key j iff i >= j - offset: earlier query blocks are skipped
        begin = tl.maximum(tl.program_id(0) * BLOCK_N - offset, 0) // BLOCK_M * BLOCK_M
    for g in range(GROUP):  # GQA: the query heads that share this K/V head
        Qh, DOh, LSEh, Dh = dkdv_head(
            Q, DO, LSE, D, b, h0 + g, stride_qb, stride_qh, stride_db, stride_dh, stride_lb,
            stride_lh,
        )  # fmt: skip
        for start in range(begin, N_q, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            in_q = rows[:, None] < N_q  # rows of Q and dO past N_q are not loaded
            q = tl.load(Qh + rows[:, None] * stride_qm + dims[None, :], mask=in_q, other=0.0)
            do = tl.load(DOh + rows[:, None] * stride_dm + dims[None, :], mask=in_q, other=0.0)
            lse = tl.load(LSEh + rows, mask=rows < N_q, other=0.0)
            delta = tl.load(Dh + rows, mask=rows < N_q, other=0.0)
            s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * sm_scale  # (BLOCK_N, BLOCK_M)
            keep = rows[None, :] < N_q
            if CAUSAL:
                keep = keep & (cols[:, None] <= rows[None, :] + offset)
            p_t = tl.where(keep, tl.exp(s_t - lse[None, :]), 0.0)
            # forward: o_i = sum_j p_ij v_j  ->  backward: dv_j += sum_i p_ij do_i
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # dP^T (BLOCK_N, BLOCK_M)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)
    dk = dk * sm_scale
    tl.store(DK + cols[:, None] * stride_dkn + dims[None, :], dk.to(DK.dtype.element_ty), mask=in_k)
    tl.store(DV + cols[:, None] * stride_dvn + dims[None, :], dv.to(DV.dtype.element_ty), mask=in_k)


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) by `flash_forward_kernel`: q (B, H, N_q, d), k, v (B, H_kv, N_k, d); o like q, lse
    (B, H, N_q) float32 (natural log; -inf and o = 0 on rows that see no key)."""
    return launch_forward(
        flash_forward_kernel, q, k, v, causal=causal, softmax_scale=softmax_scale,
        block_m=block_m, block_n=block_n,
    )  # fmt: skip


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
    block_m: int | None = None,
    block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) by `dq_kernel` and `dkdv_kernel`, with D = rowsum(do * o) in float32 (computed
    here by torch: exercise 7.1 writes it as a kernel)."""
    delta = (do.float() * o.float()).sum(-1)  # (B, H, N_q)
    lse = lse.contiguous()
    opts = dict(causal=causal, softmax_scale=softmax_scale, block_m=block_m, block_n=block_n)
    dq = launch_dq(dq_kernel, do, q, k, v, lse, delta, **opts)
    dk, dv = launch_dkdv(dkdv_kernel, do, q, k, v, lse, delta, **opts)
    return dq, dk, dv
