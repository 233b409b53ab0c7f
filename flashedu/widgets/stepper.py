"""The tile stepper: play or step through the ledger that `tiled.forward` fills, tile by tile.

`tile_stepper(N_q=..., N_k=..., ...)` shows which Q and K/V blocks sit in SRAM, which S tile is
computed or skipped, the running m and l, and the bytes so far; with `measured=True` (or your
launcher) also what a Triton kernel's program really moved for each tile. Every number comes from
`viz.stepper_frames` and `traffic.replay`; the widget keeps `.frames` and its last figure.

Introduced in notebooks/03_tiled_forward.ipynb.
"""

from __future__ import annotations

import math

import ipywidgets as W
import numpy as np

from .. import traffic, viz
from ..traffic import replay
from ..validation import check_causal, check_int, check_order


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
        from .. import tiled

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
        from .. import kernels

        measured = kernels.forward
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
