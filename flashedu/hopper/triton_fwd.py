"""FlashAttention forward for Hopper (sm_90) in Triton: tensor descriptors (TMA) and an FP8 path.

The FlashAttention-2 forward of `flashedu.kernels.fwd`, rebuilt around what Hopper adds. Q, K
and V reach shared memory through tensor descriptors: the copy engine (TMA) fetches whole tiles and
zero-fills rows past the end of a sequence, and Triton pipelines those copies under the warpgroup
matrix multiplies (`wgmma`). One program owns BLOCK_M query rows of one (batch, head); keys stream
past in blocks of BLOCK_N, in two stretches: blocks every row sees in full (no mask arithmetic),
then blocks on the causal diagonal or the ragged end (masked). Blocks no row sees are never read.

FP8: e4m3 Q and K with one scale per block of rows (BLOCK_M queries, BLOCK_N keys), e4m3 V with one
scale per channel. The Q and K scales fold into the softmax scale and V's into the epilogue, so the
inner loop pays one scalar multiply for them. P is rounded to e4m3 too, after a shift by 2^8 that
keeps small probabilities out of e4m3's subnormal range (the shift cancels in o = acc / l).
`quantize_fp8` makes the inputs, optionally after a random Hadamard rotation of Q and K (Q R (K
R)^T = Q K^T for an orthogonal R, while an outlier channel is spread over all d channels).

Contract (as the FA2 kernels): layout (B, H, N, d); K/V may have H_kv heads, H % H_kv == 0; causal
is bottom-right aligned (query i sees key j iff j <= i + N_k - N_q); any N_q, N_k >= 1; lse is the
natural-log log-sum-exp of the scaled scores, float32; a fully masked row gives o = 0, lse = -inf.

Measured on an H200 (notebooks/results/h200_hopper.json, one run; TFLOP/s, fwd):
  bf16, B=2, H=16, N=8192, d=128: 492 (causal 451) against cuDNN 606 (548), FA2 490 (472).
  bf16, B=4, H=16, N=4096, d=64:  435 (causal 357) against cuDNN 464 (411), FA2 410 (330).
  FP8, d=128, the 128 x 128 tile of FP8_CONFIGS: 629 (causal 550), 1.35x (1.31x) this module's bf16
  forward with the same tile, both from an earlier run (run B in GPU_NOTES.md); FP8 RMSE 1.9e-3 on
  gaussian inputs (bf16 8.2e-5), 1.3e-2 with outliers, 8.0e-3 with the rotation (bf16 2.7e-4).
So it reaches 0.72-0.94x cuDNN (fp16 and bf16), beats FA2 at d = 64 only (`use_hopper` says so), and
FP8 misses the 1.5x it was meant to reach. The Gluon forward (`flashedu.hopper.gluon_fwd`), which
overlaps the softmax with the next matmul as this kernel cannot, is what `flashedu.attention` runs
on sm_90 (`flashedu.hopper.dispatch`); this kernel serves the interpreter on CPU, and FP8.

Limits: forward only (a one-pass backward is `flashedu.hopper.triton_bwd`'s, slower on the H200 than
`flashedu.kernels.bwd`'s); fp16 and bf16 (and the FP8 path); head dims 64 and 128, anything else
raises `HopperUnsupported` (a ValueError), so a caller can hand over to the FA2 kernels; no windows,
ALiBi or dropout; no warp specialisation (Triton 3.6 compiles it for sm_90 only for a single loop
without a descriptor store, and that variant did not finish on the H200); CUDA tensors on an sm_90
GPU, or CPU tensors under TRITON_INTERPRET=1 (bf16 and e4m3 tiles are upcast there, since the
interpreter's low-precision dot is wrong).

Its measurements are read by notebooks/11_hopper.ipynb (FlashAttention-3 on Hopper).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

LOG2E = 1.4426950408889634  # exp(x) = exp2(x * log2(e))
LN2 = 0.6931471805599453
HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16)
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3 value
P_SHIFT = 8.0  # FP8 path: P is stored as 2^8 * exp(s - m), at most 256 < 448
_SHIFT = tl.constexpr(P_SHIFT)
_LN2 = tl.constexpr(LN2)


class HopperUnsupported(ValueError):
    """Valid attention inputs that this kernel does not take (head dim, dtype, device)."""


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ------------------------------------------------------------------------------------------------
# Kernel
# ------------------------------------------------------------------------------------------------
@triton.jit
def _fwd_loop(
    acc,
    l_i,
    m_i,
    q,
    desc_k,
    desc_v,
    SK,
    b,
    hk,
    start,
    end,
    rows,
    scale,
    N_k,
    offset,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    IS_FP8: tl.constexpr,
    SCALE_POS: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    shift = _SHIFT if IS_FP8 else 0.0
    for start_n in tl.range(start, end, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = desc_k.load([b, hk, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)  # TMA: BLOCK_N x d of K
        s_scale = scale
        if IS_FP8:
            s_scale = scale * tl.load(SK + start_n // BLOCK_N)  # this key block's descale
        if UPCAST:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k))  # (BLOCK_M, BLOCK_N) fp32, wgmma
        if MASK:  # causal diagonal or ragged end: keys past N_k were zero-filled, mask them too
            cols = start_n + tl.arange(0, BLOCK_N)
            keep = cols[None, :] < N_k
            if CAUSAL:
                keep = keep & (cols[None, :] <= rows[:, None] + offset)
            s = tl.where(keep, qk * s_scale, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == -float("inf"), 0.0, m_new)  # nothing visible yet: stay at 0
            p = tl.math.exp2(s - (m_use - shift)[:, None])
        else:
            if SCALE_POS:
                m_new = tl.maximum(m_i, tl.max(qk, 1) * s_scale)
            else:
                m_new = tl.maximum(m_i, tl.min(qk, 1) * s_scale)
            m_use = m_new
            p = tl.math.exp2(qk * s_scale - (m_use - shift)[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if IS_FP8:  # V is stored transposed, (d, N): wgmma wants fp8 operands K-major
            v = tl.trans(desc_v.load([b, hk, 0, start_n]).reshape(HEAD_DIM, BLOCK_N))
        else:
            v = desc_v.load([b, hk, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)  # TMA: BLOCK_N x d of V
        p = p.to(v.dtype)
        if UPCAST:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = tl.dot(p, v, acc)  # (BLOCK_M, d) += (BLOCK_M, BLOCK_N) @ (BLOCK_N, d)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _key_ranges(
    m0, N_q, N_k, offset, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Block-aligned (full_hi, hi): keys [0, full_hi) are visible to every row of the block, keys
    [full_hi, hi) need the mask (diagonal, ragged end), keys past hi are seen by no row."""
    hi = N_k
    full = N_k
    if CAUSAL:
        last = tl.minimum(m0 + BLOCK_M, N_q) - 1
        hi = tl.minimum(tl.maximum(last + offset + 1, 0), N_k)
        full = tl.minimum(tl.maximum(m0 + offset + 1, 0), N_k)
    hi = tl.cdiv(hi, BLOCK_N) * BLOCK_N
    full_hi = tl.minimum((full // BLOCK_N) * BLOCK_N, hi)
    return full_hi, hi


@triton.jit(do_not_specialize=["N_q", "N_k", "H", "GROUP", "N_QB", "N_KB"])
def _hopper_fwd(
    desc_q,
    desc_k,
    desc_v,
    O,
    LSE,
    SQ,
    SK,
    SV,
    qk_scale,
    H,
    GROUP,
    N_q,
    N_k,
    N_QB,
    N_KB,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    IS_FP8: tl.constexpr,
    SCALE_POS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (batch, head). Grid (cdiv(N_q, BLOCK_M), B * H)."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest causal blocks first
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP  # GQA: GROUP query heads share one K/V head
    m0 = pid_m * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    offset = N_k - N_q
    q = desc_q.load([b, h, m0, 0]).reshape(BLOCK_M, HEAD_DIM)  # TMA: BLOCK_M x d of Q, kept on chip
    scale = qk_scale
    if IS_FP8:
        scale = scale * tl.load(SQ + bh.to(tl.int64) * N_QB + pid_m)
        SK += (b * (H // GROUP) + hk).to(tl.int64) * N_KB
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    full_hi, hi = _key_ranges(m0, N_q, N_k, offset, CAUSAL, BLOCK_M, BLOCK_N)
    # keys every row sees in full (no mask), then the blocks on the diagonal / ragged end
    acc, l_i, m_i = _fwd_loop(
        acc, l_i, m_i, q, desc_k, desc_v, SK, b, hk, 0, full_hi, rows, scale, N_k, offset,
        False, CAUSAL, IS_FP8, SCALE_POS, UPCAST, BLOCK_N, HEAD_DIM,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_loop(
        acc, l_i, m_i, q, desc_k, desc_v, SK, b, hk, full_hi, hi, rows, scale, N_k, offset,
        True, CAUSAL, IS_FP8, SCALE_POS, UPCAST, BLOCK_N, HEAD_DIM,
    )  # fmt: skip
    shift = _SHIFT if IS_FP8 else 0.0
    empty = l_i == 0.0  # fully masked row: o = 0, lse = -inf
    l_use = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, -float("inf"), (m_i + tl.math.log2(l_use) - shift) * _LN2)
    tl.store(LSE + bh.to(tl.int64) * N_q + rows, lse, mask=rows < N_q)
    o = acc / l_use[:, None]
    if IS_FP8:  # V's per-channel descale
        dims = tl.arange(0, HEAD_DIM)
        o = o * tl.load(SV + (b * (H // GROUP) + hk).to(tl.int64) * HEAD_DIM + dims)[None, :]
    # O is a fresh contiguous (B, H, N_q, d) tensor: a plain masked store (as measured)
    dims = tl.arange(0, HEAD_DIM)
    o_ptrs = O + (bh.to(tl.int64) * N_q + rows)[:, None] * HEAD_DIM + dims[None, :]
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=rows[:, None] < N_q)  # HBM: BLOCK_M x d of O


# ------------------------------------------------------------------------------------------------
# Host side: which kernel, validation, descriptors, launch
# ------------------------------------------------------------------------------------------------
# (d, causal) -> (BLOCK_M, BLOCK_N, num_warps, num_stages): the fastest measured on the H200
# (notebooks/results/GPU_NOTES.md, "Hopper kernel"). FP8 tiles are 128 x 128 for both masks, so one
# set of block scales serves causal and non-causal calls.
CONFIGS = {
    (64, False): (128, 128, 4, 3),
    (64, True): (128, 64, 4, 3),
    (128, False): (128, 64, 8, 3),
    (128, True): (128, 64, 8, 3),
}
FP8_CONFIGS = {
    (64, False): (128, 128, 4, 3),
    (64, True): (128, 128, 8, 3),
    (128, False): (128, 128, 8, 2),
    (128, True): (128, 128, 8, 2),
}
FASTER_THAN_FA2 = (64,)  # head dims where this forward beat the FA2 kernel in the same run
INTERPRET_CONFIG = (16, 16, 4, 1)


def supports(capability, dtype, head_dim: int) -> bool:
    """True where this kernel runs and was measured: capability (9, 0), fp16/bf16, d 64 or 128."""
    return tuple(capability) == (9, 0) and dtype in DTYPES and head_dim in HEAD_DIMS


def prefer_hopper(capability, dtype, head_dim: int) -> bool:
    """`supports` and measured faster than the FA2 kernel: head dims in FASTER_THAN_FA2 (d = 64; at
    d = 128 the FA2 kernel was as fast or faster in the same run)."""
    return supports(capability, dtype, head_dim) and head_dim in FASTER_THAN_FA2


def use_hopper(q, k, v) -> bool:
    """Whether `flashedu.attention(impl="auto")` should take this forward for (q, k, v): CUDA
    tensors, one head dim for q, k, v, and `prefer_hopper` for the device, dtype and head dim.
    False off Hopper, on CPU tensors and under the interpreter."""
    tensors = all(isinstance(x, torch.Tensor) for x in (q, k, v))
    if interpreting() or not tensors or q.device.type != "cuda" or q.ndim != 4:
        return False
    if k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1]:
        return False
    return prefer_hopper(torch.cuda.get_device_capability(q.device), q.dtype, q.shape[-1])


def config_for(d: int, causal: bool, *, fp8: bool = False) -> tuple:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for this head dim and mask."""
    if interpreting():
        return INTERPRET_CONFIG
    return (FP8_CONFIGS if fp8 else CONFIGS)[(d, bool(causal))]


def _check_tensors(q, k, v, name):
    for arg, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(x).__name__}")
        if x.ndim != 4:
            raise ValueError(f"{name}: {arg} must have shape (B, H, N, d), got {tuple(x.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"{name}: v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    (B, H, N_q, d), (B_k, H_kv, N_k, d_k) = q.shape, k.shape
    if B_k != B or d_k != d:
        raise ValueError(
            f"{name}: k must have q's batch {B} and head dim {d}, got shape {tuple(k.shape)}"
        )
    if H_kv < 1 or H % H_kv:
        raise ValueError(f"{name}: k/v heads must divide q's heads {H} (GQA), got H_kv={H_kv}")
    if N_q < 1 or N_k < 1:
        raise ValueError(f"{name}: sequence lengths must be >= 1, got N_q={N_q}, N_k={N_k}")
    if len({x.device for x in (q, k, v)}) > 1:
        raise ValueError(
            f"{name}: q, k, v must share a device, got {q.device}, {k.device}, {v.device}"
        )
    return B, H, H_kv, N_q, N_k, d


def _check_device(q, name):
    if not interpreting() and q.device.type != "cuda":
        raise HopperUnsupported(
            f"{name}: q, k, v must be CUDA tensors on an sm_90 GPU, got device {q.device} "
            "(CPU tensors run only under TRITON_INTERPRET=1)"
        )


def resolve_scale(softmax_scale, d, name):
    if softmax_scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(
            f"{name}: softmax_scale must be a real number or None, got {softmax_scale!r}"
        )
    if not math.isfinite(softmax_scale):
        raise ValueError(f"{name}: softmax_scale must be finite, got {softmax_scale!r}")
    return float(softmax_scale)


def check_inputs(q, k, v, causal, softmax_scale, name="hopper.triton_fwd.forward"):
    """Validate once, up front. Returns ((B, H, H_kv, N_q, N_k, d), scale)."""
    dims = _check_tensors(q, k, v, name)
    if not isinstance(causal, bool):
        raise TypeError(f"{name}: causal must be a bool, got {causal!r}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{name}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in DTYPES:
        raise HopperUnsupported(f"{name}: dtype must be float16 or bfloat16, got {q.dtype}")
    if dims[-1] not in HEAD_DIMS:
        raise HopperUnsupported(f"{name}: head dim must be one of {HEAD_DIMS}, got d={dims[-1]}")
    _check_device(q, name)
    return dims, resolve_scale(softmax_scale, dims[-1], name)


def tma_ready(x: torch.Tensor) -> torch.Tensor:
    """x itself if a tensor descriptor can address it (unit last stride, 16-byte aligned base and
    strides), else a contiguous copy."""
    size = x.element_size()
    aligned = x.data_ptr() % 16 == 0 and all((s * size) % 16 == 0 for s in x.stride()[:-1])
    return x if (x.stride(-1) == 1 and aligned) else x.contiguous()


def descriptor(x: torch.Tensor, rows: int, cols: int, shape=None) -> TensorDescriptor:
    """A 4-D descriptor over x (B, H, R, C) whose tile is one (rows, cols) block of one head.
    `shape` overrides the logical shape (the copy engine zero-fills reads past it)."""
    shape = list(x.shape if shape is None else shape)
    return TensorDescriptor(x, shape, list(x.stride()), [1, 1, rows, cols])


def _launch(descs, lse, scales, scale, dims, causal, config, is_fp8, upcast):
    B, H, H_kv, N_q, N_k, d = dims
    block_m, block_n, warps, stages = config
    grid = (triton.cdiv(N_q, block_m), B * H)
    _hopper_fwd[grid](
        *descs, lse, *scales, scale * LOG2E, H, H // H_kv, N_q, N_k,
        triton.cdiv(N_q, block_m), triton.cdiv(N_k, block_n),
        HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, IS_FP8=is_fp8,
        SCALE_POS=scale >= 0, UPCAST=upcast, num_warps=warps, num_stages=stages,
    )  # fmt: skip


def forward(q, k, v, *, causal=False, softmax_scale=None, config=None):
    """Exact attention, forward only, through the Hopper kernel.

    Args:
        q: (B, H, N_q, d); k, v: (B, H_kv, N_k, d), H % H_kv == 0; fp16 or bf16, d 64 or 128.
        causal: query i sees key j iff j <= i + N_k - N_q (bottom-right aligned).
        softmax_scale: multiplies q @ k.T before the softmax; default 1 / sqrt(d).
        config: (BLOCK_M, BLOCK_N, num_warps, num_stages), default `config_for`.
    Returns:
        o: (B, H, N_q, d) in q's dtype, 0 on fully masked rows;
        lse: (B, H, N_q) float32, -inf on fully masked rows.
    Raises:
        HopperUnsupported (a ValueError) for a dtype, head dim or device this kernel does not take.
    """
    dims, scale = check_inputs(q, k, v, causal, softmax_scale)
    B, H, H_kv, N_q, N_k, d = dims
    bm, bn = (config or config_for(d, causal))[:2]
    q, k, v = tma_ready(q), tma_ready(k), tma_ready(v)
    upcast = interpreting() and q.dtype == torch.bfloat16  # the interpreter's bf16 dot is wrong
    o = torch.empty(q.shape, device=q.device, dtype=torch.float32 if upcast else q.dtype)
    lse = torch.empty((B, H, N_q), device=q.device, dtype=torch.float32)
    descs = (descriptor(q, bm, d), descriptor(k, bn, d), descriptor(v, bn, d), o)
    cfg = config or config_for(d, causal)
    _launch(descs, lse, (lse, lse, lse), scale, dims, causal, cfg, False, upcast)
    return o.to(q.dtype), lse


# ------------------------------------------------------------------------------------------------
# FP8: block scales, the Hadamard rotation, the FP8 launch
# ------------------------------------------------------------------------------------------------
class Fp8Inputs(tuple):
    """e4m3 operands and their descales, as `quantize_fp8` makes them.

    q: (B, H, N_q, d) e4m3, q_scale: (B, H, cdiv(N_q, block_m)) float32, one per query block;
    k: (B, H_kv, N_k, d) e4m3, k_scale: (B, H_kv, cdiv(N_k, block_n)) float32, one per key block;
    v_t: (B, H_kv, d, N_pad) e4m3, V transposed, N_pad = N_k rounded up to 16 (16-byte TMA rows);
    v_scale: (B, H_kv, d) float32 (one per channel). x is about x_e4m3 * scale.
    """

    _fields = ("q", "q_scale", "k", "k_scale", "v_t", "v_scale", "block_m", "block_n")

    def __new__(cls, *values):
        return super().__new__(cls, values)

    def __getattr__(self, name):
        if name in Fp8Inputs._fields:
            return self[Fp8Inputs._fields.index(name)]
        raise AttributeError(name)


def hadamard(d: int, *, generator=None, device=None) -> torch.Tensor:
    """A random orthogonal rotation (d, d) float32: diag(signs) @ H_d / sqrt(d), H_d the Sylvester
    Hadamard matrix, signs drawn from `generator`. (q R) (k R)^T = q k^T, while an outlier channel
    spreads over all d channels."""
    if isinstance(d, bool) or not isinstance(d, int) or d < 1 or d & (d - 1):
        raise ValueError(f"hadamard: d must be a power of two >= 1, got {d!r}")
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (d,), generator=generator).float() * 2 - 1
    return (signs[:, None] * h / math.sqrt(d)).to(device)


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def quantize_blocks(x: torch.Tensor, block: int):
    """(B, H, N, d) -> (e4m3 (B, H, N, d), float32 scales (B, H, cdiv(N, block))): one scale per
    `block` rows, amax / 448, so each block uses e4m3's whole range."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"quantize_blocks: block must be a positive int, got {block!r}")
    B, H, N, d = x.shape
    nb = triton.cdiv(N, block)
    xf = torch.nn.functional.pad(x.float(), (0, 0, 0, nb * block - N))
    scale = _scale_of(xf.view(B, H, nb, block * d).abs().amax(-1))  # (B, H, nb)
    x8 = (xf.view(B, H, nb, block, d) / scale[..., None, None]).view(B, H, nb * block, d)
    return x8[:, :, :N].to(FP8).contiguous(), scale


def quantize_channels_t(v: torch.Tensor):
    """(B, H, N, d) -> (e4m3 V^T (B, H, d, N_pad), float32 scales (B, H, d)): one scale per
    channel; the transposed copy has its rows padded with zeros to N_pad = N rounded up to 16."""
    B, H, N, d = v.shape
    scale = _scale_of(v.float().abs().amax(2))  # (B, H, d)
    v_t = torch.zeros((B, H, d, triton.cdiv(N, 16) * 16), device=v.device, dtype=FP8)
    v_t[..., :N] = (v.float() / scale[:, :, None, :]).transpose(2, 3).to(FP8)
    return v_t, scale


def quantize_fp8(q, k, v, *, rotate=False, generator=None, block_m=None, block_n=None):
    """fp16/bf16 (q, k, v) -> `Fp8Inputs` for `forward_fp8`; with `rotate`, Q and K are first
    multiplied by one random `hadamard` rotation (scores unchanged, outliers spread out)."""
    name = "hopper.triton_fwd.quantize_fp8"
    (B, H, H_kv, N_q, N_k, d), _ = check_inputs(q, k, v, False, None, name)
    cfg = config_for(d, False, fp8=True)
    block_m, block_n = block_m or cfg[0], block_n or cfg[1]
    if rotate:
        r = hadamard(d, generator=generator, device=q.device)
        q, k = q.float() @ r, k.float() @ r
    q8, sq = quantize_blocks(q, block_m)
    k8, sk = quantize_blocks(k, block_n)
    v_t, sv = quantize_channels_t(v)
    return Fp8Inputs(q8, sq, k8, sk, v_t, sv, block_m, block_n)


def forward_fp8(
    x: Fp8Inputs, *, causal=False, softmax_scale=None, out_dtype=torch.bfloat16, config=None
):
    """FP8 attention forward on `quantize_fp8`'s output.
    Returns (o (B, H, N_q, d) in out_dtype, lse (B, H, N_q) float32). A given config's block sizes
    must be the ones the scales were made for; by default `config_for`'s warps and stages run with
    the scales' blocks."""
    name = "hopper.triton_fwd.forward_fp8"
    if not isinstance(x, Fp8Inputs):
        raise TypeError(f"{name}: x must be the Fp8Inputs of quantize_fp8, got {type(x).__name__}")
    if not isinstance(causal, bool):
        raise TypeError(f"{name}: causal must be a bool, got {causal!r}")
    (B, H, N_q, d), (_, H_kv, N_k, _) = x.q.shape, x.k.shape
    cfg = config or (x.block_m, x.block_n, *config_for(d, causal, fp8=True)[2:])
    if tuple(cfg[:2]) != (x.block_m, x.block_n):
        raise ValueError(
            f"{name}: config blocks {tuple(cfg[:2])} differ from the scales' blocks "
            f"{(x.block_m, x.block_n)}; quantize with block_m={cfg[0]}, block_n={cfg[1]}"
        )
    _check_device(x.q, name)
    scale = resolve_scale(softmax_scale, d, name)
    upcast = interpreting()
    o = torch.empty(x.q.shape, device=x.q.device, dtype=torch.float32 if upcast else out_dtype)
    lse = torch.empty((B, H, N_q), device=x.q.device, dtype=torch.float32)
    descs = (
        descriptor(x.q, x.block_m, d),
        descriptor(x.k, x.block_n, d),
        descriptor(x.v_t, d, x.block_n, shape=(B, H_kv, d, N_k)),
        o,
    )
    scales = (x.q_scale, x.k_scale, x.v_scale)
    _launch(descs, lse, scales, scale, (B, H, H_kv, N_q, N_k, d), causal, cfg, True, upcast)
    return o.to(out_dtype), lse
