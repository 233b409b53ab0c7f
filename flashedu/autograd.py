"""A `torch.autograd.Function` around any attention implementation in `flashedu.IMPLEMENTATIONS`.

The forward pass calls the implementation's `forward` and saves only q, k, v, o and lse for
backward: O(N d) bytes, where standard attention keeps the (N_q, N_k) probability matrix. The
backward pass hands those back to the implementation's `backward`, which recomputes P block by
block. The same wrapper serves the PyTorch (`torch_tiled`), Triton (`triton`) and NumPy (`naive`,
`tiled`, `reference`) implementations; NumPy ones are bridged by copying tensors to host arrays and
back, so they work on CPU tensors and are slow on a GPU.

    o = flash_attention(q, k, v, causal=True)  # differentiable, impl="torch_tiled"
    o = flash_attention(q, k, v, impl="triton", window_size=(128, 0))

Attention sinks (`sinks=`, chapter 12): one logit per query head that joins every softmax row as
a column with no value. The implementation runs unchanged over the keys; its final state (o, lse)
then takes the sink, lse' = logaddexp(lse, sink) and o' = o * exp(lse - lse'), exact and in
[0, 1] whatever the logits (a kernel that splits the keys must not do this per split: its
combine adds the sink once, `flashedu.kernels.paged`). The backward is the implementation's own,
given (o', lse'), plus dsink_h = -sum over rows of exp(sink_h - lse') * rowsum(dO * o').

`saved_tensor_bytes` measures what autograd keeps alive for backward, for any function of tensors.

Transforms: under `torch.func.vmap` the mapped dimension is folded into the batch (one call of
the implementation for the whole map), for the forward and the backward alike, so per-sample
gradients and `torch.func.jacrev` work with every implementation. `torch.compile(fullgraph=True)`
traces a call through a torch implementation (`torch_tiled`); the NumPy ones copy tensors to host
arrays, which a graph cannot hold.

Limits: first derivatives in reverse mode only. Asking for a gradient of a gradient (double
backward) raises NotImplementedError, and so does forward mode (`torch.func.jvp`, `jacfwd`,
`hessian`: PyTorch's own message, since a custom `jvp` would keep torch.compile from tracing the
Function); no gradient flows to `alibi_slopes` or other extras.

Introduced in notebooks/05_pytorch_autograd.ipynb.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import numpy as np
import torch

from ._env import TritonUnavailable, is_triton_missing
from .dtypes import dtype_name
from .registry import IMPLEMENTATIONS, Implementation
from .validation import check_sinks, lse_from_forward

# keyword -> the registry feature an implementation needs to accept it
_FEATURES = {"window_size": "window", "alibi_slopes": "alibi", "score_mod": "score_mod"}


def get_impl(name) -> Implementation:
    """The registry entry called `name`, importing its module; a clear error if it cannot be used
    here."""
    if not isinstance(name, str):
        raise TypeError(
            f"impl must be a str, one of {sorted(IMPLEMENTATIONS)}, got {type(name).__name__} "
            f"{name!r}"
        )
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"impl must be one of {sorted(IMPLEMENTATIONS)}, got {name!r}")
    impl = IMPLEMENTATIONS[name]
    try:
        impl.module
    except ModuleNotFoundError as e:
        if is_triton_missing(e):
            raise TritonUnavailable(f"impl={name!r}") from None
        own = (e.name or "").split(".")[0] == "flashedu"
        what = "its module" if own else f"the package {e.name!r} it needs"
        raise ImportError(f"impl={name!r} is not available: {what} cannot be imported ({e})") from e
    return impl


def _check_support(impl: Implementation, q, k, extras: dict) -> None:
    """What the registry says `impl` supports: dtype, GQA, window, ALiBi. Shapes, scale and mask
    are the implementation's own validation, which runs once, inside its forward."""
    if dtype_name(q.dtype) not in impl.dtypes:
        raise TypeError(
            f"impl={impl.name!r} supports dtypes {list(impl.dtypes)}, got {dtype_name(q.dtype)}"
        )
    gqa = q.ndim == k.ndim == 4 and q.shape[1] != k.shape[1]
    if gqa and "gqa" not in impl.features:
        raise NotImplementedError(
            f"impl={impl.name!r} needs as many K/V heads as query heads (no GQA), "
            f"got H={q.shape[1]} and H_kv={k.shape[1]}"
        )
    for key, value in extras.items():
        if key in _FEATURES and _FEATURES[key] not in impl.features:
            raise NotImplementedError(
                f"impl={impl.name!r} does not support {key}; got {key}={value!r}"
            )


def _host(x):
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x


def _call(impl: Implementation, fn, tensors: tuple, kwargs: dict) -> tuple:
    """fn(*tensors, **kwargs) for the registry's `impl.forward` or `impl.backward`. NumPy
    implementations get host arrays, and their results come back as tensors on the inputs'
    device."""
    if impl.kind == "torch":
        return fn(*tensors, **kwargs)
    device = tensors[0].device
    outs = fn(*(_host(t) for t in tensors), **{k: _host(v) for k, v in kwargs.items()})
    return tuple(torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in outs)


def _fold(x, dim, size: int):
    """Move vmap's mapped dimension `dim` (None: not mapped) of x (B, ...) to the front and fold it
    into the batch: (size * B, ...)."""
    x = x.expand(size, *x.shape) if dim is None else x.movedim(dim, 0)
    return x.reshape(size * x.shape[1], *x.shape[2:])


def _unfold(x, size: int):
    return x.reshape(size, x.shape[0] // size, *x.shape[1:])


def _fold_extras(extras: tuple, size: int) -> tuple:
    """Per-batch ALiBi slopes (B, H) repeat for each mapped copy of the batch."""
    out = []
    for key, value in extras:
        if key == "alibi_slopes" and getattr(value, "ndim", 1) == 2:
            value = torch.as_tensor(value).repeat(size, 1)
        out.append((key, value))
    return tuple(out)


class FlashAttention(torch.autograd.Function):
    """o, lse = FlashAttention.apply(q, k, v, impl_name, causal, softmax_scale, extras).

    `extras` is a tuple of (keyword, value) pairs passed on to the implementation. Saves q, k, v, o,
    lse and nothing of size N_q x N_k; backward recomputes through the implementation. Use
    `flash_attention`, which checks what the implementation supports first.
    """

    @staticmethod
    def forward(q, k, v, impl_name, causal, softmax_scale, extras):
        impl = IMPLEMENTATIONS[impl_name]
        kwargs = dict(extras, causal=causal, softmax_scale=softmax_scale)
        return _call(impl, impl.forward, (q, k, v), kwargs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, impl_name, causal, softmax_scale, extras = inputs
        o, lse = output
        ctx.save_for_backward(q, k, v, o, lse)  # (B, H, N, d) x 4 and (B, H, N_q): O(N), not N^2
        ctx.settings = (impl_name, causal, softmax_scale, extras)
        ctx.mark_non_differentiable(lse)

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = FlashAttentionBackward.apply(do, q, k, v, o, lse, *ctx.settings)
        return dq, dk, dv, None, None, None, None  # none for the settings

    @staticmethod
    def vmap(info, in_dims, q, k, v, impl_name, causal, softmax_scale, extras):
        n = info.batch_size
        q, k, v = (_fold(x, dim, n) for x, dim in zip((q, k, v), in_dims[:3]))
        extras = _fold_extras(extras, n)
        o, lse = FlashAttention.apply(q, k, v, impl_name, causal, softmax_scale, extras)
        return (_unfold(o, n), _unfold(lse, n)), (0, 0)


class FlashAttentionBackward(torch.autograd.Function):
    """dq, dk, dv = FlashAttentionBackward.apply(do, q, k, v, o, lse, impl_name, causal,
    softmax_scale, extras): the implementation's backward, as a function autograd can see, so that
    vmap can batch it (per-sample gradients, `jacrev`) and a second derivative fails by name."""

    @staticmethod
    def forward(do, q, k, v, o, lse, impl_name, causal, softmax_scale, extras):
        impl = IMPLEMENTATIONS[impl_name]
        kwargs = dict(extras, causal=causal, softmax_scale=softmax_scale)
        with lse_from_forward():  # lse is the forward's own: no host sync to scan it on a GPU
            return _call(impl, impl.backward, (do.contiguous(), q, k, v, o, lse), kwargs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(
            "flashedu.autograd: double backward (a gradient of a gradient) is not supported: the "
            "attention backward is computed by the implementation's own kernel, which has no "
            "derivative of its own"
        )

    @staticmethod
    def vmap(info, in_dims, do, q, k, v, o, lse, impl_name, causal, softmax_scale, extras):
        n = info.batch_size
        args = [_fold(x, dim, n) for x, dim in zip((do, q, k, v, o, lse), in_dims[:6])]
        grads = FlashAttentionBackward.apply(
            *args, impl_name, causal, softmax_scale, _fold_extras(extras, n)
        )
        return tuple(_unfold(g, n) for g in grads), (0, 0, 0)


def _with_sinks(o, lse, sinks):
    """The sink folded into a finished row state: (o', lse') with lse' = logaddexp(lse, sink) and
    o' = o * exp(lse - lse'); a row with neither keys nor sink (lse' = -inf) stays o' = 0."""
    sink = sinks.to(lse.dtype)[None, :, None]
    lse_s = torch.logaddexp(lse, sink)
    keep = torch.where(lse_s == -torch.inf, 0.0, torch.exp(lse - lse_s))
    return (o.to(lse.dtype) * keep[..., None]).to(o.dtype), lse_s


class FlashAttentionWithSinks(torch.autograd.Function):
    """o, lse = FlashAttentionWithSinks.apply(q, k, v, sinks, impl_name, causal, softmax_scale,
    extras): `FlashAttention` with one sink logit per query head (see the module's docstring);
    differentiable in q, k, v and sinks. Saves q, k, v, sinks, o and lse, as `FlashAttention`."""

    @staticmethod
    def forward(q, k, v, sinks, impl_name, causal, softmax_scale, extras):
        impl = IMPLEMENTATIONS[impl_name]
        kwargs = dict(extras, causal=causal, softmax_scale=softmax_scale)
        o, lse = _call(impl, impl.forward, (q, k, v), kwargs)
        return _with_sinks(o, lse, sinks)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, sinks, impl_name, causal, softmax_scale, extras = inputs
        o, lse = output
        ctx.save_for_backward(q, k, v, sinks, o, lse)
        ctx.settings = (impl_name, causal, softmax_scale, extras)
        ctx.mark_non_differentiable(lse)

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, sinks, o, lse = ctx.saved_tensors
        dq, dk, dv = FlashAttentionBackward.apply(do, q, k, v, o, lse, *ctx.settings)
        D = (do.to(lse.dtype) * o.to(lse.dtype)).sum(-1)  # (B, H, N_q)
        gap = sinks.to(lse.dtype)[None, :, None] - lse
        p_sink = torch.where(lse == -torch.inf, 0.0, torch.exp(gap))  # the sink's probability
        dsinks = -(p_sink * D).sum(dim=(0, 2)).to(sinks.dtype)
        return dq, dk, dv, dsinks, None, None, None, None


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    impl: str = "torch_tiled",
    return_lse: bool = False,
    sinks: torch.Tensor | None = None,
    **extras,
):
    """Differentiable exact attention through the implementation `impl` of
    `flashedu.IMPLEMENTATIONS`.

    Args:
        q: (B, H, N_q, d) tensor.  k, v: (B, H_kv, N_k, d), H % H_kv == 0 (if the implementation
            supports GQA).
        causal: query i sees key j iff j <= i + N_k - N_q (bottom-right aligned); a bool.
        softmax_scale: default 1 / sqrt(d).
        impl: a registry name, e.g. "torch_tiled", "triton", "naive", "tiled".
        return_lse: also return lse (B, H, N_q), which carries no gradient.
        sinks: None, or (H,) attention sinks, one logit per query head (floating point, on q's
            device), differentiable; lse then includes the sink.
        extras: passed to the implementation, e.g. block_m, block_n, window_size, alibi_slopes.
    Returns:
        o (B, H, N_q, d) in q's dtype, or (o, lse) with return_lse=True.

    The implementation validates q, k, v, the scale and the mask once, in its forward; this checks
    only that the inputs are tensors and that the implementation supports what is asked.
    """
    for arg, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"flash_attention: {arg} must be a torch.Tensor, got "
                f"{type(x).__module__}.{type(x).__name__}"
            )
    implementation = get_impl(impl)
    extras = {key: value for key, value in extras.items() if value is not None}
    _check_support(implementation, q, k, extras)
    if sinks is None:
        o, lse = FlashAttention.apply(q, k, v, impl, causal, softmax_scale, tuple(extras.items()))
    else:
        _check_sink_tensor(sinks, q)
        o, lse = FlashAttentionWithSinks.apply(
            q, k, v, sinks, impl, causal, softmax_scale, tuple(extras.items())
        )
    return (o, lse) if return_lse else o


def _check_sink_tensor(sinks, q) -> None:
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(
            f"flash_attention: sinks must be a torch.Tensor of shape (H,), got "
            f"{type(sinks).__module__}.{type(sinks).__name__}"
        )
    if q.ndim == 4:  # else the implementation names q's shape
        check_sinks(sinks, q.shape[1], name="flash_attention")
    if sinks.device != q.device:
        raise ValueError(
            f"flash_attention: sinks must be on q's device {q.device}, got {sinks.device}"
        )


# torch.autograd.Function.apply binds the arguments of a Function with a separate setup_context
# through inspect.signature(cls.forward) on every call, about 30 us of host time each; a signature
# computed once and kept on the function is what inspect.signature returns at once.
for _fn in (FlashAttention, FlashAttentionBackward, FlashAttentionWithSinks):
    _fn.forward.__signature__ = inspect.signature(_fn.forward)


@dataclass
class Saved:
    """What autograd keeps for backward: each saved tensor's shape and dtype, and distinct bytes
    held."""

    shapes: list[tuple[tuple[int, ...], torch.dtype]] = field(default_factory=list)
    nbytes: int = 0


def saved_tensor_bytes(fn, *args, **kwargs) -> Saved:
    """Run fn(*args, **kwargs) and record every tensor autograd saves for the backward pass.

    A tensor saved twice (or saved as a view of another saved tensor) shares storage and is counted
    once, so `nbytes` is the memory those saved tensors keep alive until backward runs.
    """
    saved, seen = Saved(), set()

    def pack(x):
        saved.shapes.append((tuple(x.shape), x.dtype))
        storage = x.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            saved.nbytes += storage.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn(*args, **kwargs)
    return saved
