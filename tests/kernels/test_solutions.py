"""The worked solutions of the kernel exercises (flashedu.kernels.solutions, run through the
launchers of flashedu.kernels.exercises) pass the interpreter cases that triton_attention passes:
ragged lengths, causal with N_q != N_k, rows that see no key, GQA, float16 and float32, forward and
backward against the float64 reference, and agree with the package's own kernels."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashedu import kernels, reference
from flashedu.kernels import exercises as triton_exercises
from flashedu.kernels import solutions as triton_solutions
from flashedu.testing import assert_close, random_qkv

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning"
)

CASES = [  # (B, H, H_kv, N_q, N_k, d), causal
    ((1, 2, 2, 32, 32, 16), False),
    ((1, 2, 2, 37, 45, 32), False),
    ((1, 2, 2, 21, 50, 32), True),  # N_q < N_k, bottom-right
    ((2, 1, 1, 50, 19, 16), True),  # N_q > N_k: rows 0..30 see no key
    ((1, 4, 2, 33, 47, 32), True),  # GQA
    ((1, 4, 1, 1, 1, 16), True),  # one query, one key, MQA
]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("dims,causal", CASES)
def test_solutions_match_the_reference_and_the_package(dims, causal, dtype, rng):
    B, H, H_kv, N_q, N_k, d = dims
    q, k, v = random_qkv(B, H, N_q, N_k, d, dtype, H_kv=H_kv, seed=rng, kind="torch")
    do = torch.from_numpy(rng.standard_normal(q.shape)).to(q.dtype)
    o, lse = triton_solutions.forward(q, k, v, causal=causal)
    o_ref, lse_ref = reference.forward(q, k, v, causal=causal)
    assert_close(o, o_ref, dtype=dtype, name="o")
    assert_close(lse, lse_ref, dtype="float32", name="lse")
    assert not torch.isnan(o).any() and (o[torch.isinf(lse)] == 0).all()
    o_pkg, lse_pkg = kernels.forward(q, k, v, causal=causal)
    assert_close(o, o_pkg.double(), dtype=dtype, name="o against triton_attention")
    grads = triton_solutions.backward(do, q, k, v, o, lse, causal=causal)
    expected = reference.backward(do, q, k, v, causal=causal)
    for name, g, e in zip(("dq", "dk", "dv"), grads, expected):
        assert_close(g, e, dtype=dtype, grad=True, name=name)


def test_launchers_name_the_argument_they_refuse():
    q, k, v = random_qkv(1, 1, 8, 8, 16, "float32", kind="torch")
    with pytest.raises(TypeError, match="kernel must be a @triton.jit function"):
        triton_exercises.launch_forward(lambda *a: None, q, k, v)
    with pytest.raises(TypeError, match="takes 38 parameters; the forward skeleton's signature"):
        triton_exercises.launch_forward(triton_solutions.dkdv_kernel, q, k, v)
    with pytest.raises(ValueError, match="block_m must be a power of two >= 16, got 24"):
        triton_exercises.launch_forward(triton_solutions.flash_forward_kernel, q, k, v, block_m=24)
    with pytest.raises(TypeError, match="bfloat16 runs only on a GPU"):
        triton_exercises.launch_forward(
            triton_solutions.flash_forward_kernel, *(x.bfloat16() for x in (q, k, v))
        )
    lse = torch.zeros(1, 1, 8)
    with pytest.raises(ValueError, match="delta must be a \\(1, 1, 8\\) torch.float32 tensor"):
        triton_exercises.launch_dq(triton_solutions.dq_kernel, q, q, k, v, lse, lse.double())


def test_outputs_can_be_views_with_any_row_strides():
    """The graders hand the launchers strided views (a gap after each head); results agree."""
    q, k, v = random_qkv(1, 2, 20, 20, 16, "float32", kind="torch")
    o_buf, lse_buf = torch.zeros(1, 2, 36, 16), torch.zeros(1, 2, 36)
    o, lse = o_buf[:, :, :20], lse_buf[:, :, :20]
    triton_exercises.launch_forward(triton_solutions.flash_forward_kernel, q, k, v, out=(o, lse))
    o_ref, lse_ref = reference.forward(q, k, v)
    assert_close(o, o_ref, dtype="float32")
    assert_close(lse, lse_ref, dtype="float32")
    assert (o_buf[:, :, 20:] == 0).all() and (lse_buf[:, :, 20:] == 0).all()
    assert np.isfinite(lse.numpy()).all()


@pytest.mark.parametrize("causal", [False, True])
def test_tile_solutions_match_the_reference(causal, rng):
    """The worked kernels of exercises 6.1, 7.1 and 7.2, launched as their graders launch them
    (ragged lengths, BLOCK_M != BLOCK_N), against float64."""
    q, k, _ = random_qkv(1, 1, 37, 45, 32, "float32", seed=rng, kind="torch")
    q, k = q[0, 0], k[0, 0]
    s = triton_exercises.launch_scores(
        triton_solutions.scores_kernel, q, k, causal=causal, block_m=32, block_n=16
    )
    p, lse = reference.probabilities(q[None, None], k[None, None], causal=causal)
    s64 = q.double() @ k.double().T / 32**0.5
    keep = torch.ones(37, 45, dtype=torch.bool).tril(45 - 37) if causal else torch.ones(37, 45)
    assert torch.equal(torch.isinf(s), ~keep.bool())
    assert torch.allclose(s[keep.bool()].double(), s64[keep.bool()], atol=1e-5)
    lse32 = torch.as_tensor(lse[0, 0], dtype=torch.float32)
    got = triton_exercises.launch_probabilities(
        triton_solutions.probabilities_kernel, q, k, lse32, causal=causal, block_m=16, block_n=32
    )
    assert_close(got, torch.as_tensor(p[0, 0]), dtype="float32", name="p")
    o, do, _ = random_qkv(2, 3, 29, 29, 64, "float16", seed=rng, kind="torch")
    delta = triton_exercises.launch_preprocess(triton_solutions.preprocess_kernel, o, do)
    assert torch.allclose(delta.double(), (o.double() * do.double()).sum(-1), atol=1e-4)
