"""What the GPU check compares the kernels with, computed on the GPU: float64 attention (the truth)
and the same attention in the inputs' own dtype (flash-attn's same-precision yardstick), both by
plain PyTorch formulas with autograd for the gradients, and the two measures of a row, `within` and
`err`.

Used by `flashedu.bench.gpu_check` and `flashedu.bench.gpu_features`. Introduced in
notebooks/08_benchmarks.ipynb.
"""

from __future__ import annotations

import torch

from .. import masks
from ..testing import max_error, tolerance


def float64_attention(q, k, v, do, *, causal, window, slopes, scale, mod=None):
    """o, lse, dq, dk, dv in float64 on q's device (autograd through the plain formulas; masks from
    flashedu.masks; `mod`, a torch function of the scaled scores, e.g. soft-capping). v may have
    its own head dim."""
    N_q, N_k, G = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    s = q64 @ k64.repeat_interleave(G, 1).transpose(-1, -2) * scale  # (B, H, N_q, N_k)
    if mod is not None:
        s = mod(s)
    if slopes is not None:
        s = s + torch.from_numpy(masks.alibi_bias(slopes, N_q, N_k)).to(q.device)
    keep = torch.from_numpy(masks.visible(N_q, N_k, causal=causal, window_size=window)).to(q.device)
    empty = ~keep.any(-1, keepdim=True)  # (N_q, 1) rows that see nothing
    s = s.masked_fill(~keep, float("-inf")).masked_fill(empty, 0.0)
    p = torch.softmax(s, -1).masked_fill(empty, 0.0)
    o = p @ v64.repeat_interleave(G, 1)
    o.backward(do.double())
    lse = torch.logsumexp(s, -1).masked_fill(empty[:, 0], float("-inf"))
    return o.detach(), lse.detach(), q64.grad, k64.grad, v64.grad


def lowp_attention(q, k, v, do, *, causal, window, scale, mod=None):
    """o, dq, dk, dv by PyTorch ops in the inputs' dtype (scores and probabilities rounded to it,
    the softmax in fp32 inside torch.softmax), autograd for the gradients; rows that see nothing
    give 0. flash-attn's tests call this `attention_ref(upcast=False)`."""
    N_q, N_k, G = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    s = (q * scale) @ k.repeat_interleave(G, 1).transpose(-1, -2)  # (B, H, N_q, N_k) in dtype
    if mod is not None:
        s = mod(s)
    keep = torch.from_numpy(masks.visible(N_q, N_k, causal=causal, window_size=window))
    keep = keep.to(q.device)
    empty = ~keep.any(-1, keepdim=True)
    s = s.masked_fill(~keep, float("-inf")).masked_fill(empty, 0.0)
    p = torch.softmax(s, -1).masked_fill(empty, 0.0)
    o = p @ v.repeat_interleave(G, 1)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


def within(x, ref, dtype, grad: bool) -> bool:
    """|x - ref| <= atol + rtol |ref| elementwise with flashedu.testing's tolerance for dtype;
    infinities must match."""
    tol = tolerance(dtype, grad=grad)
    x, ref = x.double(), ref.double()
    same_inf = torch.isinf(x) & torch.isinf(ref) & (x == ref)
    diff = torch.where(same_inf, 0.0, (x - ref).abs())
    return bool((diff <= tol.atol + tol.rtol * torch.where(same_inf, 0.0, ref.abs())).all())


def err(x, ref) -> float:
    """Max |x - ref|; matching infinities (lse of empty rows) count as 0, any NaN as inf."""
    return max_error(x, ref)[0]
