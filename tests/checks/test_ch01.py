"""Chapter 01 graders: a learner's solution passes, each planted bug is named, flashedu's own
implementation is rejected by name."""

import numpy as np
import pytest

from flashedu import checks, naive, traffic
from flashedu.testing import run_grader


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


def test_naive_attention_accepts_a_learners_solution():
    assert run_grader(checks.naive_attention, _attention, seed=1)[0].passed


@pytest.mark.parametrize(
    "kw,words",
    [
        ({"scale": False}, "not scaled by 1/sqrt(d)"),
        ({"offset": False}, "top-left aligned"),
        ({"safe": False}, "the row max was not subtracted"),
        ({"axis": -2}, "normalises over the queries"),
    ],
)
def test_naive_attention_names_each_planted_bug(kw, words):
    report, text = run_grader(
        checks.naive_attention, lambda q, k, v, causal=False: _attention(q, k, v, causal, **kw), 2
    )
    assert not report.passed and words in report.diagnosis, text
    assert text.count("what is wrong") == 1


def test_naive_attention_rejects_flashedus_own():
    def package(q, k, v, causal=False):
        return naive.forward(q, k, v, causal=causal)[0]

    report, _ = run_grader(checks.naive_attention, package, seed=2)
    assert report.diagnosis.startswith("called flashedu.naive.forward")


def test_stub_reports_not_attempted_and_nothing_else():
    def stub(q, k, v, causal=False):
        raise NotImplementedError

    report, text = run_grader(checks.naive_attention, stub)
    assert not report.attempted and text == "naive_attention: not attempted yet"


def _bytes(B, H, N, d, e, *, sp_twice=True, per_head=True):
    bh = B * H if per_head else 1
    return bh * e * (4 * N * d + (4 if sp_twice else 2) * N * N)


@pytest.mark.parametrize(
    "kw,words",
    [
        ({"sp_twice": False}, "S and P were counted once each"),
        ({"per_head": False}, "only one (batch, head) pair was counted"),
    ],
)
def test_naive_hbm_bytes_grades_a_solution_and_names_bugs(kw, words):
    assert run_grader(checks.naive_hbm_bytes, _bytes, seed=0)[0].passed
    report, _ = run_grader(checks.naive_hbm_bytes, lambda *a: _bytes(*a, **kw), seed=0)
    assert not report.passed and words in report.diagnosis


def test_naive_hbm_bytes_rejects_the_traffic_model():
    def package(B, H, N, d, e):
        return traffic.naive_forward(B, H, N, N, d, itemsize=e).total_bytes

    report, _ = run_grader(checks.naive_hbm_bytes, package, seed=0)
    assert report.diagnosis.startswith("called flashedu.traffic.closed_forms.naive_forward")
    assert traffic.naive_forward(1, 1, 8, 8, 4).writes["lse"] == 8 * 4
