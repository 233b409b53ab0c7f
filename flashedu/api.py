"""The user-facing, autograd-aware entry points: `attention` and a drop-in
`scaled_dot_product_attention`.

    # flash-attn conventions: bottom-right causal
    o = flashedu.attention(q, k, v, causal=True)
    # PyTorch's, exactly
    o = flashedu.scaled_dot_product_attention(query, key, value, is_causal=True)

`attention` picks an implementation ("auto": the Triton kernels for CUDA tensors they support,
otherwise the PyTorch tiled code) and differentiates through `flashedu.autograd.FlashAttention`.

`scaled_dot_product_attention` has the signature and semantics of `torch.nn.functional.
scaled_dot_product_attention`, so a model can swap it in. Differences, all loud:
* `attn_mask` may be None or a `torch.nn.attention.bias.CausalBias` (`causal_upper_left`,
  `causal_lower_right`); any other mask tensor raises NotImplementedError (tiles skip masked blocks
  by position, they do not read an (L, S) mask from memory).
* `dropout_p` must be 0: the course computes exact attention; anything else raises
  NotImplementedError.
* `value` may have its own head dimension Ev, as in PyTorch; every implementation takes it.
* Where PyTorch fails on a shape mismatch with a RuntimeError, this raises ValueError naming the
  argument.
* `scale` must be a real number: `scale=True` is a TypeError, where PyTorch reads it as 1.0.

Introduced in notebooks/05_pytorch_autograd.ipynb.
"""

from __future__ import annotations

import math

import torch

from ._env import require_triton
from .autograd import flash_attention, get_impl
from .registry import IMPLEMENTATIONS
from .validation import resolve_scale


def _auto_impl(q: torch.Tensor, k=None, v=None) -> str:
    """ "hopper" where `dispatch.preferred(q, k, v)` (sm_90, at a head dim where the Hopper
    forward was measured faster); "triton" for a CUDA tensor whose dtype and head dims (q's, and
    v's when given) the Triton kernels support; else "torch_tiled"."""
    if not q.is_cuda:
        return "torch_tiled"
    try:
        mod = get_impl("triton").module
        if get_impl("hopper").module.preferred(q, k, v):
            return "hopper"
    except ImportError:
        return "torch_tiled"
    dtypes = getattr(mod, "DTYPES", ())
    head_dims = getattr(mod, "HEAD_DIMS", ())
    dims_ok = q.shape[-1] in head_dims and (v is None or v.shape[-1] in head_dims)
    return "triton" if q.dtype in dtypes and dims_ok else "torch_tiled"


def _hopper_pad(q, k, v) -> int | None:
    """`hopper.dispatch.pad_width` where CUDA tensors can reach it, else None."""
    if not q.is_cuda:
        return None
    try:
        return get_impl("hopper").module.pad_width(q, k, v)
    except ImportError:
        return None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    impl: str = "auto",
    block_table: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention with autograd, flash-attn conventions.

    Args:
        q: (B, H, N_q, d).  k: (B, H_kv, N_k, d), v: (B, H_kv, N_k, d_v), H % H_kv == 0.
        causal: query i sees key j iff j <= i + N_k - N_q (bottom-right aligned).
        softmax_scale: default 1 / sqrt(d).
        impl: "auto" or any name in `flashedu.IMPLEMENTATIONS` but "reference" (the float64 oracle).
        block_table, cache_seqlens: a paged KV cache (serving, chapter 12): k and v are then
            k_cache (num_pages, page_size, H_kv, d) and v_cache (..., d_v), block_table (B,
            max_pages) int32 lists each sequence's pages, cache_seqlens (B,) int32 its length;
            causal is bottom-right against each length. Read by the Triton paged kernel
            (`decoding.paged_forward`, impl "auto" or "triton"), forward only.
        sinks: (H,) float32 attention sinks, one logit per query head joining every softmax row
            as a column with no value. With a paged cache, through the Triton paged kernel
            (forward only); without one, through any implementation, differentiable in q, k, v
            and sinks (`autograd.FlashAttentionWithSinks`).
    Returns:
        o: (B, H, N_q, d_v) in q's dtype; fully masked rows are 0 and get zero gradients.
    """
    if block_table is not None or cache_seqlens is not None:
        return _decode(q, k, v, causal, softmax_scale, impl, block_table, cache_seqlens, sinks)
    if not isinstance(impl, str):
        raise TypeError(
            f'attention: impl must be a str ("auto" or a registry name), got '
            f"{type(impl).__name__} {impl!r}"
        )
    if impl == "reference" or (impl != "auto" and impl not in IMPLEMENTATIONS):
        names = ["auto"] + sorted(n for n in IMPLEMENTATIONS if n != "reference")
        raise ValueError(
            f"attention: impl must be one of {names}, got {impl!r}"
            + (" (the float64 oracle is flashedu.reference)" if impl == "reference" else "")
        )
    if not isinstance(q, torch.Tensor):
        raise TypeError(
            f"attention: q must be a torch.Tensor, got {type(q).__module__}.{type(q).__name__}"
        )
    tensors = isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    width = _hopper_pad(q, k, v) if impl == "auto" and tensors else None
    if width is not None:  # zero columns to the Hopper width; the scale stays 1 / sqrt(d)
        d = q.shape[-1]
        scale = resolve_scale(softmax_scale, d)
        qp, kp, vp = (torch.nn.functional.pad(x, (0, width - d)) for x in (q, k, v))
        o = flash_attention(qp, kp, vp, causal=causal, softmax_scale=scale, impl="hopper",
                            sinks=sinks)  # fmt: skip
        return o[..., :d]
    name = _auto_impl(q, *((k, v) if tensors else (None, None))) if impl == "auto" else impl
    return flash_attention(
        q, k, v, causal=causal, softmax_scale=softmax_scale, impl=name, sinks=sinks
    )


def _decode(q, k, v, causal, softmax_scale, impl, block_table, cache_seqlens, sinks):
    """`attention` with a paged cache (and maybe sinks): the Triton paged kernel, forward only."""
    name = "attention"
    if (block_table is None) != (cache_seqlens is None):
        given, missing = (
            ("block_table", "cache_seqlens") if cache_seqlens is None else
            ("cache_seqlens", "block_table")
        )  # fmt: skip
        raise ValueError(
            f"{name}: {given} was given without {missing}; a paged cache needs both (the pages "
            "of each sequence and how many keys each holds)"
        )
    what = "a paged KV cache (block_table)"
    if impl not in ("auto", "triton"):
        raise ValueError(
            f"{name}: impl={impl!r} cannot read {what}: only the Triton decoding kernels do; "
            'use impl="auto" or "triton"'
        )
    tensors = [x for x in (q, k, v, sinks) if isinstance(x, torch.Tensor)]
    if torch.is_grad_enabled() and any(x.requires_grad for x in tensors):
        raise NotImplementedError(
            f"{name}: {what} is forward only (decoding needs no gradient); call it under "
            "torch.no_grad() or on tensors that do not require grad"
        )
    require_triton(f"attention with {what}")
    from . import decoding

    kw = dict(causal=causal, softmax_scale=softmax_scale, sinks=sinks)
    return decoding.paged_forward(q, k, v, block_table, cache_seqlens, **kw)[0]


def top_left_causal(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """PyTorch's `is_causal=True` (top-left: query i sees key j iff j <= i) through bottom-right
    `attention`.

    The two alignments differ by the shift N_k - N_q, and each case maps exactly:
      N_q == N_k: they coincide.
      N_q <  N_k: no query sees a key past position N_q - 1, so drop those keys; then N_q == N_k.
      N_q >  N_k: the first N_k queries are causal with N_q == N_k; the other N_q - N_k see
                  every key.
    """
    N_q, N_k = q.shape[-2], k.shape[-2]
    if N_q <= N_k:
        return attention(
            q, k[..., :N_q, :], v[..., :N_q, :], causal=True, softmax_scale=softmax_scale, impl=impl
        )
    head = attention(q[..., :N_k, :], k, v, causal=True, softmax_scale=softmax_scale, impl=impl)
    tail = attention(q[..., N_k:, :], k, v, causal=False, softmax_scale=softmax_scale, impl=impl)
    return torch.cat([head, tail], dim=-2)  # (B, H, N_q, d)


def _causal_from_mask(attn_mask, is_causal: bool, L: int, S: int) -> str | None:
    """None, "top_left" or "bottom_right" from SDPA's attn_mask / is_causal pair; errors for the
    rest."""
    if attn_mask is None:
        return "top_left" if is_causal else None
    from torch.nn.attention.bias import CausalBias, CausalVariant

    if not isinstance(attn_mask, CausalBias):
        raise NotImplementedError(
            "scaled_dot_product_attention: attn_mask must be None or a CausalBias "
            "(causal_upper_left / causal_lower_right), "
            f"got a {type(attn_mask).__name__} of shape {tuple(attn_mask.shape)}; "
            "arbitrary masks are not supported: use is_causal=True or "
            "torch.nn.attention.bias.causal_lower_right"
        )
    if is_causal:
        raise ValueError(
            "scaled_dot_product_attention: CausalBias should not be used with is_causal=True"
        )
    if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (L, S):
        raise ValueError(
            f"scaled_dot_product_attention: attn_mask is a causal bias for (L, S) = "
            f"({attn_mask.seq_len_q}, {attn_mask.seq_len_kv}), but query and key give ({L}, {S})"
        )
    return "top_left" if attn_mask.variant == CausalVariant.UPPER_LEFT else "bottom_right"


def _as_4d(query, key, value, enable_gqa: bool):
    """Broadcast SDPA's (N, ..., L, E) batch dims: (B, H, L, E), (B, H_kv, S, E) x 2, and the output
    shape."""
    for arg, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"scaled_dot_product_attention: {arg} must be a torch.Tensor, "
                f"got {type(x).__name__}"
            )
        if x.ndim < 2:
            raise ValueError(
                f"scaled_dot_product_attention: {arg} must have shape (..., L, E), "
                f"got {tuple(x.shape)}"
            )
    lead = -3 if enable_gqa else -2  # with GQA the head dim is not broadcast but grouped
    try:
        batch = torch.broadcast_shapes(*(x.shape[:lead] for x in (query, key, value)))
    except RuntimeError:
        heads = [x.shape[-3] if x.ndim > 2 else 1 for x in (query, key, value)]
        why = (
            f"query has {heads[0]} heads and key/value {heads[1]}/{heads[2]}: "
            "pass enable_gqa=True for GQA"
            if not enable_gqa and heads[0] != heads[1]
            else "batch dimensions do not broadcast"
        )
        raise ValueError(
            f"scaled_dot_product_attention: {why}; got query {tuple(query.shape)}, "
            f"key {tuple(key.shape)}, value {tuple(value.shape)}"
        ) from None
    out = []
    for x in (query, key, value):
        x = x.expand(*batch, *x.shape[lead:])
        # the leading dims fold into B by their product, which stays right when one of them is 0
        out.append(
            x.reshape(math.prod(x.shape[:-3]), *x.shape[-3:]) if x.ndim > 2 else x[None, None]
        )
    return (*out, (*batch, *query.shape[lead:-1], value.shape[-1]))


def _nothing_to_attend(q, k, v) -> torch.Tensor:
    """SDPA where nothing is computed: no query rows (B, H or L is 0), no keys (S = 0, where PyTorch
    returns zeros), or Ev = 0. The plain product (q k^T) v is then exactly that empty or zero
    result, and autograd differentiates it to PyTorch's gradients: zeros, or empty."""
    if k.shape[1] and q.shape[1] != k.shape[1]:
        k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    return torch.matmul(torch.matmul(q, k.transpose(-1, -2)), v)  # (B, H, L, S) @ (B, H, S, Ev)


def _check_flags(dropout_p, is_causal) -> None:
    """SDPA's flags: is_causal a bool (as PyTorch demands), dropout_p a real number and 0."""
    if not isinstance(is_causal, bool):
        raise TypeError(
            f"scaled_dot_product_attention: is_causal must be a bool, got "
            f"{type(is_causal).__name__} {is_causal!r}"
        )
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(
            f"scaled_dot_product_attention: dropout_p must be a float, got "
            f"{type(dropout_p).__name__} {dropout_p!r}"
        )
    if dropout_p != 0:
        raise NotImplementedError(
            f"scaled_dot_product_attention: dropout_p must be 0.0 (flashedu computes exact "
            f"attention, no dropout), got dropout_p={dropout_p!r}"
        )


def scaled_dot_product_attention(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    *,
    scale=None,
    enable_gqa=False,
) -> torch.Tensor:
    """Drop-in for `torch.nn.functional.scaled_dot_product_attention`, computed by flashedu.

    query (N, ..., L, E), key (N, ..., S, E), value (N, ..., S, Ev) -> (N, ..., L, Ev).
    `is_causal` is top-left (query i sees key j iff j <= i); `causal_lower_right` masks are
    bottom-right. `scale` defaults to 1/sqrt(E); like PyTorch's, `scale` and `enable_gqa` are
    keyword-only. With
    enable_gqa=True, key and value may have fewer heads (dim -3), H_q % H_kv == 0.
    Unsupported: other attn_mask tensors, dropout_p > 0 (NotImplementedError).

    Empty inputs behave as PyTorch's: a batch, head or query length of 0 gives an empty output, and
    S = 0 (no keys) gives zeros, with zero or empty gradients. As in PyTorch, `is_causal` must be a
    bool and `dropout_p` a number (TypeError otherwise); `scale` must be a real, finite number,
    where PyTorch also takes a bool.
    """
    _check_flags(dropout_p, is_causal)
    q, k, v, out_shape = _as_4d(query, key, value, enable_gqa)
    L, S = q.shape[-2], k.shape[-2]
    causal = _causal_from_mask(attn_mask, is_causal, L, S)
    if enable_gqa and (q.shape[1] % k.shape[1] if k.shape[1] else q.shape[1]):
        raise ValueError(
            "scaled_dot_product_attention: with enable_gqa=True "
            f"query's {q.shape[1]} heads must be "
            f"a multiple of key's {k.shape[1]}"
        )
    name = "scaled_dot_product_attention"
    if scale is not None:
        resolve_scale(scale, 1, name=name, arg="scale")  # a real, finite number, even if unused
    if q.shape[0] * q.shape[1] * L == 0 or S == 0 or v.shape[-1] == 0:
        return _nothing_to_attend(q, k, v).reshape(out_shape)
    softmax_scale = None if scale is None else float(scale)  # checked above; None is 1/sqrt(E)
    if causal == "top_left" and L != S:
        o = top_left_causal(q, k, v, softmax_scale=softmax_scale)
    else:
        o = attention(q, k, v, causal=causal is not None, softmax_scale=softmax_scale)
    return o.reshape(out_shape)
