"""Chapter 03 graders: a learner's loop passes, each planted bug is named once, and every shortcut
(the full score matrix, made any way, or flashedu's own loop) is rejected by name."""

import numpy as np
import pytest

from flashedu import checks, tiled
from flashedu.testing import run_grader


def _tiled(q, k, v, *, causal=False, block_m, block_n, rescale=True, rescale_o=True, ragged=True,
           offset=True, guard=True, lse="m + log l"):  # fmt: skip
    """A one-head FA2-order loop, as a learner writes it, with switches that plant mistakes."""
    N_q, N_k, d = q.shape[0], k.shape[0], q.shape[1]
    o, out = np.zeros((N_q, d)), np.zeros(N_q)
    stop = N_k if ragged else N_k - N_k % block_n
    shift = N_k - N_q if offset else 0
    with np.errstate(all="ignore"):
        for r0 in range(0, N_q, block_m):
            rows = np.arange(r0, min(r0 + block_m, N_q))
            m, l, acc = np.full(rows.size, -np.inf), np.zeros(rows.size), np.zeros((rows.size, d))
            for c0 in range(0, stop, block_n):
                cols = np.arange(c0, min(c0 + block_n, N_k))
                s = q[rows] @ k[cols].T / np.sqrt(d)
                if causal:
                    s = np.where(cols[None, :] <= rows[:, None] + shift, s, -np.inf)
                m_new = np.maximum(m, s.max(axis=1))
                m_ref = np.where(np.isneginf(m_new), 0.0, m_new) if guard else m_new
                p = np.exp(s - m_ref[:, None])
                alpha = np.exp(m - m_ref) if rescale else np.ones_like(m)
                l = alpha * l + p.sum(axis=1)
                acc = (alpha[:, None] if rescale_o else 1.0) * acc + p @ v[cols]
                m = m_new
            o[rows] = acc / (np.where(l > 0, l, 1.0)[:, None] if guard else l[:, None])
            m0 = np.where(np.isneginf(m), 0, m)
            value = {"m + log l": m0 + np.log(l), "log l": np.log(l), "m + l": m0 + l}[lse]
            out[rows] = np.where(l > 0, value, -np.inf)
    return o, out


def test_tiled_attention_accepts_a_learners_loop():
    for seed in (0, 1):
        report, text = run_grader(checks.tiled_attention, _tiled, seed)
        assert report.passed, text


@pytest.mark.parametrize(
    "kw,words",
    [
        ({"rescale": False, "rescale_o": False}, "the alpha rescale is missing"),
        ({"rescale_o": False}, "the accumulator o was not rescaled"),
        ({"ragged": False}, "floor instead of ceil"),
        ({"offset": False}, "top-left aligned"),
        ({"guard": False}, "rows that see no key give NaN"),
        ({"lse": "log l"}, "lse is log l without the running max"),
        ({"lse": "m + l"}, "lse = m + l instead of m + log l"),
    ],
)
def test_tiled_attention_names_each_planted_bug_once(kw, words):
    report, text = run_grader(checks.tiled_attention, lambda *a, **k: _tiled(*a, **k, **kw), 2)
    assert not report.passed and words in report.diagnosis, text
    assert text.count("what is wrong") == 1 and "checks.hint(checks.tiled_attention)" in text


def _causal_scores(q, k, causal):
    s = q @ k.T / np.sqrt(q.shape[1])
    if causal:
        keep = (
            np.arange(k.shape[0])[None] <= np.arange(q.shape[0])[:, None] + k.shape[0] - q.shape[0]
        )
        s = np.where(keep, s, -np.inf)
    return s


def _full(q, k, v, *, causal=False, block_m, block_n):
    s = _causal_scores(q, k, causal)
    m = s.max(axis=1, keepdims=True)
    m = np.where(np.isneginf(m), 0, m)
    p = np.exp(s - m)
    l = p.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        return p @ v / np.where(l > 0, l, 1), np.where(
            l[:, 0] > 0, m[:, 0] + np.log(l[:, 0]), -np.inf
        )


def _filled(q, k, v, *, causal=False, block_m, block_n):
    """The full matrix again, filled block by block into an array made with np.zeros."""
    s = np.zeros((q.shape[0], k.shape[0]))
    for r0 in range(0, q.shape[0], block_m):
        s[r0 : r0 + block_m] = _causal_scores(np.asarray(q), np.asarray(k), causal)[
            r0 : r0 + block_m
        ]
    return _full(q, k, v, causal=causal, block_m=block_m, block_n=block_n)


def _package(q, k, v, *, causal=False, block_m, block_n):
    o, lse = tiled.forward(q[None, None], k[None, None], v[None, None], causal=causal,
                           block_m=block_m, block_n=block_n)  # fmt: skip
    return o[0, 0], lse[0, 0]


@pytest.mark.parametrize(
    "fn,words",
    [
        (_full, "built a 256x256 array"),
        (_filled, "built a 256x256 array"),
        (_package, "called flashedu.tiled.forward"),
    ],
    ids=["full matrix", "np.zeros matrix", "flashedu's loop"],
)
def test_tiled_attention_rejects_every_shortcut_by_name(fn, words):
    report, text = run_grader(checks.tiled_attention, fn, seed=3)
    assert not report.passed and report.diagnosis.startswith(words), text


def _bytes(N_q, N_k, d, bm, bn, e, *, reread=True, ceil=True, lse=True):
    blocks = -(-N_q // bm) if ceil else N_q // bm
    kv = 2 * N_k * d * e * (blocks if reread else 1)
    return 2 * N_q * d * e + kv + (4 * N_q if lse else 0)


@pytest.mark.parametrize(
    "kw,words",
    [
        ({"reread": False}, "read again for every query block"),
        ({"ceil": False}, "floor instead of ceil"),
        ({"lse": False}, "the lse write was left out"),
    ],
)
def test_fa2_hbm_bytes_grades_a_solution_and_names_bugs(kw, words):
    assert run_grader(checks.fa2_hbm_bytes, _bytes, seed=0)[0].passed
    report, text = run_grader(checks.fa2_hbm_bytes, lambda *a: _bytes(*a, **kw), seed=1)
    assert not report.passed and words in report.diagnosis, text


def test_stubs_report_not_attempted():
    def stub(*args, **kwargs):
        raise NotImplementedError("Exercise 3.1")

    for g in (checks.tiled_attention, checks.fa2_hbm_bytes):
        report, text = run_grader(g, stub)
        assert not report.attempted and text == f"{g.__name__}: not attempted yet"
