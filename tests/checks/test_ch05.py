"""Chapter 05 graders: a learner's autograd Function over their own PyTorch tiled loops passes,
each planted bug is named once, and every shortcut (flashedu.attention, torch_tiled, a stored P,
the full score matrix) is rejected by name."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from flashedu import api, autograd, checks, gpt, torch_tiled
from flashedu.testing import run_grader

_SPEC = importlib.util.spec_from_file_location(
    "learner_torch_tiled", Path(__file__).parents[1] / "fixtures" / "learner_torch_tiled.py"
)
learner = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(learner)


def test_autograd_function_accepts_a_learners_own_loops():
    report, text = run_grader(checks.check_autograd_function, learner.function(), seed=0)
    assert report.passed, text


@pytest.mark.parametrize(
    "bug,words",
    [
        (dict(rescale=False), "alpha rescale is missing"),
        (dict(offset=False), "top-left aligned"),
        (dict(backward_causal=False), "backward ignores causal"),
        (dict(lse="m + l"), "lse is m + l instead of m + log l"),
        (dict(guard=False), "give NaN"),
        (dict(swap_kv=True), "dk and dv are swapped"),
        (dict(drop_none=True), "one gradient per forward input"),
    ],
    ids=[
        "no rescale",
        "top-left",
        "backward not causal",
        "lse = m + l",
        "NaN rows",
        "swapped",
        "no None",
    ],
)
def test_autograd_function_names_each_planted_bug_once(bug, words):
    report, text = run_grader(checks.check_autograd_function, learner.function(**bug), seed=2)
    assert not report.passed and words in report.diagnosis, text
    assert text.count("what is wrong") == 1


def _plain(q, k, v, causal, block_m, block_n):
    return torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1) @ v


class _WrapsPackage(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, block_m, block_n):
        o, lse = torch_tiled.forward(q, k, v, causal=causal)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal = causal
        return o

    @staticmethod
    def backward(ctx, do):
        return (*torch_tiled.backward(do, *ctx.saved_tensors, causal=ctx.causal), None, None, None)


@pytest.mark.parametrize(
    "fn,words",
    [
        (lambda q, k, v, c, *b: api.attention(q, k, v, causal=c), "called flashedu.api.attention"),
        (_WrapsPackage.apply, "called flashedu.torch_tiled.forward"),
        (
            lambda q, k, v, c, *b: autograd.flash_attention(q, k, v, causal=c),
            "called flashedu.autograd",
        ),
        (learner.function(save_p=True), "saved a 1x2x5x7 tensor for backward"),
        (_plain, "plain torch autograd recorded your loop and saved a 1x2x5x7 tensor for backward"),
    ],
    ids=["flashedu.attention", "torch_tiled", "flashedu.autograd", "stores P", "plain torch"],
)
def test_autograd_function_rejects_every_shortcut_by_name(fn, words):
    report, text = run_grader(checks.check_autograd_function, fn, seed=3)
    assert not report.passed and report.diagnosis.startswith(words), text


def test_a_full_score_matrix_made_on_the_way_is_named():
    report, text = run_grader(checks.check_autograd_function, _one_tile, seed=4)
    assert report.diagnosis.startswith("built a 1x1x128x128 array"), text


class _OneTile(torch.autograd.Function):
    """The learner's loops with one tile as big as the whole matrix: right numbers, O(N^2)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, block_m, block_n):
        o, lse = learner.forward(q, k, v, causal, 1024, 1024)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal = causal
        return o

    @staticmethod
    def backward(ctx, do):
        grads = learner.backward(do, *ctx.saved_tensors, ctx.causal, 1024, 1024)
        return (*grads, None, None, None)


_one_tile = _OneTile.apply


def _truncate_only(q, k, v):
    L = q.shape[-2]
    return api.attention(q, k[..., :L, :], v[..., :L, :], causal=True)


@pytest.mark.parametrize(
    "bug,words",
    [
        (lambda q, k, v: api.attention(q, k, v, causal=True), "bottom-right causal as it is"),
        (_truncate_only, "the queries must be split too"),
        (lambda q, k, v: api.attention(q, k, v), "no causal mask at all"),
    ],
    ids=["bottom-right", "no split for L > S", "not causal"],
)
def test_top_left_causal_names_each_planted_bug(bug, words):
    assert run_grader(checks.check_top_left_causal, api.top_left_causal, seed=0)[0].diagnosis
    report, text = run_grader(checks.check_top_left_causal, bug, seed=4)
    assert not report.passed and words in report.diagnosis, text


def test_top_left_causal_allows_flashedu_attention_only():
    def solution(q, k, v):
        L, S = q.shape[-2], k.shape[-2]
        if L <= S:
            return api.attention(q, k[..., :L, :], v[..., :L, :], causal=True)
        head = api.attention(q[..., :S, :], k, v, causal=True)
        return torch.cat([head, api.attention(q[..., S:, :], k, v)], dim=-2)

    assert run_grader(checks.check_top_left_causal, solution, seed=0)[0].passed
    report, _ = run_grader(checks.check_top_left_causal, api.top_left_causal, seed=0)
    assert report.diagnosis.startswith("called flashedu.api.top_left_causal")


@pytest.mark.parametrize(
    "bug,words",
    [
        (lambda x, H: x.view(x.shape[0], H, x.shape[1], -1), "takes heads from positions"),
        (lambda x, H: x.view(*x.shape[:2], H, -1), "heads must come before time"),
        (lambda x, H: x.view(*x.shape[:2], -1, H).permute(0, 3, 1, 2), "interleaved"),
    ],
    ids=["view(B, H, T, hs)", "no transpose", "interleaved"],
)
def test_split_heads_names_each_planted_bug(bug, words):
    def solution(x, n_head):
        B, T, C = x.shape
        return x.view(B, T, n_head, C // n_head).transpose(1, 2)

    assert run_grader(checks.check_split_heads, solution, seed=0)[0].passed
    report, text = run_grader(checks.check_split_heads, bug, seed=5)
    assert not report.passed and words in report.diagnosis, text
    assert run_grader(checks.check_split_heads, gpt.split_heads, seed=0)[0].diagnosis.startswith(
        "called flashedu.gpt.split_heads"
    )


@pytest.mark.parametrize(
    "grader",
    [checks.check_autograd_function, checks.check_top_left_causal, checks.check_split_heads],
)
def test_stubs_report_not_attempted(grader):
    def stub(*args):
        raise NotImplementedError("Exercise 5.x: fill me in")

    report, text = run_grader(grader, stub)
    assert not report.attempted and text == f"{grader.__name__}: not attempted yet"
