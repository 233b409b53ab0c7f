"""Softmax three ways: safe (subtract the max), online (one pass with a running max and sum), and
merged.

The online softmax (Milakov & Gimelshein 2018, arXiv:1805.02867) keeps, per row, a running max `m`
and a running sum `l = sum_j exp(x_j - m)`. When a new block of scores raises the max from m to m',
everything accumulated so far is rescaled by exp(m - m'). FlashAttention (Dao et al. 2022,
arXiv:2205.14135) applies the same rescaling to the output accumulator `o`, which is what lets
attention run over K/V in tiles.

A *partial state* is a triple (m, l, o) describing attention (or softmax) over a subset of the keys:

    m = max_j s_j                      shape (...)
    l = sum_j exp(s_j - m)             shape (...)
    o = sum_j exp(s_j - m) v_j         shape (..., d)   -- UNnormalised

`merge` combines the states of two disjoint key sets exactly, in any order and grouping; `finalize`
turns a state into the attention output o / l and its log-sum-exp m + log l. Split-KV decoding and
ring attention (notebooks/09_beyond.ipynb) are nothing more than this merge. `from_output` converts
an (o, lse) pair returned by any `forward` back into a state, so the outputs over key shards can be
merged too.

Conventions: an empty or fully masked state has m = -inf, l = 0, o = 0, and every function here
returns 0 (and lse = -inf) for it, never NaN. Arithmetic happens in the dtype of the inputs; pass
float32 or float64.

Introduced in notebooks/02_online_softmax.ipynb; the tiled loop that uses it in
notebooks/03_tiled_forward.ipynb.
"""

from __future__ import annotations

import numpy as np


def _finite_or_zero(m: np.ndarray) -> np.ndarray:
    """Replace -inf maxima (nothing seen yet, or everything masked) by 0 so that x - m never hits
    -inf - -inf."""
    return np.where(np.isneginf(m), 0.0, m).astype(m.dtype, copy=False)


def safe_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """softmax(x) = exp(x - max x) / sum exp(x - max x) along `axis`.

    Subtracting the max changes nothing mathematically (it cancels between numerator and
    denominator) but keeps every exponent <= 0, so exp never overflows. A slice that is entirely
    -inf gives zeros, not NaN.
    """
    x = np.asarray(x)
    m = _finite_or_zero(np.max(x, axis=axis, keepdims=True))
    e = np.exp(x - m)  # every exponent <= 0; masked (-inf) entries -> 0
    l = e.sum(axis=axis, keepdims=True)
    return e / np.where(l > 0, l, 1)


def online_step(m: np.ndarray, l: np.ndarray, s: np.ndarray):
    """Fold a block of scores s (..., n) into the running max m (...) and running sum l (...).

    Returns (m_new, l_new, p, alpha):
        m_new = max(m, rowmax(s))
        p     = exp(s - m_new)    (..., n), the block's unnormalised probabilities
        alpha = exp(m - m_new)    (...), the factor that rescales everything summed so far
        l_new = alpha * l + rowsum(p)
    A caller that also accumulates an output does o_new = alpha[..., None] * o + p @ v_block.
    """
    m_new = np.maximum(
        m, s.max(axis=-1, initial=-np.inf)
    )  # initial: an empty block changes nothing
    m_safe = _finite_or_zero(m_new)
    p = np.exp(s - m_safe[..., None])  # masked scores (-inf) -> 0
    alpha = np.exp(m - m_safe)  # 0 when m = -inf: nothing had been summed
    return m_new, alpha * l + p.sum(axis=-1), p, alpha


def online_stats(x: np.ndarray, block: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Running (m, l) of each row of a 2-D x (M, N) after ONE pass over its columns, `block` at a
    time."""
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"online_stats: x must be 2-D (rows, columns), got shape {x.shape}")
    if not isinstance(block, (int, np.integer)) or block < 1:
        raise ValueError(f"online_stats: block must be a positive int, got {block!r}")
    m = np.full(x.shape[0], -np.inf, dtype=x.dtype)  # -inf, not 0: a row may be all very negative
    l = np.zeros(x.shape[0], dtype=x.dtype)
    for c0 in range(0, x.shape[1], block):
        m, l, _, _ = online_step(m, l, x[:, c0 : c0 + block])
    return m, l


def online_softmax(x: np.ndarray, block: int = 1) -> np.ndarray:
    """Softmax of each row of a 2-D x (M, N): one pass over the columns for (m, l), then
    exp(x - m) / l.

    Reads x twice in all (the pass for the statistics and the pass that writes the result), against
    three times for the safe softmax (max, sum, write). Fully -inf rows give zeros.
    """
    m, l = online_stats(x, block)
    p = np.exp(np.asarray(x) - _finite_or_zero(m)[:, None])
    return p / np.where(l > 0, l, 1)[:, None]


def state(s: np.ndarray, v: np.ndarray):
    """The partial state (m, l, o) of scores s (..., n) against values v (..., n, d)."""
    m, l, p, _ = online_step(
        np.full(s.shape[:-1], -np.inf, dtype=s.dtype), np.zeros(s.shape[:-1], s.dtype), s
    )
    return m, l, p @ v  # (..., n) @ (..., n, d) -> (..., d)


def merge(a, b):
    """Combine two partial states (m, l, o) over disjoint key sets into the state over their union.

        m = max(m_a, m_b)
        l = exp(m_a - m) l_a + exp(m_b - m) l_b
        o = exp(m_a - m) o_a + exp(m_b - m) o_b        (o unnormalised, see the module docstring)

    Exact: associative and commutative up to rounding. A fully masked side (m = -inf, l = 0)
    contributes nothing, and two fully masked sides give a fully masked state, without NaN.
    """
    m_a, l_a, o_a = a
    m_b, l_b, o_b = b
    m = np.maximum(m_a, m_b)
    m_safe = _finite_or_zero(m)
    alpha, beta = np.exp(m_a - m_safe), np.exp(m_b - m_safe)  # each <= 1; 0 for a fully masked side
    return m, alpha * l_a + beta * l_b, alpha[..., None] * o_a + beta[..., None] * o_b


def lse_of(m: np.ndarray, l: np.ndarray) -> np.ndarray:
    """log sum_j exp(s_j) = m + log l; -inf where l = 0 (nothing visible)."""
    with np.errstate(divide="ignore"):
        return np.where(l > 0, _finite_or_zero(m) + np.log(np.where(l > 0, l, 1)), -np.inf).astype(
            l.dtype, copy=False
        )


def finalize(m: np.ndarray, l: np.ndarray, o: np.ndarray):
    """(o / l, lse): the attention output and its log-sum-exp; o = 0 and lse = -inf where l = 0."""
    return o / np.where(l > 0, l, 1)[..., None], lse_of(m, l)


def from_output(o: np.ndarray, lse: np.ndarray):
    """The state (m, l, o) of a normalised output o (..., d) with log-sum-exp lse (...), e.g. from
    `forward`.

    Uses m = lse and l = 1, so finalize(*from_output(o, lse)) == (o, lse); lse = -inf gives the
    empty state.
    """
    lse = np.asarray(lse)
    return lse, np.where(np.isneginf(lse), 0, 1).astype(lse.dtype), np.asarray(o, dtype=lse.dtype)
