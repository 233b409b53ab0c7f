"""What the hardware can do: GPU presets, FLOPs and exponentials over the visible area of the
mask, and the roofline that turns bytes, FLOPs and exponentials into a lower bound on time.

* `GPUS`: HBM size and bandwidth, SRAM per SM and per thread block, SM count, dense fp16/bf16
  rate and, where a source gives it, the special-function (exponential) rate. Data, not code.
* `attention_flops` / `exp_count`: matmul FLOPs and exponentials of attention, counted over the
  visible (query, key) pairs in O(1); `benchmark_flops` is the convention benchmarks report.
* `roofline`: time = max(bytes / bandwidth, FLOPs / matmul rate, exps / special-function rate).

Introduced in notebooks/00_memory_hierarchy.ipynb; `flashedu.traffic` re-exports everything here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..masks import visible_count
from ..validation import check_window
from .ledger import check_sizes as _sizes

# -------------------------------------------------------------------------------------- GPU presets


@dataclass(frozen=True)
class GPU:
    name: str
    hbm_bytes: float  # device memory
    hbm_bandwidth: float  # bytes / s
    sram_per_sm: int  # bytes of combined L1 / shared memory per SM
    smem_per_block: int  # bytes of shared memory one thread block may use
    sms: int
    dense_flops: float  # dense fp16/bf16 tensor-core FLOP/s, no sparsity
    source: str
    sfu_flops: float | None = None  # special-function (exp2, ...) results / s; None: not cited

    @property
    def ridge(self) -> float:
        """Arithmetic intensity (FLOP/byte) above which a kernel is compute-bound on this GPU."""
        return self.dense_flops / self.hbm_bandwidth

    @property
    def sfu_tflops(self) -> float | None:
        return None if self.sfu_flops is None else self.sfu_flops / 1e12


_A100_SRC = (
    "NVIDIA A100 Tensor Core GPU datasheet (2021) and NVIDIA A100 Tensor Core GPU Architecture "
    "whitepaper (2020): 108 SMs, 192 KB L1/shared per SM, of which up to 164 KB shared memory per "
    "SM and 163 KB per thread block, 312 TFLOP/s dense FP16/BF16"
)
_H100_SRC = (
    "NVIDIA H100 Tensor Core GPU datasheet (2023) and NVIDIA H100 Tensor Core GPU Architecture "
    "whitepaper (2022): H100 SXM5, 132 SMs, 256 KB L1/shared per SM (up to 227 KB shared per "
    "block), 989 TFLOP/s dense FP16/BF16"
)
_SFU_SRC = (
    "; special functions: FlashAttention-3 (Shah et al. 2024, arXiv:2407.08608, Sec. 3.1) gives "
    "the H100 SXM5 3.9 TFLOP/s of exponentials (multi-function units) against 989 TFLOP/s of FP16 "
    "matmul"
)
SFU_H100 = 3.9e12  # exponentials / s, FA3 Sec. 3.1

GPUS: dict[str, GPU] = {
    "A100-40GB": GPU(
        "NVIDIA A100 SXM4 40GB",
        40e9,
        1555e9,
        192 * 1024,
        163 * 1024,
        108,
        312e12,
        _A100_SRC + "; HBM2 40 GB at 1,555 GB/s",
    ),
    "A100-80GB": GPU(
        "NVIDIA A100 SXM4 80GB",
        80e9,
        2039e9,
        192 * 1024,
        163 * 1024,
        108,
        312e12,
        _A100_SRC + "; HBM2e 80 GB at 2,039 GB/s",
    ),
    "H100-SXM": GPU(
        "NVIDIA H100 SXM5 80GB",
        80e9,
        3.35e12,
        256 * 1024,
        227 * 1024,
        132,
        989.4e12,
        _H100_SRC + "; HBM3 80 GB at 3.35 TB/s" + _SFU_SRC,
        SFU_H100,
    ),
    "H200": GPU(
        "NVIDIA H200 SXM 141GB",
        141e9,
        4.8e12,
        256 * 1024,
        227 * 1024,
        132,
        989.4e12,
        "NVIDIA H200 Tensor Core GPU datasheet (2024): HBM3e 141 GB at 4.8 TB/s; the same Hopper "
        "GH100 compute (SMs, clocks, special-function units) as H100 SXM ("
        + _H100_SRC
        + _SFU_SRC
        + ")",
        SFU_H100,
    ),
}


def gpu_preset(gpu: GPU | str) -> GPU:
    """A preset by name (a GPU passes through); a ValueError lists the names."""
    if isinstance(gpu, GPU):
        return gpu
    if gpu not in GPUS:
        raise ValueError(f"gpu must be one of {list(GPUS)} or a traffic.GPU, got {gpu!r}")
    return GPUS[gpu]


def check_mask(name: str, causal, window_size):
    """causal a bool and window_size a valid (left, right) pair or None, else a named error."""
    if not isinstance(causal, bool):
        raise TypeError(f"{name}: causal must be a bool, got {causal!r}")
    return check_window(window_size, name=name)


# ---------------------------------------------------------------------------- FLOPs, roofline

PASSES = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}


def _pass(name: str, pass_: str) -> float:
    if pass_ not in PASSES:
        raise ValueError(f"{name}: pass_ must be one of {list(PASSES)}, got {pass_!r}")
    return PASSES[pass_]


def attention_flops(
    B: int,
    H: int,
    N_q: int,
    N_k: int,
    d: int,
    *,
    causal: bool = False,
    window_size: tuple[int, int] | None = None,
    pass_: str = "fwd",
) -> float:
    """Matmul FLOPs over the visible area of the mask: forward 4 d per visible (query, key) pair
    (two matmuls, 2 FLOPs per multiply-add), so 4 B H N_q N_k d unmasked, 4 B H d N (N + 1) / 2
    causal with N_q = N_k, and all 4 B H N_k d for causal N_q = 1 (that query sees every key);
    backward 2.5x forward (five matmuls, one the recomputed Q K^T); "fwd_bwd" 3.5x. Kernels that
    skip masked blocks still compute the masked part of an edge tile, which this count leaves out;
    `benchmark_flops` is the convention benchmarks report."""
    _sizes("attention_flops", B=B, H=H, N_q=N_q, N_k=N_k, d=d)
    window_size = check_mask("attention_flops", causal, window_size)
    area = visible_count(N_q, N_k, causal=causal, window_size=window_size)
    return 4.0 * B * H * d * area * _pass("attention_flops", pass_)


def benchmark_flops(
    B: int, H: int, N: int, d: int, *, causal: bool = False, pass_: str = "fwd"
) -> float:
    """The FLOPs benchmarks divide by (FlashAttention's and Triton's tutorial convention):
    4 B H N^2 d, halved when causal, 2.5x for the backward, 3.5x forward + backward. Use it to
    compare TFLOP/s with published figures; `attention_flops` counts the exact visible area."""
    _sizes("benchmark_flops", B=B, H=H, N=N, d=d)
    check_mask("benchmark_flops", causal, None)
    return 4.0 * B * H * N * N * d * (0.5 if causal else 1.0) * _pass("benchmark_flops", pass_)


def exp_count(
    B: int,
    H: int,
    N_q: int,
    N_k: int,
    *,
    causal: bool = False,
    window_size: tuple[int, int] | None = None,
    pass_: str = "fwd",
) -> float:
    """Exponentials: one per visible (query, key) pair and head in the forward (P = exp(S - m)),
    once more in the backward, which recomputes P; "fwd_bwd" twice. Causal N_q = N_k halves them,
    give or take the diagonal. The online softmax's rescaling adds one exp per row and key block,
    left out here."""
    _sizes("exp_count", B=B, H=H, N_q=N_q, N_k=N_k)
    window_size = check_mask("exp_count", causal, window_size)
    per = {"fwd": 1.0, "bwd": 1.0, "fwd_bwd": 2.0}
    if pass_ not in per:
        raise ValueError(f"exp_count: pass_ must be one of {list(per)}, got {pass_!r}")
    area = visible_count(N_q, N_k, causal=causal, window_size=window_size)
    return float(B * H * area) * per[pass_]


def exp_time(exps: float, gpu: GPU | str) -> float | None:
    """Seconds the special-function units need for `exps` exponentials at the preset's rate
    (FA3 Sec. 3.1: 3.9 T/s on an H100 SXM5, so at d = 128 the N^2 exponentials take about half the
    time of the 4 N^2 d matmul FLOPs at 989 TFLOP/s); None when the preset cites no rate."""
    g = gpu_preset(gpu)
    return None if g.sfu_flops is None else exps / g.sfu_flops


@dataclass(frozen=True)
class Roofline:
    flops: float
    nbytes: float
    t_memory: float  # s at full HBM bandwidth
    t_compute: float  # s at the dense tensor-core rate
    intensity: float  # FLOP / byte
    ridge: float  # FLOP / byte where the two times are equal
    t_exp: float = 0.0  # s on the special-function units (0 when not asked or not cited)

    @property
    def time(self) -> float:
        return max(self.t_memory, self.t_compute, self.t_exp)

    @property
    def bound(self) -> str:
        """ "memory", "compute" (matmuls) or "exp" (the special-function units), whichever is
        slowest."""
        if self.t_memory >= max(self.t_compute, self.t_exp):
            return "memory"
        return "compute" if self.t_compute >= self.t_exp else "exp"

    def explain(self) -> str:
        exp = f", exponentials {self.t_exp * 1e3:.3f} ms" if self.t_exp else ""
        return (
            f"{self.intensity:.1f} FLOP/byte vs ridge {self.ridge:.0f}: {self.bound}-bound, "
            f"memory {self.t_memory * 1e3:.3f} ms, compute {self.t_compute * 1e3:.3f} ms{exp}"
        )


def roofline(flops: float, nbytes: float, gpu: GPU | str, *, exps: float = 0.0) -> Roofline:
    """Lower-bound time of a kernel that does `flops` matmul FLOPs, `exps` exponentials and moves
    `nbytes` of HBM traffic on `gpu`: the slowest of the three ceilings (the exponentials count
    only where the preset cites a special-function rate)."""
    g = gpu_preset(gpu)
    t_exp = (exp_time(exps, g) or 0.0) if exps else 0.0
    return Roofline(
        flops,
        nbytes,
        nbytes / g.hbm_bandwidth,
        flops / g.dense_flops,
        flops / nbytes if nbytes else math.inf,
        g.ridge,
        t_exp,
    )
