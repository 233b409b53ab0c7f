"""How many bytes move between HBM and SRAM: GPU presets, a ledger, closed forms and a roofline.

Three pieces, all pure Python:

* `GPUS`: data about real GPUs (HBM size and bandwidth, SRAM per SM, SM count, dense fp16/bf16 rate), each
  with its source. Data, not code.
* `Ledger`: the instrumented algorithms (`naive`, `tiled`) report every HBM<->SRAM transfer to one, by
  tensor (Q, K, V, S, P, O, lse, dO, ...), direction ("read" = HBM -> SRAM, "write" = SRAM -> HBM) and bytes.
  A ledger can also hold an SRAM capacity, and refuses a tile set that does not fit.
* Closed forms (`naive_forward`, `naive_backward`, and the tiled ones) that the tests hold equal, byte for
  byte, to what the instrumented code reports; and `roofline`, time = max(bytes / bandwidth, flops / rate).

The paper's analysis: standard attention needs Theta(N d + N^2) HBM accesses, FlashAttention
Theta(N^2 d^2 / M) for SRAM size M (Dao et al. 2022, Theorem 2).

Introduced in notebooks/00_memory_hierarchy.ipynb; the tiled counts in notebooks/03_tiled_forward.ipynb.
"""
from __future__ import annotations

import math
import numbers
from collections import defaultdict
from dataclasses import dataclass, field

# --------------------------------------------------------------------------------------------- GPU presets


@dataclass(frozen=True)
class GPU:
    name: str
    hbm_bytes: float            # device memory
    hbm_bandwidth: float        # bytes / s
    sram_per_sm: int            # bytes of combined L1 / shared memory per SM
    smem_per_block: int         # bytes of shared memory one thread block may use
    sms: int
    dense_flops: float          # dense fp16/bf16 tensor-core FLOP/s, no sparsity
    source: str

    @property
    def ridge(self) -> float:
        """Arithmetic intensity (FLOP/byte) above which a kernel is compute-bound on this GPU."""
        return self.dense_flops / self.hbm_bandwidth


_A100_SRC = ("NVIDIA A100 Tensor Core GPU datasheet (2021) and NVIDIA A100 Tensor Core GPU Architecture "
             "whitepaper (2020): 108 SMs, 192 KB L1/shared per SM (up to 164 KB shared per block), "
             "312 TFLOP/s dense FP16/BF16")
_H100_SRC = ("NVIDIA H100 Tensor Core GPU datasheet (2023) and NVIDIA H100 Tensor Core GPU Architecture "
             "whitepaper (2022): H100 SXM5, 132 SMs, 256 KB L1/shared per SM (up to 227 KB shared per block), "
             "989 TFLOP/s dense FP16/BF16")

GPUS: dict[str, GPU] = {
    "A100-40GB": GPU("NVIDIA A100 SXM4 40GB", 40e9, 1555e9, 192 * 1024, 164 * 1024, 108, 312e12,
                     _A100_SRC + "; HBM2 40 GB at 1,555 GB/s"),
    "A100-80GB": GPU("NVIDIA A100 SXM4 80GB", 80e9, 2039e9, 192 * 1024, 164 * 1024, 108, 312e12,
                     _A100_SRC + "; HBM2e 80 GB at 2,039 GB/s"),
    "H100-SXM": GPU("NVIDIA H100 SXM5 80GB", 80e9, 3.35e12, 256 * 1024, 227 * 1024, 132, 989.4e12,
                    _H100_SRC + "; HBM3 80 GB at 3.35 TB/s"),
    "H200": GPU("NVIDIA H200 SXM 141GB", 141e9, 4.8e12, 256 * 1024, 227 * 1024, 132, 989.4e12,
                "NVIDIA H200 Tensor Core GPU datasheet (2024): HBM3e 141 GB at 4.8 TB/s; the same Hopper "
                "GH100 compute as H100 SXM (" + _H100_SRC + ")"),
}

# --------------------------------------------------------------------------------------------- the ledger


class SramCapacityError(ValueError):
    """A tile set does not fit the SRAM budget given to the algorithm."""


@dataclass(frozen=True)
class Transfer:
    tensor: str       # "Q", "K", "V", "S", "P", "O", "lse", "dO", "D", "dQ", "dK", "dV", "dP", "dS"
    direction: str    # "read": HBM -> SRAM; "write": SRAM -> HBM
    nbytes: int
    step: int         # index into Ledger.steps of the step that was current (-1 before the first)


@dataclass
class Ledger:
    """Records every HBM <-> SRAM transfer of an instrumented algorithm.

    sram_bytes: optional capacity; `fit()` raises SramCapacityError when a tile set exceeds it.
    steps: one dict per algorithm step (`step(...)`), e.g. {"i": 0, "j": 2, "skipped": False, "m": ..., "l": ...},
    which the tile stepper widget replays.
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
        """Mark the start of an algorithm step; `state` is kept for replay (tile indices, m, l, ...)."""
        self.steps.append(dict(state))

    def fit(self, **tiles: int) -> None:
        """Check that tiles resident in SRAM at once (name=bytes, for one program) fit the capacity."""
        total = sum(int(b) for b in tiles.values())
        self.peak_sram = max(self.peak_sram, total)
        if self.sram_bytes is not None and total > self.sram_bytes:
            parts = ", ".join(f"{k}={v:,} B" for k, v in tiles.items())
            raise SramCapacityError(f"tile set needs {total:,} bytes of SRAM ({parts}) but the budget is "
                                    f"sram_bytes={self.sram_bytes:,}: use smaller block_m / block_n")

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
        names = sorted(set(self.reads) | set(self.writes), key=_order)
        lines = [f"{'tensor':<7}{'read':>16}{'written':>16}"]
        for n in names:
            lines.append(f"{n:<7}{self.reads.get(n, 0):>16,}{self.writes.get(n, 0):>16,}")
        lines.append(f"{'total':<7}{self.read_bytes:>16,}{self.write_bytes:>16,}")
        return "\n".join(lines)


_TENSOR_ORDER = ["Q", "K", "V", "S", "P", "O", "lse", "dO", "D", "dP", "dS", "dQ", "dK", "dV"]


def _order(name: str):
    return (_TENSOR_ORDER.index(name) if name in _TENSOR_ORDER else len(_TENSOR_ORDER), name)


# --------------------------------------------------------------------------------------------- FLOPs, roofline


def attention_flops(B: int, H: int, N_q: int, N_k: int, d: int, *, causal: bool = False, pass_: str = "fwd") -> float:
    """Matmul FLOPs: forward 4 B H N_q N_k d (two matmuls, 2 FLOPs per multiply-add), halved when causal
    (N_q == N_k); backward 2.5x forward (five matmuls, one is the recomputed Q K^T); "fwd_bwd" 3.5x."""
    f = 4.0 * B * H * N_q * N_k * d
    if causal:
        f *= 0.5
    return f * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[pass_]


@dataclass(frozen=True)
class Roofline:
    flops: float
    nbytes: float
    t_memory: float       # s at full HBM bandwidth
    t_compute: float      # s at the dense tensor-core rate
    intensity: float      # FLOP / byte
    ridge: float          # FLOP / byte where the two times are equal

    @property
    def time(self) -> float:
        return max(self.t_memory, self.t_compute)

    @property
    def bound(self) -> str:
        return "memory" if self.t_memory >= self.t_compute else "compute"

    def explain(self) -> str:
        return (f"{self.intensity:.1f} FLOP/byte vs ridge {self.ridge:.0f}: {self.bound}-bound, "
                f"memory {self.t_memory * 1e3:.3f} ms, compute {self.t_compute * 1e3:.3f} ms")


def roofline(flops: float, nbytes: float, gpu: GPU | str) -> Roofline:
    """Lower-bound time of a kernel that does `flops` and moves `nbytes` of HBM traffic on `gpu`."""
    g = GPUS[gpu] if isinstance(gpu, str) else gpu
    return Roofline(flops, nbytes, nbytes / g.hbm_bandwidth, flops / g.dense_flops,
                    flops / nbytes if nbytes else math.inf, g.ridge)


# --------------------------------------------------------------------------------------------- closed forms: naive


def naive_forward(B: int, H: int, N_q: int, N_k: int, d: int, *, itemsize: int = 2, lse_itemsize: int = 4) -> Traffic:
    """Standard attention (Dao et al. 2022, Algorithm 0), per (batch, head):
    read Q, K, write S; read S, write P (and lse); read P, V, write O. Theta(N d + N^2)."""
    bh, e = B * H, itemsize
    reads = {"Q": bh * N_q * d * e, "K": bh * N_k * d * e, "S": bh * N_q * N_k * e,
             "P": bh * N_q * N_k * e, "V": bh * N_k * d * e}
    writes = {"S": bh * N_q * N_k * e, "P": bh * N_q * N_k * e, "O": bh * N_q * d * e, "lse": bh * N_q * lse_itemsize}
    return Traffic(reads, writes)


def naive_backward(B: int, H: int, N_q: int, N_k: int, d: int, *, itemsize: int = 2) -> Traffic:
    """Standard backward (Dao et al. 2022, Algorithm 3), which reads the stored P:
    dV = P^T dO; dP = dO V^T; dS = P * (dP - rowsum(P * dP)); dQ = dS K; dK = dS^T Q."""
    bh, e = B * H, itemsize
    nq, nk, nn = bh * N_q * d * e, bh * N_k * d * e, bh * N_q * N_k * e
    reads = {"P": 2 * nn, "dO": 2 * nq, "V": nk, "dP": nn, "dS": 2 * nn, "K": nk, "Q": nq}
    writes = {"dV": nk, "dP": nn, "dS": nn, "dQ": nq, "dK": nk}
    return Traffic(reads, writes)


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
