"""Launch plumbing for the Triton kernels: validation, autotuning, fixed configs, flags.

Every misuse of `triton_attention.forward` / `backward` fails here before any launch, with the
argument and the value named (shapes via `flashedu._validate`, then dtype, head dim, device, window,
ALiBi slopes). On a GPU each kernel is wrapped in `triton.autotune` over a short table of (BLOCK_M,
BLOCK_N, num_warps, num_stages) per head dim, kept beside the kernel; under the interpreter (no GPU)
a kernel runs with one small fixed config, since autotuning needs a driver.

Introduced in notebooks/06_triton_forward.ipynb. Limits: the tables were chosen on one H200
(notebooks/results/GPU_NOTES.md); other GPUs run them too, unmeasured.
"""

from __future__ import annotations

import torch
import triton  # noqa: E402  (after _env, which may set TRITON_INTERPRET)
import triton.testing  # noqa: E402

from . import _env
from ._validate import check_causal, check_qkv, check_slopes, check_window, resolve_scale

INTERPRETER = _env.INTERPRETER
HEAD_DIMS = (16, 32, 64, 128, 256)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FIXED = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)  # the interpreter's one config


# On a GPU the autotuner times a short list per head dim (keyed on the N bucket, d and the mask
# flags; dtypes are part of triton's key) and keeps the fastest; the interpreter runs one small
# config.
def _cfg(block_m, block_n, num_warps, num_stages):
    return triton.Config(
        {"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=num_warps, num_stages=num_stages
    )


def _prune(table):
    """early_config_prune for triton.autotune: keep the configs listed for this head dim (and dtype
    width)."""

    def prune(configs, nargs, **kwargs):
        d, wide = kwargs["HEAD_DIM"], nargs["Q"].element_size() == 4
        listed = table(d, wide)
        if wide or d not in (64, 128) or kwargs["HAS_LEFT"] or kwargs["HAS_ALIBI"]:
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
        for d in HEAD_DIMS
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


MASK_KEY = ["N_KEY", "HEAD_DIM", "HAS_LEFT", "HAS_RIGHT", "HAS_ALIBI"]  # what the autotuners key on


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
            raise ValueError(f"triton_attention: {arg} must be a power of two >= 16, got {val!r}")
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
    stride_sb)."""
    dims = check_qkv(q, k, v, name=name, kind="torch")
    B, H, _, _, _, d = dims
    if q.dtype not in DTYPES:
        raise TypeError(f"{name}: dtype must be float16, bfloat16 or float32, got {q.dtype}")
    if d not in HEAD_DIMS:
        raise ValueError(
            f"{name}: head dimension d={d} is not supported by the kernels; expected one of "
            f"{HEAD_DIMS}"
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
