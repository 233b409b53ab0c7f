"""The answer to chapter 12's Triton exercise: a tile of keys found through the block table.

The paged decoding kernel (`flashedu.kernels.paged`) walks each sequence's keys in tiles of
BLOCK_N and asks a `@triton.jit` function where each tile lives. The learner writes that function
(`checks.paged_kernel` launches the package's kernel with it); this one is the package's answer,
and the function the kernel calls by default.

Introduced in notebooks/12_serving.ipynb.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def page_rows(BT_ROW, start_n, seqlen, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys start_n .. start_n + BLOCK_N - 1 of one sequence: their rows in the cache seen as
    (num_pages * PAGE_SIZE) rows, and which of them exist (< seqlen). BT_ROW points at the
    sequence's row of the block table. The tile lies in one page (BLOCK_N divides PAGE_SIZE and
    start_n is a multiple of BLOCK_N), so one int32 of the table is read."""
    page = tl.load(BT_ROW + start_n // PAGE_SIZE).to(tl.int64)  # HBM: read 4 bytes per tile
    cols = start_n + tl.arange(0, BLOCK_N)  # logical key positions
    return page * PAGE_SIZE + cols % PAGE_SIZE, cols < seqlen  # the last page may be partial
