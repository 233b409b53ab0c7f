"""Graders for notebooks/07_triton_backward.ipynb: the backward's preprocess, P rebuilt from lse,
and the dK/dV and dQ kernels.

Exercise 7.1 asks for the Triton kernel of D = rowsum(dO * O), the first of the three backward
launches; exercise 7.2 for a Triton kernel that rebuilds a tile of P = exp(S - lse) from the
forward's log-sum-exp, as the dK/dV and dQ kernels do; exercises 7.3 and 7.4 for the whole dK/dV
and dQ kernels, from skeletons, launched by `triton_exercises.launch_dkdv` / `launch_dq` and graded
in stages like 6.3 (`_kernel_cases`) against the float64 gradients and, under the interpreter, the
bytes FA2 moves. Mistakes are named by float64 twins: products summed in fp16, a grid that misses
the ragged last rows, the (batch, head) offset forgotten, exp2 without log2(e), the scale
forgotten, NaN on rows that see no key, the causal offset top-left, D not subtracted, one GQA head
summed, the loop rounded down or started late, a TF32 dot. On a GPU a passing 7.3 or 7.4 is timed
beside flashedu's and PyTorch's whole backward (information only).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from .. import reference
from ..kernels.exercises import launch_dkdv, launch_dq
from ..testing import Tolerance, random_qkv
from . import _kernel_cases, _tile_mistakes, _triton, _triton_judge
from ._core import Case, grade, grader, rng_for
from .ch06 import device, one_head

__all__ = ["bwd_preprocess", "recompute_probabilities", "triton_dkdv", "triton_dq"]


PREPROCESS_FORMULA = """
delta[b, h, i] = sum_k do[b, h, i, k] * o[b, h, i, k], in float32. One program per block of rows of
one (batch, head): grid (cdiv(N, BLOCK), B * H); program_id(1) picks the (batch, head), whose rows
start at (b * H + h) * N * d in a contiguous tensor; load o and do with the mask rows < N, convert
both to float32, tl.sum(o * do, axis=1), store with the same mask.
"""


@grader("flashedu.kernels.bwd.preprocess", formula=PREPROCESS_FORMULA)
def bwd_preprocess(fn, *, seed=None, out=print):
    """Grade `fn(o, do) -> delta`: o and do (B, H, N, d) float16 tensors; delta (B, H, N) float32
    with delta[b, h, i] = sum_k do[b, h, i, k] * o[b, h, i, k], products and sum in float32. A
    Triton kernel of the learner's, one program per block of rows of one (batch, head)."""
    rng = rng_for(seed)
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))  # noqa: E731
    specs = [  # (label, (B, H, N, d), input scale, what is wrong when no known mistake matches)
        ("one block of rows", (1, 1, r(2, 15), 32), 1.0, "one block of rows is wrong"),
        ("ragged N", (1, 1, 16 * r(2, 4) + r(1, 15), 32), 1.0, "the ragged last rows are wrong"),
        ("B=2, H=3", (2, 3, r(17, 40), 16), 1.0, "with several (batch, head) pairs it is wrong"),
        ("d=128, values near 8", (1, 2, r(17, 40), 128), 8.0, "large values lose digits"),
    ]
    cases = []
    for label, (B, H, N, d), scale, hint in specs:
        o, do, _ = random_qkv(
            B, H, N, N, d, "float16", seed=rng, kind="torch", device=device(), scale=scale
        )
        o16, do16 = (x.cpu().numpy() for x in (o, do))
        mistakes, fp16 = _tile_mistakes.rowdot(o16, do16)
        expected = (o.double() * do.double()).sum(-1).cpu().numpy()
        tol = Tolerance(2e-7 * d * scale**2, 1e-6)  # float32 rounding of d products of size scale^2
        check = functools.partial(_check_rowdot, tol=tol, mistakes=mistakes, fp16=fp16)
        cases.append(Case(label, (o, do), expected, hint=hint, tol=tol, check=check))
    return grade(
        "bwd_preprocess", _triton.launched(fn), cases, solution_name=bwd_preprocess.solution_name,
        out=out,
    )  # fmt: skip


def _check_rowdot(got, expected, *, tol, mistakes, fp16) -> tuple[bool, str, str]:
    def extra(g) -> str:
        return _tile_mistakes.FP16_SUM if _triton_judge.sized_like(g, fp16, expected, tol) else ""

    return _triton_judge.check_against(got, expected, tol, mistakes, extra)


PROBABILITIES_FORMULA = """
p_ij = exp(s_ij - lse_i) with s_ij = q_i . k_j / sqrt(d); 0 where query i may not see key j
(causal: j > i + N_k - N_q) and on rows with lse_i = -inf. With tl.math.exp2: exp(x) = exp2(x *
log2(e)), so multiply both s and lse by log2(e). Zero the masked entries with tl.where after the
exponential, so that -inf - (-inf) never reaches the output.
"""


@grader("flashedu.kernels.intro.probabilities", formula=PROBABILITIES_FORMULA)
def recompute_probabilities(fn, *, seed=None, out=print):
    """Grade `fn(q, k, lse, *, causal=False) -> p`: q (N_q, d), k (N_k, d) float32 tensors of one
    head and the forward's lse (N_q,) float32 (natural log); p (N_q, N_k) =
    exp(q k^T / sqrt(d) - lse), 0 where query i may not see key j (causal bottom-right) and on rows
    with lse = -inf. A Triton kernel of the learner's, one program per tile."""
    import torch

    rng = rng_for(seed)
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))  # noqa: E731
    n_q, n_k = 16 * r(2, 3) + r(1, 15), 16 * r(2, 4) + r(1, 15)
    specs = [  # (label, (N_q, N_k, d), causal, input scale, what is wrong when nothing matches)
        ("one tile", (r(2, 12), r(2, 12), 16), False, 1.0, "one tile of p is wrong"),
        (f"ragged N_q={n_q}, N_k={n_k}", (n_q, n_k, 32), False, 1.0, "the ragged tiles are wrong"),
        ("d=64", (r(17, 40), r(17, 40), 64), False, 1.0, "p is wrong at d = 64"),
        (f"causal, N_q={n_q} < N_k={n_k + n_q}", (n_q, n_k + n_q, 32), True, 1.0,
         "the causal mask is wrong when N_q < N_k"),
        (f"causal, N_q={n_k + 5} > N_k={n_k}", (n_k + 5, n_k, 16), True, 1.0,
         "rows that see no key must be 0"),
        ("logits near 100", (n_q, n_k, 32), False, 6.0, "large logits go wrong"),
    ]  # fmt: skip
    cases = []
    for label, (N_q, N_k, d), causal, scale, hint in specs:
        q, k, _ = one_head(rng, N_q, N_k, d, scale=scale)
        p, lse = reference.probabilities(q[None, None].cpu(), k[None, None].cpu(), causal=causal)
        lse32 = torch.from_numpy(lse[0, 0]).to(device=q.device, dtype=torch.float32)
        q64, k64 = (x.double().cpu().numpy() for x in (q, k))
        lse64 = lse32.double().cpu().numpy()
        mistakes = _tile_mistakes.probabilities(q64, k64, lse64, causal)
        extra = _tile_mistakes.probabilities_extra(lse64)
        tol = Tolerance(1e-5, 1e-4)
        check = functools.partial(
            _triton_judge.check_against, tol=tol, mistakes=mistakes, extra=extra
        )
        cases.append(
            Case(label, (q, k, lse32), np.asarray(p[0, 0]), hint=hint, kwargs={"causal": causal},
                 tol=tol, check=check)
        )  # fmt: skip
    return grade(
        "recompute_probabilities", _triton.launched(fn), cases,
        solution_name=recompute_probabilities.solution_name, out=out,
    )  # fmt: skip


# ------------------------------------------------------- exercises 7.3 and 7.4: the whole kernels


def _grade_backward(kind: str, name: str, kernel, seed, out, solution_name):
    rng = rng_for(seed)
    hints = _kernel_cases.DQ_HINTS if kind == "dq" else _kernel_cases.DKDV_HINTS
    specs = _kernel_cases.stage_specs(rng, hints)
    cases = [_kernel_cases.BackwardCase(kind, rng, *spec) for spec in specs]
    call, graded = _kernel_cases.graded(kernel, cases)
    report = grade(name, call, graded, solution_name=solution_name, out=out)
    if report.passed:
        _time_backward(kind, kernel, out)
    return report


DKDV_FORMULA = """
The program keeps k_j, v_j and fp32 accumulators dk, dv; for each query head of its group and each
query block i that sees key block j (from the block holding row j0 - (N_k - N_q) when causal):
  P^T = exp(tl.dot(k, tl.trans(q_i)) * sm_scale - lse_i), 0 where hidden (rows >= N_q, causal)
  dv += tl.dot(P^T, dO_i);  dP^T = tl.dot(v, tl.trans(dO_i));  dS^T = P^T * (dP^T - D_i)
  dk += tl.dot(dS^T, q_i)
After the loops: store dk * sm_scale and dv once, masked cols < N_k.
"""


@grader("flashedu.kernels.solutions.dkdv_kernel", formula=DKDV_FORMULA)
def triton_dkdv(kernel, *, seed=None, out=print):
    """Grade exercise 7.3, the dK/dV kernel of the FlashAttention-2 backward: `kernel` is a
    @triton.jit function with the skeleton's signature, launched by
    `triton_exercises.launch_dkdv` (or a Python function `fn(do, q, k, v, lse, delta, *,
    causal=False) -> (dk, dv)` that launches kernels of its own). lse comes from the forward and
    delta = rowsum(do * o). Stages as in 6.3; each against the float64 gradients, and under the
    interpreter the bytes moved against FA2's."""
    return _grade_backward("dkdv", "triton_dkdv", kernel, seed, out, triton_dkdv.solution_name)


DQ_FORMULA = """
The program keeps q_i, dO_i, lse_i, D_i and an fp32 accumulator dq; for each key block j it sees
(0 .. the diagonal of its last row when causal):
  P = exp(tl.dot(q_i, tl.trans(k_j)) * sm_scale - lse_i), 0 where hidden (cols >= N_k, causal)
  dP = tl.dot(dO_i, tl.trans(v_j));  dS = P * (dP - D_i);  dq += tl.dot(dS, k_j)
After the loop: store dq * sm_scale once, masked rows < N_q.
"""


@grader("flashedu.kernels.solutions.dq_kernel", formula=DQ_FORMULA)
def triton_dq(kernel, *, seed=None, out=print):
    """Grade exercise 7.4, the dQ kernel of the FlashAttention-2 backward: `kernel` is a
    @triton.jit function with the skeleton's signature, launched by `triton_exercises.launch_dq`
    (or a Python function `fn(do, q, k, v, lse, delta, *, causal=False) -> dq` that launches
    kernels of its own). Stages as in 6.3; each against the float64 gradient, and under the
    interpreter the bytes moved against FA2's."""
    return _grade_backward("dq", "triton_dq", kernel, seed, out, triton_dq.solution_name)


def _time_backward(kind: str, kernel, out) -> None:
    """On a GPU: the learner's dK/dV or dQ kernel beside flashedu's whole backward and PyTorch's
    (information only: the two whole backwards also run the preprocess and the other kernel)."""
    if not torch.cuda.is_available():
        return
    from .. import kernels as triton_attention

    shape = (4, 16, 4096, 64)
    q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.float16) for _ in range(4))
    o, lse = triton_attention.forward(q, k, v, causal=True)
    delta = (o.float() * do.float()).sum(-1)
    args = (do, q, k, v, lse, delta)
    launch = launch_dq if kind == "dq" else launch_dkdv
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=True)

    def yours():
        if _triton.is_kernel(kernel):
            return launch(kernel, *args, causal=True)
        return kernel(*args, causal=True)

    _triton.gpu_timing(
        f"your {'dQ' if kind == 'dq' else 'dK/dV'} kernel beside whole backwards, B=4 H=16 "
        "N=4096 d=64 fp16 causal",
        {
            "your kernel": yours,
            "flashedu backward": lambda: triton_attention.backward(
                do, q, k, v, o, lse, causal=True
            ),
            "SDPA backward": lambda: torch.autograd.grad(sdpa, (qg, kg, vg), do, retain_graph=True),
        },
        out=out,
    )
