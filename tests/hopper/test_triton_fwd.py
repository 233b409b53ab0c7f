"""The Hopper attention module: host logic on CPU, the kernel under the interpreter and on a GPU.

On a machine without CUDA the kernel runs under TRITON_INTERPRET=1 (set by flashedu._env) with 16x16
tiles and tensor descriptors over CPU tensors, so every shape below crosses several tiles and ends
on a ragged one. Tests marked `gpu` need an sm_90 GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from flashedu import reference
from flashedu.hopper import triton_fwd as th
from flashedu.testing import assert_close, random_qkv

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning"
)
gpu = pytest.mark.gpu
on_hopper = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="needs an sm_90 GPU (H100/H200)",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _qkv(B=1, H=2, N_q=40, N_k=40, d=64, dtype="bfloat16", H_kv=None, seed=0, device=DEVICE):
    return random_qkv(B, H, N_q, N_k, d, dtype, H_kv=H_kv, seed=seed, kind="torch", device=device)


# ---- which kernel -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "capability, dtype, d, expected",
    [
        ((9, 0), torch.bfloat16, 128, True),
        ((9, 0), torch.float16, 64, True),
        ((8, 0), torch.bfloat16, 128, False),
        ((10, 0), torch.bfloat16, 128, False),
        ((9, 0), torch.float32, 128, False),
        ((9, 0), torch.bfloat16, 96, False),
    ],
)
def test_supports_only_sm90_half_precision_and_measured_head_dims(capability, dtype, d, expected):
    assert th.supports(capability, dtype, d) is expected


@pytest.mark.parametrize(
    "capability, dtype, d, expected",
    [
        ((9, 0), torch.bfloat16, 64, True),
        ((9, 0), torch.float16, 64, True),
        ((9, 0), torch.bfloat16, 128, False),  # supported, but FA2 was as fast or faster
        ((8, 9), torch.float16, 64, False),
    ],
)
def test_prefer_hopper_only_where_it_was_measured_faster(capability, dtype, d, expected):
    assert th.prefer_hopper(capability, dtype, d) is expected


def test_use_hopper_is_false_for_cpu_tensors_and_non_tensors():
    q, k, v = _qkv(device="cpu")
    assert th.use_hopper(q, k, v) is False
    assert th.use_hopper("q", k, v) is False


def test_config_tables_cover_every_head_dim_and_mask():
    for table in (th.CONFIGS, th.FP8_CONFIGS):
        assert set(table) == {(d, c) for d in th.HEAD_DIMS for c in (False, True)}
        for block_m, block_n, warps, stages in table.values():
            assert block_m in (64, 128) and block_n in (64, 128) and warps in (4, 8)
            assert stages >= 1
    for d in th.HEAD_DIMS:  # one set of FP8 block scales serves both masks
        assert th.FP8_CONFIGS[(d, False)][:2] == th.FP8_CONFIGS[(d, True)][:2]


# ---- validation: named errors before any launch -------------------------------------------------
@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda q, k, v: (q[0], k, v), ValueError, r"q must have shape \(B, H, N, d\)"),
        (lambda q, k, v: (q, k, v[:, :, :3]), ValueError, "v must have k's shape"),
        (lambda q, k, v: (q, k[:, :1].expand(1, 3, -1, -1)[:, :3], v[:, :1].expand(1, 3, -1, -1)),
         ValueError, "must divide q's heads 2"),
        (lambda q, k, v: (q.float(), k.float(), v.float()), th.HopperUnsupported, "float16 or bf"),
        (lambda q, k, v: (q, k.half(), v), TypeError, "share a dtype"),
        (lambda q, k, v: (q[..., :32], k[..., :32], v[..., :32]), th.HopperUnsupported, "d=32"),
        (lambda q, k, v: ("q", k, v), TypeError, "q must be a torch.Tensor, got str"),
        (lambda q, k, v: (q[:, :, :0], k, v), ValueError, "N_q=0"),
    ],
)  # fmt: skip
def test_bad_inputs_are_named(change, error, match):
    q, k, v = change(*_qkv(device="cpu"))
    with pytest.raises(error, match=match):
        th.check_inputs(q, k, v, False, None)


def test_bad_scale_and_causal_are_named():
    q, k, v = _qkv(device="cpu")
    with pytest.raises(ValueError, match="softmax_scale must be finite, got nan"):
        th.check_inputs(q, k, v, False, float("nan"))
    with pytest.raises(TypeError, match="causal must be a bool, got 1"):
        th.check_inputs(q, k, v, 1, None)
    assert th.check_inputs(q, k, v, True, None)[1] == pytest.approx(1 / 8)


def test_hopper_unsupported_is_a_value_error_for_callers_that_hand_over():
    assert issubclass(th.HopperUnsupported, ValueError)


# ---- descriptors --------------------------------------------------------------------------------
def test_tma_ready_keeps_aligned_views_and_copies_the_rest():
    x = torch.randn(2, 64, 4, 64, dtype=torch.bfloat16).transpose(
        1, 2
    )  # (B, N, H, d) -> (B, H, N, d)
    assert th.tma_ready(x) is x  # strides 256 * 2, 64 * 2 bytes: a descriptor can address it
    odd = torch.randn(2, 4, 64, 65, dtype=torch.bfloat16)[
        ..., 1:
    ]  # base 2 bytes off, row 130 bytes
    fixed = th.tma_ready(odd)
    assert fixed is not odd and fixed.is_contiguous() and torch.equal(fixed, odd)
    strided = torch.randn(2, 4, 64, 64, dtype=torch.bfloat16).transpose(2, 3)
    assert th.tma_ready(strided).stride(-1) == 1


def test_descriptor_tiles_one_block_of_one_head():
    x = torch.zeros(2, 4, 100, 64, dtype=torch.float16)
    desc = th.descriptor(x, 128, 64)
    assert list(desc.shape) == [2, 4, 100, 64] and desc.block_shape == [1, 1, 128, 64]
    assert list(desc.strides) == list(x.stride())
    padded = torch.zeros(2, 4, 64, 112, dtype=torch.float16)
    assert list(th.descriptor(padded, 64, 128, shape=(2, 4, 64, 100)).shape) == [2, 4, 64, 100]


# ---- FP8: rotation and block scales -------------------------------------------------------------
def test_hadamard_is_orthogonal_seeded_and_keeps_scores():
    r = th.hadamard(64, generator=torch.Generator().manual_seed(3))
    assert torch.allclose(r @ r.T, torch.eye(64), atol=1e-6)
    assert torch.equal(r, th.hadamard(64, generator=torch.Generator().manual_seed(3)))
    q, k = torch.randn(10, 64), torch.randn(12, 64)
    assert torch.allclose((q @ r) @ (k @ r).T, q @ k.T, atol=1e-4)
    with pytest.raises(ValueError, match="power of two >= 1, got 96"):
        th.hadamard(96)


def test_rotation_spreads_an_outlier_channel():
    x = torch.randn(256, 64)
    x[:, 5] *= 50  # one outlier channel
    r = th.hadamard(64, generator=torch.Generator().manual_seed(0))
    peak = lambda t: (t.abs().max() / t.pow(2).mean().sqrt()).item()
    assert peak(x @ r) < peak(x) / 3


def test_block_scales_are_block_amax_over_448_and_dequantise_closely():
    x = torch.randn(1, 2, 70, 64)
    x[0, 1, 40:] = 0.0  # an all-zero block keeps scale 1
    x8, scale = th.quantize_blocks(x, 32)
    assert x8.dtype == th.FP8 and x8.shape == x.shape and scale.shape == (1, 2, 3)
    blocks = torch.nn.functional.pad(x, (0, 0, 0, 26)).view(1, 2, 3, 32 * 64).abs().amax(-1)
    assert torch.allclose(scale[blocks > 0], blocks[blocks > 0] / 448)
    assert scale[0, 1, 2] == 1.0
    back = x8.float() * scale.repeat_interleave(32, -1)[..., :70, None]
    assert ((back - x).abs() <= 2**-3 * blocks.repeat_interleave(32, -1)[..., :70, None]).all()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_channel_scales_transpose_and_pad_v(seed):
    v = torch.randn(1, 2, 50, 64, generator=torch.Generator().manual_seed(seed))
    v[0, 0, 7, 3] = 1e-7  # a value far below its channel's scale: e4m3 rounds it to 0
    v_t, scale = th.quantize_channels_t(v)
    assert v_t.shape == (1, 2, 64, 64) and scale.shape == (1, 2, 64)
    assert (v_t[..., 50:].float() == 0).all()
    back = v_t[..., :50].float().transpose(2, 3) * scale[:, :, None, :]
    # e4m3 keeps 3 mantissa bits: half a step is 2^-4 of a normal value; below 2^-6 (subnormal)
    # the step is 2^-9 of the scale, so half a step there is 2^-10 of it
    bound = v.abs() * 2**-4 + scale[:, :, None, :] * 2**-10
    assert ((back - v).abs() <= bound).all()


def test_quantize_fp8_shapes_and_forward_fp8_errors():
    q, k, v = _qkv(N_q=40, N_k=50, device="cpu", H_kv=1)
    x = th.quantize_fp8(q, k, v, rotate=True, generator=torch.Generator().manual_seed(0))
    bm, bn = x.block_m, x.block_n
    assert x.q.shape == q.shape and x.q_scale.shape == (1, 2, math.ceil(40 / bm))
    assert x.k_scale.shape == (1, 1, math.ceil(50 / bn)) and x.v_scale.shape == (1, 1, 64)
    with pytest.raises(TypeError, match="must be the Fp8Inputs of quantize_fp8"):
        th.forward_fp8((q, k, v))
    with pytest.raises(ValueError, match="differ from the scales' blocks"):
        th.forward_fp8(x, config=(2 * bm, bn, 4, 1))


# ---- the kernel: under the interpreter on CPU, compiled on a GPU --------------------------------
# (B, H, H_kv, N_q, N_k, causal): ragged, GQA, N_q != N_k, fully masked rows (N_q > N_k)
CASES = [
    (1, 2, 2, 37, 37, False),
    (1, 2, 1, 37, 50, True),
    (2, 2, 1, 50, 23, True),
    (1, 1, 1, 1, 33, True),
    (1, 2, 2, 48, 64, False),
]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", CASES)
def test_forward_matches_reference(dtype, case):
    B, H, H_kv, N_q, N_k, causal = case
    q, k, v = _qkv(B, H, N_q, N_k, 64, dtype, H_kv=H_kv, seed=N_q + N_k)
    o, lse = th.forward(q, k, v, causal=causal)
    o_ref, lse_ref = reference.forward(q, k, v, causal=causal)
    assert o.dtype == q.dtype and lse.dtype == torch.float32
    assert_close(o, o_ref, dtype=dtype)
    assert_close(lse, lse_ref, dtype="float32")
    empty = torch.isinf(torch.as_tensor(lse_ref)).to(lse.device)
    assert (o[empty] == 0).all() and (lse[empty] == -math.inf).all()


@pytest.mark.parametrize("causal", [False, True])
def test_fa2_backward_takes_this_forwards_o_and_lse(causal):
    """`flashedu.attention(impl="auto")` pairs this forward with the FA2 backward kernels."""
    from flashedu.kernels import bwd as triton_backward

    q, k, v = _qkv(1, 2, 40, 56, 64, "float16", H_kv=1, seed=3)
    o, lse = th.forward(q, k, v, causal=causal)
    do = torch.randn_like(o)
    grads = triton_backward.backward(do, q, k, v, o, lse, causal=causal)
    for g, g_ref in zip(grads, reference.backward(do, q, k, v, causal=causal)):
        assert_close(g, g_ref, dtype="float16", grad=True)


@pytest.mark.parametrize("rotate", [False, True])
def test_fp8_forward_is_within_fp8_accuracy(rotate):
    q, k, v = _qkv(1, 2, 45, 60, 64, "bfloat16", H_kv=1, seed=7)
    x = th.quantize_fp8(q, k, v, rotate=rotate, generator=torch.Generator().manual_seed(1))
    o, lse = th.forward_fp8(x, causal=True)
    o_ref, lse_ref = reference.forward(q, k, v, causal=True)
    rmse = (o.double().cpu() - torch.as_tensor(o_ref).cpu()).pow(2).mean().sqrt().item()
    assert o.dtype == torch.bfloat16 and rmse < 0.05
    assert (lse.double().cpu() - torch.as_tensor(lse_ref).cpu()).abs().max() < 0.2


@gpu
@on_hopper
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_forward_matches_reference_at_1k(dtype, d, causal):
    q, k, v = _qkv(1, 4, 1000, 1300, d, dtype, H_kv=2, seed=d)
    assert th.use_hopper(q, k, v) is (d == 64)
    o, lse = th.forward(q, k, v, causal=causal)
    o_ref, lse_ref = reference.forward(q, k, v, causal=causal)
    assert_close(o, o_ref, dtype=dtype)
    assert_close(lse, lse_ref, dtype="float32")


@gpu
@on_hopper
def test_gpu_refuses_cpu_tensors_by_name():
    with pytest.raises(th.HopperUnsupported, match="got device cpu"):
        th.forward(*_qkv(device="cpu"))
