"""Chapter 02, exercise 2.1 (the online softmax over a one-pass stream): shortcuts a learner in a
hurry writes, each rejected with the diagnosis that names it, beside honest one-pass solutions
(per block, per column, in torch, as a running log-sum) that are accepted."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from flashedu import checks
from flashedu.testing import run_grader


def _per_block(blocks):
    m, l = np.full(blocks.shape[0], -np.inf), np.zeros(blocks.shape[0])
    for b in blocks:
        m_new = np.maximum(m, b.max(axis=1))
        ref = np.where(np.isneginf(m_new), 0.0, m_new)
        l = np.exp(m - ref) * l + np.exp(b - ref[:, None]).sum(axis=1)
        m = m_new
    return m, l


def _per_column(blocks):
    """Honest: one column at a time inside each block."""
    m, l = np.full(blocks.shape[0], -np.inf), np.zeros(blocks.shape[0])
    for b in blocks:
        for j in range(b.shape[1]):
            x = b[:, j]
            m_new = np.maximum(m, x)
            ref = np.where(np.isneginf(m_new), 0.0, m_new)
            l = np.exp(m - ref) * l + np.exp(x - ref)
            m = m_new
    return m, l


def _torch_log_sum(blocks):
    """Honest: a running log-sum-exp in torch, block by block; m and l read off at the end...
    of the max kept alongside."""
    m = torch.full((blocks.shape[0],), -torch.inf, dtype=torch.float64)
    log_l = torch.full_like(m, -torch.inf)
    for b in blocks:
        t = torch.from_numpy(np.ascontiguousarray(b))
        m = torch.maximum(m, t.amax(dim=1))
        log_l = torch.logaddexp(log_l, torch.logsumexp(t, dim=1))
    ref = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    l = torch.exp(log_l - ref)
    return m.numpy(), torch.where(torch.isinf(m), torch.zeros_like(l), l).numpy()


@pytest.mark.parametrize("fn", [_per_block, _per_column, _torch_log_sum],
                         ids=["per block", "per column", "torch log-sum"])  # fmt: skip
def test_honest_one_pass_solutions_are_accepted(fn):
    with np.errstate(all="ignore"):
        report, text = run_grader(checks.online_softmax, fn, seed=11)
    assert report.passed, text


# ---------------------------------------------------------------------------- shortcuts


def _tee(blocks):
    """Two passes through itertools.tee: the first for the max, the second for the sum."""
    first, second = itertools.tee(blocks)
    m = np.max([b.max(axis=1) for b in first], axis=0)
    return m, sum(np.exp(b - m[:, None]).sum(axis=1) for b in second)


def _copies_in_a_list(blocks):
    """Keeps a private copy of every block, then a two-pass softmax over the copies."""
    kept = [np.array(b) for b in blocks]
    m = np.full(blocks.shape[0], -np.inf)
    for b in kept:
        m = np.maximum(m, b.max(axis=1))
    ref = np.where(np.isneginf(m), 0.0, m)
    return m, sum(np.exp(b - ref[:, None]).sum(axis=1) for b in kept)


def _torch_row(blocks):
    """The whole row rebuilt as a torch tensor, then torch's own two-pass softmax."""
    x = torch.cat([torch.tensor(np.array(b)) for b in blocks], dim=1)
    m = x.amax(dim=1)
    ref = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    return m.numpy(), torch.exp(x - ref[:, None]).sum(dim=1).numpy()


def _memmap_row(blocks, tmp=[]):
    """The row written to a memory-mapped file block by block, then read back whole."""
    import tempfile

    tmp.append(tempfile.NamedTemporaryFile(suffix=".dat"))
    x = np.memmap(tmp[-1].name, dtype=np.float64, mode="w+", shape=blocks.shape)
    c0 = 0
    for b in blocks:
        x[:, c0 : c0 + b.shape[1]] = b
        c0 += b.shape[1]
    m = x.max(axis=1)
    ref = np.where(np.isneginf(m), 0.0, m)
    return np.asarray(m), np.asarray(np.exp(x - ref[:, None]).sum(axis=1))


_SEEN: list = []


def _module_level(blocks):
    """Blocks stashed in a module-level list, then a second pass over the stash (a copy made
    with .copy() still belongs to its block)."""
    _SEEN.clear()
    for b in blocks:
        _SEEN.append(b.copy())
    m = np.max([b.max(axis=1) for b in _SEEN], axis=0)
    ref = np.where(np.isneginf(m), 0.0, m)
    return m, sum(np.exp(b - ref[:, None]).sum(axis=1) for b in _SEEN)


def _private_copy(blocks):
    """Reads the stream's own copy of the whole row out of its internals."""
    cells = [c.cell_contents for c in blocks._cut.__closure__]
    x = next(c for c in cells if isinstance(c, np.ndarray))
    m = x.max(axis=1)
    return m, np.exp(x - m[:, None]).sum(axis=1)


@pytest.mark.parametrize(
    "fn,words",
    [
        (_tee, "read the row twice (used block 0 again after moving past it)"),
        (_copies_in_a_list, "held 1,0"),
        (_torch_row, "built a 64x4096 array"),
        (_memmap_row, "built a 64x4096 array"),
        (_module_level, "read the row twice (used block 0 again after moving past it)"),
        (_private_copy, "read the row twice (used the stream's private copy of the whole row)"),
    ],
    ids=["itertools.tee", "copies in a list", "torch row", "memmap", "module-level", "internals"],
)
def test_each_shortcut_is_rejected_by_name(fn, words):
    with np.errstate(all="ignore"):
        report, text = run_grader(checks.online_softmax, fn, seed=12)
    assert not report.passed and report.diagnosis.startswith(words), text
    assert "exp(m - m_new)" not in text  # the formula waits for checks.hint


def test_the_stream_keeps_no_attribute_holding_the_row():
    from flashedu.checks._watch import OnePass

    x = np.arange(12.0).reshape(3, 4)
    stream = OnePass(x, 2)
    held = [v for v in vars(stream).values() if isinstance(v, np.ndarray)]
    assert held == [] and not hasattr(stream, "_x")
