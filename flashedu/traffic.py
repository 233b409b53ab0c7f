"""How many bytes move between HBM and SRAM: GPU presets, a ledger, closed forms and a roofline.

Three pieces, all pure Python:

* `GPUS`: data about real GPUs (HBM size and bandwidth, SRAM per SM, SM count, dense fp16/bf16
  rate), each with its source. Data, not code.
* `Ledger`: the instrumented algorithms (`naive`, `tiled`) report every HBM<->SRAM transfer to one,
  by tensor (Q, K, V, S, P, O, lse, dO, ...), direction ("read" = HBM -> SRAM,
  "write" = SRAM -> HBM) and bytes. A ledger can also hold an SRAM capacity, and refuses a tile set
  that does not fit.
* Closed forms (`naive_forward`, `naive_backward`, and the tiled ones) that the tests hold equal,
  byte for byte, to what the instrumented code reports; and `roofline`,
  time = max(bytes / bandwidth, flops / rate).

The paper's analysis: standard attention needs Theta(N d + N^2) HBM accesses, FlashAttention
Theta(N^2 d^2 / M) for SRAM size M (Dao et al. 2022, Theorem 2).

Introduced in notebooks/00_memory_hierarchy.ipynb; the tiled counts in
notebooks/03_tiled_forward.ipynb.
"""

from __future__ import annotations

import math
import numbers
from collections import defaultdict
from dataclasses import dataclass

from .kernel_traffic import (  # noqa: F401  (re-exported)
    Difference,
    MeasureError,
    Measurement,
    compare,
    measure,
)
from .ledger import (  # noqa: F401  (re-exported: the ledger is part of this module's story)
    NULL_LEDGER,
    Ledger,
    NullLedger,
    SramCapacityError,
    Traffic,
    Transfer,
    combine,
    tensor_order,
)

_order = tensor_order  # the sort key under its former name

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

    @property
    def ridge(self) -> float:
        """Arithmetic intensity (FLOP/byte) above which a kernel is compute-bound on this GPU."""
        return self.dense_flops / self.hbm_bandwidth


_A100_SRC = (
    "NVIDIA A100 Tensor Core GPU datasheet (2021) and NVIDIA A100 Tensor Core GPU Architecture "
    "whitepaper (2020): 108 SMs, 192 KB L1/shared per SM (up to 164 KB shared per block), "
    "312 TFLOP/s dense FP16/BF16"
)
_H100_SRC = (
    "NVIDIA H100 Tensor Core GPU datasheet (2023) and NVIDIA H100 Tensor Core GPU Architecture "
    "whitepaper (2022): H100 SXM5, 132 SMs, 256 KB L1/shared per SM (up to 227 KB shared per "
    "block), 989 TFLOP/s dense FP16/BF16"
)

GPUS: dict[str, GPU] = {
    "A100-40GB": GPU(
        "NVIDIA A100 SXM4 40GB",
        40e9,
        1555e9,
        192 * 1024,
        164 * 1024,
        108,
        312e12,
        _A100_SRC + "; HBM2 40 GB at 1,555 GB/s",
    ),
    "A100-80GB": GPU(
        "NVIDIA A100 SXM4 80GB",
        80e9,
        2039e9,
        192 * 1024,
        164 * 1024,
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
        _H100_SRC + "; HBM3 80 GB at 3.35 TB/s",
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
        "GH100 compute as H100 SXM (" + _H100_SRC + ")",
    ),
}

# ---------------------------------------------------------------------------------- FLOPs, roofline


def attention_flops(
    B: int, H: int, N_q: int, N_k: int, d: int, *, causal: bool = False, pass_: str = "fwd"
) -> float:
    """Matmul FLOPs: forward 4 B H N_q N_k d (two matmuls, 2 FLOPs per multiply-add), halved when
    causal (N_q == N_k); backward 2.5x forward (five matmuls, one is the recomputed Q K^T);
    "fwd_bwd" 3.5x."""
    f = 4.0 * B * H * N_q * N_k * d
    if causal:
        f *= 0.5
    return f * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[pass_]


@dataclass(frozen=True)
class Roofline:
    flops: float
    nbytes: float
    t_memory: float  # s at full HBM bandwidth
    t_compute: float  # s at the dense tensor-core rate
    intensity: float  # FLOP / byte
    ridge: float  # FLOP / byte where the two times are equal

    @property
    def time(self) -> float:
        return max(self.t_memory, self.t_compute)

    @property
    def bound(self) -> str:
        return "memory" if self.t_memory >= self.t_compute else "compute"

    def explain(self) -> str:
        return (
            f"{self.intensity:.1f} FLOP/byte vs ridge {self.ridge:.0f}: {self.bound}-bound, "
            f"memory {self.t_memory * 1e3:.3f} ms, compute {self.t_compute * 1e3:.3f} ms"
        )


def roofline(flops: float, nbytes: float, gpu: GPU | str) -> Roofline:
    """Lower-bound time of a kernel that does `flops` and moves `nbytes` of HBM traffic on `gpu`."""
    g = GPUS[gpu] if isinstance(gpu, str) else gpu
    return Roofline(
        flops,
        nbytes,
        nbytes / g.hbm_bandwidth,
        flops / g.dense_flops,
        flops / nbytes if nbytes else math.inf,
        g.ridge,
    )


# ------------------------------------------------------------------------------ closed forms: naive


def naive_forward(
    B: int, H: int, N_q: int, N_k: int, d: int, *, itemsize: int = 2, lse_itemsize: int = 4
) -> Traffic:
    """Standard attention (Dao et al. 2022, Algorithm 0), per (batch, head):
    read Q, K, write S; read S, write P (and lse); read P, V, write O. Theta(N d + N^2)."""
    bh, e = B * H, itemsize
    reads = {
        "Q": bh * N_q * d * e,
        "K": bh * N_k * d * e,
        "S": bh * N_q * N_k * e,
        "P": bh * N_q * N_k * e,
        "V": bh * N_k * d * e,
    }
    writes = {
        "S": bh * N_q * N_k * e,
        "P": bh * N_q * N_k * e,
        "O": bh * N_q * d * e,
        "lse": bh * N_q * lse_itemsize,
    }
    return Traffic(reads, writes)


def naive_backward(B: int, H: int, N_q: int, N_k: int, d: int, *, itemsize: int = 2) -> Traffic:
    """Standard backward (Dao et al. 2022, Algorithm 3), which reads the stored P:
    dV = P^T dO; dP = dO V^T; dS = P * (dP - rowsum(P * dP)); dQ = dS K; dK = dS^T Q."""
    bh, e = B * H, itemsize
    nq, nk, nn = bh * N_q * d * e, bh * N_k * d * e, bh * N_q * N_k * e
    reads = {"P": 2 * nn, "dO": 2 * nq, "V": nk, "dP": nn, "dS": 2 * nn, "K": nk, "Q": nq}
    writes = {"dV": nk, "dP": nn, "dS": nn, "dQ": nq, "dK": nk}
    return Traffic(reads, writes)


# ------------------------------------------------------------------------------ closed forms: flash

DEFAULT_SRAM_BYTES = 100 * 1024
"""SRAM budget for one thread block when none is given: about 100 KB, what an A100 kernel can count
on (164 KB of shared memory per block at most, part of which a real kernel spends on staging and
registers)."""


def block_sizes(sram_bytes: int, d: int, itemsize: int = 2) -> tuple[int, int]:
    """(block_m, block_n) = (B_r, B_c) by the paper's rule (Dao et al. 2022, Algorithm 1, line 1):
    B_c = ceil(M / 4d), B_r = min(B_c, d), with M = sram_bytes // itemsize the SRAM size in
    elements.

    The rule is an order-of-magnitude one: the tiles it picks (Q_i, K_j, V_j, O_i, S_ij, m, l) need
    between 0.75 M and 1.25 M elements, so `tile_bytes` of the result can exceed sram_bytes a
    little."""
    if not isinstance(d, numbers.Integral) or d < 1:
        raise ValueError(f"block_sizes: d must be a positive int, got {d!r}")
    if not isinstance(sram_bytes, numbers.Integral) or sram_bytes < itemsize:
        raise ValueError(
            f"block_sizes: sram_bytes must be an int >= itemsize={itemsize}, got {sram_bytes!r}"
        )
    M = sram_bytes // itemsize
    block_n = -(-M // (4 * d))
    return min(block_n, d), block_n


def tile_bytes(
    block_m: int, block_n: int, d: int, *, itemsize: int = 2, acc_itemsize: int = 4
) -> dict[str, int]:
    """SRAM bytes of the tiles one program of the tiled forward holds at once (for `Ledger.fit`):
    q_i, k_j, v_j in the input dtype; scores s_ij, the output accumulator o_i and the statistics
    m_i, l_i in the accumulation dtype."""
    return {
        "q_i": block_m * d * itemsize,
        "k_j": block_n * d * itemsize,
        "v_j": block_n * d * itemsize,
        "s_ij": block_m * block_n * acc_itemsize,
        "o_i": block_m * d * acc_itemsize,
        "m_i": block_m * acc_itemsize,
        "l_i": block_m * acc_itemsize,
    }


def band(N_q: int, N_k: int, *, causal: bool = False, window_size: tuple[int, int] | None = None):
    """(off, left, right): query i sees keys off + i - left ... off + i + right (-1 = unbounded
    side), with off = N_k - N_q (bottom-right alignment) and causal folded in as right = 0."""
    left, right = window_size if window_size is not None else (-1, -1)
    return N_k - N_q, left, (0 if causal else right)


def kv_blocks(
    r0: int,
    r1: int,
    N_q: int,
    N_k: int,
    block_n: int,
    *,
    causal: bool = False,
    window_size: tuple[int, int] | None = None,
) -> range:
    """Indices j of the K/V blocks [j block_n, (j+1) block_n) that query rows [r0, r1) can see at
    least one key of; every other block is skipped whole. Bottom-right alignment, as in
    `masks.visible`.

    Row i sees keys [i + N_k - N_q - left, i + N_k - N_q + right]; consecutive rows shift that
    interval by one, so the rows of a block together see one contiguous run of keys."""
    off, left, right = band(N_q, N_k, causal=causal, window_size=window_size)
    lo = max(0, r0 + off - left) if left >= 0 else 0
    hi = min(N_k - 1, r1 - 1 + off + right) if right >= 0 else N_k - 1
    return range(lo // block_n, hi // block_n + 1) if lo <= hi else range(0)


def _row_blocks(N: int, block: int) -> list[tuple[int, int]]:
    return [(r0, min(r0 + block, N)) for r0 in range(0, N, block)]


def _keys_in(js, block_n: int, N_k: int) -> int:
    """Number of keys in the K/V blocks js (the last block may be short)."""
    return sum(min(block_n, N_k - j * block_n) for j in js)


def _check_order(order: str) -> str:
    if order not in ("fa1", "fa2"):
        raise ValueError(
            f"order must be 'fa2' (outer loop over query blocks) or 'fa1' (outer loop over "
            f"K/V blocks), got {order!r}"
        )
    return order


def flash_forward(
    B: int,
    H: int,
    N_q: int,
    N_k: int,
    d: int,
    *,
    block_m: int,
    block_n: int,
    order: str = "fa2",
    causal: bool = False,
    window_size: tuple[int, int] | None = None,
    itemsize: int = 2,
    lse_itemsize: int = 4,
) -> Traffic:
    """HBM traffic of the tiled forward (`tiled.forward`), exactly, for either loop order.

    fa2 (outer loop over query blocks; Dao 2023, Algorithm 1): per query block, read Q_i once and
    the K_j, V_j of every visible block; write O_i and lse_i once. K and V are read
    ceil(N_q / block_m) times.
    fa1 (outer loop over K/V blocks; Dao et al. 2022, Algorithm 1): initialise O, m, l in HBM; read
    each visible K_j, V_j once; for every visible tile read Q_i, O_i, m_i, l_i and write O_i, m_i,
    l_i back; a last pass reads m, l and writes lse. Q and O move ceil(N_k / block_n) times.
    Blocks wholly hidden by the causal or window mask are never loaded; a query block that sees
    nothing does not load Q_i (fa2). Every (batch, head) pair reads its own tiles, so with GQA K and
    V count H times.
    """
    _check_order(order)
    row, stat = (
        B * H * d * itemsize,
        B * H * lse_itemsize,
    )  # bytes of one row of Q/K/V/O; of m, l, lse
    reads: dict[str, int] = defaultdict(int)
    writes: dict[str, int] = defaultdict(int)
    seen: set[int] = set()
    for r0, r1 in _row_blocks(N_q, block_m):
        js = kv_blocks(r0, r1, N_q, N_k, block_n, causal=causal, window_size=window_size)
        if order == "fa2":
            reads["Q"] += (r1 - r0) * row if len(js) else 0
            reads["K"] += _keys_in(js, block_n, N_k) * row
            reads["V"] += _keys_in(js, block_n, N_k) * row
        else:
            seen.update(js)
            for t, size in (("Q", row), ("O", row), ("m", stat), ("l", stat)):
                reads[t] += len(js) * (r1 - r0) * size
                if t != "Q":
                    writes[t] += len(js) * (r1 - r0) * size
    writes["O"] += N_q * row
    writes["lse"] += N_q * stat
    if order == "fa1":
        reads["K"] = reads["V"] = _keys_in(seen, block_n, N_k) * row
        for t in ("m", "l"):  # initialised in HBM, then read once more to form lse
            writes[t] += N_q * stat
            reads[t] += N_q * stat
    return Traffic(reads, writes)


def flash_backward(
    B: int,
    H: int,
    N_q: int,
    N_k: int,
    d: int,
    *,
    block_m: int,
    block_n: int,
    causal: bool = False,
    window_size: tuple[int, int] | None = None,
    itemsize: int = 2,
    lse_itemsize: int = 4,
    H_kv: int | None = None,
) -> Traffic:
    """HBM traffic of the backward by recomputation (`tiled.backward`; Dao 2023, Algorithm 2),
    exactly.

    Preprocess: read dO and O, write D = rowsum(dO * O); zero the dQ accumulator (lse_itemsize per
    entry). Outer loop over K/V blocks: read K_j, V_j if any tile of the column is visible; for each
    visible tile read Q_i, dO_i, lse_i, D_i and read-modify-write dQ_i (an atomic add on a GPU);
    write dK_j, dV_j. Finally read the dQ accumulator and write dQ in the input dtype. With GQA
    (H_kv < H) each query head writes its own dK, dV, which one more pass sums into the H_kv heads.
    Nothing of size N_q x N_k moves.
    """
    H_kv = H if H_kv is None else H_kv
    row, stat, acc_row = B * H * d * itemsize, B * H * lse_itemsize, B * H * d * lse_itemsize
    reads: dict[str, int] = defaultdict(int, {"dO": N_q * row, "O": N_q * row})
    writes: dict[str, int] = defaultdict(int, {"D": N_q * stat, "dQ": N_q * acc_row})
    seen: set[int] = set()
    for r0, r1 in _row_blocks(N_q, block_m):
        js = kv_blocks(r0, r1, N_q, N_k, block_n, causal=causal, window_size=window_size)
        seen.update(js)
        n = len(js) * (r1 - r0)  # query rows processed, summed over visible tiles
        for t, size in (("Q", row), ("dO", row), ("lse", stat), ("D", stat), ("dQ", acc_row)):
            reads[t] += n * size
        writes["dQ"] += n * acc_row
    reads["K"] = reads["V"] = _keys_in(seen, block_n, N_k) * row
    writes["dK"] = writes["dV"] = N_k * row
    reads["dQ"] += N_q * acc_row
    writes["dQ"] += N_q * row
    if H_kv != H:
        for t in ("dK", "dV"):
            reads[t] += N_k * row
            writes[t] += B * H_kv * N_k * d * itemsize
    return Traffic(reads, writes)


def saved_for_backward(
    B: int, H: int, N_q: int, N_k: int, d: int, *, itemsize: int = 2, lse_itemsize: int = 4
) -> dict[str, int]:
    """Bytes each method keeps from forward to backward besides the inputs Q, K, V:
    "naive" keeps P (B H N_q N_k, the O(N^2) term); "flash" keeps O and lse (B H N_q (d + 1),
    O(N))."""
    return {
        "naive": B * H * N_q * N_k * itemsize,
        "flash": B * H * N_q * (d * itemsize + lse_itemsize),
    }


PAPER_GPT2_MEDIUM = {
    "setting": (
        "GPT-2 medium attention: N=1024, d=64, 16 heads, batch 64, fp16, A100; forward + backward"
    ),
    "source": "Dao et al. 2022, FlashAttention, arXiv:2205.14135, Figure 2 (left)",
    "standard": {"gflops": 66.6, "hbm_gb": 40.3, "runtime_ms": 41.7},
    "flash": {"gflops": 75.2, "hbm_gb": 4.4, "runtime_ms": 7.3},
}


def paper_gpt2_medium(
    *, sram_bytes: int = DEFAULT_SRAM_BYTES, causal: bool = False, gpu: str = "A100-40GB"
):
    """The model's numbers for the paper's GPT-2 medium comparison, beside the paper's measurements.

    Standard = `naive_forward` + `naive_backward`; FlashAttention = FA1-order `flash_forward` (the
    loop order of the paper being compared) + `flash_backward`, blocks by the paper's rule for
    `sram_bytes`. FLOPs are matmul FLOPs (`attention_flops`): 3x the forward for standard (two
    forward matmuls, four backward; all N^2 scores even when causal), 3.5x for FlashAttention (the
    backward recomputes Q K^T; halved when causal). Time is the roofline lower bound on `gpu`.
    Returns one dict per row: method, source, hbm_gb, gflops, ms (None where the paper gives no
    figure).
    """
    B, H, N, d = 64, 16, 1024, 64
    block_m, block_n = block_sizes(sram_bytes, d, 2)
    std = combine(naive_forward(B, H, N, N, d), naive_backward(B, H, N, N, d))
    fl = combine(
        flash_forward(B, H, N, N, d, block_m=block_m, block_n=block_n, order="fa1", causal=causal),
        flash_backward(B, H, N, N, d, block_m=block_m, block_n=block_n, causal=causal),
    )
    std_flops = 3.0 * attention_flops(B, H, N, N, d)  # standard computes every score, masked or not
    fl_flops = 3.5 * attention_flops(
        B, H, N, N, d, causal=causal
    )  # skipped blocks are never computed
    rows = []
    for method, t, flops in (("standard", std, std_flops), ("flash", fl, fl_flops)):
        r = roofline(flops, t.total_bytes, gpu)
        rows.append(
            {
                "method": method,
                "source": "model",
                "hbm_gb": t.total_bytes / 1e9,
                "gflops": flops / 1e9,
                "ms": r.time * 1e3,
                "bound": r.bound,
            }
        )
        paper = PAPER_GPT2_MEDIUM[method]
        rows.append(
            {
                "method": method,
                "source": "paper",
                "hbm_gb": paper["hbm_gb"],
                "gflops": paper["gflops"],
                "ms": paper["runtime_ms"],
                "bound": None,
            }
        )
    return rows
