"""Chapter 04 graders: the solutions pass, each planted bug fails with a line that names it."""

import numpy as np
import pytest

from flashedu import checks, tiled


def _quiet(*a, **k):
    pass


def _softmax_bwd(p, dp, *, subtract=True, axis=-1):
    return p * (dp - (p * dp).sum(axis=axis, keepdims=True)) if subtract else p * dp


def test_softmax_backward_accepts_the_solution():
    assert checks.softmax_backward(_softmax_bwd, seed=0, out=_quiet).passed


@pytest.mark.parametrize(
    "kw,words",
    [
        ({"subtract": False}, "subtract D_i"),
        ({"axis": 0}, "not over the columns"),
    ],
)
def test_softmax_backward_names_each_planted_bug(kw, words):
    report = checks.softmax_backward(lambda p, dp: _softmax_bwd(p, dp, **kw), seed=1, out=_quiet)
    assert not report.passed, kw
    assert words in report.text, report.text


def _backward(
    do,
    q,
    k,
    v,
    o,
    lse,
    *,
    causal=False,
    block_m,
    block_n,
    by_lse=True,
    scale=True,
    offset=True,
    guard=True,
    delta=True,
):
    """A one-head FA2 backward with switches that plant the classic mistakes."""
    N_q, N_k, d = q.shape[0], k.shape[0], q.shape[1]
    tau = 1 / np.sqrt(d)
    D = (do * o).sum(axis=1) if delta else np.zeros(N_q)
    lse = np.where(np.isneginf(lse), np.inf, lse) if guard else lse
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    shift = N_k - N_q if offset else 0
    with np.errstate(all="ignore"):
        for c0 in range(0, N_k, block_n):
            cols = np.arange(c0, min(c0 + block_n, N_k))
            for r0 in range(0, N_q, block_m):
                rows = np.arange(r0, min(r0 + block_m, N_q))
                s = tau * q[rows] @ k[cols].T
                if causal:
                    s = np.where(cols[None, :] <= rows[:, None] + shift, s, -np.inf)
                if by_lse:
                    p = np.exp(s - lse[rows, None])
                else:
                    p = np.exp(s - s.max(axis=1, keepdims=True))
                    p = p / p.sum(axis=1, keepdims=True)
                dv[cols] += p.T @ do[rows]
                ds = p * (do[rows] @ v[cols].T - D[rows, None])
                dq[rows] += (tau if scale else 1.0) * ds @ k[cols]
                dk[cols] += (tau if scale else 1.0) * ds.T @ q[rows]
    return dq, dk, dv


def _package(do, q, k, v, o, lse, *, causal=False, block_m, block_n):
    grads = tiled.backward(
        do[None, None],
        q[None, None],
        k[None, None],
        v[None, None],
        o[None, None],
        lse[None, None],
        causal=causal,
        block_m=block_m,
        block_n=block_n,
    )
    return tuple(g[0, 0] for g in grads)


def test_tiled_attention_backward_accepts_the_solutions():
    assert checks.tiled_attention_backward(_package, seed=0, out=_quiet).passed
    assert checks.tiled_attention_backward(_backward, seed=1, out=_quiet).passed


@pytest.mark.parametrize(
    "kw,words",
    [
        ({"by_lse": False}, "the saved lse already normalises it"),
        ({"scale": False}, "carry the softmax scale"),
        ({"offset": False}, "bottom-right aligned"),
        ({"guard": False}, "its P must be 0"),
        ({"delta": False}, "D = rowsum(dO * O)"),
    ],
)
def test_tiled_attention_backward_names_each_planted_bug(kw, words):
    report = checks.tiled_attention_backward(
        lambda *a, **k: _backward(*a, **k, **kw), seed=2, out=_quiet
    )
    assert not report.passed, kw
    assert words in report.text, report.text


def test_stubs_report_not_attempted():
    def stub(*args, **kwargs):
        raise NotImplementedError("Exercise 4.1")

    for g in (checks.softmax_backward, checks.tiled_attention_backward):
        lines = []
        assert not g(stub, out=lines.append).attempted
        assert lines == [f"{g.__name__}: not attempted yet (reference: {g.solution_name})"]
