"""Packed sequences ("varlen"): attention over sequences of different lengths, without padding.

Training code concatenates the sequences of a batch into one long tensor instead of padding each to
the longest, and passes their boundaries as prefix sums, in flash-attn's layout
(`flash_attn_varlen_func`):

    q: (total_q, H, d)      k, v: (total_k, H_kv, d)      H % H_kv == 0
    cu_seqlens_q: (n + 1,) int32, [0, len_0, len_0 + len_1, ..., total_q]; likewise cu_seqlens_k
    sequence s: q[cu_seqlens_q[s]:cu_seqlens_q[s + 1]] against k, v sliced by cu_seqlens_k

Tokens attend only within their own sequence; with causal=True, bottom-right within each sequence
(query i of a sequence sees key j iff j <= i + len_k - len_q), as everywhere in flashedu. A sequence
of length 0 contributes nothing; a query sequence whose key sequence is empty gets zeros. The same
result is FlexAttention's document mask over the packed tokens (`flashedu.flex.document`).

`attention_varlen` validates once, then hands the packed tensors to a packed implementation. The one
here, `loop`, runs flashedu's (B=1) attention per sequence through autograd: exact, differentiable,
one launch per sequence. A kernel that takes the packed tensors in one launch registers itself in
`PACKED` under an implementation's name (a function) and is used for that name (and by "auto" for
CUDA tensors when registered as "triton"); it must accept the arguments of `loop` but `impl`.
"triton" is `flashedu.kernels.varlen.attention_varlen`: the Triton kernels over the packed tensors,
one launch per kernel. The checks of the packed layout are `validation.check_varlen`.

Introduced in notebooks/10_in_practice.ipynb.
"""

from __future__ import annotations

from typing import Callable

import torch

from .api import attention
from .registry import IMPLEMENTATIONS
from .validation import check_impl, check_varlen, resolve_scale


def _triton_varlen(*args, **kw):
    """flashedu.kernels.varlen.attention_varlen, imported on first use (so this module, like
    flashedu.registry, does not import triton)."""
    from .kernels.varlen import attention_varlen as one_launch

    return one_launch(*args, **kw)


# impl name -> a one-launch fn(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, softmax_scale)
PACKED: dict[str, Callable] = {"triton": _triton_varlen}
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the Triton kernels take


def varlen_impls() -> list[str]:
    """What `impl` may name: "auto", the one-launch `PACKED` kernels, and every
    `flashedu.attention` implementation for the per-sequence loop."""
    looped = [n for n in IMPLEMENTATIONS if n != "reference"]
    return ["auto", *dict.fromkeys([*PACKED, *looped])]


def loop(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    *,
    causal=False,
    softmax_scale=None,
    impl="auto",
):
    """The per-sequence path: `flashedu.attention` on each (1, H, len, d) slice, concatenated.

    Differentiable (autograd through the slices); max_seqlen_* go unused, as nothing is padded.
    `impl` is checked first, so a bad name is refused even when no sequence would run.
    """
    looped = ["auto", *(n for n in IMPLEMENTATIONS if n != "reference")]
    check_impl(impl, looped, name="attention_varlen.loop")
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs = []
    for q0, q1, k0, k1 in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]):
        if q1 == q0:
            continue  # an empty query sequence produces no rows
        if k1 == k0:  # no keys: every row is fully masked -> 0, as in flashedu's contract
            outs.append(q.new_zeros(q1 - q0, q.shape[1], v.shape[2]))
            continue
        q_s, k_s, v_s = (
            x[a:b].transpose(0, 1).unsqueeze(0).contiguous()  # (1, heads, len, d)
            for x, a, b in ((q, q0, q1), (k, k0, k1), (v, k0, k1))
        )
        o_s = attention(q_s, k_s, v_s, causal=causal, softmax_scale=softmax_scale, impl=impl)
        outs.append(o_s[0].transpose(0, 1))  # (len_q, H, d)
    return torch.cat(outs) if outs else q.new_zeros(0, q.shape[1], v.shape[2])


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
    impl: str = "auto",
) -> torch.Tensor:
    """Exact attention over packed sequences, flash-attn's varlen layout, with autograd.

    Args:
        q: (total_q, H, d).  k, v: (total_k, H_kv, d), H % H_kv == 0.
        cu_seqlens_q, cu_seqlens_k: (n + 1,) int32 (or int64) prefix sums of the n sequence lengths,
            starting at 0, on q's device.
        max_seqlen_q, max_seqlen_k: at least the longest query / key sequence.
        causal: bottom-right within each sequence: query i sees key j iff j <= i + len_k - len_q.
        softmax_scale: default 1 / sqrt(d).
        impl: a name in `PACKED` (one launch), or "auto" or a `flashedu.attention` implementation
            for the per-sequence `loop`.
    Returns:
        o: (total_q, H, d) in q's dtype; rows with nothing visible are 0.
    """
    check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    check_impl(impl, varlen_impls(), name="attention_varlen")
    if not isinstance(causal, bool):
        raise TypeError(f"attention_varlen: causal must be a bool, got {causal!r}")
    scale = resolve_scale(softmax_scale, q.shape[2], name="attention_varlen")
    triton_ok = q.is_cuda and q.dtype in _TRITON_DTYPES and q.shape[2] <= 256
    name = "triton" if impl == "auto" and triton_ok and "triton" in PACKED else impl
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if name in PACKED:
        return PACKED[name](*args, causal=causal, softmax_scale=scale)
    return loop(*args, causal=causal, softmax_scale=scale, impl=impl)
