"""hopper.model and hopper.fp8 against plain float64 arithmetic: the exponential budget, the
per-tile costs and the timelines (durations, in-order units, steady-state periods), the Hadamard
rotation (orthogonal, scores unchanged), the block quantiser (nearest e4m3 value, per-block scales),
the emulated low-precision attention, and flashedu.hopper.results' loader and tables."""

import json

import matplotlib
import numpy as np
import pytest
import torch

from flashedu import reference, traffic
from flashedu.hopper import fp8
from flashedu.hopper import model as hopper
from flashedu.hopper import results as hopper_results

matplotlib.use("Agg")

# ------------------------------------------------------------------------------ exponential budget


@pytest.mark.parametrize("d", [64, 128, 256])
def test_budget_ratio_is_matmul_rate_over_4d_sfu_rate(d):
    tm, te = hopper.softmax_budget(2, 16, 8192, d, matmul_tflops=989.0, sfu_tflops=3.9)
    assert tm == pytest.approx(4 * 2 * 16 * 8192**2 * d / 989e12, rel=1e-12)
    assert te == pytest.approx(2 * 16 * 8192**2 / 3.9e12, rel=1e-12)
    assert te / tm == pytest.approx(989.0 / (4 * d * 3.9), rel=1e-12)


def test_fa3_figure_exps_cost_about_half_the_matmul_at_d128():
    tm, te = hopper.softmax_budget(1, 1, 1024, 128)  # the H100 SXM5 defaults: 989.4 and 3.9
    assert hopper.MATMUL_TFLOPS == pytest.approx(989.4) and hopper.SFU_TFLOPS == pytest.approx(3.9)
    assert 0.49 < te / tm < 0.50
    tm64, te64 = hopper.softmax_budget(1, 1, 1024, 64)
    assert 0.98 < te64 / tm64 < 1.0


def test_causal_keeps_exactly_the_visible_scores_and_the_ratio():
    N = 777
    full = hopper.softmax_budget(3, 5, N, 96)
    causal = hopper.softmax_budget(3, 5, N, 96, causal=True)
    visible = N * (N + 1) / 2 / N**2  # the diagonal stays: more than half the square
    assert causal[0] == pytest.approx(full[0] * visible, rel=1e-12)
    assert causal[1] == pytest.approx(full[1] * visible, rel=1e-12)
    assert causal[1] / causal[0] == pytest.approx(full[1] / full[0], rel=1e-12)


def test_the_exp_rate_comes_from_the_preset():
    assert hopper.SFU_TFLOPS == traffic.GPUS["H100-SXM"].sfu_flops / 1e12


@pytest.mark.parametrize(
    "kw,words",
    [
        (dict(B=0), "B must be an int >= 1"),
        (dict(d=64.0), "d must be an int"),
        (dict(causal="yes"), "causal must be a bool"),
        (dict(sfu_tflops=0), "sfu_tflops must be"),
        (dict(matmul_tflops=float("inf")), "matmul_tflops must be"),
    ],
)
def test_budget_rejects_bad_arguments_by_name(kw, words):
    args = dict(B=1, H=1, N=16, d=64) | kw
    with pytest.raises((ValueError, TypeError), match=words):
        hopper.softmax_budget(args.pop("B"), args.pop("H"), args.pop("N"), args.pop("d"), **args)


# --------------------------------------------------------------------------- tile costs, timelines


def test_tile_costs_divide_gpu_rates_by_the_sms():
    c = hopper.tile_costs(
        128, 64, 128, matmul_tflops=1000, sfu_tflops=4, load_bytes_per_s=5e10, sms=100, itemsize=2
    )
    assert c.qk == c.pv == pytest.approx(2 * 128 * 64 * 128 / 1e13)
    assert c.exp == pytest.approx(128 * 64 / 4e10)
    assert c.load == pytest.approx(2 * 64 * 128 * 2 / 5e10)
    with pytest.raises(ValueError, match="block_n must be an int >= 1"):
        hopper.tile_costs(64, 0, 64)


COSTS = [
    hopper.TileCosts(load=0.1, qk=1.0, exp=0.5, pv=1.0),  # loads hidden, exp < pv
    hopper.TileCosts(load=0.2, qk=0.5, exp=1.3, pv=0.5),  # softmax-bound
    hopper.TileCosts(load=6.0, qk=1.0, exp=0.7, pv=1.0),  # load-bound
    hopper.tile_costs(128, 128, 128),
    hopper.tile_costs(128, 128, 64),
]


@pytest.mark.parametrize("schedule", hopper.SCHEDULES)
@pytest.mark.parametrize("c", COSTS)
def test_every_task_takes_its_cost_and_units_never_overlap(schedule, c):
    tl = hopper.timeline(c, 7, schedule)
    want = {"K": c.load / 2, "V": c.load / 2, "QK^T": c.qk, "exp": c.exp, "PV": c.pv}
    wgs = 2 if schedule == "pingpong" else 1
    for t in tl.tasks:
        assert t.end - t.start == pytest.approx(want[t.name.split()[0]], rel=1e-12)
    for unit in hopper.UNITS:
        spans = sorted((t.start, t.end) for t in tl.tasks if t.unit == unit)
        assert all(a[1] <= b[0] + 1e-15 for a, b in zip(spans, spans[1:])), unit
    assert tl.busy("tensor cores") == pytest.approx(7 * wgs * (c.qk + c.pv))
    assert tl.busy("SFU") == pytest.approx(7 * wgs * c.exp)
    assert tl.busy("TMA") == pytest.approx(7 * c.load)
    assert tl.total >= max(tl.busy(u) for u in hopper.UNITS)
    assert tl.tiles == 7 * wgs and tl.per_tile == pytest.approx(tl.total / tl.tiles)
    assert 0 < tl.tensor_core_utilisation <= 1


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("schedule", ["producer_consumer", "pingpong", "intra_warpgroup"])
@pytest.mark.parametrize("c", COSTS)
def test_the_producer_refills_a_buffer_only_after_every_consumer_released_it(schedule, stages, c):
    tl = hopper.timeline(c, 9, schedule, stages=stages)
    at = {t.name: t for t in tl.tasks}
    wgs = ["a", "b"] if schedule == "pingpong" else [""]
    for j in range(stages, 9):
        assert at[f"K {j}"].start >= max(at[f"QK^T {j - stages}{w}"].end for w in wgs) - 1e-15
        assert at[f"V {j}"].start >= max(at[f"PV {j - stages}{w}"].end for w in wgs) - 1e-15
    for j in range(9):  # and a consumer never reads a tile before it has landed
        assert all(at[f"QK^T {j}{w}"].start >= at[f"K {j}"].end - 1e-15 for w in wgs)
        assert all(at[f"PV {j}{w}"].start >= at[f"V {j}"].end - 1e-15 for w in wgs)


@pytest.mark.parametrize("c", COSTS)
def test_serial_schedule_is_the_plain_sum(c):
    assert hopper.timeline(c, 9, "serial").total == pytest.approx(
        9 * (c.load + c.qk + c.exp + c.pv)
    )


def _period(c, schedule):
    """Steady-state seconds per K/V tile, from the schedule's resource and dependency cycles."""
    compute = c.qk + c.exp + c.pv
    if schedule == "producer_consumer":
        return max(c.load, compute)
    if schedule == "pingpong":  # per K/V tile both warpgroups run; each chain is qk + exp + pv
        return max(c.load, 2 * (c.qk + c.pv), 2 * c.exp, compute)
    return max(c.load, c.qk + max(c.exp, c.pv), c.exp)  # intra_warpgroup


@pytest.mark.parametrize("schedule", ["producer_consumer", "pingpong", "intra_warpgroup"])
@pytest.mark.parametrize("c", COSTS)
def test_steady_state_period_matches_the_closed_form(schedule, c):
    t20 = hopper.timeline(c, 20, schedule).total
    t40 = hopper.timeline(c, 40, schedule).total
    assert (t40 - t20) / 20 == pytest.approx(_period(c, schedule), rel=1e-9)


def test_overlap_hides_the_softmax_when_it_fits_under_the_matmuls():
    c = hopper.tile_costs(128, 128, 128, load_bytes_per_s=1e15)  # loads free: isolate the softmax
    util = {s: hopper.timeline(c, 64, s).tensor_core_utilisation for s in hopper.SCHEDULES}
    assert util["serial"] == pytest.approx((c.qk + c.pv) / (c.qk + c.exp + c.pv), rel=1e-3)
    assert util["pingpong"] > 0.99 and util["intra_warpgroup"] > 0.97
    assert util["producer_consumer"] < 0.7


@pytest.mark.parametrize(
    "kw,words",
    [
        (dict(schedule="fa3"), "schedule must be one of"),
        (dict(n_tiles=0), "n_tiles must be"),
        (dict(schedule="pingpong", stages=1), "stages must be an int >= 2"),
    ],
)
def test_timeline_rejects_bad_arguments(kw, words):
    with pytest.raises(ValueError, match=words):
        hopper.timeline(COSTS[0], **({"n_tiles": 4} | kw))
    with pytest.raises(ValueError, match="unit must be one of"):
        hopper.timeline(COSTS[0], 2).busy("ALU")


def test_plot_timeline_draws_one_bar_per_task():
    tl = hopper.timeline(COSTS[0], 5, "pingpong")
    ax = hopper.plot_timeline(tl)
    assert len(ax.patches) == len(tl.tasks)
    assert "pingpong" in ax.get_title()


# ------------------------------------------------------------------------------------ results file


def _row(kernel, tflops, dtype="bf16"):
    setting = dict(causal=False, B=2, H=16, N=8192, d=128)
    return dict(kernel=kernel, dtype=dtype, **setting, ms=1.0, tflops=tflops, **{"pass": "fwd"})


def _step(name, fwd, fwd_bwd=None):
    times = dict(fwd_tflops=fwd, fwd_bwd_tflops=fwd_bwd, causal_fwd_tflops=None)
    return dict(name=name, change="-", expected="+5%", **times, note="as expected")


RESULT = {
    "date": "2026-01-01 00:00 UTC",
    "gpu": "NVIDIA H200",
    "matmul_tflops": {"bf16": 700.0, "fp8": None},
    "rows": [
        _row("hopper", 550.0),
        _row("sdpa_cudnn", 600.0),
        _row("hopper_fp8", 800.0, "fp8e4m3"),
    ],
    "steps": [_step("fa2", 490.0), _step("tma", 520.0, 410.0)],
    "fp8": [],
    "correctness": {"rows": 3, "passed": 3, "details": "-"},
}


def test_results_loader_reads_the_schema_and_refuses_other_files(tmp_path):
    assert hopper_results.load_results(tmp_path / "absent.json") is None
    path = tmp_path / "h200_hopper.json"
    path.write_text(json.dumps(RESULT))
    got = hopper_results.load_results(path)
    assert got["steps"][1]["fwd_tflops"] == 520.0
    table = hopper_results.steps_table(got)
    assert "tma" in table and "520" in table and "410" in table and "-" in table
    rows = hopper_results.rows_table(got).splitlines()
    assert rows[0].split() == ["setting", "hopper", "hopper8", "cudnn", "vs", "cudnn", "vs", "mm"]
    assert (
        rows[1].split() == "bf16 d=128 N=8192 fwd 550 - 600 0.92 0.79".split()
    )  # 550/600, 550/700
    assert rows[2].split() == "fp8e4m3 d=128 N=8192 fwd - 800 - - 1.14".split()  # no fp8 cuDNN row
    assert max(len(line) for line in rows) <= 100
    ax = hopper_results.plot_steps(got, cudnn=665.0)
    assert len(ax.patches) == 2 and len(ax.lines) == 2
    path.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="lacks steps, matmul_tflops"):
        hopper_results.load_results(path)


# ------------------------------------------------------------------------------- Hadamard rotation


@pytest.mark.parametrize("d", [1, 2, 4, 16, 64, 128, 256])
def test_hadamard_is_orthogonal_with_entries_plus_minus_one_over_sqrt_d(d):
    h = fp8.hadamard(d)
    np.testing.assert_allclose(h @ h.T, np.eye(d), atol=1e-14)
    np.testing.assert_allclose(np.abs(h), np.full((d, d), d**-0.5), rtol=1e-15)
    m = fp8.random_hadamard(d, seed=3)
    np.testing.assert_allclose(m @ m.T, np.eye(d), atol=1e-14)


@pytest.mark.parametrize("d", [0, 3, 96, 2.0])
def test_hadamard_needs_a_power_of_two(d):
    with pytest.raises(ValueError, match="power of two"):
        fp8.hadamard(d)


def test_random_signs_depend_on_the_seed_only():
    assert np.array_equal(fp8.random_hadamard(64, 1), fp8.random_hadamard(64, 1))
    assert not np.array_equal(fp8.random_hadamard(64, 1), fp8.random_hadamard(64, 2))


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_rotation_leaves_the_scores_unchanged_in_float64(kind):
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 3, 17, 64)), rng.standard_normal((2, 3, 40, 64))
    if kind == "torch":
        q, k = torch.from_numpy(q), torch.from_numpy(k)
    qr, kr = fp8.rotate(q, k, seed=5)
    assert type(qr) is type(q) and qr.shape == q.shape and kr.shape == k.shape
    s, sr = (np.asarray(a @ b.swapaxes(-1, -2)) for a, b in ((q, k), (qr, kr)))
    np.testing.assert_allclose(sr, s, atol=1e-12 * np.abs(s).max())
    with pytest.raises(ValueError, match="same head dim"):
        fp8.rotate(q[..., :32], k, seed=0)


def test_rotation_spreads_an_outlier_channel():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((32, 128))
    q[:, 7] *= 100
    qr, _ = fp8.rotate(q, q, seed=0)
    assert fp8.crest(q) > 15 and fp8.crest(qr) < 5
    np.testing.assert_allclose(np.linalg.norm(qr, axis=1), np.linalg.norm(q, axis=1), rtol=1e-13)


# --------------------------------------------------------------------------------- block quantiser

E4M3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
E4M3 = E4M3[torch.isfinite(E4M3)].unique()  # every finite e4m3 value


def _nearest_distance(y: torch.Tensor) -> torch.Tensor:
    """Distance from each element of y to the nearest finite e4m3 value, in float64."""
    return (y.double().reshape(-1, 1) - E4M3[None]).abs().min(1).values.reshape(y.shape)


@pytest.mark.parametrize("N,block", [(64, 64), (100, 32), (7, 16), (129, 64)])
def test_quantize_rounds_to_the_nearest_e4m3_value_with_per_block_scales(N, block):
    g = torch.Generator().manual_seed(N)
    x = torch.randn(N, 48, generator=g) * torch.logspace(-3, 3, N)[:, None]
    codes, scales = fp8.quantize(x, block)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (-(-N // block),)
    x64 = x.double()
    for i, s in enumerate(scales.double()):
        rows = x64[i * block : (i + 1) * block]
        assert s.item() == pytest.approx(rows.abs().max().item() / 448, rel=1e-6)
        y = x[i * block : (i + 1) * block] / scales[i]  # what was rounded, float32
        got = codes[i * block : (i + 1) * block].double()
        assert torch.all((y.double() - got).abs() <= _nearest_distance(y) + 1e-12)
        assert got.abs().max().item() == 448.0  # the block's max lands on 448
    deq = fp8.dequantize(codes, scales, block)
    rows = scales.repeat_interleave(block)[:N, None]
    assert torch.all((deq - x).abs() <= torch.maximum(x.abs() * 2**-4, rows * 2**-10) * (1 + 1e-6))


def test_quantize_gives_a_zero_block_scale_one_and_keeps_leading_dims():
    x = torch.randn(2, 3, 40, 16)
    x[1, 2, 16:32] = 0
    codes, scales = fp8.quantize(x, 16)
    assert scales.shape == (2, 3, 3) and scales[1, 2, 1] == 1.0
    assert torch.all(codes[1, 2, 16:32].float() == 0)
    for b in range(2):
        for h in range(3):
            c2, s2 = fp8.quantize(x[b, h], 16)
            assert torch.equal(s2, scales[b, h]) and torch.equal(c2.float(), codes[b, h].float())


def test_quantize_rejects_bad_input_by_name():
    with pytest.raises(ValueError, match="block must be a positive int"):
        fp8.quantize(torch.randn(4, 4), 0)
    with pytest.raises(TypeError, match="x must be a floating-point torch tensor"):
        fp8.quantize(np.ones((4, 4)), 2)


# ------------------------------------------------------------------------------ emulated attention


def test_emulated_forward_error_grows_as_precision_drops():
    q, k, v = fp8.outlier_qkv(1, 2, 96, 64, outliers=False, seed=0)
    o_ref, _ = reference.forward(q, k, v)
    err = {
        f: fp8.rmse(fp8.emulated_forward(q, k, v, fmt=f), o_ref) for f in ("fp16", "bf16", "e4m3")
    }
    assert err["fp16"] < err["bf16"] < err["e4m3"] < 1e-2
    assert err["fp16"] < 1e-4


def test_rotation_and_block_scales_cut_the_fp8_error_on_outliers():
    q, k, v = fp8.outlier_qkv(1, 2, 256, 128, seed=1)
    o_ref, _ = reference.forward(q, k, v)
    base = fp8.rmse(fp8.emulated_forward(q, k, v, scaling="tensor"), o_ref)
    fa3 = fp8.rmse(fp8.emulated_forward(q, k, v, scaling="block", rotation=True), o_ref)
    assert fa3 < 0.8 * base


def test_emulated_forward_causal_and_fully_masked_rows():
    q, k, v = fp8.outlier_qkv(1, 1, 40, 64, outliers=False, seed=2)
    o = fp8.emulated_forward(q, k[:, :, :25], v[:, :, :25], causal=True, fmt="bf16")
    o_ref, _ = reference.forward(q, k[:, :, :25], v[:, :, :25], causal=True)
    assert o.shape == (1, 1, 40, 64) and o.dtype == torch.float32
    assert torch.all(o[:, :, :15] == 0) and np.all(o_ref[:, :, :15] == 0)
    assert fp8.rmse(o, o_ref) < 5e-3


@pytest.mark.parametrize(
    "kw,words", [(dict(fmt="int8"), "fmt must be one of"), (dict(scaling="row"), "scaling must be")]
)
def test_emulated_forward_rejects_bad_options(kw, words):
    q = torch.randn(1, 1, 4, 16)
    with pytest.raises(ValueError, match=words):
        fp8.emulated_forward(q, q, q, **kw)


def test_rmse_crest_and_outlier_inputs():
    assert fp8.rmse(np.array([3.0, 4.0]), np.zeros(2)) == pytest.approx(np.sqrt(12.5))
    with pytest.raises(ValueError, match="shapes differ"):
        fp8.rmse(np.zeros(3), np.zeros(4))
    spike = np.zeros(100)
    spike[3] = 1
    assert fp8.crest(spike) == pytest.approx(10.0)
    a = fp8.outlier_qkv(2, 2, 512, 64, seed=4)
    b = fp8.outlier_qkv(2, 2, 512, 64, seed=4)
    plain = fp8.outlier_qkv(2, 2, 512, 64, outliers=False, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert (
        1.05 < a[0].var().item() < 1.15 and 0.95 < plain[0].var().item() < 1.05
    )  # 1 + 0.001 * 100


def test_the_committed_hopper_results_are_found_from_the_package():
    assert hopper_results.RESULTS.exists(), hopper_results.RESULTS
    assert hopper_results.load_results()["rows"]
