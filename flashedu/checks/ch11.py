"""Graders for notebooks/11_hopper.ipynb: the exponential budget, an FP8 block quantiser, rotation.

Exercise 11.1 asks for the seconds of matmul and of exponentials in one forward (the solution is
`hopper.model.softmax_budget`). The counts are exact: one exp and 4 d matmul FLOPs per visible
score, N^2 per head without a mask and N (N + 1) / 2 with the causal one, the diagonal included
(as `traffic.attention_flops` and `traffic.exp_count` count them). The x0.5 that benchmark TFLOP/s
use (`traffic.benchmark_flops`) is one of the named slips, beside the whole square counted under a
causal mask, one matmul, an exp per multiply-add, TFLOP/s taken as FLOP/s and the pair reversed;
answers are compared as ratios to the right pair, so the times' magnitude does not matter.
Exercise 11.2 asks for e4m3 codes with one scale per block of rows (`hopper.fp8.quantize`); the
grader checks the method, not only the values: one global scale, scale = max instead of max / 448
and a zero scale are named, and each line shows the worst block's error beside that of one global
scale. Exercise 11.3 asks for the random Hadamard rotation of Q and K (`hopper.fp8.rotate`): the
scores must not change, an outlier must be spread, and the signs must come from the seed. The
grader reads the learner's matrix M off a rotation of the identity (stacked over q): it must be one
fixed matrix whose entries are all +-1/sqrt(d), so a dense random orthogonal matrix, a signed
permutation or a rotation that depends on the data is named whatever the inputs. All three
run with flashedu's own implementations off limits; `checks.hint` prints each formula.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..hopper import fp8
from ..hopper import model as hopper
from ._core import Case, Report, grade, grader, number_or_none, rng_for
from ._method import forbid_flashedu

__all__ = ["exp_budget", "fp8_block_quantize", "hadamard_rotation"]

_REL = 1e-9

_SLIPS = [  # (what went wrong, factor on t_matmul, factor on t_exp); strings name a symbol
    ("one matmul counted: Q K^T and P V are 2 N^2 d FLOPs each (2 per multiply-add)", 0.5, 1),
    ("an exponential per multiply-add: there is one exp per score, B H N^2 of them", 1, "d"),
    ("TFLOP/s used as FLOP/s: multiply the rates by 1e12", 1e12, 1e12),
    ("that is milliseconds: return seconds", 1e3, 1e3),
    ("B H left out: every (batch, head) pair does the work", "1/BH", "1/BH"),
    ("the rates are swapped: matmuls run at matmul_tflops, exps at sfu_tflops", "mm/sfu", "sfu/mm"),
]
_CAUSAL_SLIPS = [  # "all": the whole N^2 square per head; "half": N^2 / 2
    ("the causal exps count the whole square: a masked score needs no exp", 1, "all"),
    ("the causal matmul FLOPs count the whole square: masked scores need no products", "all", 1),
    ("causal was ignored: the mask leaves N (N + 1) / 2 of the N^2 scores per head", "all", "all"),
    (
        "x0.5 is the benchmark convention; this exercise counts the visible scores exactly, "
        "N (N + 1) / 2 per head (the diagonal too)",
        "half",
        "half",
    ),
]


def _budget_mistakes(B, H, N, d, causal, mm, sfu) -> dict[str, tuple[float, float]]:
    """Each slip's (t_matmul, t_exp) divided by the right pair: ratios, so that a match is judged
    relative to the size of the answer (the times span many orders of magnitude)."""
    sym = {"d": d, "1/BH": 1 / (B * H), "mm/sfu": mm / sfu, "sfu/mm": sfu / mm}
    visible = (N + 1) / (2 * N)  # the causal share of the square, N (N + 1) / 2 of N^2
    sym.update({"all": 1 / visible, "half": 0.5 / visible})
    slips = _SLIPS + (_CAUSAL_SLIPS if causal else [])
    wrong = {why: (float(sym.get(a, a)), float(sym.get(b, b))) for why, a, b in slips}
    tm, te = hopper.softmax_budget(B, H, N, d, causal=causal, matmul_tflops=mm, sfu_tflops=sfu)
    wrong["returned (t_exp, t_matmul): the order is (t_matmul, t_exp)"] = (te / tm, tm / te)
    return wrong


def _pair(got) -> tuple[float, float] | None:
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return None
    a, b = number_or_none(got[0]), number_or_none(got[1])
    return None if a is None or b is None else (a, b)


class _Ratios(tuple):
    """The learner's (t_matmul, t_exp) divided by the right pair; keeps the answer in seconds."""

    seconds: tuple[float, float]


def _as_ratios(args, kwargs, right):
    """Run fn and hand the grader its answer as ratios to the right pair (anything that is not a
    pair of finite numbers is passed on as it is, for the check to name)."""

    def call(fn):
        got = fn(*args, **kwargs)
        g = _pair(got)
        if g is None:
            return got
        ratios = _Ratios((g[0] / right[0], g[1] / right[1]))
        ratios.seconds = g
        return ratios

    return call


def _budget_check(right: tuple[float, float]):
    def check(got, expected) -> tuple[bool, str]:
        if not isinstance(got, _Ratios):
            return False, f"expected a pair of finite numbers (t_matmul, t_exp), got {got!r}"
        g = got.seconds
        detail = f"matmul {g[0]:.3e} s, exp {g[1]:.3e} s"
        if all(abs(r - 1) <= _REL for r in got):
            return True, f"{detail} ({g[1] / g[0]:.2f}x)"
        return False, f"{detail}, expected {right[0]:.3e}, {right[1]:.3e}"

    return check


_BUDGET_FORMULA = """
visible scores per head: N^2, or N (N + 1) / 2 with the causal mask (the diagonal included)
t_matmul = 4 d * B H * visible / (matmul_tflops * 1e12)     (Q K^T and P V, 2 FLOPs per FMA)
t_exp    =     B H * visible / (sfu_tflops * 1e12)          (one exp per visible score)
"""


@grader("flashedu.hopper.model.softmax_budget", formula=_BUDGET_FORMULA)
def exp_budget(fn, *, seed=None, out=print) -> Report:
    """Exercise 11.1: `fn(B, H, N, d, *, causal, matmul_tflops, sfu_tflops)` -> (t_matmul, t_exp) in
    seconds for one forward with N_q = N_k = N: 4 d matmul FLOPs and one exponential per visible
    score, at the two rates, given in TFLOP/s. The count is exact: B H N^2 scores without a mask,
    B H N (N + 1) / 2 with the causal one (as `traffic.attention_flops` and `traffic.exp_count`
    count them); the x0.5 of benchmark TFLOP/s (`traffic.benchmark_flops`) is a named slip."""
    rng = rng_for(seed)
    specs = [
        (2, 16, 8192, 128, False, 989.4, 3.9),
        (4, 16, 4096, 64, False, 989.4, 3.9),
        (2, 16, 8192, 128, True, 989.4, 3.9),
        (2, 16, 8192, 128, False, 1978.9, 3.9),
    ]
    for c in (False, True):
        B, H, N = int(rng.integers(1, 9)), int(rng.integers(3, 33)), int(rng.integers(256, 32769))
        d, mm, sfu = int(rng.choice([64, 96, 128, 256])), rng.uniform(300, 2000), rng.uniform(1, 8)
        specs.append((B, H, N, d, c, float(mm), float(sfu)))
    cases = []
    for B, H, N, d, c, mm, sfu in specs:
        kw = {"causal": c, "matmul_tflops": mm, "sfu_tflops": sfu}
        right = hopper.softmax_budget(B, H, N, d, **kw)
        cases.append(
            Case(
                f"B={B} H={H} N={N} d={d}{' causal' if c else ''} {mm:.0f}/{sfu:.1f}",
                (B, H, N, d),
                (1.0, 1.0),
                kwargs=kw,
                hint="4 d FLOPs and one exp per visible score, B H of everything; rates x 1e12",
                check=_budget_check(right),
                mistakes=_budget_mistakes(B, H, N, d, c, mm, sfu),
                call=_as_ratios((B, H, N, d), kw, right),
                inputs=f"B={B}, H={H}, N={N}, d={d}, causal={c}, "
                f"matmul_tflops={mm:.6g}, sfu_tflops={sfu:.6g}",
            )
        )
    return grade("exp_budget", fn, cases, out=out, forbid=True)


def _error_bound_ok(x: torch.Tensor, deq: torch.Tensor, scale_rows: torch.Tensor) -> bool:
    """Round to nearest in e4m3 is off by at most half a step: 2^-4 of the value for normal
    numbers, 2^-10 of the scale below e4m3's smallest normal, 2^-6."""
    bound = torch.maximum(x.abs() * 2.0**-4, scale_rows * 2.0**-10) * (1 + 1e-6) + 1e-30
    return bool(((deq - x).abs() <= bound).all())


def _worst_block(x: torch.Tensor, deq: torch.Tensor, block: int) -> float:
    """The largest rms(deq - x) / rms(x) over the blocks of rows that are not all zero."""
    errs = [
        fp8.rmse(deq[i : i + block], x[i : i + block])
        / fp8.rmse(x[i : i + block], 0 * x[i : i + block])
        for i in range(0, x.shape[0], block)
        if x[i : i + block].abs().amax() > 0
    ]
    return max(errs)


def _no(detail: str, why: str) -> tuple[bool, str, str]:
    """A failed case: what the line shows, and what is wrong."""
    return False, detail, why


def _quant_check(x: torch.Tensor, block: int):
    N = x.shape[0]
    n_blocks = -(-N // block)
    right = fp8.quantize(x, block)[1]  # (n_blocks,)
    amax = right * fp8.E4M3_MAX
    g = x.abs().amax() / fp8.E4M3_MAX  # one global scale
    global_err = _worst_block(x, (x / g).to(torch.float8_e4m3fn).float() * g, block)

    def check(got, expected) -> tuple[bool, str]:
        if (
            not isinstance(got, (tuple, list))
            or len(got) != 2
            or not all(isinstance(t, torch.Tensor) for t in got)
        ):
            return False, f"expected (codes, scales), two torch tensors, got {type(got).__name__}"
        codes, scales = got[0], got[1].detach().float().reshape(-1)
        if codes.dtype != torch.float8_e4m3fn:
            why = f"codes are {codes.dtype}: cast x / scale with .to(torch.float8_e4m3fn)"
            return False, f"codes are {codes.dtype}", why
        if tuple(codes.shape) != tuple(x.shape):
            return False, f"codes have shape {tuple(codes.shape)}, expected {tuple(x.shape)}"
        if (
            scales.numel() == 1
            and n_blocks > 1
            or (
                scales.numel() == n_blocks
                and n_blocks > 1
                and bool((scales == scales[0]).all())
                and not bool((right == right[0]).all())
            )
        ):
            return _no(
                f"{scales.numel()} scale(s), all equal",
                "one global scale for the whole tensor: each block of rows needs its "
                "own, max|x| over the block / 448",
            )
        if scales.numel() != n_blocks:
            return _no(
                f"{scales.numel()} scales for {N} rows",
                f"{scales.numel()} scales, expected ceil(N / block) = {n_blocks}: one per "
                "block of rows, the last block may be shorter",
            )
        if (
            torch.isnan(codes.float()).any()
            or not torch.isfinite(scales).all()
            or (scales <= 0).any()
        ):
            return _no(
                "NaN codes or a scale that is not positive",
                "a block of zeros has max 0: give it scale 1 (any positive number) "
                "instead of dividing by 0",
            )
        if torch.allclose(scales, amax, rtol=1e-5, atol=0):
            return _no(
                "scales equal max|x| over each block",
                "scale = max|x| instead of max|x| / 448: the codes use only [-1, 1] of "
                "e4m3's range, where its steps are as coarse as 2^-9",
            )
        if not torch.allclose(scales, right, rtol=1e-5, atol=0):
            return False, "scales differ", "each scale is max|x| over its block of rows / 448"
        deq = fp8.dequantize(codes, scales, block)
        detail = f"worst block rmse {_worst_block(x, deq, block):.1e}, one scale {global_err:.1e}"
        rows = scales.repeat_interleave(block)[:N, None].expand_as(x)
        if not _error_bound_ok(x, deq, rows):
            return False, detail, "codes are not x / scale rounded to the nearest e4m3 value"
        return True, detail

    return check


_QUANT_FORMULA = """
block i = rows [i * block, (i + 1) * block), the last one possibly shorter
scale_i = max|x[block i]| / 448          (448: e4m3's largest value; 1 for a block of zeros)
codes   = (x / scale of the row's block).to(torch.float8_e4m3fn)    (rounds to nearest)
"""


@grader("flashedu.hopper.fp8.quantize", formula=_QUANT_FORMULA)
def fp8_block_quantize(fn, *, seed=None, out=print) -> Report:
    """Exercise 11.2: `fn(x, block)` for x (N, d) float32 -> (codes (N, d) torch.float8_e4m3fn,
    scales (ceil(N / block),) float32) with scale = max|x| over the block's rows / 448 and
    codes = x / scale rounded to e4m3 (a block of zeros: scale 1)."""
    rng = rng_for(seed)
    g = torch.Generator().manual_seed(int(rng.integers(2**31)))
    block, d = int(rng.choice([16, 32, 64])), int(rng.choice([16, 32, 64]))
    randn = lambda *s: torch.randn(*s, generator=g)
    mags = torch.tensor([1e-3, 1.0, 1e2, 1e4]).repeat_interleave(block)[:, None]
    outlier = randn(3 * block, d)
    outlier[block + int(rng.integers(block)), int(rng.integers(d))] = 1e3
    zeros = randn(2 * block + 3, d)
    zeros[block : 2 * block] = 0
    specs = [
        (f"one block ({block}, {d})", randn(block, d)),
        (f"4 blocks of 1e-3, 1, 1e2, 1e4 ({4 * block}, {d})", randn(4 * block, d) * mags),
        (f"ragged: N = 3 x {block} + 5", randn(3 * block + 5, d) * 3),
        ("an outlier of 1000 in block 1", outlier),
        ("a block of zeros", zeros),
    ]
    cases = [
        Case(
            label,
            (x, block),
            None,
            check=_quant_check(x, block),
            hint="scale_i = max|rows of block i| / 448; codes = (x / row's scale) as e4m3",
        )
        for label, x in specs
    ]
    return grade("fp8_block_quantize", fn, cases, out=out, forbid=True)


_PERMUTED = (
    "M is a (signed) permutation: it is orthogonal, so the scores stay, but it moves an outlier "
    "instead of spreading it; only the Hadamard matrix mixes every channel into all d"
)
_DENSE = (
    "M is orthogonal but not a Hadamard matrix: every entry of diag(s) H / sqrt(d) is "
    "+-1/sqrt(d). A dense random orthogonal matrix spreads an outlier only on average, and costs "
    "a d x d matmul where the Hadamard transform takes d log2(d) additions"
)
_NOT_LINEAR = (
    "the rotation depends on the values of q: M must be one fixed matrix, made from d and the "
    "seed alone, so that q and k (and every later token) get the same rotation"
)
_NOT_SPREAD = (
    "the outlier was not spread: with every entry of M +-1/sqrt(d), each channel reaches all d"
)
_ALIGNED = (
    "rows that line up with Hadamard rows became spikes: flip random signs (diag(s)) before H"
)


def _rotation_check(fn, q: np.ndarray, k: np.ndarray, seed: int, *, spread: str, reseed: bool):
    s = q @ k.T
    d = q.shape[1]

    def check(got, expected) -> tuple[bool, str]:
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            return False, f"expected (q_rot, k_rot), got {type(got).__name__}"
        qr, kr = (np.asarray(t, dtype=np.float64) for t in got)
        if qr.shape != q.shape or kr.shape != k.shape:
            return False, f"shapes {qr.shape}, {kr.shape}, expected {q.shape}, {k.shape}"
        err = np.abs(qr @ kr.T - s).max() / np.abs(s).max()
        detail = f"scores rel. error {err:.1e}; crest {fp8.crest(q):.1f} -> {fp8.crest(qr):.1f}"
        if err > 1e-9:
            return False, detail, _why_scores_moved(q, k, qr, kr, s, d)
        if np.allclose(qr, q) and np.allclose(kr, k):
            return False, detail, "nothing was rotated: q_rot equals q (multiply by M)"
        why = _matrix_problem(fn, q, k, seed, qr)
        if why:
            return False, detail, why
        if spread and fp8.crest(qr) > max(6.0, fp8.crest(q) / 3):
            return False, detail, spread
        if reseed:
            try:
                with forbid_flashedu():
                    q2 = np.asarray(fn(q, k, seed + 1)[0], dtype=np.float64)
            except Exception as e:  # the learner's bug (or a shortcut), reported
                return False, f"{detail}; with seed {seed + 1} it raised {type(e).__name__}: {e}"
            if np.allclose(q2, qr):
                return (
                    False,
                    f"{detail}; seeds {seed} and {seed + 1} agree",
                    ("the same rotation for every seed: draw the random signs from the seed"),
                )
        return True, detail

    return check


def _matrix_problem(fn, q: np.ndarray, k: np.ndarray, seed: int, qr: np.ndarray) -> str:
    """The learner's M, read off by rotating the identity stacked over q: '' when M is one fixed
    matrix with every entry +-1/sqrt(d) (a Hadamard matrix, rows signed or not), else what it is.
    Deterministic: it does not depend on how well a given input happens to be spread."""
    d = q.shape[1]
    try:
        with forbid_flashedu():
            rot = np.asarray(fn(np.vstack([np.eye(d), q]), k, seed)[0], dtype=np.float64)
    except Exception as e:  # the learner's bug, reported
        return f"rotating the identity stacked over q raised {type(e).__name__}: {e}"[:200]
    if rot.shape != (d + q.shape[0], d):
        return _NOT_LINEAR
    M = rot[:d]
    if not (np.allclose(rot[d:], q @ M, atol=1e-9) and np.allclose(qr, q @ M, atol=1e-9)):
        return _NOT_LINEAR
    if np.allclose(np.abs(M), 1 / math.sqrt(d), rtol=0, atol=1e-9):
        return ""
    nonzero = np.abs(M) > 1e-9
    if (nonzero.sum(axis=1) == 1).all() and np.allclose(np.abs(M[nonzero]), 1.0):
        return _PERMUTED
    return _DENSE


def _why_scores_moved(q, k, qr, kr, s, d) -> str:
    if np.allclose(kr, k) and not np.allclose(qr, q):
        return "K was not rotated: rotate Q and K by the same matrix M, or the scores change"
    if np.allclose(qr, q) and not np.allclose(kr, k):
        return "Q was not rotated: rotate Q and K by the same matrix M, or the scores change"
    if np.allclose(qr @ kr.T, d * s, rtol=1e-6, atol=1e-9 * np.abs(s).max()):
        return "the scores grew by d: divide the Hadamard matrix by sqrt(d) (H H^T = d I)"
    return (
        "q_rot @ k_rot.T must equal q @ k.T: rotate the head dim (the last axis) of Q and K "
        "by one orthogonal M = diag(signs) H / sqrt(d)"
    )


_ROTATE_FORMULA = """
H_1 = [1],  H_2n = [[H_n, H_n], [H_n, -H_n]]       (Sylvester; H H^T = d I)
s   = d random signs from np.random.default_rng(seed)
M   = diag(s) H / sqrt(d)                          (orthogonal, so (q M)(k M)^T = q k^T)
return q @ M, k @ M
"""


@grader("flashedu.hopper.fp8.rotate", formula=_ROTATE_FORMULA)
def hadamard_rotation(fn, *, seed=None, out=print) -> Report:
    """Exercise 11.3: `fn(q, k, seed)` for float64 arrays q (N_q, d), k (N_k, d), d a power of
    two -> (q @ M, k @ M) with M = diag(s) H / sqrt(d), H the Sylvester Hadamard matrix and s random
    signs drawn from `seed`."""
    rng = rng_for(seed)
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))
    n = lambda *s: rng.standard_normal(s)
    chan = n(r(8, 24), 64)
    chan[:, r(0, 63)] *= 100
    spike = n(r(8, 24), 128)
    spike[r(0, spike.shape[0] - 1), r(0, 127)] = 1e3
    aligned = 3 * math.sqrt(64) * fp8.hadamard(64)[rng.choice(64, size=8, replace=False)]
    specs = [
        ("d=16, random q and k", n(r(4, 12), 16), n(r(4, 12), 16), "", False),
        ("N_q != N_k, d=64", n(r(3, 9), 64), n(r(20, 40), 64), "", False),
        ("one channel 100x larger, d=64", chan, n(r(8, 24), 64), _NOT_SPREAD, False),
        ("one entry of 1000, d=128", spike, n(r(8, 24), 128), _NOT_SPREAD, False),
        ("rows equal to Hadamard rows, d=64", aligned, n(8, 64), _ALIGNED, False),
        ("the same input, two seeds, d=32", n(r(4, 12), 32), n(r(4, 12), 32), "", True),
    ]
    seeds = [r(0, 10**6) for _ in specs]
    cases = [
        Case(
            label,
            (q, k, sd),
            None,
            check=_rotation_check(fn, q, k, sd, spread=spread, reseed=reseed),
            hint="M = diag(random signs) @ H / sqrt(d); return (q @ M, k @ M)",
            inputs=f"q {q.shape}, k {k.shape}, seed={sd}",
        )
        for (label, q, k, spread, reseed), sd in zip(specs, seeds)
    ]
    return grade("hadamard_rotation", fn, cases, out=out, forbid=True)
