"""Interactive views of HBM/SRAM traffic: thin ipywidgets front-ends over `flashedu.viz`.

* `traffic_explorer(**initial)`: sliders for N, d, dtype, block sizes, SRAM size, GPU preset and
  algorithm; shows bytes read and written per tensor, the SRAM tiles, the standard/flash ratio and
  the roofline bound.
* `roofline_plot(gpu="H200", ...)`: standard and flash attention placed on a preset's roofline.
* `tile_stepper(N_q=..., N_k=..., ...)`: play/step through the ledger that `tiled.forward` fills:
  which Q and K/V blocks sit in SRAM, which S tile is computed or skipped, the running m and l,
  bytes so far; with `measured=True` (or your launcher) also what a Triton kernel's program really
  moved for each tile.
* `measured_explorer(run)`: a Triton kernel's measured bytes per tensor beside the closed form,
  and its programs one by one (`flashedu.measured_widgets`).

Every number shown comes from a pure function in `flashedu.viz` (which reads `flashedu.traffic`),
and each widget keeps its last result in `.state` (or `.frames`) and its last figure in `.figure`,
so tests move the controls and check the numbers without a browser. Figures are PNG images
(no ipympl needed); nothing here runs in JavaScript beyond what ipywidgets ships.

Introduced in notebooks/00_memory_hierarchy.ipynb; the tile stepper in
notebooks/03_tiled_forward.ipynb.
"""

from __future__ import annotations

import math

import ipywidgets as W
import numpy as np

from . import replay, traffic, viz
from ._validate import check_causal, check_int, check_order
from .measured_widgets import MeasuredExplorer, measured_explorer  # noqa: F401  (re-exported)
from .nb import fmt_bytes

_WIDE = {"description_width": "110px"}
_N_OPTIONS = [(f"{2**k:,}", 2**k) for k in range(7, 21)]  # 128 ... 1,048,576 tokens
_D_OPTIONS = [32, 64, 128, 256]
_ALGORITHMS = [
    ("standard", "naive"),
    ("FA1 order", "fa1"),
    ("FA2 order", "fa2"),
    ("backward", "backward"),
]
_BLOCKS = [("auto (tile rule)", 0)] + [(str(b), b) for b in (16, 32, 64, 128, 256)]
_TILE_RULES = [("powers of two that fit", "fit"), ("paper's rule (may overflow)", "paper")]


def _option(widget: str, arg: str, value, options) -> None:
    """A ValueError naming the argument, the value and the control's options, instead of the
    TraitError a control would raise."""
    values = [o[1] if isinstance(o, tuple) else o for o in options]
    if value not in values:
        hint = " (viz.explorer_state takes any N)" if arg == "N" else ""
        raise ValueError(f"{widget}: {arg}={value!r} is not one of the options {values}{hint}")


def _row(*cells, tag="td") -> str:
    return (
        "<tr>"
        + "".join(
            f"<{tag} style='padding:0 10px;line-height:1.35;text-align:"
            f"{'left' if i == 0 else 'right'}'>{c}</{tag}>"
            for i, c in enumerate(cells)
        )
        + "</tr>"
    )


def explorer_html(state: dict) -> str:
    """The explorer's headline: total HBM bytes, the standard/flash ratio and the roofline
    verdict."""
    t, r, g = state["traffic"], state["roofline"], traffic.GPUS[state["gpu"]]
    why = {
        "memory": "bytes set the time: each byte brings too little arithmetic to keep the tensor "
        "cores busy",
        "compute": "arithmetic sets the time: each byte fetched feeds enough FLOPs",
        "exp": "the exponentials set the time: the special-function units "
        f"({g.sfu_tflops or 0:.1f} T exp/s) are slower than the matmuls they feed",
    }[r.bound]
    return (
        "<div class='fe-explorer' style='line-height:1.5'>"
        "<div style='font-size:1.15em'>HBM traffic: "
        f"<b class='fe-total' data-bytes='{t.total_bytes}'>{t.total_bytes:,} bytes</b> "
        f"({fmt_bytes(t.total_bytes)})"
        f" &nbsp;·&nbsp; standard / flash = <b class='fe-ratio'>{state['ratio']:.1f}x</b></div>"
        f"<div>Roofline on {g.name}: <b class='fe-bound'>{r.bound}-bound</b>, at least "
        f"<b class='fe-time'>{viz.fmt_time(r.time)}</b>. Intensity {r.intensity:.1f} FLOP/byte "
        f"{'below' if r.intensity < r.ridge else 'above'} the ridge {r.ridge:.0f}: {why}.</div>"
        f"<div class='fe-exp'>{_exp_line(state)}</div></div>"
    )


def _exp_line(state: dict) -> str:
    r, g = state["roofline"], traffic.GPUS[state["gpu"]]
    if g.sfu_flops is None:
        return f"Exponentials: {state['exps']:,.0f} (no special-function rate cited for {g.name})."
    return (
        f"Exponentials: {state['exps']:,.0f} on the special-function units at "
        f"{g.sfu_tflops:.1f} T/s take {viz.fmt_time(r.t_exp)}, beside "
        f"{viz.fmt_time(r.t_compute)} of matmuls (FA3, arXiv:2407.08608, Sec. 3.2)."
    )


def explorer_details_html(state: dict) -> str:
    """The explorer's detail: bytes per tensor and direction, and the tiles one thread block keeps
    in SRAM."""
    t = state["traffic"]
    names = sorted(set(t.reads) | set(t.writes), key=traffic.tensor_order)
    rows = [_row("tensor", "read: HBM → SRAM", "written: SRAM → HBM", tag="th")]
    rows += [_row(n, f"{t.reads.get(n, 0):,}", f"{t.writes.get(n, 0):,}") for n in names]
    rows.append(_row("<b>total</b>", f"<b>{t.read_bytes:,}</b>", f"<b>{t.write_bytes:,}</b>"))
    tiles = state["sram_tiles"]
    if tiles:
        used = sum(tiles.values())
        if state["fits"]:
            verdict = "fits"
        elif state["auto_blocks"] and state["tile_rule"] == "paper":
            verdict = (
                f"{used / state['sram_bytes'] - 1:.0%} over: "
                "the paper's rule sizes tiles to the order of the "
                "SRAM, not under it; 'powers of two that fit' picks tiles a kernel can use"
            )
        else:
            verdict = "<b style='color:#c44e52'>does NOT fit: smaller blocks needed</b>"
        sram = (
            "<b>SRAM, one thread block</b> "
            f"(block_m={state['block_m']}, block_n={state['block_n']}): "
            + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in tiles.items())
            + f"; {fmt_bytes(used)} of {fmt_bytes(state['sram_bytes'])}, {verdict}. "
            + f"Tile rule: {viz.TILE_RULES[state['tile_rule']]}."
        )
    else:
        sram = (
            "<b>SRAM</b>: standard attention streams rows through it; "
            "S and P go back to HBM in full."
        )
    return (
        f"<div style='line-height:1.35'><table class='fe-table'>{''.join(rows)}</table>"
        f"<div style='margin-top:4px'>{sram}</div></div>"
    )


class TrafficExplorer(W.VBox):
    """See `traffic_explorer`. `.controls` (name -> widget), `.state`, `.figure` follow the
    controls."""

    def __init__(
        self,
        *,
        N=4096,
        d=64,
        dtype="float16",
        gpu="H200",
        algorithm="fa2",
        block_m=None,
        block_n=None,
        sram_kib=None,
        causal=False,
        B=1,
        H=1,
        tile_rule="fit",
    ):
        name = "traffic_explorer"
        for arg, value, options in (
            ("N", N, _N_OPTIONS),
            ("d", d, _D_OPTIONS),
            ("dtype", dtype, list(viz.ITEMSIZE)),
            ("gpu", gpu, list(traffic.GPUS)),
            ("algorithm", algorithm, _ALGORITHMS),
            ("block_m", block_m or 0, _BLOCKS),
            ("block_n", block_n or 0, _BLOCKS),
            ("tile_rule", tile_rule, _TILE_RULES),
        ):
            _option(name, arg, value, options)
        self._bh = (B, H)
        if sram_kib is not None:  # the slider would clamp (or round) it without a word
            check_int(sram_kib, "sram_kib", name=name, low=16, high=256)
        sram_kib = sram_kib or traffic.GPUS[gpu].smem_per_block // 1024
        c = {
            "N": W.SelectionSlider(
                options=_N_OPTIONS,
                value=N,
                description="N (tokens)",
                style=_WIDE,
                layout=W.Layout(width="330px"),
            ),
            "d": W.Dropdown(options=_D_OPTIONS, value=d, description="d (head dim)", style=_WIDE),
            "dtype": W.Dropdown(
                options=list(viz.ITEMSIZE), value=dtype, description="dtype", style=_WIDE
            ),
            "gpu": W.Dropdown(
                options=list(traffic.GPUS), value=gpu, description="GPU", style=_WIDE
            ),
            "tile_rule": W.Dropdown(
                options=_TILE_RULES, value=tile_rule, description="tiles", style=_WIDE
            ),
            "sram_kib": W.IntSlider(
                min=16, max=256, value=int(sram_kib), description="SRAM (KiB)", style=_WIDE
            ),
            "block_m": W.Dropdown(
                options=_BLOCKS, value=block_m or 0, description="block_m (B_r)", style=_WIDE
            ),
            "block_n": W.Dropdown(
                options=_BLOCKS, value=block_n or 0, description="block_n (B_c)", style=_WIDE
            ),
            "causal": W.Checkbox(value=causal, description="causal", style=_WIDE),
            "algorithm": W.ToggleButtons(
                options=_ALGORITHMS, value=algorithm, style={"button_width": "100px"}
            ),
        }
        self.controls = c
        self.html, self.details = W.HTML(), W.HTML()
        self.image = W.Image(format="png", layout=W.Layout(max_width="840px"))
        left = W.VBox([c["N"], c["d"], c["dtype"], c["causal"]])
        right = W.VBox([c["gpu"], c["sram_kib"], c["tile_rule"], c["block_m"], c["block_n"]])
        top = W.HBox([W.Label("algorithm", layout=W.Layout(width="114px")), c["algorithm"]])
        super().__init__([top, W.HBox([left, right]), self.html, self.image, self.details])
        c["gpu"].observe(self._preset, names="value")
        for w in c.values():
            w.observe(self._update, names="value")
        self._update()

    def params(self) -> dict:
        p = {k: w.value for k, w in self.controls.items()}
        p["block_m"], p["block_n"] = p["block_m"] or None, p["block_n"] or None
        return dict(p, B=self._bh[0], H=self._bh[1])

    def _preset(self, change) -> None:
        self.controls["sram_kib"].value = traffic.GPUS[change["new"]].smem_per_block // 1024

    def _update(self, change=None) -> None:
        self.state = viz.explorer_state(**self.params())
        self.figure = viz.draw_traffic(self.state)
        self.image.value = viz.png(self.figure)
        self.html.value = explorer_html(self.state)
        self.details.value = explorer_details_html(self.state)


def traffic_explorer(**initial) -> TrafficExplorer:
    """Explore HBM traffic of standard and flash attention (initial values: see
    `viz.explorer_state`)."""
    return TrafficExplorer(**initial)


class RooflinePlot(W.VBox):
    """See `roofline_plot`. `.controls`, `.points` (name -> traffic.Roofline) and `.figure` follow
    the controls."""

    def __init__(self, *, gpu="H200", N=4096, d=64, dtype="float16", causal=False):
        for arg, value, options in (
            ("gpu", gpu, list(traffic.GPUS)),
            ("N", N, _N_OPTIONS),
            ("d", d, _D_OPTIONS),
            ("dtype", dtype, list(viz.ITEMSIZE)),
        ):
            _option("roofline_plot", arg, value, options)
        c = {
            "gpu": W.Dropdown(
                options=list(traffic.GPUS), value=gpu, description="GPU", style=_WIDE
            ),
            "N": W.SelectionSlider(
                options=_N_OPTIONS, value=N, description="N (tokens)", style=_WIDE
            ),
            "d": W.Dropdown(options=_D_OPTIONS, value=d, description="d (head dim)", style=_WIDE),
            "dtype": W.Dropdown(
                options=list(viz.ITEMSIZE), value=dtype, description="dtype", style=_WIDE
            ),
            "causal": W.Checkbox(value=causal, description="causal", style=_WIDE),
        }
        self.controls, self.html, self.image = (
            c,
            W.HTML(),
            W.Image(format="png", layout=W.Layout(max_width="640px")),
        )
        super().__init__(
            [
                W.HBox([W.VBox([c["gpu"], c["N"]]), W.VBox([c["d"], c["dtype"], c["causal"]])]),
                self.image,
                self.html,
            ]
        )
        for w in c.values():
            w.observe(self._update, names="value")
        self._update()

    def _update(self, change=None) -> None:
        p = {k: w.value for k, w in self.controls.items()}
        self.points = viz.roofline_points(**p)
        self.figure = viz.draw_roofline(p["gpu"], self.points)
        self.image.value = viz.png(self.figure)
        self.html.value = "<br>".join(
            f"<b>{name}</b>: {viz.describe(r)}" for name, r in self.points.items()
        )


def roofline_plot(gpu: str = "H200", **initial) -> RooflinePlot:
    """Standard and flash attention forward on the roofline of a GPU preset (N, d, dtype, causal
    adjustable)."""
    return RooflinePlot(gpu=gpu, **initial)


def _stats(x, digits=3, most=4) -> str:
    """A short readout of m or l for the rows of one block (first batch and head)."""
    a = np.asarray(x, dtype=np.float64).reshape(-1)

    def fmt(v):
        return "-inf" if v == -math.inf else f"{v:.{digits}f}"

    if a.size and np.all(a == a[0]):
        return f"{fmt(a[0])} in all {a.size} rows" + (
            " (no key seen yet)" if a[0] == -math.inf else ""
        )
    return "[" + ", ".join(fmt(v) for v in a[:most]) + (", ...]" if a.size > most else "]")


def stepper_html(frame: dict, frames: list[dict], order: str = "fa2") -> str:
    """The stepper's text for one frame: the tile, what sits in SRAM, what moved, m and l, bytes so
    far."""
    (r0, r1), (c0, c1) = frame["rows"], frame["cols"]
    last = frames[-1]
    if frame.get("skipped"):
        stays = (
            f"q_i = Q[{r0}:{r1}] stays" if order == "fa2" else f"k_j, v_j = K, V[{c0}:{c1}] stay"
        )
        sram = (
            f"{stays}; the tile is skipped, nothing is loaded: "
            f"the mask hides every key of K[{c0}:{c1}] from every query of Q[{r0}:{r1}]"
        )
    else:
        sram = (
            f"q_i = Q[{r0}:{r1}], k_j = K[{c0}:{c1}], v_j = V[{c0}:{c1}], "
            "and the tile s_ij = q_i k_jᵀ"
        )
    moved = (
        ", ".join(
            f"{'read' if dn == 'read' else 'wrote'} {t} {n:,} B" for t, dn, n in frame["moved"]
        )
        or "none"
    )
    total = frame["read_bytes"] + frame["write_bytes"]
    return (
        "<div class='fe-stepper' style='line-height:1.45'>"
        f"<b>step {frame['step'] + 1} of {len(frames)}</b>: "
        f"S tile ({frame['i']}, {frame['j']})<br>in SRAM: {sram}<br>"
        f"HBM transfers this step: {moved}<br>"
        f"running max m (rows {r0}..{r1 - 1}) as the tile starts: {_stats(frame['m'])}<br>"
        f"running sum l: {_stats(frame['l'])}<br>HBM bytes so far: <b class='fe-step-total' "
        f"data-bytes='{total}'>{total:,}</b> (read {frame['read_bytes']:,}, written "
        f"{frame['write_bytes']:,}) of {last['read_bytes'] + last['write_bytes']:,} "
        "for the whole pass</div>"
    )


def _check_stepper(N_q, N_k, d, block_m, block_n, causal, order) -> None:
    """Sizes positive ints, and a block no taller than its sequence: a larger block would step
    through one partial tile that shows nothing a block of the sequence's length does not."""
    name = "tile_stepper"
    for arg, value in (("N_q", N_q), ("N_k", N_k), ("d", d)):
        check_int(value, arg, name=name, low=1)
    check_int(block_m, "block_m", name=name, low=1, high=N_q)
    check_int(block_n, "block_n", name=name, low=1, high=N_k)
    check_causal(causal, name=name)
    check_order(order, name=name)


class TileStepper(W.VBox):
    """See `tile_stepper`. `.frames` (from `viz.stepper_frames`), `.ledger`, `.slider` and
    `.figure`."""

    def __init__(
        self,
        *,
        N_q=40,
        N_k=40,
        d=16,
        block_m=8,
        block_n=8,
        causal=False,
        order="fa2",
        seed=0,
        measured=None,
    ):
        from . import tiled

        _check_stepper(N_q, N_k, d, block_m, block_n, causal, order)
        if math.ceil(N_q / block_m) * math.ceil(N_k / block_n) > 400:
            raise ValueError(
                f"tile_stepper: {N_q}x{N_k} in {block_m}x{block_n} blocks "
                "is more than 400 tiles to step through; use smaller N_q, N_k or larger blocks"
            )
        rng = np.random.default_rng(seed)
        shapes = [(1, 1, N_q, d), (1, 1, N_k, d), (1, 1, N_k, d)]  # q, k, v: standard normal
        q, k, v = (rng.standard_normal(s).astype(np.float32) for s in shapes)
        self.ledger = traffic.Ledger()
        tiled.forward(
            q,
            k,
            v,
            causal=causal,
            block_m=block_m,
            block_n=block_n,
            order=order,
            ledger=self.ledger,
        )
        self.frames = viz.stepper_frames(self.ledger)
        self._geometry, self.order = (N_q, N_k, block_m, block_n), order
        self.measurement, self.measured_steps = None, None
        if measured is not None and measured is not False:
            blocks = (block_m, block_n)
            self.measurement = _measure_stepper(measured, (q, k, v), causal, order, *blocks)
            self.measured_steps = replay.tile_measurements(self.measurement, self.frames)
        n = len(self.frames)
        self.play = W.Play(min=0, max=n - 1, interval=800, description="play")
        self.slider = W.IntSlider(min=0, max=n - 1, description="step", readout=False)
        W.jslink((self.play, "value"), (self.slider, "value"))
        back, fwd = (
            W.Button(description="◀ step", layout=W.Layout(width="80px")),
            W.Button(description="step ▶", layout=W.Layout(width="80px")),
        )
        back.on_click(lambda _: self._move(-1))
        fwd.on_click(lambda _: self._move(+1))
        self.html, self.image = W.HTML(), W.Image(format="png", layout=W.Layout(max_width="420px"))
        super().__init__(
            [W.HBox([self.play, back, fwd, self.slider]), W.HBox([self.image, self.html])]
        )
        self.slider.observe(self._update, names="value")
        self._update()

    def _move(self, delta: int) -> None:
        self.slider.value = min(max(self.slider.value + delta, 0), self.slider.max)

    def _update(self, change=None) -> None:
        frame = self.frames[self.slider.value]
        self.figure = viz.draw_tiles(frame, *self._geometry, order=self.order)
        self.image.value = viz.png(self.figure)
        self.html.value = stepper_html(frame, self.frames, self.order)
        if self.measured_steps is not None:
            self.html.value += measured_step_html(
                self.measured_steps[self.slider.value], self.measurement, self.slider.value
            )


def _measure_stepper(measured, qkv, causal, order, block_m, block_n) -> traffic.Measurement:
    """The stepper's inputs run through a Triton forward under `traffic.measure`: the package's
    kernel (measured=True), the learner's launcher fn(q, k, v, causal=, block_m=, block_n=), or a
    Measurement already taken on the same inputs."""
    if isinstance(measured, traffic.Measurement):
        return measured
    if order != "fa2":
        raise ValueError(f"tile_stepper: measured runs replay the FA2 order, got order={order!r}")
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        if b < 16 or b & (b - 1):
            raise ValueError(
                f"tile_stepper: a measured Triton run needs {name} a power of two >= 16, got {b}"
            )
    import torch

    q, k, v = (torch.from_numpy(x) for x in qkv)
    if measured is True:
        from . import triton_attention

        measured = triton_attention.forward
    if not callable(measured):
        raise TypeError(
            "tile_stepper: measured must be True (the package's Triton forward), a launcher "
            f"fn(q, k, v, causal=, block_m=, block_n=) or a traffic.Measurement, got {measured!r}"
        )
    with traffic.measure(per_program=True) as m:
        measured(q, k, v, causal=causal, block_m=block_m, block_n=block_n)
    return m


def measured_step_html(moved: list, measurement: traffic.Measurement, step: int) -> str:
    """The stepper's line on the measured kernel: what its program moved for this tile, and, on
    the way, the bytes so far against the measured total."""
    what = (
        ", ".join(f"{'read' if dn == 'read' else 'wrote'} {t} {n:,} B" for t, dn, n in moved)
        or "nothing (tile skipped)"
    )
    total = measurement.traffic().total_bytes
    return (
        "<div class='fe-measured' style='line-height:1.45;color:#2d5f8b'>"
        f"measured Triton kernel, this tile: {what}; whole run "
        f"<b class='fe-measured-total' data-bytes='{total}'>{total:,}</b> bytes</div>"
    )


def tile_stepper(
    N_q: int = 40,
    N_k: int = 40,
    d: int = 16,
    block_m: int = 8,
    block_n: int = 8,
    causal: bool = False,
    order: str = "fa2",
    seed: int = 0,
    measured=None,
) -> TileStepper:
    """Replay `tiled.forward` tile by tile on random (1, 1, N, d) inputs, from its real traffic
    ledger. measured=True runs flashedu's Triton forward on the same inputs under
    `traffic.measure` and shows, at each tile, what the kernel's program moved beside the model;
    pass your own launcher fn(q, k, v, causal=, block_m=, block_n=) (torch CPU tensors, under the
    interpreter) to replay your kernel instead. Measured runs need the FA2 order and power-of-two
    blocks >= 16."""
    return TileStepper(
        measured=measured,
        N_q=N_q,
        N_k=N_k,
        d=d,
        block_m=block_m,
        block_n=block_n,
        causal=causal,
        order=order,
        seed=seed,
    )
