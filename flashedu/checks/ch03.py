"""Graders for notebooks/03_tiled_forward.ipynb: the tiled forward loop and its HBM byte count.

Exercise 3.1 asks for the FA2-order tiled forward of one head (outer loop over query blocks, online
softmax over K/V blocks), returning o and lse; exercise 3.2 for the HBM bytes that loop moves. Each
case draws fresh sizes and targets one mistake: the accumulator not rescaled, the ragged last block
dropped, the causal offset top-left instead of bottom-right, NaN on fully masked rows, lse without
the max, K/V counted once.
"""

from __future__ import annotations

from .. import reference, traffic
from ..testing import Tolerance, random_qkv
from ._core import Case, grade, grader, rng_for
from .ch01 import _exact  # an exact integer answer, printed in bytes

__all__ = ["tiled_attention", "fa2_hbm_bytes"]

_F64 = Tolerance(1e-10, 1e-10)


def _one_head(rng, N_q, N_k, d, scale=1.0):
    q, k, v = random_qkv(1, 1, N_q, N_k, d, "float64", seed=rng, scale=scale)
    return q[0, 0], k[0, 0], v[0, 0]


@grader("flashedu.tiled.forward")
def tiled_attention(fn, *, seed=None, out=print):
    """Grade `fn(q, k, v, *, causal=False, block_m, block_n) -> (o, lse)` for one head: q (N_q, d),
    k and v (N_k, d) float64, scale 1/sqrt(d), o (N_q, d), lse (N_q,) natural-log, never an N_q x
    N_k array."""
    rng = rng_for(seed)
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))  # noqa: E731
    bm, bn = r(3, 5), r(4, 7)
    n_q, n_k = r(3, 6) * bm + r(1, bm - 1), r(3, 6) * bn + r(1, bn - 1)  # never block multiples
    e = r(3, 8)
    specs = [  # (label, (N_q, N_k, d, input scale), causal, (block_m, block_n), hint)
        (
            "one tile holds everything",
            (r(2, 6), r(2, 6), 8, 1.0),
            False,
            (16, 16),
            (
                "with one tile this is plain attention: scale q k^T by 1/sqrt(d), o = P V, "
                "lse = log sum_j exp(s_j)"
            ),
        ),
        (
            f"N_q={n_q}, N_k={n_k}, blocks {bm}x{bn}",
            (n_q, n_k, 8, 1.0),
            False,
            (bm, bn),
            (
                "when the row max moves from m to m', rescale the accumulator o_i (and l_i) by "
                "exp(m - m')"
            ),
        ),
        (
            f"N_k={n_k}: last K/V block short",
            (bm, n_k, 4, 1.0),
            False,
            (bm, bn),
            "the last block is shorter: loop to the end, slicing k[c0:min(c0 + block_n, N_k)]",
        ),
        (
            f"causal, N_q={n_q} < N_k={n_q + e}",
            (n_q, n_q + e, 8, 1.0),
            True,
            (bm, bn),
            "causal offset: query i sees keys j <= i + N_k - N_q (bottom-right aligned)",
        ),
        (
            f"causal, N_q={n_k + e} > N_k={n_k}",
            (n_k + e, n_k, 8, 1.0),
            True,
            (bm, bn),
            (
                "rows that see no key must give o = 0 and lse = -inf, not NaN: guard l = 0 and "
                "exp(-inf - (-inf))"
            ),
        ),
        (
            "logits near 1e4",
            (n_q, n_k, 8, 60.0),
            False,
            (bm, bn),
            (
                "lse = m + log(l), not log(l): and start m at -inf, subtracting the running max "
                "before exp"
            ),
        ),
    ]
    cases = []
    for label, (N_q, N_k, d, scale), causal, (block_m, block_n), hint in specs:
        q, k, v = _one_head(rng, N_q, N_k, d, scale)
        o, lse = reference.forward(q[None, None], k[None, None], v[None, None], causal=causal)
        cases.append(
            Case(
                label,
                (q, k, v),
                (o[0, 0], lse[0, 0]),
                hint=hint,
                tol=_F64,
                names=("o", "lse"),
                kwargs={"causal": causal, "block_m": block_m, "block_n": block_n},
            )
        )
    return grade("tiled_attention", fn, cases, solution_name=tiled_attention.solution_name, out=out)


@grader("flashedu.traffic.flash_forward")
def fa2_hbm_bytes(fn, *, seed=None, out=print):
    """Grade `fn(N_q, N_k, d, block_m, block_n, itemsize) -> int`: HBM bytes read plus written by
    the FA2-order tiled forward of one (batch, head), no mask: Q read once, K and V once per query
    block, O written once, lse written once in float32 (4 bytes per row)."""
    rng = rng_for(seed)
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))  # noqa: E731

    def expected(N_q, N_k, d, bm, bn, e):
        return traffic.flash_forward(
            1, 1, N_q, N_k, d, block_m=bm, block_n=bn, itemsize=e
        ).total_bytes

    n = 64 * r(8, 20)
    specs = [
        (
            "one query block",
            (r(10, 60), r(100, 900), 64, 64, 128, 2),
            (
                "with one query block: Q read once, K and V once, O written once, plus 4 bytes of "
                "lse per row"
            ),
        ),
        (
            f"N={n}, {n // 64} query blocks",
            (n, n, 64, 64, 128, 2),
            "K and V are read again for every query block: ceil(N_q / block_m) times each",
        ),
        (
            "ragged N_q",
            (n + r(1, 63), n, 64, 64, 128, 2),
            (
                "the number of query blocks is ceil(N_q / block_m): the short last block also "
                "reads all of K and V"
            ),
        ),
        (
            "float32 inputs",
            (n, n // 2, 32, 32, 64, 4),
            (
                "itemsize is bytes per element of Q, K, V, O; lse is float32 (4 bytes) whatever "
                "the input dtype"
            ),
        ),
    ]
    cases = [
        Case(label, args, expected(*args), hint=hint, check=_exact) for label, args, hint in specs
    ]
    return grade("fa2_hbm_bytes", fn, cases, solution_name=fa2_hbm_bytes.solution_name, out=out)
