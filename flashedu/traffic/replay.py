"""Measured kernel runs, replayed: the numbers and drawings behind the measured widgets.

A `traffic.Measurement` (from `traffic.measure`) holds every load and store a Triton kernel made
under the interpreter, program by program. This module turns it into what the widgets show, as pure
functions that tests check without a browser:

* `package_run`: runs flashedu's own Triton forward or backward on small random inputs, measured,
  with the closed form it should equal;
* `measured_state`: measured bytes per tensor beside a model's, and `traffic.compare`'s sentences;
* `program_frames`: one frame per program run (which tensor, which elements, how many bytes);
* `tile_measurements`: the bytes the Triton program of each query block moved at each tile of the
  NumPy tile stepper, so the stepper can show the kernel beside the model;
* `draw_measured`, `draw_program`: matplotlib Figures of the above.

Introduced in notebooks/06_triton_forward.ipynb (measured bytes) and
notebooks/03_tiled_forward.ipynb (the tile stepper).
"""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from .. import traffic

READ, WRITE, MODEL_EDGE = "#4c72b0", "#dd8452", "#333333"
KINDS = ("forward", "backward")
_MAX_SPANS = 4096  # above this many spans a region is drawn as its bounding span


def package_run(
    kind: str = "forward",
    *,
    B: int = 1,
    H: int = 2,
    N_q: int = 64,
    N_k: int = 64,
    d: int = 32,
    block_m: int = 16,
    block_n: int = 16,
    causal: bool = False,
    seed: int = 0,
) -> tuple[traffic.Measurement, traffic.Traffic]:
    """(measurement, model): `kernels.forward` (or its backward) measured on random fp16
    inputs under the interpreter, and the closed form it moves exactly: `flash_forward` plus
    `triton_forward_extra`, or `flash_backward(variant="two_pass")`."""
    if kind not in KINDS:
        raise ValueError(f"package_run: kind must be one of {list(KINDS)}, got {kind!r}")
    import torch

    from .. import kernels

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N_q, d, generator=g).half()
    k, v = (torch.randn(B, H, N_k, d, generator=g).half() for _ in range(2))
    kw = dict(block_m=block_m, block_n=block_n, causal=causal)
    shape = (B, H, N_q, N_k, d)
    with traffic.measure(per_program=True) as fwd:
        o, lse = kernels.forward(q, k, v, **kw)
    if kind == "forward":
        model = traffic.combine(
            traffic.flash_forward(*shape, **kw), traffic.triton_forward_extra(*shape, **kw)
        )
        return fwd, model
    do = torch.randn(q.shape, generator=g).half()
    with traffic.measure(per_program=True) as bwd:
        kernels.backward(do, q, k, v, o, lse, **kw)
    return bwd, traffic.flash_backward(*shape, variant="two_pass", **kw)


def measured_state(
    measurement: traffic.Measurement,
    model: traffic.Traffic | None = None,
    *,
    axis_names: tuple[str, ...] = (),
) -> dict:
    """What the measured explorer shows: `measured` (Traffic), `model` (Traffic or None),
    `differences` (`traffic.compare`, [] when equal or with no model), `launches`, `programs` (how
    many program runs), `tensors` (names in the model's order)."""
    if not isinstance(measurement, traffic.Measurement):
        raise TypeError(
            f"measured_state: measurement must be a traffic.Measurement, got {measurement!r}"
        )
    t = measurement.traffic()
    diffs = [] if model is None else traffic.compare(measurement, model, axis_names=axis_names)
    names = set(t.reads) | set(t.writes)
    if model is not None:
        names |= set(model.reads) | set(model.writes)
    return {
        "measured": t,
        "model": model,
        "differences": diffs,
        "launches": list(measurement.launches),
        "programs": len(measurement.ledger.steps),
        "tensors": sorted(names, key=traffic.tensor_order),
    }


def program_frames(measurement: traffic.Measurement) -> list[dict]:
    """One frame per program run, in the order the interpreter ran them: `kernel`, `launch`,
    `program` (x, y, z), `moved` [(tensor, direction, bytes, region)], and the cumulative
    `read_bytes` / `write_bytes` up to the end of the program (the last frame's equal the
    measurement's totals)."""
    groups: dict[tuple, list] = {}
    for a in measurement.accesses:
        groups.setdefault((a.launch, a.program), []).append(a)
    frames, read, written = [], 0, 0
    for step in measurement.ledger.steps:
        accesses = groups.get((step["launch"], step["program"]), [])
        read += sum(a.nbytes for a in accesses if a.direction == "read")
        written += sum(a.nbytes for a in accesses if a.direction == "write")
        moved = [(a.tensor, a.direction, a.nbytes, a.region) for a in accesses]
        frames.append({**step, "moved": moved, "read_bytes": read, "write_bytes": written})
    return frames


def _rows(region) -> tuple[int, int]:
    """The sequence rows of a (B, H, N, ...) region: its third dimension (the only one if 1-D)."""
    return region[2] if len(region) > 2 else region[0]


def tile_measurements(
    measurement: traffic.Measurement, frames: list[dict]
) -> list[list[tuple[str, str, int]]]:
    """For each tile-stepper frame (i, j, rows, cols, skipped), what the Triton program that owns
    query rows `rows` moved for that tile: the K/V loads of rows `cols`, plus its Q load at its
    first computed tile and its O / lse stores with the row's last frame, where the model writes
    them too. A skipped tile loads nothing.
    Assumes one batch and head (the stepper's inputs) and one forward launch."""
    owner: dict[int, tuple[int, int, int]] = {}
    for a in measurement.accesses:
        if a.tensor == "Q" and a.direction == "read":
            owner[_rows(a.region)[0]] = a.program
    computed = [f for f in frames if not f.get("skipped")]
    first = {f["rows"]: f["step"] for f in reversed(computed)}
    last = {f["rows"]: f["step"] for f in frames}  # the row's stores land with its last frame
    out = []
    for f in frames:
        pid, (c0, _) = owner.get(f["rows"][0]), f["cols"]
        moved = []
        for a in measurement.accesses if pid is not None else ():
            if a.program != pid:
                continue
            if a.direction == "write":
                keep = last[f["rows"]] == f["step"]
            elif a.tensor in ("K", "V"):
                keep = not f.get("skipped") and _rows(a.region)[0] == c0
            else:
                keep = first.get(f["rows"]) == f["step"]
            if keep:
                moved.append((a.tensor, a.direction, a.nbytes))
        out.append(moved)
    return out


def draw_measured(state: dict) -> Figure:
    """Bytes per tensor, read and written: the measured run as filled bars, the model as outlined
    bars beside them (where one is given). One unit on the axis, written in its label."""
    t, model = state["measured"], state["model"]
    names = state["tensors"]
    values = [*t.reads.values(), *t.writes.values(), 1]
    if model is not None:
        values += [*model.reads.values(), *model.writes.values()]
    unit, scale = _unit(max(values))
    fig = Figure(figsize=(7.6, 3.0), layout="constrained")
    ax = fig.subplots()
    w = 0.2 if model is not None else 0.4
    for k, (direction, color) in enumerate((("reads", READ), ("writes", WRITE))):
        mine = getattr(t, direction)
        x0 = [i + (k - 0.5) * 2 * w for i in range(len(names))]
        label = f"measured {'read' if k == 0 else 'written'}"
        ax.bar(x0, [mine.get(n, 0) / scale for n in names], w, color=color, label=label)
        if model is not None:
            theirs = getattr(model, direction)
            ax.bar(
                [x + w for x in x0],
                [theirs.get(n, 0) / scale for n in names],
                w,
                facecolor="none",
                edgecolor=color,
                hatch="//",
                label=f"model {'read' if k == 0 else 'written'}",
            )
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel(f"HBM bytes ({unit})")
    verdict = (
        ""
        if model is None
        else ": equal to the model"
        if not state["differences"]
        else f": {len(state['differences'])} differences from the model"
    )
    ax.set_title(f"measured kernel traffic, {state['programs']} programs{verdict}", fontsize=9)
    ax.legend(fontsize=7, frameon=False, ncol=2)
    return fig


def _unit(nbytes: float) -> tuple[str, float]:
    for unit, scale in (("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10)):
        if nbytes >= scale:
            return unit, scale
    return "B", 1.0


def _spans(region, shape) -> list[tuple[int, int]]:
    """Flat element spans [a, b) (row-major over `shape`) that a region's box covers."""
    if not region:
        return []
    strides = [1] * len(shape)
    for k in range(len(shape) - 2, -1, -1):
        strides[k] = strides[k + 1] * shape[k + 1]
    lead = region[:-1]
    count = 1
    for lo, hi in lead:
        count *= hi - lo
    if count > _MAX_SPANS:
        first = sum(lo * s for (lo, _), s in zip(region, strides))
        return [(first, sum((hi - 1) * s for (_, hi), s in zip(region, strides)) + 1)]
    spans = [(0, 0)]
    for (lo, hi), s in zip(lead, strides):
        spans = [(a + i * s, 0) for a, _ in spans for i in range(lo, hi)]
    lo, hi = region[-1]
    merged: list[list[int]] = []
    for a, _ in spans:
        if merged and merged[-1][1] == a + lo:
            merged[-1][1] = a + hi
        else:
            merged.append([a + lo, a + hi])
    return [tuple(m) for m in merged]


def draw_program(frame: dict, measurement: traffic.Measurement) -> Figure:
    """One strip per tensor the program touched, the tensor's elements laid out flat (row-major):
    the spans this program read (blue) or wrote (orange). A FlashAttention-2 forward program reads
    one block of Q rows, then the whole of its head's K and V; it writes its rows of O and lse."""
    names = sorted({t for t, *_ in frame["moved"]}, key=traffic.tensor_order)
    fig = Figure(figsize=(6.4, 0.7 + 0.45 * max(1, len(names))), layout="constrained")
    ax = fig.subplots()
    for row, name in enumerate(names):
        info = measurement.tensors.get(name)
        total = max(1, info.nbytes // info.itemsize) if info else 1
        ax.add_patch(Rectangle((0, row), 1, 0.7, facecolor="white", edgecolor="grey", lw=0.6))
        for tensor, direction, _, region in frame["moved"]:
            if tensor != name or info is None:
                continue
            color = READ if direction == "read" else WRITE
            y = row + (0.35 if direction == "write" else 0)
            for a, b in _spans(region, info.shape):
                ax.add_patch(Rectangle((a / total, y), (b - a) / total, 0.35, color=color, lw=0))
    ax.set_xlim(0, 1)
    ax.set_ylim(len(names), -0.3)
    ax.set_yticks([r + 0.35 for r in range(len(names))], names)
    ax.set_xticks([0, 0.5, 1], ["first element", "", "last element"])
    x, y, z = frame["program"]
    ax.set_title(
        f"{frame['kernel']} program ({x}, {y}, {z}): read (top half), written (bottom half)",
        fontsize=9,
    )
    return fig
