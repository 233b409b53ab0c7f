"""The closed form of paged split-KV decoding's HBM bytes (`flashedu.kernels.paged`): what one
decode step moves, tensor by tensor, held equal byte for byte to `traffic.measure()` of the
kernels (tests/traffic/test_paged_bytes.py).

Decoding reads every key once, so its bytes are mostly the cache itself, and the time of a step is
those bytes over the HBM bandwidth: the number the serving benchmark
(scripts/serving/h200_paged_decode.py) divides by the measured time. Paging adds one int32 of the
block table per tile of keys; splitting adds the partial states, written by the split kernel and
read back by the combine.

Introduced in notebooks/12_serving.ipynb.
"""

from __future__ import annotations

from ..validation import check_int
from .ledger import Traffic

F32 = 4  # partial states, lse, sinks, block table and lengths: 4-byte words


def paged_split(lens, num_splits: int, block_n: int) -> int:
    """Keys per split, as `kernels.paged.plan` picks them: ceil(longest / num_splits) rounded up
    to whole tiles of block_n keys."""
    split = -(-max(max(lens), 1) // num_splits)
    return -(-split // block_n) * block_n


def paged_decode_bytes(
    lens,
    *,
    H: int,
    H_kv: int,
    N_q: int,
    d: int,
    d_v: int | None = None,
    block_n: int,
    num_splits: int,
    itemsize: int = 2,
    sinks: bool = False,
) -> Traffic:
    """HBM bytes of one call of `decoding.paged_forward` on sequences of lengths `lens` (B ints),
    by the kernels' tensor names.

    Split kernel, grid (num_splits, B * H_kv), one program per (split, sequence, K/V head):
      LENS    read 4 B per program (its sequence's length, from cache_seqlens);
      Q       read the group's N_q * H / H_kv rows of d, by programs whose split holds keys;
      TABLE   read one int32 of the block table per tile of block_n keys: ceil(len / block_n)
              per K/V head;
      K, V    read exactly the keys that exist, len * d (d_v) per K/V head: the last, partial
              page only up to the length, and never a page the table does not name;
      M_PART, L_PART, O_PART  written: one float32 state (m, l, o of d_v) per split and row.
    Combine kernel, one program per query row: reads every split's state (and SINKS, the row's
    sink), writes O (d_v in the inputs' dtype) and lse (float32).
    itemsize: bytes per element of q, the caches and o (2 for fp16 / bf16, 4 for fp32).
    """
    name = "traffic.paged_decode_bytes"
    lens = [check_int(n, "lens[i]", name=name, low=0) for n in lens]
    if not lens:
        raise ValueError(f"{name}: lens must list at least one sequence length")
    H, H_kv, N_q, d = (check_int(x, a, name=name) for x, a in ((H, "H"), (H_kv, "H_kv"),
                                                               (N_q, "N_q"), (d, "d")))  # fmt: skip
    d_v = d if d_v is None else check_int(d_v, "d_v", name=name)
    block_n = check_int(block_n, "block_n", name=name)
    S = check_int(num_splits, "num_splits", name=name)
    item = check_int(itemsize, "itemsize", name=name)
    B, rows = len(lens), len(lens) * H * N_q
    split = paged_split(lens, S, block_n)
    busy = sum(min(S, -(-n // split)) for n in lens)  # (split, sequence) pairs that hold keys
    states = S * rows * F32
    reads = {
        "LENS": S * B * H_kv * F32,
        "Q": busy * H * N_q * d * item,
        "TABLE": H_kv * sum(-(-n // block_n) for n in lens) * F32,
        "K": H_kv * sum(lens) * d * item,
        "V": H_kv * sum(lens) * d_v * item,
        "M_PART": states,
        "L_PART": states,
        "O_PART": states * d_v,
        "SINKS": rows * F32 if sinks else 0,
    }
    writes = {
        "M_PART": states,
        "L_PART": states,
        "O_PART": states * d_v,
        "O": rows * d_v * item,
        "lse": rows * F32,
    }
    return Traffic(reads, writes)
