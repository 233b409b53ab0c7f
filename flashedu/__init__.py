"""flashedu: FlashAttention, built from scratch.

Every implementation module shares one contract (see `flashedu.registry`):

    forward(q, k, v, *, causal=False, softmax_scale=None, ...) -> (o, lse)
    backward(do, q, k, v, o, lse, *, causal=False, softmax_scale=None, ...) -> (dq, dk, dv)

with layout (B, H, N, d). `flashedu.attention` is the autograd-aware torch entry point and
`flashedu.scaled_dot_product_attention` a drop-in for PyTorch's; `flashedu.attention_varlen` takes
packed sequences in flash-attn's layout. Submodules load when imported (`from flashedu import
tiled`); `import flashedu` does not import triton. flashedu/README.md maps the folders to the
chapters.
"""

from __future__ import annotations

from . import _env  # noqa: F401  (sets TRITON_INTERPRET=1 when there is no GPU, before triton loads)
from .api import attention, scaled_dot_product_attention
from .registry import IMPLEMENTATIONS
from .varlen import attention_varlen

__version__ = "0.1.0"
__all__ = [
    "IMPLEMENTATIONS",
    "attention",
    "attention_varlen",
    "scaled_dot_product_attention",
    "__version__",
]
