"""FlashAttention backward for Hopper (sm_90) in Triton: one pass, tensor descriptors, atomic dQ.

The FA2 backward of `flashedu.kernels.bwd` runs two kernels (dK/dV, then dQ), each recomputing
S and dP, so it does 7 block matmuls per (query block, key block) pair. This one does 5, as the
FlashAttention-2 paper's Algorithm 2 and FlashAttention-3's backward do: a program owns BLOCK_N
keys of one (batch, K/V head), keeps k_j, v_j, dk_j and dv_j on chip, streams every query block
that sees them (Q and dO through tensor descriptors, so the copy engine fetches whole tiles and
zero-fills rows past the end) and, for each, adds its share of dQ into a float32 buffer with atomic
adds:

    P^T  = exp(scale K Q^T - lse)        dV += P^T dO          dP^T = V dO^T
    dS^T = P^T * (dP^T - D)              dK += dS^T Q          dQ  += dS K   (atomic, fp32)

with D = rowsum(dO * O) from `bwd.preprocess`. The price: dQ's read-modify-write
traffic goes through L2 (one BLOCK_M x d float32 tile per pair), and the order of the additions,
so dQ's last bits, can change from run to run; the FA2 kernels stay deterministic.

Contract: as `triton_fwd.forward` (fp16/bf16, d 64 or 128, GQA, bottom-right causal, any
N_q, N_k >= 1); do and o (B, H, N_q, d), lse (B, H, N_q) float32 from the forward. Fully masked
rows (lse = -inf) get zero gradients. Off Hopper it raises `HopperUnsupported`; under
TRITON_INTERPRET=1 it runs on CPU tensors with 16 x 16 tiles (fp32 dots, as the forward).

Measured on the H200: notebooks/results/h200_hopper.json (see GPU_NOTES.md, "Hopper backward").
Introduced in notebooks/11_hopper.ipynb.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernels.bwd import check_grad_inputs, preprocess
from .triton_fwd import INTERPRET_CONFIG, LOG2E, check_inputs, descriptor, interpreting, tma_ready


@triton.jit
def _bwd_inner(
    dk, dv, k, v, desc_q, desc_do, desc_dq, LSE, DELTA, DQ, b, h, start, end, cols, scale, N_q,
    N_k, offset, MASK: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
    TMA_DQ: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """Query blocks [start, end) of head h against this program's keys: dK, dV on chip, dQ by
    atomic adds. MASK: some pair in the block is hidden (diagonal, ragged ends). TMA_DQ: the adds
    go through the copy engine (one bulk reduction per tile), else one atomic per element."""
    dims = tl.arange(0, HEAD_DIM)
    for start_m in tl.range(start, end, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        rows = start_m + tl.arange(0, BLOCK_M)
        q = desc_q.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)  # TMA: BLOCK_M x d of Q
        do = desc_do.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)  # and of dO
        if MASK:
            lse2 = tl.load(LSE + rows, mask=rows < N_q, other=float("inf"))
            delta = tl.load(DELTA + rows, mask=rows < N_q, other=0.0)
        else:
            lse2 = tl.load(LSE + rows)
            delta = tl.load(DELTA + rows)
        lse2 = lse2 * 1.4426950408889634  # log2 units
        if UPCAST:
            q, do = q.to(tl.float32), do.to(tl.float32)
        qk_t = tl.dot(k, tl.trans(q))  # (BLOCK_N, BLOCK_M) = S^T / scale
        p_t = tl.math.exp2(qk_t * scale - lse2[None, :])  # P^T recomputed from lse
        if MASK:
            keep = (rows[None, :] < N_q) & (cols[:, None] < N_k)
            if CAUSAL:
                keep = keep & (cols[:, None] <= rows[None, :] + offset)
            p_t = tl.where(keep, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv)  # (BLOCK_N, d)
        dp_t = tl.dot(v, tl.trans(do))  # (BLOCK_N, BLOCK_M) = dP^T
        ds_t = p_t * (dp_t - delta[None, :])  # softmax Jacobian, column by column
        ds_t = ds_t.to(q.dtype)
        dk = tl.dot(ds_t, q, dk)  # (BLOCK_N, d), scaled at the end
        dq = tl.dot(tl.trans(ds_t), k)  # (BLOCK_M, d): this key block's share of dQ
        if TMA_DQ:  # TMA: BLOCK_M x d fp32 added in L2, rows past N_q clipped by the descriptor
            desc_dq.atomic_add([b, h, start_m, 0], dq.reshape(1, 1, BLOCK_M, HEAD_DIM))
        else:  # L2: BLOCK_M x d fp32, one atomic add per element
            dq_ptrs = DQ + rows[:, None] * HEAD_DIM + dims[None, :]
            tl.atomic_add(dq_ptrs, dq, mask=rows[:, None] < N_q, sem="relaxed")
    return dk, dv


@triton.jit(do_not_specialize=["N_q", "N_k", "H", "GROUP"])
def _hopper_bwd(
    desc_q, desc_k, desc_v, desc_do, desc_dq, LSE, DELTA, DQ, DK, DV, scale, H, GROUP, N_q, N_k,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, UPCAST: tl.constexpr, TMA_DQ: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_N keys of one (batch, K/V head). Grid (cdiv(N_k, BLOCK_N), B * H_kv).
    `scale` is softmax_scale * log2(e); DQ is a zeroed float32 (B, H, N_q, d) buffer."""
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    H_kv = H // GROUP
    b = bh // H_kv
    hk = bh % H_kv
    n0 = pid_n * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    offset = N_k - N_q
    # k_j and v_j stay on chip while the query blocks that see them stream past
    k = desc_k.load([b, hk, n0, 0]).reshape(BLOCK_N, HEAD_DIM)
    v = desc_v.load([b, hk, n0, 0]).reshape(BLOCK_N, HEAD_DIM)
    if UPCAST:
        k, v = k.to(tl.float32), v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    # Query rows that see some key of the block: i >= n0 - offset when causal. Rows from
    # full_lo on see every key of the block (i >= last key - offset); the last query block and
    # a ragged key block need the mask throughout.
    lo = 0
    full_lo = 0
    if CAUSAL:
        lo = tl.minimum(tl.maximum(n0 - offset, 0), N_q)
        last = tl.minimum(n0 + BLOCK_N, N_k) - 1
        full_lo = tl.minimum(tl.maximum(last - offset, 0), N_q)
    lo = (lo // BLOCK_M) * BLOCK_M
    full_lo = tl.cdiv(full_lo, BLOCK_M) * BLOCK_M
    full_hi = (N_q // BLOCK_M) * BLOCK_M  # query blocks with no row past N_q
    if n0 + BLOCK_N > N_k:  # ragged key block: every pair needs the key bound
        full_lo = full_hi
    full_hi = tl.maximum(full_hi, full_lo)
    hi = tl.cdiv(N_q, BLOCK_M) * BLOCK_M
    for g in range(GROUP):  # GQA: the query heads sharing this K/V head add into one dK, dV
        h = hk * GROUP + g
        row0 = (b * H + h).to(tl.int64) * N_q  # lse, D and dQ rows of head h
        LSEh = LSE + row0
        DELTAh = DELTA + row0
        DQh = DQ + row0 * HEAD_DIM
        dk, dv = _bwd_inner(
            dk, dv, k, v, desc_q, desc_do, desc_dq, LSEh, DELTAh, DQh, b, h,
            lo, full_lo, cols, scale,
            N_q, N_k, offset, True, CAUSAL, UPCAST, TMA_DQ, BLOCK_M, BLOCK_N, HEAD_DIM,
        )  # fmt: skip
        dk, dv = _bwd_inner(
            dk, dv, k, v, desc_q, desc_do, desc_dq, LSEh, DELTAh, DQh, b, h,
            full_lo, full_hi, cols, scale,
            N_q, N_k, offset, False, CAUSAL, UPCAST, TMA_DQ, BLOCK_M, BLOCK_N, HEAD_DIM,
        )  # fmt: skip
        dk, dv = _bwd_inner(
            dk, dv, k, v, desc_q, desc_do, desc_dq, LSEh, DELTAh, DQh, b, h,
            full_hi, hi, cols, scale,
            N_q, N_k, offset, True, CAUSAL, UPCAST, TMA_DQ, BLOCK_M, BLOCK_N, HEAD_DIM,
        )  # fmt: skip
    dims = tl.arange(0, HEAD_DIM)
    out = (bh.to(tl.int64) * N_k + cols)[:, None] * HEAD_DIM + dims[None, :]
    keep = cols[:, None] < N_k
    # dS was taken in log2 units of scale * log2(e): dK = softmax_scale * dS Q
    tl.store(DK + out, (dk * (scale * 0.6931471805599453)).to(DK.dtype.element_ty), mask=keep)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=keep)


# (d, causal) -> (BLOCK_M, BLOCK_N, num_warps, num_stages); see GPU_NOTES.md, "Hopper backward"
CONFIGS = {
    (64, False): (64, 128, 8, 2),
    (64, True): (64, 128, 8, 2),
    (128, False): (64, 128, 8, 2),
    (128, True): (64, 128, 8, 2),
}


def config_for(d: int, causal: bool) -> tuple:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for this head dim and mask."""
    return INTERPRET_CONFIG if interpreting() else CONFIGS[(d, bool(causal))]


def backward(
    do, q, k, v, o, lse, *, causal=False, softmax_scale=None, config=None, tma_reduce=True
):
    """Gradients (dq, dk, dv) of sum(o * do) through the Hopper backward kernel.

    Args:
        do, o: (B, H, N_q, d); q, k, v and the options as given to `triton_fwd.forward`;
        lse: (B, H, N_q) float32, the forward's.
        config: (BLOCK_M, BLOCK_N, num_warps, num_stages), default `config_for`.
        tma_reduce: add dQ tiles through the copy engine (`cp.reduce.async.bulk`); False: one
            atomic add per element (the only way under the interpreter).
    Returns:
        dq (B, H, N_q, d), dk and dv (B, H_kv, N_k, d) in q's dtype; zero for fully masked rows.
    Raises:
        HopperUnsupported (a ValueError) where `triton_fwd.forward` would.
    """
    name = "hopper.triton_bwd.backward"
    (B, H, H_kv, N_q, N_k, d), scale = check_inputs(q, k, v, causal, softmax_scale, name)
    check_grad_inputs(do, o, lse, q, v, name)
    bm, bn, warps, stages = config or config_for(d, causal)
    delta = preprocess(o, do)
    q, k, v, do = (tma_ready(x) for x in (q, k, v, do))
    upcast = interpreting()  # the interpreter's half-precision dot is not exact enough
    dq = torch.zeros((B, H, N_q, d), device=q.device, dtype=torch.float32)
    dk = torch.empty((B, H_kv, N_k, d), device=q.device, dtype=torch.float32 if upcast else q.dtype)
    dv = torch.empty_like(dk)
    descs = [descriptor(x, bm if x is q or x is do else bn, d) for x in (q, k, v, do)]
    tma_dq = not interpreting() and tma_reduce  # the interpreter has no descriptor reductions
    descs.append(descriptor(dq, bm, d) if tma_dq else dq)
    _hopper_bwd[(triton.cdiv(N_k, bn), B * H_kv)](
        *descs, lse.contiguous(), delta, dq, dk, dv, scale * LOG2E, H, H // H_kv, N_q, N_k,
        HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, UPCAST=upcast, TMA_DQ=tma_dq,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return (dq * scale).to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)
