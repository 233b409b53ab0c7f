"""Graders for notebooks/01_naive_attention.ipynb: naive attention and its HBM byte count.

Both run with flashedu's own implementations off limits. A wrong answer is matched against planted
bugs: no 1/sqrt(d), a top-left causal mask, no max subtraction (overflow), the softmax over the
queries; for the byte count, S and P crossing HBM once, one (batch, head) pair only, elements
instead of bytes.
"""

from __future__ import annotations

import numpy as np

from .. import reference, traffic
from ..testing import Tolerance, random_qkv
from ._core import Case, exact_bytes, grade, grader, rng_for

__all__ = ["naive_attention", "naive_hbm_bytes"]

_F64 = Tolerance(1e-10, 1e-10)


def _attention(q, k, v, causal=False, *, scale=True, offset=True, safe=True, axis=-1):
    """Naive attention with switches that plant the classic mistakes."""
    d, N_q, N_k = q.shape[-1], q.shape[-2], k.shape[-2]
    s = q @ np.swapaxes(k, -1, -2) / (np.sqrt(d) if scale else 1.0)
    if causal:
        shift = N_k - N_q if offset else 0
        s = np.where(np.arange(N_k)[None, :] <= np.arange(N_q)[:, None] + shift, s, -np.inf)
    with np.errstate(all="ignore"):
        if safe:
            m = s.max(axis=axis, keepdims=True)
            s = s - np.where(np.isneginf(m), 0.0, m)
        p = np.exp(s)
        return (p / p.sum(axis=axis, keepdims=True)) @ v


_MISTAKES = {
    "the scores were not scaled by 1/sqrt(d)": {"scale": False},
    "the causal mask is top-left aligned; flashedu's is bottom-right": {"offset": False},
    "exp overflowed: the row max was not subtracted before exp": {"safe": False},
    "the softmax normalises over the queries (axis -2) instead of over the keys": {"axis": -2},
}

_NAIVE_FORMULA = """
S = q k^T / sqrt(d);  causal: S[i, j] = -inf where j > i + N_k - N_q
P = softmax(S) over the last axis (subtract each row's max before exp)
O = P v
"""


@grader("flashedu.naive.forward", formula=_NAIVE_FORMULA)
def naive_attention(fn, *, seed=None, out=print):
    """Grade `fn(q, k, v, causal=False) -> o`, float64 NumPy arrays of shape (B, H, N, d)."""
    rng = rng_for(seed)
    specs = [  # (label, (B, H, N_q, N_k, d), causal, input scale, hint)
        ("one query, one key", (1, 1, 1, 1, 4), False, 1.0, "with one key, o must equal v"),
        ("ragged N_q=5, N_k=7", (2, 3, 5, 7, 8), False, 1.0, ""),
        ("d=64: scores scaled by 1/sqrt(d)", (1, 2, 9, 9, 64), False, 1.0, ""),
        ("causal, N_q == N_k", (1, 2, 6, 6, 8), True, 1.0, "query i sees keys j <= i"),
        ("causal, N_q=3 < N_k=8", (1, 1, 3, 8, 8), True, 1.0, ""),
        ("logits near 1e4", (1, 1, 4, 6, 4), False, 100.0, ""),
    ]
    cases = []
    for label, shape, causal, scale, hint in specs:
        q, k, v = random_qkv(*shape, "float64", seed=rng, scale=scale)
        cases.append(
            Case(
                label,
                (q, k, v),
                reference.forward(q, k, v, causal=causal)[0],
                hint=hint or "o must be the softmax-weighted average of the visible values",
                kwargs={"causal": causal},
                tol=_F64,
                mistakes={why: _attention(q, k, v, causal, **kw) for why, kw in _MISTAKES.items()},
            )
        )
    return grade("naive_attention", fn, cases, out=out, forbid=True)


def _bytes(B, H, N, d, e, *, sp=4, per_head=True, itemsize=True, lse=False):
    bh = B * H if per_head else 1
    return bh * ((4 * N * d + sp * N * N) * (e if itemsize else 1) + (4 * N if lse else 0))


_BYTE_MISTAKES = {
    "S and P were counted once each; each is written to HBM and read back": {"sp": 2},
    "S and P were left out": {"sp": 0},
    "only one (batch, head) pair was counted; every pair moves its own S and P": {
        "per_head": False
    },
    "that is elements, not bytes: multiply by itemsize": {"itemsize": False},
    "the lse write was counted; this exercise leaves it out": {"lse": True},
}

_BYTES_FORMULA = """
bytes = B H (4 N d + 4 N^2) itemsize
        (Q, K, V read and O written: 4 N d; S and P each written and read back: 4 N^2)
"""


@grader("flashedu.traffic.naive_forward", formula=_BYTES_FORMULA)
def naive_hbm_bytes(fn, *, seed=None, out=print):
    """Grade `fn(B, H, N, d, itemsize) -> int`: HBM bytes read plus written by the naive forward
    pass (Q, K, V read; S and P written and read back; O written; lse not counted),
    N_q == N_k == N."""
    rng = rng_for(seed)

    def expected(B, H, N, d, e):
        t = traffic.naive_forward(B, H, N, N, d, itemsize=e)
        return t.total_bytes - t.writes["lse"]

    specs = [
        ("N=1, d=64, fp16", (1, 1, 1, 64, 2), "Q, K, V are read once and O written once"),
        ("N=1024, d=64, fp16", (1, 1, 1024, 64, 2), "S and P are N x N each"),
        ("B=2, H=3, fp32", (2, 3, int(rng.integers(100, 300)), 32, 4), ""),
    ]
    cases = [
        Case(
            label,
            args,
            expected(*args),
            hint=hint or "count every tensor that crosses HBM, as often as it crosses",
            check=exact_bytes,
            mistakes={why: _bytes(*args, **kw) for why, kw in _BYTE_MISTAKES.items()},
        )
        for label, args, hint in specs
    ]
    return grade("naive_hbm_bytes", fn, cases, out=out, forbid=True)
