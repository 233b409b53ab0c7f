"""traffic.measure: the bytes a Triton kernel moves under the interpreter, by tensor and direction,
held equal to the closed forms of flashedu.traffic for the package's kernels."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from flashedu import traffic, triton_attention  # noqa: F401  (sets TRITON_INTERPRET first)
from flashedu.kernel_traffic import model_name

import triton  # noqa: E402  isort: skip
import triton.language as tl  # noqa: E402  isort: skip


def _qkv(B, H, N_q, N_k, d, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N_q, d, generator=g).to(dtype)
    k = torch.randn(B, H, N_k, d, generator=g).to(dtype)
    v = torch.randn(B, H, N_k, d, generator=g).to(dtype)
    return q, k, v


@triton.jit
def _load_row(X, row, cols, n_cols):
    return tl.load(X + row * n_cols + cols, mask=cols < n_cols, other=0.0)


@triton.jit
def _scale_rows(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    """One program per row: out = 2 x, the load in a helper jit function, the row ragged."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = _load_row(x_ptr, row, cols, n_cols)
    tl.store(out_ptr + row * n_cols + cols, 2 * x, mask=cols < n_cols)


@triton.jit
def _sum_into(X, TOTAL, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.atomic_add(TOTAL, tl.sum(tl.load(X + offs, mask=offs < n, other=0.0), 0))


def test_forward_reads_k_once_per_query_block_and_q_once():
    B, H, N, d, blk = 1, 2, 64, 32, 16
    q, k, v = _qkv(B, H, N, N, d)
    e = q.element_size()
    with traffic.measure() as m:
        triton_attention.forward(q, k, v, block_m=blk, block_n=blk)
    t = m.traffic()
    assert t.reads["K"] == H * math.ceil(N / blk) * N * d * e
    assert t.reads["V"] == H * math.ceil(N / blk) * N * d * e
    assert t.reads["Q"] == H * N * d * e
    assert t.writes["O"] == H * N * d * e  # O written once
    assert t.writes["lse"] == H * N * 4
    assert set(t.writes) == {"O", "lse"} and set(t.reads) == {"Q", "K", "V"}
    assert m.launches == [("_attn_fwd", (math.ceil(N / blk), B * H, 1))]
    assert t == traffic.flash_forward(B, H, N, N, d, block_m=blk, block_n=blk, itemsize=e)


def test_any_jit_kernel_helpers_pointer_arithmetic_and_masks():
    x = torch.arange(5 * 13, dtype=torch.float32).reshape(5, 13)
    out = torch.empty_like(x)
    with traffic.measure(per_program=True) as m:
        _scale_rows[(5,)](x, out, 13, BLOCK=16)
    assert torch.equal(out, 2 * x)
    assert m.traffic().reads == {"x_ptr": x.numel() * 4}  # 13 of 16 lanes: masked not counted
    assert m.traffic().writes == {"out_ptr": out.numel() * 4}
    assert sorted(m.by_program) == [(r, 0, 0) for r in range(5)]
    assert all(led.traffic().reads == {"x_ptr": 13 * 4} for led in m.by_program.values())
    row3 = [a for a in m.accesses if a.program == (3, 0, 0) and a.tensor == "x_ptr"]
    assert [a.region for a in row3] == [((3, 4), (0, 13))]  # which elements it touched


def test_atomics_count_a_read_and_a_write():
    x = torch.ones(40)
    total = torch.zeros(1)
    with traffic.measure() as m:
        _sum_into[(3,)](x, total, 40, BLOCK=16)
    assert total.item() == 40
    assert m.traffic().reads == {"X": 160, "TOTAL": 3 * 4}
    assert m.traffic().writes == {"TOTAL": 3 * 4}


@pytest.mark.parametrize(
    "param, name",
    [("Q", "Q"), ("q_ptr", "Q"), ("LSE", "lse"), ("DO", "dO"), ("dq", "dQ"), ("DELTA", "D")]
    + [("Out", "Out"), ("x_ptr", "x_ptr"), ("SLOPES", "SLOPES")],
)
def test_parameter_names_map_to_the_models_names(param, name):
    assert model_name(param) == name


def test_views_of_one_buffer_are_told_apart_by_strides():
    """q, k, v interleaved in one (B, N, 3, H, d) buffer: each address goes to its own view."""
    B, H, N, d = 1, 2, 32, 16
    qkv = torch.randn(B, N, 3, H, d).to(torch.float16)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, N, d), strided
    with traffic.measure() as m:
        triton_attention.forward(q, k, v, block_m=16, block_n=16)
    model = traffic.flash_forward(B, H, N, N, d, block_m=16, block_n=16)
    assert m.traffic() == model, traffic.compare(m, model)


def test_measure_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(traffic.MeasureError, match="TRITON_INTERPRET"):
        with traffic.measure():
            pass


def test_the_interpreter_is_restored_and_unwatched_runs_cost_nothing():
    from triton.runtime import interpreter

    before = dict(vars(interpreter.interpreter_builder))
    hook = interpreter.GridExecutor._init_args_hst
    x = torch.ones(3, 16)
    with traffic.measure() as m:
        _scale_rows[(3,)](x, torch.empty_like(x), 16, BLOCK=16)
    assert vars(interpreter.interpreter_builder).keys() == before.keys()
    assert interpreter.GridExecutor._init_args_hst is hook
    _scale_rows[(3,)](x, torch.empty_like(x), 16, BLOCK=16)  # after the block: not recorded
    assert m.traffic().reads == {"x_ptr": 3 * 16 * 4}


def test_a_measurement_sees_only_its_own_threads_kernels():
    x = torch.ones(2, 16)
    seen = {}

    def other():
        with traffic.measure() as m2:
            _scale_rows[(1,)](x, torch.empty_like(x), 16, BLOCK=16)
        seen["other"] = m2.traffic().reads

    with traffic.measure() as m:
        _scale_rows[(2,)](x, torch.empty_like(x), 16, BLOCK=16)
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert m.traffic().reads == {"x_ptr": 2 * 16 * 4}
    assert seen["other"] == {"x_ptr": 16 * 4}
