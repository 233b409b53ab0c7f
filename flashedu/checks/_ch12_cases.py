"""Inputs and planted-bug twins for the chapter 12 graders (ch12.py): paged pools with scrambled
block tables and garbage in every slot no sequence owns, and float64 twins of the usual mistakes
in paged attention, attention sinks and MLA.

Each twin plants exactly one mistake (a twin asked for none raises): they name a wrong answer, and
none of them is an answer. Tested through the graders' planted bugs (tests/checks/test_ch12.py).
"""

from __future__ import annotations

import numpy as np

GARBAGE = 40.0  # K rows in unowned slots: a key read by mistake dominates its row's softmax


def paged_pool(rng, lens, page_size, H_kv, d, d_v, *, spare=2):
    """(k_pages, v_pages, block_table, cache_seqlens, ks, vs): the sequences' pages in a random
    order of a pool with `spare` pages more than needed; every slot no sequence owns holds large
    keys; ks[b] (n_b, H_kv, d) and vs[b] are the contiguous rows, for the grader's reference."""
    need = [-(-n // page_size) for n in lens]
    num_pages = sum(need) + spare
    order = rng.permutation(num_pages)
    k_pages = GARBAGE * (1 + rng.random((num_pages, page_size, H_kv, d)))
    v_pages = GARBAGE * rng.standard_normal((num_pages, page_size, H_kv, d_v))
    table = np.full((len(lens), max(need + [1]) + 1), -1, np.int32)
    ks, vs, used = [], [], 0
    for b, n in enumerate(lens):
        ks.append(rng.standard_normal((n, H_kv, d)))
        vs.append(rng.standard_normal((n, H_kv, d_v)))
        for j in range(need[b]):
            table[b, j] = p = int(order[used])
            used += 1
            c0, c1 = j * page_size, min(n, (j + 1) * page_size)
            k_pages[p, : c1 - c0], v_pages[p, : c1 - c0] = ks[b][c0:c1], vs[b][c0:c1]
    return k_pages, v_pages, table, np.array(lens, np.int32), ks, vs


def contiguous_attention(q, k, v, *, sink=None, scale=None, rescale=True, lse_mode="m + log l"):
    """Attention of q (H, N_q, d) against k (N, H_kv, d), v (N, H_kv, d_v), one key at a time
    (so `rescale=False` is the classic missing-alpha bug); the sink (H,) starts the state."""
    H, N_q, d = q.shape
    N, H_kv, d_v = v.shape
    scale = 1 / np.sqrt(d) if scale is None else scale
    g = H // H_kv
    m = np.full((H, N_q), -np.inf) if sink is None else np.repeat(sink[:, None], N_q, 1) * 1.0
    l = np.where(np.isneginf(m), 0.0, 1.0)
    o = np.zeros((H, N_q, d_v))
    with np.errstate(all="ignore"):
        for j in range(N):
            kj, vj = np.repeat(k[j], g, axis=0), np.repeat(v[j], g, axis=0)  # (H, d)
            s = np.einsum("hqd,hd->hq", q, kj) * scale
            m_new = np.maximum(m, s)
            m_ref = np.where(np.isneginf(m_new), 0, m_new)
            a = np.exp(m - m_ref) if rescale else 1.0
            p = np.exp(s - m_ref)
            l = a * l + p
            o = (a[..., None] if rescale else 1.0) * o + p[..., None] * vj[:, None]
            m = m_new
        m0 = np.where(np.isneginf(m), 0, m)
        lse = {"m + log l": m0 + np.log(l), "log l": np.log(l)}[lse_mode]
        return o / np.where(l > 0, l, 1)[..., None], np.where(l > 0, lse, -np.inf)


def _page_loop(q, k, v, ps, *, rescale, lse_m):
    """(o, lse) of q (H, N_q, d) against contiguous k (n, H_kv, d), v, one page of ps keys at a
    time (the tiles a paged loop sees), with the rescale or the max in lse switchable."""
    H, N_q, d = q.shape
    g = H // k.shape[1]
    m, l = np.full((H, N_q), -np.inf), np.zeros((H, N_q))
    o = np.zeros((H, N_q, v.shape[2]))
    with np.errstate(all="ignore"):
        for c0 in range(0, k.shape[0], ps):
            kj = np.repeat(k[c0 : c0 + ps].transpose(1, 0, 2), g, axis=0)  # (H, n, d)
            vj = np.repeat(v[c0 : c0 + ps].transpose(1, 0, 2), g, axis=0)
            s = q @ kj.transpose(0, 2, 1) / np.sqrt(d)
            m_new = np.maximum(m, s.max(-1))
            a = np.exp(m - m_new) if rescale else 1.0
            p = np.exp(s - m_new[..., None])
            l = a * l + p.sum(-1)
            o = (a[..., None] if rescale else 1.0) * o + p @ vj
            m = m_new
        if not k.shape[0]:
            return o, np.full((H, N_q), -np.inf)
        return o / l[..., None], (m if lse_m else 0) + np.log(l)


_PAGED_BUGS = (
    "logical", "whole last page", "last page dropped", "n % page_size", "no rescale", "lse", "gqa",
)  # fmt: skip


def paged_twin(bug, q, k_pages, v_pages, table, lens):
    """(o, lse) of paged attention with one planted mistake (one of _PAGED_BUGS)."""
    if bug not in _PAGED_BUGS:
        raise ValueError(f"paged_twin: unknown mistake {bug!r}")
    B, H, N_q, _ = q.shape
    ps, H_kv = k_pages.shape[1], k_pages.shape[2]
    o, lse = np.zeros((B, H, N_q, v_pages.shape[3])), np.full((B, H, N_q), -np.inf)
    for b, n in enumerate(lens):
        pages = list(range(-(-n // ps))) if bug == "logical" else list(table[b, : -(-n // ps)])
        keep = n
        if bug == "whole last page":
            keep = len(pages) * ps
        elif bug == "last page dropped":
            keep = n // ps * ps
        elif bug == "n % page_size":  # the last page's keys as n % page_size: 0 when it is full
            keep = (len(pages) - 1) * ps + n % ps if pages else 0
        tiles = [(k_pages[p], v_pages[p]) for p in pages]  # (ps, H_kv, d) each, in table order
        k = np.concatenate([t[0] for t in tiles] or [k_pages[:0, 0]])[:keep]
        v = np.concatenate([t[1] for t in tiles] or [v_pages[:0, 0]])[:keep]
        if bug == "gqa":  # query head h reads K/V head h % H_kv instead of h // (H / H_kv)
            k, v = k[:, np.arange(H) % H_kv], v[:, np.arange(H) % H_kv]
        o[b], lse[b] = _page_loop(q[b], k, v, ps, rescale=bug != "no rescale", lse_m=bug != "lse")
    return o, lse


_SINK_BUGS = ("after normalisation", "unshifted", "every tile", "lse without sink")


def sink_twin(bug, q, k, v, sink, block_n):
    """(o, lse) of one head's attention with a sink, q (N_q, d), k (N_k, d), v (N_k, d_v), with one
    planted mistake (one of _SINK_BUGS)."""
    if bug not in _SINK_BUGS:
        raise ValueError(f"sink_twin: unknown mistake {bug!r}")
    s = q @ k.T / np.sqrt(q.shape[1])  # (N_q, N_k)
    with np.errstate(all="ignore"):
        m = s.max(axis=1)
        e = np.exp(s - m[:, None])
        l_keys, o_keys = e.sum(1), e @ v
        lse_keys = m + np.log(l_keys)
        lse_all = np.logaddexp(lse_keys, sink)
        if bug == "after normalisation":  # softmax over the keys, then lse with the sink; o kept
            return o_keys / l_keys[:, None], lse_all
        if bug == "unshifted":  # exp(sink) added to l as it is, without subtracting the max
            l = l_keys + np.exp(np.float32(sink)).astype(np.float64)
            return o_keys / l[:, None], m + np.log(l)
        if bug == "every tile":  # the sink joined every tile's sum
            tiles = -(-k.shape[0] // block_n)
            lse = np.logaddexp(lse_keys, sink + np.log(tiles))
            return o_keys * np.exp(m - lse)[:, None], lse
        return o_keys * np.exp(m - lse_all)[:, None], lse_keys  # "lse without sink"
