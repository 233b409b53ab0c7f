"""FP8 attention as FlashAttention-3 does it, emulated on a CPU: per-block scales, a random Hadamard
rotation of Q and K, and the error measured against float64.

* `quantize` / `dequantize`: e4m3 codes (torch.float8_e4m3fn, largest finite value 448) with one
  float32 scale per block of rows, max|x| over the block / 448 (FA3 s3.3, block quantisation).
* `hadamard`, `random_hadamard`, `rotate`: an orthogonal M = diag(random signs) H / sqrt(d), applied
  to Q and K alike, so (Q M)(K M)^T = Q K^T exactly in exact arithmetic, while an outlier in one
  channel is spread over all d of them (FA3 s3.3, incoherent processing).
* `emulated_forward`: attention with Q, K, V and P rounded as an FP8 (or bf16/fp16) kernel rounds
  them, sums in float32; `rmse` and `outlier_qkv` reproduce FA3's error experiment (s4.3): inputs
  N(0, 1), with N(0, 100) added to 0.1% of the entries.

Limits: the emulation is the arithmetic of a kernel, not a kernel: the softmax uses the row's final
max (a kernel uses a running max, so its P tiles differ slightly before they are rounded), P is cast
to e4m3 without a scale of its own, and float32 accumulation order differs from a GPU's. The
Hadamard matrix needs d a power of two.

Introduced in notebooks/11_hopper.ipynb.
"""

from __future__ import annotations

import numbers

import numpy as np
import torch

from .. import masks

E4M3_MAX = 448.0
"""Largest finite float8 e4m3 value (torch.finfo(torch.float8_e4m3fn).max; OCP FP8 spec)."""
FORMATS = {"e4m3": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp16": torch.float16}


def _block(name: str, x) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 1:
        raise ValueError(f"{name} must be a positive int (rows per scale), got {x!r}")
    return int(x)


def _tensor(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.ndim < 2:
        raise TypeError(
            f"{name} must be a floating-point torch tensor of shape (..., N, d), "
            f"got {type(x).__name__} {getattr(x, 'shape', '')}"
        )
    return x


def quantize(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes of x with one scale per block of `block` rows.

    Args:
        x: (..., N, d) floating point. Rows [i block, (i+1) block) share scale i; the last block
           may be shorter.
        block: rows per scale (FA3 uses the tile height, e.g. 64 or 128).
    Returns:
        codes: (..., N, d) torch.float8_e4m3fn, codes = x / scale rounded to nearest.
        scales: (..., ceil(N / block)) float32, max|x| over the block / 448 (1.0 for an all-zero
        block), so x ~ codes * scale and the block's largest value lands on e4m3's largest, 448.

    Introduced in notebooks/11_hopper.ipynb (exercise 11.2).
    """
    x, block = _tensor("x", x).float(), _block("block", block)
    N, d = x.shape[-2:]
    n_blocks = -(-N // block)
    padded = torch.nn.functional.pad(x, (0, 0, 0, n_blocks * block - N))  # (..., n_blocks*block, d)
    amax = padded.reshape(*x.shape[:-2], n_blocks, block * d).abs().amax(-1)  # (..., n_blocks)
    scales = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    codes = (x / _rows(scales, block, N)).to(torch.float8_e4m3fn)
    return codes, scales


def _rows(scales: torch.Tensor, block: int, N: int) -> torch.Tensor:
    """(..., n_blocks) -> (..., N, 1): each row's scale."""
    return scales.repeat_interleave(block, dim=-1)[..., :N, None]


def dequantize(codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """float32 (..., N, d) values codes * scale of each row's block (the inverse of `quantize`)."""
    return codes.float() * _rows(scales.float(), _block("block", block), codes.shape[-2])


def hadamard(d: int) -> np.ndarray:
    """The (d, d) Hadamard matrix H / sqrt(d), float64, orthogonal; d a power of two (Sylvester)."""
    if isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 1 or d & (d - 1):
        raise ValueError(f"hadamard: d must be a power of two (1, 2, 4, ..., 128, ...), got {d!r}")
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(d)


def random_hadamard(d: int, seed: int) -> np.ndarray:
    """(d, d) float64 M = diag(s) H / sqrt(d), random signs s drawn from `seed`; M M^T = I.

    x @ M flips the sign of random channels of x, then mixes every channel into every other.
    Introduced in notebooks/11_hopper.ipynb.
    """
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], size=d)
    return signs[:, None] * hadamard(d)


def rotate(q, k, seed: int):
    """(q @ M, k @ M) with M = random_hadamard(d, seed): the same rotation for Q and K, so scores
    (q M)(k M)^T = q M M^T k^T = q k^T. q (..., N_q, d), k (..., N_k, d); NumPy arrays or torch
    tensors (the result keeps the input's type and dtype).

    Introduced in notebooks/11_hopper.ipynb (exercise 11.3).
    """
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"rotate: q and k need the same head dim, got {q.shape[-1]} and {k.shape[-1]}"
        )
    m = random_hadamard(q.shape[-1], seed)
    if isinstance(q, torch.Tensor):
        m_t = torch.as_tensor(m, dtype=q.dtype, device=q.device)
        return q @ m_t, k @ m_t.to(k.dtype)
    return np.asarray(q) @ m, np.asarray(k) @ m


def crest(x) -> float:
    """max|x| / rms(x): about 3-5 for Gaussian data, far more when a few entries are outliers."""
    x = np.asarray(x.detach().double().cpu() if isinstance(x, torch.Tensor) else x, np.float64)
    return float(np.abs(x).max() / np.sqrt(np.mean(x * x)))


def _round(x: torch.Tensor, fmt: str, block: int, scaling: str) -> torch.Tensor:
    """x as the kernel sees it: rounded to `fmt`, with per-block or per-tensor scales for e4m3."""
    if fmt != "e4m3":
        return x.to(FORMATS[fmt]).float()
    if scaling == "tensor":
        scale = x.abs().amax().clamp_min(torch.finfo(torch.float32).tiny) / E4M3_MAX
        return (x / scale).to(torch.float8_e4m3fn).float() * scale
    return dequantize(*quantize(x, block), block)


def emulated_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    fmt: str = "e4m3",
    causal: bool = False,
    scaling: str = "block",
    rotation: bool = False,
    block_m: int = 64,
    block_n: int = 64,
    seed: int = 0,
) -> torch.Tensor:
    """Attention output o (B, H, N_q, d) float32, computed with a low-precision kernel's rounding.

    q (B, H, N_q, d), k and v (B, H, N_k, d), floating point. fmt "e4m3": Q, K, V quantised with a
    scale per block of `block_m` (Q) or `block_n` (K, V) rows when scaling="block", or one scale per
    tensor when scaling="tensor" (the baseline FA3 compares with); P cast to e4m3 before P V.
    fmt "bf16" / "fp16": Q, K, V and P rounded to that type, no scales. rotation=True first rotates
    Q and K by `random_hadamard(d, seed)`. Scores, row sums and P V accumulate in float32; the
    causal mask is bottom-right aligned and a fully masked row gives 0.

    Introduced in notebooks/11_hopper.ipynb.
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {tuple(FORMATS)}, got {fmt!r}")
    if scaling not in ("block", "tensor"):
        raise ValueError(f"scaling must be 'block' or 'tensor', got {scaling!r}")
    q, k, v = (_tensor(n, t).float() for n, t in (("q", q), ("k", k), ("v", v)))
    if rotation:
        q, k = rotate(q, k, seed)
    qr, kr, vr = (
        _round(q, fmt, block_m, scaling),
        _round(k, fmt, block_n, scaling),
        _round(v, fmt, block_n, scaling),
    )
    s = qr @ kr.transpose(-1, -2) / q.shape[-1] ** 0.5  # (B, H, N_q, N_k) float32
    keep = torch.as_tensor(masks.visible(q.shape[-2], k.shape[-2], causal=causal))
    s = s.masked_fill(~keep, float("-inf"))
    m = s.amax(-1, keepdim=True).nan_to_num(neginf=0.0)  # (B, H, N_q, 1)
    p = torch.exp(s - m)  # in [0, 1], exp(-inf) = 0
    l = p.sum(-1, keepdim=True)
    o = p.to(FORMATS[fmt]).float() @ vr  # P rounded for the tensor cores
    return torch.where(l > 0, o / l.clamp_min(1e-30), torch.zeros_like(o))


def rmse(o, o_ref) -> float:
    """Root-mean-square error sqrt(mean((o - o_ref)^2)) over every element, in float64 (FA3's
    measure, s4.3)."""
    to64 = lambda x: np.asarray(
        x.detach().double().cpu() if isinstance(x, torch.Tensor) else x,
        np.float64,
    )
    a, b = to64(o), to64(o_ref)
    if a.shape != b.shape:
        raise ValueError(f"rmse: shapes differ, {a.shape} and {b.shape}")
    return float(np.sqrt(np.mean((a - b) ** 2)))


def outlier_qkv(
    B: int,
    H: int,
    N: int,
    d: int,
    *,
    outliers: bool = True,
    frac: float = 1e-3,
    outlier_std: float = 10.0,
    seed: int = 0,
):
    """q, k, v (B, H, N, d) float32 torch tensors: N(0, 1) entries, and with `outliers` a fraction
    `frac` of them get N(0, outlier_std^2) added (FA3 s4.3: 0.1% of entries, variance 100).

    Introduced in notebooks/11_hopper.ipynb.
    """
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(3):
        x = torch.randn(B, H, N, d, generator=g)
        if outliers:
            hit = torch.rand(B, H, N, d, generator=g) < frac
            x = x + hit * torch.randn(B, H, N, d, generator=g) * outlier_std
        out.append(x)
    return tuple(out)
