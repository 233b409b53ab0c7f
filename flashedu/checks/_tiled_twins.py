"""Float64 twins of the tiled NumPy loops of chapters 03 and 04, with switches that plant the
classic mistakes: the alpha rescale missing, the short last block skipped, the causal offset
top-left, NaN on rows that see no key, a wrong lse, P renormalised per tile, D left out, ...

The graders of ch03.py (the forward), ch04.py (the backward) and ch05.py (both, inside an autograd
Function) name a wrong answer by the twin it equals (the sentence they add to an "N_q x N_k array"
shortcut, `with_rule`, is grading machinery and lives in _shared.py). Tested through the graders'
planted bugs (tests/checks/test_ch03.py, ch04, ch05).
"""

from __future__ import annotations

import numpy as np

from ..testing import random_qkv

__all__ = ["one_head", "twin_forward", "twin_backward"]


def one_head(rng, N_q, N_k, d, scale=1.0):
    """q (N_q, d) and k, v (N_k, d) float64 arrays for one head, drawn from `rng`."""
    q, k, v = random_qkv(1, 1, N_q, N_k, d, "float64", seed=rng, scale=scale)
    return q[0, 0], k[0, 0], v[0, 0]


def twin_forward(q, k, v, *, causal, block_m, block_n, rescale="both", ceil=True, offset=True,
                 guard=True, lse="m + log l"):  # fmt: skip
    """(o, lse) of one head from an FA2-order loop (query blocks outside, key blocks inside);
    each switch away from its default plants one classic mistake."""
    N_q, N_k, d = q.shape[0], k.shape[0], q.shape[1]
    o, out_lse = np.zeros((N_q, d)), np.full(N_q, -np.inf)
    shift = N_k - N_q if offset else 0
    rows_end, cols_end = (N_q, N_k) if ceil else (N_q, N_k - N_k % block_n)
    with np.errstate(all="ignore"):
        for r0 in range(0, rows_end, block_m):
            rows = np.arange(r0, min(r0 + block_m, N_q))
            m, l, acc = np.full(rows.size, -np.inf), np.zeros(rows.size), np.zeros((rows.size, d))
            for c0 in range(0, cols_end, block_n):
                cols = np.arange(c0, min(c0 + block_n, N_k))
                s = q[rows] @ k[cols].T / np.sqrt(d)
                if causal:
                    s = np.where(cols[None, :] <= rows[:, None] + shift, s, -np.inf)
                m_new = np.maximum(m, s.max(axis=1))
                m_ref = np.where(np.isneginf(m_new), 0.0, m_new) if guard else m_new
                p = np.exp(s - m_ref[:, None])
                alpha = np.exp(m - m_ref)
                l = (alpha if rescale in ("both", "l") else 1.0) * l + p.sum(axis=1)
                acc = (alpha[:, None] if rescale in ("both", "o") else 1.0) * acc + p @ v[cols]
                m = m_new
            o[rows] = acc / (np.where(l > 0, l, 1.0)[:, None] if guard else l[:, None])
            m0 = np.where(np.isneginf(m), 0.0, m)
            log_l = {"m + log l": m0 + np.log(l), "log l": np.log(l), "m + l": m0 + l}[lse]
            out_lse[rows] = np.where(l > 0, log_l, -np.inf) if guard else log_l
    return o, out_lse


def twin_backward(do, q, k, v, o, lse, *, causal, block_m, block_n, by_lse=True, scale=True,
                  offset=True, guard=True, delta="rowsum(dO*O)", swap=False):  # fmt: skip
    """(dq, dk, dv) of one head from an FA2 backward (key blocks outside, query blocks inside);
    each switch away from its default plants one classic mistake."""
    N_q, N_k, d = q.shape[0], k.shape[0], q.shape[1]
    tau = 1 / np.sqrt(d)
    D = (do * o).sum(axis=1) if delta == "rowsum(dO*O)" else np.zeros(N_q)
    lse = np.where(np.isneginf(lse), np.inf, lse) if guard else lse
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    shift = N_k - N_q if offset else 0
    with np.errstate(all="ignore"):
        for c0 in range(0, N_k, block_n):
            cols = np.arange(c0, min(c0 + block_n, N_k))
            for r0 in range(0, N_q, block_m):
                rows = np.arange(r0, min(r0 + block_m, N_q))
                s = tau * q[rows] @ k[cols].T
                if causal:
                    s = np.where(cols[None, :] <= rows[:, None] + shift, s, -np.inf)
                if by_lse:
                    p = np.exp(s - lse[rows, None])
                else:
                    p = np.exp(s - s.max(axis=1, keepdims=True))
                    p = p / p.sum(axis=1, keepdims=True)
                dp = do[rows] @ v[cols].T
                D_t = (p * dp).sum(axis=1) if delta == "per tile" else D[rows]
                ds = p * (dp - D_t[:, None])
                dv[cols] += p.T @ do[rows]
                dq[rows] += (tau if scale else 1.0) * ds @ k[cols]
                dk[cols] += (tau if scale else 1.0) * ds.T @ q[rows]
    return (dq, dv, dk) if swap else (dq, dk, dv)
