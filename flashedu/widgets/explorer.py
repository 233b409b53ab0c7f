"""Interactive views of HBM/SRAM traffic: thin ipywidgets front-ends over `flashedu.viz`.

* `traffic_explorer(**initial)`: sliders for N, d, dtype, block sizes, SRAM size, GPU preset and
  algorithm; shows bytes read and written per tensor, the SRAM tiles, the standard/flash ratio and
  the roofline bound.
* `roofline_plot(gpu="H200", ...)`: standard and flash attention placed on a preset's roofline.

The tile stepper is in `flashedu.widgets.stepper`, the measured explorer in
`flashedu.widgets.measured`.

Every number shown comes from a pure function in `flashedu.viz` (which reads `flashedu.traffic`),
and each widget keeps its last result in `.state` (or `.frames`) and its last figure in `.figure`,
so tests move the controls and check the numbers without a browser. Figures are PNG images
(no ipympl needed); nothing here runs in JavaScript beyond what ipywidgets ships.

Introduced in notebooks/00_memory_hierarchy.ipynb.
"""

from __future__ import annotations

import ipywidgets as W

from .. import traffic, viz
from ..nb import fmt_bytes
from ..validation import check_int

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
        f"{viz.fmt_time(r.t_compute)} of matmuls (FA3, arXiv:2407.08608, Sec. 3.1)."
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
