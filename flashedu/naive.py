"""Standard attention in NumPy, step by step as a GPU runs it: S, then P, then O, each through HBM.

Every intermediate is materialised at full size: S and P are (B, H, N_q, N_k). The comments give the
HBM traffic of each step; pass a `traffic.Ledger` to have it counted, and
`traffic.naive_forward` / `traffic.naive_backward` give the same totals in closed form.

Storage follows a GPU kernel: S and P are stored in the input dtype, products accumulate in float32
(float64 for float64 inputs). Limits: the N_q x N_k arrays are the point, so memory grows as N^2.

float16 is where storing S hurts. Its spacing grows with the magnitude (0.5 between 512 and 1024),
and exp turns an error e in a score into a relative error e in its probability, so large scores
lose the digits the softmax needs. Measured on random 64 x 64 inputs, d = 16, 3 seeds: with the
largest score near 1e2 the output errs by up to 1.6e-2, near 1e3 by 9.7e-2, while `tiled` (S in a
float32 tile) stays under 1e-3. Above 65504, float16's largest value, a stored score would be inf
and the row NaN; `forward` raises `Float16OverflowError` instead (and `backward` for dP and dS),
naming the largest value. FlashAttention never stores S: its tiles stay in fp32 registers.

Introduced in notebooks/01_naive_attention.ipynb.
"""

from __future__ import annotations

import numpy as np

from . import masks
from .dtypes import acc_dtype
from .traffic.ledger import NULL_LEDGER
from .validation import check_backward, check_causal, check_qkv, check_window, resolve_scale


def _expand(x: np.ndarray, H: int) -> np.ndarray:
    return np.repeat(x, H // x.shape[1], axis=1)  # GQA: each K/V head serves H // H_kv query heads


class Float16OverflowError(FloatingPointError):
    """An N_q x N_k intermediate (S, dP or dS) does not fit float16, where naive attention stores
    it."""


FLOAT16_MAX = float(np.finfo(np.float16).max)  # 65504


def _store(x: np.ndarray, dtype, what: str, name: str) -> np.ndarray:
    """x cast to the storage dtype, as a kernel writing it to HBM would; an overflow in float16
    raises a named error instead of leaving inf (and then NaN) in the result."""
    if np.dtype(dtype) == np.float16:
        finite = np.where(np.isfinite(x), np.abs(x), 0.0)
        largest = float(finite.max(initial=0.0))
        if largest > FLOAT16_MAX:
            raise Float16OverflowError(
                f"{name}: {what} reaches {largest:.4g}, beyond float16's largest value "
                f"{FLOAT16_MAX:.0f}; naive attention stores {what} in the input dtype, so it "
                "would hold inf and the output NaN. Use float32 inputs or a smaller "
                "softmax_scale, or an implementation that keeps S in a float32 tile on chip "
                "(tiled, kernels)"
            )
    return x.astype(dtype)


def _scores(q, k, scale, causal, window_size, acc):
    s = np.matmul(q.astype(acc), np.swapaxes(k, -1, -2).astype(acc)) * acc.type(
        scale
    )  # (B, H, N_q, N_k)
    keep = masks.visible(q.shape[2], k.shape[2], causal=causal, window_size=window_size)
    return np.where(keep, s, -np.inf)


def _softmax(s, acc):
    m = s.max(axis=-1, keepdims=True)  # (B, H, N_q, 1), -inf on fully masked rows
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s.astype(acc) - m)  # masked entries: exp(-inf) = 0
    l = p.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = np.where(l > 0, m + np.log(np.where(l > 0, l, 1)), -np.inf)[..., 0]
    return p / np.where(l > 0, l, 1), lse.astype(acc)


def forward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size=None,
    ledger=NULL_LEDGER,
    return_p: bool = False,
):
    """Standard attention, materialising S and P.

    Args:
        q: (B, H, N_q, d); k: (B, H_kv, N_k, d); v: (B, H_kv, N_k, d_v), H % H_kv == 0.
            float16, float32 or float64.
        causal: query i sees key j iff j <= i + N_k - N_q (bottom-right aligned).
        softmax_scale: default 1 / sqrt(d).
        window_size: optional (left, right), see `masks.visible`.
        ledger: a `traffic.Ledger` to count HBM traffic.
        return_p: also return P (B, H, N_q, N_k), which the standard backward reads.
    Returns:
        o (B, H, N_q, d_v) in q's dtype (0 on fully masked rows), lse (B, H, N_q) float32
        (float64 for float64).
    Raises:
        Float16OverflowError: float16 inputs whose scores exceed 65504 (S is stored in float16).
    """
    B, H, H_kv, N_q, N_k, d = check_qkv(q, k, v, name="naive.forward", kind="numpy", value_dim=True)
    scale = resolve_scale(softmax_scale, d, name="naive.forward")
    window_size = check_window(window_size, name="naive.forward")
    causal = check_causal(causal, name="naive.forward")
    acc = acc_dtype(q.dtype)
    k, v = _expand(k, H), _expand(v, H)

    s = _store(_scores(q, k, scale, causal, window_size, acc), q.dtype, "S", "naive.forward")
    ledger.read("Q", q)  # HBM: read B H N_q d
    ledger.read("K", k)  # HBM: read B H N_k d
    ledger.write("S", s)  # HBM: write B H N_q N_k  <- the N^2 term

    ledger.read("S", s)  # HBM: read B H N_q N_k
    p, lse = _softmax(s, acc)
    p = p.astype(q.dtype)
    ledger.write("P", p)  # HBM: write B H N_q N_k
    ledger.write("lse", lse)  # HBM: write B H N_q (kept for the chapters that compare lse)

    ledger.read("P", p)  # HBM: read B H N_q N_k
    ledger.read("V", v)  # HBM: read B H N_k d
    o = np.matmul(p.astype(acc), v.astype(acc)).astype(q.dtype)  # (B, H, N_q, d_v)
    ledger.write("O", o)  # HBM: write B H N_q d
    return (o, lse, p) if return_p else (o, lse)


def backward(
    do: np.ndarray,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    o: np.ndarray,
    lse: np.ndarray,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size=None,
    p: np.ndarray | None = None,
    ledger=NULL_LEDGER,
):
    """Standard backward (Dao et al. 2022, Algorithm 3): reads the stored P and writes dP and dS to
    HBM.

    p: P from `forward(..., return_p=True)`. If omitted it is rebuilt as exp(S - lse), standing in
    for the copy a GPU implementation would have kept in HBM; the ledger counts it as read either
    way.
    Returns dq (B, H, N_q, d), dk (B, H_kv, N_k, d), dv (B, H_kv, N_k, d_v) in q's dtype; do and
    o are (B, H, N_q, d_v). Float16OverflowError if dP or dS exceeds float16's range.
    """
    B, H, H_kv, N_q, N_k, d = check_qkv(
        q, k, v, name="naive.backward", kind="numpy", value_dim=True
    )
    check_backward(do, o, lse, q, name="naive.backward", kind="numpy", v=v)
    scale = resolve_scale(softmax_scale, d, name="naive.backward")
    window_size = check_window(window_size, name="naive.backward")
    causal = check_causal(causal, name="naive.backward")
    acc = acc_dtype(q.dtype)
    ke, ve = _expand(k, H), _expand(v, H)
    if p is None:
        s = _scores(q, ke, scale, causal, window_size, acc)
        lse_safe = np.where(np.isfinite(lse), lse, np.inf)[..., None]  # fully masked rows -> P = 0
        p = np.exp(s - lse_safe.astype(acc)).astype(q.dtype)
    do_a, p_a = do.astype(acc), p.astype(acc)

    ledger.read("P", p)
    ledger.read("dO", do)  # dV = P^T dO                  (B, H, N_k, d_v)
    dv = np.matmul(np.swapaxes(p_a, -1, -2), do_a)
    ledger.write("dV", dv.astype(q.dtype))

    ledger.read("dO", do)
    ledger.read("V", ve)  # dP = dO V^T                  (B, H, N_q, N_k)
    dp = _store(
        np.matmul(do_a, np.swapaxes(ve, -1, -2).astype(acc)), q.dtype, "dP", "naive.backward"
    )
    ledger.write("dP", dp)

    ledger.read("P", p)
    ledger.read("dP", dp)  # dS = P * (dP - rowsum(P * dP))
    dp_a = dp.astype(acc)
    ds = _store(
        p_a * (dp_a - (p_a * dp_a).sum(axis=-1, keepdims=True)), q.dtype, "dS", "naive.backward"
    )
    ledger.write("dS", ds)

    ledger.read("dS", ds)
    ledger.read("K", ke)  # dQ = scale dS K              (B, H, N_q, d)
    dq = np.matmul(ds.astype(acc), ke.astype(acc)) * scale
    ledger.write("dQ", dq.astype(q.dtype))

    ledger.read("dS", ds)
    ledger.read("Q", q)  # dK = scale dS^T Q            (B, H, N_k, d)
    dk = np.matmul(np.swapaxes(ds, -1, -2).astype(acc), q.astype(acc)) * scale
    ledger.write("dK", dk.astype(q.dtype))

    def heads(g):  # sum the query heads that share each K/V head
        return g.reshape(B, H_kv, H // H_kv, N_k, g.shape[-1]).sum(axis=2).astype(q.dtype)

    return dq.astype(q.dtype), heads(dk), heads(dv)
