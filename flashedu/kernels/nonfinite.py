"""`_nonfinite.poison_hidden_values` on the GPU, in two small kernels and without a host sync.

A kernel that skips the key blocks a row cannot see never multiplies their zeros by v, so a NaN or
an infinity in a skipped v[j, c] would not reach the rows the reference makes NaN (0 x NaN = NaN in
o = P @ V). The torch version restores them with a dozen elementwise passes over int64 index
tensors the size of v and o; on an H200 at B = 4, H = 16, N = 4096, d = 96 that cost 0.6 ms,
about as much as the causal forward it follows (notebooks/results/GPU_NOTES.md, "Head-dim runs").
Here:

1. `_bad_keys`: programs over (batch x K/V head, block of keys) find, per column, the first
   non-finite key and the last one, and fold them into two int32 per column with atomic min
   (`BAD[0]`: the first; `BAD[1]`: N_k - 1 - the last, so that both start at N_k, "none", from
   one fill). Without a left window edge (causal, or no mask on that side) the last query row
   sees every key, so a program first reads that row of o and stops if it is finite: v is read
   only where something is not finite. With a left edge it reads v once.
2. `_poison_rows`: reads only those 2 x d integers per head and stores NaN where a row cannot see
   its column's first or last bad key; it reads nothing of o and writes only the poisoned entries.

HBM: one row of o per head (causal), or v once (a left window edge), plus what is poisoned; no
host sync, so the call stays asynchronous and can be captured in a CUDA graph. Under the
interpreter the kernels run on CPU tensors (tests/kernels/test_nonfinite.py holds them to the
torch version).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# keys one `_bad_keys` program scans, in BLOCK_N steps: a few loads each, so that the programs
# are many (1,024 at B = 2, H_kv = 16, N_k = 8192) and the read streams at the copy's rate
KEYS_PER_PROGRAM = 256


@triton.jit
def _bad_keys(
    V, O, BAD, stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, stride_bad, H_kv,
    GROUP, N_q, N_k, D, LAST_ROW_SEES_ALL: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, KEYS: tl.constexpr,
):  # fmt: skip
    """Grid (B * H_kv, cdiv(N_k, KEYS), cdiv(D, BLOCK_D)). BAD: int32 (2, B * H_kv, D) filled
    with N_k; afterwards BAD[0] is the first key whose v is not finite in each column, BAD[1]
    N_k - 1 - the last one (N_k: none).

    LAST_ROW_SEES_ALL (no left window edge: the last query row sees every key): a non-finite
    v[j, c] makes o[last row, c] non-finite in every head of the group, since P there is
    positive on every key; so where that row of o is finite in all of this program's columns,
    no v there is bad and the program returns without reading v. (A NaN in q or k makes the row
    NaN too; the program then scans, and finds what is there.)"""
    bh = tl.program_id(0)
    start = tl.program_id(1) * KEYS
    cols = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    seen = cols < D
    b = bh // H_kv
    if LAST_ROW_SEES_ALL:
        h = (bh % H_kv) * GROUP
        row = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
        o = tl.load(row + (N_q - 1).to(tl.int64) * stride_om + cols, mask=seen, other=0.0)
        o = o.to(tl.float32)
        if tl.sum(((o != o) | (tl.abs(o) == float("inf"))).to(tl.int32), axis=0) == 0:
            return
    V += b.to(tl.int64) * stride_vb + (bh % H_kv).to(tl.int64) * stride_vh
    first = tl.full([BLOCK_N, BLOCK_D], 2147483647, tl.int32)  # reduced over keys once, at the end
    last = tl.full([BLOCK_N, BLOCK_D], -1, tl.int32)
    for n in tl.range(start, tl.minimum(start + KEYS, N_k), BLOCK_N):
        keys = n + tl.arange(0, BLOCK_N)
        inside = (keys[:, None] < N_k) & seen[None, :]
        x = tl.load(V + keys[:, None].to(tl.int64) * stride_vn + cols[None, :], mask=inside,
                    other=0.0).to(tl.float32)  # fmt: skip
        bad = ((x != x) | (tl.abs(x) == float("inf"))) & inside
        first = tl.minimum(first, tl.where(bad, keys[:, None], 2147483647))
        last = tl.maximum(last, tl.where(bad, keys[:, None], -1))
    first_c = tl.min(first, axis=0)
    last_c = tl.max(last, axis=0)
    tl.atomic_min(BAD + bh * D + cols, first_c, mask=seen & (last_c >= 0))
    tl.atomic_min(BAD + stride_bad + bh * D + cols, N_k - 1 - last_c, mask=seen & (last_c >= 0))


@triton.jit
def _poison_rows(
    O, BAD, stride_ob, stride_oh, stride_om, stride_bad, H, GROUP, N_q, N_k, D, LEFT, RIGHT,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Grid (B * H, cdiv(N_q, BLOCK_M), cdiv(D, BLOCK_D)): NaN into o[b, h, i, c] where row i
    cannot see the first (left edge) or last (right edge) non-finite key of column c."""
    bh = tl.program_id(0)
    b = bh // H
    kv = b * (H // GROUP) + (bh % H) // GROUP
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    first = tl.load(BAD + kv * D + cols, mask=cols < D, other=N_k)
    last = N_k - 1 - tl.load(BAD + stride_bad + kv * D + cols, mask=cols < D, other=N_k)
    if tl.sum((last >= 0).to(tl.int32), axis=0) == 0:  # no bad key in these columns: nothing to do
        return
    diag = rows[:, None] + (N_k - N_q)  # the key level with each row
    hidden = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.int1)
    if HAS_RIGHT:
        hidden = hidden | ((last[None, :] >= 0) & (last[None, :] > diag + RIGHT))
    if HAS_LEFT:
        hidden = hidden | ((first[None, :] < N_k) & (first[None, :] < diag - LEFT))
    hidden = hidden & (rows[:, None] < N_q) & (cols[None, :] < D)
    O += b.to(tl.int64) * stride_ob + (bh % H).to(tl.int64) * stride_oh
    nan = tl.full([BLOCK_M, BLOCK_D], float("nan"), tl.float32)
    ptrs = O + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(ptrs, nan.to(O.dtype.element_ty), mask=hidden)


def poison_hidden_values(o: torch.Tensor, v: torch.Tensor, N_q: int, left: int, right: int):
    """As `flashedu._nonfinite.poison_hidden_values`, in place on o (which it returns): o
    (B, H, N_q, d_v) with unit stride along d_v, v (B, H_kv, N_k, d_v)."""
    if left < 0 and right < 0:
        return o
    B, H_kv, N_k, D = v.shape
    H = o.shape[1]
    if o.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("kernels.nonfinite: o and v need unit stride along the head dim")
    bad = torch.full((2, B * H_kv, D), N_k, dtype=torch.int32, device=v.device)
    block_d = min(triton.next_power_of_2(D), 128)
    block_n = 32 if block_d > 64 else 64
    keys = min(KEYS_PER_PROGRAM, triton.cdiv(N_k, block_n) * block_n)
    grid = (B * H_kv, triton.cdiv(N_k, keys), triton.cdiv(D, block_d))
    _bad_keys[grid](
        v, o, bad, v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
        bad.stride(0), H_kv, H // H_kv, N_q, N_k, D, LAST_ROW_SEES_ALL=left < 0 and N_q > 0,
        BLOCK_N=block_n, BLOCK_D=block_d, KEYS=keys,
    )  # fmt: skip
    block_m = 128
    grid = (B * H, triton.cdiv(N_q, block_m), triton.cdiv(D, block_d))
    _poison_rows[grid](
        o, bad, o.stride(0), o.stride(1), o.stride(2), bad.stride(0), H, H // H_kv, N_q, N_k, D,
        max(left, 0), max(right, 0), HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, BLOCK_M=block_m,
        BLOCK_D=block_d,
    )  # fmt: skip
    return o
