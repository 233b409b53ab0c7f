"""FlashAttention-3's scheduling ideas as models that run on a CPU: the exponential budget, and a
timeline of producer and consumer work per tile with ping-pong and intra-warpgroup overlap. The FP8
half (block quantiser, Hadamard rotation, emulated FP8 attention) is in `flashedu.hopper.fp8`.

* `softmax_budget`: seconds of tensor-core matmul against seconds of exponentials for one forward,
  from two rates: FlashAttention-3 (Shah et al. 2024, arXiv:2407.08608, section 3.1) gives the
  H100 SXM5 989 TFLOP/s of FP16 matmul but 3.9 TFLOP/s of special functions (exp2 and friends).
* `tile_costs` and `timeline`: per-tile work on one SM computed from rates, then laid out on the
  SM's units (TMA copy engine, tensor cores, special-function units) under four schedules, from
  "everything in sequence" to FA3's ping-pong of two warpgroups.
* The measured results of the Hopper kernel on the H200 are read by `flashedu.hopper.results`.

Limits, honestly: the timeline is a model with three units and in-order issue, not a simulator of an
SM. It leaves out latency, register pressure, the FP32 work of the softmax (max, sum, rescale) and
the L2 cache (the load rate is one argument). Its numbers say which unit bounds a schedule, not how
fast a kernel runs; the chapter sets them beside measurements.

Introduced in notebooks/11_hopper.ipynb.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from .. import traffic

_H100 = traffic.GPUS["H100-SXM"]
MATMUL_TFLOPS = _H100.dense_flops / 1e12
"""Dense FP16/BF16 tensor-core rate of the H100 SXM5: 989 TFLOP/s (H100 datasheet; FA3 s3.1)."""
SFU_TFLOPS = _H100.sfu_tflops
"""Special-function rate of the H100 SXM5, 3.9 TFLOP/s (FA3 s3.1), read from the preset's
`sfu_flops` (`flashedu.traffic.hardware`)."""
SMS = _H100.sms
LOAD_BYTES_PER_S = _H100.hbm_bandwidth / _H100.sms
"""One SM's share of the H100 SXM5's 3.35 TB/s of HBM bandwidth: a pessimistic load rate (no L2)."""

UNITS = ("TMA", "tensor cores", "SFU")
SCHEDULES = ("serial", "producer_consumer", "pingpong", "intra_warpgroup")


def _positive(name: str, x) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not x > 0 or math.isinf(x):
        raise ValueError(f"{name} must be a positive finite number, got {x!r}")
    return float(x)


def _count(name: str, x, lo: int = 1) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {x!r}")
    return int(x)


def softmax_budget(
    B: int,
    H: int,
    N: int,
    d: int,
    *,
    causal: bool = False,
    matmul_tflops: float = MATMUL_TFLOPS,
    sfu_tflops: float = SFU_TFLOPS,
) -> tuple[float, float]:
    """(t_matmul, t_exp) in seconds for one attention forward with N_q = N_k = N.

    Matmul: 4 B H N^2 d FLOPs (Q K^T and P V, 2 FLOPs per multiply-add) at `matmul_tflops`.
    Exponentials: one per score, B H N^2, at `sfu_tflops` (one special-function op each).
    A causal mask keeps the visible scores only, exactly N (N + 1) / 2 per head (the diagonal
    included; `traffic.attention_flops` and `traffic.exp_count`), for the matmuls and the exps
    alike, so it leaves their ratio t_exp / t_matmul = matmul_tflops / (4 d sfu_tflops) unchanged.
    (Benchmarks report the x0.5 convention instead, `traffic.benchmark_flops`.)

    Introduced in notebooks/11_hopper.ipynb (exercise 11.1).
    """
    for name, x in (("B", B), ("H", H), ("N", N), ("d", d)):
        _count(name, x)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    flops = traffic.attention_flops(B, H, N, N, d, causal=causal)
    exps = traffic.exp_count(B, H, N, N, causal=causal)
    return (
        flops / (_positive("matmul_tflops", matmul_tflops) * 1e12),
        exps / (_positive("sfu_tflops", sfu_tflops) * 1e12),
    )


@dataclass(frozen=True)
class TileCosts:
    """Seconds one SM spends on one (block_m, block_n) tile, unit by unit."""

    load: float  # TMA: one K tile and one V tile, HBM (or L2) -> shared memory
    qk: float  # tensor cores: S = Q_i K_j^T, 2 block_m block_n d FLOPs
    exp: float  # special-function units: block_m block_n exponentials
    pv: float  # tensor cores: O_i += P V_j, 2 block_m block_n d FLOPs


def tile_costs(
    block_m: int,
    block_n: int,
    d: int,
    *,
    matmul_tflops: float = MATMUL_TFLOPS,
    sfu_tflops: float = SFU_TFLOPS,
    load_bytes_per_s: float = LOAD_BYTES_PER_S,
    sms: int = SMS,
    itemsize: int = 2,
) -> TileCosts:
    """Per-tile times on one SM: each GPU-wide rate shared evenly by `sms` SMs.

    `load_bytes_per_s` is one SM's load rate. Its default, the SM's share of HBM bandwidth, assumes
    every K/V tile comes from HBM; tiles shared by programs running together come from L2 instead,
    so pass a multiple of it to model that reuse.

    Introduced in notebooks/11_hopper.ipynb.
    """
    bm, bn, d = _count("block_m", block_m), _count("block_n", block_n), _count("d", d)
    sms = _count("sms", sms)
    mm = _positive("matmul_tflops", matmul_tflops) * 1e12 / sms  # FLOP/s per SM
    sfu = _positive("sfu_tflops", sfu_tflops) * 1e12 / sms
    load = (
        2 * bn * d * _count("itemsize", itemsize) / _positive("load_bytes_per_s", load_bytes_per_s)
    )
    return TileCosts(load=load, qk=2 * bm * bn * d / mm, exp=bm * bn / sfu, pv=2 * bm * bn * d / mm)


@dataclass(frozen=True)
class Task:
    name: str  # e.g. "QK^T 3"
    unit: str  # one of UNITS
    owner: str  # "producer", "warpgroup 1", "warpgroup 2"
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """The tasks of one schedule, placed on the units; `tiles` score tiles were computed."""

    schedule: str
    tasks: tuple[Task, ...]
    tiles: int

    @property
    def total(self) -> float:
        return max(t.end for t in self.tasks)

    def busy(self, unit: str) -> float:
        """Seconds `unit` spends working (its tasks never overlap: each unit issues in order)."""
        if unit not in UNITS:
            raise ValueError(f"unit must be one of {UNITS}, got {unit!r}")
        return sum(t.end - t.start for t in self.tasks if t.unit == unit)

    @property
    def tensor_core_utilisation(self) -> float:
        """Fraction of the time the tensor cores are busy: the share of peak matmul rate reached."""
        return self.busy("tensor cores") / self.total

    @property
    def per_tile(self) -> float:
        return self.total / self.tiles


def _place(spec: list[tuple[str, str, str, float, tuple[str, ...]]]) -> tuple[Task, ...]:
    """Lay out (name, unit, owner, seconds, dependencies) in list order: each unit runs its tasks
    in that order, and a task starts when its unit is free and its dependencies have ended."""
    free = dict.fromkeys(UNITS, 0.0)
    end: dict[str, float] = {}
    tasks = []
    for name, unit, owner, dt, deps in spec:
        unknown = [dep for dep in deps if dep not in end and " -" not in dep]  # tile -1: none
        if unknown:
            raise RuntimeError(f"timeline: {name} waits for {unknown}, placed later or never")
        start = max([free[unit]] + [end[dep] for dep in deps if dep in end])
        end[name] = free[unit] = start + dt
        tasks.append(Task(name, unit, owner, start, start + dt))
    return tuple(tasks)


def _loads(c: TileCosts, j: int, stages: int, wgs=("",), owner: str = "producer", after=()):
    """TMA copies of K_j and V_j into the ring of `stages` buffers: K_j's buffer is free again once
    every warpgroup's QK^T of tile j - stages has run, V_j's once their PV has (FA3 Algorithm 1)."""
    return [
        (f"K {j}", "TMA", owner, c.load / 2, tuple(f"QK^T {j - stages}{w}" for w in wgs) + after),
        (f"V {j}", "TMA", owner, c.load / 2, tuple(f"PV {j - stages}{w}" for w in wgs)),
    ]


def _consumer(c: TileCosts, j: int, wg: str, owner: str, after: tuple[str, ...] = ()):
    """QK^T, exp and PV of tile j for warpgroup `wg`, in program order (no overlap inside)."""
    return [
        (f"QK^T {j}{wg}", "tensor cores", owner, c.qk, (f"K {j}",) + after),
        (f"exp {j}{wg}", "SFU", owner, c.exp, (f"QK^T {j}{wg}",)),
        (f"PV {j}{wg}", "tensor cores", owner, c.pv, (f"exp {j}{wg}", f"V {j}")),
    ]


def _spec(c: TileCosts, n: int, schedule: str, stages: int):
    wg1 = "warpgroup 1"
    if schedule == "serial":  # one warpgroup loads, then computes, tile after tile
        return [
            task
            for j in range(n)
            for task in _loads(c, j, 1, owner=wg1, after=(f"PV {j - 1}",))
            + _consumer(c, j, "", wg1, after=(f"V {j}",))
        ]
    if schedule == "producer_consumer":  # a producer warp keeps `stages` tiles in flight
        return [
            task
            for j in range(n)
            for task in _loads(c, j, stages) + _consumer(c, j, "", wg1, after=(f"PV {j - 1}",))
        ]
    if schedule == "pingpong":  # two warpgroups take turns on the tensor cores
        spec = _loads(c, 0, stages, ("a", "b")) + [
            ("QK^T 0a", "tensor cores", wg1, c.qk, ("K 0",)),
            ("QK^T 0b", "tensor cores", "warpgroup 2", c.qk, ("K 0",)),
        ]
        for j in range(n):
            spec += _loads(c, j + 1, stages, ("a", "b")) if j + 1 < n else []
            for wg, owner in (("a", wg1), ("b", "warpgroup 2")):
                spec += [
                    (f"exp {j}{wg}", "SFU", owner, c.exp, (f"QK^T {j}{wg}",)),
                    (f"PV {j}{wg}", "tensor cores", owner, c.pv, (f"exp {j}{wg}", f"V {j}")),
                ]
                if j + 1 < n:
                    deps = (f"K {j + 1}", f"PV {j}{wg}")
                    spec.append((f"QK^T {j + 1}{wg}", "tensor cores", owner, c.qk, deps))
        return spec
    # intra_warpgroup: issue QK^T of tile j, then PV of tile j-1, and run exp of j under PV j-1
    spec = _loads(c, 0, stages) + [
        ("QK^T 0", "tensor cores", wg1, c.qk, ("K 0",)),
        ("exp 0", "SFU", wg1, c.exp, ("QK^T 0",)),
    ]
    for j in range(1, n + 1):
        if j < n:
            spec += _loads(c, j, stages) + [
                (f"QK^T {j}", "tensor cores", wg1, c.qk, (f"K {j}", f"exp {j - 1}"))
            ]
        spec.append((f"PV {j - 1}", "tensor cores", wg1, c.pv, (f"exp {j - 1}", f"V {j - 1}")))
        if j < n:
            spec.append((f"exp {j}", "SFU", wg1, c.exp, (f"QK^T {j}",)))
    return spec


def timeline(
    costs: TileCosts, n_tiles: int, schedule: str = "producer_consumer", *, stages: int = 2
) -> Timeline:
    """Place the work of `n_tiles` K/V tiles on one SM's units under `schedule`.

    serial: load, QK^T, exp, PV of each tile in turn, nothing overlaps (a baseline).
    producer_consumer: a producer warp loads tiles through the TMA into `stages` shared-memory
      buffers while one consumer warpgroup computes (FA3 s3.1, warp specialisation).
    pingpong: two consumer warpgroups, each with its own query block, take turns on the tensor
      cores, so one's exponentials run under the other's matmuls (FA3 s3.1).
    intra_warpgroup: one warpgroup issues QK^T of tile j+1 and PV of tile j back to back and
      computes the softmax of tile j+1 under PV of tile j (FA3 s3.2, two-stage pipelining).

    Introduced in notebooks/11_hopper.ipynb.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    n = _count("n_tiles", n_tiles)
    stages = _count("stages", stages, lo=2 if schedule != "serial" else 1)
    tasks = _place(_spec(costs, n, schedule, stages))
    return Timeline(schedule, tasks, n * (2 if schedule == "pingpong" else 1))


_COLORS = {"producer": "#8c8c8c", "warpgroup 1": "#3b75af", "warpgroup 2": "#d1863d"}
_SHADE = {"QK^T": 1.0, "PV": 0.6, "exp": 0.85, "K": 1.0, "V": 0.6}
_LABEL = dict(ha="center", va="center", fontsize=6, color="white", clip_on=True)


def plot_timeline(tl: Timeline, ax=None, *, until: float | None = None):
    """Draw `tl` as one row per unit (microseconds on x), coloured by owner. Returns the axes.

    Introduced in notebooks/11_hopper.ipynb.
    """
    import matplotlib.pyplot as plt

    ax = ax if ax is not None else plt.subplots(figsize=(9, 1.8))[1]
    for t in tl.tasks:
        if until is not None and t.start >= until:
            continue
        row, kind, us = UNITS.index(t.unit), t.name.split()[0], (t.end - t.start) * 1e6
        look = dict(color=_COLORS[t.owner], alpha=_SHADE[kind], height=0.7, edgecolor="white")
        ax.barh(row, us, left=t.start * 1e6, **look)
        ax.text((t.start + t.end) / 2 * 1e6, row, kind, **_LABEL)
    ax.set_yticks(range(len(UNITS)), UNITS)
    ax.invert_yaxis()
    ax.set_xlim(0, (until or tl.total) * 1e6)
    ax.set_xlabel("microseconds on one SM")
    ax.set_title(f"{tl.schedule}: tensor cores busy {tl.tensor_core_utilisation:.0%}", fontsize=9)
    return ax
