"""Tile loads and stores for any head dim: the block is padded to a power of two, the loads masked.

`tl.arange` and `tl.dot` need power-of-two extents, and a GPU's `tl.dot` needs at least 16 along
each side, so a head dim d (1 to 256) is held in a tile of `pad_dim(d)` columns: the next power of
two, at least 16. The columns past d are never read from HBM (the load is masked and fills 0) and
never written back (the store is masked). Zero columns change nothing: they add 0 to every q . k
and give 0 columns in p @ v, which the store drops. The inputs are never copied or padded in
memory.

When d is already a power of two >= 16 the column mask is left out at compile time (`D == BLOCK_D`
is a constexpr test), so the head dims the kernels were tuned on compile exactly as before.

Padding wastes work: d = 192 in a 256-wide tile spends a quarter of every matmul on zeros. A head
dim can instead be held in two chunks (`chunk_dims`): 192 = 128 + 64, 96 = 64 + 32, 80 = 64 + 16,
each a power of two, the second masked like a padded tile; every product over d becomes two
`tl.dot`s added into one accumulator, and every product onto d two accumulators. The kernels take
the second chunk's width as a constexpr (0: one chunk, the code above).
The key and the value may have different head dims (E and Ev, as in PyTorch's SDPA): each tile is
loaded with its own.

Introduced in notebooks/06_triton_forward.ipynb.
"""

from __future__ import annotations

import triton
import triton.language as tl

MAX_HEAD_DIM = 256


def _next_power_of_2(n: int) -> int:
    """triton.next_power_of_2 in plain Python: these run on the host at every call, where Triton's
    own (a constexpr function in Triton 3.7) costs microseconds a call."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def pad_dim(d: int) -> int:
    """The tile width for head dim d: the next power of two, at least 16 (a GPU tl.dot needs 16)."""
    return max(16, _next_power_of_2(d))


def chunk_dims(d: int) -> tuple[int, int]:
    """(first, second) chunk widths holding head dim d in two power-of-two tiles, or
    (pad_dim(d), 0) where two chunks cover no fewer columns than one padded tile (d a power of
    two, or d = 111: 64 + 64 = 128). The first chunk is the largest power of two <= d, so only
    the second needs a column mask."""
    first = max(16, _next_power_of_2(d + 1) // 2)
    second = pad_dim(d - first) if d > first else 0
    if second == 0 or first + second >= pad_dim(d):
        return pad_dim(d), 0
    return first, second


@triton.jit
def load_tile(
    ptrs, rows, n_rows, dims, D: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_ROWS: tl.constexpr
):
    """(len(rows), BLOCK_D) tile at `ptrs`; rows >= n_rows (when CHECK_ROWS) and columns >= D read
    as 0 and cost no HBM traffic."""
    if CHECK_ROWS:
        if D < BLOCK_D:
            x = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (dims[None, :] < D), other=0.0)
        else:
            x = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    else:
        if D < BLOCK_D:
            x = tl.load(ptrs, mask=dims[None, :] < D, other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def store_tile(ptrs, x, rows, n_rows, dims, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Write the first D columns of the rows < n_rows of tile x to `ptrs`; padding stays on chip."""
    if D < BLOCK_D:
        tl.store(ptrs, x, mask=(rows[:, None] < n_rows) & (dims[None, :] < D))
    else:
        tl.store(ptrs, x, mask=rows[:, None] < n_rows)
