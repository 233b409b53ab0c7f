"""The forward kernel chapter 06 reads: FlashAttention-2 in one Triton kernel of 21 parameters.

One program per (block of BLOCK_M query rows, batch x head). q_i stays on chip while K and V stream
past in blocks of BLOCK_N rows, with the online softmax in registers, in base 2 (exp2, with log2(e)
folded into the scale). Causal attention is bottom-right aligned, as everywhere in flashedu: query i
sees key j iff j <= i + N_k - N_q; the key blocks past the diagonal are never loaded, and a row that
sees no key gets o = 0 and lse = -inf. Any N_q, N_k >= 1.

What it leaves out, and `flashedu.kernels.fwd` (the general kernel, the registry's "triton") has:
GQA, sliding windows, ALiBi and score mods, packed sequences, any head dim from 1 to 256 and a value
head dim of its own, a key loop without mask arithmetic away from the diagonal, and autotuned
launch configs. tests/kernels/test_teach.py holds the two equal on the cases both support.

Limits: q, k, v of one shape (B, H, N, d) apart from N_q and N_k; d in 16, 32, 64, 128; fp16, bf16,
fp32 (fp32 dots in IEEE precision). Under the interpreter bf16 inputs are upcast to fp32 before the
launch (the interpreter's bf16 dot is wrong).

Introduced in notebooks/06_triton_forward.ipynb.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..validation import check_causal, check_qkv, resolve_scale
from .common import LOG2E
from .launch import DTYPES, INTERPRETER

HEAD_DIMS = (16, 32, 64, 128)  # powers of two: tl.arange and tl.dot take whole tiles


@triton.jit
def attn_fwd(
    Q, K, V, O, LSE,
    stride_qh, stride_qm, stride_kh, stride_kn, stride_vh, stride_vn, stride_oh, stride_om,
    qk_scale, N_q, N_k,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(N_q, BLOCK_M), B * H). Q, K, V, O: (B * H, N, d) with unit stride along d; LSE:
    (B * H, N_q). qk_scale = softmax_scale * log2(e)."""
    start_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # one (batch, head) pair
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    Q += bh * stride_qh
    K += bh * stride_kh
    V += bh * stride_vh
    # q_i stays in SRAM for the whole K/V loop.  HBM: read BLOCK_M * d of Q
    q = tl.load(Q + rows[:, None] * stride_qm + dims[None, :], mask=rows[:, None] < N_q, other=0.0)
    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)  # running row max (base 2)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running row sum
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # running o_i, unnormalised
    offset = N_k - N_q  # causal, bottom-right: key j is visible to query i iff j <= i + offset
    hi = N_k
    if CAUSAL:  # blocks right of the diagonal are never loaded
        hi = tl.minimum(N_k, tl.minimum(start_m * BLOCK_M + BLOCK_M, N_q) + offset)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        # HBM: read BLOCK_N * d of K
        k = tl.load(
            K + cols[:, None] * stride_kn + dims[None, :], mask=cols[:, None] < N_k, other=0.0
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        keep = cols[None, :] < N_k
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None] + offset)
        s = tl.where(keep, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == -float("inf"), 0.0, m_new)  # nothing visible yet: stay 0
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)  # rescale because the row max moved
        l_i = l_i * alpha + tl.sum(p, 1)
        # HBM: read BLOCK_N * d of V
        v = tl.load(
            V + cols[:, None] * stride_vn + dims[None, :], mask=cols[:, None] < N_k, other=0.0
        )
        # (BLOCK_M, d) += (BLOCK_M, BLOCK_N) @ (BLOCK_N, d)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    empty = l_i == 0.0  # a row that sees no key: o = 0, lse = -inf
    l_use = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, -float("inf"), (m_i + tl.math.log2(l_use)) * 0.6931471805599453)
    tl.store(LSE + bh * N_q + rows, lse, mask=rows < N_q)  # HBM: write BLOCK_M
    O += bh * stride_oh
    o = acc / l_use[:, None]  # HBM: write BLOCK_M * d
    tl.store(O + rows[:, None] * stride_om + dims[None, :], o.to(O.dtype.element_ty),
             mask=rows[:, None] < N_q)  # fmt: skip


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
    """Exact attention with the teaching kernel.

    Args:
        q: (B, H, N_q, d); k, v: (B, H, N_k, d), d in 16, 32, 64, 128; fp16, bf16 or fp32. CUDA
            tensors on a GPU machine, CPU tensors under the interpreter.
        causal: query i sees key j iff j <= i + N_k - N_q (bottom-right aligned).
        softmax_scale: multiplies q @ k.T before the softmax; default 1 / sqrt(d).
        block_m, block_n: tile heights (B_r, B_c), powers of two >= 16; default 16 under the
            interpreter, 64 on a GPU.
    Returns:
        o: (B, H, N_q, d) in q's dtype, 0 on fully masked rows.
        lse: (B, H, N_q) float32, natural-log logsumexp of each scaled score row (-inf if fully
            masked).
    """
    name = "kernels.teach.forward"
    B, H, H_kv, N_q, N_k, d = check_qkv(q, k, v, name=name, kind="torch")
    if H_kv != H:
        raise ValueError(
            f"{name}: k and v must have q's {H} heads, got {H_kv} (GQA is in kernels.forward)"
        )
    if d not in HEAD_DIMS:
        raise ValueError(
            f"{name}: head dimension d must be one of {HEAD_DIMS}, got {d} "
            "(kernels.forward takes any d from 1 to 256)"
        )
    if q.dtype not in DTYPES:
        raise TypeError(f"{name}: dtype must be float16, bfloat16 or float32, got {q.dtype}")
    if not INTERPRETER and q.device.type != "cuda":
        raise ValueError(f"{name}: q, k, v must be CUDA tensors on a GPU machine, got {q.device}")
    scale = resolve_scale(softmax_scale, d, name=name)
    causal = check_causal(causal, name=name)
    block_m = block_m or (16 if INTERPRETER else 64)
    block_n = block_n or (16 if INTERPRETER else 64)
    for arg, size in (("block_m", block_m), ("block_n", block_n)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name}: {arg} must be a power of two >= 16, got {size}")
    work = torch.float32 if INTERPRETER and q.dtype == torch.bfloat16 else q.dtype
    # (B * H, N, d) views with unit stride along d (a copy only where the layout needs one)
    q3, k3, v3 = (x.to(work).reshape(B * H, x.shape[2], d).contiguous() for x in (q, k, v))
    o = torch.empty_like(q3)
    lse = torch.empty((B * H, N_q), device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(N_q, block_m), B * H)
    attn_fwd[grid](
        q3, k3, v3, o, lse,
        q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), v3.stride(0), v3.stride(1),
        o.stride(0), o.stride(1),
        scale * LOG2E, N_q, N_k,
        HEAD_DIM=d, CAUSAL=causal, PRECISION="ieee" if work == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n,
    )  # fmt: skip
    return o.reshape(B, H, N_q, d).to(q.dtype), lse.reshape(B, H, N_q)
