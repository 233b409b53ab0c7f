"""Packed sequences in one launch of the Triton kernels (kernels.varlen) against the float64
reference run sequence by sequence: ragged lengths, N_q != N_k per sequence, empty sequences, causal
and not, forward and backward, a score mod; and through flashedu.varlen's impl="triton"."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashedu import reference
from flashedu.kernels import score_mods as triton_mods
from flashedu.kernels import varlen as triton_varlen
from flashedu.testing import assert_close
from flashedu.varlen import attention_varlen

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LENGTHS = [  # (query lengths, key lengths)
    ([1, 17, 64, 3], [1, 17, 64, 3]),
    ([1, 17, 64, 3], [9, 17, 20, 70]),  # N_q != N_k in each sequence: bottom-right causal
    ([5, 0, 12, 1], [5, 3, 0, 2]),  # an empty query sequence, an empty key sequence
]


def _pack(rng, lens_q, lens_k, H=2, H_kv=1, d=24, dtype=torch.float32):
    cu_q, cu_k = (
        torch.tensor(np.cumsum([0, *lens]), dtype=torch.int32, device=DEVICE)
        for lens in (lens_q, lens_k)
    )
    q, k, v = (
        torch.from_numpy(rng.standard_normal(s)).to(DEVICE, dtype)
        for s in ((sum(lens_q), H, d), (sum(lens_k), H_kv, d), (sum(lens_k), H_kv, d))
    )
    return q, k, v, cu_q, cu_k


def _bhnd(x):
    """(len, heads, d) -> (1, heads, len, d)."""
    return x.transpose(0, 1)[None]


def _per_sequence(q, k, v, do, cu_q, cu_k, score_mod_grad=None, **opts):
    """Reference (o, lse, dq, dk, dv) in the packed layouts, one sequence at a time."""
    o, dq, dk, dv = (np.zeros(tuple(x.shape)) for x in (do, q, k, v))
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    bounds = zip(cu_q.tolist(), cu_q[1:].tolist(), cu_k.tolist(), cu_k[1:].tolist())
    for q0, q1, k0, k1 in bounds:
        if q1 == q0 or k1 == k0:
            continue  # no rows, or rows that see nothing (o = 0, lse = -inf, zero gradients)
        args = (_bhnd(q[q0:q1]), _bhnd(k[k0:k1]), _bhnd(v[k0:k1]))
        o_s, lse_s = reference.forward(*args, **opts)
        g = reference.backward(_bhnd(do[q0:q1]), *args, score_mod_grad=score_mod_grad, **opts)
        o[q0:q1], lse[:, q0:q1] = o_s[0].transpose(1, 0, 2), lse_s[0]
        dq[q0:q1] = g[0][0].transpose(1, 0, 2)
        dk[k0:k1], dv[k0:k1] = g[1][0].transpose(1, 0, 2), g[2][0].transpose(1, 0, 2)
    return o, lse, dq, dk, dv


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens_q,lens_k", LENGTHS)
def test_one_launch_matches_reference_sequence_by_sequence(lens_q, lens_k, causal, rng):
    q, k, v, cu_q, cu_k = _pack(rng, lens_q, lens_k)
    args = (q, k, v, cu_q, cu_k, max(lens_q), max(lens_k))
    o, lse = triton_varlen.forward(*args, causal=causal)
    assert o.shape == q.shape and lse.shape == (2, sum(lens_q)) and lse.dtype == torch.float32
    do = torch.from_numpy(rng.standard_normal(tuple(o.shape))).to(o)
    ref = _per_sequence(q, k, v, do, cu_q, cu_k, causal=causal)
    assert_close(o, ref[0], "float32", name="o")
    assert_close(lse, ref[1], "float32", name="lse")
    grads = triton_varlen.backward(do, q, k, v, o, lse, *args[3:], causal=causal)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref[2:]):
        assert g.shape == r.shape, name
        assert_close(g, r, "float32", grad=True, name=name)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_impl_triton_is_differentiable_and_matches_the_loop(causal, rng):
    lens = [1, 17, 64, 3]
    q, k, v, cu_q, cu_k = _pack(rng, lens, lens, H=2, H_kv=2, d=16)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = attention_varlen(*leaves, cu_q, cu_k, 64, 64, causal=causal, impl="triton")
    do = torch.from_numpy(rng.standard_normal(tuple(o.shape))).to(o)
    o.backward(do)
    ref = _per_sequence(q, k, v, do, cu_q, cu_k, causal=causal)
    assert_close(o, ref[0], "float32", name="o")
    for name, x, r in zip(("dq", "dk", "dv"), leaves, ref[2:]):
        assert_close(x.grad, r, "float32", grad=True, name=name)


def test_a_score_mod_sees_each_sequence_from_its_own_start(rng):
    """Soft-capping plus a per-sequence window: positions restart in every sequence."""
    lens_q, lens_k = [1, 17, 64, 3], [9, 17, 20, 70]
    q, k, v, cu_q, cu_k = _pack(rng, lens_q, lens_k)
    q = q * 3  # scores of a few units, bent by the cap
    opts = dict(causal=True, window_size=(6, -1))
    mod = triton_mods.softcap(2.0)
    o, lse = triton_varlen.forward(q, k, v, cu_q, cu_k, 64, 70, score_mod=mod, **opts)
    do = torch.from_numpy(rng.standard_normal(tuple(o.shape))).to(o)
    grads = triton_varlen.backward(do, q, k, v, o, lse, cu_q, cu_k, 64, 70, score_mod=mod, **opts)
    ref = _per_sequence(
        q, k, v, do, cu_q, cu_k, **opts,
        score_mod=lambda s, *_: 2.0 * np.tanh(s / 2.0),
        score_mod_grad=lambda s, *_: 1.0 - np.tanh(s / 2.0) ** 2,
    )  # fmt: skip
    assert_close(o, ref[0], "float32", name="o")
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref[2:]):
        assert_close(g, r, "float32", grad=True, name=name)


def test_strided_packed_inputs_and_misuse(rng):
    """q, k, v as slices of wider packed buffers work without copies; bad boundaries are named."""
    q, k, v, cu_q, cu_k = _pack(rng, [5, 7], [6, 2], H=2, H_kv=2, d=16)
    wide = torch.cat([q, q], dim=1)[:, :2]  # (12, 2, 16) with a head stride of 16, a row stride 64
    o, _ = triton_varlen.forward(wide, k, v, cu_q, cu_k, 7, 6)
    assert_close(o, triton_varlen.forward(q, k, v, cu_q, cu_k, 7, 6)[0], "float32")
    with pytest.raises(ValueError, match="cu_seqlens_q ends at 12, but the packed tensor holds 11"):
        triton_varlen.forward(q[:11], k, v, cu_q, cu_k, 7, 6)
    with pytest.raises(ValueError, match="max_seqlen_q=6 is shorter than the longest sequence"):
        triton_varlen.forward(q, k, v, cu_q, cu_k, 6, 6)
    with pytest.raises(TypeError, match="dtype must be float16, bfloat16 or float32"):
        triton_varlen.forward(q.double(), k.double(), v.double(), cu_q, cu_k, 7, 6)
