"""impl="auto" zero-pads a head dim that is not a multiple of 8 to a Hopper width (64 or 128) on
an sm_90 GPU (`hopper.dispatch.pad_width`): the rule on CPU with the device faked, and (marked
`gpu`) values and gradients against the float64 reference through the padded path."""

from __future__ import annotations

import pytest
import torch

import flashedu
from flashedu import reference
from flashedu.hopper import dispatch, triton_fwd
from flashedu.testing import assert_close, random_qkv


class _OnGpu(torch.Tensor):
    """A CPU tensor that says it is on a CUDA device: enough for the rule, which reads is_cuda."""

    @property
    def is_cuda(self):
        return True


@pytest.fixture
def sm90(monkeypatch):
    monkeypatch.setattr(triton_fwd, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


def _t(d, dtype=torch.bfloat16, N=8):
    return torch.empty(1, 2, N, d, dtype=dtype).as_subclass(_OnGpu)


@pytest.mark.parametrize("d,width", [(111, 128), (65, 128), (33, 64), (20, 64), (127, 128)])
def test_a_head_dim_off_a_multiple_of_8_is_padded_to_the_next_hopper_width(sm90, d, width):
    assert dispatch.pad_width(_t(d), _t(d), _t(d)) == width


@pytest.mark.parametrize("d", [64, 128, 48, 80, 96, 200, 129, 255])
def test_aligned_head_dims_and_dims_past_128_are_left_alone(sm90, d):
    assert dispatch.pad_width(_t(d), _t(d), _t(d)) is None


def test_no_padding_off_hopper_on_cpu_under_the_interpreter_or_for_fp32_or_ev_not_e(
    sm90, monkeypatch
):
    assert dispatch.pad_width(_t(111), _t(111), _t(96)) is None  # Ev != E
    assert dispatch.pad_width(*(_t(111, torch.float32) for _ in range(3))) is None
    cpu = torch.empty(1, 2, 8, 111)
    assert dispatch.pad_width(cpu, cpu, cpu) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert dispatch.pad_width(_t(111), _t(111), _t(111)) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(triton_fwd, "interpreting", lambda: True)
    assert dispatch.pad_width(_t(111), _t(111), _t(111)) is None


def test_pad_head_dims_adds_aligned_dims(sm90, monkeypatch):
    assert dispatch.PAD_HEAD_DIMS == {40}  # measured faster padded (h200_headdims_runs/run3.json)
    assert dispatch.pad_width(_t(40), _t(40), _t(40)) == 64
    monkeypatch.setattr(dispatch, "PAD_HEAD_DIMS", frozenset({96}))
    assert dispatch.pad_width(_t(96), _t(96), _t(96)) == 128


on_hopper = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="needs an sm_90 GPU (H100/H200)",
)


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [33, 40, 111])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_padded_auto_matches_reference_forward_and_backward(dtype, d, causal):
    q, k, v = random_qkv(1, 4, 700, 1100, d, dtype, H_kv=2, seed=d, kind="torch", device="cuda")
    assert dispatch.pad_width(q, k, v) is not None
    qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o = flashedu.attention(qs, ks, vs, causal=causal)
    assert o.shape == q.shape[:3] + (d,)
    assert_close(o, reference.forward(q, k, v, causal=causal)[0], dtype=dtype)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (qs, ks, vs), do)
    for g, r in zip(grads, reference.backward(do, q, k, v, causal=causal)):
        assert g.shape == r.shape
        assert_close(g, r, dtype=dtype, grad=True)
