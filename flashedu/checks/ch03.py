"""Graders for notebooks/03_tiled_forward.ipynb: the tiled forward loop and its HBM byte count.

Exercise 3.1 asks for the FA2-order tiled forward of one head (outer loop over query blocks, online
softmax over K/V blocks), returning o and lse, in the tiles the grader passes (block_m, block_n).
It runs with flashedu's own implementations off limits, and the grader watches every array the
loop makes on two cases (`_watch.py`): on N_q = N_k = 256 with 16 x 16 tiles an N_q x N_k score
matrix, or the memory of one, is a named shortcut; on a case a few hundred keys long in tiles of
about ten (both lengths ragged), any block of scores wider than block_n keys is one (a block of
query rows against all the keys at once), and so is computing the score of a (query, key) pair
twice (a first pass for the max, a second for the sums), a fused attention
(`scaled_dot_product_attention`), and a copy of the whole K or V kept in a module-level or closure
variable. A wrong answer is matched against planted bugs: the alpha rescale missing (from l, from
o, or both), the short last block dropped (floor instead of ceil), the causal offset top-left, NaN
on rows that see no key, lse without the max or with m + l. Exercise 3.2 asks for the HBM bytes of
that loop. Shortcuts are tested in tests/checks/test_ch03_shortcuts.py.
"""

from __future__ import annotations

from .. import reference, traffic
from ..testing import Tolerance
from ._core import Case, exact_bytes, grade, grader, rng_for
from ._method import Shortcut, largest_array
from ._shared import with_rule
from ._tiled_twins import one_head, twin_forward
from ._watch import TileRule, kept_copy, watched_call

__all__ = ["tiled_attention", "fa2_hbm_bytes"]

_F64 = Tolerance(1e-10, 1e-10)


_MISTAKES = {
    "the alpha rescale is missing: when the row max grows, l and the accumulator keep their "
    "old scale": {"rescale": "none"},
    "the accumulator o was not rescaled when the row max grew (l was)": {"rescale": "l"},
    "the running sum l was not rescaled when the row max grew (o was)": {"rescale": "o"},
    "the short last block of keys was skipped (floor instead of ceil)": {"ceil": False},
    "the causal mask is top-left aligned; flashedu's is bottom-right": {"offset": False},
    "rows that see no key give NaN instead of o = 0 and lse = -inf": {"guard": False},
    "lse is log l without the running max m": {"lse": "log l"},
    "lse = m + l instead of m + log l": {"lse": "m + l"},
}


def _memory_call(q, k, v, kwargs):
    def call(fn):
        try:
            return largest_array(fn, q, k, v, limit_elems=q.shape[0] * k.shape[0] // 2, **kwargs)[0]
        except Shortcut as e:
            raise with_rule(e) from None

    return call


def _method_call(q, k, v, kwargs):
    """Run fn on q, k, v with every array it makes judged against the grader's tiles, and
    every score it computes counted (one pass over the keys)."""
    rule = TileRule(q.shape[0], k.shape[0], q.shape[1], kwargs["block_m"], kwargs["block_n"])

    def call(fn):
        def run(w):
            qw, kw_, vw = w.wrap((q, k, v))
            w.source(qw, "q")
            w.source(kw_, "k")
            return fn(qw, kw_, vw, **kwargs)

        got = watched_call(run, rule=rule)[0]
        kept = kept_copy(fn, {"K": k, "V": v}, q.shape[0], k.shape[0])
        if kept:
            raise Shortcut(f"{kept}: a tiled loop reads K and V one block at a time")
        return got

    return call


_TILED_FORMULA = """
For each block of query rows i, start m = -inf, l = 0, acc = 0; for each block of keys j:
    s     = q_i k_j^T / sqrt(d)   (causal: -inf where key > row + N_k - N_q)
    m_new = max(m, rowmax(s));  p = exp(s - m_new);  alpha = exp(m - m_new)
    l     = alpha * l + rowsum(p);   acc = alpha * acc + p v_j;   m = m_new
Then o_i = acc / l and lse_i = m + log(l); a row with l = 0 gets o = 0, lse = -inf.
"""


@grader("flashedu.tiled.forward", formula=_TILED_FORMULA)
def tiled_attention(fn, *, seed=None, out=print):
    """Grade `fn(q, k, v, *, causal=False, block_m, block_n) -> (o, lse)` for one head: q (N_q, d),
    k and v (N_k, d) float64, scale 1/sqrt(d), o (N_q, d), lse (N_q,) natural-log, never an
    N_q x N_k array."""
    rng = rng_for(seed)
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))
    bm, bn = r(3, 5), r(4, 7)
    n_q, n_k = r(3, 6) * bm + r(1, bm - 1), r(3, 6) * bn + r(1, bn - 1)  # never block multiples
    e = r(3, 8)
    lbm, lbn = r(9, 16), r(9, 14)  # the method case: many key blocks, both lengths ragged
    lq, lk = 3 * lbm + r(1, lbm - 1), r(40, 48) * lbn + r(1, lbn - 1)
    specs = [  # (label, (N_q, N_k, d, input scale), causal, (block_m, block_n), hint)
        ("one tile holds everything", (r(2, 6), r(2, 6), 8, 1.0), False, (16, 16), ""),
        (f"N_q={n_q}, N_k={n_k}, blocks {bm}x{bn}", (n_q, n_k, 8, 1.0), False, (bm, bn), ""),
        (f"N_k={n_k}: last K/V block short", (bm, n_k, 4, 1.0), False, (bm, bn), ""),
        (f"causal, N_q={n_q} < N_k={n_q + e}", (n_q, n_q + e, 8, 1.0), True, (bm, bn), ""),
        (f"causal, N_q={n_k + e} > N_k={n_k}", (n_k + e, n_k, 8, 1.0), True, (bm, bn), ""),
        ("logits near 1e4", (n_q, n_k, 8, 60.0), False, (bm, bn), ""),
        ("N_q=N_k=256, 16x16 tiles: memory", (256, 256, 8, 1.0), False, (16, 16), ""),
        (
            f"N_q={lq}, N_k={lk}, blocks {lbm}x{lbn}: tiles and one pass",
            (lq, lk, 7, 1.0),
            False,
            (lbm, lbn),
            "method",
        ),
    ]
    cases = []
    for label, (N_q, N_k, d, scale), causal, (block_m, block_n), kind in specs:
        q, k, v = one_head(rng, N_q, N_k, d, scale)
        o, lse = reference.forward(q[None, None], k[None, None], v[None, None], causal=causal)
        kw = {"causal": causal, "block_m": block_m, "block_n": block_n}
        cases.append(
            Case(
                label,
                (q, k, v),
                (o[0, 0], lse[0, 0]),
                hint="o and lse must equal exact attention of each row over its visible keys",
                tol=_F64,
                names=("o", "lse"),
                kwargs=kw,
                mistakes={
                    why: (lambda b=bug, q=q, k=k, v=v, kw=kw: twin_forward(q, k, v, **kw, **b))
                    for why, bug in _MISTAKES.items()
                },
                call=(
                    _method_call(q, k, v, kw)
                    if kind == "method"
                    else _memory_call(q, k, v, kw)
                    if N_q * N_k >= 256 * 256
                    else None
                ),
            )
        )
    return grade("tiled_attention", fn, cases, out=out, forbid=True)


# --------------------------------------------------------------------------------------------- 3.2


def _bytes(N_q, N_k, d, bm, bn, e, *, reread=True, ceil=True, lse=True, lse_e=4, o=True):
    blocks = -(-N_q // bm) if ceil else N_q // bm
    kv = 2 * N_k * d * e * (blocks if reread else 1)
    return N_q * d * e * (2 if o else 1) + kv + (lse_e * N_q if lse else 0)


_BYTE_MISTAKES = {
    "K and V were counted once; they are read again for every query block": {"reread": False},
    "the number of query blocks was rounded down (floor instead of ceil)": {"ceil": False},
    "the lse write was left out": {"lse": False},
    "lse was counted in the input's itemsize; it is float32 (4 bytes) whatever the input": {
        "lse_e": None
    },
    "the write of O was left out": {"o": False},
}

_BYTES_FORMULA = """
bytes = (N_q d + ceil(N_q / block_m) * 2 N_k d + N_q d) * itemsize + 4 N_q
        (Q read once, K and V once per query block, O written once, lse in float32)
"""


@grader("flashedu.traffic.flash_forward", formula=_BYTES_FORMULA)
def fa2_hbm_bytes(fn, *, seed=None, out=print):
    """Grade `fn(N_q, N_k, d, block_m, block_n, itemsize) -> int`: HBM bytes read plus written by
    the FA2-order tiled forward of one (batch, head), no mask: Q read once, K and V once per query
    block, O written once, lse written once in float32 (4 bytes per row)."""
    rng = rng_for(seed)
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))

    def expected(N_q, N_k, d, bm, bn, e):
        return traffic.flash_forward(
            1, 1, N_q, N_k, d, block_m=bm, block_n=bn, itemsize=e
        ).total_bytes

    n = 64 * r(8, 20)
    specs = [
        ("one query block", (r(10, 60), r(100, 900), 64, 64, 128, 2)),
        (f"N={n}, {n // 64} query blocks", (n, n, 64, 64, 128, 2)),
        ("ragged N_q", (n + r(1, 63), n, 64, 64, 128, 2)),
        ("float32 inputs", (n, n // 2, 32, 32, 64, 4)),
    ]
    cases = [
        Case(
            label,
            args,
            expected(*args),
            hint="count every tensor that crosses HBM, as often as the loop moves it",
            check=exact_bytes,
            mistakes={
                why: _bytes(*args, **{k: (args[-1] if v is None else v) for k, v in kw.items()})
                for why, kw in _BYTE_MISTAKES.items()
            },
        )
        for label, args in specs
    ]
    return grade("fa2_hbm_bytes", fn, cases, out=out, forbid=True)
