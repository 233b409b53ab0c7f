"""FlexAttention's two hooks as plain functions, and the explicit arrays the reference takes.

`torch.nn.attention.flex_attention` (Dong et al. 2024, arXiv:2412.05496) lets a user change
attention with two small functions of positions instead of a new kernel:

    score_mod(score, b, h, q_idx, kv_idx) -> new score   score: the scaled q . k of one entry
    mask_mod(b, h, q_idx, kv_idx) -> bool               True: query q_idx may attend to key kv_idx

FlexAttention calls them on single entries (through vmap, or inlined into a Triton kernel once
compiled), and `create_block_mask` evaluates a mask_mod over every (query block, key block) tile to
find the tiles it can skip. The mods here are factories: `softcap(30.0)` returns a score_mod. Where
positions matter for N_q != N_k, `offset` is the key position of query 0 (N_k - N_q for flashedu's
bottom-right alignment).

The converters evaluate a mod on the whole (B, H, N_q, N_k) grid at once, by broadcasting index
tensors: the explicit mask for `flashedu.reference.forward(attn_mask=...)`, the explicit bias of an
additive mod, or the modded scores. `explicit_forward` is the float64 oracle for any pair of mods
(the softmax of `flashedu.softmax`). `flex_forward` runs torch's FlexAttention, eager or compiled,
and `block_map` reads a BlockMask as the "skip" / "partial" / "full" tile map of
`flashedu.decoding.block_map`.

Limits: a mod must be written with tensor operations (no Python `if` on values, no `.item()`):
FlexAttention and the converters both require it. FlexAttention has no backward on CPU (torch
2.13), so the course runs it forward only there. Eager FlexAttention materialises the full score
matrix; only the compiled one is a fused, block-sparse kernel. FlexAttention pads the sequences to
whole blocks and marks every tile of a ragged last query block "partial", where flashedu's
`block_kind`, which looks at the real rows only, may say "full".

Introduced in notebooks/10_in_practice.ipynb.
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable

import numpy as np
import torch

from . import softmax
from .decoding import FULL, PARTIAL, SKIP
from .validation import check_qkv, resolve_scale

ScoreMod = Callable[..., torch.Tensor]
MaskMod = Callable[..., torch.Tensor]
EAGER_WARNING = "flex_attention called without torch.compile"


# -------------------------------------------------------------------------------------- score mods


def alibi(slopes, *, offset: int = 0) -> ScoreMod:
    """ALiBi (Press et al. 2022): score - slopes[h] * |q_idx + offset - kv_idx|."""
    slopes = torch.as_tensor(np.asarray(slopes, dtype=np.float64)).reshape(-1)  # (H,)

    def alibi_mod(score, b, h, q_idx, kv_idx):
        dist = (q_idx + offset - kv_idx).abs()
        return score - (slopes[h] * dist).to(score.dtype)

    return alibi_mod


def softcap(cap: float) -> ScoreMod:
    """Soft-capping (Gemma 2, arXiv:2408.00118): cap * tanh(score / cap), inside (-cap, cap)."""
    if not cap > 0:
        raise ValueError(f"softcap: cap must be a positive number, got {cap!r}")

    def softcap_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return softcap_mod


def relative_bias(table, *, max_distance: int, offset: int = 0) -> ScoreMod:
    """A learned bias per head and relative position: score + table[h, clip(kv - q, -D, D) + D].

    table: (H, 2 D + 1) with D = max_distance; keys further than D away share the end entries
    (T5's idea, Raffel et al. 2020, without its logarithmic buckets).
    """
    table = torch.as_tensor(table)
    if table.ndim != 2 or table.shape[1] != 2 * max_distance + 1:
        raise ValueError(
            f"relative_bias: table must have shape (H, 2 * max_distance + 1) = (H, "
            f"{2 * max_distance + 1}), got {tuple(table.shape)}"
        )

    def relative_bias_mod(score, b, h, q_idx, kv_idx):
        rel = (kv_idx - q_idx - offset).clamp(-max_distance, max_distance) + max_distance
        return score + table[h, rel].to(score.dtype)

    return relative_bias_mod


# --------------------------------------------------------------------------------------- mask mods


def causal(*, offset: int = 0) -> MaskMod:
    """kv_idx <= q_idx + offset (offset = N_k - N_q: flashedu's bottom-right causal)."""

    def causal_mask(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    return causal_mask


def sliding_window(left: int, *, offset: int = 0) -> MaskMod:
    """Causal with a window: q_idx + offset - left <= kv_idx <= q_idx + offset.

    flashedu's window_size=(left, 0).
    """

    def sliding_window_mask(b, h, q_idx, kv_idx):
        dist = q_idx + offset - kv_idx
        return (dist >= 0) & (dist <= left)

    return sliding_window_mask


def prefix_lm(prefix_len: int) -> MaskMod:
    """Prefix-LM (T5): every query sees the first prefix_len keys, and the others causally."""

    def prefix_lm_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < prefix_len)

    return prefix_lm_mask


def document_ids(cu_seqlens) -> torch.Tensor:
    """(total,) int64: the index of the sequence each packed token belongs to, from cu_seqlens."""
    cu = torch.as_tensor(cu_seqlens).to("cpu", torch.int64)
    return torch.repeat_interleave(torch.arange(len(cu) - 1), cu.diff())


def document(cu_seqlens_q, cu_seqlens_k=None, *, causal: bool = False) -> MaskMod:
    """Packed sequences: a query sees only keys of its own sequence (and, if causal, not after it).

    cu_seqlens_q / _k: (n + 1,) prefix sums of the sequence lengths, as for `flashedu.varlen`.
    Causal is bottom-right within each sequence: key j is visible iff j - end_k <= i - end_q, with
    end_q, end_k the ends of the query's sequence in the two packed tensors.
    """
    cu_q = torch.as_tensor(cu_seqlens_q).to("cpu", torch.int64)
    cu_k = cu_q if cu_seqlens_k is None else torch.as_tensor(cu_seqlens_k).to("cpu", torch.int64)
    ids_q, ids_k = document_ids(cu_q), document_ids(cu_k)

    def document_mask(b, h, q_idx, kv_idx):
        doc = ids_q[q_idx]
        same = doc == ids_k[kv_idx]
        if not causal:
            return same
        return same & (kv_idx - cu_k[doc + 1] <= q_idx - cu_q[doc + 1])

    return document_mask


# --------------------------------------------------------------------------------- explicit arrays


def _grids(B: int, H: int, N_q: int, N_k: int):
    """Index tensors that broadcast: b (B,1,1,1), h (1,H,1,1), q (1,1,N_q,1), kv (1,1,1,N_k)."""
    return (
        torch.arange(B).view(B, 1, 1, 1),
        torch.arange(H).view(1, H, 1, 1),
        torch.arange(N_q).view(1, 1, N_q, 1),
        torch.arange(N_k).view(1, 1, 1, N_k),
    )


def mask_array(mask_mod: MaskMod, B: int, H: int, N_q: int, N_k: int) -> np.ndarray:
    """(B, H, N_q, N_k) bool: mask_mod on every entry, for `reference.forward(attn_mask=...)`."""
    keep = torch.as_tensor(mask_mod(*_grids(B, H, N_q, N_k)))
    if keep.dtype != torch.bool:
        raise TypeError(f"mask_array: a mask_mod must return booleans, got {keep.dtype}")
    return keep.broadcast_to(B, H, N_q, N_k).numpy().copy()


def score_array(score_mod: ScoreMod, scores) -> np.ndarray:
    """(B, H, N_q, N_k) float64: the score_mod applied to every entry of the scaled scores."""
    s = torch.as_tensor(np.asarray(scores, dtype=np.float64))
    out = torch.as_tensor(score_mod(s, *_grids(*s.shape)))
    return out.to(torch.float64).broadcast_to(s.shape).numpy().copy()


def bias_array(score_mod: ScoreMod, B: int, H: int, N_q: int, N_k: int) -> np.ndarray:
    """(B, H, N_q, N_k) float64: mod(0), the explicit bias of an additive mod such as `alibi`."""
    return score_array(score_mod, np.zeros((B, H, N_q, N_k)))


def dense_scores(q, k, *, score_mod=None, mask_mod=None, softmax_scale=None) -> np.ndarray:
    """(B, H, N_q, N_k) float64: scale * q k^T, modded, -inf where the mask hides a key (K/V heads
    repeated for GQA)."""
    B, H, _, N_q, N_k, d = check_qkv(q, k, k, name="flex.dense_scores")
    scale = resolve_scale(softmax_scale, d, name="flex.dense_scores")
    q64 = np.asarray(torch.as_tensor(q).detach().cpu().double())
    k64 = np.repeat(np.asarray(torch.as_tensor(k).detach().cpu().double()), H // k.shape[1], axis=1)
    s = np.einsum("bhid,bhjd->bhij", q64, k64) * scale  # (B, H, N_q, N_k)
    if score_mod is not None:
        s = score_array(score_mod, s)
    if mask_mod is not None:
        s = np.where(mask_array(mask_mod, B, H, N_q, N_k), s, -np.inf)
    return s


def explicit_forward(q, k, v, *, score_mod=None, mask_mod=None, softmax_scale=None):
    """The float64 oracle with mods: (o (B, H, N_q, d), lse (B, H, N_q)) from the explicit scores.

    A fully masked row gives o = 0 and lse = -inf, as everywhere in flashedu.
    """
    check_qkv(q, k, v, name="flex.explicit_forward")
    s = dense_scores(q, k, score_mod=score_mod, mask_mod=mask_mod, softmax_scale=softmax_scale)
    v64 = np.asarray(torch.as_tensor(v).detach().cpu().double())
    v64 = np.repeat(v64, s.shape[1] // v64.shape[1], axis=1)  # (B, H, N_k, d)
    return softmax.finalize(*softmax.state(s, v64))


# ----------------------------------------------------------------------------------- FlexAttention


@functools.lru_cache(maxsize=1)
def compiled_flex_attention():
    """torch.compile(flex_attention), made once; each new shape compiles on its first call."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def flex_forward(
    q,
    k,
    v,
    *,
    score_mod=None,
    mask_mod=None,
    block_mask=None,
    softmax_scale=None,
    compiled: bool = False,
    block_size: int = 128,
):
    """torch's FlexAttention on (B, H, N, d) tensors -> (o, lse), lse natural-log as in flashedu.

    mask_mod is turned into a BlockMask of `block_size` tiles unless `block_mask` is given. Eager
    (compiled=False) runs everywhere and silences torch's warning that it materialises the scores.
    Compiled on a CPU, lse is None: torch 2.13's CPU kernel is forward-only and returns no lse.
    """
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    B, H, H_kv, N_q, N_k, _ = check_qkv(q, k, v, name="flex.flex_forward", kind="torch")
    if mask_mod is not None and block_mask is not None:
        raise ValueError("flex_forward: pass mask_mod or block_mask, not both")
    if mask_mod is not None:
        block_mask = create_block_mask(
            mask_mod, B, H, N_q, N_k, device=q.device, BLOCK_SIZE=block_size
        )
    fn = compiled_flex_attention() if compiled else flex_attention
    with_lse = not (compiled and q.device.type == "cpu")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=EAGER_WARNING)
        out = fn(
            q,
            k,
            v,
            score_mod=score_mod,
            block_mask=block_mask,
            scale=softmax_scale,
            enable_gqa=H != H_kv,
            return_aux=AuxRequest(lse=True) if with_lse else None,
        )
    return (out[0], out[1].lse) if with_lse else (out, None)


# -------------------------------------------------------------------------------------- block maps


def block_map(block_mask, *, b: int = 0, h: int = 0) -> np.ndarray:
    """(query blocks, key blocks) array of "skip" / "partial" / "full" read from a BlockMask.

    The format of `flashedu.decoding.block_map`: a partial tile gets its mask applied entry by
    entry, a full one needs no mask, a skipped one is never loaded.
    """
    N_q, N_k = block_mask.seq_lengths
    bm, bn = block_mask.BLOCK_SIZE
    kinds = np.full((-(-N_q // bm), -(-N_k // bn)), SKIP, dtype=object)
    for num, idx, kind in (
        (block_mask.kv_num_blocks, block_mask.kv_indices, PARTIAL),
        (block_mask.full_kv_num_blocks, block_mask.full_kv_indices, FULL),
    ):
        if num is None:
            continue
        num, idx = num[b, h], idx[b, h]  # (query blocks,), (query blocks, key blocks)
        for i in range(kinds.shape[0]):
            kinds[i, idx[i, : int(num[i])].tolist()] = kind
    return kinds.astype(str)


KIND_CODE = {SKIP: 0, PARTIAL: 1, FULL: 2}
KIND_COLORS = ("white", "#f4a259", "#5b8e7d")  # skipped, partial, full: the colours of chapter 09


def draw_block_map(
    ax, kinds: np.ndarray, N_q: int, N_k: int, block_m: int, block_n: int, title: str = ""
) -> None:
    """Draw a tile map on a matplotlib Axes (white skipped, orange partial, green full)."""
    from matplotlib.colors import ListedColormap

    codes = np.vectorize(KIND_CODE.get)(kinds)
    ax.imshow(
        codes,
        cmap=ListedColormap(KIND_COLORS),
        vmin=0,
        vmax=2,
        extent=(0, N_k, N_q, 0),
        interpolation="nearest",
    )
    ax.set_xticks(range(0, N_k + 1, block_n), minor=True)
    ax.set_yticks(range(0, N_q + 1, block_m), minor=True)
    ax.grid(which="minor", color="grey", lw=0.3)
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")
    computed = int((kinds != SKIP).sum())
    ax.set_title(f"{title}\n{computed} of {kinds.size} tiles computed".strip(), fontsize=9)
