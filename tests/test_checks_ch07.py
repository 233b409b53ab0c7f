"""Chapter 07 graders: the solutions pass, a stub is "not attempted", each planted bug fails with
its name.

The planted bugs are Triton kernels; on CPU they run through the interpreter."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: E402  (flashedu has set the interpreter flag when there is no GPU)
import triton.language as tl  # noqa: E402

from flashedu import checks, triton_backward, triton_intro
from flashedu.testing import run_grader

pytestmark = [
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]


@triton.jit
def _rowdot(O, DO, DELTA, N, D: tl.constexpr, BUG: tl.constexpr, BLOCK: tl.constexpr):
    bh = tl.program_id(1)
    if BUG == "no head offset":
        bh = 0
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ptrs = bh * N * D + rows[:, None] * D + tl.arange(0, D)[None, :]
    o = tl.load(O + ptrs, mask=rows[:, None] < N, other=0.0)
    do = tl.load(DO + ptrs, mask=rows[:, None] < N, other=0.0)
    if BUG == "fp16 sum":
        delta = tl.sum(o * do, 1).to(tl.float32)
    else:
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + bh * N + rows, delta, mask=rows < N)


def _my_preprocess(bug=""):
    def fn(o, do):
        B, H, N, d = o.shape
        delta = torch.zeros(B, H, N, device=o.device)
        rows = max(N // 16, 1) if bug == "grid floor" else triton.cdiv(N, 16)
        _rowdot[(rows, B * H)](o.contiguous(), do.contiguous(), delta, N, D=d, BUG=bug, BLOCK=16)
        return delta

    return fn


@pytest.mark.parametrize(
    "fn", [triton_backward.preprocess, _my_preprocess()], ids=["package", "bug-free test kernel"]
)
def test_bwd_preprocess_accepts_the_solution(fn):
    report, text = run_grader(checks.bwd_preprocess, fn)
    assert report.passed, text


@pytest.mark.parametrize(
    "bug,words",
    [
        ("fp16 sum", "convert o and do to float32"),
        ("grid floor", "cdiv(N, BLOCK)"),
        ("no head offset", "program_id(1)"),
    ],
)
def test_bwd_preprocess_names_each_planted_bug(bug, words):
    report, text = run_grader(checks.bwd_preprocess, _my_preprocess(bug), seed=5)
    assert not report.passed, bug
    assert words in text, text


@triton.jit
def _probs(
    Q,
    K,
    LSE,
    OUT,
    N_q,
    N_k,
    scale,
    D: tl.constexpr,
    CAUSAL: tl.constexpr,
    BUG: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    q = tl.load(
        Q + rows[:, None] * D + tl.arange(0, D)[None, :], mask=rows[:, None] < N_q, other=0.0
    )
    k = tl.load(
        K + cols[:, None] * D + tl.arange(0, D)[None, :], mask=cols[:, None] < N_k, other=0.0
    )
    lse = tl.load(LSE + rows, mask=rows < N_q, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision="ieee")
    if BUG != "no scale":
        s = s * scale
    shift = N_k - N_q
    if BUG == "top-left":
        shift = 0
    keep = (cols[None, :] <= rows[:, None] + shift) | (not CAUSAL)
    if BUG == "exp2 without log2(e)":
        p = tl.where(keep, tl.math.exp2(s - lse[:, None]), 0.0)
    elif BUG == "mask before exp":
        p = tl.math.exp2((tl.where(keep, s, -float("inf")) - lse[:, None]) * 1.4426950408889634)
    else:
        p = tl.where(keep, tl.math.exp2((s - lse[:, None]) * 1.4426950408889634), 0.0)
    tl.store(
        OUT + rows[:, None] * N_k + cols[None, :],
        p,
        mask=(rows[:, None] < N_q) & (cols[None, :] < N_k),
    )


def _my_probabilities(bug=""):
    def fn(q, k, lse, causal=False):
        (N_q, d), N_k = q.shape, k.shape[0]
        out = torch.zeros(N_q, N_k, device=q.device)
        _probs[(triton.cdiv(N_q, 16), triton.cdiv(N_k, 16))](
            q, k, lse, out, N_q, N_k, d**-0.5, D=d, CAUSAL=causal, BUG=bug, BM=16, BN=16
        )
        return out

    return fn


@pytest.mark.parametrize(
    "fn", [triton_intro.probabilities, _my_probabilities()], ids=["package", "bug-free test kernel"]
)
def test_recompute_probabilities_accepts_the_solution(fn):
    report, text = run_grader(checks.recompute_probabilities, fn)
    assert report.passed, text


@pytest.mark.parametrize(
    "bug,words",
    [
        ("exp2 without log2(e)", "fold log2(e)"),
        ("no scale", "scaled by 1/sqrt(d)"),
        ("top-left", "bottom-right"),
        ("mask before exp", "is NaN"),
    ],
)
def test_recompute_probabilities_names_each_planted_bug(bug, words):
    report, text = run_grader(checks.recompute_probabilities, _my_probabilities(bug), seed=6)
    assert not report.passed, bug
    assert words in text, text


def test_stubs_report_not_attempted():
    def stub(*args, **kwargs):
        raise NotImplementedError("Exercise 7.1")

    for grader in (checks.bwd_preprocess, checks.recompute_probabilities):
        report, text = run_grader(grader, stub)
        assert not report.attempted and "not attempted yet" in text and grader.solution_name in text
