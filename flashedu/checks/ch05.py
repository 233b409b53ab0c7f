"""Graders for chapter 05 (notebooks/05_pytorch_autograd.ipynb): autograd, the SDPA drop-in, the
GPT's heads.

Exercise 5.1 asks for a `torch.autograd.Function` around the learner's OWN PyTorch tiled loops
(forward and backward), called as `fn(q, k, v, causal, block_m, block_n)` with the grader's tiles.
The grader runs it with flashedu's implementations off limits (`flashedu.attention`, `torch_tiled`,
... are named shortcuts), under `torch.autograd.graph.saved_tensors_hooks` (a saved tensor of
scores is named, whether (N_q, N_k), transposed, flattened, padded or cut into tiles, and so is
plain autograd over the loop), and with a torch dispatch mode that records every tensor the
forward and the backward make, inside a custom `backward` too (`_watch.py`): on N_q = N_k = 128 an
N_q x N_k matrix is a named shortcut; on a causal case a few hundred keys long, a block of scores
wider than block_n keys, a score computed twice in the forward (or three times in the backward),
`scaled_dot_product_attention`, and a copy of the whole K or V kept in a module-level variable are
named. It compares o and all three gradients with the float64 reference, and names a wrong answer
by the planted bug it reproduces (no rescale, top-left causal, causal dropped in backward, lse
without the max or as m + l, dk and dv swapped, NaN rows). Exercise 5.2 asks for PyTorch's top-left
`is_causal` built from `flashedu.attention` (allowed there, and only there). Exercise 5.3 asks for
the (B, T, C) -> (B, H, T, hs) head split of the GPT. Shortcuts are tested in
tests/checks/test_ch05_shortcuts.py.

Limits: inputs are small float64 tensors on the CPU; 5.1 checks first derivatives only.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .. import api, reference, torch_tiled
from ..testing import Tolerance, random_qkv
from ._core import Case, Report, candidates, compare, grade, grader, rng_for
from ._method import Shortcut
from ._shared import with_rule
from ._tiled_twins import twin_backward, twin_forward
from ._watch import TileRule, kept_copy, shape_text, watched_call

__all__ = ["check_autograd_function", "check_top_left_causal", "check_split_heads"]

_F64 = Tolerance(1e-9, 1e-9)
_D = 8  # head dim; no sequence length below equals it


def _torch(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


# --------------------------------------------------------------------------------------------- 5.1


class TiledAttention(torch.autograd.Function):
    """Attention whose backward recomputes P: saves q, k, v, o, lse, never an N_q x N_k matrix.
    The loops are the package's PyTorch ones (flashedu/torch_tiled.py), in the tiles the caller
    passes (block_m query rows by block_n keys)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, block_m, block_n):
        o, lse = torch_tiled.forward(q, k, v, causal=causal, block_m=block_m, block_n=block_n)
        ctx.save_for_backward(q, k, v, o, lse)  # O(N d) memory: no S, no P
        ctx.causal, ctx.blocks = causal, (block_m, block_n)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        block_m, block_n = ctx.blocks
        grads = torch_tiled.backward(
            do, q, k, v, o, lse, causal=ctx.causal, block_m=block_m, block_n=block_n
        )
        return (*grads, None, None, None)  # one gradient per input of forward; none for flags


def _per_head(q, k, v, do, causal, blocks, fwd_bugs, bwd_bugs, swap=False):
    """o and gradients of the planted loops (ch03, ch04) run head by head: a buggy variant."""
    outs = [np.zeros_like(q), np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)]
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            qh, kh, vh, dh = (t[b, h] for t in (q, k, v, do))
            kw = {"causal": causal, "block_m": blocks[0], "block_n": blocks[1]}
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


def _variants(q, k, v, do, causal, blocks) -> dict:
    """{what is wrong: its output}, computed on demand, in the grader's tiles (and in tiles half
    as tall, an honest learner's other choice)."""
    q, k, v, do = (x.numpy() for x in (q, k, v, do))
    tilings = [blocks] + ([(max(1, blocks[0] // 2), blocks[1])] if blocks[0] > 1 else [])

    def make(fwd, bwd, swap):
        bwd = {"causal": causal, **bwd}
        return lambda: candidates(
            *(_per_head(q, k, v, do, causal, t, fwd, bwd, swap) for t in tilings)
        )

    return {why: make(*spec) for why, spec in _FUNCTION_MISTAKES.items()}


def _saved_scores(shapes, B, H, N_q, N_k, d) -> str:
    """What is wrong with the tensors kept for backward, or ''. Anything without a head-dim axis
    is per row (lse: B*H*N rows at most) or it holds scores: of shape (N_q, N_k), transposed,
    reshaped, padded, or cut into many tiles."""
    per_row = B * H * max(N_q, N_k)
    scores = [s for s in shapes if d not in s and math.prod(s) > per_row]
    rows = {(B, H, n) for n in (N_q, N_k)} | {(B, H, n, 1) for n in (N_q, N_k)}  # lse, D
    tiles = [s for s in shapes if d not in s and tuple(s) not in rows and math.prod(s) > 1]
    total = sum(math.prod(s) for s in tiles)
    if scores:
        return (
            f"saved a {shape_text(scores[0])} tensor for backward: that is scores or P, "
            f"O(N_q x N_k) memory; save q, k, v, o, lse and rebuild P in backward"
        )
    if total > 2 * per_row:
        return (
            f"saved {len(tiles)} tiles of scores for backward ({shape_text(tiles[0])} ...): "
            f"together O(N_q x N_k) memory, as autograd keeps for a loop it records; save q, "
            "k, v, o, lse in a torch.autograd.Function and rebuild P in backward"
        )
    return ""


def _is_function(fn) -> bool:
    """fn is a torch.autograd.Function's apply (or wraps one)."""
    owner = getattr(fn, "__self__", None)
    return isinstance(owner, type) and issubclass(owner, torch.autograd.Function)


def _autograd_call(q, k, v, causal, blocks, do, limit, rule):
    B, H, N_q, d = q.shape
    N_k = k.shape[-2]

    def call(fn):
        q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
        shapes = []

        def pack(x):
            shapes.append(tuple(x.shape))
            return x

        def sources(w):
            w.source(q_, "q")
            w.source(k_, "k")

        def forward(w):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
                return fn(q_, k_, v_, causal, *blocks)

        fwd_rule = bwd_rule = None
        if rule is not None:
            fwd_rule = TileRule(N_q, N_k, d, *blocks, phase="the forward", heads=B * H)
            bwd_rule = TileRule(N_q, N_k, d, *blocks, passes=2, phase="the backward", heads=B * H)
        try:
            o = watched_call(forward, limit_elems=limit, rule=fwd_rule, prepare=sources)[0]
            saved = _saved_scores(shapes, B, H, N_q, N_k, d)
            if saved and not _is_function(fn):
                saved = f"plain torch autograd recorded your loop and {saved}"
            if saved:
                raise Shortcut(saved)
            if not isinstance(o, torch.Tensor):
                raise TypeError(f"expected a tensor o, got {type(o).__name__} (return o alone)")

            def backward(w):
                return torch.autograd.grad(o, (q_, k_, v_), do, allow_unused=True)

            grads = watched_call(backward, limit_elems=limit, rule=bwd_rule, prepare=sources)[0]
        except Shortcut as e:
            raise with_rule(e) from None
        if rule is not None:
            kept = kept_copy(fn, {"K": k, "V": v}, N_q, N_k)
            if kept:
                raise Shortcut(f"{kept}: a tiled loop reads K and V one block at a time")
        return (o.detach(), *grads)

    return call


def _check_function(got, expected):
    missing = [n for n, g in zip(("dq", "dk", "dv"), got[1:]) if g is None]
    if missing:
        return (
            False,
            f"no gradient for {', '.join(missing)}",
            (
                f"backward returned None for {', '.join(missing)}: return dq, dk, dv (then None "
                "for causal, block_m and block_n)"
            ),
        )
    return compare(tuple(got), expected, _F64, ("o", "dq", "dk", "dv"))


_FUNCTION_FORMULA = """
forward(ctx, q, k, v, causal, block_m, block_n):
    o, lse = your tiled forward(q, k, v, causal, block_m, block_n)
    ctx.save_for_backward(q, k, v, o, lse); ctx.causal = causal; ctx.blocks = (block_m, block_n)
    return o
backward(ctx, do): q, k, v, o, lse = ctx.saved_tensors
    return (*your tiled backward(do, q, k, v, o, lse, ctx.causal, *ctx.blocks), None, None, None)
The loops are chapter 03's and 04's, on (B, H, N, d) tensors: every op works on the last two dims.
"""


@grader(
    "flashedu.checks.ch05.TiledAttention",
    "flashedu.torch_tiled.forward",
    "flashedu.torch_tiled.backward",
    formula=_FUNCTION_FORMULA,
)
def check_autograd_function(fn, *, seed=None, out=print) -> Report:
    """Grade `fn(q, k, v, causal, block_m, block_n) -> o`, e.g. `MyFlashAttention.apply`, built on
    your own PyTorch tiled loops in the grader's tiles (block_m query rows by block_n keys): o and
    the gradients of q, k, v (float64, (B, H, N, d)); nothing of size N_q x N_k saved for backward
    or made on the way, no key tile wider than block_n, one pass over the keys in the forward,
    no fused attention, no flashedu implementation called."""
    rng = rng_for(seed)
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))
    bm, bn = r(4, 6), r(3, 5)
    n = 3 * max(bm, bn) + r(1, 2)
    lbm, lbn = r(9, 16), r(9, 14)  # the method case: many key blocks, both lengths ragged
    lq, lk = 2 * lbm + r(1, lbm - 1), r(36, 44) * lbn + r(1, lbn - 1)
    specs = [  # (label, (B, H, N_q, N_k, d), causal, blocks, hint)
        ("N_q=5, N_k=7, one tile", (1, 2, 5, 7, _D), False, (16, 16),
         "backward returns one gradient per forward input, in order: dq, dk, dv, then None "
         "for causal, block_m and block_n"),
        (f"N_q=N_k={n}, blocks {bm}x{bn}", (1, 1, n, n, _D), False, (bm, bn), ""),
        ("causal, N_q=N_k=9", (2, 1, 9, 9, _D), True, (bm, bn), ""),
        ("causal, N_q=3 < N_k=21", (1, 2, 3, 21, _D), True, (bm, bn), ""),
        ("causal, N_q=20 > N_k=4 (empty rows)", (1, 1, 20, 4, _D), True, (bm, bn), ""),
        ("N_q=N_k=128, 16x16 tiles: memory", (1, 1, 128, 128, _D), False, (16, 16), ""),
        (f"causal, N_q={lq}, N_k={lk}, blocks {lbm}x{lbn}: tiles and passes",
         (1, 1, lq, lk, 7), True, (lbm, lbn), "method"),
    ]  # fmt: skip
    cases = []
    for label, (B, H, N_q, N_k, d), causal, blocks, hint in specs:
        q, k, v = random_qkv(B, H, N_q, N_k, d, "float64", seed=rng, kind="torch")
        do = _torch(rng.standard_normal((B, H, N_q, d)))
        want = (
            _torch(reference.forward(q, k, v, causal=causal)[0]),
            *map(_torch, reference.backward(do, q, k, v, causal=causal)),
        )
        limit = B * H * N_q * N_k // 2 if N_q == N_k == 128 else None
        method = hint == "method"
        cases.append(
            Case(
                label,
                (),
                want,
                hint=("" if method else hint)
                or "o, dq, dk, dv must be exact attention and its gradients",
                check=_check_function,
                mistakes=_variants(q, k, v, do, causal, blocks),
                inputs=(
                    f"q {(B, H, N_q, d)}, k and v {(B, H, N_k, d)}, causal={causal}, "
                    f"block_m={blocks[0]}, block_n={blocks[1]}"
                ),
                call=_autograd_call(q, k, v, causal, blocks, do, limit, method or None),
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
