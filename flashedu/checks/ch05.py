"""Graders for chapter 05 (notebooks/05_pytorch_autograd.ipynb): autograd, the SDPA drop-in, the
GPT's heads.

Exercise 5.1 asks for a `torch.autograd.Function` around the learner's OWN PyTorch tiled loops
(forward and backward, blocks of 16). The grader runs it with flashedu's implementations off limits
(`flashedu.attention`, `torch_tiled`, ... are named shortcuts), under
`torch.autograd.graph.saved_tensors_hooks` (it sees every tensor kept for backward), and on its
last case (N_q = N_k = 128) it watches every tensor the forward and backward make: an N_q x N_k
matrix is a named shortcut. It compares o and all three gradients with the float64 reference, and
names a wrong answer by the planted bug it reproduces (no rescale, top-left causal, causal dropped
in backward, lse without the max or as m + l, dk and dv swapped, NaN rows). Exercise 5.2 asks for
PyTorch's top-left `is_causal` built from `flashedu.attention` (allowed there, and only there).
Exercise 5.3 asks for the (B, T, C) -> (B, H, T, hs) head split of the GPT.

Limits: inputs are small float64 tensors on the CPU; 5.1 checks first derivatives only.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import api, reference, torch_tiled
from ..testing import Tolerance, random_qkv
from ._core import Case, Report, candidates, compare, grade, grader, rng_for
from ._method import Shortcut, watch_arrays
from ._tiled_twins import TILED_RULE, twin_backward, twin_forward
from ._watch import shape_text

__all__ = ["check_autograd_function", "check_top_left_causal", "check_split_heads"]

_F64 = Tolerance(1e-9, 1e-9)
_D = 8  # head dim; no sequence length below equals it
BLOCK = 16


def _torch(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


# --------------------------------------------------------------------------------------------- 5.1


class TiledAttention(torch.autograd.Function):
    """Attention whose backward recomputes P: saves q, k, v, o, lse, never an N_q x N_k matrix.
    The loops are the package's PyTorch ones (flashedu/torch_tiled.py), in blocks of 16."""

    @staticmethod
    def forward(ctx, q, k, v, causal):
        o, lse = torch_tiled.forward(q, k, v, causal=causal, block_m=BLOCK, block_n=BLOCK)
        ctx.save_for_backward(q, k, v, o, lse)  # O(N d) memory: no S, no P
        ctx.causal = causal
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        grads = torch_tiled.backward(
            do, q, k, v, o, lse, causal=ctx.causal, block_m=BLOCK, block_n=BLOCK
        )
        return (*grads, None)  # one gradient per input of forward; none for the flag causal


def _per_head(q, k, v, do, causal, block, fwd_bugs, bwd_bugs, swap=False):
    """o and gradients of the planted loops (ch03, ch04) run head by head: a buggy variant."""
    outs = [np.zeros_like(q), np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)]
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            qh, kh, vh, dh = (t[b, h] for t in (q, k, v, do))
            kw = {"causal": causal, "block_m": block, "block_n": block}
            o, lse = twin_forward(qh, kh, vh, **kw, **fwd_bugs)
            grads = twin_backward(dh, qh, kh, vh, o, lse, **{**kw, **bwd_bugs})
            for t, x in zip(outs, (o, *grads)):
                t[b, h] = x
    if swap:
        outs[2], outs[3] = outs[3], outs[2]
    return tuple(_torch(t) for t in outs)


_FUNCTION_MISTAKES = {  # what is wrong: (forward bugs, backward bugs, dk/dv swapped)
    "the forward's alpha rescale is missing: l and the accumulator keep their old scale": (
        {"rescale": "none"}, {}, False),
    "the causal mask is top-left aligned; flashedu's is bottom-right": (
        {"offset": False}, {"offset": False}, False),
    "backward ignores causal: keep it on ctx and use the forward's mask": (
        {}, {"causal": False}, False),
    "the saved lse is log l without the running max m": ({"lse": "log l"}, {}, False),
    "the saved lse is m + l instead of m + log l": ({"lse": "m + l"}, {}, False),
    "rows that see no key give NaN instead of o = 0, lse = -inf and zero gradients": (
        {"guard": False}, {"guard": False}, False),
    "dk and dv are swapped: return gradients in the order of forward's inputs": ({}, {}, True),
}  # fmt: skip


def _variants(q, k, v, do, causal) -> dict:
    """{what is wrong: its output}, computed on demand, for block sizes 16, 32 and 64."""
    q, k, v, do = (x.numpy() for x in (q, k, v, do))
    blocks = (BLOCK,) if max(q.shape[-2], k.shape[-2]) <= BLOCK else (BLOCK, 2 * BLOCK, 4 * BLOCK)

    def make(fwd, bwd, swap):
        bwd = {"causal": causal, **bwd}
        return lambda: candidates(
            *(_per_head(q, k, v, do, causal, b, fwd, bwd, swap) for b in blocks)
        )

    return {why: make(*spec) for why, spec in _FUNCTION_MISTAKES.items()}


def _autograd_call(q, k, v, causal, do, limit):
    N_q, N_k = q.shape[-2], k.shape[-2]

    def call(fn):
        q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
        shapes = []

        def pack(x):
            shapes.append(tuple(x.shape))
            return x

        try:
            with watch_arrays(limit, what="an N_q x N_k matrix"):
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
                    o = fn(q_, k_, v_, causal)
                if not isinstance(o, torch.Tensor):
                    raise TypeError(f"expected a tensor o, got {type(o).__name__} (return o alone)")
                grads = torch.autograd.grad(o, (q_, k_, v_), do, allow_unused=True)
        except Shortcut as e:
            raise e if str(e).startswith("called") else Shortcut(f"{e}: {TILED_RULE}") from None
        big = [s for s in shapes if s[-2:] == (N_q, N_k)]
        if big:
            raise Shortcut(
                f"saved a {shape_text(big[0])} tensor for backward: an N_q x N_k matrix; "
                "save q, k, v, o, lse and rebuild P in backward"
            )
        return (o.detach(), *grads)

    return call


def _check_function(got, expected):
    missing = [n for n, g in zip(("dq", "dk", "dv"), got[1:]) if g is None]
    if missing:
        return (
            False,
            f"no gradient for {', '.join(missing)}",
            (f"backward returned None for {', '.join(missing)}: return dq, dk, dv (then None)"),
        )
    return compare(tuple(got), expected, _F64, ("o", "dq", "dk", "dv"))


_FUNCTION_FORMULA = """
forward(ctx, q, k, v, causal): o, lse = your tiled forward; ctx.save_for_backward(q, k, v, o, lse);
                               ctx.causal = causal; return o
backward(ctx, do): q, k, v, o, lse = ctx.saved_tensors
                   return (*your tiled backward(do, q, k, v, o, lse, causal=ctx.causal), None)
The loops are chapter 03's and 04's, on (B, H, N, d) tensors: every op works on the last two dims.
"""


@grader(
    "flashedu.checks.ch05.TiledAttention",
    "flashedu.torch_tiled.forward",
    "flashedu.torch_tiled.backward",
    formula=_FUNCTION_FORMULA,
)
def check_autograd_function(fn, *, seed=None, out=print) -> Report:
    """Grade `fn(q, k, v, causal) -> o`, e.g. `MyFlashAttention.apply`, built on your own
    PyTorch tiled loops (blocks of 16): o and the gradients of q, k, v (float64, (B, H, N, d)),
    nothing of size N_q x N_k saved for backward or made on the way, no flashedu implementation
    called."""
    rng = rng_for(seed)
    specs = [  # (label, (B, H, N_q, N_k), causal, hint)
        ("N_q=5, N_k=7", (1, 2, 5, 7), False,
         "backward returns one gradient per forward input, in order: dq, dk, dv, None"),
        ("N_q=N_k=40, blocks of 16", (1, 1, 40, 40), False, ""),
        ("causal, N_q=N_k=9", (2, 1, 9, 9), True, ""),
        ("causal, N_q=3 < N_k=21", (1, 2, 3, 21), True, ""),
        ("causal, N_q=20 > N_k=4 (empty rows)", (1, 1, 20, 4), True, ""),
        ("N_q=N_k=128: memory", (1, 1, 128, 128), False, ""),
    ]  # fmt: skip
    cases = []
    for label, (B, H, N_q, N_k), causal, hint in specs:
        q, k, v = random_qkv(B, H, N_q, N_k, _D, "float64", seed=rng, kind="torch")
        do = _torch(rng.standard_normal((B, H, N_q, _D)))
        want = (
            _torch(reference.forward(q, k, v, causal=causal)[0]),
            *map(_torch, reference.backward(do, q, k, v, causal=causal)),
        )
        limit = B * H * N_q * N_k // 2 if N_q * N_k >= 128 * 128 else None
        cases.append(
            Case(
                label,
                (),
                want,
                hint=hint or "o, dq, dk, dv must be exact attention and its gradients",
                check=_check_function,
                mistakes=_variants(q, k, v, do, causal),
                inputs=f"q {(B, H, N_q, _D)}, k and v {(B, H, N_k, _D)}, causal={causal}",
                call=_autograd_call(q, k, v, causal, do, limit),
            )
        )
    return grade("check_autograd_function", fn, cases, out=out, forbid=True)


# --------------------------------------------------------------------------------------------- 5.2


def _top_left_mistakes(q, k, v) -> dict:
    L, S = q.shape[-2], k.shape[-2]
    return {
        "this is flashedu's bottom-right causal as it is; PyTorch's is top-left": (
            lambda: api.attention(q, k, v, causal=True)
        ),
        "the keys were cut to the first L, but for L > S the queries must be split too": (
            lambda: api.attention(q, k[..., :L, :], v[..., :L, :], causal=True)
        ),
        "no causal mask at all": lambda: api.attention(q, k, v),
        "for L > S the last L - S queries see every key; they were masked": (
            lambda: torch.cat(
                [api.attention(q[..., :S, :], k, v, causal=True), torch.zeros_like(q[..., S:, :])],
                dim=-2,
            )
        ),
    }


@grader("flashedu.api.top_left_causal")
def check_top_left_causal(fn, *, seed=None, out=print) -> Report:
    """Grade `fn(query, key, value) -> out`: PyTorch's is_causal=True (query i sees key j iff
    j <= i) for float64 tensors (B, H, L, E) and (B, H, S, E), built on flashedu.attention's
    bottom-right causal (the one flashedu function allowed here)."""
    rng = rng_for(seed)
    specs = [  # (label, L, S, hint)
        ("L=S=6", 6, 6, "with L == S top-left and bottom-right agree"),
        ("L=3 < S=8", 3, 8, "L < S: under top-left no query sees a key past position L-1"),
        ("L=9 > S=4", 9, 4, "L > S: under top-left the last L-S queries see every key"),
        ("L=1 < S=5", 1, 5, "a single query sees key 0 only under top-left"),
    ]
    cases = []
    for label, L, S, hint in specs:
        q, k, v = random_qkv(2, 2, L, S, _D, "float64", seed=rng, kind="torch")
        top_left = np.tril(np.ones((L, S), dtype=bool))  # query i sees key j iff j <= i
        want = _torch(reference.forward(q, k, v, attn_mask=top_left)[0])
        cases.append(
            Case(label, (q, k, v), want, hint=hint, tol=_F64, mistakes=_top_left_mistakes(q, k, v))
        )
    return grade(
        "check_top_left_causal", fn, cases, out=out, forbid=True, allow=("flashedu.api.attention",)
    )


# --------------------------------------------------------------------------------------------- 5.3


def _heads_mistakes(x, n_head) -> dict:
    B, T, C = x.shape
    return {
        "this is x.view(B, H, T, hs), which takes heads from positions, not channels": (
            x.reshape(B, n_head, T, C // n_head)
        ),
        "the shape is (B, T, H, hs): heads must come before time": (
            x.reshape(B, T, n_head, C // n_head)
        ),
        "channels are interleaved (head h gets h, h+H, ...): heads are contiguous slices": (
            x.reshape(B, T, C // n_head, n_head).permute(0, 3, 1, 2)
        ),
    }


@grader("flashedu.gpt.split_heads")
def check_split_heads(fn, *, seed=None, out=print) -> Report:
    """Grade `fn(x, n_head) -> (B, H, T, C // H)` for x (B, T, C): head h holds channels h*hs ..
    (h+1)*hs-1."""
    rng = rng_for(seed)
    specs = [
        ((2, 5, 12), 3, "a head is a slice of channels"),
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
                want,
                hint=hint,
                tol=Tolerance(0.0, 0.0),
                mistakes=_heads_mistakes(x, n_head),
            )
        )
    return grade("check_split_heads", fn, cases, out=out, forbid=True)
