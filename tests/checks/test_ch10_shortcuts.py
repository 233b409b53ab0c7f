"""Chapter 10 graders against mods that give the right numbers by the wrong method.

A score_mod or mask_mod is a function of (q_idx, kv_idx), called once per pair. The shortcut of a
learner in a hurry is a table: the whole N x N mask or bias built once (in the factory, in a global
before it, or lazily at the mod's first call) and indexed by the mod. Each grader runs a case of
thousands of tokens where any such table is far over its limit of 16 N elements, and names the
table. Honest mods written other ways (document ids by searchsorted at each call, torch.where) are
accepted. Also here: the causes the graders name for errors that are not tables (a Python `if` on
a tensor, slopes indexed by the batch, documents taken to be equally long, a hidden diagonal).
"""

import numpy as np
import pytest
import torch

from flashedu import checks
from flashedu.testing import run_grader

SEEDS = [0, 1]
MAXN = 2048  # a fixed-size table: covers the short cases, not the long one

# --------------------------------------------------------------------------------- honest mods


def alibi(slopes):
    def mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    return mod


def relative(table, D):
    def mod(score, b, h, q_idx, kv_idx):
        return score + table[h, (kv_idx - q_idx).clamp(-D, D) + D]

    return mod


def window_where(w):
    def mod(b, h, q_idx, kv_idx):
        d = q_idx - kv_idx
        return torch.where(d < 0, torch.zeros_like(d, dtype=torch.bool), d <= w)

    return mod


def prefix(p):
    def mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < p)

    return mod


def document_ids(cu):
    ids = torch.repeat_interleave(torch.arange(len(cu) - 1), cu.diff())

    def mod(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (kv_idx <= q_idx)

    return mod


def document_searchsorted(cu):
    """Another honest way: look each token's document up in cu_seqlens at every call."""
    ends = cu[1:].long().contiguous()

    def mod(b, h, q_idx, kv_idx):
        dq = torch.searchsorted(ends, q_idx.contiguous(), right=True)
        dk = torch.searchsorted(ends, kv_idx.contiguous(), right=True)
        return (dq == dk) & (kv_idx <= q_idx)

    return mod


HONEST = [
    (checks.alibi_mod, alibi),
    (checks.relative_bias_mod, relative),
    (checks.sliding_window_mask, window_where),
    (checks.prefix_lm_mask, prefix),
    (checks.document_mask, document_ids),
    (checks.document_mask, document_searchsorted),
]


@pytest.mark.parametrize("grader,mine", HONEST, ids=[m.__name__ for _, m in HONEST])
def test_honest_mods_pass_every_case_the_long_one_too(grader, mine):
    for seed in SEEDS:
        report, text = run_grader(grader, mine, seed)
        assert report.passed, text
        long = [detail for label, _, detail in report.results if "single (query, key)" in label]
        assert long and "no table" in long[0], text


# ------------------------------------------------------------------------------------- tables


def document_table(cu):
    """Shortcut: the whole N x N document mask, built in the factory."""
    N = int(cu[-1])
    ids = torch.repeat_interleave(torch.arange(len(cu) - 1), cu.diff())
    pos = torch.arange(N)
    table = (ids[:, None] == ids[None, :]) & (pos[None, :] <= pos[:, None])

    def mod(b, h, q_idx, kv_idx):
        return table[q_idx, kv_idx]

    return mod


def document_numpy_table(cu):
    """Shortcut: the same table in NumPy, turned into a tensor."""
    c = np.asarray(cu)
    ids = np.repeat(np.arange(len(c) - 1), np.diff(c))
    table = torch.from_numpy((ids[:, None] == ids[None, :]) & np.tri(len(ids), dtype=bool))

    def mod(b, h, q_idx, kv_idx):
        return table[q_idx, kv_idx]

    return mod


def document_table_per_call(cu):
    """Shortcut: the table rebuilt inside every call of the mod."""
    ids = torch.repeat_interleave(torch.arange(len(cu) - 1), cu.diff())

    def mod(b, h, q_idx, kv_idx):
        same = ids[:, None] == ids[None, :]
        return (same & torch.ones_like(same).tril())[q_idx, kv_idx]

    return mod


WINDOW_TABLE = None


def window_global(w):
    """Shortcut: a fixed-size table made once, kept in a global."""
    global WINDOW_TABLE
    i = torch.arange(MAXN)
    WINDOW_TABLE = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] <= w)

    def mod(b, h, q_idx, kv_idx):
        return WINDOW_TABLE[q_idx, kv_idx]

    return mod


def prefix_lazy(p):
    """Shortcut: a table made at the mod's first call, cached in the closure."""
    cache = {}

    def mod(b, h, q_idx, kv_idx):
        if "t" not in cache:
            i = torch.arange(MAXN)
            cache["t"] = (i[None, :] <= i[:, None]) | (i[None, :] < p)
        return cache["t"][q_idx, kv_idx]

    return mod


def alibi_default_arg(slopes):
    """Shortcut: a table of distances handed to the mod as a default argument."""
    i = torch.arange(MAXN)
    dist = (i[:, None] - i[None, :]).abs()

    def mod(score, b, h, q_idx, kv_idx, dist=dist):
        return score - slopes[h] * dist[q_idx, kv_idx]

    return mod


def relative_expanded(table, D):
    """Shortcut: the bias table expanded to (H, MAXN, MAXN) once."""
    i = torch.arange(1024)
    full = table[:, (i[None, :] - i[:, None]).clamp(-D, D) + D]

    def mod(score, b, h, q_idx, kv_idx):
        return score + full[h, q_idx, kv_idx]

    return mod


TABLES = [
    (checks.document_mask, document_table, "the factory built a "),
    (checks.document_mask, document_numpy_table, "the factory "),
    (checks.document_mask, document_table_per_call, "one call of the mod built a "),
    (checks.sliding_window_mask, window_global, "the factory built a 2048x2048 table"),
    (checks.prefix_lm_mask, prefix_lazy, "one call of the mod built a 2048x2048 table"),
    (checks.alibi_mod, alibi_default_arg, "the factory built a 2048x2048 table"),
    (checks.relative_bias_mod, relative_expanded, "the factory built a 3x1024x1024 table"),
]


@pytest.mark.parametrize("grader,shortcut,words", TABLES, ids=[s.__name__ for _, s, _ in TABLES])
def test_a_table_of_the_whole_sequence_is_rejected_and_named(grader, shortcut, words):
    report, text = run_grader(grader, shortcut, seed=0)
    assert not report.passed
    assert report.diagnosis.startswith(words), text
    assert "exists to avoid" in report.diagnosis, text


def test_a_table_made_before_the_factory_is_found_where_the_mod_reads_it():
    i = torch.arange(MAXN)
    made_before = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] <= 3)

    def window(w):
        def mod(b, h, q_idx, kv_idx):
            return (
                made_before[q_idx, kv_idx] if w == 3 else (q_idx >= kv_idx) & (q_idx - kv_idx <= w)
            )

        return mod

    report, text = run_grader(checks.sliding_window_mask, window, seed=0)
    assert not report.passed
    assert report.diagnosis.startswith("the mod reads a 2048x2048 table (made_before)"), text


# ------------------------------------------------------------------------ named causes of errors


def document_python_if(cu):
    ids = torch.repeat_interleave(torch.arange(len(cu) - 1), cu.diff())

    def mod(b, h, q_idx, kv_idx):
        if ids[q_idx] == ids[kv_idx]:
            return kv_idx <= q_idx
        return kv_idx < 0

    return mod


def alibi_item(slopes):
    def mod(score, b, h, q_idx, kv_idx):
        return score - float(slopes[h]) * (q_idx - kv_idx).abs()

    return mod


def alibi_by_batch(slopes):
    def mod(score, b, h, q_idx, kv_idx):
        return score - slopes[b] * (q_idx - kv_idx).abs()

    return mod


def document_equal_lengths(cu):
    first = max(int(cu[1]), 1)

    def mod(b, h, q_idx, kv_idx):
        return (q_idx // first == kv_idx // first) & (kv_idx <= q_idx)

    return mod


def document_no_diagonal(cu):
    ids = torch.repeat_interleave(torch.arange(len(cu) - 1), cu.diff())

    def mod(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (kv_idx < q_idx)

    return mod


CAUSES = [
    (checks.document_mask, document_python_if, "a Python `if`, float() or .item() on a tensor"),
    (checks.alibi_mod, alibi_item, "a Python `if`, float() or .item() on a tensor"),
    (checks.alibi_mod, alibi_by_batch, "the slopes were indexed by the batch b"),
    (checks.document_mask, document_equal_lengths, "the documents were taken to be equally long"),
    (checks.document_mask, document_no_diagonal, "the diagonal was hidden"),
]


@pytest.mark.parametrize("grader,bug,words", CAUSES, ids=[b.__name__ for _, b, _ in CAUSES])
def test_errors_and_slips_are_named_by_their_cause(grader, bug, words):
    for seed in SEEDS:
        report, text = run_grader(grader, bug, seed)
        assert not report.passed
        assert words in report.diagnosis, text
