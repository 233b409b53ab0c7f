"""The ledger of HBM <-> SRAM transfers, and the `Traffic` totals it adds up to.

An instrumented algorithm (`naive`, `tiled`) reports every transfer to a `Ledger`: tensor (Q, K, V,
S, P, O, lse, dO, ...), direction ("read" = HBM -> SRAM, "write" = SRAM -> HBM) and bytes. A
measured Triton run (`traffic.measure`) fills the same kind of ledger from the kernel's own loads
and stores, and the closed forms of `flashedu.traffic` return the same `Traffic` record, so all
three can be compared byte for byte; `compare` says in words where they differ.

This module sits below `traffic` and the kernel measurement so that neither imports the other.
Introduced in notebooks/00_memory_hierarchy.ipynb; `flashedu.traffic` re-exports everything here.
"""

from __future__ import annotations

import numbers
from collections import defaultdict
from dataclasses import dataclass, field


def check_sizes(name: str, **sizes) -> None:
    """Every size a positive int (not a bool), else a ValueError naming the function, the
    argument, its value and what was expected."""
    for arg, v in sizes.items():
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise ValueError(f"{name}: {arg} must be a positive int, got {v!r}")


class SramCapacityError(ValueError):
    """A tile set does not fit the SRAM budget given to the algorithm."""


@dataclass(frozen=True)
class Transfer:
    tensor: str  # "Q", "K", "V", "S", "P", "O", "lse", "dO", "D", "dQ", "dK", "dV", "dP", "dS"
    direction: str  # "read": HBM -> SRAM; "write": SRAM -> HBM
    nbytes: int
    step: int  # index into Ledger.steps of the step that was current (-1 before the first)


@dataclass
class Ledger:
    """Records every HBM <-> SRAM transfer of an instrumented algorithm.

    sram_bytes: optional capacity; `fit()` raises SramCapacityError when a tile set exceeds it.
    steps: one dict per algorithm step (`step(...)`), e.g.
    {"i": 0, "j": 2, "skipped": False, "m": ..., "l": ...}, which the tile stepper widget replays.
    """

    sram_bytes: int | None = None
    transfers: list[Transfer] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)
    peak_sram: int = 0

    def read(self, tensor: str, x) -> None:
        """Count loading `x` (an array, or a byte count) from HBM into SRAM."""
        self.transfers.append(Transfer(tensor, "read", _nbytes(x), len(self.steps) - 1))

    def write(self, tensor: str, x) -> None:
        """Count storing `x` (an array, or a byte count) from SRAM to HBM."""
        self.transfers.append(Transfer(tensor, "write", _nbytes(x), len(self.steps) - 1))

    def step(self, **state) -> None:
        """Mark the start of an algorithm step; `state` is kept for replay (tile indices, m, l,
        ...)."""
        self.steps.append(dict(state))

    def fit(self, **tiles: int) -> None:
        """Check that tiles resident in SRAM at once (name=bytes, for one program) fit the
        capacity."""
        total = sum(int(b) for b in tiles.values())
        self.peak_sram = max(self.peak_sram, total)
        if self.sram_bytes is not None and total > self.sram_bytes:
            parts = ", ".join(f"{k}={v:,} B" for k, v in tiles.items())
            raise SramCapacityError(
                f"tile set needs {total:,} bytes of SRAM ({parts}) but the budget is "
                f"sram_bytes={self.sram_bytes:,}: use smaller block_m / block_n"
            )

    def traffic(self) -> "Traffic":
        reads: dict[str, int] = defaultdict(int)
        writes: dict[str, int] = defaultdict(int)
        for t in self.transfers:
            (reads if t.direction == "read" else writes)[t.tensor] += t.nbytes
        return Traffic(dict(reads), dict(writes))

    @property
    def read_bytes(self) -> int:
        return sum(t.nbytes for t in self.transfers if t.direction == "read")

    @property
    def write_bytes(self) -> int:
        return sum(t.nbytes for t in self.transfers if t.direction == "write")

    @property
    def total_bytes(self) -> int:
        return self.read_bytes + self.write_bytes


def _nbytes(x) -> int:
    if isinstance(x, numbers.Integral):
        return int(x)
    if hasattr(x, "nbytes"):
        return int(x.nbytes)
    return int(x.numel() * x.element_size())  # torch


@dataclass(frozen=True)
class Traffic:
    """HBM bytes by tensor: `reads[tensor]` (HBM -> SRAM) and `writes[tensor]` (SRAM -> HBM)."""

    reads: dict[str, int]
    writes: dict[str, int]

    def __post_init__(self):
        object.__setattr__(self, "reads", {k: int(v) for k, v in self.reads.items() if v})
        object.__setattr__(self, "writes", {k: int(v) for k, v in self.writes.items() if v})

    @property
    def read_bytes(self) -> int:
        return sum(self.reads.values())

    @property
    def write_bytes(self) -> int:
        return sum(self.writes.values())

    @property
    def total_bytes(self) -> int:
        return self.read_bytes + self.write_bytes

    def table(self) -> str:
        """A fixed-width table: one row per tensor, bytes read and written."""
        names = sorted(set(self.reads) | set(self.writes), key=tensor_order)
        lines = [f"{'tensor':<7}{'read':>16}{'written':>16}"]
        for n in names:
            lines.append(f"{n:<7}{self.reads.get(n, 0):>16,}{self.writes.get(n, 0):>16,}")
        lines.append(f"{'total':<7}{self.read_bytes:>16,}{self.write_bytes:>16,}")
        return "\n".join(lines)


_TENSOR_ORDER = ["Q", "K", "V", "S", "P", "O", "lse", "dO", "D", "dP", "dS", "dQ", "dK", "dV"]


def tensor_order(name: str):
    """Sort key: the model's tensors in order (Q, K, V, S, P, O, ...), then others by name."""
    return (_TENSOR_ORDER.index(name) if name in _TENSOR_ORDER else len(_TENSOR_ORDER), name)


class NullLedger:
    """The default ledger: records nothing, so uninstrumented calls cost nothing."""

    sram_bytes = None

    def read(self, tensor, x) -> None:
        pass

    def write(self, tensor, x) -> None:
        pass

    def step(self, **state) -> None:
        pass

    def fit(self, **tiles) -> None:
        pass


NULL_LEDGER = NullLedger()


def combine(*parts: Traffic) -> Traffic:
    """The sum of several Traffic records (e.g. a forward and its backward)."""
    reads: dict[str, int] = defaultdict(int)
    writes: dict[str, int] = defaultdict(int)
    for t in parts:
        for k, v in t.reads.items():
            reads[k] += v
        for k, v in t.writes.items():
            writes[k] += v
    return Traffic(reads, writes)


# ---------------------------------------------------------------------------- measured vs model


@dataclass(frozen=True)
class Difference:
    """One tensor and direction where a measured run and a model disagree; `text` says how."""

    tensor: str
    direction: str
    measured: int
    model: int
    text: str

    def __str__(self) -> str:
        return self.text


def compare(measured, model: Traffic, *, axis_names: tuple[str, ...] = ()) -> list[Difference]:
    """Per tensor and direction, where `measured` (a `traffic.Measurement`, a Ledger or a Traffic)
    moves other bytes than `model` (a Traffic from the closed forms); [] when they agree byte for
    byte.

    With a Measurement the text counts how many times the tensor was moved and says why, from the
    addresses each program touched: "your kernel read Q twice (8,192 B of a 4,096 B tensor); the
    model reads it once: each program loaded the same elements of Q 2 times", or, for a tensor
    shared by programs, "... once per program along grid axis 0" (name the axes with
    axis_names=("query block", "batch x head") to read "once per query block")."""
    m = measured.traffic() if hasattr(measured, "traffic") else measured
    out = []
    pairs = (("read", m.reads, model.reads), ("write", m.writes, model.writes))
    for direction, mine, theirs in pairs:
        for name in sorted(set(mine) | set(theirs), key=tensor_order):
            a, b = mine.get(name, 0), theirs.get(name, 0)
            if a != b:
                text = _explain(measured, name, direction, a, b, axis_names)
                out.append(Difference(name, direction, a, b, text))
    return out


def _times(t: float) -> str:
    if t == int(t):
        return {1: "once", 2: "twice"}.get(int(t), f"{int(t)} times")
    return f"{t:.2f} times"


def _explain(measured, name, direction, a, b, axis_names) -> str:
    verb, verb_model = ("read", "reads") if direction == "read" else ("wrote", "writes")
    info = getattr(measured, "tensors", {}).get(name)
    if not a:
        return f"your kernel never {verb} {name}; the model {verb_model} {b:,} B of it"
    if info is None or not info.nbytes:
        return f"your kernel {verb} {name} {a:,} B; the model {verb_model} {b:,} B"
    size = info.nbytes
    text = f"your kernel {verb} {name} {_times(a / size)} ({a:,} B of a {size:,} B tensor)"
    text += f"; the model {verb_model} it {_times(b / size)}" if b else "; the model never moves it"
    within, across, _ = measured.reuse(name, direction)
    if within > 1:
        return f"{text}: each program {verb} the same elements of {name} {_times(within)}"
    for grid in (g for _, g in measured.launches):
        for axis, n in enumerate(grid):
            if n > 1 and across == n:
                what = axis_names[axis] if axis < len(axis_names) else ""
                return f"{text}: once per {what or f'program along grid axis {axis}'}"
    return text
