"""Chapter 03 graders: the solutions pass, each planted bug fails with a line that names it."""

import numpy as np
import pytest

from flashedu import checks, tiled


def _quiet(*a, **k):
    pass


def _tiled(
    q,
    k,
    v,
    *,
    causal=False,
    block_m,
    block_n,
    rescale=True,
    ragged=True,
    offset=True,
    guard=True,
    lse_max=True,
):
    """A one-head FA2-order loop with switches that plant the classic mistakes."""
    N_q, N_k, d = q.shape[0], k.shape[0], q.shape[1]
    o, lse = np.zeros((N_q, d)), np.zeros(N_q)
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
                alpha = np.exp(m - m_ref) if rescale else 1.0
                l = alpha * l + p.sum(axis=1)
                acc = (alpha[:, None] if rescale else 1.0) * acc + p @ v[cols]
                m = m_new
            o[rows] = acc / (np.where(l > 0, l, 1.0)[:, None] if guard else l[:, None])
            lse[rows] = np.where(
                l > 0, (np.where(np.isneginf(m), 0, m) if lse_max else 0) + np.log(l), -np.inf
            )
    return o, lse


def _package(q, k, v, *, causal=False, block_m, block_n):
    o, lse = tiled.forward(
        q[None, None], k[None, None], v[None, None], causal=causal, block_m=block_m, block_n=block_n
    )
    return o[0, 0], lse[0, 0]


def test_tiled_attention_accepts_the_solutions():
    assert checks.tiled_attention(_package, seed=0, out=_quiet).passed
    assert checks.tiled_attention(_tiled, seed=1, out=_quiet).passed


@pytest.mark.parametrize(
    "kw,words",
    [
        ({"rescale": False}, "rescale the accumulator o_i"),
        ({"ragged": False}, "the last block is shorter"),
        ({"offset": False}, "causal offset"),
        ({"guard": False}, "rows that see no key must give o = 0"),
        ({"lse_max": False}, "lse = m + log(l)"),
    ],
)
def test_tiled_attention_names_each_planted_bug(kw, words):
    report = checks.tiled_attention(lambda *a, **k: _tiled(*a, **k, **kw), seed=2, out=_quiet)
    assert not report.passed, kw
    assert words in report.text, report.text


def _bytes(N_q, N_k, d, bm, bn, e, *, reread=True, ceil=True, lse=True):
    blocks = -(-N_q // bm) if ceil else N_q // bm
    kv = 2 * N_k * d * e * (blocks if reread else 1)
    return 2 * N_q * d * e + kv + (4 * N_q if lse else 0)


def test_fa2_hbm_bytes_grades_solution_and_bugs():
    assert checks.fa2_hbm_bytes(_bytes, seed=0, out=_quiet).passed
    for kw, words in (
        ({"reread": False}, "read again for every query block"),
        ({"ceil": False}, "ceil(N_q / block_m)"),
        ({"lse": False}, "4 bytes of lse per row"),
    ):
        report = checks.fa2_hbm_bytes(lambda *a: _bytes(*a, **kw), seed=1, out=_quiet)
        assert not report.passed and words in report.text, (kw, report.text)


def test_stubs_report_not_attempted():
    def stub(*args, **kwargs):
        raise NotImplementedError("Exercise 3.1")

    for g in (checks.tiled_attention, checks.fa2_hbm_bytes):
        lines = []
        assert not g(stub, out=lines.append).attempted
        assert lines == [f"{g.__name__}: not attempted yet (reference: {g.solution_name})"]
