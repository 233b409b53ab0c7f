"""flashedu: FlashAttention, built from scratch.

Every implementation module shares one contract (see `flashedu.registry`):

    forward(q, k, v, *, causal=False, softmax_scale=None, ...) -> (o, lse)
    backward(do, q, k, v, o, lse, *, causal=False, softmax_scale=None, ...) -> (dq, dk, dv)

with layout (B, H, N, d). `flashedu.attention` is the autograd-aware torch entry point and
`flashedu.scaled_dot_product_attention` a drop-in for PyTorch's; `flashedu.attention_varlen` takes
packed sequences in flash-attn's layout. Submodules load on first use.
"""

from __future__ import annotations

import importlib

from . import _env  # sets TRITON_INTERPRET=1 when there is no GPU, before triton loads
from .registry import IMPLEMENTATIONS

__version__ = "0.1.0"
__all__ = [
    "IMPLEMENTATIONS",
    "attention",
    "attention_varlen",
    "scaled_dot_product_attention",
    "__version__",
]

# public function -> the module that defines it
_API = {"attention": ".api", "scaled_dot_product_attention": ".api", "attention_varlen": ".varlen"}


def __getattr__(name: str):
    if name in _API:
        return getattr(importlib.import_module(_API[name], __name__), name)
    try:
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as e:
        if e.name == f"{__name__}.{name}":
            raise AttributeError(f"module 'flashedu' has no attribute {name!r}") from None
        if _env.is_triton_missing(e) and not isinstance(e, _env.TritonUnavailable):
            raise _env.TritonUnavailable(f"flashedu.{name}") from None
        raise
