"""Exact attention in float64: the oracle every other implementation is compared with.

Plain formulas, no tiling, no cleverness: S = scale * Q K^T (+ bias), masked entries -inf,
P = softmax(S) row by row, O = P V; the backward pass by the closed-form gradients. Everything is
computed in float64 and returned in float64, whatever the input dtype.

Introduced in notebooks/01_naive_attention.ipynb.
"""

from __future__ import annotations

import numpy as np

from . import masks
from .validation import (
    check_backward,
    check_causal,
    check_qkv,
    check_slopes,
    check_window,
    resolve_scale,
)


def _as_f64(x) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor
        x = x.detach().to("cpu").double().numpy()
    return np.asarray(x, dtype=np.float64)


def _expand_kv(x: np.ndarray, H: int) -> np.ndarray:
    """(B, H_kv, N, d) -> (B, H, N, d): each K/V head serves H // H_kv consecutive query heads
    (GQA)."""
    return np.repeat(x, H // x.shape[1], axis=1)


def positions(B: int, H: int, N_q: int, N_k: int) -> tuple[np.ndarray, ...]:
    """(b, h, q_idx, kv_idx) index arrays broadcasting to (B, H, N_q, N_k), the arguments of a
    score mod; q_idx is aligned with the keys, i + N_k - N_q (bottom-right, as `masks.visible`)."""
    return (
        np.arange(B)[:, None, None, None],
        np.arange(H)[None, :, None, None],
        np.arange(N_q)[:, None] + (N_k - N_q),
        np.arange(N_k)[None, :],
    )


def scores(q, k, *, softmax_scale=None, score_mod=None) -> np.ndarray:
    """S = softmax_scale * q k^T (B, H, N_q, N_k) in float64, then `score_mod` if given: a function
    score_mod(s, b, h, q_idx, kv_idx) -> s of float64 arrays broadcasting as `positions` gives them
    (the NumPy twin of a `flashedu.kernels.score_mods` mod)."""
    q, k = _as_f64(q), _as_f64(k)
    scale = resolve_scale(softmax_scale, q.shape[3], name="reference")
    s = np.einsum("bhid,bhjd->bhij", q, _expand_kv(k, q.shape[1])) * scale  # (B, H, N_q, N_k)
    if score_mod is not None:
        s = np.broadcast_to(score_mod(s, *positions(*s.shape)), s.shape).astype(np.float64)
    return s


def probabilities(
    q,
    k,
    *,
    causal=False,
    softmax_scale=None,
    window_size=None,
    alibi_slopes=None,
    attn_mask=None,
    score_mod=None,
):
    """P (B, H, N_q, N_k) float64 and lse (B, H, N_q): the softmax of the masked, scaled scores.

    attn_mask: optional bool array broadcastable to (B, H, N_q, N_k), True = may attend
    (SDPA's convention). score_mod: see `scores`. A row with nothing visible has P = 0 and
    lse = -inf.
    """
    H, N_q, N_k = q.shape[1], q.shape[2], k.shape[2]
    causal = check_causal(causal, name="reference")
    check_slopes(alibi_slopes, H, name="reference")
    s = scores(q, k, softmax_scale=softmax_scale, score_mod=score_mod)  # (B, H, N_q, N_k)
    if alibi_slopes is not None:
        s = s + masks.alibi_bias(alibi_slopes, N_q, N_k)[None]
    keep = masks.visible(
        N_q, N_k, causal=causal, window_size=check_window(window_size, name="reference")
    )
    keep = np.broadcast_to(keep, s.shape)
    if attn_mask is not None:
        keep = keep & np.broadcast_to(np.asarray(attn_mask, dtype=bool), s.shape)
    s = np.where(keep, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)  # (B, H, N_q, 1); -inf on fully masked rows
    m_safe = np.where(np.isfinite(m), m, 0.0)
    p = np.where(keep, np.exp(s - m_safe), 0.0)
    l = p.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = np.where(l > 0, m_safe + np.log(np.where(l > 0, l, 1.0)), -np.inf)[..., 0]
    p = p / np.where(l > 0, l, 1.0)
    return p, lse


def forward(
    q,
    k,
    v,
    *,
    causal=False,
    softmax_scale=None,
    window_size=None,
    alibi_slopes=None,
    attn_mask=None,
    score_mod=None,
):
    """Exact attention. q (B, H, N_q, d); k (B, H_kv, N_k, d); v (B, H_kv, N_k, d_v),
    H % H_kv == 0.

    Returns o (B, H, N_q, d_v) and lse (B, H, N_q), both float64. Fully masked rows give o = 0,
    lse = -inf. See `masks.visible` for causal and window alignment (bottom-right),
    `masks.alibi_bias` for ALiBi and `scores` for score_mod.
    """
    check_qkv(q, k, v, name="reference.forward", value_dim=True)
    p, lse = probabilities(
        q,
        k,
        causal=causal,
        softmax_scale=softmax_scale,
        window_size=window_size,
        alibi_slopes=alibi_slopes,
        attn_mask=attn_mask,
        score_mod=score_mod,
    )
    o = np.einsum("bhij,bhjd->bhid", p, _expand_kv(_as_f64(v), p.shape[1]))
    return o, lse


def _reduce_heads(g: np.ndarray, H_kv: int) -> np.ndarray:
    """Sum a (B, H, N, d) gradient over the query heads that share each K/V head -> (B, H_kv, N,
    d)."""
    B, H, N, d = g.shape
    return g.reshape(B, H_kv, H // H_kv, N, d).sum(axis=2)


def backward(
    do,
    q,
    k,
    v,
    o=None,
    lse=None,
    *,
    causal=False,
    softmax_scale=None,
    window_size=None,
    alibi_slopes=None,
    attn_mask=None,
    score_mod=None,
    score_mod_grad=None,
):
    """Gradients (dq, dk, dv) of sum(o * do) in float64, from the closed forms.

    o and lse are accepted for the common signature but not trusted: P is recomputed here in
    float64.
        dv = P^T dO     dP = dO V^T     dS = P * (dP - rowsum(P * dP))
        dq = scale dS K     dk = scale dS^T Q
    With a score mod, dS is multiplied by score_mod_grad(S, b, h, q_idx, kv_idx), the derivative
    of the mod at the unmodded scores S (None: 1, a bias that does not depend on the score).
    """
    check_qkv(q, k, v, name="reference.backward", value_dim=True)
    if o is not None and lse is not None:
        check_backward(do, o, lse, q, name="reference.backward", strict_lse_dtype=False, v=v)
    H, H_kv, d = q.shape[1], k.shape[1], q.shape[3]
    scale = resolve_scale(softmax_scale, d, name="reference")
    do, q64, k64, v64 = (
        _as_f64(do),
        _as_f64(q),
        _expand_kv(_as_f64(k), H),
        _expand_kv(_as_f64(v), H),
    )
    p, _ = probabilities(
        q,
        k,
        causal=causal,
        softmax_scale=softmax_scale,
        window_size=window_size,
        alibi_slopes=alibi_slopes,
        attn_mask=attn_mask,
        score_mod=score_mod,
    )
    dv = np.einsum("bhij,bhid->bhjd", p, do)  # (B, H, N_k, d_v)
    dp = np.einsum("bhid,bhjd->bhij", do, v64)  # (B, H, N_q, N_k)
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))  # softmax Jacobian; 0 where P = 0
    if score_mod is not None and score_mod_grad is not None:  # chain rule through the mod
        s = scores(q, k, softmax_scale=softmax_scale)
        ds = ds * np.where(p > 0, score_mod_grad(s, *positions(*s.shape)), 0.0)
    dq = np.einsum("bhij,bhjd->bhid", ds, k64) * scale
    dk = np.einsum("bhij,bhid->bhjd", ds, q64) * scale
    return dq, _reduce_heads(dk, H_kv), _reduce_heads(dv, H_kv)
