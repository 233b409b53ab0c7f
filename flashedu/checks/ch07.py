"""Graders for notebooks/07_triton_backward.ipynb: the backward's preprocess, P rebuilt from lse,
and the dK/dV and dQ kernels.

Exercise 7.1 asks for the Triton kernel of D = rowsum(dO * O), the first of the three backward
launches; exercise 7.2 for a Triton kernel that rebuilds a tile of P = exp(S - lse) from the
forward's log-sum-exp, as the dK/dV and dQ kernels do; exercises 7.3 and 7.4 for the whole dK/dV and
dQ kernels, from skeletons, graded in stages like 6.3 (`_kernel_cases`) against the float64
gradients and, under the interpreter, the bytes FA2 moves. As in chapter 06 the learner hands over
the `@triton.jit` kernel and the grader launches it itself (`kernels.exercises.launch_preprocess`,
`launch_probabilities`, `launch_dkdv`, `launch_dq`) with its own blocks into NaN-filled outputs;
tiles larger than its blocks, and programs that store outside their own rows or tile, are named.
Mistakes are named by float64 twins: products summed in fp16, the (batch, head) offset forgotten,
exp2 without log2(e), the scale forgotten, NaN on rows that see no key, the causal offset top-left,
D not subtracted, one GQA head summed, the loop rounded down or started late, a TF32 dot. On a GPU a
passing 7.3 or 7.4 is timed beside flashedu's and PyTorch's whole backward (information only).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from .. import reference
from ..kernels.exercises import launch_dkdv, launch_dq, launch_preprocess, launch_probabilities
from ..testing import Tolerance, random_qkv
from . import _kernel_cases, _tile_mistakes, _triton, _triton_judge
from ._core import grade, grader, rng_for
from .ch06 import one_head

__all__ = ["bwd_preprocess", "recompute_probabilities", "triton_dkdv", "triton_dq"]


PREPROCESS_FORMULA = """
delta[b, h, i] = sum_k do[b, h, i, k] * o[b, h, i, k], in float32. One program per BLOCK_M rows of
one (batch, head): the grader launches (cdiv(N, BLOCK_M), B * H) programs; program_id(1) = b * H + h
picks the (batch, head), whose rows start at O + b * stride_ob + h * stride_oh (likewise DO and
DELTA); rows = program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M); load o and do with the mask
rows < N, convert both to float32, tl.sum(o * do, axis=1), store with the same mask.
"""


@grader("flashedu.kernels.solutions.preprocess_kernel", formula=PREPROCESS_FORMULA)
def bwd_preprocess(kernel, *, seed=None, out=print):
    """Grade exercise 7.1, `kernel(O, DO, DELTA, stride_ob, stride_oh, stride_om, stride_db,
    stride_dh, stride_dm, stride_deltab, stride_deltah, N, H, HEAD_DIM, BLOCK_M)`, a @triton.jit
    kernel: o and do (B, H, N, d) float16, delta (B, H, N) float32 with delta[b, h, i] =
    sum_k do[b, h, i, k] * o[b, h, i, k], products and sum in float32, one program per BLOCK_M
    rows of one (batch, head). The grader launches it (`kernels.exercises.launch_preprocess`) with
    its own BLOCK_M into a NaN-filled delta."""
    rng = rng_for(seed)
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))
    bs = _kernel_cases.BLOCK
    specs = [  # (label, (B, H, N, d), input scale, BLOCK_M, what is wrong when nothing matches)
        ("one block of rows", (1, 1, r(2, bs - 1), 32), 1.0, bs, "one block of rows is wrong"),
        ("ragged N", (1, 1, bs * r(2, 4) + r(1, bs - 1), 32), 1.0, bs,
         "the ragged last rows are wrong"),
        ("B=2, H=3", (2, 3, r(bs + 1, 3 * bs), 16), 1.0, bs,
         "with several (batch, head) pairs it is wrong"),
        (f"d=128, values near 8, BLOCK_M={2 * bs}", (1, 2, r(2 * bs + 1, 4 * bs), 128), 8.0,
         2 * bs, "large values lose digits"),
    ]  # fmt: skip
    cases = []
    for label, (B, H, N, d), scale, bm, hint in specs:
        o, do, _ = random_qkv(B, H, N, N, d, "float16", seed=rng, kind="numpy", scale=scale)
        mistakes, fp16 = _tile_mistakes.rowdot(o, do)
        expected = (o.astype(np.float64) * do.astype(np.float64)).sum(-1)
        tol = Tolerance(2e-7 * d * scale**2, 1e-6)  # float32 rounding of d products of size scale^2
        check = functools.partial(_check_rowdot, tol=tol, mistakes=mistakes, fp16=fp16)
        o_t, do_t = (_triton.gapped(x, torch.float16) for x in (o, do))

        def launch(kernel, out_d, o_t=o_t, do_t=do_t, bm=bm):
            return launch_preprocess(kernel, o_t, do_t, block_m=bm, out=out_d)

        cases.append(
            _triton_judge.tile_case(
                label, launch, {o_t.data_ptr(): "O", do_t.data_ptr(): "dO"}, (B, H, N), expected,
                hint, check, first=not cases, out_name="D",
                tiles=[_triton.Tile(t, 2, bm, "rows", "BLOCK_M", dn)
                       for t, dn in (("O", "read"), ("dO", "read"), ("D", "write"))],
                owner_axes=[(2, bm, 0, "rows")],
                grader="bwd_preprocess", example="my_preprocess_kernel",
                inputs=f"o, do ({B}, {H}, {N}, {d}) float16, values near {scale:g}, BLOCK_M={bm}",
            )
        )  # fmt: skip
    return grade(
        "bwd_preprocess", kernel, cases, solution_name=bwd_preprocess.solution_name, out=out
    )


def _check_rowdot(got, expected, *, tol, mistakes, fp16) -> tuple[bool, str, str]:
    def extra(g) -> str:
        return _tile_mistakes.FP16_SUM if _triton_judge.sized_like(g, fp16, expected, tol) else ""

    return _triton_judge.check_against(got, expected, tol, mistakes, extra)


PROBABILITIES_FORMULA = """
p_ij = exp(s_ij - lse_i) with s_ij = q_i . k_j * sm_scale; 0 where query i may not see key j
(causal: j > i + N_k - N_q) and on rows with lse_i = -inf. With tl.math.exp2: exp(x) = exp2(x *
log2(e)), so multiply both s and lse by log2(e). Zero the masked entries with tl.where after the
exponential, so that -inf - (-inf) never reaches the output. One program per tile, as in 6.1.
"""


@grader("flashedu.kernels.solutions.probabilities_kernel", formula=PROBABILITIES_FORMULA)
def recompute_probabilities(kernel, *, seed=None, out=print):
    """Grade exercise 7.2, `kernel(Q, K, LSE, P, stride_qm, stride_kn, stride_pm, N_q, N_k,
    sm_scale, CAUSAL, HEAD_DIM, BLOCK_M, BLOCK_N)`, a @triton.jit kernel: q (N_q, d), k (N_k, d)
    float32 of one head and the forward's lse (N_q,) float32 (natural log); p (N_q, N_k) =
    exp(q k^T * sm_scale - lse), 0 where query i may not see key j (causal bottom-right) and on
    rows with lse = -inf, one program per (BLOCK_M, BLOCK_N) tile. The grader launches it
    (`kernels.exercises.launch_probabilities`) with its own blocks into a NaN-filled p."""
    rng = rng_for(seed)
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))
    bs = _kernel_cases.BLOCK
    n_q, n_k = bs * r(2, 3) + r(1, bs - 1), bs * r(2, 4) + r(1, bs - 1)
    specs = [  # (label, (N_q, N_k, d), causal, input scale, blocks, what is wrong otherwise)
        ("one tile", (r(2, 12), r(2, 12), 16), False, 1.0, (bs, bs), "one tile of p is wrong"),
        (f"ragged N_q={n_q}, N_k={n_k}", (n_q, n_k, 32), False, 1.0, (bs, bs),
         "the ragged tiles are wrong"),
        (f"d=64, blocks {bs} x {2 * bs}", (r(bs + 1, 3 * bs), r(2 * bs + 1, 4 * bs), 64), False,
         1.0, (bs, 2 * bs), "p is wrong at d = 64"),
        (f"causal, N_q={n_q} < N_k={n_k + n_q}", (n_q, n_k + n_q, 32), True, 1.0, (bs, bs),
         "the causal mask is wrong when N_q < N_k"),
        (f"causal, N_q={n_k + 5} > N_k={n_k}, blocks {2 * bs} x {bs}", (n_k + 5, n_k, 16), True,
         1.0, (2 * bs, bs), "rows that see no key must be 0"),
        ("logits near 100", (n_q, n_k, 32), False, 6.0, (bs, bs), "large logits go wrong"),
    ]  # fmt: skip
    cases = []
    for label, (N_q, N_k, d), causal, scale, (bm, bn), hint in specs:
        q, k, _ = one_head(rng, N_q, N_k, d, scale=scale)
        p, lse = reference.probabilities(q[None, None].cpu(), k[None, None].cpu(), causal=causal)
        lse32 = np.asarray(lse[0, 0], dtype=np.float32)
        q64, k64 = (x.double().cpu().numpy() for x in (q, k))
        lse64 = lse32.astype(np.float64)
        mistakes = _tile_mistakes.probabilities(q64, k64, lse64, causal)
        extra = _tile_mistakes.probabilities_extra(lse64)
        tol = Tolerance(1e-5, 1e-4)
        check = functools.partial(
            _triton_judge.check_against, tol=tol, mistakes=mistakes, extra=extra
        )
        q, k = (_triton.gapped(x[None, None].cpu().numpy(), torch.float32)[0, 0] for x in (q, k))
        lse_t = _triton.gapped(lse32[None, None, :, None], torch.float32)[0, 0, :, 0]

        def launch(kernel, out_p, q=q, k=k, lse_t=lse_t, causal=causal, bm=bm, bn=bn):
            return launch_probabilities(
                kernel, q, k, lse_t, causal=causal, block_m=bm, block_n=bn, out=out_p
            )

        cases.append(
            _triton_judge.tile_case(
                label, launch, {q.data_ptr(): "Q", k.data_ptr(): "K", lse_t.data_ptr(): "lse"},
                (N_q, N_k), np.asarray(p[0, 0]), hint, check, first=not cases, out_name="P",
                tiles=[
                    _triton.Tile("Q", 0, bm, "rows", "BLOCK_M"),
                    _triton.Tile("K", 0, bn, "columns", "BLOCK_N"),
                    _triton.Tile("P", 0, bm, "rows", "BLOCK_M", "write"),
                    _triton.Tile("P", 1, bn, "columns", "BLOCK_N", "write"),
                ],
                owner_axes=[(0, bm, 0, "rows"), (1, bn, 1, "columns")],
                grader="recompute_probabilities", example="my_probabilities_kernel",
                inputs=f"q ({N_q}, {d}), k ({N_k}, {d}) float32 (values near {scale:g}), lse, "
                f"causal={causal}, BLOCK_M={bm}, BLOCK_N={bn}",
            )
        )  # fmt: skip
    return grade(
        "recompute_probabilities", kernel, cases,
        solution_name=recompute_probabilities.solution_name, out=out,
    )  # fmt: skip


# ------------------------------------------------------- exercises 7.3 and 7.4: the whole kernels


def _grade_backward(kind: str, name: str, kernel, seed, out, solution_name):
    rng = rng_for(seed)
    hints = _kernel_cases.DQ_HINTS if kind == "dq" else _kernel_cases.DKDV_HINTS
    specs = _kernel_cases.stage_specs(rng, hints)
    cases = [_kernel_cases.BackwardCase(kind, rng, *spec) for spec in specs]
    example = "my_dq" if kind == "dq" else "my_dkdv"
    call, graded = _kernel_cases.graded(kernel, cases, name, example)
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
    @triton.jit function with the skeleton's signature, which the grader launches itself through
    `kernels.exercises.launch_dkdv` with its own blocks into NaN-filled dk and dv. lse comes from
    the forward and delta = rowsum(do * o). Stages as in 6.3; each with tiles no larger than the
    grader's blocks, against the float64 gradients, and under the interpreter the bytes moved
    against FA2's."""
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
    @triton.jit function with the skeleton's signature, which the grader launches itself through
    `kernels.exercises.launch_dq` with its own blocks into a NaN-filled dq. Stages as in 6.3; each
    with tiles no larger than the grader's blocks, against the float64 gradient, and under the
    interpreter the bytes moved against FA2's."""
    return _grade_backward("dq", "triton_dq", kernel, seed, out, triton_dq.solution_name)


def _time_backward(kind: str, kernel, out) -> None:
    """On a GPU: the learner's dK/dV or dQ kernel beside flashedu's whole backward and PyTorch's
    (information only: the two whole backwards also run the preprocess and the other kernel)."""
    if not torch.cuda.is_available():
        return
    from ..kernels import fwd as triton_attention

    shape = (4, 16, 4096, 64)
    q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.float16) for _ in range(4))
    o, lse = triton_attention.forward(q, k, v, causal=True)
    delta = (o.float() * do.float()).sum(-1)
    args = (do, q, k, v, lse, delta)
    launch = launch_dq if kind == "dq" else launch_dkdv
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=True)

    def yours():
        return launch(kernel, *args, causal=True)

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
