"""Chapter 11 graders: the solutions pass, a stub is "not attempted", each planted bug fails with a
line that names it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashedu import checks, traffic
from flashedu.hopper import fp8
from flashedu.hopper import model as hopper
from flashedu.testing import run_grader

# --------------------------------------------------------------------------------- 11.1 the budget


def _budget(
    B,
    H,
    N,
    d,
    *,
    causal=False,
    matmul_tflops=989.4,
    sfu_tflops=3.9,
    causal_exp="exact",
    causal_mm="exact",
    matmuls=2,
    exps_per_score=1,
    unit=1e12,
    bh=True,
    swap_rates=False,
    order=True,
    scale=1.0,
):
    """A learner-style solution with switches that plant the classic slips. causal_exp and
    causal_mm: how the causal mask is counted, "exact" (N (N + 1) / 2 scores per head), "half"
    (N^2 / 2, the benchmark convention) or "all" (the whole square)."""
    heads = B * H if bh else 1
    area = {"exact": N * (N + 1) / 2, "half": N * N / 2, "all": N * N}
    mm_area = area[causal_mm] if causal else N * N
    exp_area = area[causal_exp] if causal else N * N
    flops = 2 * matmuls * heads * mm_area * d
    exps = heads * exp_area * exps_per_score
    mm, sfu = (sfu_tflops, matmul_tflops) if swap_rates else (matmul_tflops, sfu_tflops)
    t = (flops / (mm * unit) * scale, exps / (sfu * unit) * scale)
    return t if order else t[::-1]


BUDGET_BUGS = {
    "the causal exps count the whole square": dict(causal_exp="all"),
    "the causal matmul FLOPs count the whole square": dict(causal_mm="all"),
    "causal was ignored": dict(causal_exp="all", causal_mm="all"),
    "x0.5 is the benchmark convention": dict(causal_exp="half", causal_mm="half"),
    "one matmul counted": dict(matmuls=1),
    "an exponential per multiply-add": dict(exps_per_score="d"),
    "TFLOP/s used as FLOP/s": dict(unit=1.0),
    "that is milliseconds": dict(scale=1e3),
    "left out: every (batch, head) pair does the work": dict(bh=False),
    "the rates are swapped": dict(swap_rates=True),
    "the order is (t_matmul, t_exp)": dict(order=False),
}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_budget_solution_passes_and_agrees_with_the_package(seed):
    report, text = run_grader(checks.exp_budget, _budget, seed)
    assert report.passed and "all cases pass" in text, text
    for causal in (False, True):
        args = (seed + 1, 7, 1000 + seed, 96)
        kw = dict(causal=causal, matmul_tflops=800.0, sfu_tflops=2.5)
        assert hopper.softmax_budget(*args, **kw) == pytest.approx(_budget(*args, **kw), rel=1e-12)


@pytest.mark.parametrize("bug", BUDGET_BUGS)
def test_budget_bugs_are_named(bug):
    kw = BUDGET_BUGS[bug]

    def buggy(B, H, N, d, **k):
        extra = dict(kw, exps_per_score=d) if kw.get("exps_per_score") == "d" else kw
        return _budget(B, H, N, d, **k, **extra)

    report, text = run_grader(checks.exp_budget, buggy, seed=4)
    assert not report.passed
    assert bug in report.diagnosis, text
    assert text.count("what is wrong") == 1


def test_budget_rejects_flashedus_own_counts():
    def via_traffic(B, H, N, d, *, causal, matmul_tflops, sfu_tflops):
        flops = traffic.attention_flops(B, H, N, N, d, causal=causal)
        return flops / matmul_tflops / 1e12, traffic.exp_count(B, H, N, N, causal=causal) / 3.9e12

    for shortcut, called in (
        (hopper.softmax_budget, "called flashedu.hopper.model.softmax_budget"),
        (via_traffic, "called flashedu.traffic.hardware.attention_flops"),
    ):
        report, text = run_grader(checks.exp_budget, shortcut, seed=0)
        assert not report.passed and report.diagnosis.startswith(called), text


def test_budget_rejects_what_is_not_a_pair_of_numbers():
    for wrong in (lambda *a, **k: 1.0, lambda *a, **k: (float("nan"), 1.0), lambda *a, **k: None):
        report, text = run_grader(checks.exp_budget, wrong, seed=0)
        assert not report.passed and "expected a pair of finite numbers" in text


# ------------------------------------------------------------------------------ 11.2 the quantiser


def _quantize(
    x,
    block,
    *,
    per_block=True,
    divide=True,
    guard=True,
    cast=True,
    rounding="nearest",
    n_scales=None,
):
    """A learner-style block quantiser with switches for the planted bugs."""
    N = x.shape[0]
    n = -(-N // block)
    rows = [x[i * block : (i + 1) * block] for i in range(n)]
    amax = torch.stack([r.abs().max() for r in rows]) if per_block else x.abs().max().repeat(n)
    scales = amax / 448.0 if divide else amax.clone()
    if guard:
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    y = x / scales.repeat_interleave(block)[:N, None]
    if rounding == "down":  # truncate toward zero on the e4m3 grid instead of rounding to nearest
        c = y.to(torch.float8_e4m3fn).float()
        y = torch.where(c.abs() > y.abs(), torch.nextafter(c, torch.zeros_like(c)) * 0.9375, c)
    codes = y.to(torch.float8_e4m3fn) if cast else y
    return codes, scales[:n_scales] if n_scales else scales


QUANT_BUGS = {
    "one global scale for the whole tensor": dict(per_block=False),
    "scale = max|x| instead of max|x| / 448": dict(divide=False),
    "a block of zeros has max 0": dict(guard=False),
    "codes are torch.float32": dict(cast=False),
    "expected ceil(N / block)": dict(n_scales=2),
    "not x / scale rounded to the nearest e4m3 value": dict(rounding="down"),
}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quantizer_solution_passes_and_flashedus_is_refused(seed):
    report, text = run_grader(checks.fp8_block_quantize, _quantize, seed)
    assert report.passed, text
    report, text = run_grader(checks.fp8_block_quantize, fp8.quantize, seed)
    assert report.diagnosis.startswith("called flashedu.hopper.fp8.quantize"), text


@pytest.mark.parametrize("bug", QUANT_BUGS)
def test_quantizer_bugs_are_named(bug):
    report, text = run_grader(
        checks.fp8_block_quantize, lambda x, block: _quantize(x, block, **QUANT_BUGS[bug]), seed=5
    )
    assert not report.passed
    assert bug in report.diagnosis, text
    assert text.count("what is wrong") == 1


def test_quantizer_line_shows_what_one_global_scale_would_cost():
    report, text = run_grader(checks.fp8_block_quantize, _quantize, seed=6)
    line = next(t for t in text.splitlines() if "4 blocks of" in t)
    per_block, one = (float(w.rstrip(",")) for w in (line.split()[-4], line.split()[-1]))
    assert per_block < 0.05 < 0.5 < one


# ------------------------------------------------------------------------------- 11.3 the rotation


def _hadamard(d):
    h = np.array([[1.0]])
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h


def _rotate(q, k, seed, *, rotate_k=True, normalise=True, signs=True, same=True, how="hadamard"):
    """A learner-style rotation with switches for the planted bugs."""
    d = q.shape[1]

    def matrix(s):
        rng = np.random.default_rng(s)
        if how == "permutation":
            return np.eye(d)[rng.permutation(d)] * rng.choice([-1.0, 1.0], size=d)
        if how == "identity":
            return np.eye(d)
        m = _hadamard(d) / (np.sqrt(d) if normalise else 1.0)
        return rng.choice([-1.0, 1.0], size=d)[:, None] * m if signs else m

    mq = matrix(seed)
    mk = mq if same else matrix(seed + 1)
    return q @ mq, (k @ mk if rotate_k else k)


ROT_BUGS = {
    "K was not rotated": dict(rotate_k=False),
    "divide the Hadamard matrix by sqrt(d)": dict(normalise=False),
    "by one orthogonal M": dict(same=False),
    "flip random signs (diag(s)) before H": dict(signs=False),
    "only the Hadamard matrix mixes every channel": dict(how="permutation"),
    "nothing was rotated": dict(how="identity"),
}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rotation_solution_passes_and_flashedus_is_refused(seed):
    report, text = run_grader(checks.hadamard_rotation, _rotate, seed)
    assert report.passed, text
    for shortcut, called in (
        (fp8.rotate, "called flashedu.hopper.fp8.rotate"),
        (lambda q, k, s: (q @ fp8.hadamard(q.shape[1]), k), "called flashedu.hopper.fp8.hadamard"),
    ):
        report, text = run_grader(checks.hadamard_rotation, shortcut, seed)
        assert report.diagnosis.startswith(called), text


@pytest.mark.parametrize("bug", ROT_BUGS)
def test_rotation_bugs_are_named(bug):
    report, text = run_grader(
        checks.hadamard_rotation, lambda q, k, s: _rotate(q, k, s, **ROT_BUGS[bug]), seed=7
    )
    assert not report.passed
    assert bug in report.diagnosis, text
    assert text.count("what is wrong") == 1


def test_rotation_without_seed_dependence_is_named():
    fixed = lambda q, k, s: _rotate(q, k, 0)
    report, text = run_grader(checks.hadamard_rotation, fixed, seed=8)
    assert not report.passed and "draw the random signs from the seed" in text, text


def test_rotation_along_the_wrong_axis_is_caught():
    def rows(q, k, s):  # an orthogonal matrix over the tokens: mixes rows instead of channels
        rng = np.random.default_rng(s)
        mix = [np.linalg.qr(rng.standard_normal((x.shape[0],) * 2))[0] for x in (q, k)]
        return mix[0] @ q, mix[1] @ k

    report, text = run_grader(checks.hadamard_rotation, rows, seed=9)
    assert not report.passed and "q_rot @ k_rot.T must equal q @ k.T" in text, text


# --------------------------------------------------------------------------------------- all three


GRADERS = [
    (checks.exp_budget, "flashedu.hopper.model.softmax_budget"),
    (checks.fp8_block_quantize, "flashedu.hopper.fp8.quantize"),
    (checks.hadamard_rotation, "flashedu.hopper.fp8.rotate"),
]


def test_stubs_report_not_attempted_and_the_formula_comes_on_request():
    def stub(*args, **kwargs):
        raise NotImplementedError("Exercise 11.1: fill me in")

    for grader, name in GRADERS:
        report, text = run_grader(grader, stub, seed=None)
        assert not report.attempted and not report.passed
        assert text == f"{grader.__name__}: not attempted yet"
        assert grader.solution_name == name
        lines = []
        checks.hint(grader, out=lines.append)
        assert lines and max(len(line) for line in lines) <= 100


def test_the_budget_formula_names_the_exact_causal_count():
    lines = []
    checks.hint(checks.exp_budget, out=lines.append)
    assert any("N (N + 1) / 2" in line for line in lines), lines


def test_a_wrong_budget_report_leads_with_one_case_and_how_to_rerun_it():
    def in_ms(B, H, N, d, **kw):
        return _budget(B, H, N, d, **kw, scale=1e3)

    report, text = run_grader(checks.exp_budget, in_ms, seed=3)
    lines = text.splitlines()
    assert lines[0].startswith("exp_budget: wrong (0 of 6 cases pass)"), text
    assert lines[1].startswith("  case 1: B=2 H=16 N=8192 d=128"), text
    assert report.diagnosis == "that is milliseconds: return seconds"
    assert "inputs: B=2, H=16, N=8192, d=128, causal=False" in text, text
    assert "checks.exp_budget(your_function, seed=3)" in text, text
    assert "checks.hint(checks.exp_budget)" in text, text


def test_graders_draw_fresh_inputs_unless_seeded():
    solutions = [_budget, _quantize, _rotate]
    for (grader, _), solution in zip(GRADERS, solutions):
        fresh = {run_grader(grader, solution, seed=None)[1] for _ in range(3)}
        assert len(fresh) > 1, grader.__name__
        assert run_grader(grader, solution, 3)[1] == run_grader(grader, solution, 3)[1]


def test_printed_lines_fit_100_columns_when_right():
    for (grader, _), solution in zip(GRADERS, [_budget, _quantize, _rotate]):
        _, text = run_grader(grader, solution, seed=0)
        assert max(len(line) for line in text.splitlines()) <= 100, text
