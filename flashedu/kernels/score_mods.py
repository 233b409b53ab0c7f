"""Score mods for the Triton kernels: FlexAttention's `score_mod` idea in flashedu's own code.

A score mod is a `@triton.jit` function the kernels apply to every tile of scores, after the scale
and before the mask and the softmax (Dong et al. 2024, FlexAttention, arXiv:2412.05496):

    @triton.jit
    def my_mod(score, b, h, q_idx, kv_idx, args):  # -> the new score, same shape
        ...

* `score`: a (rows, cols) fp32 tile of scaled scores, softmax_scale * q . k, in natural units.
* `b`, `h`: the batch (for packed sequences, the sequence) and query head of the tile.
* `q_idx`, `kv_idx`: positions broadcasting against `score`. `q_idx` is the query's position
  aligned with the keys, i + N_k - N_q (flashedu's bottom-right convention: q_idx == kv_idx on the
  diagonal); when N_q == N_k it is FlexAttention's q_idx.
* `args`: a pointer to this (b, h)'s row of the mod's float32 `args` tensor (slopes, a cap, a bias
  table), `tl.load(args + i)` reads entry i.

The kernel passes the mod as a compile-time argument, so each mod compiles into the kernel; no
function is called per score at run time. The backward needs d new_score / d score: `additive=True`
says it is 1 (a bias that does not depend on the score, e.g. ALiBi), otherwise `grad` is a second
`@triton.jit` function of the same arguments returning it (soft-capping's is 1 - tanh^2). A mod
with neither runs forward only; its backward raises NotImplementedError.

Built in: `alibi(slopes)` (Press et al. 2022, the kernels' `alibi_slopes` goes through it) and
`softcap(cap)` (Gemma 2). Limits: no gradient flows into `args`; a mod that sends a score to -inf
masks it, but the kernels still visit its block (block skipping follows `causal` and
`window_size` only).

notebooks/10_in_practice.ipynb teaches score mods with FlexAttention; this is the same idea in the
kernels of notebooks/06_triton_forward.ipynb.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.jit import KernelInterface


@triton.jit
def tanh(x):
    """tanh from exp (the interpreter has no libdevice): 2 sigmoid(2x) - 1."""
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def identity(score, b, h, q_idx, kv_idx, args):
    """No mod: what the kernels are compiled with when no score_mod is given."""
    return score


@triton.jit
def alibi_fn(score, b, h, q_idx, kv_idx, args):
    """ALiBi: score - slope_h * |q_idx - kv_idx|, args = this head's slope."""
    return score - tl.load(args) * tl.abs(q_idx - kv_idx).to(tl.float32)


@triton.jit
def softcap_fn(score, b, h, q_idx, kv_idx, args):
    """Soft-capping: cap * tanh(score / cap), args = the cap."""
    cap = tl.load(args)
    return cap * tanh(score / cap)


@triton.jit
def softcap_grad(score, b, h, q_idx, kv_idx, args):
    """d/d score of cap * tanh(score / cap) = 1 - tanh(score / cap)^2."""
    t = tanh(score / tl.load(args))
    return 1.0 - t * t


@dataclass(frozen=True)
class ScoreMod:
    """A score mod and what the kernels need to run it: see the module docstring.

    fn, grad: `@triton.jit` functions (score, b, h, q_idx, kv_idx, args) -> tile; grad may be None.
    args: float32 tensor of shape (n,) (one row for every (b, h)), (H, n) (a row per head) or
        (B, H, n) (a row per batch element and head); None when the mod reads nothing.
    additive: the mod's derivative with respect to the score is 1 (no `grad` needed).
    """

    fn: object
    grad: object = None
    args: torch.Tensor | None = None
    additive: bool = False
    name: str = "score_mod"

    def __post_init__(self):
        for arg in ("fn", "grad"):
            f = getattr(self, arg)
            if (f is not None or arg == "fn") and not isinstance(f, KernelInterface):
                raise TypeError(
                    f"ScoreMod: {arg} must be a @triton.jit function, got {type(f).__name__}"
                )
        if self.args is not None and not isinstance(self.args, torch.Tensor):
            raise TypeError(
                f"ScoreMod: args must be a torch.Tensor, got {type(self.args).__name__}"
            )


def alibi(slopes) -> ScoreMod:
    """ALiBi as a score mod: slopes of shape (H,) or (B, H)."""
    args = torch.as_tensor(slopes, dtype=torch.float32)
    return ScoreMod(alibi_fn, args=args[..., None], additive=True, name="alibi")


def softcap(cap: float) -> ScoreMod:
    """Soft-capping as a score mod: scores squashed into (-cap, cap) by cap * tanh(score / cap)."""
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < float("inf"):
        raise ValueError(f"softcap: cap must be a positive finite number, got {cap!r}")
    return ScoreMod(
        softcap_fn, grad=softcap_grad, args=torch.tensor([float(cap)]), name=f"softcap({cap})"
    )


def resolve(score_mod, alibi_slopes, B: int, H: int, device, name: str):
    """The kernels' view of `score_mod` / `alibi_slopes`: (ScoreMod or None, args tensor (B, H, n)
    on `device` with unit last stride, stride_ab, stride_ah). ALiBi slopes become `alibi(...)`."""
    if score_mod is not None and alibi_slopes is not None:
        raise ValueError(
            f"{name}: give alibi_slopes or score_mod, not both (ALiBi is the score mod "
            "score_mods.alibi(slopes); write one mod that does both)"
        )
    if alibi_slopes is not None:
        score_mod = alibi(alibi_slopes)
    if score_mod is None:
        return None, None, 0, 0
    if isinstance(score_mod, KernelInterface):
        score_mod = ScoreMod(score_mod, name=getattr(score_mod, "__name__", "score_mod"))
    if not isinstance(score_mod, ScoreMod):
        raise TypeError(
            f"{name}: score_mod must be a @triton.jit function or a score_mods.ScoreMod, "
            f"got {type(score_mod).__name__}"
        )
    args = score_mod.args if score_mod.args is not None else torch.zeros(1)
    shape = tuple(args.shape)
    if args.ndim == 0 or args.ndim > 3 or (args.ndim >= 2 and shape[-2] != H):
        raise ValueError(
            f"{name}: score_mod args must have shape (n,), (H, n) or (B, H, n) with H = {H}, "
            f"got {shape}"
        )
    if args.ndim == 3 and shape[0] not in (1, B):
        raise ValueError(f"{name}: score_mod args must have B = {B} rows, got shape {shape}")
    if args.device != device and args.device.type != "cpu":
        raise ValueError(
            f"{name}: score_mod args must be on q's device {device}, got {args.device}"
        )
    args = args.to(device=device, dtype=torch.float32).contiguous()
    view = args.reshape((1,) * (3 - args.ndim) + shape).expand(B, H, shape[-1])
    return score_mod, args, view.stride(0), view.stride(1)


@triton.jit
def mod_scores(qk, sm_scale, b, h, q_idx, kv_idx, args, SCORE_MOD: tl.constexpr):
    """The mod applied to one tile of raw dots qk, returned in log2 units (the kernels' exp2)."""
    return SCORE_MOD(qk * sm_scale, b, h, q_idx, kv_idx, args) * 1.4426950408889634  # log2(e)
