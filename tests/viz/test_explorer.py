"""The chapter figures and tables that live in the package (viz.tflops_panels, viz.cpu_table,
viz.show_block_map) and the measured-run replay behind the measured widgets
(flashedu.traffic.replay)."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.figure import Figure

from flashedu import masks, traffic, viz
from flashedu.traffic import replay

TIMING = [
    dict(impl=impl, dtype="fp16", d=d, N=N, causal=causal, tflops=tf, **{"pass": p})
    for impl, tf in (("a", 100.0), ("b", 200.0))
    for d in (64, 128)
    for N in (1024, 4096)
    for causal in (False, True)
    for p in ("fwd", "fwd_bwd")
] + [dict(impl="a", dtype="bf16", d=64, N=1024, causal=False, tflops=1.0, **{"pass": "fwd"})]


def test_tflops_panels_draw_one_line_per_implementation_and_mask():
    fig = viz.tflops_panels(TIMING, "fp16", gpu="H100")
    assert isinstance(fig, Figure) and repr(fig) == "<Figure size 1000x640 with 4 Axes>"
    assert [ax.get_title() for ax in fig.axes] == [
        "fwd, d=64",
        "fwd, d=128",
        "fwd_bwd, d=64",
        "fwd_bwd, d=128",
    ]
    for ax in fig.axes:
        assert len(ax.lines) == 4  # 2 implementations x (causal, not)
        assert ax.get_xscale() == "log"
    line = fig.axes[0].lines[0]
    assert list(line.get_xdata()) == [1024, 4096] and list(line.get_ydata()) == [100.0, 100.0]
    assert fig._suptitle.get_text() == "H100, fp16: measured"
    assert len(viz.tflops_panels(TIMING, "bf16").axes) == 2
    with pytest.raises(ValueError, match="no timing rows with dtype='fp8'"):
        viz.tflops_panels(TIMING, "fp8")


def test_cpu_table_lists_each_n_with_ratio_and_peaks():
    rows = [
        dict(impl=i, N=N, ms=ms, peak_bytes=pk, **{"pass": "fwd"})
        for i, N, ms, pk in (
            ("naive", 512, 2.0, 3 * 2**20),
            ("tiled", 512, 1.0, 2**10),
            ("tiled", 1024, 4.0, 2**11),
        )
    ] + [dict(impl="naive", N=512, ms=9.0, peak_bytes=1, **{"pass": "fwd_bwd"})]
    skipped = [dict(impl="naive", N=1024, reason="over budget", **{"pass": "fwd"})]
    text = viz.cpu_table({"timing": rows, "skipped": skipped}).split("\n")
    assert text[0] == f"{'N':>6}{'naive ms':>15}{'tiled ms':>15}{'tiled/naive':>13}" + (
        f"{'naive peak':>13}{'tiled peak':>13}"
    )
    assert text[1] == f"{512:>6}{2.0:>15.1f}{1.0:>15.1f}{0.5:>13.2f}{'3 MiB':>13}{'1 KiB':>13}"
    assert text[2].startswith(f"{1024:>6}{'skipped':>15}{4.0:>15.1f}{'-':>13}{'-':>13}")
    assert text[3] == "skipped: naive at N=1024 (fwd): over budget"


@pytest.mark.parametrize(
    "mask", [dict(causal=True), dict(window_size=(48, 0)), dict(causal=False, window_size=(8, 8))]
)
def test_show_block_map_draws_the_block_rules(mask):
    fig = Figure()
    ax = fig.subplots()
    kinds = viz.show_block_map(ax, 96, 80, 16, 16, **mask)
    np.testing.assert_array_equal(kinds, masks.block_map(96, 80, 16, 16, **mask))
    shown = np.asarray(ax.images[0].get_array())
    np.testing.assert_array_equal(shown, np.vectorize(viz.KIND_CODE.get)(kinds))
    label = ", ".join(f"{k}={v}" for k, v in mask.items())
    computed = int((kinds != "skip").sum())
    assert ax.get_title() == f"{label}\n{computed} of {kinds.size} tiles computed"
    with pytest.raises(TypeError, match="mask takes causal= and window_size="):
        viz.show_block_map(ax, 8, 8, 4, 4, window=(1, 1))


# --------------------------------------------------------------------------- measured-run replay


def test_program_frames_add_up_to_the_measurement():
    m, model = replay.package_run("forward", N_q=40, N_k=24, causal=True)
    assert m.traffic() == model
    frames = replay.program_frames(m)
    assert len(frames) == len(m.ledger.steps) == 3 * 2
    assert frames[-1]["read_bytes"] == m.traffic().read_bytes
    assert frames[-1]["write_bytes"] == m.traffic().write_bytes
    fig = replay.draw_program(frames[0], m)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["Q", "K", "V", "O", "lse"]


def test_spans_cover_a_regions_elements_row_major():
    # rows 2..3 of a (1, 2, 4, 3) tensor, head 1, all columns: elements 12 + 6..12
    assert replay._spans(((0, 1), (1, 2), (2, 4), (0, 3)), (1, 2, 4, 3)) == [(18, 24)]
    assert replay._spans(((0, 2), (1, 3)), (2, 4)) == [(1, 3), (5, 7)]


def test_measured_state_without_a_model_and_with_a_wrong_one():
    m, model = replay.package_run("forward", N_q=32, N_k=32)
    alone = replay.measured_state(m)
    assert alone["model"] is None and alone["differences"] == []
    half = traffic.Traffic({k: v // 2 for k, v in model.reads.items()}, model.writes)
    wrong = replay.measured_state(m, half, axis_names=("query block",))
    assert {d.tensor for d in wrong["differences"]} == {"Q", "K", "V"}
    fig = replay.draw_measured(wrong)
    assert "3 differences from the model" in fig.axes[0].get_title()
    with pytest.raises(TypeError, match="must be a traffic.Measurement"):
        replay.measured_state(model)
