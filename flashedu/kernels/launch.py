"""Launch plumbing for the Triton kernels: validation, autotuning, fixed configs, flags.

Every misuse of `kernels.forward` / `backward` fails here before any launch, with the argument and
the value named (shapes via `flashedu.validation`, then dtype, head dim, device, window, ALiBi
slopes, score mod). `plan` turns one validated call into what the kernels take: sizes, the scale,
the mask bounds, the score mod and the constexpr flags (head dims and their padded tile widths, or
two chunks each for a head dim in SPLIT_HEAD_DIMS, `flashedu.kernels.tiles`). On a GPU each kernel
is wrapped in `triton.autotune` over a short table of (BLOCK_M, BLOCK_N, num_warps, num_stages) per
tile width, kept beside the kernel; under the interpreter (no GPU) a kernel runs with one small
fixed config, since autotuning needs a driver.

Introduced in notebooks/06_triton_forward.ipynb. Limits: the tables were chosen on one H200
(notebooks/results/GPU_NOTES.md) for d = 64 and 128 with Ev = E; every other head dim (1 to 256,
padded to a power of two) and Ev != E runs the first, untuned entry of its width's table. Other
GPUs run the tables too, unmeasured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.testing

from .. import _env
from ..validation import check_causal, check_qkv, check_slopes, check_window, resolve_scale
from . import score_mods
from .tiles import MAX_HEAD_DIM, chunk_dims, pad_dim

INTERPRETER = _env.INTERPRETER
HEAD_DIMS = range(1, MAX_HEAD_DIM + 1)  # any head dim; the tiles are padded to a power of two
# Head dims held in two chunks (`tiles.chunk_dims`: 192 = 128 + 64) instead of one padded tile:
# those where two chunks measured faster than one padded tile on the H200, forward and
# forward + backward, causal and not (notebooks/results/h200_headdims.json, written by
# scripts/hopper/h200_headdims.py: at d = 192, bf16, non-causal, 488 against 407 TFLOP/s forward
# and, with SEPARATE_DKDV_DIMS, 308 against 202 forward + backward). d = 40 (32 + 16) is left
# out: its two-chunk kernels stopped on an illegal memory access there (GPU_NOTES.md, "Head-dim
# runs"); d = 111 (64 + 64) would gain no columns.
SPLIT_HEAD_DIMS: frozenset[int] = frozenset({80, 96, 192})
# Head dims whose dK and dV come from two launches of the dK/dV kernel, dV alone then dK alone, each
# with one float32 accumulator instead of two, so that a program can own 128 keys at widths where
# the fused kernel spills (`bwd.dkdv_parts_table`): one more block matmul per tile pair (S is
# recomputed), better-shaped ones. Measured faster at both widths above 128 that were timed
# (h200_headdims.json: the dK/dV kernel 5.63 against 8.12 ms at d = 192 in two chunks, 6.41
# against 10.59 ms at d = 256, bf16, non-causal).
SEPARATE_DKDV_DIMS: frozenset[int] = frozenset({192, 256})
# the widths the tables are keyed on: pad_dim of every head dim, and the two-chunk sums
TILE_WIDTHS = tuple(
    sorted({pad_dim(d) for d in HEAD_DIMS} | {sum(chunk_dims(d)) for d in HEAD_DIMS})
)
TUNED_DIMS = (64, 128)  # head dims the autotune tables were measured on (with Ev = E)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FIXED = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)  # the interpreter's one config


# On a GPU the autotuner times a short list per tile width (keyed on the N bucket, the head dims
# and the mask flags; dtypes are part of triton's key) and keeps the fastest; the interpreter runs
# one small config.
def _cfg(block_m, block_n, num_warps, num_stages):
    return triton.Config(
        {"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=num_warps, num_stages=num_stages
    )


def tile_width(flags) -> int:
    """The width the tables are keyed on: the wider of the key and value tiles (padded, or the
    sum of the two chunks: 192 for d = 128 + 64)."""
    return max(
        flags["BLOCK_D"] + flags.get("BLOCK_D2", 0), flags["BLOCK_DV"] + flags.get("BLOCK_DV2", 0)
    )


def separate_dkdv(flags) -> bool:
    """Whether the backward computes dV and dK in two launches (SEPARATE_DKDV_DIMS)."""
    return flags["HEAD_DIM"] in SEPARATE_DKDV_DIMS


def head_chunks(d: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_D2) for head dim d: two chunks where d is in SPLIT_HEAD_DIMS, else one
    padded tile and 0."""
    return chunk_dims(d) if d in SPLIT_HEAD_DIMS else (pad_dim(d), 0)


def _tuned(flags, wide) -> bool:
    """Whether this launch is one the tables were measured on (else their first entry runs)."""
    return (
        not wide
        and flags["HEAD_DIM"] in TUNED_DIMS
        and flags["V_DIM"] == flags["HEAD_DIM"]
        and not (flags["HAS_LEFT"] or flags["HAS_MOD"] or flags["VARLEN"])
    )


def _prune(table):
    """early_config_prune for triton.autotune: keep the configs listed for this tile width (and
    dtype width)."""

    def prune(configs, nargs, **kwargs):
        wide = nargs["Q"].element_size() == 4
        listed = table(tile_width(kwargs), wide)
        if not _tuned(kwargs, wide):
            listed = listed[:1]  # tuned where it is benchmarked; elsewhere the first (safe) entry
        keep = [
            c
            for c in configs
            if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in listed
        ]
        return keep or configs[:1]

    return prune


def _all_configs(*tables):
    seen = {
        cfg
        for table in tables
        for d in TILE_WIDTHS
        for wide in (False, True)
        for cfg in table(d, wide)
    }
    return [_cfg(*c) for c in sorted(seen)]


def _autotune_bench(fn, quantiles):
    return triton.testing.do_bench(fn, warmup=10, rep=50, quantiles=quantiles)


def autotuned(kernel, table, key):
    """`kernel` wrapped in triton.autotune over `table` on a GPU; the bare kernel under the
    interpreter."""
    if INTERPRETER:
        return kernel
    return triton.autotune(
        configs=_all_configs(table),
        key=key,
        prune_configs_by={"early_config_prune": _prune(table)},
        do_bench=_autotune_bench,
    )(kernel)


# what the autotuners key on
MASK_KEY = ["N_KEY", "HEAD_DIM", "V_DIM", "HAS_LEFT", "HAS_RIGHT", "HAS_MOD", "VARLEN"]


def n_key(N_q: int, N_k: int) -> int:
    """Autotuning bucket for the sequence lengths: next power of two, clipped to [512, 8192]."""
    return min(max(triton.next_power_of_2(max(N_q, N_k)), 512), 8192)


def launch_config(block_m=None, block_n=None, num_warps=None, num_stages=None) -> dict | None:
    """A fixed launch config from explicit block sizes; None (autotune on a GPU) when no block size
    is given."""
    if block_m is None and block_n is None:
        return dict(_FIXED) if INTERPRETER else None
    block_m = _FIXED["BLOCK_M"] if block_m is None else block_m
    block_n = _FIXED["BLOCK_N"] if block_n is None else block_n
    for arg, val in (("block_m", block_m), ("block_n", block_n)):
        if not isinstance(val, int) or val < 16 or val & (val - 1):
            raise ValueError(f"kernels: {arg} must be a power of two >= 16, got {val!r}")
    warps = num_warps or (8 if block_m * block_n >= 128 * 128 else 4)
    return dict(
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=warps,
        num_stages=num_stages or (1 if INTERPRETER else 2),
    )


def launch(tuned, raw, grid, args, kw, config):
    """Run `raw` with a fixed config, or the autotuned kernel when config is None."""
    if config is None:
        tuned[grid](*args, **kw)
    else:
        raw[grid](*args, **kw, **config)


# --------------------------------------------------------------------------------------------------
# Validation: every misuse fails here, before any launch, with the argument and the value named.
# --------------------------------------------------------------------------------------------------
def check_inputs(q, k, v, causal, softmax_scale, window_size, alibi_slopes, name):
    """Validate and normalise. Returns (dims, scale, (HAS_LEFT, LEFT, HAS_RIGHT, RIGHT), slopes,
    stride_sb), dims = (B, H, H_kv, N_q, N_k, d); v may have its own head dim d_v."""
    dims = check_qkv(q, k, v, name=name, kind="torch", value_dim=True)
    B, H, _, _, _, d = dims
    if q.dtype not in DTYPES:
        raise TypeError(f"{name}: dtype must be float16, bfloat16 or float32, got {q.dtype}")
    for arg, dim in (("d", d), ("d_v", v.shape[-1])):
        if dim > MAX_HEAD_DIM:
            raise ValueError(
                f"{name}: head dimension {arg}={dim} is not supported by the kernels; expected "
                f"1 to {MAX_HEAD_DIM}"
            )
    if not INTERPRETER and q.device.type != "cuda":
        raise ValueError(
            f"{name}: q, k, v must be CUDA tensors on a GPU machine, got device {q.device} "
            "(CPU tensors run only under TRITON_INTERPRET=1)"
        )
    scale = resolve_scale(softmax_scale, d, name=name)
    left, right = check_window(window_size, name=name) or (-1, -1)
    causal = check_causal(causal, name=name)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    bounds = (left >= 0, max(left, 0), right >= 0, max(right, 0))
    slopes, stride_sb = _check_slopes(alibi_slopes, B, H, q.device, name)
    return dims, scale, bounds, slopes, stride_sb


@dataclass(frozen=True)
class Plan:
    """One validated call, as the attention kernels take it."""

    B: int  # batch, or the number of packed sequences
    H: int
    H_kv: int
    N_q: int  # per sequence (packed: the total; the kernels read each sequence's own length)
    N_k: int
    scale: float
    left: int  # keys visible left / right of the diagonal, when HAS_LEFT / HAS_RIGHT
    right: int
    mod: score_mods.ScoreMod | None
    mod_args: torch.Tensor | None  # float32 rows, one per (b, h), or None
    stride_ab: int
    stride_ah: int
    flags: dict  # the kernels' constexprs but the block sizes

    def mod_pointer(self, fallback: torch.Tensor) -> torch.Tensor:
        """The tensor passed as MOD_ARGS: the mod's args, or any float32 tensor when unused."""
        return fallback if self.mod_args is None else self.mod_args


def plan(q, k, v, causal, softmax_scale, window_size, alibi_slopes, score_mod, name, batch=None):
    """Validate q (B, H, N_q, d), k (B, H_kv, N_k, d), v (B, H_kv, N_k, d_v) and the options once;
    `batch` is the number of packed sequences when q, k, v hold them as (1, H, total, d) views."""
    dims, scale, bounds, slopes, _ = check_inputs(
        q, k, v, causal, softmax_scale, window_size, alibi_slopes, name
    )
    B, H, H_kv, N_q, N_k, d = dims
    B = B if batch is None else batch
    mod, args, stride_ab, stride_ah = score_mods.resolve(score_mod, slopes, B, H, q.device, name)
    flags, left, right = kernel_flags(q, scale, bounds, False)
    flags.pop("HAS_ALIBI")
    d_v = v.shape[-1]
    (block_d, block_d2), (block_dv, block_dv2) = head_chunks(d), head_chunks(d_v)
    flags.update(
        V_DIM=d_v,
        BLOCK_D=block_d,
        BLOCK_D2=block_d2,
        BLOCK_DV=block_dv,
        BLOCK_DV2=block_dv2,
        SCORE_MOD=score_mods.identity if mod is None else mod.fn,
        HAS_MOD=mod is not None,
        VARLEN=batch is not None,
    )
    return Plan(B, H, H_kv, N_q, N_k, scale, left, right, mod, args, stride_ab, stride_ah, flags)


def _check_slopes(alibi_slopes, B, H, device, name):
    if alibi_slopes is None:
        return None, 0
    check_slopes(alibi_slopes, H, B=B, name=name)
    slopes = torch.as_tensor(alibi_slopes, dtype=torch.float32)
    if slopes.device != device and slopes.device.type != "cpu":
        raise ValueError(
            f"{name}: alibi_slopes must be on q's device {device}, got {slopes.device}"
        )
    return slopes.to(device).contiguous(), (H if slopes.ndim == 2 else 0)


def strides(x: torch.Tensor, packed: bool = False) -> tuple[int, int, int]:
    """(batch, head, row) strides of a (B, H, N, d) tensor as the kernels take them. Packed
    sequences have no batch stride: the grid's batch axis runs over sequences, which the kernels
    locate through cu_seqlens."""
    return (0 if packed else x.stride(0), x.stride(1), x.stride(2))


def rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """The kernels need unit stride along d; any other strides are passed through."""
    return x if x.stride(-1) == 1 else x.contiguous()


def kernel_flags(q, scale, bounds, has_alibi):
    has_left, left, has_right, right = bounds
    upcast = INTERPRETER and q.dtype == torch.bfloat16  # the interpreter's bf16 tl.dot is wrong
    precision = "ieee" if (q.dtype == torch.float32 or upcast) else "tf32"
    return (
        dict(
            HEAD_DIM=q.shape[-1],
            HAS_LEFT=has_left,
            HAS_RIGHT=has_right,
            HAS_ALIBI=has_alibi,
            UPCAST=upcast,
            PRECISION=precision,
        ),
        left,
        right,
    )


def out_dtype(q, flags):
    """The kernels store q's dtype, except bf16 under the interpreter: its fp32 -> bf16 cast
    truncates, so the kernels store fp32 there and torch rounds to nearest, as the GPU does."""
    return torch.float32 if flags["UPCAST"] else q.dtype
