"""The traffic widgets, built without a display: controls moved in Python, every number and figure
checked against `flashedu.traffic`."""

from __future__ import annotations

import importlib.util
import math
import re

import numpy as np
import pytest

from flashedu import masks, traffic, viz, widgets

MIB = 2.0**20


def _bars(ax) -> list[float]:
    return [p.get_height() for p in ax.patches]


def _shown_total(html: str) -> int:
    return int(re.search(r"class='fe-total' data-bytes='(\d+)'", html).group(1))


# ----------------------------------------------------------------------------------- explorer state


@pytest.mark.parametrize(
    "N,d,dtype", [(1024, 64, "float16"), (4096, 128, "float32"), (128, 32, "bfloat16")]
)
def test_standard_algorithm_shows_the_naive_closed_form(N, d, dtype):
    s = viz.explorer_state(N=N, d=d, dtype=dtype, algorithm="naive")
    e = viz.ITEMSIZE[dtype]
    assert s["traffic"] == traffic.naive_forward(1, 1, N, N, d, itemsize=e)
    flash = traffic.flash_forward(
        1, 1, N, N, d, block_m=s["block_m"], block_n=s["block_n"], order="fa2", itemsize=e
    )
    assert s["flash"] == flash
    assert s["ratio"] == s["traffic"].total_bytes / flash.total_bytes
    expected = traffic.roofline(
        traffic.attention_flops(1, 1, N, N, d),
        s["traffic"].total_bytes,
        "H200",
        exps=traffic.exp_count(1, 1, N, N),
    )
    assert s["roofline"] == expected and s["roofline"].bound == "memory"
    assert s["exps"] == N * N


@pytest.mark.parametrize("algorithm,order", [("fa1", "fa1"), ("fa2", "fa2")])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_orders_show_the_flash_closed_form(algorithm, order, causal):
    s = viz.explorer_state(
        N=2048, d=64, algorithm=algorithm, block_m=64, block_n=32, causal=causal, B=2, H=3
    )
    assert s["traffic"] == traffic.flash_forward(
        2, 3, 2048, 2048, 64, block_m=64, block_n=32, order=order, causal=causal
    )
    assert s["standard"] == traffic.naive_forward(2, 3, 2048, 2048, 64)
    assert s["flops"] == traffic.attention_flops(2, 3, 2048, 2048, 64, causal=causal)
    exps = traffic.exp_count(2, 3, 2048, 2048, causal=causal)
    assert s["roofline"].time == max(
        s["traffic"].total_bytes / 4.8e12, s["flops"] / 989.4e12, exps / 3.9e12
    )


def test_backward_compares_the_two_backward_passes():
    s = viz.explorer_state(N=1024, d=64, algorithm="backward", causal=True)
    assert s["standard"] == traffic.naive_backward(1, 1, 1024, 1024, 64)
    assert s["traffic"] == traffic.flash_backward(
        1, 1, 1024, 1024, 64, block_m=s["block_m"], block_n=s["block_n"], causal=True
    )
    assert s["flops"] == traffic.attention_flops(1, 1, 1024, 1024, 64, causal=True, pass_="bwd")


def test_paper_rule_gives_the_outer_loop_the_large_block():
    b_r, b_c = traffic.block_sizes(100 * 1024, 64, 2)
    assert b_c > b_r
    for algorithm, expected in [("fa1", (b_r, b_c)), ("backward", (b_r, b_c)), ("fa2", (b_c, b_r))]:
        s = viz.explorer_state(N=4096, d=64, algorithm=algorithm, sram_kib=100, tile_rule="paper")
        assert (s["block_m"], s["block_n"]) == expected, algorithm


@pytest.mark.parametrize("gpu", list(traffic.GPUS))
@pytest.mark.parametrize("d", [32, 64, 128, 256])
@pytest.mark.parametrize("algorithm", ["fa1", "fa2", "backward"])
def test_default_tiles_are_powers_of_two_that_fit(gpu, d, algorithm):
    s = viz.explorer_state(gpu=gpu, d=d, algorithm=algorithm)
    bm, bn = s["block_m"], s["block_n"]
    assert s["fits"] and s["tile_rule"] == "fit", s["tiles"].explain()
    assert all(b in (16, 32, 64, 128) for b in (bm, bn))
    # no larger power of two on the outer loop's side would fit
    outer = (
        dict(block_m=2 * bm, block_n=16) if algorithm == "fa2" else dict(block_m=16, block_n=2 * bn)
    )
    if max(outer.values()) <= 128:
        assert not viz.explorer_state(gpu=gpu, d=d, algorithm=algorithm, **outer)["fits"]


def test_default_tiles_report_both_rules_for_the_chapters():
    t = viz.default_tiles("H200", 64)
    assert (t["fit"].block_m, t["fit"].block_n, t["fit"].fits) == (128, 128, True)
    assert (t["paper"].block_m, t["paper"].block_n, t["paper"].fits) == (454, 64, False)
    assert t["paper"].explain().endswith("303.3 KiB of 227.0 KiB, 34% over: does NOT fit")
    assert "fits" in t["fit"].explain()


def test_sram_tiles_and_fit():
    s = viz.explorer_state(algorithm="fa2", d=64, block_m=128, block_n=64, sram_kib=227)
    assert s["sram_tiles"] == traffic.tile_bytes(128, 64, 64, itemsize=2)
    assert s["fits"] and sum(s["sram_tiles"].values()) <= 227 * 1024
    big = viz.explorer_state(algorithm="fa2", d=256, block_m=256, block_n=256, sram_kib=64)
    assert not big["fits"]
    assert "does NOT fit" in widgets.explorer_details_html(big)
    assert viz.explorer_state(algorithm="naive")["sram_tiles"] == {}
    auto = viz.explorer_state(
        algorithm="fa1", d=64, sram_kib=227, tile_rule="paper"
    )  # the paper's rule overshoots a little
    assert auto["auto_blocks"] and not auto["fits"]
    assert "% over: the paper's rule" in widgets.explorer_details_html(auto)


def test_flash_ratio_grows_with_N():
    ratios = [viz.explorer_state(N=n, algorithm="fa2")["ratio"] for n in (512, 2048, 8192, 32768)]
    assert all(a < b for a, b in zip(ratios, ratios[1:])), ratios


@pytest.mark.parametrize(
    "bad,match", [({"algorithm": "fa3"}, "algorithm"), ({"dtype": "int8"}, "dtype")]
)
def test_bad_choice_names_the_argument(bad, match):
    with pytest.raises(ValueError, match=match):
        viz.explorer_state(**bad)


# ---------------------------------------------------------------------------------- explorer widget


def test_explorer_follows_its_controls():
    w = widgets.traffic_explorer(N=1024, d=64, algorithm="naive")
    assert _shown_total(w.html.value) == traffic.naive_forward(1, 1, 1024, 1024, 64).total_bytes
    w.controls["N"].value = 2048
    expected = traffic.naive_forward(1, 1, 2048, 2048, 64)
    assert w.state["traffic"] == expected
    assert _shown_total(w.html.value) == expected.total_bytes
    assert f"{expected.total_bytes:,} bytes" in w.html.value
    for tensor in ("S", "P"):
        assert (
            "<td style='padding:0 10px;line-height:1.35;text-align:right'>"
            f"{expected.reads[tensor]:,}</td>"
        ) in w.details.value
    w.controls["dtype"].value = "float32"
    assert w.state["traffic"] == traffic.naive_forward(1, 1, 2048, 2048, 64, itemsize=4)
    w.controls["algorithm"].value = "fa1"
    w.controls["block_m"].value, w.controls["block_n"].value = 32, 128
    w.controls["causal"].value = True
    assert w.state["traffic"] == traffic.flash_forward(
        1, 1, 2048, 2048, 64, block_m=32, block_n=128, order="fa1", causal=True, itemsize=4
    )
    assert w.image.value[:4] == b"\x89PNG"


def test_explorer_figure_bars_are_the_traffic_numbers():
    w = widgets.traffic_explorer(N=2048, d=128, algorithm="fa2", block_m=128, block_n=64)
    t = traffic.flash_forward(1, 1, 2048, 2048, 128, block_m=128, block_n=64, order="fa2")
    per_tensor, totals = w.figure.axes
    names = [tick.get_text() for tick in per_tensor.get_xticklabels()]
    assert names == ["Q", "K", "V", "O", "lse"]
    expected = [t.reads.get(n, 0) / MIB for n in names] + [t.writes.get(n, 0) / MIB for n in names]
    np.testing.assert_allclose(_bars(per_tensor), expected)
    standard = traffic.naive_forward(1, 1, 2048, 2048, 128)
    np.testing.assert_allclose(_bars(totals), [standard.total_bytes / MIB, t.total_bytes / MIB])


def test_choosing_a_gpu_sets_its_shared_memory():
    w = widgets.traffic_explorer(gpu="H200")
    assert w.controls["sram_kib"].value == 227
    w.controls["gpu"].value = "A100-80GB"
    assert w.controls["sram_kib"].value == 163  # per thread block (164 KB is the SM's total)
    assert w.state["sram_bytes"] == 163 * 1024
    assert w.state["roofline"].ridge == traffic.GPUS["A100-80GB"].ridge
    assert "NVIDIA A100 SXM4 80GB" in w.html.value


# ----------------------------------------------------------------------------------------- roofline


def test_roofline_points_place_standard_and_flash():
    pts = viz.roofline_points("H100-SXM", N=8192, d=64)
    s = viz.explorer_state(N=8192, d=64, gpu="H100-SXM", algorithm="fa2")
    flops = traffic.attention_flops(1, 1, 8192, 8192, 64)
    exps = traffic.exp_count(1, 1, 8192, 8192)
    assert pts["standard"] == traffic.roofline(
        flops, traffic.naive_forward(1, 1, 8192, 8192, 64).total_bytes, "H100-SXM", exps=exps
    )
    assert pts["flash"] == traffic.roofline(flops, s["flash"].total_bytes, "H100-SXM", exps=exps)
    # With 128 x 128 tiles that fit, the counting model leaves flash just below the ridge (about
    # 2 block_m / itemsize FLOP/B): four times the standard intensity, still memory-bound.
    assert pts["standard"].bound == pts["flash"].bound == "memory"
    assert pts["flash"].intensity > 3.9 * pts["standard"].intensity
    paper = viz.explorer_state(N=8192, d=64, gpu="H100-SXM", tile_rule="paper")["roofline"]
    assert paper.bound == "compute"  # the paper's 454-row tiles would be, if they fitted


def test_roofline_widget_moves_its_points():
    w = widgets.roofline_plot(gpu="H200", N=4096)
    assert "exponentials" in w.html.value  # the H200 preset cites its special-function rate
    ax = w.figure.axes[0]
    dots = [line for line in ax.lines if line.get_marker() == "o"]
    for line, r in zip(dots, w.points.values()):
        assert line.get_xdata()[0] == pytest.approx(r.intensity)
        assert line.get_ydata()[0] == pytest.approx(r.flops / r.time / 1e12)
    w.controls["gpu"].value = "A100-40GB"
    assert w.points == viz.roofline_points("A100-40GB", N=4096)
    assert w.html.value.count("memory-bound") == 2 and "exponentials" not in w.html.value
    w.controls["N"].value = 128
    assert w.points["standard"].flops == traffic.attention_flops(1, 1, 128, 128, 64)


# ------------------------------------------------------------------------------------- tile stepper


def _hand_ledger() -> traffic.Ledger:
    """A 2 x 2 causal tiling as tiled.forward would log it (FA2 order, 4 rows, 2-row blocks,
    d = 1)."""
    led = traffic.Ledger()
    led.read("Q", 8)  # before any step: counted in the first frame
    for i, j, skipped in [(0, 0, False), (0, 1, True), (1, 0, False), (1, 1, False)]:
        m = np.full((1, 1, 2), -np.inf if j == 0 else 0.5)
        led.step(
            i=i,
            j=j,
            skipped=skipped,
            rows=(2 * i, 2 * i + 2),
            cols=(2 * j, 2 * j + 2),
            m=m,
            l=np.full((1, 1, 2), float(j)),
        )
        if not skipped:
            led.read("K", 4)
            led.read("V", 4)
        if j == 1:
            led.write("O", 8)
    return led


def test_stepper_frames_replay_the_ledger():
    led = _hand_ledger()
    frames = viz.stepper_frames(led)
    assert len(frames) == 4
    assert [f["read_bytes"] for f in frames] == [16, 16, 24, 32]
    assert [f["write_bytes"] for f in frames] == [0, 8, 8, 16]
    assert (
        frames[-1]["read_bytes"] == led.read_bytes and frames[-1]["write_bytes"] == led.write_bytes
    )
    assert frames[1]["done"] == {(0, 0)} and frames[3]["done"] == {(0, 0), (1, 0), (1, 1)}
    assert frames[1]["moved"] == [("O", "write", 8)]
    html = widgets.stepper_html(frames[1], frames)
    assert "skipped" in html and "-inf" not in html and "0.500 in all 2 rows" in html
    assert "-inf in all 2 rows (no key seen yet)" in widgets.stepper_html(frames[0], frames)


needs_tiled = pytest.mark.skipif(
    importlib.util.find_spec("flashedu.tiled") is None,
    reason="flashedu.tiled is not in this tree yet",
)


@needs_tiled
@pytest.mark.parametrize("order", ["fa2", "fa1"])
@pytest.mark.parametrize("causal", [False, True])
def test_tile_stepper_replays_tiled_forward(order, causal):
    w = widgets.tile_stepper(N_q=17, N_k=33, d=16, block_m=8, block_n=8, causal=causal, order=order)
    expected = traffic.flash_forward(
        1, 1, 17, 33, 16, block_m=8, block_n=8, order=order, causal=causal, itemsize=4
    )
    last = w.frames[-1]
    assert last["read_bytes"] + last["write_bytes"] == expected.total_bytes
    assert len(w.frames) == math.ceil(17 / 8) * math.ceil(33 / 8)
    skipped = {(f["i"], f["j"]) for f in w.frames if f["skipped"]}
    visible = {
        (i, j)
        for i in range(3)
        for j in masks.kv_blocks(8 * i, min(8 * i + 8, 17), 17, 33, 8, causal=causal)
    }
    assert skipped == {(i, j) for i in range(3) for j in range(5)} - visible
    w.slider.value = w.slider.max
    assert f"data-bytes='{expected.total_bytes}'" in w.html.value


@needs_tiled
def test_tile_stepper_buttons_step_and_stop_at_the_ends():
    w = widgets.tile_stepper(N_q=16, N_k=16, d=16, block_m=8, block_n=8)
    back, fwd = w.children[0].children[1:3]
    back.click()
    assert w.slider.value == 0
    fwd.click()
    fwd.click()
    assert w.slider.value == 2
    frame = w.frames[2]
    assert f"data-bytes='{frame['read_bytes'] + frame['write_bytes']}'" in w.html.value
    assert f"S tile ({frame['i']}, {frame['j']})" in w.html.value


def test_tile_stepper_refuses_too_many_tiles():
    with pytest.raises(ValueError, match="tiles"):
        widgets.tile_stepper(N_q=4096, N_k=4096, block_m=16, block_n=16)


# ------------------------------------------------------------------------- measured kernel runs


def test_measured_explorer_shows_the_package_forward_equal_to_the_model():
    w = widgets.measured_explorer("forward", N_q=48, N_k=40, causal=True)
    model = traffic.combine(
        traffic.flash_forward(1, 2, 48, 40, 32, block_m=16, block_n=16, causal=True),
        traffic.triton_forward_extra(1, 2, 48, 40, 32, block_m=16, block_n=16, causal=True),
    )
    assert w.state["measured"] == model and w.state["differences"] == []
    assert "equal to the model, byte for byte" in w.html.value
    assert len(w.frames) == 3 * 2 and w.state["launches"] == [("_attn_fwd", (3, 2, 1))]
    last = w.frames[-1]
    assert last["read_bytes"] + last["write_bytes"] == model.total_bytes
    bars = [p.get_height() for p in w.figure.axes[0].patches]
    unit = w.figure.axes[0].get_ylabel()
    assert unit == "HBM bytes (KiB)" and max(bars) == pytest.approx(
        max(model.reads.values()) / 1024
    )
    w.slider.value = 3
    frame = w.frames[2]
    assert f"program 3 of {len(w.frames)}" in w.program.value
    assert sum(n for _, dn, n, _ in frame["moved"] if dn == "read") == sum(
        led.read_bytes
        for (_, pid), led in w.measurement.by_launch_program.items()
        if pid == frame["program"]
    )
    assert w.program_image.value[:4] == b"\x89PNG"
    assert "read Q 1,024 B, K 2,048 B (2 loads), V 2,048 B (2 loads); wrote lse 64 B, O" in (
        w.program.value
    )


def test_measured_explorer_replays_the_three_backward_kernels():
    w = widgets.measured_explorer("backward", N_q=33, N_k=20, causal=True)
    assert w.state["differences"] == []
    kernels = {f["kernel"] for f in w.frames}
    assert kernels == {"attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq"}


def test_measured_explorer_tells_a_learners_wasteful_kernel_in_words():
    """A 'kernel' that runs the forward twice moves every tensor twice: the differences say so."""
    import torch

    from flashedu import kernels

    q, k, v = (torch.randn(1, 1, 32, 16) for _ in range(3))
    model = traffic.flash_forward(1, 1, 32, 32, 16, block_m=16, block_n=16, itemsize=4)

    def run():
        for _ in range(2):
            kernels.forward(q, k, v, block_m=16, block_n=16)

    w = widgets.measured_explorer(run, model=model)
    assert {d.tensor for d in w.state["differences"]} == {"Q", "K", "V", "O", "lse"}
    assert "your kernel read Q twice (4,096 B of a 2,048 B tensor); the model reads it once" in (
        w.html.value
    )
    assert widgets.measured_explorer(w.measurement).state["model"] is None
    with pytest.raises(TypeError, match="run must be 'forward', 'backward', a function"):
        widgets.measured_explorer(42)
    with pytest.raises(ValueError, match="kind must be one of"):
        widgets.measured_explorer("sideways")


@pytest.mark.parametrize("causal", [False, True])
def test_tile_stepper_shows_the_triton_kernel_beside_each_tile(causal):
    s = widgets.tile_stepper(
        N_q=40, N_k=33, d=16, block_m=16, block_n=16, causal=causal, measured=True
    )
    assert len(s.measured_steps) == len(s.frames)
    for frame, measured in zip(s.frames, s.measured_steps):
        assert sorted(measured) == sorted(frame["moved"]), frame[
            "step"
        ]  # kernel == model, per tile
    assert s.measurement.traffic() == s.ledger.traffic()
    s.slider.value = s.slider.max
    assert f"data-bytes='{s.ledger.traffic().total_bytes}'" in s.html.value
    assert "measured Triton kernel, this tile" in s.html.value


def test_tile_stepper_measured_needs_fa2_and_real_tiles():
    with pytest.raises(ValueError, match="block_m a power of two >= 16, got 8"):
        widgets.tile_stepper(block_m=8, block_n=16, measured=True)
    with pytest.raises(ValueError, match="replay the FA2 order"):
        widgets.tile_stepper(block_m=16, block_n=16, order="fa1", measured=True)
    with pytest.raises(TypeError, match="measured must be True"):
        widgets.tile_stepper(block_m=16, block_n=16, measured="yes")
