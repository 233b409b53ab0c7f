"""Chapter 07's Triton graders against a learner in a hurry: every shortcut (right numbers by the
wrong method) is rejected with a message that names it, and honest kernels written in other shapes
(loops walked backwards or by block index, masks built in registers, base-2 exponentials) pass.

As in chapter 06 the grader launches the learner's @triton.jit kernel itself, with its own blocks,
into NaN-filled outputs: a Python wrapper (whatever kernel it launches) is never graded, a tile
wider than the grader's block is named with both sizes, flashedu's kernels are named however they
are reached, and a known mistake is named instead of a generic "values differ"."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import triton
from fixtures import shortcut_kernels as sk
from fixtures.learner_kernels import (
    my_dkdv,
    my_dq,
    my_preprocess_kernel,
    my_probabilities_kernel,
    planted,
)
from fixtures.planted_backward import bad_dkdv, bad_dq
from fixtures.planted_tiles import bad_preprocess, bad_probabilities

from flashedu import checks
from flashedu.kernels import bwd as triton_backward
from flashedu.kernels import exercises as triton_exercises
from flashedu.kernels import solutions as triton_solutions
from flashedu.testing import run_grader

pytestmark = [
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="traffic is measured by the interpreter"),
]


def flat(text: str) -> str:
    return " ".join(text.split())


def rejected(grader, fn, words, seed=2):
    report, text = run_grader(grader, fn, seed)
    assert not report.passed, text
    assert words in flat(text), text
    return text


def jit_clone(kernel):
    fn = kernel.fn
    copy = types.FunctionType(fn.__code__, fn.__globals__, "my_kernel", fn.__defaults__)
    copy.__annotations__ = dict(fn.__annotations__)
    copy.__module__ = "__main__"
    return triton.jit(copy)


# ----------------------------------------------------------------------------- 7.1: preprocess


@pytest.mark.parametrize(
    "kernel", [my_preprocess_kernel, planted(bad_preprocess, "")], ids=["divmod heads", "plain"]
)
def test_honest_preprocess_kernels_pass(kernel):
    report, text = run_grader(checks.bwd_preprocess, kernel, seed=2)
    assert report.passed, text


def _empty_kernel_and_torch(o, do):
    """An empty kernel launched for show; torch computes D."""
    triton_exercises.launch_preprocess(planted(bad_preprocess, ""), o, do)
    return (o.float() * do.float()).sum(-1)


@pytest.mark.parametrize(
    "fn,words",
    [
        (_empty_kernel_and_torch, "_empty_kernel_and_torch is a Python function: "
         "checks.bwd_preprocess grades your @triton.jit kernel itself"),
        (triton_backward.preprocess, "preprocess is a Python function"),
        (sk.with_globals(sk.wide_preprocess, WIDE=128), "rows of O in one tile; the grader asked "
         "for BLOCK_M = 16"),
        (triton_solutions.preprocess_kernel, "flashedu's own kernel: pass the one you wrote"),
        (jit_clone(triton_solutions.preprocess_kernel), "your code is flashedu's "
         "flashedu.kernels.solutions.preprocess_kernel"),
    ],
    ids=["empty kernel + torch", "the package's function", "all rows in one tile", "the solution",
         "cloned code object"],
)  # fmt: skip
def test_preprocess_shortcuts_are_named(fn, words):
    rejected(checks.bwd_preprocess, fn, words)


# ----------------------------------------------------------------------------- 7.2: P from lse


def test_honest_probabilities_kernel_passes():
    for kernel in (my_probabilities_kernel, planted(bad_probabilities, "")):
        report, text = run_grader(checks.recompute_probabilities, kernel, seed=2)
        assert report.passed, text


@pytest.mark.parametrize(
    "fn,words",
    [
        (lambda q, k, lse, causal=False: torch.exp(q @ k.T / q.shape[1] ** 0.5 - lse[:, None]),
         "is a Python function"),
        (sk.with_globals(sk.wide_probabilities, WIDE=128), "in one tile; the grader asked for "
         "BLOCK_N ="),
        (triton_solutions.probabilities_kernel, "flashedu's own kernel"),
        (sys.modules["flashedu.kernels.solutions"].probabilities_kernel, "flashedu's own kernel"),
        (jit_clone(triton_solutions.probabilities_kernel), "your code is flashedu's "
         "flashedu.kernels.solutions.probabilities_kernel"),
    ],
    ids=["torch", "one tile of every key", "the solution", "via sys.modules", "cloned code"],
)  # fmt: skip
def test_probabilities_shortcuts_are_named(fn, words):
    rejected(checks.recompute_probabilities, fn, words)


# ------------------------------------------------------------------------- 7.3, 7.4: dK/dV, dQ


@pytest.mark.parametrize(
    "grader,kernel",
    [
        (checks.triton_dq, my_dq),
        (checks.triton_dq, planted(bad_dq, "")),
        (checks.triton_dkdv, my_dkdv),
        (checks.triton_dkdv, planted(bad_dkdv, "")),
    ],
    ids=["dq: backwards loop, exp2", "dq: plain", "dkdv: block index loop, exp2", "dkdv: plain"],
)
def test_honest_backward_kernels_pass(grader, kernel):
    report, text = run_grader(grader, kernel, seed=4)
    assert report.passed, text


def _decoy_dq(do, q, k, v, lse, delta, *, causal=False):
    """Launches a kernel of the learner's (into a buffer nobody reads), answers with autograd."""
    triton_exercises.launch_dq(my_dq, do, q, k, v, lse, delta, causal=causal)
    qg = q.detach().double().requires_grad_()
    group = q.shape[1] // k.shape[1]
    kk, vv = (x.double().repeat_interleave(group, 1) for x in (k, v))
    o = torch.nn.functional.scaled_dot_product_attention(qg, kk, vv, is_causal=causal)
    (dq,) = torch.autograd.grad(o, qg, do.double())
    return dq.to(q.dtype)


def _decoy_dkdv(do, q, k, v, lse, delta, *, causal=False):
    triton_exercises.launch_dkdv(my_dkdv, do, q, k, v, lse, delta, causal=causal)
    return torch.zeros_like(k), torch.zeros_like(v)


@pytest.mark.parametrize(
    "grader,fn,words",
    [
        (checks.triton_dq, _decoy_dq, "_decoy_dq is a Python function: checks.triton_dq grades "
         "your @triton.jit kernel itself"),
        (checks.triton_dkdv, _decoy_dkdv, "_decoy_dkdv is a Python function"),
        (checks.triton_dq, sk.with_globals(sk.wide_dq, WIDE=128), "your kernel read all 32 keys "
         "of K in one tile; the grader asked for BLOCK_N = 16"),
        (checks.triton_dkdv, sk.with_globals(sk.wide_dkdv, WIDE=128), "your kernel read all 32 "
         "query rows of Q in one tile; the grader asked for BLOCK_M = 16"),
        (checks.triton_dq, triton_solutions.dq_kernel, "flashedu's own kernel"),
        (checks.triton_dkdv, jit_clone(triton_solutions.dkdv_kernel), "your code is flashedu's "
         "flashedu.kernels.solutions.dkdv_kernel"),
        (checks.triton_dq, jit_clone(triton_solutions.dq_kernel), "your code is flashedu's "
         "flashedu.kernels.solutions.dq_kernel"),
        (checks.triton_dq, triton_backward.attn_bwd_dq, "flashedu's own kernel"),
    ],
    ids=["dq: decoy + autograd", "dkdv: decoy + torch", "dq: one tile of every key",
         "dkdv: one tile of every query", "dq: the solution", "dkdv: cloned code",
         "dq: cloned code", "dq: the package's kernel"],
)  # fmt: skip
def test_backward_shortcuts_are_named(grader, fn, words):
    rejected(grader, fn, words, seed=4)


@pytest.mark.parametrize(
    "grader,kernel,bug,words",
    [
        (checks.triton_dq, bad_dq, "no D", "D was not subtracted"),
        (checks.triton_dq, bad_dq, "no p mask", "P was not zeroed where the causal mask hides"),
        (checks.triton_dq, bad_dq, "exp2 no log2e", "P rebuilt with tl.exp2 from natural-log"),
        (checks.triton_dq, bad_dq, "no lse", "P was rebuilt without subtracting lse"),
        (checks.triton_dq, bad_dq, "dp from k", "dP came from dO and K"),
        (checks.triton_dkdv, bad_dkdv, "no p mask", "P was not zeroed where the causal mask hides"),
    ],
)
def test_known_backward_mistakes_are_named_not_generic(grader, kernel, bug, words):
    text = rejected(grader, planted(kernel, bug), words, seed=3)
    assert "matches none of the usual mistakes" not in flat(text), text


def test_the_ds_formula_waits_for_the_hint():
    text = rejected(checks.triton_dq, planted(bad_dq, "no D"), "D was not subtracted", seed=3)
    assert "P * (dP" not in text and "dS =" not in text, text
    hints = []
    checks.hint(checks.triton_dq, out=hints.append)
    assert any("dS = P * (dP - D_i)" in line for line in hints), hints
