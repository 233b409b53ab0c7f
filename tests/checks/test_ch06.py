"""Chapter 06 graders: the solutions pass, a stub is "not attempted", each planted bug fails with
its name.

The planted bugs of exercise 6.1 are Triton kernels too; on CPU they run through the interpreter."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from fixtures.learner_kernels import my_flash_forward, my_scores_kernel, planted
from fixtures.planted_forward import bad_forward
from fixtures.planted_tiles import bad_scores

from flashedu import checks, traffic
from flashedu.checks import _attn_variants, _kernel_cases, _triton, _triton_bytes, _triton_judge
from flashedu.kernels import exercises as triton_exercises
from flashedu.kernels import fwd as triton_attention
from flashedu.kernels import intro as triton_intro
from flashedu.kernels import solutions as triton_solutions
from flashedu.testing import random_qkv, run_grader, tolerance


def flat(text: str) -> str:
    """The report with its line breaks and indents gone, so a phrase wrapped at 100 columns is
    found whole."""
    return " ".join(text.split())


pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning"
)


def test_triton_scores_accepts_a_correct_kernel():
    report, text = run_grader(checks.triton_scores, my_scores_kernel)
    assert report.passed, text


@pytest.mark.parametrize(
    "fn,words",
    [
        (triton_intro.scores, "is a Python function: checks.triton_scores grades your @triton.jit"),
        (lambda q, k, causal=False: q @ k.T / q.shape[-1] ** 0.5, "is a Python function"),
        (triton_solutions.scores_kernel, "flashedu's own kernel: pass the one you wrote"),
    ],
    ids=["the package's function", "plain torch", "the solution kernel"],
)
def test_triton_scores_rejects_shortcuts(fn, words):
    report, text = run_grader(checks.triton_scores, fn)
    assert not report.passed and words in flat(text), text


@pytest.mark.parametrize(
    "bug,words",
    [
        ("no scale", "1/sqrt(d)"),
        ("masked to 0", "not 0"),
        ("top-left", "bottom-right"),
        ("swapped axes", "outside its own rows"),
        ("tf32", "input_precision"),
    ],
)
def test_triton_scores_names_each_planted_bug(bug, words):
    report, text = run_grader(checks.triton_scores, planted(bad_scores, bug), seed=3)
    assert not report.passed, bug
    assert words in flat(text), text


def _my_kv_range(bug=""):
    def fn(first, last, N_q, N_k, block_n, causal=False):
        off, right = N_k - N_q, (0 if causal else -1)  # bottom-right; right = -1: no causal edge
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
    report, text = run_grader(checks.kv_block_range, _my_kv_range(), seed)
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
    assert words in flat(text), text


@triton.jit
def _empty_scores(
    Q, K, S, stride_qm, stride_kn, stride_sm, N_q, N_k, sm_scale,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pass


def test_stubs_report_not_attempted():
    def stub(*args, **kwargs):
        raise NotImplementedError("Exercise 6.2")

    for grader, fn in ((checks.triton_scores, _empty_scores), (checks.kv_block_range, stub)):
        report, text = run_grader(grader, fn)
        assert not report.attempted and "not attempted yet" in text


# ----------------------------------------------------------- exercise 6.3: the whole forward kernel

kernel_warnings = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.mark.parametrize("seed", [0, 1])
def test_triton_forward_accepts_a_learner_kernel(seed):
    report, text = run_grader(checks.triton_forward, my_flash_forward, seed)
    assert report.passed, text
    assert all(detail.endswith("bytes as FA2") for _, _, detail in report.results), text


@kernel_warnings
@pytest.mark.parametrize(
    "bug,words",
    [
        ("no rescale", "not rescaled when the row max grew"),
        ("top-left", "bottom-right"),
        ("lse = m + l", "lse = m + log(l), not m + l"),
        ("floor", "ragged last key block was skipped"),
        ("tf32", "TF32-sized error"),
        ("no load mask", "outside every tensor"),
        ("no score mask", "scored 0 instead of -inf"),
        ("no empty guard", "rows that see no key"),
        ("re-read q", "read Q 3 times (12,288 B of a 4,096 B tensor): once more per key block"),
        ("store per block", "wrote O 3 times"),
        ("no causal skip", "blocks the causal mask hides entirely are never loaded"),
    ],
)
def test_triton_forward_names_each_planted_bug(bug, words):
    report, text = run_grader(checks.triton_forward, planted(bad_forward, bug), seed=3)
    assert not report.passed, bug
    assert words in flat(text), text


def test_the_planted_kernel_without_a_bug_passes():
    report, text = run_grader(checks.triton_forward, planted(bad_forward, ""), seed=3)
    assert report.passed, text


@triton.jit
def _skeleton(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh,
    stride_vn, stride_ob, stride_oh, stride_om, stride_lb, stride_lh,
    N_q, N_k, H, GROUP, sm_scale,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    Q, K, V, O, LSE, rows = triton_exercises.fwd_program(
        Q, K, V, O, LSE, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
        stride_ob, stride_oh, stride_lb, stride_lh, H, GROUP, BLOCK_M,
    )  # fmt: skip
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + rows[:, None] * stride_qm + dims[None, :], mask=rows[:, None] < N_q, other=0.0)  # noqa: F841


def test_the_untouched_skeleton_is_not_attempted():
    report, text = run_grader(checks.triton_forward, _skeleton)
    assert not report.attempted and "not attempted yet" in text, text


@triton.jit
def _scores_to_hbm(Q, K, S, N_q, N_k, scale, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    q = tl.load(
        Q + rows[:, None] * D + tl.arange(0, D)[None, :], mask=rows[:, None] < N_q, other=0.0
    )
    k = tl.load(
        K + cols[:, None] * D + tl.arange(0, D)[None, :], mask=cols[:, None] < N_k, other=0.0
    )
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    tl.store(
        S + rows[:, None] * N_k + cols[None, :],
        s,
        mask=(rows[:, None] < N_q) & (cols[None, :] < N_k),
    )


def _keep(N_q, N_k, causal):
    keep = torch.ones(N_q, N_k, dtype=torch.bool)
    return keep.tril(N_k - N_q) if causal else keep


def _plain_torch(q, k, v, causal=False):
    """Right answers with no Triton kernel at all."""
    k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1).double() for x in (k, v))
    s = (q.double() @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~_keep(q.shape[2], k.shape[2], causal), float("-inf"))
    o = torch.softmax(s, -1).nan_to_num() @ v
    return o.to(q.dtype), torch.logsumexp(s, -1).float()


def _calls_the_package(q, k, v, causal=False):
    return triton_attention.forward(q, k, v, causal=causal)


def _writes_s(q, k, v, causal=False):
    """The scores through HBM: a Triton kernel stores S per head, torch does the softmax."""
    B, H, N_q, d = q.shape
    k, v = (x.repeat_interleave(H // k.shape[1], dim=1) for x in (k, v))
    o, lse = torch.empty_like(q), torch.empty(B, H, N_q)
    keep = _keep(N_q, k.shape[2], causal)
    for b in range(B):
        for h in range(H):
            s = torch.empty(N_q, k.shape[2])
            qh, kh = q[b, h].contiguous(), k[b, h].contiguous()
            _scores_to_hbm[(triton.cdiv(N_q, 16), triton.cdiv(k.shape[2], 16))](
                qh, kh, s, N_q, k.shape[2], d**-0.5, D=d, BM=16, BN=16
            )
            s = s.masked_fill(~keep, float("-inf"))
            lse[b, h] = torch.logsumexp(s, -1)
            o[b, h] = (torch.softmax(s, -1).nan_to_num() @ v[b, h].float()).to(q.dtype)
    return o, lse


@kernel_warnings
@pytest.mark.parametrize(
    "fn,words",
    [
        (_plain_torch, "_plain_torch is a Python function: checks.triton_forward grades"),
        (_calls_the_package, "is a Python function"),
        (triton_attention._attn_fwd, "flashedu.kernels.fwd._attn_fwd, flashedu's own kernel"),
        (triton_solutions.flash_forward_kernel, "flashedu's own kernel: pass the one you wrote"),
        (_writes_s, "is a Python function"),
    ],
    ids=["plain torch", "flashedu's forward", "flashedu's kernel", "the solution", "S in HBM"],
)
def test_triton_forward_rejects_shortcuts_by_name(fn, words):
    report, text = run_grader(checks.triton_forward, fn)
    assert not report.passed, text
    assert words in flat(text), text


def _forward_case(seed=0, dims=(1, 2, 2, 37, 45, 32), causal=True):
    rng = np.random.default_rng(seed)
    return _kernel_cases.ForwardCase(rng, "case", dims, "float32", causal, "hint")


def test_tf32_recogniser_names_a_tf32_rounded_result_and_nothing_else():
    """Under the interpreter tl.dot never rounds to TF32, so the recogniser is held to a synthetic
    TF32 result: every product input rounded to 10 mantissa bits, as a GPU does."""
    case = _forward_case()
    outs = [
        _triton_judge.Output("o", "O", case.o, tolerance("float32"), 37),
        _triton_judge.Output("lse", "lse", case.lse, _kernel_cases.LSE_TOL, 37),
    ]
    tf32 = case._tf32()
    assert _triton_judge.diagnose(tf32, outs, {}, tf32) == _attn_variants.TF32
    far = tuple(e + 30 * (t - e) for t, e in zip(tf32, (case.o, case.lse)))
    assert _triton_judge.diagnose(far, outs, {}, tf32) == ""  # 30x a TF32 error is a real bug
    exact = (case.o.astype(np.float32), case.lse.astype(np.float32))
    assert all(_triton_judge.compare(o.name, g, o.expected, o.tol)[0] for g, o in zip(exact, outs))


def _measured(fn):
    with traffic.measure() as m:
        fn()
    return m.traffic()


@pytest.mark.parametrize(
    "dims,causal",
    [
        ((1, 2, 2, 64, 64, 32), False),
        ((1, 2, 2, 37, 45, 32), False),
        ((1, 2, 2, 21, 50, 32), True),
        ((2, 1, 1, 50, 19, 16), True),
        ((1, 4, 2, 33, 47, 16), True),
    ],
)
def test_package_and_solution_kernels_move_bytes_inside_the_fa2_budget(dims, causal):
    B, H, H_kv, N_q, N_k, d = dims
    q, k, v = random_qkv(B, H, N_q, N_k, d, "float32", H_kv=H_kv, kind="torch")
    shape = _triton_bytes.Shape(B, H, H_kv, N_q, N_k, d, 4, causal, 16, 16)
    budget = _triton_bytes.forward(shape)
    for run in (
        lambda: triton_attention.forward(q, k, v, causal=causal, block_m=16, block_n=16),
        lambda: triton_solutions.forward(q, k, v, causal=causal, block_m=16, block_n=16),
    ):
        assert _triton_bytes.judge(_measured(run), budget, ("O", "lse")) == ""
    model = traffic.flash_forward(
        B, H, N_q, N_k, d, block_m=16, block_n=16, causal=causal, itemsize=4
    )
    assert budget[("K", "read")].high == model.reads["K"]  # the upper end is the closed form


def test_budget_bounds_are_the_masked_edge_tolerance():
    """K may be read from its visible keys only (masked loads on the diagonal) down to the keys
    some row of each query block sees, and no lower; Q at most once."""
    s = _triton_bytes.Shape(1, 1, 1, 20, 40, 16, 4, True, 16, 16)
    a = _triton_bytes.forward(s)[("K", "read")]
    row = 16 * 4
    # rows 0..15 see keys 0..35 (offset N_k - N_q = 20), rows 16..19 all 40; whole blocks of 16
    # keys make that 40 and 40 (the last key block is short)
    assert (a.low, a.high) == ((36 + 40) * row, (40 + 40) * row)
    t = traffic.Traffic({"Q": 20 * row, "K": a.low, "V": a.low}, {"O": 20 * row, "lse": 20 * 4})
    assert _triton_bytes.judge(t, _triton_bytes.forward(s), ("O", "lse")) == ""
    short = traffic.Traffic(dict(t.reads, K=a.low - row), t.writes)
    assert "FA2 moves at least" in _triton_bytes.judge(short, _triton_bytes.forward(s), ("O",))


def test_gpu_timing_prints_nothing_on_cpu_and_ratios_given_times():
    lines = []
    if not torch.cuda.is_available():
        assert _triton.gpu_timing("x", {"your kernel": lambda: 0}, out=lines.append) is None
        assert lines == []
        checks.ch06._time_forward(_skeleton, lines.append)
        assert lines == []
    times = iter([2.0, 1.0, 0.5])
    ms = _triton.gpu_timing(
        "forward", {"your kernel": 0, "flashedu": 0, "SDPA": 0}, out=lines.append,
        bench=lambda fn: next(times),
    )  # fmt: skip
    assert ms == {"your kernel": 2.0, "flashedu": 1.0, "SDPA": 0.5}
    assert lines == [
        "timing, forward (information, not graded): your kernel 2.000 ms; flashedu 1.000 ms "
        "(yours / flashedu = 2.00); SDPA 0.500 ms (yours / SDPA = 4.00)"
    ]


def test_a_dot_without_input_precision_is_exact_under_the_interpreter():
    """TF32 is a GPU's doing: the interpreter multiplies float32 in full, so the same kernel passes
    here (and is named on the GPU: the test below)."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU the default dot is TF32")
    report, text = run_grader(checks.triton_forward, planted(bad_forward, "default dot"), seed=3)
    assert report.passed, text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_dot_without_input_precision_is_named_tf32_on_a_gpu():
    report, text = run_grader(checks.triton_forward, planted(bad_forward, "default dot"), seed=11)
    assert not report.passed and "TF32-sized error" in flat(text), text


@pytest.mark.parametrize("grader", ["triton_forward", "triton_dkdv", "triton_dq"])
def test_the_solution_shown_is_a_kernel_written_from_the_skeleton(grader):
    from flashedu import nb

    g = checks.GRADERS[grader]
    text = nb.source(checks.solution_function(g))
    assert text.startswith("@triton.jit\ndef ") and "_program(" in text, text[:200]
    assert "input_precision=PRECISION" in text
    hints = []
    checks.hint(g, out=hints.append)
    assert any("sm_scale" in line for line in hints), hints
