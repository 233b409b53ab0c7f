"""FlashAttention in serving: a KV cache in pages, attention through a block table, attention
sinks, and multi-head latent attention (MLA).

A server generates for many sequences at once, each one token per step, each with a KV cache that
grows by one row per layer and step. Four pieces, one per section of the chapter:

* The decode loop (`generate`): the course's small GPT (`flashedu.gpt`) run one token at a time,
  its keys and values kept per layer in a cache. `ContiguousKVCache` keeps each sequence's K/V in
  one array and reallocates it as it grows (what `torch.cat` does); `copy_bytes` and
  `reserved_bytes` are the byte model of what that costs.
* The paged cache (`PagedKVCache`, Kwon et al. 2023, "Efficient Memory Management for Large
  Language Model Serving with PagedAttention", arXiv:2309.06180): K and V pools of fixed-size
  pages, a free list, and per sequence a row of the block table (its pages in order) and a length.
  `append_tokens` fills the last page and takes a new one only when it is full; `free_sequence`
  hands the pages back; `PagedKVCache.fork` shares a sequence's pages with a new one (reference
  counts, the last page copied on write).
* `paged_attention`: attention of q against the paged cache, reading K/V page by page through the
  block table with the online softmax, never gathering the cache into one array; GQA, causal
  (bottom-right), ragged lengths (0 included) and attention sinks.
* Attention sinks (Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks",
  arXiv:2309.17453; here as one learnable logit per head, the form gpt-oss uses): a column with a
  score and no value joins every softmax row. It starts the online state at (m, l, o) =
  (sink, 1, 0). `sink_forward`, `sink_backward` (dsink_h = -sum_i P_sink,i D_i) and the
  autograd Function `SinkAttention`.
* MLA (DeepSeek-AI 2024, "DeepSeek-V2", arXiv:2405.04434): the cache holds a latent c_kv (d_c) and
  one shared RoPE key (d_r) per token. `mla_naive` expands per-head keys and values from the
  latent; `mla_absorbed` folds W_uk into the query and W_uv into the output, so attention runs on
  the latent cache as one K/V head of width d_c + d_r shared by all heads (MQA). Same output.

Conventions as everywhere in flashedu: q (B, H, N_q, d); lse natural log of each scaled score row
(with sinks, the sink column included); a row that sees nothing gives o = 0 and lse = -inf (with a
sink: lse = sink). Limits: NumPy, forward only except the sinks; a page pool of one dtype; the
decode loop runs the GPT one token at a time (prefill included) on the CPU, a few hundred tokens at
most, and its cache is per layer. No Triton here.

Introduced in notebooks/12_serving.ipynb.
"""

from __future__ import annotations

import numpy as np

from . import decoding, softmax, tiled_backward
from .dtypes import acc_dtype
from .validation import (
    check_block_table,
    check_causal,
    check_int,
    check_qkv,
    check_sinks,
    resolve_scale,
)

# --------------------------------------------------------------------- 1. the contiguous cache


def copy_bytes(n_tokens: int, bytes_per_token: int) -> int:
    """Bytes a contiguous cache copies while growing to n_tokens one token at a time, reallocating
    at every step: step t copies the t tokens already there, sum = n (n - 1) / 2 tokens."""
    n_tokens = check_int(n_tokens, "n_tokens", name="serving.copy_bytes", low=0)
    return n_tokens * (n_tokens - 1) // 2 * bytes_per_token


def reserved_bytes(lengths, bytes_per_token: int, *, max_len=None, page_size=None):
    """(reserved, used) bytes for sequences of these lengths: one buffer of max_len tokens each
    (a preallocated contiguous cache), or whole pages of page_size tokens (a paged cache)."""
    lengths = [int(n) for n in lengths]
    used = sum(lengths) * bytes_per_token
    if (max_len is None) == (page_size is None):
        raise ValueError("serving.reserved_bytes: give exactly one of max_len and page_size")
    if max_len is not None:
        return len(lengths) * int(max_len) * bytes_per_token, used
    return sum(-(-n // page_size) * page_size for n in lengths) * bytes_per_token, used


class ContiguousKVCache:
    """Each sequence's K and V in one array (N, H_kv, d), reallocated and copied at every append,
    as `torch.cat` on a growing cache does. `bytes_copied` counts what the copies moved."""

    def __init__(self, H_kv: int, d: int, *, d_v: int | None = None, dtype=np.float32):
        self.H_kv, self.d, self.d_v, self.dtype = H_kv, d, d_v or d, np.dtype(dtype)
        self.k: dict = {}
        self.v: dict = {}
        self.bytes_copied = 0

    def append(self, seq, k, v) -> None:
        """Add rows k (n, H_kv, d) and v (n, H_kv, d_v) to sequence `seq`."""
        old_k = self.k.get(seq, np.zeros((0, self.H_kv, self.d), self.dtype))
        old_v = self.v.get(seq, np.zeros((0, self.H_kv, self.d_v), self.dtype))
        self.bytes_copied += old_k.nbytes + old_v.nbytes  # the whole cache moves to a new buffer
        self.k[seq] = np.concatenate([old_k, np.asarray(k, self.dtype)])
        self.v[seq] = np.concatenate([old_v, np.asarray(v, self.dtype)])

    def free(self, seq) -> None:
        del self.k[seq], self.v[seq]

    def attention(self, q, seqs):
        """o (B, H, N_q, d_v) of q against the caches of `seqs`, one sequence at a time."""
        o = [
            decoding.forward(
                q[b : b + 1],
                self.k[s].transpose(1, 0, 2)[None],  # (1, H_kv, N, d)
                self.v[s].transpose(1, 0, 2)[None],
                num_splits=1,
            )[0]
            for b, s in enumerate(seqs)
        ]
        return np.concatenate(o)


# ----------------------------------------------------------------------- 2a. the paged cache


class PagedKVCache:
    """K and V in pools of pages, (num_pages, page_size, H_kv, d); the pages of each sequence
    listed in order in `tables[seq]`, its length in `lengths[seq]`, unused pages in `free_pages`
    (the next page handed out is `free_pages.pop()`), and `refs[p]` sequences holding page p.

    A sequence of n tokens holds ceil(n / page_size) pages, so at most page_size - 1 slots per
    sequence stand empty; pages never move once written.
    """

    def __init__(self, num_pages, page_size, H_kv, d, *, d_v=None, dtype=np.float32):
        name = "serving.PagedKVCache"
        num_pages = check_int(num_pages, "num_pages", name=name)
        self.page_size = check_int(page_size, "page_size", name=name)
        H_kv, d = check_int(H_kv, "H_kv", name=name), check_int(d, "d", name=name)
        d_v = d if d_v is None else check_int(d_v, "d_v", name=name)
        self.k_pages = np.zeros((num_pages, self.page_size, H_kv, d), dtype)
        self.v_pages = np.zeros((num_pages, self.page_size, H_kv, d_v), dtype)
        self.free_pages = list(range(num_pages - 1, -1, -1))
        self.tables: dict = {}
        self.lengths: dict = {}
        self.refs = np.zeros(num_pages, np.int64)

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[0]

    @property
    def pages_used(self) -> int:
        return self.num_pages - len(self.free_pages)

    def append(self, seq, k, v) -> None:
        """`append_tokens(self, seq, k, v)`."""
        append_tokens(self, seq, k, v)

    def free(self, seq) -> None:
        """`free_sequence(self, seq)`."""
        free_sequence(self, seq)

    def fork(self, seq, new_seq) -> None:
        """Start `new_seq` as a copy of `seq` that shares its pages (a shared prompt, parallel
        samples): no page is copied now; the shared last page is copied when either appends."""
        if seq not in self.tables or new_seq in self.tables:
            raise KeyError(f"serving.PagedKVCache.fork: cannot fork {seq!r} into {new_seq!r}")
        self.tables[new_seq] = list(self.tables[seq])
        self.lengths[new_seq] = self.lengths[seq]
        self.refs[self.tables[seq]] += 1

    def block_table(self, seqs=None):
        """(block_table (B, max_pages) int32 padded with -1, cache_seqlens (B,) int32) for
        `seqs` (default: every sequence, in the order they started)."""
        seqs = list(self.tables) if seqs is None else list(seqs)
        width = max([len(self.tables[s]) for s in seqs] + [1])
        table = np.full((len(seqs), width), -1, np.int32)
        for b, s in enumerate(seqs):
            table[b, : len(self.tables[s])] = self.tables[s]
        return table, np.array([self.lengths[s] for s in seqs], np.int32)

    def attention(self, q, seqs, **kwargs):
        """`paged_attention` of q (B, H, N_q, d) against the sequences `seqs`; o only."""
        table, lens = self.block_table(seqs)
        return paged_attention(q, self.k_pages, self.v_pages, table, lens, **kwargs)[0]


def _take_page(cache) -> int:
    if not cache.free_pages:
        raise MemoryError(
            f"serving.PagedKVCache: all {cache.k_pages.shape[0]} pages are in use; free a "
            "sequence or make a larger pool"
        )
    page = cache.free_pages.pop()
    cache.refs[page] = 1
    return page


def _check_rows(cache, k, v, name="serving.PagedKVCache.append"):
    for arg, x, pool in (("k", k, cache.k_pages), ("v", v, cache.v_pages)):
        if not hasattr(x, "shape") or tuple(x.shape[1:]) != pool.shape[2:] or x.ndim != 3:
            got = tuple(x.shape) if hasattr(x, "shape") else type(x).__name__
            want = ", ".join(map(str, pool.shape[2:]))
            raise ValueError(f"{name}: {arg} must have shape (n, {want}), got {got}")
    if len(k) != len(v):
        raise ValueError(
            f"{name}: k and v must hold the same number of rows, got {len(k)} and {len(v)}"
        )


def append_tokens(cache, seq, k, v) -> None:
    """Append rows k (n, H_kv, d) and v (n, H_kv, d_v) to sequence `seq` of a PagedKVCache (a new
    sequence starts empty). Fills the last page, and takes a page from the free list only when
    it is full; pages already written are never moved (a shared last page is copied first)."""
    _check_rows(cache, k, v)
    ps = cache.page_size
    table = cache.tables.setdefault(seq, [])
    n = cache.lengths.setdefault(seq, 0)
    if n % ps and cache.refs[table[-1]] > 1:  # copy on write: another sequence reads this page
        page = _take_page(cache)
        cache.k_pages[page], cache.v_pages[page] = (
            cache.k_pages[table[-1]],
            cache.v_pages[table[-1]],
        )
        cache.refs[table[-1]] -= 1
        table[-1] = page
    for i in range(len(k)):
        slot = (n + i) % ps
        if slot == 0:  # the last page is full (or there is none yet)
            table.append(_take_page(cache))
        cache.k_pages[table[-1], slot] = k[i]
        cache.v_pages[table[-1], slot] = v[i]
    cache.lengths[seq] = n + len(k)


def free_sequence(cache, seq) -> None:
    """Remove sequence `seq` from a PagedKVCache; each of its pages no other sequence holds goes
    back to the free list."""
    if seq not in cache.tables:
        raise KeyError(f"serving.PagedKVCache.free: no sequence {seq!r} in the cache")
    for page in cache.tables.pop(seq):
        cache.refs[page] -= 1
        if cache.refs[page] == 0:
            cache.free_pages.append(page)
    del cache.lengths[seq]


# ------------------------------------------------------------------- 2b. attention over pages


def _online(q_b, tiles, n, *, scale, causal, sink, acc):
    """(o, lse) of one sequence's queries q_b (H, N_q, d) against the key tiles
    [(c0, k_j (H_kv, n_j, d), v_j (H_kv, n_j, d_v)), ...] covering keys 0..n-1 in order."""
    H, N_q, _ = q_b.shape
    m = np.full((H, N_q), -np.inf, acc)
    l = np.zeros((H, N_q), acc)
    o = None
    if sink is not None:  # the sink: one more column, score sink[h], value 0
        m = np.repeat(np.asarray(sink, acc)[:, None], N_q, axis=1)
        l = np.where(np.isneginf(m), 0, 1).astype(acc)
    rows = np.arange(N_q) + n - N_q  # each query's position among the keys (bottom-right)
    q_b = q_b.astype(acc)
    for c0, k_j, v_j in tiles:
        g = H // k_j.shape[0]
        k_j = np.repeat(k_j.astype(acc), g, axis=0)  # (H, n_j, d): query head h reads h // g
        v_j = np.repeat(v_j.astype(acc), g, axis=0)
        s = q_b @ k_j.swapaxes(-1, -2) * acc.type(scale)  # (H, N_q, n_j)
        if causal:
            s = np.where(c0 + np.arange(k_j.shape[1]) <= rows[:, None], s, -np.inf)
        m, l, p, alpha = softmax.online_step(m, l, s)
        o = p @ v_j if o is None else alpha[..., None] * o + p @ v_j  # rescale: the max moved
    if o is None:
        return None, softmax.lse_of(m, l)
    return softmax.finalize(m, l, o)


def _check_pages(q, k_pages, v_pages, name):
    for arg, x in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        if not isinstance(x, np.ndarray) or x.ndim != 4:
            got = f"shape {x.shape}" if hasattr(x, "shape") else type(x).__name__
            raise ValueError(
                f"{name}: {arg} must be a 4-dim NumPy array "
                + ("(B, H, N_q, d)" if arg == "q" else "(num_pages, page_size, H_kv, d)")
                + f", got {got}"
            )
    if k_pages.shape[:3] != v_pages.shape[:3]:
        raise ValueError(
            f"{name}: k_pages and v_pages must share (num_pages, page_size, H_kv), got "
            f"{k_pages.shape} and {v_pages.shape}"
        )
    H, d, H_kv = q.shape[1], q.shape[3], k_pages.shape[2]
    if k_pages.shape[3] != d:
        raise ValueError(f"{name}: q has head dim d={d}, k_pages has {k_pages.shape[3]}")
    if H % H_kv:
        raise ValueError(f"{name}: q has H={H} heads, not a multiple of the pages' H_kv={H_kv}")
    if not (q.dtype == k_pages.dtype == v_pages.dtype) or q.dtype.kind != "f":
        raise TypeError(
            f"{name}: q, k_pages and v_pages must share one float dtype, got {q.dtype}, "
            f"{k_pages.dtype} and {v_pages.dtype}"
        )


def paged_attention(
    q: np.ndarray,
    k_pages: np.ndarray,
    v_pages: np.ndarray,
    block_table,
    cache_seqlens,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    sinks=None,
):
    """Attention of q against a paged KV cache, page by page through the block table.

    Args:
        q: (B, H, N_q, d); k_pages: (num_pages, page_size, H_kv, d); v_pages: (num_pages,
            page_size, H_kv, d_v); H % H_kv == 0; one float dtype.
        block_table: ints (B, max_pages): sequence b's keys i live in page
            block_table[b, i // page_size], slot i % page_size. cache_seqlens: ints (B,), >= 0.
        causal: query i sees key j iff j <= i + len_b - N_q (bottom-right, per sequence).
        sinks: None or (H,) logits, one per head, each joining every row as a column with no value.
    Returns:
        o (B, H, N_q, d_v) in q's dtype; lse (B, H, N_q), float32 (float64 for float64 input),
        including the sink; a row that sees no key has o = 0 and lse = -inf (or the sink).
    """
    name = "serving.paged_attention"
    _check_pages(q, k_pages, v_pages, name)
    B, H, N_q, d = q.shape
    num_pages, ps = k_pages.shape[:2]
    lens = check_block_table(
        block_table, cache_seqlens, num_pages=num_pages, page_size=ps, B=B, name=name
    )
    table = np.asarray(block_table)
    check_sinks(sinks, H, name=name)
    scale = resolve_scale(softmax_scale, d, name=name)
    causal = check_causal(causal, name=name)
    acc = acc_dtype(q.dtype)
    o = np.zeros((B, H, N_q, v_pages.shape[3]), acc)
    lse = np.zeros((B, H, N_q), acc)
    for b, n in enumerate(lens):
        pages = (
            (j * ps, int(table[b, j]), min(ps, n - j * ps)) for j in range(-(-n // ps))
        )  # logical page j -> physical page block_table[b, j], holding `valid` keys
        tiles = (
            (c0, k_pages[p, :valid].transpose(1, 0, 2), v_pages[p, :valid].transpose(1, 0, 2))
            for c0, p, valid in pages
        )  # (H_kv, valid, d): one page at a time, read where the table says
        o_b, lse[b] = _online(q[b], tiles, n, scale=scale, causal=causal, sink=sinks, acc=acc)
        if o_b is not None:
            o[b] = o_b
    return o.astype(q.dtype), lse


# --------------------------------------------------------------------------- 2c. attention sinks


def sink_forward(q, k, v, sinks, *, causal=False, softmax_scale=None, block_n: int = 16):
    """Attention with sinks on a contiguous cache, by tiles of block_n keys: the online softmax
    starts from the sink's state (m, l, o) = (sink, 1, 0).

    q (B, H, N_q, d); k (B, H_kv, N_k, d); v (B, H_kv, N_k, d_v); sinks (H,) or None.
    Returns o (B, H, N_q, d_v) in q's dtype and lse (B, H, N_q), the sink included.
    """
    name = "serving.sink_forward"
    B, H, _, N_q, N_k, d = check_qkv(q, k, v, name=name, kind="numpy", value_dim=True)
    check_sinks(sinks, H, name=name)
    scale = resolve_scale(softmax_scale, d, name=name)
    causal = check_causal(causal, name=name)
    block_n = check_int(block_n, "block_n", name=name)
    acc = acc_dtype(q.dtype)
    o = np.zeros((B, H, N_q, v.shape[3]), acc)
    lse = np.zeros((B, H, N_q), acc)
    for b in range(B):
        tiles = (
            (c, k[b, :, c : c + block_n], v[b, :, c : c + block_n]) for c in range(0, N_k, block_n)
        )
        o[b], lse[b] = _online(q[b], tiles, N_k, scale=scale, causal=causal, sink=sinks, acc=acc)
    return o.astype(q.dtype), lse


def sink_backward(do, q, k, v, o, lse, sinks, *, causal=False, softmax_scale=None):
    """Gradients of sum(o * do) for attention with sinks: (dq, dk, dv, dsinks).

    The sink column has no value, so dS, dQ, dK, dV are the usual recomputing backward with the
    forward's lse (which includes the sink): P = exp(S - lse). The sink's own gradient:
        lse_i = log(exp(sink) + sum_j exp(s_ij))  ->  d p_ij / d sink = -p_ij P_sink,i
        dsink_h = -sum_i P_sink,i D_i,   P_sink,i = exp(sink_h - lse_i),  D_i = rowsum(dO_i * O_i)
    summed over the batch and the query rows of head h.
    """
    check_sinks(sinks, q.shape[1], name="serving.sink_backward")
    dq, dk, dv = tiled_backward.backward(
        do, q, k, v, o, lse, causal=causal, softmax_scale=softmax_scale
    )
    if sinks is None:
        return dq, dk, dv, None
    acc = acc_dtype(q.dtype)
    D = (do.astype(acc) * o.astype(acc)).sum(-1)  # (B, H, N_q)
    p_sink = np.exp(np.asarray(sinks, acc)[None, :, None] - lse.astype(acc))  # (B, H, N_q)
    dsinks = -(p_sink * D).sum(axis=(0, 2))
    return dq, dk, dv, dsinks.astype(np.asarray(sinks).dtype)


try:
    import torch
except ModuleNotFoundError:  # pragma: no cover - torch is a dependency of the course
    torch = None

if torch is not None:

    class SinkAttention(torch.autograd.Function):
        """Attention with sinks as a torch.autograd.Function over `sink_forward` and
        `sink_backward` (NumPy on the host; saves o and lse, recomputes P)."""

        @staticmethod
        def forward(ctx, q, k, v, sinks, causal=False, softmax_scale=None):
            args = [t.detach().cpu().numpy() for t in (q, k, v, sinks)]
            o, lse = sink_forward(*args, causal=causal, softmax_scale=softmax_scale)
            o, lse = torch.from_numpy(o).to(q.device), torch.from_numpy(lse).to(q.device)
            ctx.save_for_backward(q, k, v, sinks, o, lse)
            ctx.causal, ctx.softmax_scale = causal, softmax_scale
            ctx.mark_non_differentiable(lse)
            return o, lse

        @staticmethod
        def backward(ctx, do, _dlse):
            q, k, v, sinks, o, lse = (t.detach().cpu().numpy() for t in ctx.saved_tensors)
            grads = sink_backward(
                do.detach().cpu().numpy(), q, k, v, o, lse, sinks,
                causal=ctx.causal, softmax_scale=ctx.softmax_scale,
            )  # fmt: skip
            dev = ctx.saved_tensors[0].device
            return (*(torch.from_numpy(np.ascontiguousarray(g)).to(dev) for g in grads), None, None)


def attention_with_sinks(q, k, v, sinks, *, causal=False, softmax_scale=None):
    """Torch entry point: o (B, H, N_q, d_v) of attention with sinks, differentiable in q, k, v
    and sinks (`SinkAttention`)."""
    return SinkAttention.apply(q, k, v, sinks, causal, softmax_scale)[0]


# ---------------------------------------------------------------------------------- 2d. MLA


def _check_mla(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, name):
    arrays = dict(q_nope=q_nope, q_rope=q_rope, c_kv=c_kv, k_rope=k_rope, w_uk=w_uk, w_uv=w_uv)
    for arg, x in arrays.items():
        if not isinstance(x, np.ndarray) or x.dtype.kind != "f":
            raise TypeError(f"{name}: {arg} must be a float NumPy array, got {type(x).__name__}")
    want = {
        "q_nope": (4, "(B, H, N_q, d_nope)"), "q_rope": (4, "(B, H, N_q, d_rope)"),
        "c_kv": (3, "(B, N, d_c)"), "k_rope": (3, "(B, N, d_rope)"),
        "w_uk": (3, "(H, d_c, d_nope)"), "w_uv": (3, "(H, d_c, d_v)"),
    }  # fmt: skip
    for arg, (ndim, text) in want.items():
        if arrays[arg].ndim != ndim:
            raise ValueError(f"{name}: {arg} must have shape {text}, got {arrays[arg].shape}")
    B, H, N_q, d_nope = q_nope.shape
    N, d_c, d_rope = c_kv.shape[1], c_kv.shape[2], q_rope.shape[3]
    expect = {
        "q_rope": (B, H, N_q, d_rope), "c_kv": (B, N, d_c), "k_rope": (B, N, d_rope),
        "w_uk": (H, d_c, d_nope), "w_uv": (H, d_c, w_uv.shape[2]),
    }  # fmt: skip
    for arg, shape in expect.items():
        if arrays[arg].shape != shape:
            raise ValueError(
                f"{name}: {arg} must have shape {shape} to match, got {arrays[arg].shape}"
            )
    if N == 0:
        raise ValueError(f"{name}: the cache is empty (c_kv has N = 0 tokens)")


def mla_naive(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, *, causal=False, softmax_scale=None):
    """One MLA attention step as written: every head's keys and values expanded from the latent.

    q_nope (B, H, N_q, d_nope), q_rope (B, H, N_q, d_rope): the query's two parts. c_kv (B, N, d_c)
    and k_rope (B, N, d_rope): the cache, per token. w_uk (H, d_c, d_nope), w_uv (H, d_c, d_v): the
    up-projections. softmax_scale defaults to 1 / sqrt(d_nope + d_rope).
    Returns o (B, H, N_q, d_v) and lse (B, H, N_q).
    """
    _check_mla(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, "serving.mla_naive")
    B, H, _, d_nope = q_nope.shape
    scale = resolve_scale(softmax_scale, d_nope + q_rope.shape[3], name="serving.mla_naive")
    k_nope = np.einsum("bnc,hce->bhne", c_kv, w_uk)  # (B, H, N, d_nope): per-head keys
    k_r = np.broadcast_to(k_rope[:, None], (B, H) + k_rope.shape[1:])  # one RoPE key, every head
    k = np.concatenate([k_nope, k_r], axis=-1)  # (B, H, N, d_nope + d_rope), 192 in DeepSeek-V2
    v = np.einsum("bnc,hce->bhne", c_kv, w_uv)  # (B, H, N, d_v)
    q = np.concatenate([q_nope, q_rope], axis=-1)
    return decoding.forward(q, k, v, causal=causal, softmax_scale=scale, num_splits=1)


def mla_absorbed(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, *, causal=False, softmax_scale=None):
    """The same step with the up-projections absorbed: attention runs on the latent cache.

    q_nope . (W_uk^T c) = (W_uk q_nope) . c, so W_uk moves to the query side; and
    sum_j p_j (W_uv^T c_j) = W_uv^T (sum_j p_j c_j), so W_uv moves after the attention. What is
    left is MQA: one K head [c_kv, k_rope] of width d_c + d_rope and one V head c_kv (its first
    d_c columns), shared by all H query heads. Arguments and results as `mla_naive`.
    """
    _check_mla(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, "serving.mla_absorbed")
    scale = resolve_scale(
        softmax_scale, q_nope.shape[3] + q_rope.shape[3], name="serving.mla_absorbed"
    )  # the scale of the 192-wide keys: the scores are the same numbers
    q_lat = np.einsum("bhqe,hce->bhqc", q_nope, w_uk)  # (B, H, N_q, d_c): W_uk folded into q
    q = np.concatenate([q_lat, q_rope], axis=-1)  # (B, H, N_q, d_c + d_rope)
    k = np.concatenate([c_kv, k_rope], axis=-1)[:, None]  # (B, 1, N, d_c + d_rope): the cache
    v = c_kv[:, None]  # (B, 1, N, d_c)
    o_lat, lse = decoding.forward(q, k, v, causal=causal, softmax_scale=scale, num_splits=1)
    return np.einsum("bhqc,hce->bhqe", o_lat, w_uv), lse  # W_uv applied after: (B, H, N_q, d_v)


def mla_cache_bytes(H, d_c, d_rope, d_nope, d_v, itemsize=2) -> dict:
    """Cache bytes per token and layer: MLA's latent and RoPE key against the per-head K and V
    that the naive step expands (H (d_nope + d_rope) + H d_v)."""
    return {
        "MLA latent": (d_c + d_rope) * itemsize,
        "expanded K and V": H * (d_nope + d_rope + d_v) * itemsize,
    }


# ---------------------------------------------------------------------------- the decode loop


def _layer_step(block, x, cache, seqs):
    """One GPT block on one new token per sequence: x (B, C); K/V appended to `cache`."""
    B, C = x.shape
    H = block.attn.n_head
    q, k, v = block.attn.qkv(block.ln1(x)).split(C, dim=-1)  # (B, C) each
    q, k, v = (t.reshape(B, H, C // H).double().numpy() for t in (q, k, v))
    for b, s in enumerate(seqs):
        cache.append(s, k[b][None], v[b][None])  # one row (1, H, hs) per sequence
    o = cache.attention(q[:, :, None].astype(np.float32), seqs)  # (B, H, 1, hs)
    x = x + block.attn.proj(torch.from_numpy(np.ascontiguousarray(o)).reshape(B, C).to(x.dtype))
    return x + block.mlp(block.ln2(x))


def generate(model, prompts, max_new_tokens, *, cache, generator=None, greedy=False):
    """Generate for several sequences at once, one token per sequence and step, with a KV cache.

    model: a `gpt.GPT`. prompts: list of 1-D token tensors (lengths may differ). max_new_tokens:
    an int, or one per sequence. cache: a function making one layer's cache
    (`lambda: PagedKVCache(...)` or `lambda: ContiguousKVCache(...)`). A prompt is fed one token
    per step too. A sequence that is done is freed from every layer's cache at once.
    Returns (tokens: list of lists, caches: one per layer, logits: per sequence (T - 1, vocab),
    the logits of every position fed).
    """
    n_new = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else max_new_tokens
    tokens = [p.tolist() for p in prompts]
    total = [len(t) + n for t, n in zip(tokens, n_new)]
    if max(total) > model.config.block_size:
        raise ValueError(f"serving.generate: {max(total)} tokens exceed block_size")
    caches = [cache() for _ in model.blocks]
    logits = [[] for _ in prompts]
    with torch.no_grad():
        for t in range(max(total) - 1):
            seqs = [s for s in range(len(tokens)) if t < total[s] - 1]
            idx = torch.tensor([tokens[s][t] for s in seqs])
            x = model.tok_emb(idx) + model.pos_emb(torch.full((len(seqs),), t))  # (B, C)
            for block, layer_cache in zip(model.blocks, caches):
                x = _layer_step(block, x, layer_cache, seqs)
            out = model.head(model.ln_f(x))  # (B, vocab)
            for b, s in enumerate(seqs):
                logits[s].append(out[b])
                if t == len(tokens[s]) - 1:  # past the prompt: sample the next token
                    p = torch.softmax(out[b].double(), -1)
                    nxt = p.argmax() if greedy else torch.multinomial(p, 1, generator=generator)
                    tokens[s].append(int(nxt))
                if t == total[s] - 2:
                    for layer_cache in caches:
                        layer_cache.free(s)
    return tokens, caches, [torch.stack(x) for x in logits]


def decode_table(result: dict) -> str:
    """The H200 decode benchmark (`notebooks/results/h200_paged_decode.json`, written by
    scripts/serving/h200_paged_decode.py) as a table: per batch and context, the paged step's time
    replayed from a CUDA graph, its bytes over that time against the copy bandwidth measured in the
    same run, the same with twice the split programs, SDPA on the same keys held contiguously
    (graph replay), and the paged step launched from Python (host launch overhead included).
    Nothing here measures; every number comes from the file. Under 100 columns.

    Introduced in notebooks/12_serving.ipynb.
    """
    copy = result["hbm"]["gbs"]
    lines = [
        f"{'B':>3}{'keys':>8}{'splits':>7}{'paged us':>10}{'of copy':>9}{'splits':>8}"
        f"{'us':>7}{'SDPA us':>9}{'launched us':>13}"
    ]
    for r in result["rows"]:
        if "ms_graph" not in r:
            continue
        x2 = r["ms_graph_x2"] * 1e3
        lines.append(
            f"{r['B']:>3}{r['ctx']:>8}{r['num_splits']:>7}{r['ms_graph'] * 1e3:>10.0f}"
            f"{r['gbs_graph'] / copy:>9.0%}{r['num_splits_x2']:>8}{x2:>7.0f}"
            f"{r.get('sdpa_ms_graph', float('nan')) * 1e3:>9.0f}{r['ms'] * 1e3:>13.0f}"
        )
    return "\n".join(lines)
