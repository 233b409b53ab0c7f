"""Graders for notebooks/04_recompute_backward.ipynb: the softmax backward and the tiled backward
pass.

Exercise 4.1 asks for dS = P * (dP - rowsum(P * dP)), the backward of a row-wise softmax; exercise
4.2 for the FA2 backward of one head, rebuilding each tile of P from q, k and the saved lse. Each
case draws fresh sizes and targets one mistake: the row sum left out or taken over the wrong axis, P
renormalised per tile instead of by lse, the softmax scale forgotten, the causal offset top-left,
NaN from a fully masked row.
"""

from __future__ import annotations

import numpy as np

from .. import reference
from ..testing import Tolerance
from ._core import Case, grade, grader, rng_for
from .ch03 import _one_head

__all__ = ["softmax_backward", "tiled_attention_backward"]

_F64 = Tolerance(1e-10, 1e-10)


def _softmax_rows(rng, R, N, masked=0.0):
    s = rng.standard_normal((R, N)) * 2
    keep = rng.random((R, N)) >= masked
    keep[:, 0] = True
    p, _ = reference.probabilities(
        np.where(keep, s, 0)[None, None],
        np.eye(N)[None, None],
        softmax_scale=1.0,
        attn_mask=keep[None, None],
    )
    return p[0, 0]


@grader("flashedu.tiled_backward._tile_grads")
def softmax_backward(fn, *, seed=None, out=print):
    """Grade `fn(p, dp) -> ds`: for P = softmax(S) row by row and dP = dL/dP, both (M, N) float64,
    return dS = dL/dS = P * (dP - D) with D = rowsum(P * dP), one number per row."""
    rng = rng_for(seed)
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))  # noqa: E731
    M, N, R1, N1 = r(5, 9), r(2, 4), r(3, 6), r(7, 12)
    specs = [
        ("one row, two entries", _softmax_rows(rng, 1, 2), "dS = P * (dP - D), D = sum_j P_j dP_j"),
        (
            f"random ({R1}, {N1})",
            _softmax_rows(rng, R1, N1),
            "subtract D_i = sum_j P_ij dP_ij (the softmax couples every entry of a row) "
            "before multiplying by P",
        ),
        (
            f"more rows than columns ({M}, {N})",
            _softmax_rows(rng, M, N),
            "D is a sum over each row (axis=-1, over the keys), not over the columns",
        ),
        (
            "masked entries (P = 0)",
            _softmax_rows(rng, r(3, 6), r(6, 12), masked=0.4),
            "where P = 0 (a masked key), dS must be 0",
        ),
    ]
    cases = []
    for label, p, hint in specs:
        dp = rng.standard_normal(p.shape)
        cases.append(
            Case(
                label, (p, dp), p * (dp - (p * dp).sum(axis=-1, keepdims=True)), hint=hint, tol=_F64
            )
        )
    return grade(
        "softmax_backward", fn, cases, solution_name=softmax_backward.solution_name, out=out
    )


@grader("flashedu.tiled_backward.backward")
def tiled_attention_backward(fn, *, seed=None, out=print):
    """Grade `fn(do, q, k, v, o, lse, *, causal=False, block_m, block_n) -> (dq, dk, dv)` for one
    head: q, do, o (N_q, d); k, v (N_k, d); lse (N_q,) from the forward; scale 1/sqrt(d);
    float64."""
    rng = rng_for(seed)
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))  # noqa: E731
    bm, bn = r(3, 5), r(4, 7)
    n_q, n_k, e = r(3, 5) * bm + r(1, bm - 1), r(3, 5) * bn + r(1, bn - 1), r(3, 8)
    specs = [  # (label, (N_q, N_k, d), causal, hint); the first case is one tile: blocks 16 x 16
        (
            "one tile holds everything",
            (r(2, 4), r(2, 6), 4),
            False,
            "dV = P^T dO, dP = dO V^T, dS = P * (dP - D) with D = rowsum(dO * O), "
            "dQ = scale dS K, dK = scale dS^T Q",
        ),
        (
            f"N_q={n_q}, N_k={n_k}, blocks {bm}x{bn}",
            (n_q, n_k, 8),
            False,
            "rebuild each tile of P as exp(scale q_i k_j^T - lse_i): "
            "the saved lse already normalises it, so no per-tile max or sum is needed",
        ),
        (
            "d=64",
            (n_q, n_k, 64),
            False,
            "dQ and dK carry the softmax scale: dQ = scale dS K, dK = scale dS^T Q",
        ),
        (
            f"causal, N_q={n_q} < N_k={n_q + e}",
            (n_q, n_q + e, 8),
            True,
            "recompute P with the forward's mask, bottom-right aligned: "
            "key j visible iff j <= i + N_k - N_q",
        ),
        (
            f"causal, N_q={n_k + e} > N_k={n_k}",
            (n_k + e, n_k, 8),
            True,
            "a row that sees no key has lse = -inf: its P must be 0, not exp(-inf - (-inf)) = NaN",
        ),
    ]
    cases = []
    for n, (label, (N_q, N_k, d), causal, hint) in enumerate(specs):
        q, k, v = _one_head(rng, N_q, N_k, d)
        do = rng.standard_normal(q.shape)
        o, lse = (
            x[0, 0]
            for x in reference.forward(q[None, None], k[None, None], v[None, None], causal=causal)
        )
        grads = reference.backward(
            do[None, None], q[None, None], k[None, None], v[None, None], causal=causal
        )
        cases.append(
            Case(
                label,
                (do, q, k, v, o, lse),
                tuple(g[0, 0] for g in grads),
                hint=hint,
                tol=_F64,
                names=("dq", "dk", "dv"),
                kwargs={
                    "causal": causal,
                    "block_m": 16 if n == 0 else bm,
                    "block_n": 16 if n == 0 else bn,
                },
            )
        )
    return grade(
        "tiled_attention_backward",
        fn,
        cases,
        solution_name=tiled_attention_backward.solution_name,
        out=out,
    )
