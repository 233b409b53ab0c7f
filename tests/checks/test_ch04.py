"""Chapter 04 graders: a learner's solutions pass, each planted bug is named once, and every
shortcut (the full matrix, flashedu's own backward) is rejected by name."""

import numpy as np
import pytest

from flashedu import checks, tiled
from flashedu.testing import run_grader


def _softmax_bwd(p, dp, *, subtract=True, axis=-1):
    return p * (dp - (p * dp).sum(axis=axis, keepdims=True)) if subtract else p * dp


def test_softmax_backward_accepts_a_learners_solution():
    assert run_grader(checks.softmax_backward, _softmax_bwd, seed=0)[0].passed


@pytest.mark.parametrize(
    "kw,words",
    [({"subtract": False}, "D was not subtracted"), ({"axis": 0}, "summed over the columns")],
)
def test_softmax_backward_names_each_planted_bug(kw, words):
    report, text = run_grader(
        checks.softmax_backward, lambda p, dp: _softmax_bwd(p, dp, **kw), seed=1
    )
    assert not report.passed and words in report.diagnosis, text
    assert "dP - D" not in text  # the formula comes only with checks.hint


def _backward(do, q, k, v, o, lse, *, causal=False, block_m, block_n, by_lse=True, scale=True,
              offset=True, guard=True, delta=True, swap=False):  # fmt: skip
    """A one-head FA2 backward, as a learner writes it, with switches that plant mistakes."""
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
    return (dq, dv, dk) if swap else (dq, dk, dv)


def test_tiled_attention_backward_accepts_a_learners_loop():
    for seed in (0, 1):
        report, text = run_grader(checks.tiled_attention_backward, _backward, seed)
        assert report.passed, text


@pytest.mark.parametrize(
    "kw,words",
    [
        ({"by_lse": False}, "renormalised on its own"),
        ({"scale": False}, "missing the softmax scale"),
        ({"offset": False}, "top-left aligned"),
        ({"guard": False}, "give NaN"),
        ({"delta": False}, "D was left out"),
        ({"swap": True}, "dk and dv are swapped"),
    ],
)
def test_tiled_attention_backward_names_each_planted_bug_once(kw, words):
    report, text = run_grader(
        checks.tiled_attention_backward, lambda *a, **k: _backward(*a, **k, **kw), seed=2
    )
    assert not report.passed and words in report.diagnosis, text
    assert text.count("what is wrong") == 1


def _full(do, q, k, v, o, lse, *, causal=False, block_m, block_n):
    """The whole backward in one tile: an N_q x N_k P."""
    return _backward(do, q, k, v, o, lse, causal=causal, block_m=10**6, block_n=10**6)


def _package(do, q, k, v, o, lse, *, causal=False, block_m, block_n):
    grads = tiled.backward(*(t[None, None] for t in (do, q, k, v, o, lse)), causal=causal,
                           block_m=block_m, block_n=block_n)  # fmt: skip
    return tuple(g[0, 0] for g in grads)


@pytest.mark.parametrize(
    "fn,words",
    [(_full, "built a 256x256 array"), (_package, "called flashedu.tiled_backward.backward")],
    ids=["full matrix", "flashedu's backward"],
)
def test_tiled_attention_backward_rejects_every_shortcut_by_name(fn, words):
    report, text = run_grader(checks.tiled_attention_backward, fn, seed=3)
    assert not report.passed and report.diagnosis.startswith(words), text


def test_stubs_report_not_attempted():
    def stub(*args, **kwargs):
        raise NotImplementedError("Exercise 4.1")

    for g in (checks.softmax_backward, checks.tiled_attention_backward):
        report, text = run_grader(g, stub)
        assert not report.attempted and text == f"{g.__name__}: not attempted yet"
