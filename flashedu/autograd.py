"""A `torch.autograd.Function` around any attention implementation in `flashedu.IMPLEMENTATIONS`.

The forward pass calls the implementation's `forward` and saves only q, k, v, o and lse for
backward: O(N d) bytes, where standard attention keeps the (N_q, N_k) probability matrix. The
backward pass hands those back to the implementation's `backward`, which recomputes P block by
block. The same wrapper serves the PyTorch (`torch_tiled`), Triton (`triton`) and NumPy (`naive`,
`tiled`, `reference`) implementations; NumPy ones are bridged by copying tensors to host arrays and
back, so they work on CPU tensors and are slow on a GPU.

    o = flash_attention(q, k, v, causal=True)  # differentiable, impl="torch_tiled"
    o = flash_attention(q, k, v, impl="triton", window_size=(128, 0))

`saved_tensor_bytes` measures what autograd keeps alive for backward, for any function of tensors.

Limits: first derivatives only (the backward is not itself differentiable, so no double backward);
no gradient flows to `alibi_slopes` or other extras.

Introduced in notebooks/05_pytorch_autograd.ipynb.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch.autograd.function import once_differentiable

from ._validate import check_qkv, resolve_scale
from .registry import IMPLEMENTATIONS, Implementation
from .testing import dtype_name

# keyword -> the registry feature an implementation needs to accept it
_FEATURES = {"window_size": "window", "alibi_slopes": "alibi"}


def get_impl(name: str) -> Implementation:
    """The registry entry called `name`, importing its module; a clear error if it cannot be used
    here."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"impl must be one of {sorted(IMPLEMENTATIONS)}, got {name!r}")
    impl = IMPLEMENTATIONS[name]
    try:
        impl.module
    except ModuleNotFoundError as e:
        what = "its module" if e.name == impl.module_name else f"the package {e.name!r} it needs"
        raise ImportError(f"impl={name!r} is not available: {what} cannot be imported ({e})") from e
    return impl


def _check_support(impl: Implementation, q, k, extras: dict) -> None:
    if dtype_name(q.dtype) not in impl.dtypes:
        raise TypeError(
            f"impl={impl.name!r} supports dtypes {list(impl.dtypes)}, got {dtype_name(q.dtype)}"
        )
    if q.shape[1] != k.shape[1] and "gqa" not in impl.features:
        raise NotImplementedError(
            f"impl={impl.name!r} needs as many K/V heads as query heads (no GQA), "
            f"got H={q.shape[1]} and H_kv={k.shape[1]}"
        )
    for key, value in extras.items():
        if key in _FEATURES and value is not None and _FEATURES[key] not in impl.features:
            raise NotImplementedError(
                f"impl={impl.name!r} does not support {key}; got {key}={value!r}"
            )


def _host(x):
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x


def _run(impl: Implementation, fn: str, tensors: tuple, kwargs: dict) -> tuple:
    """Call impl.<fn>(*tensors, **kwargs); NumPy implementations get host arrays, results come back
    as tensors."""
    if impl.kind == "torch":
        return getattr(impl.module, fn)(*tensors, **kwargs)
    device = tensors[0].device
    outs = getattr(impl.module, fn)(
        *(_host(t) for t in tensors), **{k: _host(v) for k, v in kwargs.items()}
    )
    return tuple(torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in outs)


class FlashAttention(torch.autograd.Function):
    """o, lse = FlashAttention.apply(q, k, v, impl_name, causal, softmax_scale, extras).

    Saves q, k, v, o, lse and nothing of size N_q x N_k; backward recomputes through the
    implementation. Use `flash_attention`, which validates its inputs first.
    """

    @staticmethod
    def forward(ctx, q, k, v, impl_name, causal, softmax_scale, extras):
        impl = IMPLEMENTATIONS[impl_name]
        kwargs = dict(extras, causal=causal, softmax_scale=softmax_scale)
        o, lse = _run(impl, "forward", (q, k, v), kwargs)
        ctx.save_for_backward(
            q, k, v, o, lse
        )  # (B, H, N, d) x 4 and (B, H, N_q): O(N), never O(N^2)
        ctx.impl, ctx.kwargs = impl, kwargs
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _run(ctx.impl, "backward", (do.contiguous(), q, k, v, o, lse), ctx.kwargs)
        return (
            dq,
            dk,
            dv,
            None,
            None,
            None,
            None,
        )  # one gradient per forward input; none for the settings


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    impl: str = "torch_tiled",
    return_lse: bool = False,
    **extras,
):
    """Differentiable exact attention through the implementation `impl` of
    `flashedu.IMPLEMENTATIONS`.

    Args:
        q: (B, H, N_q, d) tensor.  k, v: (B, H_kv, N_k, d), H % H_kv == 0 (if the implementation
            supports GQA).
        causal: query i sees key j iff j <= i + N_k - N_q (bottom-right aligned).
        softmax_scale: default 1 / sqrt(d).
        impl: a registry name, e.g. "torch_tiled", "triton", "naive", "tiled".
        return_lse: also return lse (B, H, N_q), which carries no gradient.
        extras: passed to the implementation, e.g. block_m, block_n, window_size, alibi_slopes.
    Returns:
        o (B, H, N_q, d) in q's dtype, or (o, lse) with return_lse=True.
    """
    check_qkv(q, k, v, name="flash_attention", kind="torch")
    scale = resolve_scale(softmax_scale, q.shape[-1], name="flash_attention")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"flash_attention: causal must be a bool, got {causal!r}")
    implementation = get_impl(impl)
    extras = {
        key: value for key, value in extras.items() if not (key in _FEATURES and value is None)
    }
    _check_support(implementation, q, k, extras)
    o, lse = FlashAttention.apply(q, k, v, impl, bool(causal), scale, extras)
    return (o, lse) if return_lse else o


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
