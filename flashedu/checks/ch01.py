"""Graders for notebooks/01_naive_attention.ipynb."""

from __future__ import annotations

from .. import reference, traffic
from ..testing import Tolerance, random_qkv
from ._core import Case, grade, grader, rng_for

__all__ = ["naive_attention", "naive_hbm_bytes"]

_F64 = Tolerance(1e-10, 1e-10)


@grader("flashedu.naive.forward")
def naive_attention(fn, *, seed=None, out=print):
    """Grade `fn(q, k, v, causal=False) -> o`, float64 NumPy arrays of shape (B, H, N, d)."""
    rng = rng_for(seed)
    cases = []
    specs = [  # (label, (B, H, N_q, N_k, d), causal, input scale, hint)
        ("one query, one key", (1, 1, 1, 1, 4), False, 1.0, "with one key, o must equal v"),
        (
            "ragged N_q=5, N_k=7",
            (2, 3, 5, 7, 8),
            False,
            1.0,
            "softmax normalises over the keys, the last axis of S",
        ),
        (
            "d=64: scores scaled by 1/sqrt(d)",
            (1, 2, 9, 9, 64),
            False,
            1.0,
            "scale q @ k^T by 1/sqrt(d) before the softmax",
        ),
        ("causal, N_q == N_k", (1, 2, 6, 6, 8), True, 1.0, "causal: query i sees keys j <= i"),
        (
            "causal, N_q=3 < N_k=8",
            (1, 1, 3, 8, 8),
            True,
            1.0,
            "causal offset: query i sees keys j <= i + N_k - N_q (bottom-right aligned)",
        ),
        (
            "logits near 1e4",
            (1, 1, 4, 6, 4),
            False,
            100.0,
            "subtract the row max before exp (safe softmax), or exp overflows",
        ),
    ]
    for label, shape, causal, scale, hint in specs:
        q, k, v = random_qkv(*shape, "float64", seed=rng, scale=scale)
        cases.append(
            Case(
                label,
                (q, k, v),
                reference.forward(q, k, v, causal=causal)[0],
                hint=hint,
                kwargs={"causal": causal},
                tol=_F64,
            )
        )
    return grade("naive_attention", fn, cases, solution_name=naive_attention.solution_name, out=out)


def _exact(got, expected):
    try:
        ok = int(got) == int(expected)
    except (TypeError, ValueError):
        return False, f"expected an int, got {got!r}"
    return ok, f"{int(got):,} bytes" + ("" if ok else f", expected {int(expected):,}")


@grader("flashedu.traffic.naive_forward")
def naive_hbm_bytes(fn, *, seed=None, out=print):
    """Grade `fn(B, H, N, d, itemsize) -> int`: HBM bytes read plus written by the naive forward
    pass (Q, K, V read; S and P written and read back; O written; lse not counted),
    N_q == N_k == N."""
    rng = rng_for(seed)

    def expected(B, H, N, d, e):
        t = traffic.naive_forward(B, H, N, N, d, itemsize=e)
        return t.total_bytes - t.writes["lse"]

    specs = [
        (
            "N=1, d=64, fp16",
            (1, 1, 1, 64, 2),
            "Q, K, V are read once and O written once: 4 N d elements",
        ),
        (
            "N=1024, d=64, fp16",
            (1, 1, 1024, 64, 2),
            "S and P each cross HBM twice (written, then read back): 4 N^2 elements",
        ),
        (
            "B=2, H=3, fp32",
            (2, 3, int(rng.integers(100, 300)), 32, 4),
            "every (batch, head) pair moves its own S and P; itemsize is bytes per element",
        ),
    ]
    cases = [
        Case(label, args, expected(*args), hint=hint, check=_exact) for label, args, hint in specs
    ]
    return grade("naive_hbm_bytes", fn, cases, solution_name=naive_hbm_bytes.solution_name, out=out)
