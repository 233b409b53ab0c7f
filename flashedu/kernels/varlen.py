"""Packed sequences ("varlen") in one launch of the Triton kernels, no padding.

flash-attn's layout (`flash_attn_varlen_func`): q (total_q, H, d), k and v (total_k, H_kv, d), and
the boundaries of the n sequences as prefix sums cu_seqlens_q / cu_seqlens_k (n + 1,). Sequence s
is q[cu_q[s]:cu_q[s+1]] against k, v[cu_k[s]:cu_k[s+1]]; tokens never see another sequence.

The packed tensors are handed to the same forward and backward kernels as (1, H, total, d) views
(their strides, no copy), with VARLEN set: the grid's batch axis runs over sequences, each program
reads its sequence's start and length from cu_seqlens, and the grid covers `max_seqlen` rows, so
programs past the end of a shorter sequence stop at once. Causal and windows are bottom-right
within each sequence (query i sees key j iff j <= i + len_k - len_q), as everywhere in flashedu; a
score mod gets the sequence index as `b` and positions within the sequence.

`attention_varlen` is differentiable (an autograd Function over `forward` and `backward`) and is
what `flashedu.varlen.attention_varlen(..., impl="triton")` runs, and "auto" on CUDA tensors.
lse is (H, total_q), float32, as flash-attn returns it for packed input.

Limits: fp16, bf16, fp32; one head dim d for q, k and v (as `validation.check_varlen` checks); the
launch configs are the first, untuned entries of the kernels' tables.

notebooks/10_in_practice.ipynb teaches packed sequences (`flashedu.varlen`); this is their
one-launch path in the kernels of notebooks/06_triton_forward.ipynb.
"""

from __future__ import annotations

import torch

from ..validation import check_varlen
from .bwd import check_grad_inputs, run_backward
from .fwd import run_forward
from .launch import launch_config, out_dtype, plan


def _bhnd(x: torch.Tensor) -> torch.Tensor:
    """(total, heads, d) -> the (1, heads, total, d) view the kernels take (no copy)."""
    return x.permute(1, 0, 2).unsqueeze(0)


def _setup(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, opts, name):
    """Validate; return the plan and the boundaries as int32 tensors on q's device."""
    cu_q, _ = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    causal, scale, window, alibi, mod = opts
    pl = plan(_bhnd(q), _bhnd(k), _bhnd(v), causal, scale, window, alibi, mod, name, len(cu_q) - 1)
    cu = tuple(
        c.to(device=q.device, dtype=torch.int32).contiguous() for c in (cu_seqlens_q, cu_seqlens_k)
    )
    return pl, cu


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size=None,
    alibi_slopes=None,
    score_mod=None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over packed sequences with one launch of the forward kernel.

    Args:
        q: (total_q, H, d); k, v: (total_k, H_kv, d), H % H_kv == 0; cu_seqlens_q, cu_seqlens_k:
            (n + 1,) int32 (or int64) prefix sums of the sequence lengths; max_seqlen_q,
            max_seqlen_k: at least the longest sequence. The options as in
            `kernels.forward`, per sequence (alibi_slopes of shape (H,)).
    Returns:
        o: (total_q, H, d) in q's dtype, 0 on rows that see nothing; lse: (H, total_q) float32.
    """
    opts = (causal, softmax_scale, window_size, alibi_slopes, score_mod)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if q.shape[0] == 0 or k.shape[0] == 0:  # nothing to launch: no rows, or rows that see nothing
        check_varlen(*args)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device)
        return torch.zeros_like(q), lse
    pl, cu = _setup(*args, opts, "kernels.varlen.forward")
    o = torch.empty(q.shape, device=q.device, dtype=out_dtype(q, pl.flags))  # packed layout
    config = launch_config(block_m, block_n)
    o4, lse = run_forward(_bhnd(q), _bhnd(k), _bhnd(v), pl, config, cu, max_seqlen_q, _bhnd(o))
    return o4[0].transpose(0, 1), lse[0]


def backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size=None,
    alibi_slopes=None,
    score_mod=None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) in the packed layout of q, k, v, from `forward`'s o and lse (H,
    total_q), one launch per backward kernel."""
    name = "kernels.varlen.backward"
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if q.shape[0] == 0 or k.shape[0] == 0:
        check_varlen(*args)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    opts = (causal, softmax_scale, window_size, alibi_slopes, score_mod)
    pl, cu = _setup(*args, opts, name)
    lse4 = lse.unsqueeze(0) if lse.ndim == 2 else lse
    check_grad_inputs(_bhnd(do), _bhnd(o), lse4, _bhnd(q), _bhnd(v), name)
    config = launch_config(block_m, block_n)
    grads = run_backward(
        _bhnd(do), _bhnd(q), _bhnd(k), _bhnd(v), _bhnd(o), lse4, pl, config, config,
        cu=cu, max_seqlen=(max_seqlen_q, max_seqlen_k), name=name,
    )  # fmt: skip
    return tuple(g[0].transpose(0, 1) for g in grads)


class VarlenAttention(torch.autograd.Function):
    """o = VarlenAttention.apply(q, k, v, cu_q, cu_k, max_q, max_k, options): `forward` and
    `backward` for autograd; saves q, k, v, o and lse (O(total) memory)."""

    @staticmethod
    def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options):
        return forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **dict(options)
        )

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, cu_q, cu_k, max_q, max_k, options = inputs
        o, lse = output
        ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k)
        ctx.settings = (max_q, max_k, dict(options))
        ctx.mark_non_differentiable(lse)

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, options = ctx.settings
        dq, dk, dv = backward(do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, **options)
        return dq, dk, dv, None, None, None, None, None


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size=None,
    score_mod=None,
) -> torch.Tensor:
    """Differentiable packed attention in one launch: o (total_q, H, d). Arguments as `forward`;
    the signature `flashedu.varlen.attention_varlen` calls for impl="triton"."""
    options = dict(
        causal=causal, softmax_scale=softmax_scale, window_size=window_size, score_mod=score_mod
    )
    o, _ = VarlenAttention.apply(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, tuple(options.items())
    )
    return o
