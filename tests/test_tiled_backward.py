"""flashedu.tiled.backward: gradients by recomputation against the float64 reference."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from flashedu import masks, naive, reference, tiled, traffic
from flashedu.testing import Tolerance, assert_close

SHAPES = [
    (1, 1, 1, 1, 16),
    (2, 3, 17, 17, 16),
    (1, 2, 33, 65, 32),
    (1, 2, 65, 33, 32),
    (1, 1, 97, 5, 8),
]


def _grads(q, k, v, do, *, block_m=8, block_n=16, **kw):
    o, lse = tiled.forward(q, k, v, block_m=block_m, block_n=block_n, **kw)
    return tiled.backward(do, q, k, v, o, lse, block_m=block_m, block_n=block_n, **kw)


# float32 tighter than the shared table (5e-5): the measured worst gradient error is about 1e-6.
TIGHT = {"float32": Tolerance(1e-5, 1e-5)}


def _check(grads, expected, dtype):
    for name, g, e in zip(("dq", "dk", "dv"), grads, expected):
        assert g.dtype == np.dtype(dtype), name
        assert_close(g, e, dtype, grad=True, name=name, tol=TIGHT.get(dtype))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,H,N_q,N_k,d", SHAPES)
def test_backward_matches_reference(B, H, N_q, N_k, d, causal, dtype, make_qkv, rng):
    q, k, v = make_qkv(B, H, N_q, N_k, d, dtype)
    do = rng.standard_normal(q.shape).astype(dtype)
    expected = reference.backward(do, q, k, v, causal=causal)
    for block_m, block_n in ((16, 16), (5, 7)):
        _check(
            _grads(q, k, v, do, causal=causal, block_m=block_m, block_n=block_n), expected, dtype
        )


def test_float16_gradients_within_tolerance(make_qkv, rng):
    q, k, v = make_qkv(2, 2, 65, 33, 32, "float16")
    do = rng.standard_normal(q.shape).astype(np.float16)
    _check(
        _grads(q, k, v, do, causal=True), reference.backward(do, q, k, v, causal=True), "float16"
    )


@pytest.mark.parametrize("window_size", [None, (5, 3), (-1, 2)])
def test_window_alibi_and_gqa_gradients(window_size, make_qkv, rng):
    H, H_kv = 4, 2
    q, k, v = make_qkv(2, H, 33, 45, 16, "float64", H_kv=H_kv)
    do = rng.standard_normal(q.shape)
    for causal in (False, True):
        kw = dict(causal=causal, window_size=window_size, alibi_slopes=masks.alibi_slopes(H))
        grads = _grads(q, k, v, do, block_m=8, block_n=6, **kw)
        assert grads[1].shape == grads[2].shape == k.shape
        _check(grads, reference.backward(do, q, k, v, **kw), "float64")


def test_fully_masked_rows_give_zero_gradients_not_nan(make_qkv, rng):
    q, k, v = make_qkv(2, 2, 9, 4, 8, "float32")  # causal, N_q > N_k: rows 0..4 see nothing
    do = rng.standard_normal(q.shape).astype(np.float32)
    dq, dk, dv = _grads(q, k, v, do, causal=True, block_m=2, block_n=3)
    for g in (dq, dk, dv):
        assert np.isfinite(g).all()
    np.testing.assert_array_equal(dq[:, :, :5], 0.0)
    dq0, dk0, dv0 = _grads(q[:, :, 5:], k, v, do[:, :, 5:], causal=True, block_m=2, block_n=3)
    assert_close(dk, dk0, "float32", grad=True)  # the masked rows add nothing to dK, dV
    assert_close(dv, dv0, "float32", grad=True)


def test_huge_logits_give_finite_gradients(make_qkv, rng):
    q, k, v = make_qkv(1, 2, 33, 17, 16, "float64")
    q, k = q * 1e2, k * 1e2  # scores around +-1e4
    do = rng.standard_normal(q.shape)
    grads = _grads(q, k, v, do, block_m=8, block_n=4)
    assert all(np.isfinite(g).all() for g in grads)
    expected = reference.backward(do, q, k, v)
    for g, e in zip(grads, expected):  # gradients scale with |q| |k|: compare normwise
        assert np.linalg.norm(g - e) <= 1e-10 * max(np.linalg.norm(e), 1.0)


def test_backward_never_materialises_an_n_by_n_array(make_qkv, rng):
    N, d = 1024, 8  # an N x N float64 array is 8 MiB, Q is 64 KiB
    q, k, v = make_qkv(1, 1, N, N, d, "float64")
    do = rng.standard_normal(q.shape)
    o, lse = tiled.forward(q, k, v, causal=True)
    tracemalloc.start()
    tiled.backward(do, q, k, v, o, lse, causal=True, block_m=32, block_n=32)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < N * N * 8 / 8, f"peak {peak:,} B"
    tracemalloc.start()
    naive.backward(do, q, k, v, o, lse, causal=True)
    assert tracemalloc.get_traced_memory()[1] > N * N * 8
    tracemalloc.stop()


def test_backward_steps_cover_every_tile_kv_block_outermost(make_qkv, rng):
    q, k, v = make_qkv(1, 1, 10, 13, 8, "float32")
    o, lse = tiled.forward(q, k, v, causal=True)
    ledger = traffic.Ledger()
    tiled.backward(
        rng.standard_normal(q.shape).astype(np.float32),
        q,
        k,
        v,
        o,
        lse,
        causal=True,
        block_m=3,
        block_n=5,
        ledger=ledger,
    )
    order = [(s["j"], s["i"]) for s in ledger.steps]
    assert order == sorted(order) and len(order) == 4 * 3
    keep = masks.visible(10, 13, causal=True)
    for s in ledger.steps:
        (r0, r1), (c0, c1) = s["rows"], s["cols"]
        assert s["skipped"] == (not keep[r0:r1, c0:c1].any())


def test_backward_bad_arguments_raise_named_errors(make_qkv):
    q, k, v = make_qkv(1, 2, 5, 6, 8, "float32")
    o, lse = tiled.forward(q, k, v)
    with pytest.raises(ValueError, match="lse must have shape"):
        tiled.backward(o, q, k, v, o, lse[..., :3])
    with pytest.raises(ValueError, match="do must have"):
        tiled.backward(o[:, :1], q, k, v, o, lse)
    with pytest.raises(TypeError, match="do must have q's dtype"):
        tiled.backward(o.astype(np.float64), q, k, v, o, lse)
    with pytest.raises(ValueError, match="block_n"):
        tiled.backward(o, q, k, v, o, lse, block_n=-1)
    with pytest.raises(traffic.SramCapacityError):
        tiled.backward(
            o, q, k, v, o, lse, block_m=4, block_n=4, ledger=traffic.Ledger(sram_bytes=100)
        )
