"""The measured explorer: a Triton kernel's real HBM traffic beside the model, program by program.

`measured_explorer(run)` takes flashedu's own kernel ("forward" or "backward", on small random
inputs) or yours (a function that launches it, or a `traffic.Measurement` you took), runs it under
`traffic.measure(per_program=True)`, and shows per-tensor bars of the bytes it moved beside the
closed form, `traffic.compare`'s sentences where they differ ("your kernel read Q 3 times..."), and
a step-through of the programs it ran: what each loaded and stored. Every number comes from
`flashedu.traffic.replay`; the widget keeps `.measurement`, `.state`, `.frames` and its figures so
tests
drive it without a browser. Needs Triton's interpreter (TRITON_INTERPRET=1; flashedu sets it on a
machine without CUDA).

Introduced in notebooks/06_triton_forward.ipynb; `flashedu.widgets` re-exports it.
"""

from __future__ import annotations

import ipywidgets as W

from .. import traffic, viz
from ..traffic import replay


def program_html(frame: dict, frames: list[dict]) -> str:
    """The text of one program frame: kernel, program id, what it moved per tensor (bytes and
    number of instructions), bytes so far."""
    totals: dict[tuple[str, str], list[int]] = {}
    for t, dn, n, _ in frame["moved"]:
        entry = totals.setdefault((dn, t), [0, 0])
        entry[0], entry[1] = entry[0] + n, entry[1] + 1
    parts = []
    for direction, verb in (("read", "read"), ("write", "wrote")):
        items = [
            f"{t} {n:,} B"
            + (f" ({k} loads)" if k > 1 and direction == "read" else "")
            + (f" ({k} stores)" if k > 1 and direction == "write" else "")
            for (dn, t), (n, k) in totals.items()
            if dn == direction
        ]
        if items:
            parts.append(f"{verb} " + ", ".join(items))
    moved = "; ".join(parts)
    x, y, z = frame["program"]
    total = frame["read_bytes"] + frame["write_bytes"]
    last = frames[-1]["read_bytes"] + frames[-1]["write_bytes"]
    return (
        "<div class='fe-program' style='line-height:1.45'>"
        f"<b>program {frames.index(frame) + 1} of {len(frames)}</b>: {frame['kernel']} "
        f"({x}, {y}, {z})<br>moved: {moved or 'nothing'}<br>HBM bytes so far: "
        f"<b class='fe-program-total' data-bytes='{total}'>{total:,}</b> of {last:,}</div>"
    )


def measured_html(state: dict) -> str:
    """The headline: measured total, the model's total, and each difference in words."""
    t, model = state["measured"], state["model"]
    head = (
        f"Measured: <b class='fe-measured-total' data-bytes='{t.total_bytes}'>"
        f"{t.total_bytes:,} bytes</b> in {len(state['launches'])} launch(es), "
        f"{state['programs']} programs"
    )
    if model is None:
        return f"<div class='fe-measured'>{head}</div>"
    verdict = (
        "<b class='fe-verdict'>equal to the model, byte for byte</b>"
        if not state["differences"]
        else "<br>".join(f"• {d}" for d in state["differences"])
    )
    return (
        f"<div class='fe-measured' style='line-height:1.45'>{head}; model: "
        f"{model.total_bytes:,} bytes<br>{verdict}</div>"
    )


class MeasuredExplorer(W.VBox):
    """See `measured_explorer`. `.measurement`, `.state`, `.frames`, `.slider` (1-based: program
    k is frames[k - 1]), `.figure` (the bars) and `.program_figure` (the current program)."""

    def __init__(self, measurement, model=None, axis_names=()):
        self.measurement = measurement
        self.state = replay.measured_state(measurement, model, axis_names=axis_names)
        self.frames = replay.program_frames(measurement)
        self.figure = replay.draw_measured(self.state)
        self.html = W.HTML(measured_html(self.state))
        self.image = W.Image(
            value=viz.png(self.figure), format="png", layout=W.Layout(max_width="760px")
        )
        n = max(1, len(self.frames))
        self.slider = W.IntSlider(min=1, max=n, description="program", readout=True)
        back, fwd = (
            W.Button(description="◀", layout=W.Layout(width="50px")),
            W.Button(description="▶", layout=W.Layout(width="50px")),
        )
        back.on_click(lambda _: self._move(-1))
        fwd.on_click(lambda _: self._move(+1))
        self.program = W.HTML()
        self.program_image = W.Image(format="png", layout=W.Layout(max_width="640px"))
        steps = W.HBox([back, fwd, self.slider])
        super().__init__([self.html, self.image, steps, self.program_image, self.program])
        self.slider.observe(self._update, names="value")
        self._update()

    def _move(self, delta: int) -> None:
        self.slider.value = min(max(self.slider.value + delta, 1), self.slider.max)

    def _update(self, change=None) -> None:
        if not self.frames:
            self.program.value = "no Triton program ran under the measurement"
            return
        frame = self.frames[self.slider.value - 1]
        self.program_figure = replay.draw_program(frame, self.measurement)
        self.program_image.value = viz.png(self.program_figure)
        self.program.value = program_html(frame, self.frames)


def measured_explorer(
    run="forward", *, model: traffic.Traffic | None = None, axis_names=None, **shape
) -> MeasuredExplorer:
    """A kernel's measured HBM traffic beside the model, with its programs one by one.

    run: "forward" or "backward" runs flashedu's Triton kernel (`replay.package_run`; shape keywords
    B, H, N_q, N_k, d, block_m, block_n, causal, seed) with its closed form as the model; a function
    of no arguments that launches your kernel (on CPU tensors, under the interpreter) is run under
    `traffic.measure(per_program=True)`; a `traffic.Measurement` is shown as it is.
    model: the Traffic to compare with (e.g. `traffic.flash_forward(...)`); None shows the
    measurement alone. axis_names name the grid axes in the differences, ("query block",
    "batch x head") by default."""
    names = ("query block", "batch x head") if axis_names is None else tuple(axis_names)
    if isinstance(run, str):
        measurement, default = replay.package_run(run, **shape)
        return MeasuredExplorer(measurement, default if model is None else model, names)
    if shape:
        raise TypeError(f"measured_explorer: shape keywords {sorted(shape)} only go with a name")
    if isinstance(run, traffic.Measurement):
        return MeasuredExplorer(run, model, names)
    if not callable(run):
        raise TypeError(
            "measured_explorer: run must be 'forward', 'backward', a function that launches "
            f"a Triton kernel, or a traffic.Measurement, got {run!r}"
        )
    with traffic.measure(per_program=True) as m:
        run()
    return MeasuredExplorer(m, model, names)
