"""Chapter 09 graders: the solutions pass, and each planted bug fails with a line that names it."""

import numpy as np
import pytest

from flashedu import checks, decoding, reference, ring


def _quiet(*a, **k):
    pass


def _block_kind(
    rows,
    cols,
    N_q,
    N_k,
    causal=False,
    window_size=None,
    *,
    offset=True,
    corner="bottom-left",
    inclusive=True,
    window=True,
    full=True,
):
    """A learner's block classifier by corners, with switches for the classic mistakes."""
    (r0, r1), (c0, c1) = rows, cols
    off = N_k - N_q if offset else 0
    left, right = window_size if (window and window_size is not None) else (-1, -1)
    if causal:
        right = 0
    last_row = r1 - 1 if corner == "bottom-left" else r0
    smallest, largest = c0 - (last_row + off), (c1 - 1) - (r0 + off)
    hidden_left = left >= 0 and (largest < -left if inclusive else largest <= -left)
    if hidden_left or (right >= 0 and smallest > right):
        return "skip"
    if full and (left < 0 or smallest >= -left) and (right < 0 or largest <= right):
        return "full"
    return "partial"


def test_block_kind_accepts_a_learners_solution_and_rejects_flashedus():
    for seed in range(5):
        assert checks.block_kind(_block_kind, seed=seed, out=_quiet).passed
    report = checks.block_kind(decoding.block_kind, seed=0, out=_quiet)
    assert report.diagnosis.startswith("called flashedu.")  # where the block rules live
    assert "block_kind: the exercise asks for your own code" in report.diagnosis


@pytest.mark.parametrize(
    "bug,kw,words",
    [
        ("top-left causal", {"offset": False}, "top-left aligned"),
        ("first row's corner", {"corner": "top-left"}, "judged by its first row's diagonal"),
        ("exclusive window edge", {"inclusive": False}, "the window is inclusive"),
        ("window ignored", {"window": False}, "window_size was ignored"),
        ("never full", {"full": False}, "no block is ever reported full"),
    ],
)
def test_block_kind_names_each_planted_bug(bug, kw, words):
    for seed in range(3):
        report = checks.block_kind(
            lambda *a, **k: _block_kind(*a, **k, **kw), seed=seed, out=_quiet
        )
        assert not report.passed, bug
        assert words in report.diagnosis, report.text


def _split_state(q, k, v, *, m0=-np.inf, normalise=False):
    """One split's state, as a learner writes it, with switches that plant mistakes."""
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])  # (B, H, N_q, n)
    m = np.maximum(s.max(axis=-1, initial=-np.inf), m0)
    m_ref = np.where(np.isneginf(m), 0.0, m)
    p = np.exp(s - m_ref[..., None])
    l, o = p.sum(axis=-1), p @ v
    return m, l, (o / np.where(l > 0, l, 1)[..., None] if normalise else o)


def _combine(states, *, weighted=True, rescale=True, log_m=True):
    """The merge of every split's state, with switches that plant mistakes."""
    m = np.max([m for m, _, _ in states], axis=0)
    if not weighted:  # the plain mean of each split's output; lse right
        o = np.mean([o / l[..., None] for _, l, o in states], axis=0)
        return o, m + np.log(sum(np.exp(m_s - m) * l_s for m_s, l_s, _ in states))
    w = [np.exp(m_s - m) if rescale else np.ones_like(m) for m_s, _, _ in states]
    l = sum(w_s * l_s for w_s, (_, l_s, _) in zip(w, states))
    o = sum(w_s[..., None] * o_s for w_s, (_, _, o_s) in zip(w, states))
    return o / l[..., None], (m if log_m else 0) + np.log(l)


def _decode(split_state, seed, combine=None):
    """(report, printed text) of split_kv_decode for a split_state and a combine."""
    lines = []
    report = checks.split_kv_decode(split_state, combine, seed=seed, out=lines.append)
    return report, "\n".join(lines)


def test_split_kv_decode_accepts_a_learners_split_and_combine():
    for seed in range(3):
        report, text = _decode(_split_state, seed, _combine)
        assert report.passed, text


@pytest.mark.parametrize(
    "split_kw,combine_kw,words",
    [
        ({}, {"weighted": False}, "averaged instead of weighted"),
        ({}, {"rescale": False}, "without rescaling them to the common max"),
        ({"m0": 0.0}, {}, "the split's max started at 0"),
        ({}, {"log_m": False}, "lse is log l without the common max"),
        ({"normalise": True}, {}, "keeps o unnormalised"),
    ],
    ids=["averaged", "not rescaled", "max starts at 0", "lse without m", "o normalised"],
)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_split_kv_decode_names_each_planted_bug(split_kw, combine_kw, words):
    report, text = _decode(
        lambda q, k, v: _split_state(q, k, v, **split_kw),
        4,
        lambda states: _combine(states, **combine_kw),
    )
    assert not report.passed and words in report.diagnosis, text


def test_split_kv_decode_rejects_decoding_without_a_split():
    def unsplit(q, k, v):
        o, lse = reference.forward(q, k, v)  # no state: attention over the split, by flashedu
        return lse, np.ones_like(lse), o

    report, text = _decode(unsplit, 5, _combine)
    assert report.diagnosis.startswith("called flashedu.reference.forward"), text
    split = lambda q, k, v: decoding.partial_state(q, k, v, (0, k.shape[2]), scale=1.0)
    report, _ = _decode(split, 5, _combine)
    assert report.diagnosis.startswith("called flashedu.decoding.partial_state")


def test_split_kv_decode_sees_only_each_splits_keys():
    seen = []

    def spy(q, k, v):
        seen.append((k.shape[2], k.base is None))
        return _split_state(q, k, v)

    assert _decode(spy, 6, _combine)[0].passed
    assert (0, True) in seen and all(own for _, own in seen)  # an empty split; no view of all K


def test_split_kv_decode_asks_for_the_combine():
    report, _ = _decode(_split_state, 6)
    assert "pass your combine function too" in report.diagnosis


def _ring_bytes(
    B, H, H_kv, N_k, d, W, itemsize, *, tensors=2, heads="kv", rows="all", last_sends=False
):
    n = {"all": N_k, "shard": N_k // W, "padded": -(-N_k // W) * W}[rows]
    per_step = tensors * B * (H_kv if heads == "kv" else H) * n * d * itemsize
    return [per_step] * (W if last_sends else W - 1) + ([] if last_sends else [0])


def test_ring_bytes_accepts_a_learners_solution_and_rejects_flashedus():
    assert checks.ring_bytes(_ring_bytes, seed=0, out=_quiet).passed
    report = checks.ring_bytes(
        lambda B, H, H_kv, N, d, W, e: ring.traffic_per_step(B, H_kv, N, d, W, e),
        seed=1,
        out=_quiet,
    )
    assert report.diagnosis.startswith("called flashedu.ring.traffic_per_step")


@pytest.mark.parametrize(
    "bug,kw,words",
    [
        ("only K travels", {"tensors": 1}, "V travels too"),
        ("last step sends", {"last_sends": True}, "the last step sends too"),
        ("one shard per step", {"rows": "shard"}, "one shard was counted per step"),
        ("query heads travel", {"heads": "q"}, "only the H_kv K/V heads travel"),
        ("shards padded", {"rows": "padded"}, "together they hold exactly N_k rows"),
    ],
)
def test_ring_bytes_names_each_planted_bug(bug, kw, words):
    report = checks.ring_bytes(lambda *a: _ring_bytes(*a, **kw), seed=2, out=_quiet)
    assert not report.passed, bug
    assert words in report.diagnosis, report.text


@pytest.mark.parametrize("grader", [checks.block_kind, checks.split_kv_decode, checks.ring_bytes])
def test_stubs_report_not_attempted(grader):
    lines = []

    def stub(*a, **k):
        raise NotImplementedError("Exercise 9.x")

    report = grader(stub, out=lines.append)
    assert not report.attempted and lines == [f"{grader.__name__}: not attempted yet"]
