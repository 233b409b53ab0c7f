"""Split-KV decoding from a paged KV cache, and attention sinks: the serving kernels of chapter 12.

A serving engine does not keep each sequence's keys in one contiguous (N_k, d) slab. It keeps a
pool of fixed-size pages, k_cache and v_cache of shape (num_pages, page_size, H_kv, d), and a
block table (B, max_pages) of int32 page numbers per sequence: key j of sequence b lives in row
j % page_size of page block_table[b, j // page_size]. Sequences grow a page at a time and share
nothing but the pool (the layout of vLLM's PagedAttention and of flash-attn's
`flash_attn_with_kvcache`). `cache_seqlens` (B,) int32 says how many keys each holds (0 allowed).

`forward` runs split-KV decoding (as `flashedu.decoding.triton_forward`) THROUGH the table: each
program of the split kernel walks its chunk of one sequence's keys in tiles of BLOCK_N, and for
each tile loads one block-table entry (BLOCK_N divides page_size, so a tile lies in one page),
then the tile's K and V rows from that physical page. No contiguous copy of the cache is made.
The page lookup is a `@triton.jit` function passed to the kernel as a compile-time argument
(`paged_solution.page_rows` by default; chapter 12's exercise hands in the learner's own).

Attention sinks (gpt-oss, StreamingLLM): one learned logit per query head that joins every
softmax row as an extra column with no value. The combine kernel folds it into the running max
and sum as one more partial state (m = sink, l = 1, o = 0), so lse is that of the row including
the sink, and a row with no keys gives o = 0, lse = sink. The combine is shared with
`decoding.triton_forward` (which takes sinks too).

Conventions as elsewhere: q (B, H, N_q, d) with a few query rows (decode, or speculative /
chunked steps), GQA (H % H_kv == 0; one program holds the H / H_kv * N_q <= 128 query rows of a
K/V head), causal aligned bottom-right against each sequence's own length (query i sees key j iff
j <= i + len_b - N_q), fp16 / bf16 / fp32, d and d_v from 1 to 256 (padded tiles,
`flashedu.kernels.tiles`), lse float32 in natural units, rows that see nothing give o = 0 and
lse = -inf. Limits: no window, ALiBi or score mods; forward only; the cache's page and row axes
must be contiguous with each other (stride(0) == page_size * stride(1)), as a cache tensor is; one
fixed launch configuration, not tuned (scripts/serving/h200_paged_decode.py times it). `forward`
validates every call, and the check reads the block table and lengths on the host (a copy and a
sync): a serving loop validates once (`plan`) when its table changes and launches `split_states`
and `combine` itself, as the benchmark does. The bytes
it moves are `flashedu.traffic.paged_decode_bytes`.

Introduced in notebooks/12_serving.ipynb.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..traffic.paged import paged_split
from ..validation import check_block_table, check_causal, check_int, check_sinks, resolve_scale
from .common import LOG2E
from .launch import DTYPES, INTERPRETER, kernel_flags
from .paged_solution import page_rows
from .tiles import MAX_HEAD_DIM, load_tile, pad_dim, store_tile

MAX_ROWS = 128  # query rows (H / H_kv * N_q) one split program holds on chip


@triton.jit
def _load_rows(ptrs, keep, dims, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """(len(keep), BLOCK_D) tile: rows where keep is False and columns >= D read as 0, no HBM."""
    if D < BLOCK_D:
        x = tl.load(ptrs, mask=keep[:, None] & (dims[None, :] < D), other=0.0)
    else:
        x = tl.load(ptrs, mask=keep[:, None], other=0.0)
    return x


@triton.jit
def paged_split_kernel(
    Q, K, V, TABLE, LENS, M_PART, L_PART, O_PART,
    stride_qb, stride_qh, stride_qm, stride_kn, stride_kh, stride_vn, stride_vh, stride_tb,
    qk_scale, B, H, H_kv, GROUP, N_q, SPLIT,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    PAGE_SIZE: tl.constexpr, PAGE_ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One program: every query row of the GROUP heads sharing one K/V head, against keys
    [split * SPLIT, (split + 1) * SPLIT) of one sequence, read page by page. Grid (num_splits,
    B * H_kv). Row r of the tile is query r % N_q of head kv_head * GROUP + r // N_q."""
    split = tl.program_id(0)
    b = tl.program_id(1) // H_kv
    kv_head = tl.program_id(1) % H_kv
    seqlen = tl.load(LENS + b)  # HBM: read 4 bytes
    lo = split * SPLIT
    hi = tl.minimum(lo + SPLIT, seqlen)
    r = tl.arange(0, BLOCK_M)
    head = kv_head * GROUP + r // N_q
    i = r % N_q
    n_rows = tl.where(lo < hi, GROUP * N_q, 0)  # a split past the sequence's end reads no q
    dims = tl.arange(0, BLOCK_D)
    dims_v = tl.arange(0, BLOCK_DV)
    q_ptrs = (
        Q + b.to(tl.int64) * stride_qb + head[:, None].to(tl.int64) * stride_qh
        + i[:, None] * stride_qm + dims[None, :]
    )  # fmt: skip
    q = load_tile(q_ptrs, r, n_rows, dims, HEAD_DIM, BLOCK_D, True)  # HBM: read rows * d
    if UPCAST:
        q = q.to(tl.float32)
    K += kv_head.to(tl.int64) * stride_kh
    V += kv_head.to(tl.int64) * stride_vh
    bt_row = TABLE + b.to(tl.int64) * stride_tb
    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    diag = i + seqlen - N_q  # bottom-right: query i sees keys j <= diag
    for start_n in tl.range(lo, hi, BLOCK_N):
        rows, keep = PAGE_ROWS(bt_row, start_n, seqlen, PAGE_SIZE, BLOCK_N)  # through the table
        k = _load_rows(K + rows[:, None] * stride_kn + dims[None, :], keep, dims, HEAD_DIM, BLOCK_D)
        v = _load_rows(V + rows[:, None] * stride_vn + dims_v[None, :], keep, dims_v, V_DIM,
                       BLOCK_DV)  # fmt: skip
        if UPCAST:  # HBM: read the keys that exist, d of K and d_v of V each
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        see = keep[None, :]
        if CAUSAL:
            cols = start_n + tl.arange(0, BLOCK_N)
            see = see & (cols[None, :] <= diag[:, None])
        s = tl.where(see, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == -float("inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)  # rescale because the row max moved
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    live = r < GROUP * N_q
    row = ((split * B + b) * H + head).to(tl.int64) * N_q + i  # into (num_splits, B, H, N_q)
    tl.store(M_PART + row, m_i * 0.6931471805599453, mask=live)  # ln 2: natural units; HBM:
    tl.store(L_PART + row, l_i, mask=live)  # write rows * (d_v + 2) float32
    store_tile(O_PART + row[:, None] * V_DIM + dims_v[None, :], acc, r, GROUP * N_q, dims_v, V_DIM,
               BLOCK_DV)  # fmt: skip


@triton.jit
def combine_kernel(
    M_PART, L_PART, O_PART, SINKS, O, LSE, NUM_SPLITS, ROWS, H, N_q,
    V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SINKS: tl.constexpr,
):  # fmt: skip
    """One program per query row: fold its NUM_SPLITS partial states at once, the rule of
    `softmax.merge`; a sink is one more state (m = sink, l = 1, o = 0) in the same max and sum."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_DV)
    m = tl.load(M_PART + s * ROWS + row, mask=s < NUM_SPLITS, other=-float("inf"))
    l = tl.load(L_PART + s * ROWS + row, mask=s < NUM_SPLITS, other=0.0)  # HBM: read S*(d_v+2)
    o = load_tile(O_PART + (s[:, None] * ROWS + row) * V_DIM + dims[None, :], s, NUM_SPLITS, dims,
                  V_DIM, BLOCK_DV, True)  # fmt: skip
    m_max = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(SINKS + (row // N_q) % H)  # HBM: read 4 bytes; natural units, unscaled
        m_max = tl.maximum(m_max, sink)
    m_use = tl.where(m_max == -float("inf"), 0.0, m_max)
    w = tl.exp(m - m_use)  # each split's weight; 0 for an empty split
    l_sum = tl.sum(w * l, 0)
    if HAS_SINKS:
        l_sum += tl.exp(sink - m_use)  # the sink's column: exp(sink) in the sum, no value
    l_use = tl.where(l_sum == 0.0, 1.0, l_sum)
    o_row = (tl.sum(w[:, None] * o, 0) / l_use).to(O.dtype.element_ty)
    tl.store(O + row * V_DIM + dims, o_row, mask=dims < V_DIM)  # HBM: write d_v + 1
    tl.store(LSE + row, tl.where(l_sum == 0.0, -float("inf"), m_use + tl.log(l_use)))


def combine(m, l, o, dtype=None, *, sinks=None, out=None):
    """Merge partial states m, l (S, B, H, N_q) float32 and o (S, B, H, N_q, d) over their first
    axis, with the Triton combine kernel; sinks (H,) float32 join each row of their head. Returns
    (o (B, H, N_q, d) in `dtype`, lse float32), written into `out` = (o, lse) when given."""
    S, B, H, N_q = m.shape
    d = o.shape[-1]
    if out is None:
        out = (
            torch.empty(o.shape[1:], dtype=dtype or o.dtype, device=o.device),
            torch.empty(m.shape[1:], dtype=torch.float32, device=o.device),
        )
    o_out, lse = out
    rows = B * H * N_q
    combine_kernel[(rows,)](
        m.contiguous(), l.contiguous(), o.contiguous(), m if sinks is None else sinks, o_out, lse,
        S, rows, H, N_q, V_DIM=d, BLOCK_DV=pad_dim(d),
        BLOCK_S=max(2, triton.next_power_of_2(S)), HAS_SINKS=sinks is not None,
    )  # fmt: skip
    return o_out, lse


# --------------------------------------------------------------------------------------------------
# Validation: every misuse fails here, before any launch, with the argument and the value named.
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PagedPlan:
    """One validated paged call: sizes, the lengths, the launch's blocks and splits."""

    B: int
    H: int
    H_kv: int
    N_q: int
    d: int
    d_v: int
    num_pages: int
    page_size: int
    seqlens: tuple[int, ...]
    scale: float
    causal: bool
    block_n: int
    num_splits: int
    split: int  # keys per split, a multiple of block_n


def _tensor(x, arg, ndim, what, name):
    if not isinstance(x, torch.Tensor):
        got = "None" if x is None else type(x).__name__
        raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {got}")
    if x.ndim != ndim:
        raise ValueError(f"{name}: {arg} must have shape {what}, got {tuple(x.shape)}")


def _check_cache(q, k_cache, v_cache, name):
    """q (B, H, N_q, d), k_cache (num_pages, page_size, H_kv, d), v_cache (..., d_v): shapes,
    dtypes, devices and the strides the kernel reads them with."""
    _tensor(q, "q", 4, "(B, H, N_q, d)", name)
    _tensor(k_cache, "k_cache", 4, "(num_pages, page_size, H_kv, d)", name)
    _tensor(v_cache, "v_cache", 4, "(num_pages, page_size, H_kv, d_v)", name)
    B, H, N_q, d = q.shape
    P, page_size, H_kv, d_k = k_cache.shape
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(
            f"{name}: v_cache must have k_cache's (num_pages, page_size, H_kv) = "
            f"{tuple(k_cache.shape[:3])}, got {tuple(v_cache.shape[:3])}"
        )
    if min(B, H, N_q, d, P, page_size, H_kv, v_cache.shape[-1]) == 0:
        raise ValueError(
            f"{name}: every size must be at least 1, got q {tuple(q.shape)}, k_cache "
            f"{tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    if d_k != d:
        raise ValueError(f"{name}: k_cache's head dimension {d_k} must equal q's d = {d}")
    if H % H_kv:
        raise ValueError(
            f"{name}: q's H = {H} heads must be a multiple of the cache's H_kv = {H_kv} (GQA)"
        )
    for arg, dim in (("d", d), ("d_v", v_cache.shape[-1])):
        if dim > MAX_HEAD_DIM:
            raise ValueError(
                f"{name}: head dimension {arg}={dim} is not supported by the kernels; expected "
                f"1 to {MAX_HEAD_DIM}"
            )
    if q.dtype not in DTYPES:
        raise TypeError(f"{name}: q's dtype must be float16, bfloat16 or float32, got {q.dtype}")
    for arg, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name}: {arg} must have q's dtype {q.dtype}, got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name}: {arg} must be on q's device {q.device}, got {x.device}")
        if x.stride(-1) != 1 or x.stride(0) != page_size * x.stride(1):
            raise ValueError(
                f"{name}: {arg} must hold each page's rows one after another with a unit stride "
                f"along d (stride(0) == page_size * stride(1), stride(-1) == 1), got strides "
                f"{tuple(x.stride())}; the kernel never copies the cache"
            )
    if not INTERPRETER and q.device.type != "cuda":
        raise ValueError(
            f"{name}: q and the caches must be CUDA tensors on a GPU machine, got device "
            f"{q.device} (CPU tensors run only under TRITON_INTERPRET=1)"
        )
    if H // H_kv * N_q > MAX_ROWS:
        raise ValueError(
            f"{name}: H / H_kv * N_q = {H // H_kv} * {N_q} query rows exceed the {MAX_ROWS} one "
            "program holds; paged decoding is for a few query rows"
        )
    return B, H, H_kv, N_q, d, P, page_size


def _check_ints(x, arg, device, name):
    if x.dtype != torch.int32:
        raise TypeError(f"{name}: {arg} must be torch.int32, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name}: {arg} must be on q's device {device}, got {x.device}")


def _block_n(block_n, page_size, name):
    if block_n is None:
        block_n = 16 if INTERPRETER else 64
        while block_n > 16 and page_size % block_n:
            block_n //= 2
    elif (
        isinstance(block_n, bool)
        or not isinstance(block_n, int)
        or block_n < 16
        or (block_n & (block_n - 1))
    ):
        raise ValueError(f"{name}: block_n must be a power of two >= 16, got {block_n!r}")
    if page_size % block_n:
        raise ValueError(
            f"{name}: page_size = {page_size} must be a multiple of the kernel's key block "
            f"BLOCK_N = {block_n}: a tile of keys must lie in one page"
        )
    return block_n


# split programs `auto_splits` aims at per SM: 8 measured faster than 4 on the H200 at batch 8
# (CUDA-graph replay, 8 K/V heads, d = 128, fp16: 1.16 against 1.32 ms at 128k keys, 0.29 against
# 0.34 at 32k) and within 3 % elsewhere but batch 64 with 1k keys, 7 % slower
# (notebooks/results/h200_paged_decode.json, "ms_graph" against "ms_graph_x2")
PROGRAMS_PER_SM = 8


def auto_splits(
    B: int, H_kv: int, longest: int, block_n: int, device, per_sm: int = PROGRAMS_PER_SM
) -> int:
    """Enough programs to fill the GPU (about `per_sm` per SM), never a split shorter than 256
    keys (or one block): how many splits `forward` uses when num_splits is None."""
    sms = 4
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = -(-per_sm * sms // (B * H_kv))
    return max(1, min(want, -(-longest // max(256, block_n))))


def plan(q, k_cache, v_cache, block_table, cache_seqlens, causal, softmax_scale, sinks,
         num_splits, block_n, name) -> PagedPlan:  # fmt: skip
    """Validate a paged call once, before any launch; returns the plan the launch follows."""
    B, H, H_kv, N_q, d, P, page_size = _check_cache(q, k_cache, v_cache, name)
    block_n = _block_n(block_n, page_size, name)
    for arg, x, ndim in (("block_table", block_table, 2), ("cache_seqlens", cache_seqlens, 1)):
        what = "(B, max_pages)" if ndim == 2 else "(B,)"
        _tensor(x, arg, ndim, what + " int32", name)
    seqlens = check_block_table(
        block_table, cache_seqlens, num_pages=P, page_size=page_size, B=B, name=name
    )
    _check_ints(block_table, "block_table", q.device, name)
    _check_ints(cache_seqlens, "cache_seqlens", q.device, name)
    if check_sinks(sinks, H, name=name) is not None:
        if not isinstance(sinks, torch.Tensor) or sinks.dtype != torch.float32:
            got = sinks.dtype if isinstance(sinks, torch.Tensor) else type(sinks).__name__
            raise TypeError(f"{name}: sinks must be a torch.float32 tensor, got {got}")
        if sinks.device != q.device:
            raise ValueError(f"{name}: sinks must be on q's device {q.device}, got {sinks.device}")
    longest = max(seqlens)
    if num_splits is None:
        num_splits = auto_splits(B, H_kv, longest, block_n, q.device)
    num_splits = check_int(num_splits, "num_splits", name=name)
    split = paged_split(seqlens, num_splits, block_n)  # whole tiles, never straddling splits
    return PagedPlan(
        B, H, H_kv, N_q, d, v_cache.shape[-1], P, page_size, tuple(seqlens),
        resolve_scale(softmax_scale, d, name=name), check_causal(causal, name=name), block_n,
        num_splits, split,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Launch
# --------------------------------------------------------------------------------------------------
def _warps(p: PagedPlan) -> int:
    """8 warps for tiles of 128 or 256 columns, else 4: from ptxas on the sm_90 compile (d = 128,
    BLOCK_N = 64: 4 warps spill 168 bytes at 255 registers, 8 warps use 254 and spill nothing);
    not timed."""
    return 8 if max(pad_dim(p.d), pad_dim(p.d_v)) >= 128 else 4


def split_states(q, k_cache, v_cache, block_table, cache_seqlens, p: PagedPlan, page_fn=None):
    """Launch the split kernel on a validated plan: partial states (m, l, o), each with a leading
    num_splits axis, float32. page_fn: the @triton.jit page lookup (default `page_rows`)."""
    if q.stride(-1) != 1:
        q = q.contiguous()  # q is a few rows; the cache is never copied
    flags, _, _ = kernel_flags(q, p.scale, (False, 0, False, 0), False)
    parts = [
        torch.empty((p.num_splits, p.B, p.H, p.N_q, *extra), dtype=torch.float32, device=q.device)
        for extra in ((), (), (p.d_v,))
    ]
    group = p.H // p.H_kv
    paged_split_kernel[(p.num_splits, p.B * p.H_kv)](
        q, k_cache, v_cache, block_table, cache_seqlens, *parts,
        *q.stride()[:3], k_cache.stride(1), k_cache.stride(2), v_cache.stride(1),
        v_cache.stride(2), block_table.stride(0),
        p.scale * LOG2E, p.B, p.H, p.H_kv, group, p.N_q, p.split,
        CAUSAL=p.causal, HEAD_DIM=p.d, V_DIM=p.d_v, BLOCK_D=pad_dim(p.d),
        BLOCK_DV=pad_dim(p.d_v), UPCAST=flags["UPCAST"], PRECISION=flags["PRECISION"],
        PAGE_SIZE=p.page_size, PAGE_ROWS=page_rows if page_fn is None else page_fn,
        BLOCK_M=max(16, triton.next_power_of_2(group * p.N_q)), BLOCK_N=p.block_n,
        num_warps=_warps(p), num_stages=1 if INTERPRETER else 2,
    )  # fmt: skip
    return parts


def forward(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    sinks: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    page_fn=None,
    out=None,
    name: str = "kernels.paged.forward",
):
    """Split-KV decoding through a block table; `decoding.paged_forward` documents the arguments.
    page_fn: a @triton.jit page lookup with `page_rows`'s signature (chapter 12's exercise);
    out: (o, lse) to write into. Returns (o (B, H, N_q, d_v) in q's dtype, lse (B, H, N_q)
    float32)."""
    p = plan(q, k_cache, v_cache, block_table, cache_seqlens, causal, softmax_scale, sinks,
             num_splits, block_n, name)  # fmt: skip
    parts = split_states(q, k_cache, v_cache, block_table, cache_seqlens, p, page_fn)
    return combine(*parts, dtype=q.dtype, sinks=sinks, out=out)
