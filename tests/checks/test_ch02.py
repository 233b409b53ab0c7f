"""Chapter 02 graders: a learner's solutions pass, each planted bug is named, and each shortcut
(a second pass, kept blocks, flashedu's own softmax) is rejected by name."""

import types

import numpy as np
import pytest

from flashedu import checks, softmax
from flashedu.checks import ch02
from flashedu.testing import run_grader


def _online(blocks, *, rescale=True, m0=-np.inf, shift=True, guard=True, per_column=False):
    """One pass over the blocks, as a learner writes it, with switches that plant mistakes."""
    m, l = np.full(blocks.shape[0], m0), np.zeros(blocks.shape[0])
    with np.errstate(all="ignore"):
        for b in blocks:
            for c in [b[:, j : j + 1] for j in range(b.shape[1])] if per_column else [b]:
                m_new = np.maximum(m, c.max(axis=1))
                ref = np.where(np.isneginf(m_new), 0.0, m_new) if guard else m_new
                ref = ref if shift else np.zeros_like(ref)
                alpha = np.exp(m - ref) if (rescale and shift) else 1.0
                l = alpha * l + np.exp(c - ref[:, None]).sum(axis=1)
                m = m_new
    return m, l


def test_online_softmax_accepts_a_learners_pass_and_refuses_a_clone_of_the_solution():
    assert run_grader(checks.online_softmax, _online, seed=0)[0].passed
    clone = types.FunctionType(ch02.online_stats.__code__, ch02.online_stats.__globals__)
    report, text = run_grader(checks.online_softmax, clone, seed=1)
    assert not report.passed and "flashedu" in text


@pytest.mark.parametrize(
    "kw,words",
    [
        ({"rescale": False}, "l was not rescaled when the running max grew"),
        ({"m0": 0.0}, "the running max started at 0 instead of -inf"),
        ({"shift": False}, "exp was taken of the raw scores"),
        ({"guard": False}, "a row of -inf gives NaN"),
    ],
)
def test_online_softmax_names_each_planted_bug(kw, words):
    report, text = run_grader(checks.online_softmax, lambda b: _online(b, **kw), seed=2)
    assert not report.passed and words in report.diagnosis, text
    assert text.count("what is wrong") == 1


def test_a_missing_rescale_is_named_when_the_loop_runs_column_by_column():
    report, _ = run_grader(
        checks.online_softmax, lambda b: _online(b, rescale=False, per_column=True), seed=3
    )
    assert "l was not rescaled" in report.diagnosis


def _two_passes(blocks):
    m = np.max([b.max(axis=1) for b in blocks], axis=0)
    return m, sum(np.exp(b - m[:, None]).sum(axis=1) for b in blocks)


def _kept(blocks):
    x = np.concatenate(list(blocks), axis=1)
    m = x.max(axis=1)
    return m, np.exp(x - m[:, None]).sum(axis=1)


def _copied(blocks):
    x = np.concatenate([np.array(b) for b in blocks], axis=1)  # copies survive the stream
    m = x.max(axis=1)
    return m, np.exp(x - m[:, None]).sum(axis=1)


def _package(blocks):
    return softmax.online_stats(np.concatenate([np.array(b) for b in blocks], axis=1))


@pytest.mark.parametrize(
    "fn,words",
    [
        (_two_passes, "read the row twice (walked the blocks a second time)"),
        (_kept, "read the row twice (used block 0 again"),
        (_copied, "built a 64x4096 array"),
        (_package, "called flashedu.softmax.online_stats"),
    ],
    ids=["second walk", "blocks kept", "copies kept", "flashedu's softmax"],
)
def test_online_softmax_rejects_every_shortcut_by_name(fn, words):
    report, text = run_grader(checks.online_softmax, fn, seed=4)
    assert not report.passed and report.diagnosis.startswith(words), text


def _merge(a, b, *, rescale_o=True, guard=True, shift=True):
    (m_a, l_a, o_a), (m_b, l_b, o_b) = a, b
    m = np.maximum(m_a, m_b)
    ref = (np.where(np.isneginf(m), 0.0, m) if guard else m) if shift else 0.0
    with np.errstate(all="ignore"):
        alpha, beta = np.exp(m_a - ref), np.exp(m_b - ref)
        l = alpha * l_a + beta * l_b
        o = alpha[:, None] * o_a + beta[:, None] * o_b if rescale_o else o_a + o_b
    return m, l, o


def test_merge_states_accepts_a_learners_merge():
    assert run_grader(checks.merge_states, _merge, seed=0)[0].passed
    assert run_grader(checks.merge_states, _merge, seed=1)[0].passed


@pytest.mark.parametrize(
    "kw,words",
    [
        ({"rescale_o": False}, "o was added without rescaling"),
        ({"guard": False}, "two fully masked sides give NaN"),
        ({"shift": False}, "not taken relative to the new max"),
    ],
)
def test_merge_states_names_each_planted_bug(kw, words):
    report, text = run_grader(checks.merge_states, lambda a, b: _merge(a, b, **kw), seed=3)
    assert not report.passed and words in report.diagnosis, text


def test_merge_states_rejects_flashedus_merge():
    report, _ = run_grader(checks.merge_states, softmax.merge, seed=3)
    assert report.diagnosis.startswith("called flashedu.softmax.merge")


def test_stubs_report_not_attempted_and_the_formula_comes_on_request():
    def stub(*args):
        raise NotImplementedError("Exercise 2.1")

    for g in (checks.online_softmax, checks.merge_states):
        report, text = run_grader(g, stub)
        assert not report.attempted and text == f"{g.__name__}: not attempted yet"
        lines = []
        checks.hint(g, out=lines.append)
        assert any("exp(" in line for line in lines)


def test_graders_draw_fresh_inputs_unless_seeded():
    a = run_grader(checks.online_softmax, _online, seed=5)[1]
    b = run_grader(checks.online_softmax, _online, seed=5)[1]
    c = run_grader(checks.online_softmax, _online, seed=None)[1]
    assert a == b and "all cases pass" in c
