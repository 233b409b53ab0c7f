"""Chapter 06 graders: the solutions pass, a stub is "not attempted", each planted bug fails with
its name.

The planted bugs of exercise 6.1 are Triton kernels too; on CPU they run through the interpreter."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: E402  (flashedu has set the interpreter flag when there is no GPU)
import triton.language as tl  # noqa: E402

from flashedu import checks, triton_intro
from flashedu.testing import run_grader
from flashedu.traffic import band

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning"
)


@triton.jit
def _scores(
    Q,
    K,
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
    s = tl.dot(q, tl.trans(k), input_precision="ieee")
    if BUG != "no scale":
        s = s * scale
    if CAUSAL:
        shift = N_k - N_q
        if BUG == "top-left":
            shift = 0
        keep = cols[None, :] <= rows[:, None] + shift
        if BUG == "masked to 0":
            s = tl.where(keep, s, 0.0)
        else:
            s = tl.where(keep, s, -float("inf"))
    tl.store(
        OUT + rows[:, None] * N_k + cols[None, :],
        s,
        mask=(rows[:, None] < N_q) & (cols[None, :] < N_k),
    )


def _my_scores(bug=""):
    def fn(q, k, causal=False):
        (N_q, d), N_k = q.shape, k.shape[0]
        out = torch.zeros(N_q, N_k, device=q.device)
        rows = max(N_q // 16, 1) if bug == "grid floor" else triton.cdiv(N_q, 16)
        _scores[(rows, triton.cdiv(N_k, 16))](
            q, k, out, N_q, N_k, d**-0.5, D=d, CAUSAL=causal, BUG=bug, BM=16, BN=16
        )
        return out

    return fn


@pytest.mark.parametrize(
    "fn", [triton_intro.scores, _my_scores()], ids=["package", "bug-free test kernel"]
)
def test_triton_scores_accepts_the_solution(fn):
    report, text = run_grader(checks.triton_scores, fn)
    assert report.passed, text


@pytest.mark.parametrize(
    "bug,words",
    [
        ("no scale", "1/sqrt(d)"),
        ("masked to 0", "not 0"),
        ("top-left", "bottom-right"),
        ("grid floor", "cdiv(N_q, BLOCK_M)"),
    ],
)
def test_triton_scores_names_each_planted_bug(bug, words):
    report, text = run_grader(checks.triton_scores, _my_scores(bug), seed=3)
    assert not report.passed, bug
    assert words in text, text


def _my_kv_range(bug=""):
    def fn(first, last, N_q, N_k, block_n, causal=False):
        off, _, right = band(N_q, N_k, causal=causal)
        off = 0 if bug == "top-left" else off
        hi, full_hi = N_k, N_k
        if right >= 0:
            hi = min(last + off + 1, N_k) if bug == "no clamp" else min(max(last + off + 1, 0), N_k)
            full_hi = min(max((last if bug == "last row" else first) + off + 1, 0), N_k)
        hi = (
            -(-hi // block_n) * block_n
            if bug == "no clamp"
            else max(-(-hi // block_n) * block_n, 0)
        )
        full_hi = (
            -(-full_hi // block_n) * block_n if bug == "round up" else full_hi // block_n * block_n
        )
        return 0, 0, min(full_hi, hi), hi

    return fn


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kv_block_range_accepts_the_solution(seed):
    for fn in (triton_intro.kv_range, _my_kv_range()):
        report, text = run_grader(checks.kv_block_range, fn, seed)
        assert report.passed, text


@pytest.mark.parametrize(
    "bug,words",
    [
        ("round up", "ragged last key block"),
        ("top-left", "bottom-right"),
        ("last row", "diagonal block"),
        ("no clamp", "see no key"),
    ],
)
def test_kv_block_range_names_each_planted_bug(bug, words):
    report, text = run_grader(checks.kv_block_range, _my_kv_range(bug), seed=4)
    assert not report.passed, bug
    assert words in text, text


def test_stubs_report_not_attempted():
    def stub(*args, **kwargs):
        raise NotImplementedError("Exercise 6.1")

    for grader in (checks.triton_scores, checks.kv_block_range):
        report, text = run_grader(grader, stub)
        assert not report.attempted and "not attempted yet" in text and grader.solution_name in text
