"""The traffic model at any size: closed forms in O(1) or O(query blocks), named errors for bad
sizes, FLOPs and exponentials over the visible area, tiles that fit, the exponentials' ceiling."""

from __future__ import annotations

import itertools
import math
import time

import numpy as np
import pytest

from flashedu import masks, tiled, traffic, viz, widgets
from flashedu.testing import random_qkv

MASKS = [
    dict(),
    dict(causal=True),
    dict(window_size=(5, 2)),
    dict(window_size=(0, 0)),
    dict(causal=True, window_size=(3, -1)),
    dict(window_size=(-1, 4)),
]
SIZES = [(1, 1), (1, 9), (9, 1), (7, 7), (13, 29), (29, 13), (40, 40)]


@pytest.mark.parametrize("kw", MASKS)
def test_visible_count_is_the_area_of_the_mask(kw):
    for N_q, N_k in SIZES:
        assert masks.visible_count(N_q, N_k, **kw) == masks.visible(N_q, N_k, **kw).sum(), (
            N_q,
            N_k,
        )


@pytest.mark.parametrize("kw", MASKS)
def test_kv_block_spans_are_kv_blocks_for_every_query_block(kw):
    for (N_q, N_k), (bm, bn) in itertools.product(SIZES, [(1, 1), (4, 3), (8, 16)]):
        rows, first, stop = masks.kv_block_spans(N_q, N_k, bm, bn, **kw)
        for k, (r0, r1) in enumerate(masks.row_blocks(N_q, bm)):
            js = masks.kv_blocks(r0, r1, N_q, N_k, bn, **kw)
            assert rows[k] == r1 - r0
            assert range(first[k], stop[k]) == js or (len(js) == 0 and first[k] == stop[k])


def test_tile_map_prints_the_tiles_tiled_forward_computes():
    """The text map of chapter 03, from the block rules, equals the one read off the ledger."""
    for N_q, N_k, kw in [(48, 48, dict(causal=True)), (20, 48, dict(causal=True))] + [
        (48, 48, dict(window_size=(16, 0)))
    ]:
        q, k, v = random_qkv(1, 1, N_q, N_k, 8, "float32", seed=0)
        ledger = traffic.Ledger()
        tiled.forward(q, k, v, block_m=8, block_n=8, ledger=ledger, **kw)
        keep = masks.visible(N_q, N_k, **kw)
        grid = {}
        for s in ledger.steps:
            (r0, r1), (c0, c1) = s["rows"], s["cols"]
            full = keep[r0:r1, c0:c1].all()
            grid[s["i"], s["j"]] = "." if s["skipped"] else "#" if full else "/"
        n_i = max(i for i, _ in grid) + 1
        lines = ["   " + " ".join(grid[i, j] for j in range(len(grid) // n_i)) for i in range(n_i)]
        lines.append(f"   {sum(c != '.' for c in grid.values())} of {len(grid)} tiles computed")
        assert masks.tile_map(N_q, N_k, 8, 8, **kw) == "\n".join(lines)
    assert masks.tile_map(16, 16, 8, 8, causal=True) == "   / .\n   # /\n   3 of 4 tiles computed"


# ---------------------------------------------------------------------------------------- scale


def test_closed_forms_never_loop_over_blocks(monkeypatch):
    """Structural: the closed forms may not call the per-block rule at all, so their cost is
    O(query blocks) in numpy; at N = 10^6 with 16-blocks they equal the textbook formula."""

    def forbidden(*a, **k):
        raise AssertionError("a closed form looped over blocks")

    monkeypatch.setattr(masks, "kv_blocks", forbidden)
    N, d, row = 10**6, 64, 64 * 2
    t = traffic.flash_forward(1, 1, N, N, d, block_m=16, block_n=16)
    assert t.reads["K"] == t.reads["V"] == math.ceil(N / 16) * N * row
    assert t.reads["Q"] == t.writes["O"] == N * row
    for variant in traffic.BACKWARD_VARIANTS:
        traffic.flash_backward(1, 1, N, N, d, block_m=16, block_n=16, causal=True, variant=variant)
    traffic.flash_forward(1, 1, N, N, d, block_m=16, block_n=16, order="fa1", causal=True)


def test_explorer_answers_at_ten_million_tokens():
    start = time.perf_counter()
    s = viz.explorer_state(N=10**7, causal=True)
    assert time.perf_counter() - start < 2.0  # about 10 ms measured; generous for a busy machine
    assert s["traffic"].reads["Q"] == 10**7 * 64 * 2
    assert s["flops"] == 4 * 64 * (10**7 * (10**7 + 1) // 2)


# ----------------------------------------------------------------------------- named size errors

BAD = [0, -3, 2.5, True, "4", None]
CALLS = {
    "naive_forward": lambda **kw: traffic.naive_forward(**{**ARGS, **kw}),
    "naive_backward": lambda **kw: traffic.naive_backward(**{**ARGS, **kw}),
    "flash_forward": lambda **kw: traffic.flash_forward(**{**ARGS, **BLK, **kw}),
    "flash_backward": lambda **kw: traffic.flash_backward(**{**ARGS, **BLK, **kw}),
    "attention_flops": lambda **kw: traffic.attention_flops(**{**ARGS, **kw}),
    "saved_for_backward": lambda **kw: traffic.saved_for_backward(**{**ARGS, **kw}),
}
ARGS = dict(B=1, H=2, N_q=33, N_k=17, d=16)
BLK = dict(block_m=8, block_n=8)


@pytest.mark.parametrize("fn", list(CALLS))
@pytest.mark.parametrize("bad", BAD)
def test_every_size_argument_is_checked_by_name(fn, bad):
    args = list(ARGS) + (list(BLK) if fn.startswith("flash") else [])
    args += ["itemsize"] if fn != "attention_flops" else []
    for arg in args:
        with pytest.raises(ValueError, match=rf"{fn}: {arg} must be a positive int, got {bad!r}"):
            CALLS[fn](**{arg: bad})


def test_other_bad_arguments_are_named():
    with pytest.raises(ValueError, match="order must be 'fa2'"):
        traffic.flash_forward(**ARGS, **BLK, order="fa3")
    with pytest.raises(TypeError, match="causal must be a bool, got 'False'"):
        traffic.flash_forward(**ARGS, **BLK, causal="False")
    with pytest.raises(ValueError, match="window_size entries must be >= 0"):
        traffic.flash_forward(**ARGS, **BLK, window_size=(-2, 0))
    with pytest.raises(ValueError, match="pass_ must be one of"):
        traffic.attention_flops(**ARGS, pass_="both")
    with pytest.raises(ValueError, match="H=3 must be a multiple of H_kv=2"):
        traffic.flash_backward(1, 3, 8, 8, 16, **BLK, H_kv=2)
    with pytest.raises(ValueError, match="gpu must be one of"):
        traffic.roofline(1.0, 1.0, "B200")


# --------------------------------------------------------------------- FLOPs and exponentials


def test_flops_count_the_visible_area():
    d = 64
    assert traffic.attention_flops(1, 1, 1, 1000, d, causal=True) == 4 * d * 1000  # sees all keys
    assert traffic.attention_flops(1, 1, 1000, 1000, d, causal=True) == 4 * d * 1000 * 1001 / 2
    assert traffic.attention_flops(2, 3, 10, 20, d, window_size=(0, 0)) == 4 * d * 6 * 10
    assert traffic.attention_flops(1, 1, 8, 8, d, pass_="fwd_bwd") == 3.5 * 4 * d * 64
    # benchmarks keep their convention: 4 N^2 d, halved when causal
    assert traffic.benchmark_flops(1, 1, 1000, d, causal=True) == 0.5 * 4 * d * 1000**2


def test_exponentials_have_their_own_ceiling():
    h200 = traffic.GPUS["H200"]
    assert h200.sfu_tflops == traffic.GPUS["H100-SXM"].sfu_tflops == 3.9
    assert "arXiv:2407.08608" in h200.source and traffic.GPUS["A100-80GB"].sfu_flops is None
    N = 4096
    assert traffic.exp_count(1, 1, N, N) == N * N
    assert traffic.exp_count(1, 1, N, N, causal=True) == N * (N + 1) / 2
    assert traffic.exp_count(1, 1, N, N, pass_="fwd_bwd") == 2 * N * N
    # FA3's point: at d = 128 the exponentials take about half the matmul time
    flops, exps = traffic.attention_flops(1, 1, N, N, 128), traffic.exp_count(1, 1, N, N)
    ratio = traffic.exp_time(exps, "H100-SXM") / (flops / h200.dense_flops)
    assert 0.45 < ratio < 0.55
    assert traffic.exp_time(exps, "A100-40GB") is None
    r = traffic.roofline(traffic.attention_flops(1, 1, N, N, 16), 1.0, "H200", exps=exps)
    assert r.bound == "exp" and r.time == r.t_exp == exps / 3.9e12
    assert traffic.roofline(flops, 1.0, "A100-40GB", exps=exps).t_exp == 0.0


# ------------------------------------------------------------------------------- tiles and presets


def test_a100_shared_memory_is_163_kb_per_block_164_per_sm():
    for name in ("A100-40GB", "A100-80GB"):
        g = traffic.GPUS[name]
        assert g.smem_per_block == 163 * 1024
        assert "164 KB shared memory per SM and 163 KB per thread block" in g.source
        assert "up to 164 KB shared per block" not in g.source


def test_fitting_blocks_and_tile_choice():
    assert traffic.fitting_blocks(227 * 1024, 64) == (128, 128)
    assert traffic.fitting_blocks(227 * 1024, 256) == (128, 16)
    assert traffic.fitting_blocks(227 * 1024, 256, algorithm="backward") == (16, 64)
    with pytest.raises(traffic.SramCapacityError, match="even 16x16 tiles need"):
        traffic.fitting_blocks(8 * 1024, 256, 4)
    c = traffic.tile_choice(8 * 1024, 256, 4)
    assert (c.block_m, c.block_n, c.fits) == (16, 16, False)
    assert traffic.tile_choice(100 * 1024, 64, block_m=32, block_n=32).rule == "given"
    with pytest.raises(ValueError, match="rule must be one of"):
        traffic.tile_choice(100 * 1024, 64, rule="best")


# ------------------------------------------------------------------------------ widget options


@pytest.mark.parametrize(
    "make, arg, value",
    [
        (widgets.traffic_explorer, "N", 3000),
        (widgets.traffic_explorer, "d", 48),
        (widgets.traffic_explorer, "gpu", "B200"),
        (widgets.traffic_explorer, "block_m", 24),
        (widgets.roofline_plot, "N", 10**7),
        (widgets.roofline_plot, "dtype", "int8"),
    ],
)
def test_widgets_name_a_value_outside_their_options(make, arg, value):
    with pytest.raises(ValueError, match=rf"{arg}={value!r} is not one of the options \["):
        make(**{arg: value})


def test_the_explorer_slider_reaches_a_million_tokens():
    w = widgets.traffic_explorer(N=2**20)
    assert w.state["N"] == 2**20 and w.state["fits"]
    np.testing.assert_equal(w.state["traffic"].writes["O"], 2**20 * 64 * 2)
