"""Graders for notebooks/09_beyond.ipynb: which blocks a mask hides, split-KV decoding, bytes on the
ring."""

from __future__ import annotations

from .. import decoding, reference, ring
from ..testing import Tolerance, random_qkv
from ._core import Case, _compare, _compare_array, grade, grader, rng_for

__all__ = ["block_kind", "split_kv_decode", "ring_bytes"]

_F64 = Tolerance(1e-10, 1e-10)


def _same(got, expected):
    ok = got == expected
    return ok, f"{got!r}" + ("" if ok else f", expected {expected!r}")


def _block_specs(rng):
    """(label, rows, cols, N_q, N_k, causal, window_size, hint) with fresh sizes; each targets one
    mistake."""
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))  # noqa: E731
    bm, bn, n, e, left = (
        r(2, 5),
        r(2, 5),
        r(20, 30),
        r(3, 9),
        r(2, 6),
    )  # n >= 20: every block below fits
    row = r(left + bn + 2, n - bm - 1)  # a query row far right of the first keys
    return [
        (
            "no mask",
            (r(0, 4), r(5, 9)),
            (r(0, 4), r(5, 9)),
            n,
            n,
            False,
            None,
            "with no causal mask and no window every key is visible: full",
        ),
        (
            f"causal N={n}, keys right of the diagonal",
            (0, bm),
            (bm, bm + bn),
            n,
            n,
            True,
            None,
            "causal hides key j > i + N_k - N_q: "
            "a block whose first key is right of its last row's diagonal is hidden",
        ),
        (
            f"causal N={n}, keys left of the diagonal",
            (bn + 1, bn + 1 + bm),
            (0, bn),
            n,
            n,
            True,
            None,
            "full: every row of the block sees every key, so no mask is needed",
        ),
        (
            f"causal N={n}, on the diagonal",
            (0, bm),
            (0, bm),
            n,
            n,
            True,
            None,
            "a block the diagonal cuts through needs the mask: partial",
        ),
        (
            f"causal N={n}, just right of the diagonal",
            (0, bm),
            (1, 1 + bn),
            n,
            n,
            True,
            None,
            "a block is hidden only if even its last row sees none of its keys: "
            "compare its first key with the LAST row's diagonal",
        ),
        (
            f"causal N_q={n} < N_k={n + e}",
            (0, 1),
            (1, e + 1),
            n,
            n + e,
            True,
            None,
            "bottom-right alignment: query i sits at key position i + N_k - N_q",
        ),
        (
            f"causal N_q={n + e} > N_k={n}",
            (0, e),
            (0, n),
            n + e,
            n,
            True,
            None,
            "bottom-right alignment: with N_q > N_k the first N_q - N_k rows see no key at all",
        ),
        (
            f"window ({left}, 0), keys far left",
            (row, row + bm),
            (0, bn),
            n,
            n,
            False,
            (left, 0),
            "window_size=(left, right): keys more than `left` before the diagonal are hidden too",
        ),
        (
            f"window ({left}, 0), last key on the edge",
            (row, row + 1),
            (row - left - bn + 1, row - left + 1),
            n,
            n,
            False,
            (left, 0),
            "the window is inclusive: query i sees key i + N_k - N_q - left",
        ),
        (
            f"window (-1, {left}), keys far right",
            (0, bm),
            (bm + left, bm + left + bn),
            n,
            n,
            False,
            (-1, left),
            "keys more than `right` after the diagonal are hidden; -1 leaves the left side open",
        ),
    ]


@grader("flashedu.decoding.block_kind")
def block_kind(fn, *, seed=None, out=print):
    """Grade `fn(rows, cols, N_q, N_k, causal=False, window_size=None) -> "skip" | "partial" |
    "full"`: rows = (r0, r1) query rows and cols = (c0, c1) keys of one block, half-open."""
    cases = []
    for label, rows, cols, N_q, N_k, causal, window, hint in _block_specs(rng_for(seed)):
        expected = decoding.block_kind(rows, cols, N_q, N_k, causal=causal, window_size=window)
        cases.append(
            Case(
                f"{label}: rows {rows[0]}:{rows[1]}, keys {cols[0]}:{cols[1]}",
                (rows, cols, N_q, N_k),
                expected,
                hint=hint,
                kwargs=dict(causal=causal, window_size=window),
                check=_same,
            )
        )
    return grade("block_kind", fn, cases, solution_name=block_kind.solution_name, out=out)


def _check_decode(got, expected):
    """Compare (o, lse); when o is right and lse is not, say so."""
    ok, detail = _compare(got, expected, _F64, ("o", "lse"))
    if (
        not ok
        and isinstance(got, tuple)
        and len(got) == 2
        and _compare_array(got[0], expected[0], _F64)[0]
    ):
        detail += (
            " (o is right: lse must be m + log(l), "
            "the natural-log log-sum-exp of the scaled scores)"
        )
    return ok, detail


@grader("flashedu.decoding.forward")
def split_kv_decode(fn, *, seed=None, out=print):
    """Grade `fn(q, k, v, num_splits) -> (o, lse)`: exact attention of q (B, H, N_q, d) over k, v
    (B, H, N_k, d), computed split by split and merged. float64 NumPy, no mask."""
    rng = rng_for(seed)
    n = int(rng.integers(20, 60))
    specs = [  # (label, (B, H, N_q, N_k, d), num_splits, k scale, hint)
        (
            "one split",
            (1, 2, 1, n, 8),
            1,
            1.0,
            "with one split this is plain attention: o = softmax(s) v",
        ),
        (
            "4 splits",
            (2, 2, 1, n, 8),
            4,
            3.0,
            "rescale each split's l and o by exp(m_s - m) to the common max m before adding them",
        ),
        (
            "3 splits, the last one short",
            (1, 3, 2, 3 * (n // 3) + 1, 16),
            3,
            3.0,
            "each split's share is exp(m_s - m) l_s: splits must be weighted, not averaged",
        ),
        (
            "num_splits=8 > N_k=5",
            (1, 1, 1, 5, 8),
            8,
            1.0,
            "a split with no keys contributes nothing (m = -inf, l = 0), or is not made at all",
        ),
        (
            "every score below -1000",
            (1, 1, 1, 12, 4),
            3,
            -40.0,
            "start the running max at -inf, not 0: "
            "with all scores << 0, exp(s - 0) underflows to 0",
        ),
    ]
    cases = []
    for label, shape, splits, k_scale, hint in specs:
        q, k, v = random_qkv(*shape, "float64", seed=rng)
        if k_scale < 0:  # q >= 40, k <= -40 elementwise: scores <= -1600 d / sqrt(d)
            q, k = (abs(q) + 1) * -k_scale, -(abs(k) + 1) * -k_scale
        else:
            k = k * k_scale
        cases.append(
            Case(
                f"{label}, N_k={shape[3]}",
                (q, k, v, splits),
                reference.forward(q, k, v),
                hint=hint,
                check=_check_decode,
            )
        )
    return grade("split_kv_decode", fn, cases, solution_name=split_kv_decode.solution_name, out=out)


@grader("flashedu.ring.traffic_per_step")
def ring_bytes(fn, *, seed=None, out=print):
    """Grade `fn(B, H, H_kv, N_k, d, world_size, itemsize) -> list[int]`: bytes sent over all ring
    links at each step of the ring forward (one entry per step, world_size steps)."""
    rng = rng_for(seed)
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))  # noqa: E731
    specs = [  # (label, (B, H, H_kv, N_k, d, world_size, itemsize), hint)
        (
            "2 ranks, fp16",
            (1, 1, 1, 2 * r(8, 64), 64, 2, 2),
            "both K and V travel, and every step but the last sends: W - 1 hops",
        ),
        (
            "4 ranks, fp32",
            (2, 4, 4, 4 * r(8, 64), 32, 4, 4),
            "every rank passes its K/V shard at each step: all N_k rows cross the ring per step",
        ),
        (
            "GQA: H=8, H_kv=2",
            (1, 8, 2, 3 * r(8, 64), 64, 3, 2),
            "with GQA only the H_kv K/V heads travel, not the H query heads",
        ),
        (
            "ragged: N_k not a multiple of W",
            (1, 2, 2, 3 * r(8, 64) + 1, 16, 3, 2),
            "shards may differ in size, but together they still hold all N_k rows",
        ),
    ]
    cases = []
    for label, args, hint in specs:
        cases.append(
            Case(label, args, ring.traffic_per_step(*(args[:1] + args[2:])), hint=hint, check=_same)
        )
    return grade("ring_bytes", fn, cases, solution_name=ring_bytes.solution_name, out=out)
