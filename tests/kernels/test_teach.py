"""The teaching kernel (flashedu.kernels.teach) against the float64 reference and against the
general kernel (flashedu.kernels.forward) on every case both support: ragged lengths, N_q != N_k
with causal (fully masked rows), fp32, fp16 and bf16; its size limit; and its misuse errors."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from flashedu import kernels, reference
from flashedu.kernels import teach
from flashedu.testing import assert_close, random_qkv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [  # (B, H, N_q, N_k, d)
    (1, 1, 1, 1, 16),
    (2, 3, 17, 33, 16),
    (1, 2, 65, 33, 32),  # N_q > N_k: causal leaves rows with no key
    (1, 1, 40, 97, 64),
]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,H,N_q,N_k,d", CASES)
def test_teaching_kernel_equals_the_general_kernel_and_the_reference(
    B, H, N_q, N_k, d, causal, dtype, rng
):
    q, k, v = random_qkv(B, H, N_q, N_k, d, dtype, seed=rng, kind="torch", device=DEVICE)
    o, lse = teach.forward(q, k, v, causal=causal)
    o_gen, lse_gen = kernels.forward(q, k, v, causal=causal, block_m=16, block_n=16)
    o_ref, lse_ref = reference.forward(q, k, v, causal=causal)
    assert o.dtype == q.dtype and o.shape == q.shape and lse.shape == (B, H, N_q)
    assert_close(o, o_ref, dtype=dtype, name="o vs reference")
    assert_close(lse, lse_ref, dtype="float32", name="lse vs reference")
    assert_close(o, o_gen, dtype=dtype, name="o vs kernels.forward")
    assert_close(lse, lse_gen, dtype="float32", name="lse vs kernels.forward")
    empty = np.isneginf(lse_ref)
    assert np.array_equal(np.isneginf(lse.numpy()), empty) and not torch.isnan(o).any()
    assert (o.float().numpy()[empty] == 0).all()


def test_scale_and_block_sizes_are_honoured(rng):
    q, k, v = random_qkv(1, 2, 50, 70, 32, "float32", seed=rng, kind="torch", device=DEVICE)
    o, lse = teach.forward(q, k, v, causal=True, softmax_scale=-0.3, block_m=32, block_n=16)
    o_ref, lse_ref = reference.forward(q, k, v, causal=True, softmax_scale=-0.3)
    assert_close(o, o_ref, dtype="float32")
    assert_close(lse, lse_ref, dtype="float32")


def test_the_teaching_kernel_is_no_larger_than_the_triton_tutorial_kernel():
    """Triton's tutorial 06 forward kernel has 29 parameters."""
    params = inspect.signature(teach.attn_fwd.fn).parameters
    assert len(params) <= 29, len(params)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda q: (q, q[:, :1], q[:, :1]), ValueError, "GQA is in kernels.forward"),
        (lambda q: (q[..., :24], q[..., :24], q[..., :24]), ValueError, "must be one of"),
        (lambda q: (q.double(),) * 3, TypeError, "dtype must be"),
        (lambda q: (q, q, q[..., :16]), ValueError, "kernels.teach.forward"),
    ],
)
def test_misuse_is_named(make, error, match, rng):
    q = random_qkv(1, 2, 8, 8, 32, "float32", seed=rng, kind="torch", device=DEVICE)[0]
    with pytest.raises(error, match=match):
        teach.forward(*make(q))


def test_block_sizes_must_be_powers_of_two(rng):
    q, k, v = random_qkv(1, 1, 8, 8, 16, "float32", seed=rng, kind="torch", device=DEVICE)
    with pytest.raises(ValueError, match="block_m must be a power of two >= 16, got 24"):
        teach.forward(q, k, v, block_m=24)
