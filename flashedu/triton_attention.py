"""FlashAttention-2 in Triton: the forward kernel, the launchers, and the autograd entry point
`attention`.

One source runs everywhere: on a CUDA GPU it compiles to tensor-core code (autotuned block sizes,
warps and pipeline stages); on a machine without one, `flashedu._env` has set TRITON_INTERPRET=1
before triton loaded, so the same kernels run on CPU tensors, slowly, with one small fixed block
size. The backward kernels live in `flashedu.triton_backward` (`backward` is re-exported here);
validation and autotuning in `flashedu.triton_launch`.

Structure (Dao 2023, FlashAttention-2, Alg. 1): one program per (block of BLOCK_M query rows, batch,
head). q_i stays on chip while K and V stream past in blocks of BLOCK_N rows (B_r and B_c in the
paper), with the online softmax (Milakov & Gimelshein 2018) kept in registers in base 2: exp2 with
log2(e) folded into the scale. The key range of each query block is cut into blocks that are fully
visible (no mask arithmetic at all) and blocks on a mask edge (causal diagonal, window edge, ragged
end); blocks nobody can see are never loaded.

Supports: causal (bottom-right aligned), sliding windows `window_size=(left, right)`, ALiBi slopes
of shape (H,) or (B, H), GQA/MQA (K/V with H_kv heads, H % H_kv == 0), any N_q, N_k >= 1, head dims
16, 32, 64, 128, 256, fp16, bf16 and fp32 inputs (fp32 dots in full IEEE precision, not tf32), fp32
accumulation.
Limits: no dropout; the last dimension must be contiguous (other strides are free; a tensor whose
last dimension is strided is copied once); under the interpreter bf16 tiles are upcast to fp32
before `tl.dot` (the interpreter's bf16 dot is wrong), so CPU runs are slightly more exact than the
GPU for bf16.

Measured on an H200 (notebooks/results/GPU_NOTES.md): 1.27-1.57x PyTorch SDPA's FLASH backend
forward and 1.19-1.34x forward + backward at N >= 2048, bf16/fp16, d 64/128; 0.67-0.97x its cuDNN
backend. Tuned only where benchmarked (fp16/bf16, d 64 and 128, no window or ALiBi); elsewhere the
first config of each table runs.

Introduced in notebooks/06_triton_forward.ipynb (forward) and notebooks/07_triton_backward.ipynb
(backward).
"""

from __future__ import annotations

import torch
import triton  # noqa: E402  (after _env, which may set TRITON_INTERPRET)
import triton.language as tl  # noqa: E402

from .autograd import flash_attention
from .triton_backward import backward  # noqa: F401  (defined beside its kernels; re-exported)
from .triton_common import LOG2E, alibi, block_range, visible
from .triton_launch import (  # noqa: F401
    DTYPES,
    HEAD_DIMS,
    INTERPRETER,
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


@triton.jit
def _fwd_inner(
    acc,
    l_i,
    m_i,
    q,
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
    SCALE_POS: tl.constexpr,
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
        if MASK:  # HBM: read BLOCK_N * d of K (rows past N_k read as 0)
            k = tl.load(k_ptrs, mask=cols[:, None] < N_k, other=0.0)
        else:
            k = tl.load(k_ptrs)
        if UPCAST:
            k = k.to(tl.float32)
        qk = tl.dot(
            q, tl.trans(k), input_precision=PRECISION
        )  # (BLOCK_M, BLOCK_N), in SRAM/registers only
        if HAS_ALIBI or MASK:
            s = qk * qk_scale
            if HAS_ALIBI:
                s += alibi(slope2, rows, cols, offset)
            if MASK:
                s = tl.where(
                    visible(rows, cols, N_k, offset, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT),
                    s,
                    -float("inf"),
                )
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(
                m_new == -float("inf"), 0.0, m_new
            )  # a row with nothing visible yet stays 0
            p = tl.math.exp2(s - m_use[:, None])
        else:  # exp2 with log2(e) folded into qk_scale: one FMA per score
            if SCALE_POS:
                m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            else:
                m_new = tl.maximum(m_i, tl.min(qk, 1) * qk_scale)
            m_use = m_new
            p = tl.math.exp2(qk * qk_scale - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)  # rescale because the row max moved
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if MASK:  # HBM: read BLOCK_N * d of V
            v = tl.load(v_ptrs, mask=cols[:, None] < N_k, other=0.0)
        else:
            v = tl.load(v_ptrs)
        if UPCAST:
            v = v.to(tl.float32)
        acc = tl.dot(
            p.to(v.dtype), v, acc, input_precision=PRECISION
        )  # (BLOCK_M, d) += (BLOCK_M, BLOCK_N) @ (BLOCK_N, d)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["N_q", "N_k", "LEFT", "RIGHT", "H", "GROUP", "N_KEY", "stride_sb"])
def _attn_fwd(
    Q,
    K,
    V,
    O,
    LSE,
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
    stride_ob,
    stride_oh,
    stride_om,
    stride_sb,
    qk_scale,
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
    SCALE_POS: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (batch, head). Grid (cdiv(N_q, BLOCK_M), B * H)."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest (last) causal blocks start first
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    Q += b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    O += b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    K += (
        b.to(tl.int64) * stride_kb + (h // GROUP).to(tl.int64) * stride_kh
    )  # GQA: H // H_kv heads share K/V
    V += b.to(tl.int64) * stride_vb + (h // GROUP).to(tl.int64) * stride_vh
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    offset = N_k - N_q
    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = tl.load(SLOPES + b * stride_sb + h) * 1.4426950408889634
    # q_i stays in SRAM for the whole K/V loop.  HBM: read BLOCK_M * d of Q
    q = tl.load(Q + rows[:, None] * stride_qm + dims[None, :], mask=rows[:, None] < N_q, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    last = tl.minimum(pid_m * BLOCK_M + BLOCK_M, N_q) - 1
    lo, full_lo, full_hi, hi = block_range(
        pid_m * BLOCK_M, last, N_k, offset, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT, BLOCK_N
    )
    # Three stretches of keys: left mask edge (window), fully visible middle, right mask edge
    # (causal diagonal).
    if HAS_LEFT:
        acc, l_i, m_i = _fwd_inner(
            acc,
            l_i,
            m_i,
            q,
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
            SCALE_POS,
            UPCAST,
            PRECISION,
            BLOCK_N,
            HEAD_DIM,
        )
    acc, l_i, m_i = _fwd_inner(
        acc,
        l_i,
        m_i,
        q,
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
        SCALE_POS,
        UPCAST,
        PRECISION,
        BLOCK_N,
        HEAD_DIM,
    )
    acc, l_i, m_i = _fwd_inner(
        acc,
        l_i,
        m_i,
        q,
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
        SCALE_POS,
        UPCAST,
        PRECISION,
        BLOCK_N,
        HEAD_DIM,
    )
    empty = l_i == 0.0  # fully masked row: o = 0, lse = -inf
    l_use = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, -float("inf"), (m_i + tl.math.log2(l_use)) * 0.6931471805599453)
    tl.store(LSE + bh.to(tl.int64) * N_q + rows, lse, mask=rows < N_q)  # HBM: write BLOCK_M
    o = acc / l_use[:, None]
    tl.store(
        O + rows[:, None] * stride_om + dims[None, :],
        o.to(O.dtype.element_ty),  # HBM: write BLOCK_M * d
        mask=rows[:, None] < N_q,
    )


# --------------------------------------------------------------------------------------------------
# Launch: autotuned on a GPU over this table (flashedu.triton_launch),
# one fixed config under the interpreter
# --------------------------------------------------------------------------------------------------
def _fwd_table(d, wide):
    """(BLOCK_M, BLOCK_N, warps, stages) candidates; the first is used untuned (fp32, d 16/32/256,
    window, ALiBi). Chosen from sm_90 compiles without register spills and H200 timings
    (notebooks/results/GPU_NOTES.md)."""
    if wide:  # fp32: IEEE dots run on FMA units, small tiles
        return [(32, 16, 4, 2)] if d <= 64 else [(16, 16, 4, 2)]
    if d <= 64:
        return [(128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 4, 3), (128, 64, 8, 3)]
    if d == 128:
        return [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4)]
    return [(64, 32, 4, 3)]


_attn_fwd_tuned = autotuned(_attn_fwd, _fwd_table, MASK_KEY)


# --------------------------------------------------------------------------------------------------
# Public API: forward, backward (flashedu.triton_backward), attention (autograd)
# --------------------------------------------------------------------------------------------------
def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size=None,
    alibi_slopes=None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention with the Triton forward kernel.

    Args:
        q: (B, H, N_q, d); k, v: (B, H_kv, N_k, d), H % H_kv == 0. fp16, bf16 or fp32;
            d in {16, 32, 64, 128, 256}. CUDA tensors on a GPU machine; CPU tensors under the
            interpreter.
        causal: query i sees key j iff j <= i + N_k - N_q (bottom-right aligned).
        softmax_scale: multiplies q @ k.T before the softmax; default 1 / sqrt(d).
        window_size: (left, right) keys visible around the diagonal, -1 = unbounded; see
            `masks.visible`.
        alibi_slopes: (H,) or (B, H); adds -slope * |i + N_k - N_q - j| to the scaled scores.
        block_m, block_n, num_warps, num_stages: a fixed launch config (B_r, B_c in the paper)
            instead of the autotuned one; block sizes are powers of two >= 16.
    Returns:
        o: (B, H, N_q, d) in q's dtype, 0 on fully masked rows.
        lse: (B, H, N_q) float32, natural-log logsumexp of each scaled score row
            (-inf if fully masked).
    """
    (B, H, H_kv, N_q, N_k, d), scale, bounds, slopes, stride_sb = check_inputs(
        q, k, v, causal, softmax_scale, window_size, alibi_slopes, "triton_attention.forward"
    )
    config = launch_config(block_m, block_n, num_warps, num_stages)
    q, k, v = rows_contiguous(q), rows_contiguous(k), rows_contiguous(v)
    flags, left, right = kernel_flags(q, scale, bounds, slopes is not None)
    o = torch.empty(q.shape, device=q.device, dtype=out_dtype(q, flags))
    lse = torch.empty((B, H, N_q), device=q.device, dtype=torch.float32)
    slopes = lse if slopes is None else slopes  # any float32 pointer when there is no ALiBi
    args = (
        q,
        k,
        v,
        o,
        lse,
        slopes,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *o.stride()[:3],
        stride_sb,
        scale * LOG2E,
        H,
        H // H_kv,
        N_q,
        N_k,
        left,
        right,
        n_key(N_q, N_k),
    )
    grid = lambda meta: (triton.cdiv(N_q, meta["BLOCK_M"]), B * H)  # noqa: E731
    launch(_attn_fwd_tuned, _attn_fwd, grid, args, dict(flags, SCALE_POS=scale >= 0), config)
    return o.to(q.dtype), lse


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size=None,
    alibi_slopes=None,
) -> torch.Tensor:
    """Autograd-aware Triton attention, (B, H, N_q, d): `forward` and `backward` inside
    `flashedu.autograd.FlashAttention`, which saves q, k, v, o and lse (O(N) memory) for the
    backward kernels."""
    return flash_attention(
        q,
        k,
        v,
        causal=causal,
        softmax_scale=softmax_scale,
        impl="triton",
        window_size=window_size,
        alibi_slopes=alibi_slopes,
    )
