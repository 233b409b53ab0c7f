"""kernel_bytes: the sentences and bars that put a kernel's measured bytes beside the closed form,
held to the package's kernels (which move exactly the closed forms' bytes)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest
import torch

from flashedu import kernels, traffic
from flashedu.kernels import bwd as triton_backward
from flashedu.testing import random_qkv
from flashedu.traffic import kernel_bytes

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning"
)


def test_describe_counts_each_tensor_and_names_the_loop():
    B, H, N, d = 1, 2, 64, 32
    q, k, v = random_qkv(B, H, N, N, d, "float32", kind="torch")
    with traffic.measure() as m:
        kernels.forward(q, k, v, block_m=16, block_n=16)
    model = traffic.flash_forward(B, H, N, N, d, block_m=16, block_n=16, itemsize=4)
    sizes = {name: t.nbytes for name, t in m.tensors.items()}
    lines = kernel_bytes.describe(m.traffic(), model, sizes, per={4: "query block"})
    assert lines[1] == (
        "K: read 4 times (65,536 B of a 16,384 B tensor); the closed form also 4 times: "
        "once per query block"
    )
    assert lines[0].startswith("Q: read once (16,384 B") and lines[-1].startswith("lse: written")
    ax = kernel_bytes.plot(m.traffic(), model, "forward")
    assert [t.get_text() for t in ax.get_xticklabels()][:2] == ["Q\nread", "K\nread"]


@pytest.mark.parametrize("causal", [False, True])
def test_backward_passes_are_the_two_pass_closed_form_without_the_preprocess(causal):
    B, H, N_q, N_k, d = 1, 2, 37, 50, 16
    q, k, v = random_qkv(B, H, N_q, N_k, d, "float32", kind="torch")
    do = torch.randn_like(q)
    o, lse = kernels.forward(q, k, v, causal=causal)
    with traffic.measure() as m:
        triton_backward.backward(do, q, k, v, o, lse, causal=causal, block_m=16, block_n=16)
    passes = kernel_bytes.measured(m, skip=("attn_bwd_preprocess",))
    model = kernel_bytes.backward_passes(
        B, H, N_q, N_k, d, block_m=16, block_n=16, causal=causal, itemsize=4
    )
    assert passes == model
    assert "O" not in passes.reads and "D" not in passes.writes


@pytest.mark.parametrize("causal", [False, True])
def test_each_dq_strategy_moves_its_closed_form(causal):
    """The FA2 kernels (separate dQ pass) and the one-pass Triton backward (float32 atomics, the
    only way under the interpreter) move exactly `dq_strategies`' bytes of Q, dO, K, V and dQ."""
    from flashedu.hopper import triton_bwd

    B, H, N_q, N_k, d, bm, bn = 1, 2, 80, 112, 64, 16, 32
    q, k, v = random_qkv(B, H, N_q, N_k, d, "float16", kind="torch")
    do = torch.randn_like(q)
    o, lse = kernels.forward(q, k, v, causal=causal)
    skip = ("attn_bwd_preprocess",)
    with traffic.measure() as separate:
        triton_backward.backward(do, q, k, v, o, lse, causal=causal, block_m=bm, block_n=bn)
    with traffic.measure() as atomic:
        triton_bwd.backward(do, q, k, v, o, lse, causal=causal, config=(bm, bn, 4, 1))
    model = kernel_bytes.dq_strategies(B, H, N_q, N_k, d, block_m=bm, block_n=bn, causal=causal)
    for name, m in (("separate", separate), ("atomic", atomic)):
        mine = kernel_bytes.families(kernel_bytes.measured(m, skip=skip))
        assert mine == kernel_bytes.families(model[name]), name
    both = {name: kernel_bytes.families(t) for name, t in model.items()}
    assert both["atomic"]["Q, dO read"] == both["separate"]["Q, dO read"] - 2 * B * H * N_q * d * 2
    assert both["atomic"]["K, V read"] < both["separate"]["K, V read"]
    assert both["atomic"]["dQ read + written"] > both["separate"]["dQ read + written"]


def test_families_sum_the_three_sides():
    t = traffic.Traffic({"Q": 1, "dO": 2, "K": 4, "V": 8, "dQ": 16, "lse": 99}, {"dQ": 32, "dK": 7})
    assert kernel_bytes.families(t) == {
        "Q, dO read": 3,
        "K, V read": 12,
        "dQ read + written": 48,
    }


def test_the_workspace_strategy_streams_what_the_atomics_add():
    B, H, N, d, bm, bn = 2, 3, 96, 32, 16, 32
    kw = dict(block_m=bm, block_n=bn)
    ways = kernel_bytes.dq_strategies(B, H, N, N, d, **kw)
    slots = kernel_bytes.dq_workspace_bytes(B, H, N, N, d, **kw)
    assert slots == (N // bm) * (N // bn) * B * H * bm * d * 4  # a float32 tile per tile pair
    assert ways["workspace"].reads == ways["atomic"].reads
    assert ways["workspace"].reads["dQ"] == slots
    assert ways["workspace"].writes["dQ"] == slots + B * H * N * d * 2
    causal = kernel_bytes.dq_workspace_bytes(B, H, N, N, d, causal=True, **kw)
    assert 0 < causal < slots
