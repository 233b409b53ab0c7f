"""flashedu.traffic: every closed form equals, byte for byte, what the instrumented code reports."""

from __future__ import annotations

import numpy as np
import pytest

from flashedu import masks, naive, tiled, traffic
from flashedu.testing import random_qkv

RAGGED = [
    (1, 1, 1, 1, 4),
    (2, 3, 17, 33, 8),
    (1, 2, 33, 17, 8),
    (1, 1, 97, 65, 4),
    (1, 2, 5, 40, 4),
]
BLOCKS = [(4, 4), (5, 7), (16, 8), (64, 64)]
MASKS = [
    dict(),
    dict(causal=True),
    dict(window_size=(6, 2)),
    dict(causal=True, window_size=(3, -1)),
]


def _sizes(dtype):
    return dict(itemsize=np.dtype(dtype).itemsize, lse_itemsize=8 if dtype == "float64" else 4)


def _qkv(B, H, N_q, N_k, d, dtype, seed=0, H_kv=None):
    return random_qkv(B, H, N_q, N_k, d, dtype, H_kv=H_kv, seed=seed)


@pytest.mark.parametrize("dtype", ["float16", "float64"])
@pytest.mark.parametrize("B,H,N_q,N_k,d", RAGGED)
def test_naive_closed_forms_match_instrumented_counts(B, H, N_q, N_k, d, dtype):
    q, k, v = _qkv(B, H, N_q, N_k, d, dtype)
    ledger = traffic.Ledger()
    o, lse, p = naive.forward(q, k, v, causal=True, ledger=ledger, return_p=True)
    assert ledger.traffic() == traffic.naive_forward(B, H, N_q, N_k, d, **_sizes(dtype))
    ledger = traffic.Ledger()
    naive.backward(o, q, k, v, o, lse, causal=True, p=p, ledger=ledger)
    assert ledger.traffic() == traffic.naive_backward(
        B, H, N_q, N_k, d, itemsize=np.dtype(dtype).itemsize
    )


@pytest.mark.parametrize("order", ["fa2", "fa1"])
@pytest.mark.parametrize("B,H,N_q,N_k,d", RAGGED)
def test_flash_forward_matches_instrumented_count(B, H, N_q, N_k, d, order):
    for dtype in ("float16", "float32"):
        q, k, v = _qkv(B, H, N_q, N_k, d, dtype)
        for (block_m, block_n), kw in zip(BLOCKS, MASKS):
            ledger = traffic.Ledger()
            tiled.forward(
                q, k, v, block_m=block_m, block_n=block_n, order=order, ledger=ledger, **kw
            )
            model = traffic.flash_forward(
                B,
                H,
                N_q,
                N_k,
                d,
                block_m=min(block_m, N_q),
                block_n=min(block_n, N_k),
                order=order,
                **kw,
                **_sizes(dtype),
            )
            assert ledger.traffic() == model, (
                block_m,
                block_n,
                kw,
                ledger.traffic().table(),
                model.table(),
            )


@pytest.mark.parametrize("B,H,N_q,N_k,d", RAGGED)
def test_flash_backward_matches_instrumented_count(B, H, N_q, N_k, d):
    for dtype in ("float16", "float64"):
        q, k, v = _qkv(B, H, N_q, N_k, d, dtype)
        for (block_m, block_n), kw in zip(BLOCKS[::-1], MASKS):
            o, lse = tiled.forward(q, k, v, **kw)
            ledger = traffic.Ledger()
            tiled.backward(
                o, q, k, v, o, lse, block_m=block_m, block_n=block_n, ledger=ledger, **kw
            )
            model = traffic.flash_backward(
                B,
                H,
                N_q,
                N_k,
                d,
                block_m=min(block_m, N_q),
                block_n=min(block_n, N_k),
                **kw,
                **_sizes(dtype),
            )
            assert ledger.traffic() == model, (
                block_m,
                block_n,
                kw,
                ledger.traffic().table(),
                model.table(),
            )


def test_gqa_counts_each_query_head_and_the_group_reduction():
    B, H, H_kv, N, d = 2, 4, 1, 19, 8
    q, k, v = _qkv(B, H, N, N, d, "float32", H_kv=H_kv)
    ledger = traffic.Ledger()
    o, lse = tiled.forward(q, k, v, causal=True, block_m=4, block_n=8, ledger=ledger)
    assert ledger.traffic() == traffic.flash_forward(
        B, H, N, N, d, block_m=4, block_n=8, causal=True, itemsize=4
    )
    ledger = traffic.Ledger()
    tiled.backward(o, q, k, v, o, lse, causal=True, block_m=4, block_n=8, ledger=ledger)
    model = traffic.flash_backward(
        B, H, N, N, d, block_m=4, block_n=8, causal=True, itemsize=4, H_kv=H_kv
    )
    assert ledger.traffic() == model
    assert model.writes["dK"] == (B * H + B * H_kv) * N * d * 4


def test_unmasked_fa2_forward_is_the_textbook_formula():
    B, H, N_q, N_k, d, bm, bn = 2, 3, 1000, 700, 64, 64, 128
    t = traffic.flash_forward(B, H, N_q, N_k, d, block_m=bm, block_n=bn)
    row = B * H * d * 2
    assert t.reads == {
        "Q": N_q * row,
        "K": -(-N_q // bm) * N_k * row,
        "V": -(-N_q // bm) * N_k * row,
    }
    assert t.writes == {"O": N_q * row, "lse": B * H * N_q * 4}
    t1 = traffic.flash_forward(B, H, N_q, N_k, d, block_m=bm, block_n=bn, order="fa1")
    assert t1.reads["Q"] == t1.reads["O"] == -(-N_k // bn) * N_q * row
    assert t1.reads["K"] == N_k * row


def test_kv_blocks_are_exactly_the_blocks_with_a_visible_key():
    for N_q, N_k in ((1, 1), (23, 30), (30, 23), (9, 4)):
        for kw in MASKS + [dict(window_size=(0, 0)), dict(window_size=(-1, -1))]:
            keep = masks.visible(N_q, N_k, **kw)
            for bm, bn in ((1, 1), (4, 6), (7, 5)):
                for r0 in range(0, N_q, bm):
                    r1 = min(r0 + bm, N_q)
                    want = [
                        j for j in range(-(-N_k // bn)) if keep[r0:r1, j * bn : (j + 1) * bn].any()
                    ]
                    assert list(masks.kv_blocks(r0, r1, N_q, N_k, bn, **kw)) == want


def test_causal_skipping_roughly_halves_the_kv_traffic():
    kw = dict(block_m=64, block_n=64)
    full = traffic.flash_forward(1, 1, 4096, 4096, 64, **kw)
    causal = traffic.flash_forward(1, 1, 4096, 4096, 64, causal=True, **kw)
    assert causal.reads["K"] / full.reads["K"] == pytest.approx(0.5, abs=0.01)
    assert causal.reads["Q"] == full.reads["Q"] and causal.writes == full.writes


def test_naive_to_flash_ratio_grows_with_n():
    """Grows with N, then levels off near Theta(M / d^2) when the re-read operand has the long
    blocks: the FA1 order with the paper's rule, the FA2 order with the rule's roles swapped (B_r
    long, B_c = min(B_r, d))."""
    d, sram = 64, 100 * 1024
    bm, bn = traffic.block_sizes(sram, d, 2)  # (64, 200)
    Ns = (256, 512, 1024, 2048, 4096, 8192, 16384)
    for order, (block_m, block_n) in (("fa1", (bm, bn)), ("fa2", (bn, bm))):
        ratios = [
            traffic.naive_forward(1, 1, N, N, d).total_bytes
            / traffic.flash_forward(
                1, 1, N, N, d, block_m=block_m, block_n=block_n, order=order
            ).total_bytes
            for N in Ns
        ]
        assert all(b > a for a, b in zip(ratios, ratios[1:])), (order, ratios)
        assert ratios[-1] > 1.2 * ratios[0] and ratios[-1] > 3.5, (order, ratios)
    # The paper's rule in the FA2 order (B_r = d) re-reads K and V N/d times: 2N^2 elements against
    # S and P's 4N^2, so the ratio stays just under 2 at every N.
    fa2_rule = [
        traffic.naive_forward(1, 1, N, N, d).total_bytes
        / traffic.flash_forward(1, 1, N, N, d, block_m=bm, block_n=bn).total_bytes
        for N in Ns
    ]
    assert all(1.9 < r < 2 for r in fa2_rule), fa2_rule


def test_flash_traffic_shrinks_as_sram_grows():
    totals = [
        traffic.flash_forward(
            1,
            1,
            4096,
            4096,
            64,
            **dict(zip(("block_m", "block_n"), traffic.block_sizes(kib * 1024, 64, 2))),
            order="fa1",
        ).total_bytes
        for kib in (16, 48, 100, 192)
    ]
    assert all(b < a for a, b in zip(totals, totals[1:])), totals


def test_block_sizes_rule_and_errors():
    for sram in (1024, 20_000, 100 * 1024, 192 * 1024):
        for d in (16, 64, 128):
            bm, bn = traffic.block_sizes(sram, d, 2)
            M = sram // 2
            assert bn == -(-M // (4 * d)) and bm == min(bn, d)
            assert (
                sum(traffic.tile_bytes(bm, bn, d, itemsize=2, acc_itemsize=2).values())
                <= 1.25 * M * 2 + 4 * d * 2
            )
    with pytest.raises(ValueError, match="sram_bytes"):
        traffic.block_sizes(1, 64, 2)
    with pytest.raises(ValueError, match="d must"):
        traffic.block_sizes(1024, 0, 2)
    with pytest.raises(ValueError, match="order"):
        traffic.flash_forward(1, 1, 8, 8, 4, block_m=4, block_n=4, order="fa3")


def test_saved_for_backward_matches_what_each_forward_returns():
    for N in (17, 64, 200):
        q, k, v = _qkv(2, 3, N, N, 16, "float16")
        _, _, p = naive.forward(q, k, v, return_p=True)
        o, lse = tiled.forward(q, k, v)
        saved = traffic.saved_for_backward(2, 3, N, N, 16, itemsize=2, lse_itemsize=4)
        assert saved == {"naive": p.nbytes, "flash": o.nbytes + lse.nbytes}


def test_paper_gpt2_medium_comparison():
    rows = {(r["method"], r["source"]): r for r in traffic.paper_gpt2_medium()}
    assert rows["standard", "paper"]["hbm_gb"] == 40.3 and rows["flash", "paper"]["hbm_gb"] == 4.4
    assert rows["standard", "paper"]["gflops"] == 66.6 and rows["flash", "paper"]["gflops"] == 75.2
    std, fl = rows["standard", "model"], rows["flash", "model"]
    assert std["hbm_gb"] == pytest.approx(25.24, abs=0.01)  # S, P, dP, dS through HBM in fp16
    assert fl["hbm_gb"] < std["hbm_gb"] / 2
    assert fl["gflops"] / std["gflops"] == pytest.approx(3.5 / 3.0)  # recomputation costs FLOPs
    assert std["bound"] == "memory" and fl["ms"] < std["ms"]
    causal = {(r["method"], r["source"]): r for r in traffic.paper_gpt2_medium(causal=True)}
    assert causal["flash", "model"]["hbm_gb"] < fl["hbm_gb"]
    assert causal["standard", "model"]["hbm_gb"] == std["hbm_gb"]


def test_combine_adds_traffic_by_tensor():
    a = traffic.Traffic({"Q": 1, "K": 2}, {"O": 3})
    b = traffic.Traffic({"Q": 10}, {"O": 1, "lse": 4})
    assert traffic.combine(a, b) == traffic.Traffic({"Q": 11, "K": 2}, {"O": 4, "lse": 4})
