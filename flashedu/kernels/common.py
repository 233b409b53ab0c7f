"""The Triton device helpers shared by the attention kernels: which key blocks a query block visits,
which (query, key) pairs it may see, and the ALiBi bias.

The forward kernel (`flashedu.kernels.fwd`), the backward kernels (`flashedu.kernels.bwd`),
split-KV decoding (`flashedu.decoding`) and the teaching kernels (`flashedu.kernels.intro`) all call
these, so the mask rule lives in one place. Everything is in base 2 where the kernels are:
`LOG2E` folds log2(e) into the scale so exp becomes exp2, and `LN2` turns a base-2 log-sum-exp back
into natural units. The host twin of `block_range` is `intro.kv_range`.

Introduced in notebooks/06_triton_forward.ipynb.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # exp(x) = exp2(x * log2(e))
LN2 = 0.6931471805599453  # lse = lse_2 * ln(2)


@triton.jit
def block_range(
    first,
    last,
    N_other,
    offset,
    LEFT,
    RIGHT,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Rows first..last see columns [row + offset - LEFT, row + offset + RIGHT] of 0..N_other-1.
    Returns block-aligned (lo, full_lo, full_hi, hi): columns in [full_lo, full_hi) are visible to
    every row (no mask needed); [lo, full_lo) and [full_hi, hi) need the mask; the rest is never
    touched."""
    lo = 0
    hi = N_other
    full_lo = 0
    full_hi = N_other
    if HAS_LEFT:
        lo = tl.maximum(first + offset - LEFT, 0)
        full_lo = tl.maximum(last + offset - LEFT, 0)
    if HAS_RIGHT:
        hi = tl.minimum(tl.maximum(last + offset + RIGHT + 1, 0), N_other)
        full_hi = tl.minimum(tl.maximum(first + offset + RIGHT + 1, 0), N_other)
    lo = (lo // BLOCK) * BLOCK
    hi = tl.maximum(tl.cdiv(hi, BLOCK) * BLOCK, lo)
    full_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK) * BLOCK, lo), hi)
    full_hi = tl.minimum(tl.maximum((full_hi // BLOCK) * BLOCK, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def visible(rows, cols, N_k, offset, LEFT, RIGHT, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """(len(rows), len(cols)) bool: key col exists and lies in the (window of) query row,
    bottom-right aligned."""
    diag = rows[:, None] + offset  # key position level with each query
    keep = cols[None, :] < N_k
    if HAS_LEFT:
        keep = keep & (cols[None, :] >= diag - LEFT)
    if HAS_RIGHT:
        keep = keep & (cols[None, :] <= diag + RIGHT)
    return keep


@triton.jit
def alibi(slope2, rows, cols, offset):
    """ALiBi bias in log2 units: -slope * log2(e) * |i + offset - j|, shape
    (len(rows), len(cols))."""
    return -slope2 * tl.abs(rows[:, None] + offset - cols[None, :]).to(tl.float32)
