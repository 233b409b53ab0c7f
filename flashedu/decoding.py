"""Split-KV decoding (FlashDecoding): a few query rows against a long KV cache, split across
programs.

When a model generates text, each step brings one new query row per head (N_q = 1) and a KV cache of
N_k keys. A FlashAttention forward kernel runs one program per (query block, batch, head), so at
N_q = 1 it launches only B*H programs: far too few to fill a GPU, however long the cache. Split-KV
decoding (Flash-Decoding, Dao, Haziza, Massa and Sizov, 2023) cuts the cache into `num_splits`
chunks instead. Each program computes a partial softmax state (m, l, o) over its chunk, and a
combine step merges the states with the online-softmax rule, exactly as `flashedu.softmax.merge`
does. The result is exact attention.

Two versions, one contract (`forward(q, k, v, *, causal, softmax_scale, ...) -> (o, lse)`, layout
(B, H, N, d), K/V with H_kv heads, H % H_kv == 0, causal and windows aligned bottom-right):

* `forward`: NumPy. Per split, `partial_state` builds (m, l, o), and `softmax.merge` folds the
  states.
* `triton_forward`: torch tensors, a Triton split kernel (one program per split, batch and K/V head)
  and a Triton combine kernel (one program per query row).
* `paged_forward`: the same on a paged KV cache (pages of a pool, a block table per sequence,
  ragged lengths), read through the table by `flashedu.kernels.paged` (chapter 12). Both Triton
  versions take attention sinks, one logit per query head that the combine folds into each row's
  max and sum.

The block-visibility rule that chapter 09's pictures, split skipping and ring attention share
lives in `flashedu.masks` (importable from here too): `block_kind` says whether a (query rows x key
columns) block is fully masked ("skip"), partly masked ("partial") or fully visible ("full"), from
two corners, without building the mask.

Limits: forward only (decoding needs no gradient). The NumPy version builds each split's scores, a
(N_q, chunk) array per head; that is cheap for N_q = 1 and the reason the method is for decoding.
The Triton split kernel holds the H / H_kv * N_q query rows of one K/V head in one tile (at most 128
rows), reuses the mask and ALiBi helpers of `flashedu.kernels.common`, and shares the attention
kernels' dtypes (fp16, bf16, fp32) and head dims (any d and value head dim d_v up to 256, padded by
`flashedu.kernels.tiles`); it picks one fixed launch configuration (no autotuning) and has not been
timed on a GPU. Partial states go through HBM in float32: (num_splits, B, H, N_q) for m and l, and
(num_splits, B, H, N_q, d_v) for o.

Introduced in notebooks/09_beyond.ipynb.
"""

from __future__ import annotations

import numpy as np

from . import softmax
from .dtypes import acc_dtype
from .masks import (  # noqa: F401  (the block rules, re-exported where chapter 09 met them)
    FULL,
    PARTIAL,
    SKIP,
    block_kind,
    block_map,
    block_visible,
    key_offsets,
    kv_blocks,
)
from .validation import (
    check_block,
    check_causal,
    check_qkv,
    check_sinks,
    check_slopes,
    check_window,
    resolve_scale,
)


def split_bounds(N_k: int, num_splits: int) -> list[tuple[int, int]]:
    """[(c0, c1), ...]: `num_splits` contiguous chunks of ceil(N_k / num_splits) keys (fewer if N_k
    is small)."""
    num_splits = check_block(num_splits, "num_splits", name="decoding")
    size = -(-N_k // num_splits)
    return [(c, min(c + size, N_k)) for c in range(0, N_k, size)]


def partial_state(q, k, v, cols, *, scale, causal=False, window_size=None, alibi_slopes=None):
    """The softmax state (m, l, o) of all query rows against keys [c0, c1): what one split program
    computes.

    m (B, H, N_q) row max of the scaled scores, l (B, H, N_q) sum of exp(s - m), o (B, H, N_q, d)
    the unnormalised sum of exp(s - m) v, in the accumulation dtype. Rows that see none of these
    keys get the empty state m = -inf, l = 0, o = 0.
    """
    B, H, N_q, d = q.shape
    N_k, acc = k.shape[2], acc_dtype(q.dtype)
    k_j = np.repeat(k[:, :, cols[0] : cols[1]], H // k.shape[1], axis=1).astype(
        acc
    )  # (B, H, n, d) GQA
    v_j = np.repeat(v[:, :, cols[0] : cols[1]], H // v.shape[1], axis=1).astype(acc)
    s = np.matmul(q.astype(acc), np.swapaxes(k_j, -1, -2)) * acc.type(scale)  # (B, H, N_q, n)
    off = key_offsets((0, N_q), cols, N_q, N_k)
    if alibi_slopes is not None:
        s = s - (np.asarray(alibi_slopes, dtype=acc)[:, None, None] * np.abs(off)).astype(acc)
    keep = block_visible((0, N_q), cols, N_q, N_k, causal=causal, window_size=window_size)
    return softmax.state(np.where(keep, s, -np.inf), v_j)  # o: (B, H, N_q, n) @ (B, H, n, d)


def _check_extras(q, alibi_slopes, window_size, name):
    check_slopes(alibi_slopes, q.shape[1], name=name)
    return check_window(window_size, name=name)


def forward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size=None,
    alibi_slopes=None,
    num_splits: int = 4,
    return_states: bool = False,
):
    """Exact attention by split-KV: partial states over `num_splits` key chunks, merged with
    `softmax.merge`.

    Args:
        q: (B, H, N_q, d), usually N_q = 1; k: (B, H_kv, N_k, d), v: (B, H_kv, N_k, d_v),
            H % H_kv == 0. float16/32/64 NumPy.
        causal, window_size, alibi_slopes: as in `reference.forward` (bottom-right alignment).
        num_splits: how many chunks (programs) the cache is cut into; chunks no query sees are
            skipped.
        return_states: also return [(cols, kind, (m, l, o)), ...], one entry per split, for the
            figures.
    Returns:
        o (B, H, N_q, d_v) in q's dtype; lse (B, H, N_q) float32 (float64 for float64 input); -inf
        and o = 0 on rows that see no key.
    """
    B, H, H_kv, N_q, N_k, d = check_qkv(
        q, k, v, name="decoding.forward", kind="numpy", value_dim=True
    )
    scale = resolve_scale(softmax_scale, d, name="decoding.forward")
    causal = check_causal(causal, name="decoding.forward")
    window_size = _check_extras(q, alibi_slopes, window_size, "decoding.forward")
    acc = acc_dtype(q.dtype)
    state = (
        np.full((B, H, N_q), -np.inf, acc),
        np.zeros((B, H, N_q), acc),
        np.zeros((B, H, N_q, v.shape[-1]), acc),
    )
    states = []
    for cols in split_bounds(N_k, num_splits):
        kind = block_kind((0, N_q), cols, N_q, N_k, causal=causal, window_size=window_size)
        part = None
        if kind != SKIP:  # a skipped chunk is never read: its K/V stay in HBM
            part = partial_state(
                q,
                k,
                v,
                cols,
                scale=scale,
                causal=causal,
                window_size=window_size,
                alibi_slopes=alibi_slopes,
            )
            state = softmax.merge(state, part)
        states.append((cols, kind, part))
    o, lse = softmax.finalize(*state)
    o, lse = o.astype(q.dtype), lse.astype(acc)
    return (o, lse, states) if return_states else (o, lse)


# ------------------------------------------------------------------------------------------- Triton
try:
    import torch
    import triton
    import triton.language as tl

    from .kernels import paged as paged_kernels
    from .kernels.common import LOG2E, alibi, visible
    from .kernels.launch import INTERPRETER, check_inputs, kernel_flags, rows_contiguous
    from .kernels.paged import combine, combine_kernel  # noqa: F401  (shared with paged decoding)
    from .kernels.tiles import load_tile, pad_dim, store_tile
except ModuleNotFoundError as e:  # pragma: no cover - triton is an optional dependency
    if e.name not in ("triton", "torch"):
        raise
    triton = None

MAX_ROWS = 128  # query rows (H / H_kv * N_q) one split program holds on chip


if triton is not None:

    @triton.jit
    def _split_kernel(
        Q,
        K,
        V,
        M_PART,
        L_PART,
        O_PART,
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
        stride_sb,
        qk_scale,
        B,
        H,
        H_kv,
        GROUP,
        N_q,
        N_k,
        SPLIT,
        KEY_LO,
        KEY_HI,
        LEFT,
        RIGHT,
        HEAD_DIM: tl.constexpr,
        V_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr,
        HAS_LEFT: tl.constexpr,
        HAS_RIGHT: tl.constexpr,
        HAS_ALIBI: tl.constexpr,
        UPCAST: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """One program: every query row of the GROUP heads sharing one K/V head, against one split
        of the cache. Grid (num_splits, B * H_kv). Row r of the tile is query r % N_q of head
        kv_head * GROUP + r // N_q."""
        split = tl.program_id(0)
        b = tl.program_id(1) // H_kv
        kv_head = tl.program_id(1) % H_kv
        r = tl.arange(0, BLOCK_M)
        head = kv_head * GROUP + r // N_q
        i = r % N_q  # query index, for the mask and ALiBi
        live = r < GROUP * N_q
        dims = tl.arange(0, BLOCK_D)  # head dims padded to a power of two (flashedu.kernels.tiles)
        dims_v = tl.arange(0, BLOCK_DV)
        # the GROUP heads' queries stay on chip; K/V of this split are read once for all of them.
        # HBM: read rows*d
        q_ptrs = (
            Q
            + b.to(tl.int64) * stride_qb
            + head[:, None].to(tl.int64) * stride_qh
            + i[:, None] * stride_qm
        )
        q = load_tile(q_ptrs + dims[None, :], r, GROUP * N_q, dims, HEAD_DIM, BLOCK_D, True)
        K += b.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
        V += b.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
        slope2 = tl.zeros([BLOCK_M], dtype=tl.float32)
        if HAS_ALIBI:
            slope2 = (
                tl.load(SLOPES + b * stride_sb + head, mask=live, other=0.0) * 1.4426950408889634
            )
        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        start = tl.maximum(split * SPLIT, KEY_LO)  # keys no query can see are never loaded
        end = tl.minimum(tl.minimum(split * SPLIT + SPLIT, N_k), KEY_HI)
        for start_n in tl.range(start, end, BLOCK_N):
            cols = start_n + tl.arange(0, BLOCK_N)
            k_ptrs = K + cols[:, None] * stride_kn + dims[None, :]
            v_ptrs = V + cols[:, None] * stride_vn + dims_v[None, :]
            k = load_tile(k_ptrs, cols, end, dims, HEAD_DIM, BLOCK_D, True)
            v = load_tile(v_ptrs, cols, end, dims_v, V_DIM, BLOCK_DV, True)
            if UPCAST:  # HBM: read BLOCK_N * d of K and BLOCK_N * d_v of V
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = (
                tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            )  # (BLOCK_M, BLOCK_N), log2 units
            if HAS_ALIBI:
                s += alibi(slope2[:, None], i, cols, N_k - N_q)
            s = tl.where(
                visible(i, cols, end, N_k - N_q, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT),
                s,
                -float("inf"),
            )
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == -float("inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_use[:, None])
            alpha = tl.math.exp2(m_i - m_use)  # rescale because the row max moved
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(
                p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION
            )  # (BLOCK_M, d_v)
            m_i = m_new
        row = ((split * B + b) * H + head).to(tl.int64) * N_q + i  # into (num_splits, B, H, N_q)
        tl.store(
            M_PART + row, m_i * 0.6931471805599453, mask=live
        )  # natural log units; HBM: write rows*(d_v+2)
        tl.store(L_PART + row, l_i, mask=live)
        o_ptrs = O_PART + row[:, None] * V_DIM + dims_v[None, :]
        store_tile(o_ptrs, acc, r, GROUP * N_q, dims_v, V_DIM, BLOCK_DV)


def triton_forward(
    q,
    k,
    v,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size=None,
    alibi_slopes=None,
    num_splits: int = 4,
    block_n: int | None = None,
    return_states: bool = False,
    sinks=None,
):
    """Split-KV decoding with Triton: a split kernel writes one partial state per (split, batch,
    head, row), and a combine kernel merges them. Same arguments and results as `forward`, on torch
    tensors.

    q: (B, H, N_q, d), with H / H_kv * N_q <= 128 rows (one program holds the queries of every head
    that shares a K/V head: K and V are read once per group, the point of GQA at decode time); v
    may have its own head dim d_v; fp16, bf16 or fp32, d and d_v from 1 to 256; CUDA tensors, or
    CPU tensors under the interpreter.
    block_n: keys per inner step (a power of two >= 16; default 16 under the interpreter, 64 on a
    GPU).
    return_states: also return the partial states (m, l, o), each with a leading num_splits axis.
    sinks: None, or (H,) float32, one logit per query head (natural units, not scaled) joining
    every softmax row as an extra column with no value; the combine folds it into the row's max
    and sum, and lse includes it (`kernels.paged`).
    """
    name = "decoding.triton_forward"
    (B, H, H_kv, N_q, N_k, d), scale, bounds, slopes, stride_sb = check_inputs(
        q, k, v, causal, softmax_scale, window_size, alibi_slopes, name
    )
    sinks = _check_sinks(sinks, q, name)
    group = H // H_kv
    if group * N_q > MAX_ROWS:
        raise ValueError(
            f"{name}: H / H_kv * N_q = {group} * {N_q} query rows exceed the {MAX_ROWS} one "
            "program holds; split-KV decoding is for a few query rows "
            "(use kernels.forward)"
        )
    block_n = 16 if INTERPRETER and block_n is None else block_n or 64
    if not isinstance(block_n, int) or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"{name}: block_n must be a power of two >= 16, got {block_n!r}")
    splits = split_bounds(N_k, num_splits)
    q, k, v = (rows_contiguous(x) for x in (q, k, v))
    flags, left, right = kernel_flags(q, scale, bounds, slopes is not None)
    keys = kv_blocks(
        0, N_q, N_q, N_k, 1, causal=causal, window_size=check_window(window_size, name=name)
    )
    d_v = v.shape[-1]
    flags.update(V_DIM=d_v, BLOCK_D=pad_dim(d), BLOCK_DV=pad_dim(d_v))
    parts = [
        torch.empty((len(splits), B, H, N_q, *extra), dtype=torch.float32, device=q.device)
        for extra in ((), (), (d_v,))
    ]
    slopes = parts[0] if slopes is None else slopes  # any float32 pointer without ALiBi
    _split_kernel[(len(splits), B * H_kv)](
        q,
        k,
        v,
        *parts,
        slopes,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        stride_sb,
        scale * LOG2E,
        B,
        H,
        H_kv,
        group,
        N_q,
        N_k,
        splits[0][1],
        keys.start,
        keys.stop,
        left,
        right,
        BLOCK_M=max(16, triton.next_power_of_2(group * N_q)),
        BLOCK_N=block_n,
        **flags,
    )
    o, lse = combine(*parts, dtype=q.dtype, sinks=sinks)
    return (o, lse, tuple(parts)) if return_states else (o, lse)


def _check_sinks(sinks, q, name):
    if check_sinks(sinks, q.shape[1], name=name) is None:
        return None
    if not isinstance(sinks, torch.Tensor) or sinks.dtype != torch.float32:
        got = sinks.dtype if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise TypeError(f"{name}: sinks must be a torch.float32 tensor, got {got}")
    if sinks.device != q.device:
        raise ValueError(f"{name}: sinks must be on q's device {q.device}, got {sinks.device}")
    return sinks


def paged_forward(
    q,
    k_cache,
    v_cache,
    block_table,
    cache_seqlens,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    sinks=None,
    num_splits: int | None = None,
    block_n: int | None = None,
):
    """Split-KV decoding from a paged KV cache, read through its block table (never copied).

    Args:
        q: (B, H, N_q, d), a few query rows per sequence (decode, speculative or chunked steps),
            H / H_kv * N_q <= 128; fp16, bf16 or fp32; CUDA, or CPU under the interpreter.
        k_cache: (num_pages, page_size, H_kv, d), v_cache: (num_pages, page_size, H_kv, d_v), in
            q's dtype; the pool of pages every sequence draws from (vLLM / flash-attn layout).
        block_table: (B, max_pages) int32: row b lists the pages holding keys 0..page_size-1,
            page_size..2*page_size-1, ... of sequence b; entries past its length are not read.
        cache_seqlens: (B,) int32, keys per sequence, 0 <= len_b <= max_pages * page_size.
        causal: query i of sequence b sees key j iff j <= i + len_b - N_q (bottom-right against
            each sequence's own length).
        softmax_scale: default 1 / sqrt(d).
        sinks: None, or (H,) float32 attention sinks: one logit per query head (natural units,
            not scaled) joining every row's softmax as an extra column with no value.
        num_splits: chunks each sequence's keys are cut into (default: enough programs to fill
            the GPU, `kernels.paged.auto_splits`).
        block_n: keys per tile, a power of two >= 16 dividing page_size (default 64 on a GPU, or
            the largest power of two <= 64 that divides page_size; 16 under the interpreter).
    Returns:
        o (B, H, N_q, d_v) in q's dtype; lse (B, H, N_q) float32, the natural-log logsumexp of
        the row including its sink; a row that sees no key (len_b = 0, or causal rows before the
        first key) gives o = 0 and lse = -inf (lse = sink with a sink).
    """
    return paged_kernels.forward(
        q, k_cache, v_cache, block_table, cache_seqlens, causal=causal,
        softmax_scale=softmax_scale, sinks=sinks, num_splits=num_splits, block_n=block_n,
        name="decoding.paged_forward",
    )  # fmt: skip
