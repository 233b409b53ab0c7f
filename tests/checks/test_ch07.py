"""Chapter 07 graders: the solutions pass, a stub is "not attempted", each planted bug fails with
its name.

The planted bugs are Triton kernels; on CPU they run through the interpreter."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from fixtures.learner_kernels import (
    my_dkdv,
    my_dq,
    my_preprocess_kernel,
    my_probabilities_kernel,
    planted,
)
from fixtures.planted_backward import bad_dkdv, bad_dq
from fixtures.planted_tiles import bad_preprocess, bad_probabilities

from flashedu import checks, traffic
from flashedu.checks import _triton_bytes
from flashedu.kernels import bwd as triton_backward
from flashedu.kernels import intro as triton_intro
from flashedu.kernels import solutions as triton_solutions
from flashedu.testing import random_qkv, run_grader


def flat(text: str) -> str:
    """The report with its line breaks and indents gone (phrases wrapped at 100 columns)."""
    return " ".join(text.split())


pytestmark = [
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]


def test_bwd_preprocess_accepts_a_correct_kernel_and_rejects_the_package():
    report, text = run_grader(checks.bwd_preprocess, my_preprocess_kernel)
    assert report.passed, text
    report, text = run_grader(checks.bwd_preprocess, triton_backward.preprocess)
    assert "preprocess is a Python function" in flat(text), text
    report, text = run_grader(checks.bwd_preprocess, triton_solutions.preprocess_kernel)
    assert "flashedu's own kernel" in flat(text), text


@pytest.mark.parametrize(
    "bug,words",
    [
        ("fp16 sum", "convert o and do to float32"),
        ("no head offset", "program_id(1)"),
    ],
)
def test_bwd_preprocess_names_each_planted_bug(bug, words):
    report, text = run_grader(checks.bwd_preprocess, planted(bad_preprocess, bug), seed=5)
    assert not report.passed, bug
    assert words in flat(text), text


def test_recompute_probabilities_accepts_a_correct_kernel_and_rejects_the_package():
    report, text = run_grader(checks.recompute_probabilities, my_probabilities_kernel)
    assert report.passed, text
    report, text = run_grader(checks.recompute_probabilities, triton_intro.probabilities)
    assert "probabilities is a Python function" in flat(text), text


@pytest.mark.parametrize(
    "bug,words",
    [
        ("exp2 without log2(e)", "fold log2(e)"),
        ("no scale", "not multiplied by the scale 1/sqrt(d)"),
        ("top-left", "bottom-right"),
        ("mask before exp", "is NaN"),
    ],
)
def test_recompute_probabilities_names_each_planted_bug(bug, words):
    report, text = run_grader(
        checks.recompute_probabilities, planted(bad_probabilities, bug), seed=6
    )
    assert not report.passed, bug
    assert words in flat(text), text


@triton.jit
def _empty_preprocess(
    O, DO, DELTA, stride_ob, stride_oh, stride_om, stride_db, stride_dh, stride_dm,
    stride_deltab, stride_deltah, N, H, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    pass


@triton.jit
def _empty_probabilities(
    Q, K, LSE, P, stride_qm, stride_kn, stride_pm, N_q, N_k, sm_scale,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pass


def test_stubs_report_not_attempted():
    for grader, kernel in (
        (checks.bwd_preprocess, _empty_preprocess),
        (checks.recompute_probabilities, _empty_probabilities),
    ):
        report, text = run_grader(grader, kernel)
        assert not report.attempted and "not attempted yet" in text


# ------------------------------------------------- exercises 7.3 and 7.4: the dK/dV and dQ kernels


@pytest.mark.parametrize(
    "grader,kernel",
    [(checks.triton_dkdv, my_dkdv), (checks.triton_dq, my_dq)],
    ids=["dkdv", "dq"],
)
def test_backward_graders_accept_learner_kernels(grader, kernel):
    report, text = run_grader(grader, kernel, seed=1)
    assert report.passed, text
    assert all(detail.endswith("bytes as FA2") for _, _, detail in report.results), text


@pytest.mark.parametrize(
    "bug,words",
    [
        ("top-left", "bottom-right"),
        ("floor", "ragged last key block was skipped"),
        ("tf32", "TF32-sized error"),
        ("no load mask", "outside every tensor"),
        ("no scale", "multiplication by sm_scale is missing"),
        ("no D", "D was not subtracted"),
        ("no p mask", "query i sees keys j <= i + N_k - N_q"),
        ("re-read q", "read Q 3 times (12,288 B of a 4,096 B tensor): once more per key block"),
        ("store per block", "wrote dQ 3 times"),
        ("no causal skip", "blocks the causal mask hides entirely are never loaded"),
    ],
)
def test_triton_dq_names_each_planted_bug(bug, words):
    report, text = run_grader(checks.triton_dq, planted(bad_dq, bug), seed=3)
    assert not report.passed, bug
    assert words in flat(text), text


@pytest.mark.parametrize(
    "bug,words",
    [
        ("top-left", "bottom-right"),
        ("floor", "ragged last query block was skipped"),
        ("tf32", "TF32-sized error"),
        ("no load mask", "outside every tensor"),
        ("no scale", "multiplication by sm_scale is missing"),
        ("no D", "D was not subtracted"),
        ("one head", "only one head was added"),
        ("late start", "loop over query blocks started too late"),
        ("re-read k", "read K 3 times (12,288 B of a 4,096 B tensor): once more per query block"),
        ("store per block", "wrote dV 3 times"),
        ("no causal skip", "query blocks the causal mask hides from these keys are never loaded"),
    ],
)
def test_triton_dkdv_names_each_planted_bug(bug, words):
    report, text = run_grader(checks.triton_dkdv, planted(bad_dkdv, bug), seed=3)
    assert not report.passed, bug
    assert words in flat(text), text


def _plain_dq(do, q, k, v, lse, delta, causal=False):
    return torch.zeros_like(q)


def _package_dq(do, q, k, v, lse, delta, causal=False):
    return triton_backward.backward(do, q, k, v, q, lse, causal=causal)[0]


@pytest.mark.parametrize(
    "fn,words",
    [
        (_plain_dq, "_plain_dq is a Python function: checks.triton_dq grades"),
        (_package_dq, "is a Python function"),
        (triton_backward.attn_bwd_dq, "flashedu.kernels.bwd.attn_bwd_dq, flashedu's own"),
        (triton_solutions.dq_kernel, "flashedu.kernels.solutions.dq_kernel, flashedu's own kernel"),
    ],
    ids=["plain torch", "flashedu's backward", "flashedu's kernel", "the solution"],
)
def test_triton_dq_rejects_shortcuts_by_name(fn, words):
    report, text = run_grader(checks.triton_dq, fn)
    assert not report.passed and words in flat(text), text


@pytest.mark.parametrize(
    "grader,kernel", [(checks.triton_dkdv, bad_dkdv), (checks.triton_dq, bad_dq)]
)
def test_a_kernel_that_stores_nothing_is_not_attempted(grader, kernel):
    report, text = run_grader(grader, planted(kernel, "stub"))
    assert not report.attempted and "not attempted yet" in text, text


def _two_pass_split(B, H, H_kv, N_q, N_k, d, causal):
    """The bytes of the package's dK/dV and dQ launches, measured apart."""
    q, k, v = random_qkv(B, H, N_q, N_k, d, "float32", H_kv=H_kv, kind="torch")
    do = torch.randn_like(q)
    o, lse = triton_solutions.forward(q, k, v, causal=causal)
    with traffic.measure() as m:
        triton_backward.backward(do, q, k, v, o, lse, causal=causal, block_m=16, block_n=16)
    per_launch = {}
    for a in m.accesses:
        name = m.launches[a.launch][0]
        t = per_launch.setdefault(name, ({}, {}))[0 if a.direction == "read" else 1]
        t[a.tensor] = t.get(a.tensor, 0) + a.nbytes
    return {name: traffic.Traffic(*rw) for name, rw in per_launch.items()}


@pytest.mark.parametrize(
    "dims,causal",
    [((1, 2, 2, 37, 45, 32), False), ((1, 2, 2, 21, 50, 32), True), ((2, 4, 2, 50, 19, 16), True)],
)
def test_package_backward_kernels_move_bytes_inside_the_budgets(dims, causal):
    B, H, H_kv, N_q, N_k, d = dims
    shape = _triton_bytes.Shape(B, H, H_kv, N_q, N_k, d, 4, causal, 16, 16)
    split = _two_pass_split(*dims, causal)
    assert _triton_bytes.judge(split["attn_bwd_dq"], _triton_bytes.dq(shape), ("dQ",)) == ""
    dkdv = _triton_bytes.dkdv(shape)
    assert _triton_bytes.judge(split["attn_bwd_dkdv"], dkdv, ("dK", "dV")) == ""
    # the budgets' upper ends and the preprocess add up to the two-pass closed form
    model = traffic.flash_backward(
        B, H, N_q, N_k, d, block_m=16, block_n=16, causal=causal, itemsize=4, H_kv=H_kv,
        variant="two_pass",
    )  # fmt: skip
    highs: dict = {}
    for budget in (dkdv, _triton_bytes.dq(shape)):
        for (name, direction), a in budget.items():
            highs[(name, direction)] = highs.get((name, direction), 0) + a.high
    row = B * H * N_q * d * 4
    highs[("dO", "read")] += row  # the preprocess reads dO and O, writes D
    highs[("O", "read")] = row
    highs[("D", "write")] = B * H * N_q * 4
    assert {k: v for k, v in highs.items() if k[1] == "read"} == {
        (k, "read"): v for k, v in model.reads.items()
    }
    assert {k: v for k, v in highs.items() if k[1] == "write"} == {
        (k, "write"): v for k, v in model.writes.items()
    }
