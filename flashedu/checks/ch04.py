"""Graders for notebooks/04_recompute_backward.ipynb: the softmax backward and the tiled backward.

Exercise 4.1 asks for the backward of a row-wise softmax; exercise 4.2 for the FA2 backward of one
head in the grader's tiles, rebuilding each tile of P from q, k and the saved lse. Both run with
flashedu's own implementations off limits. On 4.2's N_q = N_k = 256 case the grader watches every
array the loop makes, and an N_q x N_k matrix is a named shortcut; on a causal case a few hundred
keys long it judges every array against the tiles (no block of scores wider than block_n keys),
counts how often each score is computed (once, or twice with a separate dQ loop), and requires the
saved lse to be read (recomputing each row's max and sum is a named shortcut). A wrong answer is
matched against planted bugs: the row term D left out, summed over the wrong axis or taken per
tile, P renormalised per tile instead of by lse, the softmax scale forgotten, the causal offset
top-left, NaN from a fully masked row, dK and dV swapped. Shortcuts are tested in
tests/checks/test_ch04_shortcuts.py.
"""

from __future__ import annotations

import numpy as np

from .. import reference
from ..testing import Tolerance
from ._core import Case, grade, grader, rng_for
from ._method import Shortcut, largest_array
from ._shared import with_rule
from ._tiled_twins import one_head, twin_backward
from ._watch import TileRule, kept_copy, watched_call

__all__ = ["softmax_backward", "tiled_attention_backward"]

_F64 = Tolerance(1e-10, 1e-10)


def softmax_grad(p, dp):
    """dS for P = softmax(S) row by row, given dP = dL/dP; p and dp (M, N)."""
    D = (p * dp).sum(axis=-1, keepdims=True)  # (M, 1): one number per row
    return p * (dp - D)


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


def _grad_bug(p, dp, *, subtract=True, axis=-1, times_p=True):
    D = (p * dp).sum(axis=axis, keepdims=True) if subtract else 0.0
    return (p if times_p else 1.0) * (dp - D)


_GRAD_MISTAKES = {
    "D was not subtracted: the softmax couples every entry of a row": {"subtract": False},
    "D was summed over the columns (axis 0); it is one number per row": {"axis": 0},
    "the result was not multiplied by P": {"times_p": False},
}

_GRAD_FORMULA = """
dS = P * (dP - D),  D_i = sum_j P_ij dP_ij   (one number per row, elementwise products)
"""


@grader(
    "flashedu.checks.ch04.softmax_grad",
    "flashedu.tiled_backward.tile_grads",
    formula=_GRAD_FORMULA,
)
def softmax_backward(fn, *, seed=None, out=print):
    """Grade `fn(p, dp) -> ds`: for P = softmax(S) row by row and dP = dL/dP, both (M, N)
    float64, return dS = dL/dS."""
    rng = rng_for(seed)
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))
    M, N, R1, N1 = r(5, 9), r(2, 4), r(3, 6), r(7, 12)
    specs = [
        ("one row, two entries", _softmax_rows(rng, 1, 2)),
        (f"random ({R1}, {N1})", _softmax_rows(rng, R1, N1)),
        (f"more rows than columns ({M}, {N})", _softmax_rows(rng, M, N)),
        ("masked entries (P = 0)", _softmax_rows(rng, r(3, 6), r(6, 12), masked=0.4)),
    ]
    cases = []
    for label, p in specs:
        dp = rng.standard_normal(p.shape)
        cases.append(
            Case(
                label,
                (p, dp),
                softmax_grad(p, dp),
                hint="dS must be the gradient of the loss with respect to the scores S",
                tol=_F64,
                mistakes={why: _grad_bug(p, dp, **kw) for why, kw in _GRAD_MISTAKES.items()},
            )
        )
    return grade("softmax_backward", fn, cases, out=out, forbid=True)


# --------------------------------------------------------------------------------------------- 4.2


_BACKWARD_MISTAKES = {
    "each tile of P was renormalised on its own instead of rebuilt from the saved lse": {
        "by_lse": False
    },
    "dQ and dK are missing the softmax scale": {"scale": False},
    "the causal mask is top-left aligned; flashedu's is bottom-right": {"offset": False},
    "rows that see no key (lse = -inf) give NaN instead of contributing nothing": {"guard": False},
    "D was left out": {"delta": "none"},
    "D was computed inside each tile; it is a sum over the whole row (from dO and O)": {
        "delta": "per tile"
    },
    "dk and dv are swapped": {"swap": True},
}

_BACKWARD_FORMULA = """
D = rowsum(dO * O); for each block of keys j, for each block of query rows i:
    P  = exp(q_i k_j^T / sqrt(d) - lse_i)   (causal: 0 where key > row + N_k - N_q)
    dV_j += P^T dO_i;   dP = dO_i v_j^T;   dS = P * (dP - D_i)
    dQ_i += dS k_j / sqrt(d);   dK_j += dS^T q_i / sqrt(d)
A row with lse = -inf has P = 0.
"""


def _memory_call(args, kwargs):
    def call(fn):
        limit = args[1].shape[0] * args[2].shape[0] // 2
        try:
            return largest_array(fn, *args, limit_elems=limit, **kwargs)[0]
        except Shortcut as e:
            raise with_rule(e) from None

    return call


_NO_LSE = (
    "never read the saved lse: rebuild each tile of P from the lse the forward saved, instead of "
    "recomputing each row's max and sum in a pass over the keys"
)


def _method_call(args, kwargs):
    """Run fn with every array it makes judged against the grader's tiles, every score it
    computes counted (one pass over the keys, one more for dQ at most), and lse required."""
    do, q, k, v, o, lse = args
    rule = TileRule(q.shape[0], k.shape[0], q.shape[1], kwargs["block_m"], kwargs["block_n"],
                    passes=2, phase="the backward")  # fmt: skip

    def call(fn):
        def run(w):
            wrapped = w.wrap(args)
            w.source(wrapped[1], "q")
            w.source(wrapped[2], "k")
            w.must_use(wrapped[5], "lse")
            return fn(*wrapped, **kwargs)

        try:
            got = watched_call(run, rule=rule)[0]
        except Shortcut as e:
            raise Shortcut(_NO_LSE) if str(e).startswith("never read the lse") else e from None
        kept = kept_copy(fn, {"K": k, "V": v}, q.shape[0], k.shape[0])
        if kept:
            raise Shortcut(f"{kept}: a tiled loop reads K and V one block at a time")
        return got

    return call


@grader("flashedu.tiled_backward.backward", formula=_BACKWARD_FORMULA)
def tiled_attention_backward(fn, *, seed=None, out=print):
    """Grade `fn(do, q, k, v, o, lse, *, causal=False, block_m, block_n) -> (dq, dk, dv)` for one
    head: q, do, o (N_q, d); k, v (N_k, d); lse (N_q,) from the forward; scale 1/sqrt(d);
    float64; never an N_q x N_k array."""
    rng = rng_for(seed)
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))
    bm, bn = r(3, 5), r(4, 7)
    n_q, n_k, e = r(3, 5) * bm + r(1, bm - 1), r(3, 5) * bn + r(1, bn - 1), r(3, 8)
    lbm, lbn = r(9, 16), r(9, 14)  # the method case: many key blocks, both lengths ragged
    lq, lk = 3 * lbm + r(1, lbm - 1), r(40, 48) * lbn + r(1, lbn - 1)
    specs = [  # (label, (N_q, N_k, d), causal, blocks)
        ("one tile holds everything", (r(2, 4), r(2, 6), 4), False, (16, 16)),
        (f"N_q={n_q}, N_k={n_k}, blocks {bm}x{bn}", (n_q, n_k, 8), False, (bm, bn)),
        ("d=64", (n_q, n_k, 64), False, (bm, bn)),
        (f"causal, N_q={n_q} < N_k={n_q + e}", (n_q, n_q + e, 8), True, (bm, bn)),
        (f"causal, N_q={n_k + e} > N_k={n_k}", (n_k + e, n_k, 8), True, (bm, bn)),
        ("N_q=N_k=256, 16x16 tiles: memory", (256, 256, 8), False, (16, 16)),
        (
            f"N_q={lq}, N_k={lk}, blocks {lbm}x{lbn}: tiles, passes, lse",
            (lq, lk, 7),
            True,
            (lbm, lbn),
        ),
    ]
    cases = []
    for label, (N_q, N_k, d), causal, (block_m, block_n) in specs:
        q, k, v = one_head(rng, N_q, N_k, d)
        do = rng.standard_normal(q.shape)
        o, lse = (
            x[0, 0] for x in reference.forward(*(t[None, None] for t in (q, k, v)), causal=causal)
        )
        grads = reference.backward(*(t[None, None] for t in (do, q, k, v)), causal=causal)
        args, kw = (do, q, k, v, o, lse), {"causal": causal, "block_m": block_m, "block_n": block_n}
        cases.append(
            Case(
                label,
                args,
                tuple(g[0, 0] for g in grads),
                hint="dq, dk, dv must be the gradients of sum(o * do)",
                tol=_F64,
                names=("dq", "dk", "dv"),
                kwargs=kw,
                mistakes={
                    why: (lambda b=bug, a=args, kw=kw: twin_backward(*a, **kw, **b))
                    for why, bug in _BACKWARD_MISTAKES.items()
                },
                call=(
                    _method_call(args, kw)
                    if d == 7
                    else _memory_call(args, kw)
                    if N_q * N_k >= 256 * 256
                    else None
                ),
            )
        )
    return grade("tiled_attention_backward", fn, cases, out=out, forbid=True)
