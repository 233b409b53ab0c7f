"""traffic.measure: the bytes a Triton kernel moves under the interpreter, by tensor and direction,
held equal to the closed forms of flashedu.traffic for the package's kernels."""

from __future__ import annotations

import math
import threading

import pytest
import torch
import triton
import triton.language as tl

from flashedu import (
    kernels,
    traffic,
)
from flashedu.traffic.measured import model_name


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
        kernels.forward(q, k, v, block_m=blk, block_n=blk)
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
    + [("desc_q", "Q"), ("desc_dq", "dQ"), ("desc_x", "desc_x")]
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
        kernels.forward(q, k, v, block_m=16, block_n=16)
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


# ------------------------------------------------------------ the package's kernels == the model

SHAPES = [  # (B, H, N_q, N_k, d, causal): ragged, causal both ways, N_q != N_k
    (1, 2, 37, 53, 32, False),
    (1, 2, 37, 53, 32, True),
    (2, 1, 53, 37, 16, True),
    (1, 2, 64, 64, 16, True),
]


def _forward_and_backward(B, H, N_q, N_k, d, causal, H_kv=None, dtype=torch.float16):
    q, k, v = _qkv(B, H, N_q, N_k, d, dtype)
    if H_kv:
        k, v = k[:, :H_kv].contiguous(), v[:, :H_kv].contiguous()
    blocks = dict(block_m=16, block_n=16)
    with traffic.measure() as fwd:
        o, lse = kernels.forward(q, k, v, causal=causal, **blocks)
    do = torch.randn_like(q)
    with traffic.measure() as bwd:
        kernels.backward(do, q, k, v, o, lse, causal=causal, **blocks)
    return fwd, bwd


@pytest.mark.parametrize("B,H,N_q,N_k,d,causal", SHAPES)
def test_triton_forward_and_backward_move_the_models_bytes(B, H, N_q, N_k, d, causal):
    fwd, bwd = _forward_and_backward(B, H, N_q, N_k, d, causal)
    kw = dict(block_m=16, block_n=16, causal=causal)
    model = traffic.flash_forward(B, H, N_q, N_k, d, **kw)
    extra = traffic.triton_forward_extra(B, H, N_q, N_k, d, **kw)
    assert fwd.traffic() == traffic.combine(model, extra), traffic.compare(fwd, model)
    back = traffic.flash_backward(B, H, N_q, N_k, d, variant="two_pass", **kw)
    assert bwd.traffic() == back, traffic.compare(bwd, back)
    assert [name for name, _ in bwd.launches] == ["attn_bwd_preprocess", "attn_bwd_dkdv"] + [
        "attn_bwd_dq"
    ]


def test_the_one_difference_is_q_of_query_blocks_that_see_no_key():
    """Causal N_q > N_k: rows 0..15 of 53 see no key of 37, and the Triton forward still loads
    that Q block (to write its zero output); the NumPy tiled forward and the model do not."""
    B, H, N_q, N_k, d = 1, 2, 53, 37, 16
    fwd, _ = _forward_and_backward(B, H, N_q, N_k, d, True)
    model = traffic.flash_forward(B, H, N_q, N_k, d, block_m=16, block_n=16, causal=True)
    (diff,) = traffic.compare(fwd, model)
    assert (diff.tensor, diff.direction) == ("Q", "read")
    assert diff.measured - diff.model == 16 * B * H * d * 2  # one hidden block of 16 rows
    extra = traffic.triton_forward_extra(B, H, N_q, N_k, d, block_m=16, block_n=16, causal=True)
    assert extra.reads == {"Q": diff.measured - diff.model}


def test_gqa_backward_reads_each_kv_head_once_per_pass():
    B, H, H_kv, N, d = 1, 4, 2, 40, 16
    _, bwd = _forward_and_backward(B, H, N, N, d, True, H_kv=H_kv)
    back = traffic.flash_backward(
        B, H, N, N, d, block_m=16, block_n=16, causal=True, H_kv=H_kv, variant="two_pass"
    )
    assert bwd.traffic() == back, traffic.compare(bwd, back)


def test_the_atomic_and_two_pass_backwards_differ_where_the_docstring_says():
    kw = dict(block_m=16, block_n=16)
    atomic = traffic.flash_backward(1, 1, 64, 64, 16, **kw)
    two = traffic.flash_backward(1, 1, 64, 64, 16, variant="two_pass", **kw)
    row = 16 * 2
    assert two.reads["Q"] - atomic.reads["Q"] == 64 * row  # the dQ pass reads Q once more
    assert two.reads["K"] == 64 * row + 4 * 64 * row  # once in the dK/dV pass, 4x in the dQ pass
    assert "dQ" not in two.reads and two.writes["dQ"] == 64 * row  # no accumulator
    with pytest.raises(ValueError, match="variant must be one of"):
        traffic.flash_backward(1, 1, 64, 64, 16, variant="atomics", **kw)


# ---------------------------------------------------- planted kernels: the bytes give them away


@triton.jit
def _planted_fwd(
    Q, K, V, O, S, N_q, N_k, scale,
    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    STORE_S: tl.constexpr, RELOAD_Q: tl.constexpr,
):  # fmt: skip
    """A plain FA2 forward over (B*H, N, D) tensors, N a multiple of the blocks, with two planted
    wastes: STORE_S writes every score tile to HBM, RELOAD_Q loads q_i again for every key block."""
    i, bh = tl.program_id(0), tl.program_id(1)
    rows, dims = i * BM + tl.arange(0, BM), tl.arange(0, D)
    q_ptrs = Q + bh * N_q * D + rows[:, None] * D + dims[None, :]
    q = tl.load(q_ptrs)
    m = tl.full([BM], -float("inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    for start in range(0, N_k, BN):
        cols = start + tl.arange(0, BN)
        if RELOAD_Q:
            q = tl.load(q_ptrs)
        k = tl.load(K + bh * N_k * D + cols[:, None] * D + dims[None, :])
        s = tl.dot(q, tl.trans(k)) * scale
        if STORE_S:
            tl.store(S + bh * N_q * N_k + rows[:, None] * N_k + cols[None, :], s)
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + bh * N_k * D + cols[:, None] * D + dims[None, :])
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m = m_new
    tl.store(O + bh * N_q * D + rows[:, None] * D + dims[None, :], acc / l_i[:, None])


def _planted(store_s=False, reload_q=False, N_q=64, N_k=32, d=16, BH=2):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(BH, n, d, generator=g) for n in (N_q, N_k, N_k))
    o, s = torch.empty_like(q), torch.empty(BH, N_q, N_k)
    with traffic.measure() as m:
        _planted_fwd[(N_q // 16, BH)](
            q, k, v, o, s, N_q, N_k, d**-0.5, D=d, BM=16, BN=16, STORE_S=store_s, RELOAD_Q=reload_q
        )
    ref = torch.softmax(q @ k.transpose(1, 2) * d**-0.5, -1) @ v
    torch.testing.assert_close(o, ref, atol=1e-4, rtol=1e-4)
    model = traffic.flash_forward(1, BH, N_q, N_k, d, block_m=16, block_n=16, itemsize=4)
    model = traffic.Traffic(model.reads, {"O": model.writes["O"]})  # this kernel keeps no lse
    return m, model


def test_a_clean_kernel_moves_exactly_the_fa2_bytes():
    m, model = _planted()
    assert traffic.compare(m, model) == []
    assert m.reuse("K") == (1.0, 4.0, 8)  # each program reads its K once; 4 query blocks share it
    assert m.reuse("Q") == (1.0, 1.0, 8)


def test_a_kernel_that_stores_s_is_caught_in_bytes():
    m, model = _planted(store_s=True)
    (diff,) = traffic.compare(m, model)
    assert (diff.tensor, diff.direction, diff.model) == ("S", "write", 0)
    assert diff.measured == 2 * 64 * 32 * 4  # all of S, once
    assert str(diff) == (
        "your kernel wrote S once (16,384 B of a 16,384 B tensor); the model never moves it"
    )


def test_a_kernel_that_rereads_q_per_key_block_is_caught_in_bytes():
    m, model = _planted(reload_q=True)
    (diff,) = traffic.compare(m, model)
    assert (diff.tensor, diff.direction) == ("Q", "read")
    assert diff.measured == 3 * diff.model  # once before the loop, then once per key block (2)
    assert str(diff) == (
        "your kernel read Q 3 times (24,576 B of a 8,192 B tensor); the model reads it once: "
        "each program read the same elements of Q 3 times"
    )


def test_compare_names_the_grid_axis_a_tensor_is_reread_along():
    m, _ = _planted()
    once = traffic.Traffic({"Q": 8192, "K": 4096, "V": 4096}, {"O": 8192})
    (k, v) = traffic.compare(m, once, axis_names=("query block", "batch x head"))
    assert str(k) == (
        "your kernel read K 4 times (16,384 B of a 4,096 B tensor); the model reads it once: "
        "once per query block"
    )
    assert v.tensor == "V"
    (k, _) = traffic.compare(m, once)
    assert str(k).endswith(": once per program along grid axis 0")
