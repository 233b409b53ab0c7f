"""The closed forms: how many bytes move between HBM and SRAM, for standard attention and for
FlashAttention's forward and backward. The rest of `flashedu.traffic` is in its sibling modules:

* `GPUS`: data about real GPUs (HBM size and bandwidth, SRAM per SM and per thread block, SM count,
  dense fp16/bf16 rate, special-function rate), each with its source. Data, not code.
* `Ledger` (`traffic.ledger`): the instrumented algorithms (`naive`, `tiled`) report every
  HBM<->SRAM transfer to one, by tensor (Q, K, V, S, P, O, lse, dO, ...), direction ("read" =
  HBM -> SRAM, "write" = SRAM -> HBM) and bytes.
* `measure()` (`traffic.measured`): fills a Ledger from the loads and stores of Triton
  kernels run under the interpreter, the package's or the learner's; `compare` says in words where
  a measured run and a closed form differ.
* Closed forms (`naive_forward`, `naive_backward`, `flash_forward`, `flash_backward`) that the tests
  hold equal, byte for byte, to what the instrumented code reports and what the Triton kernels are
  measured to move. They cost O(1) or O(number of query blocks), so they answer at N = 10^7.
* `roofline`: time = max(bytes / bandwidth, flops / matmul rate, exponentials / special-function
  rate); `attention_flops` and `exp_count` count the visible area of the mask.
* Tile sizes (`traffic.tiles`): the paper's rule and the powers of two that fit.

The paper's analysis: standard attention needs Theta(N d + N^2) HBM accesses, FlashAttention
Theta(N^2 d^2 / M) for SRAM size M (Dao et al. 2022, Theorem 2).

Introduced in notebooks/00_memory_hierarchy.ipynb; the tiled counts in
notebooks/03_tiled_forward.ipynb; the measured bytes in notebooks/06_triton_forward.ipynb.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..masks import keys_in_blocks, kv_block_spans
from ..validation import check_order
from .hardware import attention_flops, check_mask, roofline
from .ledger import Traffic, combine
from .ledger import check_sizes as _sizes
from .tiles import block_sizes

# ------------------------------------------------------------------------------ closed forms: naive


def naive_forward(
    B: int, H: int, N_q: int, N_k: int, d: int, *, itemsize: int = 2, lse_itemsize: int = 4
) -> Traffic:
    """Standard attention (Dao et al. 2022, Algorithm 0), per (batch, head): read Q, K, write S;
    read S, write P; read P, V, write O. Theta(N d + N^2). Algorithm 0 writes nothing else;
    `naive.forward` also writes the row lse (lse_itemsize bytes a row), which its backward uses."""
    _sizes(
        "naive_forward",
        B=B,
        H=H,
        N_q=N_q,
        N_k=N_k,
        d=d,
        itemsize=itemsize,
        lse_itemsize=lse_itemsize,
    )
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
    _sizes("naive_backward", B=B, H=H, N_q=N_q, N_k=N_k, d=d, itemsize=itemsize)
    bh, e = B * H, itemsize
    nq, nk, nn = bh * N_q * d * e, bh * N_k * d * e, bh * N_q * N_k * e
    reads = {"P": 2 * nn, "dO": 2 * nq, "V": nk, "dP": nn, "dS": 2 * nn, "K": nk, "Q": nq}
    writes = {"dV": nk, "dP": nn, "dS": nn, "dQ": nq, "dK": nk}
    return Traffic(reads, writes)


# ------------------------------------------------------------------------------ closed forms: flash

DEFAULT_SRAM_BYTES = 100 * 1024
"""SRAM budget for one thread block when none is given: about 100 KB, what an A100 kernel can count
on (163 KB of shared memory per thread block at most, part of which a real kernel spends on staging
and registers)."""


@dataclass(frozen=True)
class _Tiles:
    """Sums over the visible tiles, in rows and keys (Python ints: no overflow at any N)."""

    q_rows: int  # rows of the query blocks that see at least one key
    tile_rows: int  # query rows summed over visible tiles (rows x visible K/V blocks)
    tile_keys: int  # keys summed over visible tiles (each query block's visible keys)
    seen_keys: int  # keys in the K/V blocks some query block sees (one contiguous run)


MAX_QUERY_BLOCKS = 2**20  # the tiled closed forms keep a few ints per query block


def check_query_blocks(name: str, N_q: int, block_m: int, arg: str = "N_q") -> None:
    """The tiled models sum over query blocks with arrays of ceil(N_q / block_m) ints: past
    MAX_QUERY_BLOCKS blocks (N = 10^18, say) that would be a MemoryError, so it is refused."""
    blocks = -(-N_q // block_m)
    if blocks > MAX_QUERY_BLOCKS:
        raise ValueError(
            f"{name}: {arg}={N_q:,} in blocks of {block_m} rows is {blocks:.3g} query blocks, more "
            f"than the model sums over ({MAX_QUERY_BLOCKS:,}: {arg} up to "
            f"{MAX_QUERY_BLOCKS * block_m:,} with block_m={block_m})"
        )


def _tiles(name, N_q, N_k, block_m, block_n, causal, window_size) -> _Tiles:
    window_size = check_mask(name, causal, window_size)
    check_query_blocks(name, N_q, block_m)
    rows, first, stop = kv_block_spans(
        N_q, N_k, block_m, block_n, causal=causal, window_size=window_size
    )
    seen = stop > first
    keys = keys_in_blocks(first, stop, N_k, block_n)
    seen_keys = 0
    if seen.any():
        j0, j1 = int(first[seen].min()), int(stop[seen].max())
        seen_keys = min(j1 * block_n, N_k) - j0 * block_n
    return _Tiles(
        int(rows[seen].sum()), int((rows * (stop - first)).sum()), int(keys.sum()), seen_keys
    )


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
    nothing does not load Q_i (fa2; the Triton kernel loads it anyway, see
    `triton_forward_extra`). Every (batch, head) pair reads its own tiles, so with GQA K and V
    count H times. O(number of query blocks) time.
    """
    check_order(order, name="flash_forward")
    _sizes(
        "flash_forward",
        B=B,
        H=H,
        N_q=N_q,
        N_k=N_k,
        d=d,
        block_m=block_m,
        block_n=block_n,
        itemsize=itemsize,
        lse_itemsize=lse_itemsize,
    )
    t = _tiles("flash_forward", N_q, N_k, block_m, block_n, causal, window_size)
    row, stat = B * H * d * itemsize, B * H * lse_itemsize  # one row of Q/K/V/O; of m, l, lse
    if order == "fa2":
        reads = {"Q": t.q_rows * row, "K": t.tile_keys * row, "V": t.tile_keys * row}
        return Traffic(reads, {"O": N_q * row, "lse": N_q * stat})
    reads = {
        "Q": t.tile_rows * row,
        "K": t.seen_keys * row,
        "V": t.seen_keys * row,
        "O": t.tile_rows * row,
        "m": (t.tile_rows + N_q) * stat,  # + one last read of m and l to form lse
        "l": (t.tile_rows + N_q) * stat,
    }
    writes = {
        "O": (t.tile_rows + N_q) * row,  # initialised in HBM, then rewritten per visible tile
        "m": (t.tile_rows + N_q) * stat,
        "l": (t.tile_rows + N_q) * stat,
        "lse": N_q * stat,
    }
    return Traffic(reads, writes)


def triton_forward_extra(
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
) -> Traffic:
    """What `kernels.forward` moves beyond `flash_forward` (FA2 order): it loads Q_i for
    every query block, also one that sees no key (causal with N_q > N_k, or a window), to write
    its zero output. Zero bytes whenever every query block sees a key."""
    _sizes("triton_forward_extra", B=B, H=H, N_q=N_q, N_k=N_k, d=d, itemsize=itemsize)
    t = _tiles("triton_forward_extra", N_q, N_k, block_m, block_n, causal, window_size)
    return Traffic({"Q": (N_q - t.q_rows) * B * H * d * itemsize}, {})


BACKWARD_VARIANTS = ("atomic", "two_pass")


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
    variant: str = "atomic",
) -> Traffic:
    """HBM traffic of the backward by recomputation (Dao 2023, Algorithm 2), exactly.

    Both variants start with a preprocess: read dO and O, write D = rowsum(dO * O).
    variant="atomic" (`tiled.backward`): zero a dQ accumulator (lse_itemsize per entry); outer loop
    over K/V blocks: read K_j, V_j if any tile of the column is visible; for each visible tile read
    Q_i, dO_i, lse_i, D_i and read-modify-write dQ_i (an atomic add on a GPU); write dK_j, dV_j.
    Finally read the dQ accumulator and write dQ in the input dtype. With GQA (H_kv < H) each query
    head writes its own dK, dV, which one more pass sums into the H_kv heads.
    variant="two_pass" (`kernels.backward`): no accumulator and no atomics. A dK/dV pass,
    one program per K/V block and K/V head, reads K_j, V_j (every block, as the kernel does) and,
    for each query head of its group and each visible tile, Q_i, dO_i, lse_i, D_i; it writes dK_j,
    dV_j once per K/V head. A dQ pass, one program per query block and head, reads Q_i, dO_i,
    lse_i, D_i once and the K_j, V_j of each visible tile, and writes dQ_i. Q, dO, lse and D are
    read once more than in the atomic variant, and K, V ceil(N_q / block_m) times instead of once:
    the price of a deterministic dQ.
    Nothing of size N_q x N_k moves. O(number of query blocks) time.
    """
    H_kv = H if H_kv is None else H_kv
    _sizes(
        "flash_backward",
        B=B,
        H=H,
        N_q=N_q,
        N_k=N_k,
        d=d,
        block_m=block_m,
        block_n=block_n,
        itemsize=itemsize,
        lse_itemsize=lse_itemsize,
        H_kv=H_kv,
    )
    if H % H_kv:
        raise ValueError(f"flash_backward: H={H} must be a multiple of H_kv={H_kv}")
    if variant not in BACKWARD_VARIANTS:
        raise ValueError(
            f"flash_backward: variant must be one of {list(BACKWARD_VARIANTS)}, got {variant!r}"
        )
    t = _tiles("flash_backward", N_q, N_k, block_m, block_n, causal, window_size)
    row, stat, acc_row = B * H * d * itemsize, B * H * lse_itemsize, B * H * d * lse_itemsize
    kv_row = B * H_kv * d * itemsize
    if variant == "two_pass":
        n = t.tile_rows + N_q  # dK/dV pass per visible tile, then the dQ pass once per row
        reads = {"Q": n * row, "dO": (n + N_q) * row, "O": N_q * row, "lse": n * stat}
        reads |= {"D": n * stat, "K": N_k * kv_row + t.tile_keys * row}
        reads["V"] = reads["K"]
        writes = {"D": N_q * stat, "dQ": N_q * row, "dK": N_k * kv_row, "dV": N_k * kv_row}
        return Traffic(reads, writes)
    n = t.tile_rows
    reads = {"Q": n * row, "dO": (n + N_q) * row, "O": N_q * row, "lse": n * stat, "D": n * stat}
    reads |= {"dQ": (n + N_q) * acc_row, "K": t.seen_keys * row, "V": t.seen_keys * row}
    writes = {"D": N_q * stat, "dQ": (n + N_q) * acc_row + N_q * row}
    writes |= {"dK": N_k * row, "dV": N_k * row}
    if H_kv != H:
        for name in ("dK", "dV"):
            reads[name] = N_k * row
            writes[name] += N_k * kv_row
    return Traffic(reads, writes)


def saved_for_backward(
    B: int, H: int, N_q: int, N_k: int, d: int, *, itemsize: int = 2, lse_itemsize: int = 4
) -> dict[str, int]:
    """Bytes each method keeps from forward to backward besides the inputs Q, K, V:
    "naive" keeps P (B H N_q N_k, the O(N^2) term); "flash" keeps O and lse (B H N_q (d + 1),
    O(N))."""
    _sizes(
        "saved_for_backward",
        B=B,
        H=H,
        N_q=N_q,
        N_k=N_k,
        d=d,
        itemsize=itemsize,
        lse_itemsize=lse_itemsize,
    )
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
