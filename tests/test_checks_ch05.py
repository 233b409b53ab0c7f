"""Chapter 05 graders: the solutions pass, each planted bug fails with a line that names it, stubs
are reported as not attempted."""

from __future__ import annotations

import pytest
import torch

from flashedu import api, autograd, checks, gpt, torch_tiled


def _quiet(*a, **k):
    pass


def _function(save_p=False, backward_causal=True, swap_kv=False, drop_none=False):
    """A torch.autograd.Function around torch_tiled, with optional planted bugs; returns its
    apply."""

    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, causal):
            o, lse = torch_tiled.forward(q, k, v, causal=causal)
            saved = (q, k, v, o, lse)
            if save_p:
                saved += (torch.exp(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 - lse[..., None]),)
            ctx.save_for_backward(*saved)
            ctx.causal = causal
            return o

        @staticmethod
        def backward(ctx, do):
            q, k, v, o, lse = ctx.saved_tensors[:5]
            causal = ctx.causal if backward_causal else False
            dq, dk, dv = torch_tiled.backward(do, q, k, v, o, lse, causal=causal)
            if swap_kv:
                dk, dv = dv, dk
            return (dq, dk, dv) if drop_none else (dq, dk, dv, None)

    return Attention.apply


def test_autograd_function_accepts_the_solution_and_the_package():
    assert checks.check_autograd_function(_function(), seed=0, out=_quiet).passed
    package = lambda q, k, v, causal: autograd.flash_attention(q, k, v, causal=causal)  # noqa: E731
    assert checks.check_autograd_function(package, seed=1, out=_quiet).passed


@pytest.mark.parametrize(
    "bug,words",
    [
        (dict(save_p=True), "saved a tensor of shape"),
        (dict(backward_causal=False), "pass it to backward too"),
        (dict(swap_kv=True), "dk and dv are swapped"),
        (dict(drop_none=True), "incorrect number of gradients"),
    ],
    ids=["stores P", "forgets causal in backward", "swaps dk and dv", "no None for causal"],
)
def test_autograd_function_names_each_planted_bug(bug, words):
    report = checks.check_autograd_function(_function(**bug), seed=2, out=_quiet)
    assert not report.passed
    assert words in report.text, report.text


def test_plain_pytorch_attention_is_caught_storing_p():
    def plain(q, k, v, causal):
        return torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1) @ v

    report = checks.check_autograd_function(plain, seed=3, out=_quiet)
    assert not report.passed and "recompute P in backward" in report.text


def _truncate_only(q, k, v):
    L = q.shape[-2]
    return api.attention(q, k[..., :L, :], v[..., :L, :], causal=True)


@pytest.mark.parametrize(
    "bug,words",
    [
        (lambda q, k, v: api.attention(q, k, v, causal=True), "drop keys L.. first"),
        (lambda q, k, v: api.attention(q, k, v, causal=True), "split the queries"),
        (_truncate_only, "split the queries"),
        (lambda q, k, v: api.attention(q, k, v), "attention(..., causal=True)"),
    ],
    ids=["bottom-right, L < S", "bottom-right, L > S", "no split for L > S", "not causal"],
)
def test_top_left_causal_names_each_planted_bug(bug, words):
    assert checks.check_top_left_causal(api.top_left_causal, seed=0, out=_quiet).passed
    report = checks.check_top_left_causal(bug, seed=4, out=_quiet)
    assert not report.passed and words in report.text, report.text


@pytest.mark.parametrize(
    "bug,words",
    [
        (lambda x, H: x.view(x.shape[0], H, x.shape[1], -1), "takes heads from positions"),
        (lambda x, H: x.view(*x.shape[:2], H, -1), "transpose(1, 2) to put heads before time"),
        (lambda x, H: x.view(*x.shape[:2], -1, H).permute(0, 3, 1, 2), "interleaves channels"),
    ],
    ids=["view(B, H, T, hs)", "no transpose", "interleaved"],
)
def test_split_heads_names_each_planted_bug(bug, words):
    assert checks.check_split_heads(gpt.split_heads, seed=0, out=_quiet).passed
    report = checks.check_split_heads(bug, seed=5, out=_quiet)
    assert not report.passed and words in report.text, report.text


@pytest.mark.parametrize(
    "grader,solution",
    [
        (checks.check_autograd_function, "flashedu.autograd.FlashAttention"),
        (checks.check_top_left_causal, "flashedu.api.top_left_causal"),
        (checks.check_split_heads, "flashedu.gpt.split_heads"),
    ],
)
def test_stubs_report_not_attempted(grader, solution):
    lines = []

    def stub(*args):
        raise NotImplementedError("Exercise 5.x: fill me in")

    report = grader(stub, out=lines.append)
    assert not report.attempted and lines == [
        f"{grader.__name__}: not attempted yet (reference: {solution})"
    ]
