"""Score mods in the Triton kernels (kernels.score_mods) against the float64 reference with the
same mod written in NumPy: ALiBi and soft-capping built in, a learner's own mods, forward and
backward, and every misuse named."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from flashedu import autograd, kernels, masks, reference
from flashedu.kernels import score_mods as triton_mods
from flashedu.testing import assert_close, random_qkv

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def shifted_bias(score, b, h, q_idx, kv_idx, args):
    """A learner's relative bias: + args[0] per key of distance, up to 4 keys back, 0 elsewhere."""
    dist = tl.minimum(tl.abs(q_idx - kv_idx), 4).to(tl.float32)
    return score + tl.load(args) * dist + 0.5 * h


@triton.jit
def halve(score, b, h, q_idx, kv_idx, args):
    """Temperature 2, written as a mod with no gradient given."""
    return score * 0.5


def _np_shifted_bias(weight):
    return lambda s, b, h, i, j: s + weight * np.minimum(np.abs(i - j), 4) + 0.5 * h


def _np_softcap(cap):
    return lambda s, b, h, i, j: cap * np.tanh(s / cap)


def _np_softcap_grad(cap):
    return lambda s, b, h, i, j: 1.0 - np.tanh(s / cap) ** 2


def _check(rng, q, k, v, mod, ref_mod, ref_grad=None, **opts):
    """Kernels with `mod` against reference with `ref_mod` (and its derivative), o, lse, grads."""
    o, lse = kernels.forward(q, k, v, score_mod=mod, **opts)
    o_ref, lse_ref = reference.forward(q, k, v, score_mod=ref_mod, **opts)
    assert_close(o, o_ref, dtype=str(q.dtype).split(".")[-1], name="o")
    assert_close(lse, lse_ref, dtype="float32", name="lse")
    do = torch.from_numpy(rng.standard_normal(tuple(o.shape))).to(o.device, o.dtype)
    grads = kernels.backward(do, q, k, v, o, lse, score_mod=mod, **opts)
    refs = reference.backward(do, q, k, v, score_mod=ref_mod, score_mod_grad=ref_grad, **opts)
    for name, g, r in zip(("dq", "dk", "dv"), grads, refs):
        assert_close(g, r, dtype=str(q.dtype).split(".")[-1], grad=True, name=name)


def _qkv(rng, N_q=21, N_k=30, H=4, H_kv=2, d=16, dtype="float32", scale=1.0):
    return random_qkv(
        1, H, N_q, N_k, d, dtype, H_kv=H_kv, seed=rng, kind="torch", device=DEVICE, scale=scale
    )


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, (7, -1))])
def test_alibi_through_the_hook_matches_reference_and_alibi_slopes(causal, window, rng):
    q, k, v = _qkv(rng, N_q=25, N_k=19)
    slopes = masks.alibi_slopes(4)
    mod = triton_mods.alibi(slopes)
    opts = dict(causal=causal, window_size=window)
    o, lse = kernels.forward(q, k, v, score_mod=mod, **opts)
    o2, lse2 = kernels.forward(q, k, v, alibi_slopes=slopes, **opts)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)  # alibi_slopes is this mod
    o_ref, lse_ref = reference.forward(q, k, v, alibi_slopes=slopes, **opts)
    assert_close(o, o_ref, "float32", name="o")
    do = torch.from_numpy(rng.standard_normal(tuple(o.shape))).to(o.device, o.dtype)
    grads = kernels.backward(do, q, k, v, o, lse, score_mod=mod, **opts)
    for name, g, r in zip(("dq", "dk", "dv"), grads, reference.backward(do, q, k, v,
                          alibi_slopes=slopes, **opts)):  # fmt: skip
        assert_close(g, r, "float32", grad=True, name=name)


@pytest.mark.parametrize("causal,dtype", [(False, "float32"), (True, "float32"), (True, "float16")])
def test_softcap_matches_reference(causal, dtype, rng):
    q, k, v = _qkv(rng, dtype=dtype, scale=3.0)  # scores of a few units: the cap bends them
    cap = 2.0
    _check(rng, q, k, v, triton_mods.softcap(cap), _np_softcap(cap), _np_softcap_grad(cap),
           causal=causal)  # fmt: skip


def test_a_learners_own_additive_mod_runs_forward_and_backward(rng):
    q, k, v = _qkv(rng, N_q=30, N_k=30)
    weight = 0.3
    mod = triton_mods.ScoreMod(
        shifted_bias, args=torch.tensor([weight]), additive=True, name="shifted_bias"
    )
    _check(rng, q, k, v, mod, _np_shifted_bias(weight), causal=True)


def test_per_head_args_reach_their_head(rng):
    """args of shape (H, n): head h reads row h (here: a soft cap per head)."""
    q, k, v = _qkv(rng, H=2, H_kv=2, scale=3.0)
    caps = torch.tensor([[1.5], [4.0]])
    mod = triton_mods.ScoreMod(
        triton_mods.softcap_fn, grad=triton_mods.softcap_grad, args=caps, name="caps"
    )

    def ref_mod(s, b, h, i, j):
        c = np.asarray([1.5, 4.0])[h]
        return c * np.tanh(s / c)

    def ref_grad(s, b, h, i, j):
        c = np.asarray([1.5, 4.0])[h]
        return 1.0 - np.tanh(s / c) ** 2

    _check(rng, q, k, v, mod, ref_mod, ref_grad)


def test_a_mod_without_gradient_runs_forward_only(rng):
    q, k, v = _qkv(rng)
    o, lse = kernels.forward(q, k, v, score_mod=halve, causal=True)  # a bare @triton.jit function
    o_ref, lse_ref = reference.forward(q, k, v, causal=True, score_mod=lambda s, *_: s * 0.5)
    assert_close(o, o_ref, "float32", name="o")
    assert_close(lse, lse_ref, "float32", name="lse")
    with pytest.raises(NotImplementedError, match="score_mod 'halve' has no gradient"):
        kernels.backward(torch.ones_like(o), q, k, v, o, lse, score_mod=halve, causal=True)


def test_attention_autograd_carries_the_score_mod(rng):
    q, k, v = (x.requires_grad_() for x in _qkv(rng, scale=3.0))
    o = autograd.flash_attention(
        q, k, v, causal=True, score_mod=triton_mods.softcap(2.0), impl="triton"
    )
    do = torch.from_numpy(rng.standard_normal(tuple(o.shape))).to(o.dtype)
    o.backward(do)
    refs = reference.backward(
        do, q, k, v, causal=True, score_mod=_np_softcap(2.0), score_mod_grad=_np_softcap_grad(2.0)
    )
    for name, x, r in zip("qkv", (q, k, v), refs):
        assert_close(x.grad, r, "float32", grad=True, name="d" + name)


def test_score_mod_misuse_is_named(rng):
    q, k, v = _qkv(rng)
    with pytest.raises(TypeError, match="score_mod must be a @triton.jit function or a"):
        kernels.forward(q, k, v, score_mod=lambda s, *_: s)
    with pytest.raises(ValueError, match="give alibi_slopes or score_mod, not both"):
        kernels.forward(q, k, v, score_mod=halve, alibi_slopes=masks.alibi_slopes(4))
    bad = triton_mods.ScoreMod(halve, args=torch.zeros(3, 1))
    with pytest.raises(ValueError, match=r"args must have shape \(n,\), \(H, n\) or \(B, H, n\)"):
        kernels.forward(q, k, v, score_mod=bad)
    with pytest.raises(TypeError, match="ScoreMod: grad must be a @triton.jit function"):
        triton_mods.ScoreMod(halve, grad=np.tanh)
    with pytest.raises(ValueError, match="cap must be a positive finite number, got 0"):
        triton_mods.softcap(0)
