"""Float64 twins of the usual mistakes in attention kernels, for the Triton graders' diagnoses.

A learner's forward or backward kernel that is wrong is most often wrong in one of a few known
ways; each function here computes, in float64 from the same inputs, what a kernel with that one
mistake returns. `flashedu.checks._triton` compares the learner's answer with each and names the
one it equals. The forward twins follow the kernel's own loop (blocks of keys, online softmax), so
a missing rescale gives exactly the numbers a kernel without it gives; the backward twins
recompute P from the true lse, as the kernels do, and drop or change one term.

The TF32 twins cut every matrix-product input to TF32 (10 bits of mantissa) as a GPU's `tl.dot`
does on float32 inputs by default: the size of their error against the exact
answer tells a TF32 dot from a real bug.

Used by the graders of notebooks/06_triton_forward.ipynb and notebooks/07_triton_backward.ipynb;
tested through tests/checks/test_ch06.py and tests/checks/test_ch07.py.
"""

from __future__ import annotations

import numpy as np

# The diagnoses, one sentence each: what is wrong, never the whole formula.
NO_RESCALE = (
    "l and acc were not rescaled when the row max grew: both hold sums taken against the old max "
    "(checks.hint gives the factor)"
)
ACC_NOT_RESCALED = (
    "acc was not rescaled when the row max grew (l was): acc needs the same factor as l"
)
L_NOT_RESCALED = (
    "l was not rescaled when the row max grew (acc was): l needs the same factor as acc"
)
TOP_LEFT = (
    "causal offset: query i sees keys j <= i + N_k - N_q (bottom-right aligned), not j <= i "
    "(top-left)"
)
FLOOR_KEYS = (
    "the ragged last key block was skipped: run the loop over cdiv(N_k, BLOCK_N) blocks "
    "(round the end up, not down)"
)
FLOOR_QUERIES = (
    "the ragged last query block was skipped: run the loop over cdiv(N_q, BLOCK_M) blocks "
    "(round the end up, not down)"
)
PAD_SCORED = (
    "keys past N_k were scored 0 instead of -inf: mask the scores of the ragged last block "
    "(cols < N_k) as well as its loads"
)
NOT_NORMALISED = "o was not divided by l at the end of the loop"
NO_SCALE = "the scores were not multiplied by sm_scale (1/sqrt(d))"
EXP2_NO_LOG2E = "tl.exp2 on natural-log scores: fold log2(e) into the scale, or use tl.exp"
EXP_WITH_LOG2E = "log2(e) was folded into the scale but tl.exp used: pair it with tl.exp2"
LSE_M_PLUS_L = "lse = m + log(l), not m + l"
LSE_BASE2 = "lse must be a natural log: a base-2 m + log2(l) needs a factor ln(2)"
LSE_NO_LOG = "lse = m + log(l): the log(l) term is missing"
EMPTY_ROWS = (
    "rows that see no key (causal, N_q > N_k) need o = 0 and lse = -inf: there l = 0 and the row "
    "max stays -inf, so guard both (use 0 for m in the exponent, 1 for l in the division)"
)
EMPTY_ROWS_BWD = (
    "rows that see no key have lse = -inf, so exp(s - lse) is inf there: set P to 0 with "
    "tl.where wherever the mask hides a key (their gradients are 0)"
)
TF32 = (
    "a TF32-sized error: on a GPU tl.dot cuts float32 inputs to TF32 (10-bit mantissa) unless "
    "told otherwise; pass input_precision=PRECISION (the launcher gives 'ieee' for float32) to "
    "every tl.dot"
)
GRAD_NO_SCALE = (
    "the final multiplication by sm_scale is missing: the scores were scaled, so their gradient "
    "is scaled too"
)
NO_DELTA = (
    "D was not subtracted from dP: the softmax's gradient needs the row term D = rowsum(dO * O) "
    "(checks.hint gives dS)"
)
BWD_EXP2 = (
    "P rebuilt with tl.exp2 from natural-log scores and lse: multiply both by log2(e) first, or "
    "use tl.exp"
)
BWD_NO_LSE = "P was rebuilt without subtracting lse: exp(s) alone is not normalised"
BWD_NO_SCORE_SCALE = (
    "the scores were not multiplied by sm_scale (1/sqrt(d)) before P was rebuilt from lse"
)
P_UNMASKED = (
    "P was not zeroed where the causal mask hides a key inside the blocks the loop visits: query i "
    "sees keys j <= i + N_k - N_q; set P to 0 elsewhere with tl.where"
)
DP_FROM_K = "dP came from dO and K: dP = dO V^T (the gradient of P V), with V's tile"
GROUP_SUM = (
    "with GQA, dk and dv sum over every query head of the group (the loop over g): only one head "
    "was added"
)
LATE_START = (
    "the loop over query blocks started too late: query i sees key j when i >= j - (N_k - N_q), "
    "so start at the block holding (first key - offset)"
)


def expand(x: np.ndarray, H: int) -> np.ndarray:
    """(B, H_kv, N, d) -> (B, H, N, d): K/V head h // (H // H_kv) serves query head h."""
    return np.repeat(x, H // x.shape[1], axis=1)


def visible(N_q: int, N_k: int, causal: bool, *, top_left: bool = False) -> np.ndarray:
    """(N_q, N_k) bool: key j exists for query i and the causal mask lets i see it."""
    keep = np.ones((N_q, N_k), bool)
    if causal:
        off = 0 if top_left else N_k - N_q
        keep = np.arange(N_k)[None, :] <= np.arange(N_q)[:, None] + off
    return keep


def key_end(N_q: int, N_k: int, causal: bool, block_m: int, block_n: int, floor: bool):
    """(N_q,) the end of the key loop of each row's query block; floor=True rounds it down to a
    block (the bug), else it is the true end (N_k, or the causal diagonal of the block's last
    row)."""
    rows = np.arange(N_q)
    last = np.minimum((rows // block_m + 1) * block_m, N_q) - 1
    end = np.minimum(np.maximum(last + N_k - N_q + 1, 0), N_k) if causal else np.full(N_q, N_k)
    return end // block_n * block_n if floor else end


def query_start(N_q: int, N_k: int, causal: bool, block_m: int, block_n: int, late: bool):
    """(N_k,) the first query row the dK/dV loop visits for each key's block: block-aligned start
    at (first key - offset), or at the first key itself with late=True (the bug)."""
    first = np.arange(N_k) // block_n * block_n
    if not causal:
        return np.zeros(N_k, int)
    start = first if late else np.maximum(first - (N_k - N_q), 0)
    return np.minimum(start // block_m * block_m, N_q)


def online_forward(q, k, v, scale, keep, block_n, *, rescale=(True, True), normalise=True,
                   pad_keys=False, exp_base=np.e):  # fmt: skip
    """(o, lse) of the block-by-block online softmax, float64, q (B, H, N_q, d), k and v already
    expanded to H heads, keep (N_q, N_k) or (B, H, N_q, N_k). rescale = (l, acc): which running
    sums are multiplied by alpha when the max moves. pad_keys: the ragged last block's missing keys
    take part with score 0 and value 0. exp_base: the base the exponentials are taken in."""
    B, H, N_q, d = q.shape
    N_k = k.shape[2]
    n_pad = -N_k % block_n if pad_keys else 0
    k = np.concatenate([k, np.zeros((B, H, n_pad, d))], axis=2)
    v = np.concatenate([v, np.zeros((B, H, n_pad, d))], axis=2)
    keep = np.broadcast_to(keep, (B, H, N_q, N_k))
    keep = np.concatenate([keep, np.ones((B, H, N_q, n_pad), bool)], axis=3)
    ln = np.log(exp_base)
    m = np.full((B, H, N_q), -np.inf)
    l_sum, acc = np.zeros((B, H, N_q)), np.zeros((B, H, N_q, d))
    for j in range(0, N_k + n_pad, block_n):
        s = np.einsum("bhid,bhjd->bhij", q, k[:, :, j : j + block_n]) * scale
        s = np.where(keep[..., j : j + block_n], s, -np.inf)
        m_new = np.maximum(m, s.max(-1))
        m_use = np.where(m_new == -np.inf, 0.0, m_new)
        p = np.exp((s - m_use[..., None]) * ln)
        alpha = np.exp((m - m_use) * ln)
        l_sum = l_sum * (alpha if rescale[0] else 1.0) + p.sum(-1)
        acc = acc * (alpha[..., None] if rescale[1] else 1.0)
        acc = acc + np.einsum("bhij,bhjd->bhid", p, v[:, :, j : j + block_n])
        m = m_new
    empty = l_sum == 0
    l_use = np.where(empty, 1.0, l_sum)
    o = acc / l_use[..., None] if normalise else acc
    lse = np.where(empty, -np.inf, np.where(empty, 0.0, m) + np.log(l_use))
    return o, lse


def forward_variants(q, k, v, scale, causal, block_m, block_n) -> dict:
    """{diagnosis: (o, lse)} for the forward's usual mistakes; an entry's None part is not
    compared. q (B, H, N_q, d), k, v expanded to H heads, all float64."""
    N_q, N_k = q.shape[2], k.shape[2]
    keep = visible(N_q, N_k, causal)

    def run(**kw):
        return online_forward(q, k, v, kw.pop("scale", scale), kw.pop("keep", keep), block_n, **kw)

    o, lse = run()
    m_plus = _lse_parts(q, k, scale, keep)
    end = key_end(N_q, N_k, causal, block_m, block_n, True)
    floor = keep & (np.arange(N_k)[None, :] < end[:, None])
    return {
        NO_RESCALE: (run(rescale=(False, False))[0], None),
        ACC_NOT_RESCALED: (run(rescale=(True, False))[0], None),
        L_NOT_RESCALED: (run(rescale=(False, True))[0], None),
        TOP_LEFT: run(keep=visible(N_q, N_k, causal, top_left=True)),
        FLOOR_KEYS: run(keep=floor),
        PAD_SCORED: (run(pad_keys=True)[0], None),
        NOT_NORMALISED: (run(normalise=False)[0], None),
        NO_SCALE: (run(scale=1.0)[0], None),
        EXP2_NO_LOG2E: (run(exp_base=2.0)[0], None),
        EXP_WITH_LOG2E: (run(scale=scale * np.log2(np.e))[0], None),
        LSE_M_PLUS_L: (o, m_plus["m + l"]),
        LSE_BASE2: (o, lse / np.log(2.0)),
        LSE_NO_LOG: (o, m_plus["m"]),
    }


def _lse_parts(q, k, scale, keep) -> dict:
    """The row max m and sum l of exp(s - m) of the scaled, masked scores: 'm + l' and 'm'."""
    s = np.where(keep, np.einsum("bhid,bhjd->bhij", q, k) * scale, -np.inf)
    m = s.max(-1)
    m_use = np.where(np.isfinite(m), m, 0.0)
    l_sum = np.exp(s - m_use[..., None]).sum(-1)
    return {"m + l": np.where(l_sum > 0, m_use + l_sum, -np.inf), "m": m}


# --------------------------------------------------------------------------------------- backward


def gradients(
    q, k, v, do, lse, delta, scale, keep, include=None, *, subtract_delta=True, base=np.e,
    score_scale=None,
):  # fmt: skip
    """(dq, dk, dv) per query head, float64, with P rebuilt from the given lse as the kernels do:
    P = exp(s - lse) where keep (0 elsewhere and on rows with lse = -inf), dS = P (dP - D).
    include (N_q, N_k) bool: the (query, key) pairs the kernel's loops reach (default all).
    base: of the exponential (2: tl.exp2 on natural-log values); score_scale: the scores' scale
    when it differs from the final one (default scale)."""
    s = np.einsum("bhid,bhjd->bhij", q, k) * (scale if score_scale is None else score_scale)
    lse_use = np.where(np.isfinite(lse), lse, np.inf)[..., None]  # exp(s - inf) = 0
    p = np.where(keep & (True if include is None else include), base ** (s - lse_use), 0.0)
    dp = np.einsum("bhid,bhjd->bhij", do, v)
    ds = p * (dp - (delta[..., None] if subtract_delta else 0.0))
    dq = np.einsum("bhij,bhjd->bhid", ds, k) * scale
    dk = np.einsum("bhij,bhid->bhjd", ds, q) * scale
    dv = np.einsum("bhij,bhid->bhjd", p, do)
    return dq, dk, dv


def reduce_heads(g: np.ndarray, H_kv: int) -> np.ndarray:
    """(B, H, N, d) -> (B, H_kv, N, d): the sum over the query heads of each group."""
    B, H, N, d = g.shape
    return g.reshape(B, H_kv, H // H_kv, N, d).sum(axis=2)


def backward_variants(q, k, v, do, lse, delta, scale, causal, block_m, block_n, H_kv) -> dict:
    """{diagnosis: (dq, dk, dv)} for the backward's usual mistakes, dk and dv reduced to H_kv
    heads. q, do (B, H, N_q, d); k, v expanded to H heads; lse, delta (B, H, N_q)."""
    N_q, N_k = q.shape[2], k.shape[2]
    keep = visible(N_q, N_k, causal)
    rows, cols = np.arange(N_q)[:, None], np.arange(N_k)[None, :]

    def run(**kw):
        dq, dk, dv = gradients(q, k, v, do, lse, delta, kw.pop("scale", scale),
                               kw.pop("keep", keep), **kw)  # fmt: skip
        return dq, reduce_heads(dk, H_kv), reduce_heads(dv, H_kv)

    end = key_end(N_q, N_k, causal, block_m, block_n, True)[:, None]
    start = query_start(N_q, N_k, causal, block_m, block_n, True)[None, :]
    dq, dk, dv = run()
    first = q.shape[1] // H_kv  # heads per group
    one_head = run(include=np.arange(q.shape[1])[:, None, None] % first == 0)
    args = (q, k, v, do, lse, delta, scale, keep)
    no_lse = gradients(q, k, v, do, np.where(np.isfinite(lse), 0.0, lse), delta, scale, keep)
    dp_k = gradients(q, k, k, do, lse, delta, scale, keep)
    if causal:  # every key of a visited block counted, the causal mask forgotten
        ends = -(-key_end(N_q, N_k, causal, block_m, block_n, False) // block_n) * block_n
        unmasked_q = run(keep=np.ones_like(keep), include=cols < ends[:, None])[0]
        first = query_start(N_q, N_k, causal, block_m, block_n, False)[None, :]
        unmasked_kv = run(keep=np.ones_like(keep), include=rows >= first)[1:]
    twins = {
        BWD_EXP2: gradients(*args, base=2.0),
        BWD_NO_LSE: no_lse,
        BWD_NO_SCORE_SCALE: gradients(*args, score_scale=1.0),
        DP_FROM_K: (dp_k[0], dp_k[1], None),
    }
    twins = {
        why: (g[0], None if g[1] is None else reduce_heads(g[1], H_kv),
              None if g[2] is None else reduce_heads(g[2], H_kv))
        for why, g in twins.items()
    }  # fmt: skip
    if causal:
        twins[P_UNMASKED] = (unmasked_q, *unmasked_kv)
    return {
        **twins,
        TOP_LEFT: run(keep=visible(N_q, N_k, causal, top_left=True)),
        FLOOR_KEYS: (run(include=cols < end)[0], None, None),
        FLOOR_QUERIES: (None, *run(include=rows < N_q // block_m * block_m)[1:]),
        LATE_START: (None, *run(include=rows >= start)[1:]),
        GRAD_NO_SCALE: (dq / scale, dk / scale, None),
        NO_DELTA: run(subtract_delta=False),
        GROUP_SUM: (None, one_head[1], one_head[2]),
    }


# ------------------------------------------------------------------------------------------- TF32


def tf32(x: np.ndarray) -> np.ndarray:
    """x rounded to float32, then to TF32 as the tensor cores read it: the top 19 bits (sign, 8
    exponent bits, 10 mantissa bits), the rest dropped (rounding toward zero). A correct fp32
    kernel without input_precision="ieee" erred on an H200 exactly as this twin does (1.5e-3 in o
    at d = 16), and three times as much as a round-to-nearest twin; returned as float64."""
    bits = np.asarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFFE000)
    return bits.view(np.float32).astype(np.float64)


def tf32_forward(q, k, v, scale, keep) -> tuple[np.ndarray, np.ndarray]:
    """(o, lse) of a forward whose two products take TF32 inputs (q, k; then p, v), float64."""
    s = np.where(keep, np.einsum("bhid,bhjd->bhij", tf32(q), tf32(k)) * scale, -np.inf)
    m = s.max(-1, keepdims=True)
    m_use = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m_use)
    l_sum = p.sum(-1, keepdims=True)
    o = np.einsum("bhij,bhjd->bhid", tf32(p), tf32(v)) / np.where(l_sum > 0, l_sum, 1.0)
    with np.errstate(divide="ignore"):
        lse = np.where(l_sum > 0, m_use + np.log(l_sum), -np.inf)[..., 0]
    return o, lse


def tf32_backward(q, k, v, do, lse, delta, scale, keep, H_kv):
    """(dq, dk, dv) of a backward whose five products take TF32 inputs, dk and dv reduced."""
    s = np.einsum("bhid,bhjd->bhij", tf32(q), tf32(k)) * scale
    lse_use = np.where(np.isfinite(lse), lse, np.inf)[..., None]
    p = np.where(keep, np.exp(s - lse_use), 0.0)
    dp = np.einsum("bhid,bhjd->bhij", tf32(do), tf32(v))
    ds = p * (dp - delta[..., None])
    dq = np.einsum("bhij,bhjd->bhid", tf32(ds), tf32(k)) * scale
    dk = np.einsum("bhij,bhid->bhjd", tf32(ds), tf32(q)) * scale
    dv = np.einsum("bhij,bhid->bhjd", tf32(p), tf32(do))
    return dq, reduce_heads(dk, H_kv), reduce_heads(dv, H_kv)
