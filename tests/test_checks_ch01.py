"""Chapter 01 graders: the solution passes, each planted bug fails with a line that names it."""

import numpy as np
import pytest

from flashedu import checks, naive, traffic


def _attention(q, k, v, causal=False, *, scale=True, offset=True, safe=True, axis=-1):
    d, N_q, N_k = q.shape[-1], q.shape[-2], k.shape[-2]
    s = q @ np.swapaxes(k, -1, -2) / (np.sqrt(d) if scale else 1.0)
    if causal:
        shift = N_k - N_q if offset else 0
        s = np.where(np.arange(N_k)[None, :] <= np.arange(N_q)[:, None] + shift, s, -np.inf)
    if safe:
        s = s - s.max(axis=axis, keepdims=True)
    with np.errstate(over="ignore", invalid="ignore"):
        p = np.exp(s)
        return (p / p.sum(axis=axis, keepdims=True)) @ v


def _quiet(*a, **k):
    pass


def test_naive_attention_accepts_the_solution():
    assert checks.naive_attention(
        lambda q, k, v, causal=False: naive.forward(q, k, v, causal=causal)[0], seed=0, out=_quiet
    ).passed
    assert checks.naive_attention(_attention, seed=1, out=_quiet).passed


@pytest.mark.parametrize(
    "bug,kw,words",
    [
        ("no 1/sqrt(d)", {"scale": False}, "1/sqrt(d)"),
        ("top-left causal", {"offset": False}, "causal offset"),
        ("no max subtraction", {"safe": False}, "subtract the row max"),
        ("softmax over queries", {"axis": -2}, "last axis"),
    ],
)
def test_naive_attention_names_each_planted_bug(bug, kw, words):
    report = checks.naive_attention(
        lambda q, k, v, causal=False: _attention(q, k, v, causal, **kw), seed=2, out=_quiet
    )
    assert not report.passed, bug
    assert words in report.text, report.text


def test_stub_reports_not_attempted():
    lines = []

    def stub(q, k, v, causal=False):
        raise NotImplementedError

    report = checks.naive_attention(stub, out=lines.append)
    assert (
        not report.attempted
        and "not attempted yet" in lines[0]
        and "flashedu.naive.forward" in lines[0]
    )


def _bytes(B, H, N, d, e, *, sp_twice=True, per_head=True):
    bh = B * H if per_head else 1
    return bh * e * (4 * N * d + (4 if sp_twice else 2) * N * N)


def test_naive_hbm_bytes_grades_solution_and_bugs():
    assert checks.naive_hbm_bytes(_bytes, seed=0, out=_quiet).passed
    r = checks.naive_hbm_bytes(lambda *a: _bytes(*a, sp_twice=False), seed=0, out=_quiet)
    assert not r.passed and "cross HBM twice" in r.text
    r = checks.naive_hbm_bytes(lambda *a: _bytes(*a, per_head=False), seed=0, out=_quiet)
    assert not r.passed and "every (batch, head) pair" in r.text
    assert traffic.naive_forward(1, 1, 8, 8, 4).writes["lse"] == 8 * 4
