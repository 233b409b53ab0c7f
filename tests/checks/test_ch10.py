"""Chapter 10 graders: the solutions pass, and each planted bug fails with a line that names it."""

import pytest
import torch

from flashedu import checks, flex
from flashedu.testing import run_grader

# ------------------------------------------------------------------------------ learners' mods


def _alibi(slopes, *, sign=-1, absolute=True, per_head=True, use_slope=True):
    def mod(score, b, h, q_idx, kv_idx):
        dist = (q_idx - kv_idx).abs() if absolute else q_idx - kv_idx
        slope = (slopes[h] if per_head else slopes[0]) if use_slope else 1.0
        return score + sign * slope * dist

    return mod


def _softcap(cap, *, form="right"):
    def mod(score, b, h, q_idx, kv_idx):
        return {
            "right": lambda: cap * torch.tanh(score / cap),
            "no scale back": lambda: torch.tanh(score / cap),
            "no divide": lambda: cap * torch.tanh(score),
            "clamp": lambda: score.clamp(-cap, cap),
            "bare tanh": lambda: torch.tanh(score),
        }[form]()

    return mod


def _relative(table, D, *, reverse=False, per_head=True, clamp=True, shift=True):
    def mod(score, b, h, q_idx, kv_idx):
        rel = q_idx - kv_idx if reverse else kv_idx - q_idx
        rel = rel.clamp(-D, D) if clamp else rel
        return score + table[h if per_head else 0, rel + D if shift else rel]

    return mod


def _window(w, *, inclusive=True, causal=True, bounded=True, extra=0):
    def mod(b, h, q_idx, kv_idx):
        dist = q_idx - kv_idx
        near = (dist <= w + extra) if inclusive else (dist < w)
        keep = (dist >= 0) if causal else (dist >= -w)
        return keep & near if bounded else keep

    return mod


def _prefix(p, *, bidirectional=True, inclusive_end=False, on_queries=False, use_and=False):
    def mod(b, h, q_idx, kv_idx):
        idx = q_idx if on_queries else kv_idx
        in_prefix = (idx <= p) if inclusive_end else (idx < p)
        causal = kv_idx <= q_idx
        if not bidirectional:
            return causal
        return causal & in_prefix if use_and else causal | in_prefix

    return mod


def _document(cu, *, same_doc=True, causal=True, right=True):
    ids = torch.searchsorted(cu[1:].long(), torch.arange(int(cu[-1])), right=right)

    def mod(b, h, q_idx, kv_idx):
        keep = kv_idx <= q_idx if causal else kv_idx >= 0
        return keep & (ids[q_idx] == ids[kv_idx]) if same_doc else keep

    return mod


# ------------------------------------------------------------------------------ graders

SOLUTIONS = [  # (grader, a learner's factory, the package's, the package function's name)
    (checks.alibi_mod, _alibi, flex.alibi, "alibi"),
    (checks.softcap_mod, _softcap, flex.softcap, "softcap"),
    (
        checks.relative_bias_mod,
        _relative,
        lambda t, D: flex.relative_bias(t, max_distance=D),
        "relative_bias",
    ),
    (checks.sliding_window_mask, _window, flex.sliding_window, "sliding_window"),
    (checks.prefix_lm_mask, _prefix, flex.prefix_lm, "prefix_lm"),
    (checks.document_mask, _document, lambda cu: flex.document(cu, causal=True), "document"),
]


@pytest.mark.parametrize("grader,mine,package,name", SOLUTIONS, ids=[s[3] for s in SOLUTIONS])
def test_graders_accept_a_learners_mod_and_refuse_the_packages(grader, mine, package, name):
    for seed in range(2):
        report, text = run_grader(grader, mine, seed=seed)
        assert report.passed, text
    report, text = run_grader(grader, package, seed=0)
    assert not report.passed
    assert report.diagnosis.startswith(f"called flashedu.flex.{name}"), text


def test_the_packages_mods_equal_the_learners_on_the_grid():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(1, 3, 11, 11, dtype=torch.float64, generator=g).numpy()
    slopes, table = torch.rand(3, dtype=torch.float64), torch.randn(3, 9, dtype=torch.float64)
    for package, mine in (
        (flex.alibi(slopes), _alibi(slopes)),
        (flex.softcap(2.5), _softcap(2.5)),
        (flex.relative_bias(table, max_distance=4), _relative(table, 4)),
    ):
        assert (flex.score_array(package, scores) == flex.score_array(mine, scores)).all()
    cu = torch.tensor([0, 4, 4, 11], dtype=torch.int32)
    for package, mine in (
        (flex.sliding_window(3), _window(3)),
        (flex.prefix_lm(4), _prefix(4)),
        (flex.document(cu, causal=True), _document(cu)),
    ):
        assert (flex.mask_array(package, 1, 3, 11, 11) == flex.mask_array(mine, 1, 3, 11, 11)).all()


BUGS = [
    (checks.alibi_mod, lambda s: _alibi(s, sign=+1), "wrong sign"),
    (checks.alibi_mod, lambda s: _alibi(s, absolute=False), "no absolute value"),
    (checks.alibi_mod, lambda s: _alibi(s, per_head=False), "one slope for all heads"),
    (checks.alibi_mod, lambda s: _alibi(s, use_slope=False), "not multiplied by the head's slope"),
    (checks.softcap_mod, lambda c: _softcap(c, form="no scale back"), "not scaled back"),
    (checks.softcap_mod, lambda c: _softcap(c, form="no divide"), "not divided by cap"),
    (checks.softcap_mod, lambda c: _softcap(c, form="clamp"), "a hard clamp is not soft-capping"),
    (checks.softcap_mod, lambda c: _softcap(c, form="bare tanh"), "tanh(score) alone"),
    (checks.relative_bias_mod, lambda t, D: _relative(t, D, reverse=True), "offset reversed"),
    (checks.relative_bias_mod, lambda t, D: _relative(t, D, per_head=False), "one row for all"),
    (checks.relative_bias_mod, lambda t, D: _relative(t, D, shift=False), "offset not shifted"),
    (checks.relative_bias_mod, lambda t, D: _relative(t, D, clamp=False), "share the end entries"),
    (checks.sliding_window_mask, lambda w: _window(w, inclusive=False), "the window is inclusive"),
    (checks.sliding_window_mask, lambda w: _window(w, causal=False), "the window is causal too"),
    (checks.sliding_window_mask, lambda w: _window(w, bounded=False), "that is causal attention"),
    (checks.sliding_window_mask, lambda w: _window(w, extra=1), "one key too many"),
    (checks.prefix_lm_mask, lambda p: _prefix(p, bidirectional=False), "not bidirectional"),
    (checks.prefix_lm_mask, lambda p: _prefix(p, inclusive_end=True), "keys 0 .. prefix_len - 1"),
    (checks.prefix_lm_mask, lambda p: _prefix(p, on_queries=True), "must not see the suffix"),
    (checks.prefix_lm_mask, lambda p: _prefix(p, use_and=True), "`and` instead of `or`"),
    (checks.document_mask, lambda cu: _document(cu, same_doc=False), "see other documents"),
    (checks.document_mask, lambda cu: _document(cu, causal=False), "not causal"),
    (checks.document_mask, lambda cu: _document(cu, right=False), "document ids off by one"),
]


@pytest.mark.parametrize("grader,bug,words", BUGS, ids=[w for _, _, w in BUGS])
def test_graders_name_each_planted_bug(grader, bug, words):
    for seed in range(2):
        report, text = run_grader(grader, bug, seed=seed)
        assert not report.passed, words
        assert words in report.diagnosis, text
        assert text.count("what is wrong") == 1


def test_a_wrong_answer_without_a_known_mistake_shows_the_first_wrong_entry():
    report, text = run_grader(checks.sliding_window_mask, lambda w: _window(w, extra=3), seed=0)
    assert not report.passed and "first wrong: head 0, query" in text, text


def test_a_factory_that_returns_no_function_is_reported():
    report, text = run_grader(checks.softcap_mod, lambda cap: cap, seed=0)
    assert not report.passed and "expected a score_mod function, got float" in text, text


@pytest.mark.parametrize("grader", [s[0] for s in SOLUTIONS], ids=lambda g: g.__name__)
def test_stubs_report_not_attempted(grader):
    def stub(*args):
        raise NotImplementedError("Exercise 10.x")

    report, text = run_grader(grader, stub)
    assert not report.attempted
    assert text == f"{grader.__name__}: not attempted yet"
    lines = []
    checks.hint(grader, out=lines.append)
    assert any("_mod(" in line for line in lines), lines


def _package_inside(slopes):
    inner = flex.alibi(slopes)  # built while grading: the factory's call is refused

    def mod(score, b, h, q_idx, kv_idx):
        return inner(score, b, h, q_idx, kv_idx)

    return mod


def _package_in_mod(slopes):
    def mod(score, b, h, q_idx, kv_idx):  # the package's mod, built at every call
        return flex.alibi(slopes)(score, b, h, q_idx, kv_idx)

    return mod


@pytest.mark.parametrize("make", [flex.alibi, _package_inside, _package_in_mod])
def test_flashedus_own_mods_are_refused_by_name(make):
    report, text = run_grader(checks.alibi_mod, make, seed=0)
    assert not report.passed
    assert report.diagnosis.startswith("called flashedu.flex.alibi"), text


def test_a_wrong_report_leads_with_one_case_and_its_inputs():
    report, text = run_grader(checks.softcap_mod, lambda c: _softcap(c, form="clamp"), seed=1)
    lines = text.splitlines()
    assert lines[0].startswith("softcap_mod: wrong (") and lines[1].startswith("  case "), text
    assert "inputs: factory(" in text and "q, k, v (1, 2, " in text, text
    assert "checks.softcap_mod(your_function, seed=1)" in text, text
    assert max(len(line) for line in lines) <= 100, text
