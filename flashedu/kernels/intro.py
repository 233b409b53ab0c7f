"""Small Triton kernels that teach the model before the real ones: one tile of scores or
probabilities.

`scores(q, k)` launches a 2D grid with one program per (BLOCK_M x BLOCK_N) tile of S = scale q k^T
for one head: each program builds its row and column offsets with `tl.arange`, loads its two tiles
with masks at the ragged edges, multiplies them with `tl.dot`, masks what the query may not see with
-inf and stores its tile. `probabilities(q, k, lse)` is the same kernel with one more line,
P = exp(S - lse): how the backward kernels rebuild P from the saved log-sum-exp (base 2, as the
kernels compute it). Both materialise (N_q, N_k) arrays, which is what FlashAttention avoids: they
exist to be read, run and checked, not to be fast.

`kv_range` is the plain-Python twin of the kernels' `common.block_range`: which key blocks a
block of query rows skips, which it must mask and which it sees whole
(tests/kernels/test_attention.py holds the two equal).

Introduced in notebooks/06_triton_forward.ipynb (scores, kv_range) and
notebooks/07_triton_backward.ipynb (probabilities). Limits: one head, 2D inputs (N, d); fp16, bf16
or fp32; d in {16, 32, 64, 128, 256}.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..masks import band
from .common import LOG2E, visible
from .launch import check_inputs, kernel_flags


@triton.jit
def tile_kernel(
    Q,
    K,
    LSE,
    OUT,
    N_q,
    N_k,
    LEFT,
    RIGHT,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    FROM_LSE: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Program (i, j) of a 2D grid computes tile (i, j) of S (or of P with FROM_LSE) for one
    head."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(
        0, BLOCK_M
    )  # (BLOCK_M,) query indices of this tile
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key indices
    dims = tl.arange(0, HEAD_DIM)
    # Pointers: a (BLOCK_M, d) grid of addresses; the mask keeps rows past N_q from being read (0
    # instead).
    q = tl.load(Q + rows[:, None] * HEAD_DIM + dims[None, :], mask=rows[:, None] < N_q, other=0.0)
    k = tl.load(K + cols[:, None] * HEAD_DIM + dims[None, :], mask=cols[:, None] < N_k, other=0.0)
    if UPCAST:
        q, k = q.to(tl.float32), k.to(tl.float32)
    s = (
        tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    )  # (BLOCK_M, BLOCK_N), log2 units
    keep = visible(rows, cols, N_k, N_k - N_q, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT)
    if FROM_LSE:  # P = exp(S - lse) = exp2(S log2(e) - lse log2(e)); masked (and empty rows) -> 0
        lse2 = tl.load(LSE + rows, mask=rows < N_q, other=0.0) * 1.4426950408889634
        out = tl.where(keep, tl.math.exp2(s - lse2[:, None]), 0.0)
    else:  # S in natural units; masked -> -inf
        out = tl.where(keep, s * 0.6931471805599453, -float("inf"))
    tl.store(
        OUT + rows[:, None] * N_k + cols[None, :],
        out,
        mask=(rows[:, None] < N_q) & (cols[None, :] < N_k),
    )


def launch_tiles(q, k, lse, causal, softmax_scale, window_size, block_m, block_n, name):
    if q.ndim != 2 or k.ndim != 2:
        raise ValueError(
            f"{name}: q and k must be 2D (N, d) tensors for one head, got shapes "
            f"{tuple(q.shape)} and {tuple(k.shape)}"
        )
    _, scale, bounds, _, _ = check_inputs(
        q[None, None], k[None, None], k[None, None], causal, softmax_scale, window_size, None, name
    )
    flags, left, right = kernel_flags(q, scale, bounds, False)
    flags.pop("HAS_ALIBI")
    q, k = q.contiguous(), k.contiguous()
    (N_q, _), N_k = q.shape, k.shape[0]
    out = torch.empty((N_q, N_k), device=q.device, dtype=torch.float32)
    from_lse = lse is not None
    lse = lse.to(torch.float32).contiguous() if from_lse else out  # any float32 pointer when unused
    grid = (triton.cdiv(N_q, block_m), triton.cdiv(N_k, block_n))  # one program per tile
    tile_kernel[grid](
        q,
        k,
        lse,
        out,
        N_q,
        N_k,
        left,
        right,
        scale * LOG2E,
        **flags,
        FROM_LSE=from_lse,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
    )
    return out


def scores(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size=None,
    block_m: int = 16,
    block_n: int = 16,
) -> torch.Tensor:
    """S = softmax_scale * q k^T for one head, (N_q, N_k) float32, -inf where query i may not see
    key j.

    q (N_q, d), k (N_k, d); causal bottom-right aligned, window_size as in `masks.visible`.
    """
    return launch_tiles(
        q, k, None, causal, softmax_scale, window_size, block_m, block_n, "kernels.intro.scores"
    )


def probabilities(
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size=None,
    block_m: int = 16,
    block_n: int = 16,
) -> torch.Tensor:
    """P = exp(S - lse) for one head, (N_q, N_k) float32, rebuilt from the forward's lse (N_q,): 0
    where masked, and 0 on rows with lse = -inf (they see no key)."""
    if tuple(lse.shape) != (q.shape[0],):
        raise ValueError(
            f"kernels.intro.probabilities: lse must have shape (N_q,) = ({q.shape[0]},), "
            f"got {tuple(lse.shape)}"
        )
    return launch_tiles(
        q,
        k,
        lse,
        causal,
        softmax_scale,
        window_size,
        block_m,
        block_n,
        "kernels.intro.probabilities",
    )


def kv_range(
    first: int,
    last: int,
    N_q: int,
    N_k: int,
    block_n: int,
    *,
    causal: bool = False,
    window_size=None,
) -> tuple[int, int, int, int]:
    """(lo, full_lo, full_hi, hi), multiples of block_n: the key stretches the forward kernel loops
    over for query rows first..last (inclusive). Keys [full_lo, full_hi) are visible to every one of
    those rows and need no mask; [lo, full_lo) and [full_hi, hi) need the mask (a window's left
    edge, the causal diagonal, the ragged last block); keys outside [lo, hi) are never loaded. The
    kernel computes the same in `common.block_range`."""
    off, left, right = band(N_q, N_k, causal=causal, window_size=window_size)
    lo, full_lo, full_hi, hi = 0, 0, N_k, N_k
    if left >= 0:  # row i sees keys >= i + off - left
        lo, full_lo = max(first + off - left, 0), max(last + off - left, 0)
    if right >= 0:  # row i sees keys <= i + off + right
        hi = min(max(last + off + right + 1, 0), N_k)
        full_hi = min(max(first + off + right + 1, 0), N_k)
    lo = lo // block_n * block_n
    hi = max(-(-hi // block_n) * block_n, lo)
    full_lo = min(max(-(-full_lo // block_n) * block_n, lo), hi)
    full_hi = min(max(full_hi // block_n * block_n, full_lo), hi)
    return lo, full_lo, full_hi, hi
