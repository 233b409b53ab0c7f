"""Ring attention on real processes (gloo, CPU): exact against the float64 reference, forward and
backward, with the bytes that crossed the ring measured on the sent tensors and equal to the closed
form."""

import numpy as np
import pytest
import torch

from flashedu import masks, reference, ring
from flashedu.decoding import block_kind
from flashedu.testing import assert_close, random_qkv

# (B, H, H_kv, N_q, N_k, d, dtype, kwargs, input scale, with backward); N not a multiple of the
# world size
CASES = {
    "plain": (2, 2, 2, 13, 13, 8, "float64", {}, 1.0, True),
    "causal": (2, 2, 2, 13, 13, 8, "float64", {"causal": True}, 1.0, True),
    "causal-Nq>Nk-gqa": (1, 4, 2, 11, 7, 8, "float64", {"causal": True}, 1.0, True),
    "causal-Nq<Nk-f32": (1, 2, 2, 7, 12, 16, "float32", {"causal": True}, 1.0, True),
    "window-alibi-mqa": (
        1,
        4,
        1,
        12,
        12,
        8,
        "float64",
        {"window_size": (3, 1), "alibi_slopes": masks.alibi_slopes(4)},
        1.0,
        True,
    ),
    "huge-logits-f32": (1, 2, 2, 9, 9, 8, "float32", {"causal": True}, 100.0, False),
    "torch-f16": (1, 2, 2, 10, 10, 16, "float16", {"causal": True}, 1.0, False),
}
WORLD_SIZES = [2, 3]


def _problem(name, seed):
    B, H, H_kv, N_q, N_k, d, dtype, kwargs, scale, grad = CASES[name]
    kind = "torch" if name.startswith("torch") else "numpy"
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(B, H, N_q, N_k, d, dtype, H_kv=H_kv, seed=rng, kind=kind)
    q, k = q * scale, k * scale  # scale 100: logits of order 1e4
    do = random_qkv(B, H, N_q, 1, d, dtype, seed=rng, kind=kind)[0] if grad else None
    return dict(q=q, k=k, v=v, do=do, kwargs=kwargs)


@pytest.fixture(scope="module")
def runs():
    """One launch per world size, every case in it: process start-up is what costs time on a CPU."""
    out = {}
    for W in WORLD_SIZES:
        problems = {name: _problem(name, seed=100 * W + i) for i, name in enumerate(CASES)}
        results = ring.run_many(W, list(problems.values()))
        out[W] = {name: (problems[name], res) for name, res in zip(problems, results)}
    return out


def _dtype(name):
    return CASES[name][6]


def _same_precision_error(p):
    """Max error of plain float32 attention (torch, no tiling) on the same inputs: the conditioning
    floor."""
    q, k, v = (torch.from_numpy(x) for x in (p["q"], p["k"], p["v"]))
    o = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=p["kwargs"].get("causal", False)
    )
    return np.abs(
        o.double().numpy() - reference.forward(p["q"], p["k"], p["v"], **p["kwargs"])[0]
    ).max()


@pytest.mark.parametrize("W", WORLD_SIZES)
@pytest.mark.parametrize("name", list(CASES))
def test_forward_matches_reference(runs, W, name):
    p, res = runs[W][name]
    o_ref, lse_ref = reference.forward(p["q"], p["k"], p["v"], **p["kwargs"])
    assert type(res.o) is type(p["q"]) and res.o.dtype == p["q"].dtype
    if name.startswith("huge"):  # logits ~1e4: fp32 rounding of q.k is ~1e-3 absolute
        err, floor = np.abs(res.o - o_ref).max(), _same_precision_error(p)
        print(f"huge logits: ring error {err:.2e}, plain fp32 attention {floor:.2e}")
        assert np.isfinite(res.o).all() and err <= 2 * floor
    else:
        assert_close(res.o, o_ref, _dtype(name), name="o")
    assert_close(res.lse, lse_ref, _dtype(name), name="lse")


@pytest.mark.parametrize("W", WORLD_SIZES)
@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[-1]])
def test_backward_matches_reference(runs, W, name):
    p, res = runs[W][name]
    expected = reference.backward(p["do"], p["q"], p["k"], p["v"], **p["kwargs"])
    for g_name, g, g_ref in zip(("dq", "dk", "dv"), (res.dq, res.dk, res.dv), expected):
        assert g.shape == g_ref.shape
        assert_close(g, g_ref, _dtype(name), grad=True, name=g_name)


@pytest.mark.parametrize("W", WORLD_SIZES)
def test_fully_masked_rows_are_zero_not_nan(runs, W):
    p, res = runs[W]["causal-Nq>Nk-gqa"]  # N_q=11, N_k=7, causal: rows 0..3 see no key
    assert np.all(res.o[:, :, :4] == 0) and np.all(np.isneginf(res.lse[:, :, :4]))
    assert np.all(res.dq[:, :, :4] == 0) and not np.isnan(res.dq).any()


@pytest.mark.parametrize("W", WORLD_SIZES)
@pytest.mark.parametrize("name", list(CASES))
def test_bytes_that_crossed_the_ring_equal_the_closed_form(runs, W, name):
    p, res = runs[W][name]
    B, H_kv, N_k, d = p["k"].shape[0], p["k"].shape[1], p["k"].shape[2], p["k"].shape[3]
    expected = ring.traffic_per_step(B, H_kv, N_k, d, W, p["k"].dtype.itemsize)
    assert res.bytes_per_step.tolist() == expected
    received = sum(r["recv_bytes"] for rec in res.records for r in rec)
    assert received == sum(expected)


@pytest.mark.parametrize("W", WORLD_SIZES)
def test_backward_sends_kv_and_brings_gradients_home(runs, W):
    p, res = runs[W]["plain"]
    B, H_kv, N_k, d = p["k"].shape
    per_step = [sum(rec[t]["sent_bytes"] for rec in res.backward_records) for t in range(W)]
    kv = 2 * B * H_kv * N_k * d * 8
    assert per_step == [2 * kv] * (W - 1) + [
        kv
    ]  # K, V and their float64 accumulators; then dK, dV home


@pytest.mark.parametrize("W", WORLD_SIZES)
@pytest.mark.parametrize("name", ["plain", "causal", "causal-Nq>Nk-gqa", "window-alibi-mqa"])
def test_each_rank_meets_every_shard_and_skips_what_the_mask_hides(runs, W, name):
    p, res = runs[W][name]
    steps = np.arange(W)[:, None]
    assert (
        res.schedule == (np.arange(W)[None, :] - steps) % W
    ).all()  # shards move one rank per step
    N_q, N_k = p["q"].shape[2], p["k"].shape[2]
    q_b, k_b = ring.shard_bounds(N_q, W), ring.shard_bounds(N_k, W)
    kw = {key: p["kwargs"][key] for key in ("causal", "window_size") if key in p["kwargs"]}
    expected = [
        [block_kind(q_b[r], k_b[res.schedule[t, r]], N_q, N_k, **kw) for r in range(W)]
        for t in range(W)
    ]
    assert res.kinds.tolist() == expected
    if name == "causal":  # equal-size shards: rank r computes r + 1 blocks
        assert [(res.kinds[:, r] != "skip").sum() for r in range(W)] == list(range(1, W + 1))


def test_shard_bounds_are_contiguous_and_ragged():
    assert ring.shard_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert ring.shard_bounds(3, 3) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError, match="N=2 rows.*world_size=3"):
        ring.shard_bounds(2, 3)


def test_bad_launches_fail_before_any_process_starts():
    q, k, v = random_qkv(1, 2, 4, 4, 8, "float64")
    with pytest.raises(ValueError, match="N=4 rows.*world_size=5"):
        ring.run(5, q, k, v)
    with pytest.raises(ValueError, match="backend='nccl', device='cpu'"):
        ring.run(2, q, k, v, backend="nccl", device="cpu")
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        ring.run(2, q, k, v, alibi_slopes=[0.5])
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        ring.run(0, q, k, v)
    if torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match="one GPU per process"):
            ring.run(2, q, k, v, backend="nccl", device="cuda")


def test_forward_outside_a_process_group_says_so():
    q, k, v = random_qkv(1, 2, 4, 4, 8, "float32", kind="torch")
    with pytest.raises(RuntimeError, match="initialised torch.distributed process group"):
        ring.forward(q, k, v)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL ring needs two CUDA GPUs")
def test_nccl_ring_on_two_gpus_matches_reference():
    for causal in (False, True):
        p = _problem("causal-Nq<Nk-f32", seed=7)
        res = ring.run(
            2, p["q"], p["k"], p["v"], do=p["do"], causal=causal, backend="nccl", device="cuda"
        )
        o_ref, lse_ref = reference.forward(p["q"], p["k"], p["v"], causal=causal)
        assert_close(res.o, o_ref, "float32", name="o")
        assert_close(res.lse, lse_ref, "float32", name="lse")
        for g, g_ref in zip(
            (res.dq, res.dk, res.dv),
            reference.backward(p["do"], p["q"], p["k"], p["v"], causal=causal),
        ):
            assert_close(g, g_ref, "float32", grad=True)
