"""flashedu.tiled.forward: exact against the float64 reference, tile by tile, in both loop
orders."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from flashedu import IMPLEMENTATIONS, masks, naive, reference, tiled, traffic
from flashedu.testing import Tolerance, assert_close, tolerance

# Tighter than the shared table for float32 (2e-5): the measured worst error of tiled.forward on
# these shapes is about 6e-7 (o) and 5e-7 (lse), so 5e-6 keeps 10x headroom.
TIGHT = {"float64": tolerance("float64"), "float32": Tolerance(5e-6, 5e-6)}
SHAPES = [
    (1, 1, 1, 1, 16),
    (2, 3, 17, 17, 16),
    (1, 2, 33, 65, 32),
    (1, 2, 65, 33, 32),
    (1, 1, 97, 1, 8),
]
BLOCKS = [(16, 16), (5, 7)]


@pytest.mark.parametrize("order", ["fa2", "fa1"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,H,N_q,N_k,d", SHAPES)
def test_forward_matches_reference(B, H, N_q, N_k, d, causal, dtype, order, make_qkv):
    q, k, v = make_qkv(B, H, N_q, N_k, d, dtype)
    o_ref, lse_ref = reference.forward(q, k, v, causal=causal)
    for block_m, block_n in BLOCKS:
        o, lse = tiled.forward(
            q, k, v, causal=causal, block_m=block_m, block_n=block_n, order=order
        )
        assert o.dtype == np.dtype(dtype) and lse.dtype == (
            np.float64 if dtype == "float64" else np.float32
        )
        assert_close(o, o_ref, tol=TIGHT[dtype], name="o")
        assert_close(lse, lse_ref, tol=TIGHT[dtype], name="lse")


def test_float64_is_exact_to_1e12_relative(make_qkv):
    q, k, v = make_qkv(2, 2, 97, 65, 32, "float64", scale=2.0)
    o_ref, lse_ref = reference.forward(q, k, v, causal=True)
    for order in ("fa2", "fa1"):
        o, lse = tiled.forward(q, k, v, causal=True, block_m=8, block_n=16, order=order)
        assert np.linalg.norm(o - o_ref) <= 1e-12 * np.linalg.norm(o_ref)
        fin = np.isfinite(lse_ref)
        assert np.isneginf(lse[~fin]).all()
        assert np.abs(lse[fin] - lse_ref[fin]).max() <= 1e-12 * np.abs(lse_ref[fin]).max()


@pytest.mark.parametrize("order", ["fa2", "fa1"])
def test_float16_within_tolerance(order, make_qkv):
    q, k, v = make_qkv(2, 2, 65, 97, 32, "float16")
    o_ref, lse_ref = reference.forward(q, k, v, causal=True)
    o, lse = tiled.forward(q, k, v, causal=True, block_m=16, block_n=16, order=order)
    assert o.dtype == np.float16 and lse.dtype == np.float32
    assert_close(o, o_ref, "float16", name="o")
    assert_close(lse, lse_ref, "float16", name="lse")


@pytest.mark.parametrize("order", ["fa2", "fa1"])
def test_huge_logits_stay_finite(order, make_qkv):
    q, k, v = make_qkv(1, 2, 33, 17, 16, "float32")
    q = q * np.float32(1e2)  # scores around +-1e4 in fp32
    k = k * np.float32(1e2)
    o_ref, lse_ref = reference.forward(q, k, v)
    o, lse = tiled.forward(q, k, v, block_m=8, block_n=4, order=order)
    assert np.isfinite(o).all() and np.isfinite(lse).all()
    assert_close(o, o_ref, "float32", name="o")
    assert (
        np.abs(lse - lse_ref).max() <= 2e-5 * np.abs(lse_ref).max()
    )  # lse ~ 1e4: relative in fp32


@pytest.mark.parametrize("order", ["fa2", "fa1"])
def test_fully_masked_row_is_zero_not_nan(order, make_qkv):
    q, k, v = make_qkv(
        2, 2, 9, 4, 8, "float32"
    )  # causal with N_q > N_k: the first 5 rows see nothing
    o, lse = tiled.forward(q, k, v, causal=True, block_m=2, block_n=3, order=order)
    assert not np.isnan(o).any()
    np.testing.assert_array_equal(o[:, :, :5], 0.0)
    assert np.isneginf(lse[:, :, :5]).all() and np.isfinite(lse[:, :, 5:]).all()
    q, k, v = make_qkv(1, 1, 6, 20, 8, "float64")  # a window that lies past the end of the keys
    o, lse = tiled.forward(q, k, v, window_size=(-1, -1), block_m=4, block_n=4, order=order)
    assert_close(o, reference.forward(q, k, v)[0], "float64")


@pytest.mark.parametrize("order", ["fa2", "fa1"])
@pytest.mark.parametrize("window_size", [(0, 0), (5, 3), (-1, 2), (4, -1)])
def test_window_alibi_and_gqa_match_reference(window_size, order, make_qkv):
    H, H_kv = 4, 2
    q, k, v = make_qkv(2, H, 33, 45, 16, "float64", H_kv=H_kv)
    slopes = masks.alibi_slopes(H)
    for causal in (False, True):
        kw = dict(causal=causal, window_size=window_size, alibi_slopes=slopes)
        o_ref, lse_ref = reference.forward(q, k, v, **kw)
        o, lse = tiled.forward(q, k, v, block_m=8, block_n=6, order=order, **kw)
        assert_close(o, o_ref, "float64", name="o")
        assert_close(lse, lse_ref, "float64", name="lse")


def test_orders_and_block_sizes_agree(make_qkv):
    q, k, v = make_qkv(1, 2, 50, 70, 16, "float64", H_kv=1)
    o, lse = tiled.forward(q, k, v, causal=True)
    for block_m, block_n, order in (
        (1, 1, "fa2"),
        (3, 64, "fa1"),
        (50, 70, "fa2"),
        (1000, 1000, "fa1"),
    ):
        o2, lse2 = tiled.forward(
            q, k, v, causal=True, block_m=block_m, block_n=block_n, order=order
        )
        assert_close(o2, o, "float64")
        assert_close(lse2, lse, "float64")


def test_softmax_scale_far_from_default(make_qkv):
    q, k, v = make_qkv(1, 2, 17, 33, 16, "float32")
    for scale in (1e-3, 7.5):
        assert_close(
            tiled.forward(q, k, v, softmax_scale=scale, block_m=4, block_n=8)[0],
            reference.forward(q, k, v, softmax_scale=scale)[0],
            "float32",
        )


def test_never_materialises_an_n_by_n_array(make_qkv):
    N, d = 1024, 8  # an N x N float64 array is 8 MiB, Q is 64 KiB
    q, k, v = make_qkv(1, 1, N, N, d, "float64")
    square = N * N * 8
    for fn in (
        lambda: tiled.forward(q, k, v, causal=True, block_m=32, block_n=32),
        lambda: tiled.forward(q, k, v, block_m=32, block_n=32, order="fa1"),
    ):
        tracemalloc.start()
        fn()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < square / 8, f"peak {peak:,} B, an N x N array is {square:,} B"
    tracemalloc.start()
    naive.forward(q, k, v)
    assert tracemalloc.get_traced_memory()[1] > square  # the check can see an N x N array
    tracemalloc.stop()


def test_block_sizes_follow_the_papers_rule(make_qkv):
    assert traffic.block_sizes(100 * 1024, 64, 2) == (64, 200)  # M = 51200: B_c = ceil(M/4d) = 200
    assert traffic.block_sizes(100 * 1024, 64, 4) == (64, 100)
    assert traffic.block_sizes(2048, 64, 2) == (4, 4)  # small SRAM: B_r = min(B_c, d)
    q, k, v = make_qkv(1, 1, 300, 300, 64, "float32")
    ledger = traffic.Ledger()
    tiled.forward(q, k, v, ledger=ledger)  # default SRAM: 100 KiB -> (64, 100)
    first = ledger.steps[0]
    assert first["rows"] == (0, 64) and first["cols"] == (0, 100)
    ledger = traffic.Ledger()
    tiled.forward(q, k, v, sram_bytes=8192, ledger=ledger)  # M = 2048 floats: (8, 8)
    assert ledger.steps[0]["rows"] == (0, 8) and ledger.steps[0]["cols"] == (0, 8)


def test_too_small_sram_raises_a_clear_error(make_qkv):
    q, k, v = make_qkv(1, 1, 64, 64, 16, "float32")
    need = sum(traffic.tile_bytes(32, 32, 16, itemsize=4, acc_itemsize=4).values())
    with pytest.raises(traffic.SramCapacityError, match="block_m"):
        tiled.forward(q, k, v, block_m=32, block_n=32, ledger=traffic.Ledger(sram_bytes=need - 1))
    with pytest.raises(traffic.SramCapacityError, match=f"{need:,}"):
        tiled.forward(q, k, v, block_m=32, block_n=32, sram_bytes=need - 1)
    ledger = traffic.Ledger(sram_bytes=need)
    tiled.forward(q, k, v, block_m=32, block_n=32, ledger=ledger)
    assert ledger.peak_sram == need


@pytest.mark.parametrize("order", ["fa2", "fa1"])
def test_ledger_steps_visit_every_tile_and_skip_exactly_the_hidden_ones(order, make_qkv):
    N_q, N_k, bm, bn = 23, 30, 4, 6
    q, k, v = make_qkv(2, 2, N_q, N_k, 8, "float32")
    for kw in (dict(causal=True), dict(window_size=(3, 1)), dict(causal=True, window_size=(7, -1))):
        ledger = traffic.Ledger()
        tiled.forward(q, k, v, block_m=bm, block_n=bn, order=order, ledger=ledger, **kw)
        keep = masks.visible(N_q, N_k, **kw)
        tiles = {(s["i"], s["j"]) for s in ledger.steps}
        assert len(ledger.steps) == len(tiles) == -(-N_q // bm) * -(-N_k // bn)
        for s in ledger.steps:
            (r0, r1), (c0, c1) = s["rows"], s["cols"]
            assert (r0, c0) == (s["i"] * bm, s["j"] * bn)
            assert s["skipped"] == (not keep[r0:r1, c0:c1].any())
            assert s["m"].shape == s["l"].shape == (2, 2, r1 - r0)
            loads = [
                t for t in ledger.transfers if t.step == ledger.steps.index(s) and t.tensor in "QKV"
            ]
            assert not (s["skipped"] and loads), "a skipped tile must not load Q, K or V"
        assert any(s["skipped"] for s in ledger.steps)


def test_ledger_steps_record_running_statistics(make_qkv):
    q, k, v = make_qkv(1, 1, 4, 12, 8, "float64")
    ledger = traffic.Ledger()
    o, lse = tiled.forward(q, k, v, block_m=4, block_n=4, ledger=ledger)
    ms = [s["m"] for s in ledger.steps]
    assert np.isneginf(ms[0]).all()  # before the first tile: m = -inf, l = 0
    assert (ledger.steps[0]["l"] == 0).all()
    assert all((b >= a).all() for a, b in zip(ms[1:], ms[2:]))  # the running max never decreases
    s = q[0, 0] @ k[0, 0].T / np.sqrt(8)
    assert_close(ms[2][0, 0], s[:, :8].max(axis=1), "float64")  # after two K/V blocks


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(order="fa3"), "order"),
        (dict(block_m=0), "block_m"),
        (dict(block_n=2.5), "block_n"),
        (dict(alibi_slopes=[0.5]), "alibi_slopes"),
        (dict(window_size=(-2, 0)), "window_size"),
        (dict(softmax_scale=float("nan")), "softmax_scale"),
        (dict(sram_bytes=0), "sram_bytes"),
    ],
)
def test_bad_arguments_raise_named_errors(bad, match, make_qkv):
    q, k, v = make_qkv(1, 2, 5, 5, 8, "float32")
    with pytest.raises(ValueError, match=match):
        tiled.forward(q, k, v, **bad)


def test_bad_inputs_raise_before_any_work(make_qkv):
    q, k, v = make_qkv(1, 2, 5, 5, 8, "float32")
    with pytest.raises(TypeError, match="q must be an array"):
        tiled.forward(q.tolist(), k, v)
    with pytest.raises(TypeError, match="dtype"):
        tiled.forward(q.astype(np.int32), k.astype(np.int32), v.astype(np.int32))
    with pytest.raises(ValueError, match="head dimension"):
        tiled.forward(q, k[..., :4], v[..., :4])
    with pytest.raises(ValueError, match="heads"):
        tiled.forward(np.concatenate([q, q[:, :1]], axis=1), k, v)


def test_registry_entry_is_honest(make_qkv):
    impl = IMPLEMENTATIONS["tiled"]
    assert impl.module is tiled and impl.kind == "numpy"
    assert {"gqa", "window", "alibi"} <= impl.features
    q, k, v = make_qkv(1, 2, 9, 9, 8, "float16")
    assert impl.forward(q, k, v)[0].dtype == np.float16
