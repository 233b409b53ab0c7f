"""FlashAttention-2 in Triton: the forward kernel and its launcher.

One source runs everywhere: on a CUDA GPU it compiles to tensor-core code (autotuned block sizes,
warps and pipeline stages); on a machine without one, `flashedu._env` has set TRITON_INTERPRET=1
before triton loaded, so the same kernels run on CPU tensors, slowly, with one small fixed block
size. The backward kernels live in `flashedu.kernels.bwd`; validation and autotuning in
`flashedu.kernels.launch`; `flashedu.kernels.forward` / `backward` are the registry's "triton"
entry, and `flashedu.attention(..., impl="triton")` the autograd-aware call.

Structure (Dao 2023, FlashAttention-2, Alg. 1): one program per (block of BLOCK_M query rows, batch,
head). q_i stays on chip while K and V stream past in blocks of BLOCK_N rows (B_r and B_c in the
paper), with the online softmax (Milakov & Gimelshein 2018) kept in registers in base 2: exp2 with
log2(e) folded into the scale. The key range of each query block is cut into blocks that are fully
visible (no mask arithmetic at all) and blocks on a mask edge (causal diagonal, window edge, ragged
end); blocks nobody can see are never loaded.

Supports: causal (bottom-right aligned), sliding windows `window_size=(left, right)`, a score mod
applied to every tile of scores (`score_mod`, `flashedu.kernels.score_mods`; ALiBi slopes of shape
(H,) or
(B, H) are one), GQA/MQA (K/V with H_kv heads, H % H_kv == 0), any N_q, N_k >= 1, any head dim d
from 1 to 256 and a value head dim d_v of its own (tiles padded to a power of two with masked loads,
`flashedu.kernels.tiles`), packed sequences in one launch (`flashedu.kernels.varlen`), fp16, bf16
and fp32 inputs (fp32 dots in full IEEE precision, not tf32), fp32 accumulation.
Limits: no dropout; the last dimension must be contiguous (other strides are free; a tensor whose
last dimension is strided is copied once); a padded head dim computes on the padded width (d = 80
costs what d = 128 does) unless it runs in two chunks (`launch.SPLIT_HEAD_DIMS`: 80, 96 and 192,
where the H200 measured it faster; 192 = 128 + 64 does three quarters of the padded matmul work);
`flashedu.attention(impl="auto")` zero-pads some head dims to the Hopper kernels' width instead
(`hopper.dispatch.pad_width`); under the interpreter bf16
tiles are upcast to fp32 before `tl.dot` (the interpreter's bf16 dot is wrong), so CPU runs are
slightly more exact than the GPU for bf16.

Measured on an H200 (notebooks/results/GPU_NOTES.md): 1.27-1.57x PyTorch SDPA's FLASH backend
forward and 1.19-1.34x forward + backward at N >= 2048, bf16/fp16, d 64/128; 0.67-0.97x its cuDNN
backend. Tuned only where benchmarked (fp16/bf16, d 64 and 128 with d_v = d, no window, score mod or
packing); elsewhere the first config of its tile width's table runs, untuned.

Introduced in notebooks/06_triton_forward.ipynb (forward) and notebooks/07_triton_backward.ipynb
(backward).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._nonfinite import poison_hidden_values
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
    strides,
)
from .score_mods import mod_scores
from .tiles import load_tile, store_tile


@triton.jit
def _fwd_inner(
    acc, acc2, l_i, m_i, q, q2, K, V, stride_kn, stride_vn, start, end, rows, b, h, ARGS, sm_scale,
    N_k, offset, LEFT, RIGHT,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SCORE_MOD: tl.constexpr,
    HAS_MOD: tl.constexpr, MASK: tl.constexpr, SCALE_POS: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_D2: tl.constexpr,
    BLOCK_DV2: tl.constexpr,
):  # fmt: skip
    """Stream key blocks start..end past the query tile. q2, acc2: the second chunk of q and of
    the output's accumulator (`tiles.chunk_dims`) when BLOCK_D2 / BLOCK_DV2 > 0, else unused."""
    qk_scale = sm_scale * 1.4426950408889634  # exp2 with log2(e) folded into the scale
    dims = tl.arange(0, BLOCK_D)
    dims_v = tl.arange(0, BLOCK_DV)
    for start_n in tl.range(start, end, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        # HBM: read BLOCK_N * d of K (rows past N_k and columns past d read as 0)
        k = load_tile(K + cols[:, None] * stride_kn + dims[None, :], cols, N_k, dims,
                      HEAD_DIM, BLOCK_D, MASK)  # fmt: skip
        if UPCAST:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (BLOCK_M, BLOCK_N), on chip only
        if BLOCK_D2 > 0:  # q . k over the head dim's second chunk, added into the same scores
            dims2 = BLOCK_D + tl.arange(0, BLOCK_D2)
            k2 = load_tile(K + cols[:, None] * stride_kn + dims2[None, :], cols, N_k, dims2,
                           HEAD_DIM, BLOCK_D + BLOCK_D2, MASK)  # fmt: skip
            if UPCAST:
                k2 = k2.to(tl.float32)
            qk = tl.dot(q2, tl.trans(k2), qk, input_precision=PRECISION)
        if HAS_MOD or MASK:
            if HAS_MOD:  # the score mod sees scaled scores and positions aligned with the keys
                s = mod_scores(qk, sm_scale, b, h, rows[:, None] + offset, cols[None, :], ARGS,
                               SCORE_MOD)  # fmt: skip
            else:
                s = qk * qk_scale
            if MASK:
                keep = visible(rows, cols, N_k, offset, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT)
                s = tl.where(keep, s, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == -float("inf"), 0.0, m_new)  # nothing visible yet: stay 0
            p = tl.math.exp2(s - m_use[:, None])
        else:  # one FMA per score
            if SCALE_POS:
                m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            else:
                m_new = tl.maximum(m_i, tl.min(qk, 1) * qk_scale)
            m_use = m_new
            p = tl.math.exp2(qk * qk_scale - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)  # rescale because the row max moved
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if BLOCK_DV2 > 0:
            acc2 = acc2 * alpha[:, None]
        # HBM: read BLOCK_N * d_v of V
        v = load_tile(V + cols[:, None] * stride_vn + dims_v[None, :], cols, N_k, dims_v,
                      V_DIM, BLOCK_DV, MASK)  # fmt: skip
        if UPCAST:
            v = v.to(tl.float32)
        # (BLOCK_M, d_v) += (BLOCK_M, BLOCK_N) @ (BLOCK_N, d_v)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        if BLOCK_DV2 > 0:  # the value's second chunk: its own accumulator
            dims_v2 = BLOCK_DV + tl.arange(0, BLOCK_DV2)
            v2 = load_tile(V + cols[:, None] * stride_vn + dims_v2[None, :], cols, N_k, dims_v2,
                           V_DIM, BLOCK_DV + BLOCK_DV2, MASK)  # fmt: skip
            if UPCAST:
                v2 = v2.to(tl.float32)
            acc2 = tl.dot(p.to(v2.dtype), v2, acc2, input_precision=PRECISION)
        m_i = m_new
    return acc, acc2, l_i, m_i


@triton.jit(do_not_specialize=["N_q", "N_k", "LEFT", "RIGHT", "H", "GROUP", "N_KEY", "stride_lb",
                               "stride_lh", "stride_ab", "stride_ah"])  # fmt: skip
def _attn_fwd(
    Q, K, V, O, LSE, MOD_ARGS, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh,
    stride_vn, stride_ob, stride_oh, stride_om, stride_lb, stride_lh, stride_ab, stride_ah,
    sm_scale, H, GROUP, N_q, N_k, LEFT, RIGHT, N_KEY,
    HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SCORE_MOD: tl.constexpr,
    HAS_MOD: tl.constexpr, VARLEN: tl.constexpr, SCALE_POS: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D2: tl.constexpr = 0, BLOCK_DV2: tl.constexpr = 0,
):  # fmt: skip
    """One program: BLOCK_M query rows of one (batch, head). Grid (cdiv(N_q, BLOCK_M), B * H).
    VARLEN: batch b is packed sequence b, whose rows CU_Q[b]..CU_Q[b+1] and keys CU_K[b]..CU_K[b+1]
    replace N_q and N_k; the grid covers the longest sequence and the other programs stop early.
    BLOCK_D2, BLOCK_DV2 > 0: the head dims in two chunks each (`tiles.chunk_dims`)."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest (last) causal blocks start first
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
    K += b.to(tl.int64) * stride_kb + (h // GROUP).to(tl.int64) * stride_kh + k_start * stride_kn
    V += b.to(tl.int64) * stride_vb + (h // GROUP).to(tl.int64) * stride_vh + k_start * stride_vn
    ARGS = MOD_ARGS + b * stride_ab + h * stride_ah  # this (batch, head)'s score-mod arguments
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    dims_v = tl.arange(0, BLOCK_DV)
    offset = N_k - N_q
    # q_i stays in SRAM for the whole K/V loop.  HBM: read BLOCK_M * d of Q
    q = load_tile(Q + rows[:, None] * stride_qm + dims[None, :], rows, N_q, dims, HEAD_DIM,
                  BLOCK_D, True)  # fmt: skip
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    q2 = q  # one chunk: unused stand-ins
    acc2 = l_i
    if BLOCK_D2 > 0:  # the head dim's second chunk of q (columns BLOCK_D..), masked past d
        dims2 = BLOCK_D + tl.arange(0, BLOCK_D2)
        q2 = load_tile(Q + rows[:, None] * stride_qm + dims2[None, :], rows, N_q, dims2,
                       HEAD_DIM, BLOCK_D + BLOCK_D2, True)  # fmt: skip
        if UPCAST:
            q2 = q2.to(tl.float32)
    if BLOCK_DV2 > 0:
        acc2 = tl.zeros([BLOCK_M, BLOCK_DV2], dtype=tl.float32)
    last = tl.minimum(pid_m * BLOCK_M + BLOCK_M, N_q) - 1
    lo, full_lo, full_hi, hi = block_range(
        pid_m * BLOCK_M, last, N_k, offset, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT, BLOCK_N
    )
    # Three stretches of keys: left mask edge (window), fully visible middle, right mask edge
    # (causal diagonal).
    if HAS_LEFT:
        acc, acc2, l_i, m_i = _fwd_inner(
            acc, acc2, l_i, m_i, q, q2, K, V, stride_kn, stride_vn, lo, full_lo, rows, b, h, ARGS,
            sm_scale, N_k, offset, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT, SCORE_MOD, HAS_MOD, True,
            SCALE_POS, UPCAST, PRECISION, BLOCK_N, HEAD_DIM, V_DIM, BLOCK_D, BLOCK_DV, BLOCK_D2,
            BLOCK_DV2,
        )  # fmt: skip
    acc, acc2, l_i, m_i = _fwd_inner(
        acc, acc2, l_i, m_i, q, q2, K, V, stride_kn, stride_vn, full_lo, full_hi, rows, b, h, ARGS,
        sm_scale, N_k, offset, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT, SCORE_MOD, HAS_MOD, False,
        SCALE_POS, UPCAST, PRECISION, BLOCK_N, HEAD_DIM, V_DIM, BLOCK_D, BLOCK_DV, BLOCK_D2,
        BLOCK_DV2,
    )  # fmt: skip
    acc, acc2, l_i, m_i = _fwd_inner(
        acc, acc2, l_i, m_i, q, q2, K, V, stride_kn, stride_vn, full_hi, hi, rows, b, h, ARGS,
        sm_scale, N_k, offset, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT, SCORE_MOD, HAS_MOD, True,
        SCALE_POS, UPCAST, PRECISION, BLOCK_N, HEAD_DIM, V_DIM, BLOCK_D, BLOCK_DV, BLOCK_D2,
        BLOCK_DV2,
    )  # fmt: skip
    empty = l_i == 0.0  # fully masked row: o = 0, lse = -inf
    l_use = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, -float("inf"), (m_i + tl.math.log2(l_use)) * 0.6931471805599453)
    LSE += b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + q_start
    tl.store(LSE + rows, lse, mask=rows < N_q)  # HBM: write BLOCK_M
    o = acc / l_use[:, None]
    O += b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + q_start * stride_om
    # HBM: write BLOCK_M * d_v
    store_tile(O + rows[:, None] * stride_om + dims_v[None, :], o.to(O.dtype.element_ty), rows,
               N_q, dims_v, V_DIM, BLOCK_DV)  # fmt: skip
    if BLOCK_DV2 > 0:
        dims_v2 = BLOCK_DV + tl.arange(0, BLOCK_DV2)
        o2 = acc2 / l_use[:, None]
        store_tile(O + rows[:, None] * stride_om + dims_v2[None, :], o2.to(O.dtype.element_ty),
                   rows, N_q, dims_v2, V_DIM, BLOCK_DV + BLOCK_DV2)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Launch: autotuned on a GPU over this table (flashedu.kernels.launch),
# one fixed config under the interpreter
# --------------------------------------------------------------------------------------------------
def fwd_table(d, wide):
    """(BLOCK_M, BLOCK_N, warps, stages) candidates for tile width d (`launch.tile_width`);
    the first is used untuned (fp32, head dims other than 64 and 128, Ev != E, window, score mod,
    packed sequences). Chosen from sm_90 compiles without register spills and H200 timings
    (notebooks/results/GPU_NOTES.md); the 16, 32 and 256 rows are the safe first entries only.
    Public for the GPU check (`flashedu.bench.gpu_check`), which compiles and checks every entry."""
    if wide:  # fp32: IEEE dots run on FMA units, small tiles
        return [(32, 16, 4, 2)] if d <= 64 else [(16, 16, 4, 2)]
    if d <= 64:
        return [(128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 4, 3), (128, 64, 8, 3)]
    if d == 128:
        return [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4)]
    # Two-chunk widths (launch.SPLIT_HEAD_DIMS; 80 = 64 + 16, 96 = 64 + 32, 144-192 = 128 + 16-64):
    # tiles that fit shared memory on sm_90a (scripts/hopper/compile_fa2.py, GPU_NOTES.md "Head
    # dims in two chunks"), fastest first by the H200 sweep (notebooks/results/h200_headdims.json:
    # at d = 96, 1.01 / 0.63 ms non-causal / causal against 1.08 / 0.63 for (128, 64, 8, 3); at
    # d = 192, 1.66 / 1.11 against 1.81 / 1.31 for (128, 64, 8, 2)).
    if d < 128:
        return [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 2)]
    if d <= 192:
        return [(128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 3)]
    # d 129-256 padded: the fastest of five tiles on the H200 (GPU_NOTES.md, "Gluon backward",
    # run 4: 2.01 ms at d = 192 against 3.46 for the former (64, 32, 4, 3))
    return [(128, 64, 8, 2)]


_attn_fwd_tuned = autotuned(_attn_fwd, fwd_table, MASK_KEY)
# The autotuned kernel by pass, for the GPU check's report of the config each key kept (on a GPU
# the kernel's `cache` maps an autotune key to its config; under the interpreter it has none).
AUTOTUNED = {"fwd": _attn_fwd_tuned}


def run_forward(q, k, v, pl: Plan, config, cu=None, max_seqlen_q=None, out=None):
    """Launch the forward kernel for a plan: o (B, H, N_q, d_v) and lse (B, H, N_q).

    Packed sequences (cu = (cu_seqlens_q, cu_seqlens_k) int32): q, k, v are (1, H, total, d) views
    of the packed tensors, the grid covers `max_seqlen_q` rows, and lse is (1, H, total_q). `out`:
    where to write o (any strides, unit stride along d_v), in `out_dtype`."""
    q, k, v = rows_contiguous(q), rows_contiguous(k), rows_contiguous(v)
    o = (
        q.new_empty((*q.shape[:3], v.shape[-1]), dtype=out_dtype(q, pl.flags))
        if out is None
        else out
    )
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    packed = cu is not None
    cu_q, cu_k = cu if packed else (lse, lse)  # any pointer when not packed
    args = (
        q, k, v, o, lse, pl.mod_pointer(lse), cu_q, cu_k,
        *strides(q, packed), *strides(k, packed), *strides(v, packed), *strides(o, packed),
        0 if packed else lse.stride(0), lse.stride(1), pl.stride_ab, pl.stride_ah,
        pl.scale, pl.H, pl.H // pl.H_kv, pl.N_q, pl.N_k, pl.left, pl.right,
        n_key(pl.N_q, pl.N_k) if cu is None else n_key(max_seqlen_q, max_seqlen_q),
    )  # fmt: skip
    rows = pl.N_q if cu is None else max_seqlen_q
    grid = lambda meta: (triton.cdiv(rows, meta["BLOCK_M"]), pl.B * pl.H)
    kw = dict(pl.flags, SCALE_POS=pl.scale >= 0)
    launch(_attn_fwd_tuned, _attn_fwd, grid, args, kw, config)
    return o.to(q.dtype), lse


# --------------------------------------------------------------------------------------------------
# Public API: forward (the backward is flashedu.kernels.bwd.backward)
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
    score_mod=None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention with the Triton forward kernel.

    Args:
        q: (B, H, N_q, d); k: (B, H_kv, N_k, d); v: (B, H_kv, N_k, d_v), H % H_kv == 0. fp16,
            bf16 or fp32; any d, d_v from 1 to 256. CUDA tensors on a GPU machine; CPU tensors
            under the interpreter.
        causal: query i sees key j iff j <= i + N_k - N_q (bottom-right aligned).
        softmax_scale: multiplies q @ k.T before the softmax; default 1 / sqrt(d).
        window_size: (left, right) keys visible around the diagonal, -1 = unbounded; see
            `masks.visible`.
        alibi_slopes: (H,) or (B, H); adds -slope * |i + N_k - N_q - j| to the scaled scores
            (the score mod `score_mods.alibi`).
        score_mod: a `@triton.jit` function (score, b, h, q_idx, kv_idx, args) -> score applied to
            every tile of scaled scores, or a `score_mods.ScoreMod` (with args and a gradient);
            see `flashedu.kernels.score_mods`.
        block_m, block_n, num_warps, num_stages: a fixed launch config (B_r, B_c in the paper)
            instead of the autotuned one; block sizes are powers of two >= 16.
    Returns:
        o: (B, H, N_q, d_v) in q's dtype, 0 on fully masked rows.
        lse: (B, H, N_q) float32, natural-log logsumexp of each scaled score row
            (-inf if fully masked).
    """
    name = "kernels.forward"
    pl = plan(q, k, v, causal, softmax_scale, window_size, alibi_slopes, score_mod, name)
    o, lse = run_forward(q, k, v, pl, launch_config(block_m, block_n, num_warps, num_stages))
    left = pl.left if pl.flags["HAS_LEFT"] else -1
    right = pl.right if pl.flags["HAS_RIGHT"] else -1
    return poison_hidden_values(o, v, pl.N_q, left, right), lse  # non-finite v: as the reference
