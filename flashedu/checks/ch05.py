"""Graders for chapter 05 (notebooks/05_pytorch_autograd.ipynb): autograd, the SDPA drop-in, the
GPT's heads.

Exercise 5.1 asks for a `torch.autograd.Function` that saves only q, k, v, o and lse; the grader
runs it under `torch.autograd.graph.saved_tensors_hooks`, so it sees every tensor kept for backward,
and compares the output and all three gradients with the float64 reference. Exercise 5.2 asks for
PyTorch's top-left `is_causal` built from flashedu's bottom-right `causal`. Exercise 5.3 asks for
the (B, T, C) -> (B, H, T, hs) head split of the GPT. When an answer is wrong, the graders say which
part is wrong and, where they can, which mistake reproduces it (swapped gradients, a stored P, heads
taken from positions instead of channels).

Limits: inputs are small float64 tensors on the CPU; 5.1 checks first derivatives only.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import reference
from ..testing import Tolerance, max_error, random_qkv
from ._core import Case, Report, _compare, grade, grader, rng_for

__all__ = ["check_autograd_function", "check_top_left_causal", "check_split_heads"]

_F64 = Tolerance(1e-9, 1e-9)
_D = 8  # head dim; no sequence length below equals it


def _torch(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


# --------------------------------------------------------------------------------------------- 5.1


def _run_function(fn):
    """Call fn(q, k, v, causal) -> o under hooks that record what autograd saves; return o, grads,
    shapes."""

    def run(q, k, v, causal, do):
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        shapes = []

        def pack(x):
            shapes.append(tuple(x.shape))
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            o = fn(q, k, v, causal)
        if not isinstance(o, torch.Tensor):
            raise TypeError(
                f"expected a tensor o, got {type(o).__name__} (return o alone, not (o, lse))"
            )
        grads = torch.autograd.grad(o, (q, k, v), do, allow_unused=True)
        return (o.detach(), *grads), shapes

    return run


def _check_function(got, expected):
    (answer, shapes), (want, (N_q, N_k)) = got, expected
    big = [s for s in shapes if s[-2:] == (N_q, N_k)]
    if big:
        return False, (
            f"saved a tensor of shape {big[0]} for backward: an (N_q, N_k) matrix (S or P) costs "
            "O(N^2) memory; save only q, k, v, o, lse and recompute P in backward"
        )
    missing = [n for n, g in zip(("dq", "dk", "dv"), answer[1:]) if g is None]
    if missing:
        return (
            False,
            f"no gradient for {', '.join(missing)}: backward must return dq, dk, dv (then None)",
        )
    ok, detail = _compare(tuple(answer), tuple(want), _F64, ("o", "dq", "dk", "dv"))
    if ok:
        worst = max(max_error(g, e)[0] for g, e in zip(answer, want))
        return (
            True,
            f"o, dq, dk, dv: max|diff|={worst:.1e}; saved {len(shapes)} tensors, none N_q x N_k",
        )
    if (
        answer[2].shape == answer[3].shape
        and _close(answer[2], want[3])
        and _close(answer[3], want[2])
    ):
        detail += (
            "; dk and dv are swapped: "
            "return gradients in the order of forward's inputs (q, k, v, ...)"
        )
    return ok, detail


def _close(a, b) -> bool:
    return max_error(a, b)[0] <= 1e-9


@grader("flashedu.autograd.FlashAttention")
def check_autograd_function(fn, *, seed=None, out=print) -> Report:
    """Grade `fn(q, k, v, causal) -> o`, e.g. `MyFlashAttention.apply`: o and the gradients of q, k,
    v (float64, (B, H, N, d)), and that nothing of size N_q x N_k is saved for backward."""
    rng = rng_for(seed)
    specs = [  # (label, (B, H, N_q, N_k), causal, hint)
        (
            "N_q=5, N_k=7",
            (1, 2, 5, 7),
            False,
            "backward returns one gradient per forward input, in order: "
            "dq, dk, dv, None (for causal)",
        ),
        (
            "causal, N_q=N_k=9",
            (2, 1, 9, 9),
            True,
            "keep causal on ctx and pass it to backward too: "
            "the gradients must use the forward's mask",
        ),
        (
            "causal, N_q=3 < N_k=11",
            (1, 2, 3, 11),
            True,
            "causal is bottom-right: pass causal through unchanged, torch_tiled aligns it",
        ),
        (
            "causal, N_q=10 > N_k=4 (empty rows)",
            (1, 1, 10, 4),
            True,
            "rows that see no key: o = 0, lse = -inf, zero gradients; "
            "save lse exactly as forward returned it",
        ),
        (
            "N_q=N_k=40: memory",
            (1, 1, 40, 40),
            False,
            "ctx.save_for_backward(q, k, v, o, lse) only; recompute P in backward",
        ),
    ]
    cases = []
    for label, (B, H, N_q, N_k), causal, hint in specs:
        q, k, v = random_qkv(B, H, N_q, N_k, _D, "float64", seed=rng, kind="torch")
        do = _torch(rng.standard_normal((B, H, N_q, _D)))
        want = (
            _torch(reference.forward(q, k, v, causal=causal)[0]),
            *map(_torch, reference.backward(do, q, k, v, causal=causal)),
        )
        cases.append(
            Case(label, (q, k, v, causal, do), (want, (N_q, N_k)), hint=hint, check=_check_function)
        )
    return grade(
        "check_autograd_function",
        _run_function(fn),
        cases,
        solution_name=check_autograd_function.solution_name,
        out=out,
    )


# --------------------------------------------------------------------------------------------- 5.2


@grader("flashedu.api.top_left_causal")
def check_top_left_causal(fn, *, seed=None, out=print) -> Report:
    """Grade `fn(query, key, value) -> out`: PyTorch's is_causal=True (query i sees key j iff
    j <= i) for float64 tensors (B, H, L, E) and (B, H, S, E), built on flashedu.attention's
    bottom-right causal."""
    rng = rng_for(seed)
    specs = [  # (label, L, S, hint)
        ("L=S=6", 6, 6, "with L == S top-left and bottom-right agree: attention(..., causal=True)"),
        (
            "L=3 < S=8",
            3,
            8,
            "L < S: under top-left no query sees a key past position L-1; bottom-right "
            "causal=True would show the last query every key: drop keys L.. first",
        ),
        (
            "L=9 > S=4",
            9,
            4,
            "L > S: under top-left every query sees key 0 and the last L-S queries see all "
            "keys; bottom-right causal=True blanks the first L-S rows: split the queries",
        ),
        ("L=1 < S=5", 1, 5, "a single query sees key 0 only under top-left"),
    ]
    cases = []
    for label, L, S, hint in specs:
        q, k, v = random_qkv(2, 2, L, S, _D, "float64", seed=rng, kind="torch")
        top_left = np.tril(np.ones((L, S), dtype=bool))  # query i sees key j iff j <= i
        want = _torch(reference.forward(q, k, v, attn_mask=top_left)[0])
        cases.append(Case(label, (q, k, v), want, hint=hint, tol=_F64))
    return grade(
        "check_top_left_causal",
        fn,
        cases,
        solution_name=check_top_left_causal.solution_name,
        out=out,
    )


# --------------------------------------------------------------------------------------------- 5.3


def _check_heads(got, expected):
    x, n_head, want = expected
    B, T, C = x.shape
    if isinstance(got, torch.Tensor) and tuple(got.shape) == (B, T, n_head, C // n_head):
        return (
            False,
            f"shape {tuple(got.shape)} is (B, T, H, hs): transpose(1, 2) to put heads before time",
        )
    ok, detail = _compare(got, want, Tolerance(0.0, 0.0))
    if not ok and isinstance(got, torch.Tensor) and got.shape == want.shape:
        if T > 1 and torch.equal(got, x.reshape(B, n_head, T, C // n_head)):
            detail += (
                "; this is x.view(B, H, T, hs), which takes heads from positions, not channels"
            )
        elif torch.equal(got, x.reshape(B, T, C // n_head, n_head).permute(0, 3, 1, 2)):
            detail += (
                "; this interleaves channels (head h gets h, h+H, ...): heads are contiguous slices"
            )
    return ok, detail


@grader("flashedu.gpt.split_heads")
def check_split_heads(fn, *, seed=None, out=print) -> Report:
    """Grade `fn(x, n_head) -> (B, H, T, C // H)` for x (B, T, C): head h holds channels h*hs ..
    (h+1)*hs-1."""
    rng = rng_for(seed)
    specs = [
        ((2, 5, 12), 3, "view(B, T, H, hs), then transpose(1, 2): a head is a slice of channels"),
        ((1, 7, 8), 2, "keep the batch dimension first; T and C come from x.shape"),
        ((3, 4, 6), 6, "hs = C // n_head can be 1"),
        ((1, 1, 10), 5, "T = 1 (one token, as when decoding) must work too"),
    ]
    cases = []
    for shape, n_head, hint in specs:
        x = _torch(rng.standard_normal(shape))
        want = x.reshape(shape[0], shape[1], n_head, -1).permute(0, 2, 1, 3)
        cases.append(
            Case(
                f"x{shape}, n_head={n_head}",
                (x, n_head),
                (x, n_head, want),
                hint=hint,
                check=_check_heads,
            )
        )
    return grade(
        "check_split_heads", fn, cases, solution_name=check_split_heads.solution_name, out=out
    )
