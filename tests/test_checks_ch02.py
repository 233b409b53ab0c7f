"""Chapter 02 graders: the solutions pass, each planted bug fails with a line that names it."""

import numpy as np
import pytest

from flashedu import checks, softmax


def _quiet(*a, **k):
    pass


def _online(x, *, rescale=True, m0=-np.inf, shift=True, guard=True):
    """One pass over the columns, with switches that plant the classic mistakes."""
    m = np.full(x.shape[0], m0)
    l = np.zeros(x.shape[0])
    with np.errstate(all="ignore"):
        for j in range(x.shape[1]):
            m_new = np.maximum(m, x[:, j])
            ref = m_new if shift else 0.0
            alpha = np.exp(m - m_new) if rescale else 1.0
            if guard:
                alpha = np.where(np.isneginf(m_new), 0.0, alpha)
            term = np.exp(x[:, j] - ref)
            l = alpha * l + (np.where(np.isneginf(x[:, j]), 0.0, term) if guard else term)
            m = m_new
        m_ref = np.where(np.isneginf(m), 0.0, m) if guard else m
        p = np.exp(x - (m_ref[:, None] if shift else 0.0))
        return p / (np.where(l > 0, l, 1.0)[:, None] if guard else l[:, None])


def test_online_softmax_accepts_the_solutions():
    assert checks.online_softmax(softmax.online_softmax, seed=0, out=_quiet).passed
    assert checks.online_softmax(_online, seed=1, out=_quiet).passed


@pytest.mark.parametrize(
    "kw,words",
    [
        ({"rescale": False}, "rescale l by exp(m - m')"),
        ({"m0": 0.0}, "start the running max at -inf, not 0"),
        ({"shift": False}, "exp(1e4) overflows"),
        ({"guard": False}, "a row with no finite entry must give zeros"),
    ],
)
def test_online_softmax_names_each_planted_bug(kw, words):
    report = checks.online_softmax(lambda x: _online(x, **kw), seed=2, out=_quiet)
    assert not report.passed, kw
    assert words in report.text, report.text


def _merge(a, b, *, rescale_o=True, guard=True, shift=True):
    (m_a, l_a, o_a), (m_b, l_b, o_b) = a, b
    m = np.maximum(m_a, m_b)
    ref = (np.where(np.isneginf(m), 0.0, m) if guard else m) if shift else 0.0
    with np.errstate(all="ignore"):
        alpha, beta = np.exp(m_a - ref), np.exp(m_b - ref)
        l = alpha * l_a + beta * l_b if shift else np.exp(m_a) * l_a + np.exp(m_b) * l_b
        o = alpha[:, None] * o_a + beta[:, None] * o_b if rescale_o else o_a + o_b
    return m, l, o


def test_merge_states_accepts_the_solutions():
    assert checks.merge_states(softmax.merge, seed=0, out=_quiet).passed
    assert checks.merge_states(_merge, seed=1, out=_quiet).passed


@pytest.mark.parametrize(
    "kw,words",
    [
        ({"rescale_o": False}, "rescale BOTH l and o"),
        ({"guard": False}, "guard exp(-inf - (-inf)) = NaN"),
        ({"shift": False}, "exp(m_a) alone overflows"),
    ],
)
def test_merge_states_names_each_planted_bug(kw, words):
    report = checks.merge_states(lambda a, b: _merge(a, b, **kw), seed=3, out=_quiet)
    assert not report.passed, kw
    assert words in report.text, report.text


def test_stubs_report_not_attempted():
    def stub(*args):
        raise NotImplementedError("Exercise 2.1")

    for g, ref in (
        (checks.online_softmax, "flashedu.softmax.online_softmax"),
        (checks.merge_states, "flashedu.softmax.merge"),
    ):
        lines = []
        report = g(stub, out=lines.append)
        assert not report.attempted and lines == [
            f"{g.__name__}: not attempted yet (reference: {ref})"
        ]


def test_graders_draw_fresh_inputs_unless_seeded():
    a, b, c = [], [], []
    checks.online_softmax(softmax.online_softmax, seed=5, out=a.append)
    checks.online_softmax(softmax.online_softmax, seed=5, out=b.append)
    checks.online_softmax(softmax.online_softmax, out=c.append)
    assert a == b
    assert "all cases pass" in c[-1]
