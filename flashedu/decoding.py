"""Split-KV decoding (FlashDecoding): a few query rows against a long KV cache, split across programs.

When a model generates text, each step brings one new query row per head (N_q = 1) and a KV cache of N_k
keys. A FlashAttention forward kernel runs one program per (query block, batch, head), so at N_q = 1 it
launches only B*H programs: far too few to fill a GPU, however long the cache. Split-KV decoding
(Flash-Decoding, Dao, Haziza, Massa and Sizov, 2023) cuts the cache into `num_splits` chunks instead. Each
program computes a partial softmax state (m, l, o) over its chunk, and a combine step merges the states with
the online-softmax rule, exactly as `flashedu.softmax.merge` does. The result is exact attention.

Two versions, one contract (`forward(q, k, v, *, causal, softmax_scale, ...) -> (o, lse)`, layout
(B, H, N, d), K/V with H_kv heads, H % H_kv == 0, causal and windows aligned bottom-right):

* `forward`: NumPy. Per split, `partial_state` builds (m, l, o), and `softmax.merge` folds the states.
* `triton_forward`: torch tensors, a Triton split kernel (one program per split, batch and K/V head) and
  a Triton combine kernel (one program per query row).

This module also holds the block-visibility rule that chapter 09's pictures, split skipping and ring
attention share: `block_kind` says whether a (query rows x key columns) block is fully masked ("skip"),
partly masked ("partial") or fully visible ("full"), from two corners, without building the mask.

Limits: forward only (decoding needs no gradient). The NumPy version builds each split's scores, a
(N_q, chunk) array per head; that is cheap for N_q = 1 and the reason the method is for decoding.

Introduced in notebooks/09_beyond.ipynb.
"""
from __future__ import annotations

import math

import numpy as np

from . import softmax
from ._validate import check_block, check_qkv, check_window, resolve_scale

SKIP, PARTIAL, FULL = "skip", "partial", "full"


def band(causal: bool = False, window_size: tuple[int, int] | None = None) -> tuple[float, float]:
    """(lo, hi): query i sees key j iff lo <= j - (i + N_k - N_q) <= hi (see `masks.visible`)."""
    lo, hi = -math.inf, math.inf
    if window_size is not None:
        left, right = window_size
        lo = -math.inf if left < 0 else -left
        hi = math.inf if right < 0 else right
    if causal:
        hi = min(hi, 0)
    return lo, hi


def key_offsets(rows: tuple[int, int], cols: tuple[int, int], N_q: int, N_k: int) -> np.ndarray:
    """(r1 - r0, c1 - c0) int array of j - (i + N_k - N_q): each key's distance from the query's diagonal."""
    i = np.arange(rows[0], rows[1])[:, None] + (N_k - N_q)
    return np.arange(cols[0], cols[1])[None, :] - i


def block_visible(rows, cols, N_q: int, N_k: int, *, causal: bool = False, window_size=None) -> np.ndarray:
    """The bool mask of one block: `masks.visible(N_q, N_k, ...)[r0:r1, c0:c1]`, built for the block alone."""
    lo, hi = band(causal, window_size)
    off = key_offsets(rows, cols, N_q, N_k)
    return (off >= lo) & (off <= hi)


def block_kind(rows, cols, N_q: int, N_k: int, *, causal: bool = False, window_size=None) -> str:
    """"skip", "partial" or "full" for query rows [r0, r1) against keys [c0, c1), from the block's corners.

    Offsets j - i grow along a row and shrink down a column, so the block's smallest offset sits at its
    bottom-left corner and its largest at its top-right. It is fully masked when even the largest is below
    the band or the smallest above it; fully visible when both corners fall inside the band.
    """
    (r0, r1), (c0, c1) = rows, cols
    lo, hi = band(causal, window_size)
    smallest = c0 - (r1 - 1 + N_k - N_q)        # bottom-left corner
    largest = (c1 - 1) - (r0 + N_k - N_q)       # top-right corner
    if largest < lo or smallest > hi:
        return SKIP
    return FULL if lo <= smallest and largest <= hi else PARTIAL


def block_map(N_q: int, N_k: int, block_m: int, block_n: int, *, causal=False, window_size=None) -> np.ndarray:
    """(ceil(N_q / block_m), ceil(N_k / block_n)) array of "skip" / "partial" / "full" for every tile."""
    rows = [(r, min(r + block_m, N_q)) for r in range(0, N_q, block_m)]
    cols = [(c, min(c + block_n, N_k)) for c in range(0, N_k, block_n)]
    return np.array([[block_kind(r, c, N_q, N_k, causal=causal, window_size=window_size) for c in cols]
                     for r in rows])


def split_bounds(N_k: int, num_splits: int) -> list[tuple[int, int]]:
    """[(c0, c1), ...]: `num_splits` contiguous chunks of ceil(N_k / num_splits) keys (fewer if N_k is small)."""
    num_splits = check_block(num_splits, "num_splits", name="decoding")
    size = -(-N_k // num_splits)
    return [(c, min(c + size, N_k)) for c in range(0, N_k, size)]


def _acc(dtype) -> np.dtype:
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def partial_state(q, k, v, cols, *, scale, causal=False, window_size=None, alibi_slopes=None):
    """The softmax state (m, l, o) of all query rows against keys [c0, c1): what one split program computes.

    m (B, H, N_q) row max of the scaled scores, l (B, H, N_q) sum of exp(s - m), o (B, H, N_q, d) the
    unnormalised sum of exp(s - m) v, in the accumulation dtype. Rows that see none of these keys get the
    empty state m = -inf, l = 0, o = 0.
    """
    B, H, N_q, d = q.shape
    N_k, acc = k.shape[2], _acc(q.dtype)
    k_j = np.repeat(k[:, :, cols[0]:cols[1]], H // k.shape[1], axis=1).astype(acc)   # (B, H, n, d) GQA
    v_j = np.repeat(v[:, :, cols[0]:cols[1]], H // v.shape[1], axis=1).astype(acc)
    s = np.matmul(q.astype(acc), np.swapaxes(k_j, -1, -2)) * acc.type(scale)          # (B, H, N_q, n)
    off = key_offsets((0, N_q), cols, N_q, N_k)
    if alibi_slopes is not None:
        s = s - (np.asarray(alibi_slopes, dtype=acc)[:, None, None] * np.abs(off)).astype(acc)
    keep = block_visible((0, N_q), cols, N_q, N_k, causal=causal, window_size=window_size)
    return softmax.state(np.where(keep, s, -np.inf), v_j)     # o: (B, H, N_q, n) @ (B, H, n, d)


def _check_extras(q, alibi_slopes, window_size, name):
    window_size = check_window(window_size, name=name)
    if alibi_slopes is not None and np.shape(alibi_slopes) != (q.shape[1],):
        raise ValueError(f"{name}: alibi_slopes must have shape (H,) = ({q.shape[1]},), "
                         f"got {tuple(np.shape(alibi_slopes))}")
    return window_size


def forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, causal: bool = False, softmax_scale: float | None = None,
            window_size=None, alibi_slopes=None, num_splits: int = 4, return_states: bool = False):
    """Exact attention by split-KV: partial states over `num_splits` key chunks, merged with `softmax.merge`.

    Args:
        q: (B, H, N_q, d), usually N_q = 1; k, v: (B, H_kv, N_k, d), H % H_kv == 0. float16/32/64 NumPy.
        causal, window_size, alibi_slopes: as in `reference.forward` (bottom-right alignment).
        num_splits: how many chunks (programs) the cache is cut into; chunks no query sees are skipped.
        return_states: also return [(cols, kind, (m, l, o)), ...], one entry per split, for the figures.
    Returns:
        o (B, H, N_q, d) in q's dtype; lse (B, H, N_q) float32 (float64 for float64 input); -inf and o = 0
        on rows that see no key.
    """
    B, H, H_kv, N_q, N_k, d = check_qkv(q, k, v, name="decoding.forward", kind="numpy")
    scale = resolve_scale(softmax_scale, d, name="decoding.forward")
    window_size = _check_extras(q, alibi_slopes, window_size, "decoding.forward")
    acc = _acc(q.dtype)
    state = (np.full((B, H, N_q), -np.inf, acc), np.zeros((B, H, N_q), acc), np.zeros((B, H, N_q, d), acc))
    states = []
    for cols in split_bounds(N_k, num_splits):
        kind = block_kind((0, N_q), cols, N_q, N_k, causal=causal, window_size=window_size)
        part = None
        if kind != SKIP:   # a skipped chunk is never read: its K/V stay in HBM
            part = partial_state(q, k, v, cols, scale=scale, causal=causal, window_size=window_size,
                                 alibi_slopes=alibi_slopes)
            state = softmax.merge(state, part)
        states.append((cols, kind, part))
    o, lse = softmax.finalize(*state)
    o, lse = o.astype(q.dtype), lse.astype(acc)
    return (o, lse, states) if return_states else (o, lse)
