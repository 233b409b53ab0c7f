"""Host code for the kernels the learner writes: the same launchers for everyone, and the few lines
of each kernel that the skeletons give.

Chapter 06's exercises are a kernel of the scores, one program per tile (6.1), and the whole
FlashAttention-2 forward kernel (6.3); chapter 07's the preprocess D = rowsum(dO * O) (7.1), a tile
of P rebuilt from lse (7.2), the dK/dV kernel and the dQ kernel (7.3, 7.4). The learner writes the
`@triton.jit` function; everything around it is here:
validation, the output buffers, the grid, the arguments in a fixed order (the skeleton's
signature), and `PRECISION`, which is "ieee" for float32 inputs so that `tl.dot` multiplies in
full float32 on a GPU too (its default there rounds float32 inputs to TF32). The graders in
`flashedu.checks.ch06` / `ch07` launch a learner's kernel through exactly these functions, and the
worked solutions in `flashedu.kernels.solutions` run through them as well.

Each kernel opens with a given prologue, `fwd_program`, `dq_program` or `dkdv_program` (and
`dkdv_head` inside its loop over the query heads of a GQA group): which rows or keys the program
owns and the pointers moved to its (batch, head). The arguments come in the skeletons' order:
pointers, then the batch, head and row strides of each tensor (the last dimension is contiguous;
LSE and D share one (B, H, N_q) layout), then sizes, the softmax scale and the constexpr flags.

Introduced in notebooks/06_triton_forward.ipynb (the forward) and
notebooks/07_triton_backward.ipynb (the backward). Limits: no window, ALiBi or dropout; d a power
of two from 16 to 256; float16 or float32 (bfloat16 only on a GPU: the interpreter's bf16 `tl.dot`
is wrong); block sizes powers of two >= 16.
"""

from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl

from .launch import INTERPRETER, check_inputs, rows_contiguous


# --------------------------------------------------------------------------------------------------
# The given prologues, called on the first line of the learner's kernels
# --------------------------------------------------------------------------------------------------
@triton.jit
def fwd_program(
    Q, K, V, O, LSE, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
    stride_ob, stride_oh, stride_lb, stride_lh, H, GROUP, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Forward, grid (cdiv(N_q, BLOCK_M), B * H): Q, K, V, O, LSE moved to this program's (batch,
    head) and its query rows (BLOCK_M,). With GQA, query head h reads K/V head h // GROUP."""
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)  # int64: offsets past 2**31 elements stay exact
    h = (bh % H).to(tl.int64)
    Q += b * stride_qb + h * stride_qh
    O += b * stride_ob + h * stride_oh
    LSE += b * stride_lb + h * stride_lh
    K += b * stride_kb + (h // GROUP) * stride_kh
    V += b * stride_vb + (h // GROUP) * stride_vh
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    return Q, K, V, O, LSE, rows


@triton.jit
def dq_program(
    Q, K, V, DO, LSE, D, DQ, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
    stride_db, stride_dh, stride_dqb, stride_dqh, stride_lb, stride_lh, H, GROUP,
    BLOCK_M: tl.constexpr,
):  # fmt: skip
    """dQ, grid (cdiv(N_q, BLOCK_M), B * H): every pointer moved to this program's (batch, head),
    and its query rows (BLOCK_M,)."""
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    Q += b * stride_qb + h * stride_qh
    DO += b * stride_db + h * stride_dh
    DQ += b * stride_dqb + h * stride_dqh
    LSE += b * stride_lb + h * stride_lh
    D += b * stride_lb + h * stride_lh
    K += b * stride_kb + (h // GROUP) * stride_kh
    V += b * stride_vb + (h // GROUP) * stride_vh
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    return Q, K, V, DO, LSE, D, DQ, rows


@triton.jit
def dkdv_program(
    K, V, DK, DV, stride_kb, stride_kh, stride_vb, stride_vh, stride_dkb, stride_dkh,
    stride_dvb, stride_dvh, H, GROUP, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dK/dV, grid (cdiv(N_k, BLOCK_N), B * H_kv): K, V, DK, DV moved to this program's (batch,
    K/V head); its key rows (BLOCK_N,); its batch b and h0, the first query head of its group."""
    bh = tl.program_id(1)
    H_kv = H // GROUP
    b = (bh // H_kv).to(tl.int64)
    h_kv = (bh % H_kv).to(tl.int64)
    K += b * stride_kb + h_kv * stride_kh
    V += b * stride_vb + h_kv * stride_vh
    DK += b * stride_dkb + h_kv * stride_dkh
    DV += b * stride_dvb + h_kv * stride_dvh
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    return K, V, DK, DV, b, h_kv * GROUP, cols


@triton.jit
def dkdv_head(
    Q, DO, LSE, D, b, h, stride_qb, stride_qh, stride_db, stride_dh, stride_lb, stride_lh,
):  # fmt: skip
    """Q, DO, LSE, D moved to query head h of batch b (one head of the dK/dV program's group)."""
    Q += b * stride_qb + h * stride_qh
    DO += b * stride_db + h * stride_dh
    LSE += b * stride_lb + h * stride_lh
    D += b * stride_lb + h * stride_lh
    return Q, DO, LSE, D


# --------------------------------------------------------------------------------------------------
# Launchers: validation, buffers, grid, arguments in the skeleton's order
# --------------------------------------------------------------------------------------------------
SCORES_PARAMS = 13  # parameters of the exercise 6.1 kernel
PREPROCESS_PARAMS = 15  # exercise 7.1
PROBABILITIES_PARAMS = 14  # exercise 7.2
FORWARD_PARAMS = 29  # parameters of the forward skeleton
DQ_PARAMS = 34
DKDV_PARAMS = 38


def _block_default() -> int:
    return 16 if INTERPRETER else 64


def _check_kernel(kernel, params: int, name: str, what: str) -> None:
    if not isinstance(kernel, triton.runtime.KernelInterface):
        raise TypeError(
            f"{name}: kernel must be a @triton.jit function (your {what} kernel), got "
            f"{type(kernel).__name__}"
        )
    n = len(inspect.signature(kernel.fn).parameters)
    if n != params:
        raise TypeError(
            f"{name}: {kernel.fn.__name__} takes {n} parameters; the {what} skeleton's signature "
            f"has {params} (keep it as given: the launcher passes them in that order)"
        )


def _check_blocks(block_m, block_n, name) -> None:
    for arg, val in (("block_m", block_m), ("block_n", block_n)):
        if not isinstance(val, int) or val < 16 or val & (val - 1):
            raise ValueError(f"{name}: {arg} must be a power of two >= 16, got {val!r}")


def _prepare(q, k, v, causal, softmax_scale, name):
    """Validated (dims, scale, PRECISION); bf16 refused under the interpreter."""
    dims, scale, _, _, _ = check_inputs(q, k, v, causal, softmax_scale, None, None, name)
    if INTERPRETER and q.dtype == torch.bfloat16:
        raise TypeError(
            f"{name}: dtype bfloat16 runs only on a GPU (the interpreter's bf16 tl.dot is wrong); "
            "use float16 or float32 here"
        )
    return dims, scale, ("ieee" if q.dtype == torch.float32 else "tf32")


def _check_out(x, shape, dtype, arg, name):
    if tuple(x.shape) != tuple(shape) or x.dtype != dtype or x.stride(-1) != 1:
        raise ValueError(
            f"{name}: {arg} must be a {tuple(shape)} {dtype} tensor with a contiguous last "
            f"dimension, got {tuple(x.shape)} {x.dtype} with strides {x.stride()}"
        )
    return x


def _one_head(q, k, name):
    for arg, x in (("q", q), ("k", k)):
        if not isinstance(x, torch.Tensor) or x.ndim != 2 or x.stride(-1) != 1:
            raise ValueError(
                f"{name}: {arg} must be a 2D (N, d) tensor of one head with a contiguous last "
                f"dimension, got {getattr(x, 'shape', type(x).__name__)}"
            )
    if q.shape[1] != k.shape[1] or q.dtype != torch.float32 or k.dtype != torch.float32:
        raise ValueError(
            f"{name}: q and k must be float32 with the same d, got {tuple(q.shape)} {q.dtype} "
            f"and {tuple(k.shape)} {k.dtype}"
        )
    d = q.shape[1]
    if d < 16 or d & (d - 1):
        raise ValueError(f"{name}: d must be a power of two >= 16, got {d}")
    return q.shape[0], k.shape[0], d


def _tile_grid(kernel, params, name, what, q, k, block_m, block_n):
    _check_kernel(kernel, params, name, what)
    N_q, N_k, d = _one_head(q, k, name)
    block_m, block_n = block_m or _block_default(), block_n or _block_default()
    _check_blocks(block_m, block_n, name)
    return N_q, N_k, d, block_m, block_n, (triton.cdiv(N_q, block_m), triton.cdiv(N_k, block_n))


def launch_scores(
    kernel,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool = False,
    block_m: int | None = None,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch an exercise 6.1 kernel, `kernel(Q, K, S, stride_qm, stride_kn, stride_sm, N_q, N_k,
    sm_scale, CAUSAL, HEAD_DIM, BLOCK_M, BLOCK_N)`, on q (N_q, d) and k (N_k, d) float32 of one
    head: one program per (BLOCK_M, BLOCK_N) tile of s, grid (cdiv(N_q, BLOCK_M),
    cdiv(N_k, BLOCK_N)). Returns s (N_q, N_k) float32, or fills `out`."""
    name = "triton_exercises.launch_scores"
    N_q, N_k, d, bm, bn, grid = _tile_grid(kernel, SCORES_PARAMS, name, "scores", q, k, block_m,
                                           block_n)  # fmt: skip
    s = torch.empty((N_q, N_k), device=q.device, dtype=torch.float32) if out is None else out
    _check_out(s, (N_q, N_k), torch.float32, "out", name)
    kernel[grid](q, k, s, q.stride(0), k.stride(0), s.stride(0), N_q, N_k, d**-0.5,
                 bool(causal), d, bm, bn)  # fmt: skip
    return s


def launch_probabilities(
    kernel,
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool = False,
    block_m: int | None = None,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch an exercise 7.2 kernel, `kernel(Q, K, LSE, P, stride_qm, stride_kn, stride_pm, N_q,
    N_k, sm_scale, CAUSAL, HEAD_DIM, BLOCK_M, BLOCK_N)`, on q (N_q, d), k (N_k, d) float32 and the
    forward's lse (N_q,) float32: one program per tile of p, grid as for the scores. Returns p
    (N_q, N_k) float32, or fills `out`."""
    name = "triton_exercises.launch_probabilities"
    N_q, N_k, d, bm, bn, grid = _tile_grid(kernel, PROBABILITIES_PARAMS, name, "probabilities", q,
                                           k, block_m, block_n)  # fmt: skip
    _check_out(lse, (N_q,), torch.float32, "lse", name)
    p = torch.empty((N_q, N_k), device=q.device, dtype=torch.float32) if out is None else out
    _check_out(p, (N_q, N_k), torch.float32, "out", name)
    kernel[grid](q, k, lse, p, q.stride(0), k.stride(0), p.stride(0), N_q, N_k, d**-0.5,
                 bool(causal), d, bm, bn)  # fmt: skip
    return p


def launch_preprocess(
    kernel,
    o: torch.Tensor,
    do: torch.Tensor,
    *,
    block_m: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch an exercise 7.1 kernel, `kernel(O, DO, DELTA, stride_ob, stride_oh, stride_om,
    stride_db, stride_dh, stride_dm, stride_deltab, stride_deltah, N, H, HEAD_DIM, BLOCK_M)`, on o
    and do (B, H, N, d): one program per BLOCK_M rows of one (batch, head), grid
    (cdiv(N, BLOCK_M), B * H). Returns delta (B, H, N) float32, or fills `out`."""
    name = "triton_exercises.launch_preprocess"
    _check_kernel(kernel, PREPROCESS_PARAMS, name, "preprocess")
    if o.ndim != 4 or o.shape != do.shape or o.stride(-1) != 1 or do.stride(-1) != 1:
        raise ValueError(
            f"{name}: o and do must be (B, H, N, d) tensors of one shape with a contiguous last "
            f"dimension, got {tuple(o.shape)} and {tuple(do.shape)}"
        )
    B, H, N, d = o.shape
    block_m = block_m or _block_default()
    _check_blocks(block_m, block_m, name)
    delta = torch.empty((B, H, N), device=o.device, dtype=torch.float32) if out is None else out
    _check_out(delta, (B, H, N), torch.float32, "out", name)
    kernel[(triton.cdiv(N, block_m), B * H)](
        o, do, delta, *o.stride()[:3], *do.stride()[:3], *delta.stride()[:2], N, H, d, block_m
    )
    return delta


def launch_forward(
    kernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch a forward kernel with the chapter 06 skeleton's signature on q (B, H, N_q, d), k, v
    (B, H_kv, N_k, d): grid (cdiv(N_q, block_m), B * H). Returns (o, lse), o like q and lse
    (B, H, N_q) float32, or fills `out` = (o, lse) if given (any strides, last dimension
    contiguous). Block sizes default to 16 under the interpreter and 64 on a GPU."""
    name = "kernels.exercises.launch_forward"
    _check_kernel(kernel, FORWARD_PARAMS, name, "forward")
    (B, H, H_kv, N_q, N_k, d), scale, precision = _prepare(q, k, v, causal, softmax_scale, name)
    block_m, block_n = block_m or _block_default(), block_n or _block_default()
    _check_blocks(block_m, block_n, name)
    q, k, v = rows_contiguous(q), rows_contiguous(k), rows_contiguous(v)
    if out is None:
        out = (torch.empty_like(q), torch.empty((B, H, N_q), device=q.device, dtype=torch.float32))
    o = _check_out(out[0], q.shape, q.dtype, "o", name)
    lse = _check_out(out[1], (B, H, N_q), torch.float32, "lse", name)
    kernel[(triton.cdiv(N_q, block_m), B * H)](
        q, k, v, o, lse,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], *lse.stride()[:2],
        N_q, N_k, H, H // H_kv, scale,
        causal, d, block_m, block_n, precision,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return o, lse


def _prepare_backward(do, q, k, v, lse, delta, causal, softmax_scale, name):
    dims, scale, precision = _prepare(q, k, v, causal, softmax_scale, name)
    B, H, _, N_q, _, _ = dims
    _check_out(do, q.shape, q.dtype, "do", name)
    _check_out(lse, (B, H, N_q), torch.float32, "lse", name)
    _check_out(delta, (B, H, N_q), torch.float32, "delta", name)
    if lse.stride() != delta.stride():
        lse, delta = lse.contiguous(), delta.contiguous()  # the kernels index both alike
    q, k, v, do = (rows_contiguous(x) for x in (q, k, v, do))
    return dims, scale, precision, (q, k, v, do, lse, delta)


def launch_dq(
    kernel,
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch a dQ kernel with the chapter 07 skeleton's signature: grid (cdiv(N_q, block_m),
    B * H). lse is the forward's (B, H, N_q) float32, delta = rowsum(do * o) likewise. Returns dq
    like q (or fills `out`)."""
    name = "kernels.exercises.launch_dq"
    _check_kernel(kernel, DQ_PARAMS, name, "dQ")
    dims, scale, precision, (q, k, v, do, lse, delta) = _prepare_backward(
        do, q, k, v, lse, delta, causal, softmax_scale, name
    )
    B, H, H_kv, N_q, N_k, d = dims
    block_m, block_n = block_m or _block_default(), block_n or _block_default()
    _check_blocks(block_m, block_n, name)
    dq = _check_out(torch.empty_like(q) if out is None else out, q.shape, q.dtype, "out", name)
    kernel[(triton.cdiv(N_q, block_m), B * H)](
        q, k, v, do, lse, delta, dq,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *dq.stride()[:3],
        *lse.stride()[:2], N_q, N_k, H, H // H_kv, scale,
        causal, d, block_m, block_n, precision,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return dq


def launch_dkdv(
    kernel,
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch a dK/dV kernel with the chapter 07 skeleton's signature: grid (cdiv(N_k, block_n),
    B * H_kv); each program sums over the query heads of its GQA group. Returns (dk, dv) like k
    (or fills `out`)."""
    name = "kernels.exercises.launch_dkdv"
    _check_kernel(kernel, DKDV_PARAMS, name, "dK/dV")
    dims, scale, precision, (q, k, v, do, lse, delta) = _prepare_backward(
        do, q, k, v, lse, delta, causal, softmax_scale, name
    )
    B, H, H_kv, N_q, N_k, d = dims
    block_m, block_n = block_m or _block_default(), block_n or _block_default()
    _check_blocks(block_m, block_n, name)
    if out is None:
        out = (torch.empty_like(k), torch.empty_like(v))
    dk = _check_out(out[0], k.shape, k.dtype, "dk", name)
    dv = _check_out(out[1], v.shape, v.dtype, "dv", name)
    kernel[(triton.cdiv(N_k, block_n), B * H_kv)](
        q, k, v, do, lse, delta, dk, dv,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *dk.stride()[:3],
        *dv.stride()[:3], *lse.stride()[:2], N_q, N_k, H, H // H_kv, scale,
        causal, d, block_m, block_n, precision,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return dk, dv
