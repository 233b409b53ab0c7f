"""Chapter 09 graders: the solutions pass, and each planted bug fails with a line that names it."""

import numpy as np
import pytest

from flashedu import checks, decoding, ring


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


def test_block_kind_accepts_the_solutions():
    for seed in range(5):
        assert checks.block_kind(decoding.block_kind, seed=seed, out=_quiet).passed
        assert checks.block_kind(_block_kind, seed=seed, out=_quiet).passed


@pytest.mark.parametrize(
    "bug,kw,words",
    [
        ("top-left causal", {"offset": False}, "bottom-right alignment"),
        ("first row's corner", {"corner": "top-left"}, "LAST row's diagonal"),
        ("exclusive window edge", {"inclusive": False}, "the window is inclusive"),
        ("window ignored", {"window": False}, "keys more than `left` before the diagonal"),
        ("never full", {"full": False}, "every key is visible: full"),
    ],
)
def test_block_kind_names_each_planted_bug(bug, kw, words):
    for seed in range(3):
        report = checks.block_kind(
            lambda *a, **k: _block_kind(*a, **k, **kw), seed=seed, out=_quiet
        )
        assert not report.passed, bug
        assert words in report.text, report.text


def _decode(
    q, k, v, num_splits, *, weighted=True, rescale=True, m0=-np.inf, log_m=True, skip_empty=True
):
    """A learner's split-KV decoding: per-split (m, l, o), then the merge; switches plant the
    mistakes."""
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])  # (B, H, N_q, N_k)
    size = -(-k.shape[2] // num_splits)
    chunks = (
        [(c, c + size) for c in range(0, k.shape[2], size)]
        if skip_empty
        else [
            (c[0], c[-1] + 1) if len(c) else (0, 0)
            for c in np.array_split(np.arange(k.shape[2]), num_splits)
        ]
    )
    states = []
    for c0, c1 in chunks:
        m = np.maximum(s[..., c0:c1].max(axis=-1), m0)  # an empty chunk raises here
        p = np.exp(s[..., c0:c1] - m[..., None])
        states.append((m, p.sum(axis=-1), p @ v[:, :, c0:c1]))
    if not weighted:
        return np.mean([o / l[..., None] for _, l, o in states], axis=0), np.log(
            sum(l for _, l, _ in states)
        )
    m = np.max([m for m, _, _ in states], axis=0)
    w = [np.exp(m_s - m) if rescale else np.ones_like(m) for m_s, _, _ in states]
    l = sum(w_s * l_s for w_s, (_, l_s, _) in zip(w, states))
    o = sum(w_s[..., None] * o_s for w_s, (_, _, o_s) in zip(w, states))
    return o / l[..., None], (m if log_m else 0) + np.log(l)


def test_split_kv_decode_accepts_the_solutions():
    for seed in range(3):
        assert checks.split_kv_decode(
            lambda q, k, v, n: decoding.forward(q, k, v, num_splits=n), seed=seed, out=_quiet
        ).passed
        assert checks.split_kv_decode(_decode, seed=seed, out=_quiet).passed


@pytest.mark.parametrize(
    "bug,kw,words",
    [
        ("outputs averaged", {"weighted": False}, "weighted, not averaged"),
        ("l not rescaled", {"rescale": False}, "rescale each split's l and o"),
        ("max starts at 0", {"m0": 0.0}, "start the running max at -inf, not 0"),
        ("lse without m", {"log_m": False}, "lse must be m + log(l)"),
        ("empty splits", {"skip_empty": False}, "a split with no keys contributes nothing"),
    ],
)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_split_kv_decode_names_each_planted_bug(bug, kw, words):
    report = checks.split_kv_decode(
        lambda q, k, v, n: _decode(q, k, v, n, **kw), seed=4, out=_quiet
    )
    assert not report.passed, bug
    assert words in report.text, report.text


def _ring_bytes(
    B, H, H_kv, N_k, d, W, itemsize, *, tensors=2, heads="kv", rows="all", last_sends=False
):
    n = {"all": N_k, "shard": N_k // W, "padded": -(-N_k // W) * W}[rows]
    per_step = tensors * B * (H_kv if heads == "kv" else H) * n * d * itemsize
    return [per_step] * (W if last_sends else W - 1) + ([] if last_sends else [0])


def test_ring_bytes_accepts_the_solutions():
    assert checks.ring_bytes(_ring_bytes, seed=0, out=_quiet).passed
    assert checks.ring_bytes(
        lambda B, H, H_kv, N, d, W, e: ring.traffic_per_step(B, H_kv, N, d, W, e),
        seed=1,
        out=_quiet,
    ).passed


@pytest.mark.parametrize(
    "bug,kw,words",
    [
        ("only K travels", {"tensors": 1}, "both K and V travel"),
        ("last step sends", {"last_sends": True}, "W - 1 hops"),
        ("one shard per step", {"rows": "shard"}, "all N_k rows cross the ring"),
        ("query heads travel", {"heads": "q"}, "only the H_kv K/V heads travel"),
        ("shards padded", {"rows": "padded"}, "together they still hold all N_k rows"),
    ],
)
def test_ring_bytes_names_each_planted_bug(bug, kw, words):
    report = checks.ring_bytes(lambda *a: _ring_bytes(*a, **kw), seed=2, out=_quiet)
    assert not report.passed, bug
    assert words in report.text, report.text


@pytest.mark.parametrize("grader", [checks.block_kind, checks.split_kv_decode, checks.ring_bytes])
def test_stubs_report_not_attempted(grader):
    lines = []

    def stub(*a, **k):
        raise NotImplementedError("Exercise 9.x")

    report = grader(stub, out=lines.append)
    assert not report.attempted and lines == [
        f"{grader.__name__}: not attempted yet (reference: {grader.solution_name})"
    ]
