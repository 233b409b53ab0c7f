"""Graders for notebooks/06_triton_forward.ipynb: a first Triton kernel, the key ranges of the
forward, and the whole FlashAttention-2 forward kernel.

Exercise 6.1 asks for a Triton kernel that computes the masked, scaled scores of one head, one
program per (BLOCK_M, BLOCK_N) tile of a 2D grid; exercise 6.2 for the arithmetic that tells each
program of the forward kernel which key blocks it skips, which it masks and which it sees whole;
exercise 6.3 for the forward kernel itself, from a skeleton, graded in stages (`_kernel_cases`)
against float64 and, under the interpreter, the bytes FA2 moves.

The learner hands over the `@triton.jit` kernel, never a Python wrapper: the grader launches it
itself (`kernels.exercises.launch_scores` / `launch_forward`), with block sizes of its own that
differ between cases, on ragged lengths several blocks long, into outputs filled with NaN, and
grades what the kernel stored. Under the interpreter every load and store is measured: a tile
larger than the grader's block ("your kernel read all 45 keys of K in one tile; the grader asked
for BLOCK_N = 16"), a program that stores outside its tile, or bytes other than FA2's are named
before the numbers count. Mistakes are named by the float64 twins of `_tile_mistakes` and
`_attn_variants` (masked scores set to 0, the scale forgotten, the causal offset top-left, a
missing rescale, lse = m + l, a TF32 dot, ...). flashedu's own kernels and functions, and copies of
their code (`_method.same_code_as_flashedu`), are refused by name; 6.2 runs under the same guard.
Learners' kernels run on the GPU when there is one, else on CPU through the Triton interpreter; on
a GPU a passing 6.3 is also timed beside flashedu's kernel and PyTorch's SDPA (information only).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .. import masks
from ..kernels.exercises import launch_forward, launch_scores
from ..kernels.intro import kv_range
from ..testing import Tolerance, random_qkv
from . import _attn_variants, _kernel_cases, _tile_mistakes, _triton, _triton_judge
from ._core import Case, grade, grader, rng_for

__all__ = ["triton_scores", "kv_block_range", "triton_forward"]


def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def one_head(rng, N_q, N_k, d, dtype="float32", scale=1.0):
    """q (N_q, d) and k, v (N_k, d) torch tensors for one head, on the GPU if there is one."""
    q, k, v = random_qkv(
        1, 1, N_q, N_k, d, dtype, seed=rng, kind="torch", device=device(), scale=scale
    )
    return q[0, 0], k[0, 0], v[0, 0]


def _scores64(q, k, causal):
    s = q.double().cpu().numpy() @ k.double().cpu().numpy().T / np.sqrt(q.shape[-1])  # (N_q, N_k)
    return np.where(masks.visible(q.shape[0], k.shape[0], causal=causal), s, -np.inf)


SCORES_FORMULA = """
s_ij = q_i . k_j * sm_scale, and -inf where query i may not see key j (causal: j > i + N_k - N_q).
One program per tile: rows = program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M), cols likewise with
program_id(1) and BLOCK_N; load both tiles with masks (rows < N_q, cols < N_k), row r of Q at
Q + r * stride_qm; s = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale;
s = tl.where(visible, s, -inf); store at S + rows[:, None] * stride_sm + cols[None, :] with the 2D
mask. The grader launches (cdiv(N_q, BLOCK_M), cdiv(N_k, BLOCK_N)) programs.
"""


@grader("flashedu.kernels.solutions.scores_kernel", formula=SCORES_FORMULA)
def triton_scores(kernel, *, seed=None, out=print):
    """Grade exercise 6.1, `kernel(Q, K, S, stride_qm, stride_kn, stride_sm, N_q, N_k, sm_scale,
    CAUSAL, HEAD_DIM, BLOCK_M, BLOCK_N)`, a @triton.jit kernel: one program per (BLOCK_M, BLOCK_N)
    tile of s (N_q, N_k), s_ij = q_i . k_j * sm_scale, -inf where query i may not see key j
    (causal: j <= i + N_k - N_q). The grader launches it (`kernels.exercises.launch_scores`) with
    its own blocks into a NaN-filled s, and checks that each program stored its own tile."""
    rng = rng_for(seed)
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))
    bs = _kernel_cases.BLOCK
    n_q, n_k = bs * r(2, 3) + r(1, bs - 1), bs * r(2, 4) + r(1, bs - 1)  # never block multiples
    specs = [  # (label, (N_q, N_k, d), causal, blocks, what is wrong when no known mistake matches)
        ("one tile", (r(2, 12), r(2, 12), 16), False, (bs, bs),
         "the scores of a single tile are wrong"),
        (f"ragged N_q={n_q}, N_k={n_k}", (n_q, n_k, 32), False, (bs, bs),
         "the ragged edge tiles are wrong"),
        (f"d=64, blocks {2 * bs} x {bs}", (r(2 * bs + 1, 3 * bs), r(2 * bs + 1, 3 * bs), 64), False,
         (2 * bs, bs), "the scores are wrong at d = 64"),
        ("causal, N_q == N_k", (n_q, n_q, 32), True, (bs, bs), "the causal mask is wrong"),
        (f"causal, N_q={n_q} < N_k={n_k + n_q}, blocks {bs} x {2 * bs}", (n_q, n_k + n_q, 32), True,
         (bs, 2 * bs), "the causal mask is wrong when N_q < N_k"),
        (f"causal, N_q={n_k + 5} > N_k={n_k}", (n_k + 5, n_k, 16), True, (bs, bs),
         "rows that see no key must be -inf everywhere"),
    ]  # fmt: skip
    cases = []
    for label, (N_q, N_k, d), causal, blocks, hint in specs:
        q, k, _ = one_head(rng, N_q, N_k, d)
        q64, k64 = (x.double().cpu().numpy() for x in (q, k))
        expected = _scores64(q, k, causal)
        mistakes = _tile_mistakes.scores(q64, k64, causal)
        tf32 = np.where(np.isinf(expected), expected, _scores_tf32(q, k))
        q, k = (_triton.gapped(x[None, None].cpu().numpy(), torch.float32)[0, 0] for x in (q, k))

        def launch(kernel, out_s, q=q, k=k, causal=causal, blocks=blocks):
            return launch_scores(
                kernel, q, k, causal=causal, block_m=blocks[0], block_n=blocks[1], out=out_s
            )

        bm, bn = blocks
        cases.append(
            _triton_judge.tile_case(
                label, launch, {q.data_ptr(): "Q", k.data_ptr(): "K"}, (N_q, N_k), expected, hint,
                lambda got, e, m=mistakes, t=tf32: _check_scores(got, e, m, t),
                first=not cases, out_name="S",
                tiles=[
                    _triton.Tile("Q", 0, bm, "rows", "BLOCK_M"),
                    _triton.Tile("K", 0, bn, "columns", "BLOCK_N"),
                    _triton.Tile("S", 0, bm, "rows", "BLOCK_M", "write"),
                    _triton.Tile("S", 1, bn, "columns", "BLOCK_N", "write"),
                ],
                owner_axes=[(0, bm, 0, "rows"), (1, bn, 1, "columns")],
                grader="triton_scores", example="my_scores_kernel",
                inputs=f"q ({N_q}, {d}), k ({N_k}, {d}) float32, causal={causal}, "
                f"BLOCK_M={bm}, BLOCK_N={bn}",
            )
        )  # fmt: skip
    return grade("triton_scores", kernel, cases, solution_name=triton_scores.solution_name, out=out)


SCORES_TOL = Tolerance(2e-5, 2e-5)


def _scores_tf32(q, k) -> np.ndarray:
    q64, k64 = (_attn_variants.tf32(x.double().cpu().numpy()) for x in (q, k))
    return q64 @ k64.T / np.sqrt(q.shape[-1])


def _check_scores(got, expected, mistakes, tf32) -> tuple[bool, str, str]:
    def extra(g):
        return (
            _attn_variants.TF32 if _triton_judge.sized_like(g, tf32, expected, SCORES_TOL) else ""
        )

    return _triton_judge.check_against(got, expected, SCORES_TOL, mistakes, extra)


_STRETCH = ("lo", "full_lo", "full_hi", "hi")


def _same_ints(got, expected) -> tuple[bool, str]:
    """Which of the four bounds are wrong, by name; the right values stay for the hint."""
    try:
        g = tuple(int(x) for x in got)
    except (TypeError, ValueError):
        return False, f"expected 4 ints (lo, full_lo, full_hi, hi), got {got!r}"
    if len(g) != 4:
        return False, f"expected 4 ints (lo, full_lo, full_hi, hi), got {len(g)}"
    wrong = [name for name, a, b in zip(_STRETCH, g, expected) if a != b]
    return not wrong, f"{g}" + (f": {' and '.join(wrong)} wrong" if wrong else "")


KV_RANGE_FORMULA = """
With off = N_k - N_q (causal is bottom-right) and round down / up to multiples of block_n:
  not causal: lo = full_lo = 0, full_hi = N_k rounded down, hi = N_k rounded up
  causal:     hi = min(max(last + off + 1, 0), N_k) rounded up
              full_hi = min(min(max(first + off + 1, 0), N_k) rounded down, hi)
              lo = full_lo = 0
Rows that see no key get lo == full_lo == full_hi == hi (nothing loaded).
"""


@grader("flashedu.kernels.intro.kv_range", formula=KV_RANGE_FORMULA)
def kv_block_range(fn, *, seed=None, out=print):
    """Grade `fn(first, last, N_q, N_k, block_n, *, causal=False) -> (lo, full_lo, full_hi, hi)`:
    for the query rows first..last (inclusive), the key stretches of the forward kernel, all
    multiples of block_n: keys in [full_lo, full_hi) are visible to every one of these rows and to
    no mask; [lo, full_lo) and [full_hi, hi) need the mask (the causal diagonal, the ragged last
    block); keys outside [lo, hi) are never loaded, and a block of rows that sees nothing gets
    lo == hi."""
    rng = rng_for(seed)
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))
    bm, bn = 64, 32 * r(1, 2)
    n = bm * r(4, 8)
    i = r(1, n // bm - 2) * bm
    ragged = n + r(1, bn - 1)
    specs = [  # (label, (first, last, N_q, N_k), causal, hint)
        (
            "no mask, N_k a block multiple",
            (i, i + bm - 1, n, n),
            False,
            "without a mask every key is visible to every row",
        ),
        (
            f"no mask, ragged N_k={ragged}",
            (i, i + bm - 1, n, ragged),
            False,
            "the ragged last key block is in the wrong stretch: part of it is past N_k",
        ),
        (
            f"causal, rows {i}..{i + bm - 1} of N={n}",
            (i, i + bm - 1, n, n),
            True,
            "causal: the diagonal block(s) of these rows are in the wrong stretch",
        ),
        (
            f"causal, N_q={n} < N_k={n + bn + 3}",
            (i, i + bm - 1, n, n + bn + 3),
            True,
            "causal with N_q < N_k: the diagonal is bottom-right aligned, not top-left",
        ),
        (
            f"causal, N_q={n + 2 * bm} > N_k={n}: rows that see nothing",
            (0, bm - 1, n + 2 * bm, n),
            True,
            "these rows see no key (N_q > N_k, causal): a range that loads keys for them",
        ),
        (
            f"causal, short last block (N={n - 7})",
            (n - bm, n - 8, n - 7, n - 7),
            True,
            (
                "the last row of a short block is min(first + BLOCK_M, N_q) - 1, the `last` you "
                "are given"
            ),
        ),
    ]
    cases = [
        Case(
            label,
            (first, last, N_q, N_k, bn),
            kv_range(first, last, N_q, N_k, bn, causal=causal),
            hint=hint,
            kwargs={"causal": causal},
            check=_same_ints,
        )
        for label, (first, last, N_q, N_k), causal, hint in specs
    ]
    return grade(
        "kv_block_range", fn, cases, solution_name=kv_block_range.solution_name, out=out,
        forbid=True,
    )  # fmt: skip


# ------------------------------------------------------------------ exercise 6.3: the whole kernel


FORWARD_FORMULA = """
Per key block j of the block's range (0 .. the diagonal of its last row when causal), in fp32:
  s = tl.dot(q, tl.trans(k_j), input_precision=PRECISION) * sm_scale, -inf where hidden
      (cols >= N_k, or cols > rows + N_k - N_q when causal)
  m_new = max(m, rowmax(s));  p = exp(s - m_new);  alpha = exp(m - m_new)
  l = alpha * l + rowsum(p);  acc = alpha * acc + tl.dot(p.to(v.dtype), v_j);  m = m_new
After the loop: o = acc / l, lse = m + log(l); a row that saw nothing (l = 0) gets o = 0 and
lse = -inf (use 0 for m in the exponents while it is -inf). Store o and lse once, masked rows < N_q.
Optional: exp2 with log2(e) folded into the scale, lse = (m2 + log2(l)) * ln(2).
"""


@grader("flashedu.kernels.solutions.flash_forward_kernel", formula=FORWARD_FORMULA)
def triton_forward(kernel, *, seed=None, out=print):
    """Grade exercise 6.3, the whole FlashAttention-2 forward kernel: `kernel` is a @triton.jit
    function with the skeleton's signature, which the grader launches itself through
    `kernels.exercises.launch_forward`, with its own BLOCK_M and BLOCK_N, into NaN-filled o and lse
    (a Python function is not graded: its return value could come from anywhere). Stages: N a
    block multiple, ragged N, causal N_q < N_k, rows that see no key, GQA, float16; each with tiles
    no larger than the grader's blocks, against float64, and under the interpreter the bytes moved
    against FA2's (one pass over K and V per query block)."""
    rng = rng_for(seed)
    specs = _kernel_cases.stage_specs(rng, _kernel_cases.FORWARD_HINTS)
    cases = [_kernel_cases.ForwardCase(rng, *spec) for spec in specs]
    call, graded = _kernel_cases.graded(kernel, cases, "triton_forward", "my_flash_forward")
    report = grade(
        "triton_forward", call, graded, solution_name=triton_forward.solution_name, out=out
    )
    if report.passed:
        _time_forward(kernel, out)
    return report


def _time_forward(kernel, out) -> None:
    """On a GPU: the learner's forward beside flashedu's and PyTorch's SDPA (information only)."""
    if not torch.cuda.is_available():
        return
    from ..kernels import fwd as triton_attention

    q, k, v = (torch.randn(4, 16, 4096, 64, device="cuda", dtype=torch.float16) for _ in range(3))

    def yours():
        return launch_forward(kernel, q, k, v, causal=True)

    _triton.gpu_timing(
        "forward, B=4 H=16 N=4096 d=64 fp16 causal",
        {
            "your kernel": yours,
            "flashedu": lambda: triton_attention.forward(q, k, v, causal=True),
            "SDPA": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        },
        out=out,
    )
