"""Chapter 12 graders against solutions that give the right numbers by the wrong method.

Each shortcut is what a learner in a hurry writes: a cache that reallocates its pool, moves its
pages or rewrites its tokens from a copy kept aside (12.1); paged attention that gathers the pages
into one contiguous K and V first (12.2); a sink added after the loop, with the right numbers
(12.4); MLA that expands per-head keys and values from the latent (12.5). Each is rejected with a
diagnosis that names it.
"""

import numpy as np
import pytest
import torch

from flashedu import checks
from flashedu.testing import run_grader

from .test_ch12 import append, free, sinks

SEEDS = [0, 1]

# ---------------------------------------------------------------------------- 12.1 the cache


def append_reallocating(cache, seq, k, v):
    """Right bookkeeping, but the pools grow by reallocation (a new array each time)."""
    append(cache, seq, k, v)
    cache.k_pages = np.concatenate([cache.k_pages, cache.k_pages[:0]])
    cache.v_pages = np.concatenate([cache.v_pages, cache.v_pages[:0]])


def append_moving(cache, seq, k, v):
    """Keeps each sequence in fresh pages: at every append its old pages are copied to new ones
    (then freed), as a contiguous cache copies its buffer."""
    old = cache.tables.get(seq, [])
    ks = cache.k_pages[old].reshape((-1,) + cache.k_pages.shape[2:])[: cache.lengths.get(seq, 0)]
    vs = cache.v_pages[old].reshape((-1,) + cache.v_pages.shape[2:])[: cache.lengths.get(seq, 0)]
    ks, vs = ks.copy(), vs.copy()
    cache.tables[seq], cache.lengths[seq] = [], 0
    append(cache, seq, np.concatenate([ks, k]), np.concatenate([vs, v]))
    cache.free_pages.extend(old)


_KEPT: dict = {}


def append_rewriting(cache, seq, k, v):
    """Keeps every row aside and writes the whole sequence again at each append, into the same
    pages: the table is right, the old tokens are rewritten."""
    rows = _KEPT.setdefault((id(cache), seq), [])
    rows += [(k[i], v[i]) for i in range(len(k))]
    append(cache, seq, k, v)
    for i, (kr, vr) in enumerate(rows):
        page = cache.tables[seq][i // cache.page_size]
        cache.k_pages[page, i % cache.page_size] = kr
        cache.v_pages[page, i % cache.page_size] = vr


@pytest.mark.parametrize(
    "fn,words",
    [
        (append_reallocating, "replaced by new arrays: a paged cache never reallocates"),
        (append_moving, "pages already written were moved"),
        (append_rewriting, "rewrote tokens already in the cache from a copy kept aside"),
    ],
    ids=["reallocated pool", "pages moved", "tokens rewritten"],
)
def test_paged_cache_names_each_shortcut(fn, words):
    for seed in SEEDS:
        lines = []
        report = checks.paged_cache(fn, free, seed=seed, out=lines.append)
        assert not report.passed
        assert words in report.diagnosis, "\n".join(lines)


def test_paged_cache_calling_the_cache_method_is_named():
    report = checks.paged_cache(
        lambda c, s, k, v: c.append(s, k, v), free, seed=0, out=lambda *a: None
    )
    assert report.diagnosis.startswith("called flashedu.serving.PagedKVCache.append")


# ----------------------------------------------------------------------- 12.2 paged attention


def _softmax_attention(q, k, v):
    """q (H, N_q, d) against contiguous k, v (H, n, d): (o, lse)."""
    s = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    return e @ v / e.sum(-1, keepdims=True), m[..., 0] + np.log(e.sum(-1))


def gather_then_attend(q, k_pages, v_pages, block_table, cache_seqlens):
    """Gathers each sequence's pages into one contiguous K and V, then plain attention."""
    B, H, N_q, d = q.shape
    ps, H_kv = k_pages.shape[1], k_pages.shape[2]
    o, lse = np.zeros((B, H, N_q, v_pages.shape[3])), np.full((B, H, N_q), -np.inf)
    for b in range(B):
        n = int(cache_seqlens[b])
        if n:
            pages = block_table[b, : -(-n // ps)]
            k = k_pages[pages].reshape(-1, H_kv, d)[:n].transpose(1, 0, 2)  # (H_kv, n, d)
            v = v_pages[pages].reshape(-1, H_kv, v_pages.shape[3])[:n].transpose(1, 0, 2)
            g = H // H_kv
            o[b], lse[b] = _softmax_attention(q[b], np.repeat(k, g, 0), np.repeat(v, g, 0))
    return o, lse


def concatenate_pages(q, k_pages, v_pages, block_table, cache_seqlens):
    """Reads the pages one by one through the table, but stacks them into one array first."""
    B, H, N_q, d = q.shape
    ps, H_kv = k_pages.shape[1], k_pages.shape[2]
    o, lse = np.zeros((B, H, N_q, v_pages.shape[3])), np.full((B, H, N_q), -np.inf)
    for b in range(B):
        n = int(cache_seqlens[b])
        if n:
            ks = [k_pages[block_table[b, j]] for j in range(-(-n // ps))]
            vs = [v_pages[block_table[b, j]] for j in range(-(-n // ps))]
            k = np.concatenate(ks)[:n].transpose(1, 0, 2)
            v = np.concatenate(vs)[:n].transpose(1, 0, 2)
            g = H // H_kv
            o[b], lse[b] = _softmax_attention(q[b], np.repeat(k, g, 0), np.repeat(v, g, 0))
    return o, lse


def gather_in_torch(q, k_pages, v_pages, block_table, cache_seqlens):
    """The same gather with torch: index_select of the pages, then SDPA-free attention."""
    B, H, N_q, d = q.shape
    ps, H_kv = k_pages.shape[1], k_pages.shape[2]
    kp, vp = torch.as_tensor(np.asarray(k_pages)), torch.as_tensor(np.asarray(v_pages))
    o, lse = np.zeros((B, H, N_q, v_pages.shape[3])), np.full((B, H, N_q), -np.inf)
    for b in range(B):
        n = int(cache_seqlens[b])
        if n:
            idx = torch.as_tensor(np.asarray(block_table[b, : -(-n // ps)], dtype=np.int64))
            k = kp.index_select(0, idx).reshape(-1, H_kv, d)[:n].transpose(0, 1)
            v = vp.index_select(0, idx).reshape(-1, H_kv, vp.shape[3])[:n].transpose(0, 1)
            k, v = (x.repeat_interleave(H // H_kv, 0).numpy() for x in (k, v))
            o[b], lse[b] = _softmax_attention(np.asarray(q[b]), k, v)
    return o, lse


@pytest.mark.parametrize(
    "fn", [gather_then_attend, concatenate_pages, gather_in_torch],
    ids=["fancy-index gather", "concatenate", "torch index_select"],
)  # fmt: skip
def test_paged_attention_names_the_gather(fn):
    for seed in SEEDS:
        report, text = run_grader(checks.paged_attention, fn, seed=seed)
        assert not report.passed
        assert "gathering the pages into one contiguous K or V" in report.diagnosis, text
        assert report.diagnosis.startswith("built a"), text


# ------------------------------------------------------------------------------- 12.4 sinks


def sink_rescaled_at_the_end(q, k, v, sink, block_n):
    """Plain attention by tiles, then the output scaled by the keys' share once at the end, with
    logaddexp (stable, and the right numbers): the sink never was in the running state."""
    o, lse_keys, states = sinks(q, k, v, -np.inf, block_n)
    lse = np.logaddexp(lse_keys, sink)
    return o * np.exp(lse_keys - lse)[:, None], lse, states


@pytest.mark.parametrize("fn", [sink_rescaled_at_the_end, lambda *a: sinks(*a, post_hoc=True)],
                         ids=["rescaled at the end", "merged after the loop"])  # fmt: skip
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_sink_attention_names_a_sink_added_after_the_loop(fn):
    for seed in SEEDS:
        report, text = run_grader(checks.sink_attention, fn, seed=seed)
        assert not report.passed
        assert "the sink is not in the running state" in report.diagnosis, text
        assert sum(ok for _, ok, _ in report.results) <= 2  # no sink, or one far below


# --------------------------------------------------------------------------------- 12.5 MLA


def naive_expand(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv):
    """The naive step: per-head K (192 wide) and V (128) for every cached token."""
    B, H = q_nope.shape[:2]
    k = np.concatenate(
        [np.einsum("bnc,hce->bhne", c_kv, w_uk),
         np.broadcast_to(k_rope[:, None], (B, H) + k_rope.shape[1:])], -1,
    )  # fmt: skip
    v = np.einsum("bnc,hce->bhne", c_kv, w_uv)
    q = np.concatenate([q_nope, q_rope], -1)
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(192)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def per_head_loop(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv):
    """Absorbs nothing: expands one head at a time, (N, 128) keys and values per head."""
    B, H, N_q, _ = q_nope.shape
    o = np.zeros((B, H, N_q, w_uv.shape[2]))
    for b in range(B):
        for h in range(H):
            k_h = c_kv[b] @ w_uk[h]  # (N, 128)
            v_h = c_kv[b] @ w_uv[h]
            s = (q_nope[b, h] @ k_h.T + q_rope[b, h] @ k_rope[b].T) / np.sqrt(192)
            p = np.exp(s - s.max(-1, keepdims=True))
            o[b, h] = (p / p.sum(-1, keepdims=True)) @ v_h
    return o


def naive_in_torch(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv):
    """The naive step in torch, keys expanded with one batched matmul."""
    t = [torch.as_tensor(np.asarray(x)) for x in (q_nope, q_rope, c_kv, k_rope, w_uk, w_uv)]
    qn, qr, c, kr, wk, wv = t
    k_nope = torch.einsum("bnc,hce->bhne", c, wk)
    v = torch.einsum("bnc,hce->bhne", c, wv)
    s = (qn @ k_nope.transpose(-1, -2) + qr @ kr[:, None].transpose(-1, -2)) / 192**0.5
    return (torch.softmax(s, -1) @ v).numpy()


@pytest.mark.parametrize(
    "fn", [naive_expand, per_head_loop, naive_in_torch], ids=["naive", "per head", "torch"]
)
def test_mla_absorbed_names_expanded_keys_and_values(fn):
    for seed in SEEDS:
        report, text = run_grader(checks.mla_absorbed, fn, seed=seed)
        assert not report.passed
        assert "per-head keys or values expanded from the latent" in report.diagnosis, text


def test_mla_absorbed_refuses_the_naive_package_step():
    from flashedu import serving

    report, _ = run_grader(checks.mla_absorbed, lambda *a: serving.mla_naive(*a)[0], seed=0)
    assert report.diagnosis.startswith("called flashedu.serving.mla_naive")
