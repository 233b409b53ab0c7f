"""Float64 twins of the usual mistakes in the small Triton exercises: a tile of scores (6.1),
D = rowsum(dO * O) (7.1) and a tile of P rebuilt from lse (7.2).

Each function returns {what is wrong: the buggy output}, a value being one array or a list of
candidates (a grid rounded down leaves the last rows unwritten, and where depends on the learner's
block size). `_triton_judge.check_against` names the mistake whose twin the learner's answer
equals. Used by the graders in ch06.py and ch07.py; tested through their planted bugs.
"""

from __future__ import annotations

import numpy as np

from ._attn_variants import TOP_LEFT, visible

NO_SCALE = "the scores were not multiplied by the scale 1/sqrt(d)"
MASKED_TO_ZERO = (
    "masked scores must be -inf, not 0: a hidden key would then count with weight exp(0) = 1"
)
NO_MASK = "the causal mask is missing: query i may not see keys j > i + N_k - N_q"
GRID_FLOOR = (
    "the last rows (or columns) were never computed: the grid must round up, "
    "cdiv(N, BLOCK) programs along each axis"
)
EXP2_NO_LOG2E = "tl.exp2 on natural-log values: fold log2(e) into both s and lse (or use tl.exp)"
EMPTY_P = (
    "rows with lse = -inf see no key: their p is 0, set with tl.where after the exponential "
    "(exp(-inf + inf) is NaN)"
)
OVERFLOW = "exp(s) overflowed: subtract lse inside the exponent, exp(s - lse), never exp(s) / e^lse"
NO_HEAD_OFFSET = (
    "only the first (batch, head) was written: offset each program by its (batch, head), "
    "program_id(1), with the strides"
)
FP16_SUM = (
    "an fp16-sized error: convert o and do to float32 before multiplying and summing (fp16 "
    "products and sums keep 11 bits)"
)
BLOCKS = (16, 32, 64, 128)


def unwritten(x: np.ndarray, axes=(-1,)) -> list[np.ndarray]:
    """Candidates of x with everything past a multiple of a block left 0 along one axis (what a
    grid rounded down leaves in a zero-filled output), for the usual block sizes."""
    out = []
    for axis in axes:
        n = x.shape[axis]
        for b in BLOCKS:
            if n % b:
                y = x.copy()
                idx = [slice(None)] * x.ndim
                idx[axis] = slice(n // b * b, None)
                y[tuple(idx)] = 0.0
                out.append(y)
    return out


def scores(q: np.ndarray, k: np.ndarray, causal: bool) -> dict:
    """Twins of a tile-of-scores kernel: q (N_q, d), k (N_k, d) float64."""
    N_q, N_k, d = q.shape[0], k.shape[0], q.shape[1]
    raw = q @ k.T
    s = raw / np.sqrt(d)
    keep = visible(N_q, N_k, causal)
    right = np.where(keep, s, -np.inf)
    found = {
        NO_SCALE: np.where(keep, raw, -np.inf),
        MASKED_TO_ZERO: np.where(keep, s, 0.0),
        TOP_LEFT: np.where(visible(N_q, N_k, causal, top_left=True), s, -np.inf),
        GRID_FLOOR: unwritten(right, axes=(0, 1)),
    }
    if causal:
        found[NO_MASK] = s
    return found


def probabilities(q: np.ndarray, k: np.ndarray, lse: np.ndarray, causal: bool) -> dict:
    """Twins of a P-from-lse kernel: q (N_q, d), k (N_k, d), lse (N_q,) float64."""
    N_q, N_k, d = q.shape[0], k.shape[0], q.shape[1]
    raw = q @ k.T
    lse_use = np.where(np.isfinite(lse), lse, np.inf)[:, None]  # exp(s - inf) = 0
    keep = visible(N_q, N_k, causal)
    with np.errstate(over="ignore"):
        found = {
            NO_SCALE: np.where(keep, np.exp(raw - lse_use), 0.0),
            EXP2_NO_LOG2E: np.where(keep, np.exp2(raw / np.sqrt(d) - lse_use), 0.0),
            TOP_LEFT: np.where(visible(N_q, N_k, causal, top_left=True),
                               np.exp(raw / np.sqrt(d) - lse_use), 0.0),
        }  # fmt: skip
        if causal:
            found[NO_MASK] = np.exp(raw / np.sqrt(d) - lse_use)
    return found


def probabilities_extra(lse: np.ndarray):
    """The diagnosis of an answer by its kind of error: NaN where lse = -inf, or overflow."""

    def extra(got) -> str:
        g = np.asarray(got, dtype=np.float64)
        if g.shape[:1] != lse.shape:
            return ""
        empty = ~np.isfinite(lse)
        if np.isnan(g[empty]).any():
            return EMPTY_P
        return OVERFLOW if np.isinf(g).any() else ""

    return extra


def rowdot(o16: np.ndarray, do16: np.ndarray) -> tuple[dict, np.ndarray]:
    """Twins of a D = rowsum(dO * O) kernel, o16 and do16 (B, H, N, d) float16 arrays; and the
    fp16-arithmetic twin (products and sum in fp16) for the size of an fp16 error."""
    right = (o16.astype(np.float64) * do16.astype(np.float64)).sum(-1)
    first = np.zeros_like(right)
    first[0, 0] = right[0, 0]
    found = {GRID_FLOOR: unwritten(right), NO_HEAD_OFFSET: first}
    fp16 = (o16 * do16).sum(-1, dtype=np.float16).astype(np.float64)
    return found, fp16
