"""FlashAttention backward for Hopper (sm_90) in Gluon: TMA rings, asynchronous wgmma, and a dQ
that is either summed with atomics in the same pass or computed by a second, deterministic pass.

A program owns BLOCK_N keys of one (batch, query head) and keeps K_j and V_j in shared memory and
dK_j, dV_j in registers while the query blocks that see those keys stream past through a ring of
NUM_STAGES shared-memory slots (Q_i and dO_i arrive together, by the copy engine, on one mbarrier
per slot). Per query block the program runs, with P and dS transposed because its rows are keys:

    S^T  = K Q_i^T                 (tensor cores, async)   dP^T = V dO_i^T   (async, right after)
    P^T  = exp(scale S^T - lse_i)  (CUDA cores, while dP^T is still being computed)
    dV  += P^T dO_i                (async, P^T straight from registers)
    dS^T = P^T * (dP^T - D_i)      (CUDA cores, while dV's multiply runs)
    dK  += dS^T Q_i                (async)
    ATOMIC_DQ: dQ_i^T = K^T dS^T   (dS^T through shared memory, async beside dK), then added to a
                                   float32 dQ in global memory with one atomic per element

with D = rowsum(dO * O) (`kernels.bwd.preprocess`). Five block matmuls per (query block, key
block) pair with ATOMIC_DQ; without it (the default, `dq_mode="separate"`) four here and three more
in `_gluon_bwd_dq`, a second kernel that owns BLOCK_M queries and streams the key blocks (S, dP,
then dQ += dS K): no atomics, so the same bits on every run (`deterministic=True` insists on it).

Switches that make the steps of the backward's ablation ladder runnable from this one source
(arguments of `backward`): NUM_STAGES, the last entry of `config` / `dq_config` (1 = each block's
load waited for before its matmuls; 2 or more = the next blocks' loads in flight under the current
block's matmuls); OVERLAP, `overlap=` (False = every wgmma waited for right after it is issued, as
plain Triton 3.6 compiles a `tl.dot`; True = the schedule above, where the exponentials and the dS
arithmetic run while the tensor cores work); `dq_mode=` (atomic or separate); and SMEM_P,
`smem_p=` (P^T and dS^T handed to the dV and dK multiplies through shared memory instead of
registers). `scripts/hopper/h200_backward.py` (LADDER) times them side by side.

GQA: a program per query head; with H > H_kv each writes its own float32 dK, dV and the host sums
the heads of a group (deterministic; no atomics on dK, dV).

Measured on the H200 (notebooks/results/h200_backward.json; GPU_NOTES.md, "Gluon backward"; one
run, backward alone, N = 8192, separate dQ): bf16 d = 128 406 TFLOP/s (causal 382) against the FA2
backward's 353 (326) and cuDNN's 529 (507); d = 64 causal 311 against 299 and 403; d = 64 non-causal
level with FA2 (0.99x), so `hopper.dispatch` keeps FA2 there. Atomic dQ is about 2x slower than the
separate pass (17 GB of float32 partials added in L2 at that size) and stays an option. The tensor
pipe is as busy as in cuDNN's kernel (ncu: 66 % and 81 % in the two kernels, 65 % in cuDNN's); the
gap to cuDNN is the two extra matmuls of the dQ pass. Not here: a producer warp (warp
specialisation), `setmaxnreg`, persistent scheduling, TMA bulk reductions of dQ (not exposed by
Triton 3.6's Gluon).

Contract: as `triton_fwd.forward`'s (fp16/bf16, d 64 or 128, GQA, bottom-right causal, any
N_q, N_k >= 1); do and o (B, H, N_q, d); lse (B, H, N_q) float32 from the forward. Rows that see
no key (lse = -inf) get zero gradients. Gluon does not run under TRITON_INTERPRET=1: there, and off
sm_90, it raises `HopperUnsupported`.

Introduced in notebooks/11_hopper.ipynb (the backward's ablation ladder).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..kernels.bwd import check_grad_inputs, preprocess
from .gluon_fwd import descriptor
from .triton_fwd import LOG2E, HopperUnsupported, check_inputs, interpreting

_LOG2E = gl.constexpr(LOG2E)
# every thread of the program waits here (Triton 3.6 calls it thread_barrier, 3.7 barrier)
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

# (d, causal) -> (BLOCK_M, BLOCK_N, num_warps, num_stages) of the dK/dV kernel, and of the dQ
# kernel (BLOCK_M queries per program, BLOCK_N keys a step). See GPU_NOTES.md, "Gluon backward".
KV_CONFIGS = {
    (64, False): (32, 64, 4, 2),
    (64, True): (64, 64, 4, 3),
    (128, False): (64, 64, 4, 2),
    (128, True): (64, 64, 4, 2),
}
DQ_CONFIGS = {
    (64, False): (64, 128, 4, 2),
    (64, True): (64, 128, 4, 3),
    (128, False): (64, 64, 4, 2),
    (128, True): (64, 64, 4, 2),
}
DQ_MODES = ("atomic", "separate")
# head dim -> whether P^T and dS^T reach the dV and dK multiplies through shared memory (True) or
# straight from registers (False): at d = 128 registers run out (dK, dV: 128 a thread).
SMEM_P = {64: False, 128: False}


@gluon.constexpr_function
def mma_layout(rows, cols, num_warps):
    """Register layout of a wgmma accumulator (rows, cols): a warpgroup multiplies 64 rows at a
    time, 16 rows a warp; with 8 warps and 64 rows the two warpgroups split the columns."""
    if rows >= 16 * num_warps:
        warps = [num_warps, 1]
    else:
        warps = [4, num_warps // 4]
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=warps, instr_shape=[16, cols // warps[1], 16]
    )


@gluon.constexpr_function
def ds_layout(rows, cols, bitwidth):
    """Shared layout of the dS^T tile (rows keys, cols queries) that the dQ multiply reads."""
    return gl.NVMMASharedLayout(
        swizzle_byte_width=min(128, cols * bitwidth // 8), element_bitwidth=bitwidth, rank=2
    )


# ------------------------------------------------------------------------------------------------
# dK, dV (and optionally dQ by atomics): a program per BLOCK_N keys of one (batch, query head)
# ------------------------------------------------------------------------------------------------
@gluon.jit
def _load_qdo(desc_q, desc_do, q_smem, do_smem, bars, t, blk, bh, pred, NUM_STAGES: gl.constexpr):
    """Start the copies of query block `blk` (its Q and dO tiles) into ring slot t % NUM_STAGES;
    both report to that slot's mbarrier. Callers arm the barrier and sync the CTA first."""
    slot = t % NUM_STAGES
    BLOCK_M: gl.constexpr = desc_q.block_type.shape[1]
    row = blk * BLOCK_M
    tma.async_copy_global_to_shared(desc_q, [bh, row, 0], bars.index(slot), q_smem.index(slot),
                                    pred=pred)  # fmt: skip
    tma.async_copy_global_to_shared(desc_do, [bh, row, 0], bars.index(slot), do_smem.index(slot),
                                    pred=pred)  # fmt: skip


@gluon.jit
def _kv_step(
    t, blk, n_steps, blk0, k2, v2, q_smem, do_smem, ds_smem, p_smem, bars, desc_q, desc_do, dk, dv,
    LSEh, DELTAh, DQh, cols, N_q, offset, qk_scale, dq_scale, bh, MASK: gl.constexpr,
    CAUSAL: gl.constexpr, ATOMIC_DQ: gl.constexpr, OVERLAP: gl.constexpr, SMEM_P: gl.constexpr,
    NUM_STAGES: gl.constexpr,
):  # fmt: skip
    """One query block (`blk`, the t-th this program reads) against the program's keys."""
    BLOCK_M: gl.constexpr = desc_q.block_type.shape[1]
    HEAD_DIM: gl.constexpr = desc_q.block_type.shape[2]
    BLOCK_N: gl.constexpr = k2.shape[0]
    NUM_WARPS: gl.constexpr = gl.num_warps()
    dtype: gl.constexpr = desc_q.dtype
    s_layout: gl.constexpr = mma_layout(BLOCK_N, BLOCK_M, NUM_WARPS)  # S^T, dP^T: (BN, BM)
    kv_layout: gl.constexpr = mma_layout(BLOCK_N, HEAD_DIM, NUM_WARPS)  # dK, dV: (BN, d)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # one value per query row

    slot = t % NUM_STAGES
    mbarrier.wait(bars.index(slot), (t // NUM_STAGES) & 1)
    q2 = q_smem.index(slot).reshape([BLOCK_M, HEAD_DIM])
    do2 = do_smem.index(slot).reshape([BLOCK_M, HEAD_DIM])

    # S^T = K Q^T and dP^T = V dO^T, both started at once (Q^T, dO^T: transposed views).
    zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    s_t = warpgroup_mma(k2, q2.permute((1, 0)), zero, use_acc=False, is_async=True)
    if not OVERLAP:
        s_t = warpgroup_mma_wait(num_outstanding=0, deps=[s_t])
    dp_t = warpgroup_mma(v2, do2.permute((1, 0)), zero, use_acc=False, is_async=True)
    if not OVERLAP:
        dp_t = warpgroup_mma_wait(num_outstanding=0, deps=[dp_t])

    # lse (log2 units; a row that sees no key has lse = -inf: +inf makes its P zero) and D.
    rows = blk * BLOCK_M + gl.arange(0, BLOCK_M, layout=col_layout)
    in_q = rows < N_q
    lse = gl.load(LSEh + rows, mask=in_q, other=float("inf"))
    lse2 = gl.where(lse == -float("inf"), float("inf"), lse * _LOG2E)
    delta = gl.load(DELTAh + rows, mask=in_q, other=0.0)

    if OVERLAP:  # wait for S^T only; dP^T keeps running under the exponentials
        s_t = warpgroup_mma_wait(num_outstanding=1, deps=[s_t])
    z = s_t * qk_scale - gl.expand_dims(lse2, 0)
    if MASK:  # causal diagonal: key col is visible to query row iff col <= row + offset
        keep = gl.expand_dims(cols, 1) <= gl.expand_dims(rows, 0) + offset
        z = gl.where(keep, z, -float("inf"))
    p_t = gl.exp2(z)  # P^T, exact probabilities (lse is the forward's)

    # dV += P^T dO, P^T rounded to the input dtype, read from registers or (SMEM_P) from shared
    # memory: registers spare the shared-memory bandwidth, shared memory spares registers.
    if SMEM_P:
        p_smem.store(p_t.to(dtype))
        fence_async_shared()
        _cta_barrier()
        p16 = p_smem
        dv = warpgroup_mma(p_smem, do2, dv, is_async=True)
    else:
        p16 = gl.convert_layout(p_t.to(dtype), gl.DotOperandLayout(0, kv_layout, 2))
        dv = warpgroup_mma(p16, do2, dv, is_async=True)
    if OVERLAP:  # S^T and dP^T done; dV keeps running under dS
        dp_t = warpgroup_mma_wait(num_outstanding=1, deps=[dp_t])
    else:
        dv = warpgroup_mma_wait(num_outstanding=0, deps=[dv])
    ds_t = p_t * (dp_t - gl.expand_dims(delta, 0))  # dS^T (natural units; scale applied later)
    ds16 = ds_t.to(dtype)
    if SMEM_P or ATOMIC_DQ:
        # dS^T through shared memory (the dQ multiply's B operand): every warp's stores must land,
        # and be visible to the tensor cores, before a multiply reads them.
        ds_smem.store(ds16)
        fence_async_shared()
        _cta_barrier()
    if SMEM_P:
        dk = warpgroup_mma(ds_smem, q2, dk, is_async=True)
        if not ATOMIC_DQ:
            dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=[dk, dv])
    else:
        dsa = gl.convert_layout(ds16, gl.DotOperandLayout(0, kv_layout, 2))
        dk = warpgroup_mma(dsa, q2, dk, is_async=True)
        if not ATOMIC_DQ:
            dk, dv, p16, dsa = warpgroup_mma_wait(num_outstanding=0, deps=[dk, dv, p16, dsa])
    if ATOMIC_DQ:
        # dQ^T = K^T dS^T (d, BM), beside dK's multiply
        dq_layout: gl.constexpr = mma_layout(HEAD_DIM, BLOCK_M, NUM_WARPS)
        dq_zero = gl.zeros([HEAD_DIM, BLOCK_M], gl.float32, dq_layout)
        dq_t = warpgroup_mma(k2.permute((1, 0)), ds_smem, dq_zero, use_acc=False, is_async=True)
        if SMEM_P:
            dq_t, dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=[dq_t, dk, dv])
        else:
            dq_t, dk, dv, p16, dsa = warpgroup_mma_wait(num_outstanding=0,
                                                        deps=[dq_t, dk, dv, p16, dsa])  # fmt: skip
        # one float32 atomic add per element, into rows < N_q (d fastest in memory)
        add_layout: gl.constexpr = dq_layout
        dq_t = dq_t * dq_scale
        dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, add_layout))
        q_rows = blk * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, add_layout))
        offs = gl.expand_dims(q_rows * HEAD_DIM, 0) + gl.expand_dims(dims, 1)
        gl.atomic_add(DQh + offs, dq_t, mask=gl.expand_dims(q_rows < N_q, 0), sem="relaxed")

    # Ring slot free in every warp: refill it with the block NUM_STAGES steps ahead.
    _cta_barrier()
    nxt = t + NUM_STAGES
    pred = nxt < n_steps
    mbarrier.expect(bars.index(slot), 2 * desc_q.block_type.nbytes, pred=pred)
    _load_qdo(desc_q, desc_do, q_smem, do_smem, bars, nxt, blk0 + nxt, bh, pred, NUM_STAGES)
    return dk, dv


@gluon.jit(do_not_specialize=["H", "GROUP", "N_q", "N_k"])
def _gluon_bwd_kv(
    desc_q, desc_k, desc_v, desc_do, LSE, DELTA, DQ, DK, DV, qk_scale, dq_scale, dk_scale, H,
    GROUP, N_q, N_k, CAUSAL: gl.constexpr, ATOMIC_DQ: gl.constexpr, OVERLAP: gl.constexpr,
    SMEM_P: gl.constexpr, NUM_STAGES: gl.constexpr,
):  # fmt: skip
    """Grid (cdiv(N_k, BLOCK_N), B * H). DK, DV: (B, H or H_kv, N_k, d), one head per program's
    query head when GROUP > 1 (the host sums them). DQ: zeroed float32 (B, H, N_q, d)."""
    BLOCK_M: gl.constexpr = desc_q.block_type.shape[1]
    HEAD_DIM: gl.constexpr = desc_q.block_type.shape[2]
    BLOCK_N: gl.constexpr = desc_k.block_type.shape[1]
    NUM_WARPS: gl.constexpr = gl.num_warps()
    dtype: gl.constexpr = desc_q.dtype
    s_layout: gl.constexpr = mma_layout(BLOCK_N, BLOCK_M, NUM_WARPS)
    kv_layout: gl.constexpr = mma_layout(BLOCK_N, HEAD_DIM, NUM_WARPS)

    pid_n = gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    kv_row = b * (H // GROUP) + h // GROUP
    n0 = pid_n * BLOCK_N
    offset = N_k - N_q
    cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))

    # Query blocks that see some key of ours: rows i >= n0 - offset (causal). From full_blk on,
    # every row sees every key of the block (no mask); rows past N_q are zero-filled by TMA and
    # get lse = +inf, so P = 0 there without a mask.
    n_qblk = gl.cdiv(N_q, BLOCK_M)
    blk_lo = 0
    full_blk = 0
    if CAUSAL:
        blk_lo = gl.minimum(gl.maximum(n0 - offset, 0), N_q) // BLOCK_M
        last = gl.minimum(n0 + BLOCK_N, N_k) - 1
        full_blk = gl.minimum(gl.cdiv(gl.maximum(last - offset, 0), BLOCK_M), n_qblk)
        full_blk = gl.maximum(full_blk, blk_lo)
    n_steps = n_qblk - blk_lo
    n_masked = full_blk - blk_lo

    # Shared memory: K and V once, a ring of Q and dO tiles, the dS^T tile for the dQ multiply.
    k_smem = gl.allocate_shared_memory(dtype, desc_k.block_type.shape, desc_k.layout)
    v_smem = gl.allocate_shared_memory(dtype, desc_v.block_type.shape, desc_v.layout)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + desc_q.block_type.shape, desc_q.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + desc_do.block_type.shape,
                                        desc_do.layout)  # fmt: skip
    ds_smem = gl.allocate_shared_memory(
        dtype, [BLOCK_N, BLOCK_M], ds_layout(BLOCK_N, BLOCK_M, dtype.primitive_bitwidth)
    )
    p_smem = gl.allocate_shared_memory(
        dtype, [BLOCK_N, BLOCK_M], ds_layout(BLOCK_N, BLOCK_M, dtype.primitive_bitwidth)
    )
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(bars.index(i), count=1)

    # Prologue: K, V and the first NUM_STAGES query blocks in flight at once.
    mbarrier.expect(kv_bar, 2 * desc_k.block_type.nbytes)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.expect(bars.index(i), 2 * desc_q.block_type.nbytes, pred=i < n_steps)
    _cta_barrier()
    tma.async_copy_global_to_shared(desc_k, [kv_row, n0, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(desc_v, [kv_row, n0, 0], kv_bar, v_smem)
    for i in gl.static_range(NUM_STAGES):
        _load_qdo(desc_q, desc_do, q_smem, do_smem, bars, i, blk_lo + i, bh, i < n_steps,
                  NUM_STAGES)  # fmt: skip
    mbarrier.wait(kv_bar, 0)
    k2 = k_smem.reshape([BLOCK_N, HEAD_DIM])
    v2 = v_smem.reshape([BLOCK_N, HEAD_DIM])

    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    row0 = bh.to(gl.int64) * N_q
    LSEh = LSE + row0
    DELTAh = DELTA + row0
    DQh = DQ + row0 * HEAD_DIM
    for t in range(0, n_masked):  # the causal diagonal: masked
        dk, dv = _kv_step(
            t, blk_lo + t, n_steps, blk_lo, k2, v2, q_smem, do_smem, ds_smem, p_smem, bars, desc_q,
            desc_do, dk, dv, LSEh, DELTAh, DQh, cols, N_q, offset, qk_scale, dq_scale, bh, True,
            CAUSAL, ATOMIC_DQ, OVERLAP, SMEM_P, NUM_STAGES,
        )  # fmt: skip
    for t in range(n_masked, n_steps):  # every row sees every key: no mask
        dk, dv = _kv_step(
            t, blk_lo + t, n_steps, blk_lo, k2, v2, q_smem, do_smem, ds_smem, p_smem, bars, desc_q,
            desc_do, dk, dv, LSEh, DELTAh, DQh, cols, N_q, offset, qk_scale, dq_scale, bh, False,
            CAUSAL, ATOMIC_DQ, OVERLAP, SMEM_P, NUM_STAGES,
        )  # fmt: skip

    mbarrier.invalidate(kv_bar)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(bars.index(i))

    # dK = scale * dS^T Q; rows past N_k are not stored. GROUP > 1: this query head's share.
    out_head = bh
    if GROUP == 1:
        out_head = kv_row
    k_rows = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, kv_layout))
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))
    offs = gl.expand_dims((out_head.to(gl.int64) * N_k + k_rows) * HEAD_DIM, 1)
    offs = offs + gl.expand_dims(dims, 0)
    keep = gl.expand_dims(k_rows < N_k, 1)
    gl.store(DK + offs, (dk * dk_scale).to(DK.dtype.element_ty), mask=keep)
    gl.store(DV + offs, dv.to(DV.dtype.element_ty), mask=keep)


# ------------------------------------------------------------------------------------------------
# dQ, deterministic: a program per BLOCK_M queries of one (batch, head), key blocks streamed
# ------------------------------------------------------------------------------------------------
@gluon.jit
def _dq_step(
    j, n_blocks, q2, do2, k_smem, v_smem, bars, desc_k, desc_v, kv_row, dq, lse2, delta, rows,
    offset, qk_scale, MASK: gl.constexpr, OVERLAP: gl.constexpr, NUM_STAGES: gl.constexpr,
):  # fmt: skip
    BLOCK_M: gl.constexpr = q2.shape[0]
    HEAD_DIM: gl.constexpr = q2.shape[1]
    BLOCK_N: gl.constexpr = desc_k.block_type.shape[1]
    NUM_WARPS: gl.constexpr = gl.num_warps()
    dtype: gl.constexpr = desc_k.dtype
    s_layout: gl.constexpr = mma_layout(BLOCK_M, BLOCK_N, NUM_WARPS)
    q_layout: gl.constexpr = mma_layout(BLOCK_M, HEAD_DIM, NUM_WARPS)

    slot = j % NUM_STAGES
    mbarrier.wait(bars.index(slot), (j // NUM_STAGES) & 1)
    k2 = k_smem.index(slot).reshape([BLOCK_N, HEAD_DIM])
    v2 = v_smem.index(slot).reshape([BLOCK_N, HEAD_DIM])
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    s = warpgroup_mma(q2, k2.permute((1, 0)), zero, use_acc=False, is_async=True)
    if not OVERLAP:
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
    dp = warpgroup_mma(do2, v2.permute((1, 0)), zero, use_acc=False, is_async=True)
    if OVERLAP:  # the exponentials run while dP is computed
        s = warpgroup_mma_wait(num_outstanding=1, deps=[s])
    z = s * qk_scale - gl.expand_dims(lse2, 1)
    if MASK:
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        keep = gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1) + offset
        z = gl.where(keep, z, -float("inf"))
    p = gl.exp2(z)
    dp = warpgroup_mma_wait(num_outstanding=0, deps=[dp])
    ds = p * (dp - gl.expand_dims(delta, 1))
    dsa = gl.convert_layout(ds.to(dtype), gl.DotOperandLayout(0, q_layout, 2))
    dq = warpgroup_mma(dsa, k2, dq, is_async=True)
    dq, dsa = warpgroup_mma_wait(num_outstanding=0, deps=[dq, dsa])

    _cta_barrier()
    nxt = j + NUM_STAGES
    pred = nxt < n_blocks
    nslot = nxt % NUM_STAGES
    mbarrier.expect(bars.index(nslot), 2 * desc_k.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(desc_k, [kv_row, nxt * BLOCK_N, 0], bars.index(nslot),
                                    k_smem.index(nslot), pred=pred)  # fmt: skip
    tma.async_copy_global_to_shared(desc_v, [kv_row, nxt * BLOCK_N, 0], bars.index(nslot),
                                    v_smem.index(nslot), pred=pred)  # fmt: skip
    return dq


@gluon.jit(do_not_specialize=["H", "GROUP", "N_q", "N_k"])
def _gluon_bwd_dq(
    desc_q, desc_k, desc_v, desc_do, LSE, DELTA, DQ, qk_scale, dq_scale, H, GROUP, N_q, N_k,
    CAUSAL: gl.constexpr, OVERLAP: gl.constexpr, NUM_STAGES: gl.constexpr,
):  # fmt: skip
    """Grid (cdiv(N_q, BLOCK_M), B * H). DQ: (B, H, N_q, d) in the input dtype."""
    BLOCK_M: gl.constexpr = desc_q.block_type.shape[1]
    HEAD_DIM: gl.constexpr = desc_q.block_type.shape[2]
    BLOCK_N: gl.constexpr = desc_k.block_type.shape[1]
    NUM_WARPS: gl.constexpr = gl.num_warps()
    dtype: gl.constexpr = desc_q.dtype
    s_layout: gl.constexpr = mma_layout(BLOCK_M, BLOCK_N, NUM_WARPS)
    q_layout: gl.constexpr = mma_layout(BLOCK_M, HEAD_DIM, NUM_WARPS)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    pid_m = gl.num_programs(0) - 1 - gl.program_id(0)  # heaviest causal blocks first
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    kv_row = b * (H // GROUP) + h // GROUP
    m0 = pid_m * BLOCK_M
    offset = N_k - N_q
    rows = m0 + gl.arange(0, BLOCK_M, layout=row_layout)
    # Key blocks [0, full) are seen in full by every row, [full, n_blocks) need the mask; keys
    # past N_k are zero-filled, so dS K gets nothing from them.
    hi = N_k
    full = N_k
    if CAUSAL:
        last = gl.minimum(m0 + BLOCK_M, N_q) - 1
        hi = gl.minimum(gl.maximum(last + offset + 1, 0), N_k)
        full = gl.minimum(gl.maximum(m0 + offset + 1, 0), N_k)
    n_blocks = gl.cdiv(hi, BLOCK_N)
    n_full = n_blocks  # not causal: no block needs a mask (a ragged end is zero-filled)
    if CAUSAL:
        n_full = gl.minimum(full // BLOCK_N, n_blocks)

    q_smem = gl.allocate_shared_memory(dtype, desc_q.block_type.shape, desc_q.layout)
    do_smem = gl.allocate_shared_memory(dtype, desc_do.block_type.shape, desc_do.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + desc_k.block_type.shape, desc_k.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + desc_v.block_type.shape, desc_v.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(bars.index(i), count=1)
    mbarrier.expect(q_bar, 2 * desc_q.block_type.nbytes)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.expect(bars.index(i), 2 * desc_k.block_type.nbytes, pred=i < n_blocks)
    _cta_barrier()
    tma.async_copy_global_to_shared(desc_q, [bh, m0, 0], q_bar, q_smem)
    tma.async_copy_global_to_shared(desc_do, [bh, m0, 0], q_bar, do_smem)
    for i in gl.static_range(NUM_STAGES):
        tma.async_copy_global_to_shared(desc_k, [kv_row, i * BLOCK_N, 0], bars.index(i),
                                        k_smem.index(i), pred=i < n_blocks)  # fmt: skip
        tma.async_copy_global_to_shared(desc_v, [kv_row, i * BLOCK_N, 0], bars.index(i),
                                        v_smem.index(i), pred=i < n_blocks)  # fmt: skip

    row0 = bh.to(gl.int64) * N_q
    in_q = rows < N_q
    lse = gl.load(LSE + row0 + rows, mask=in_q, other=float("inf"))
    lse2 = gl.where(lse == -float("inf"), float("inf"), lse * _LOG2E)
    delta = gl.load(DELTA + row0 + rows, mask=in_q, other=0.0)
    dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, q_layout)
    mbarrier.wait(q_bar, 0)
    q2 = q_smem.reshape([BLOCK_M, HEAD_DIM])
    do2 = do_smem.reshape([BLOCK_M, HEAD_DIM])
    for j in range(0, n_full):
        dq = _dq_step(j, n_blocks, q2, do2, k_smem, v_smem, bars, desc_k, desc_v, kv_row, dq,
                      lse2, delta, rows, offset, qk_scale, False, OVERLAP, NUM_STAGES)  # fmt: skip
    for j in range(n_full, n_blocks):
        dq = _dq_step(j, n_blocks, q2, do2, k_smem, v_smem, bars, desc_k, desc_v, kv_row, dq,
                      lse2, delta, rows, offset, qk_scale, True, OVERLAP, NUM_STAGES)  # fmt: skip

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(bars.index(i))
    q_rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, q_layout))
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_layout))
    offs = gl.expand_dims((row0 + q_rows) * HEAD_DIM, 1) + gl.expand_dims(dims, 0)
    gl.store(DQ + offs, (dq * dq_scale).to(DQ.dtype.element_ty),
             mask=gl.expand_dims(q_rows < N_q, 1))  # fmt: skip


# ------------------------------------------------------------------------------------------------
# Host side
# ------------------------------------------------------------------------------------------------
def kv_query_blocks(n0, N_q, N_k, causal, block_m, block_n) -> tuple[int, int, int]:
    """(first, first_full, end) query blocks of the dK/dV program whose keys start at n0: blocks
    [first, first_full) need the causal mask, [first_full, end) none (rows past N_q are zero-filled
    and get lse = +inf, hence P = 0). The same integer arithmetic as `_gluon_bwd_kv`, in Python."""
    end = -(-N_q // block_m)
    first = full = 0
    if causal:
        offset = N_k - N_q
        first = min(max(n0 - offset, 0), N_q) // block_m
        last = min(n0 + block_n, N_k) - 1
        full = max(min(-(-max(last - offset, 0) // block_m), end), first)
    return first, full, end


def dq_key_blocks(m0, N_q, N_k, causal, block_m, block_n) -> tuple[int, int]:
    """(n_full, n_blocks) key blocks of the dQ program whose rows start at m0: blocks [0, n_full)
    unmasked, [n_full, n_blocks) causal-masked; keys past N_k are zero-filled (dS K gets nothing
    from them). The same integer arithmetic as `_gluon_bwd_dq`, in Python."""
    hi = N_k
    full = N_k
    if causal:
        offset = N_k - N_q
        last = min(m0 + block_m, N_q) - 1
        hi = min(max(last + offset + 1, 0), N_k)
        full = min(max(m0 + offset + 1, 0), N_k)
    n_blocks = -(-hi // block_n)
    return (min(full // block_n, n_blocks) if causal else n_blocks), n_blocks


def check_config(cfg, kind="kv", name="hopper.gluon_bwd.backward") -> tuple:
    """cfg itself if the `kind` kernel ("kv" or "dq") can run it: (BLOCK_M, BLOCK_N, num_warps,
    num_stages), 4 or 8 warps, blocks powers of two from 32, the block that gives the wgmma its
    rows (BLOCK_N keys for "kv", BLOCK_M queries for "dq") at least 64, at least one stage."""
    if len(cfg) != 4 or not all(isinstance(x, int) and not isinstance(x, bool) for x in cfg):
        raise ValueError(
            f"{name}: config must be 4 ints (BLOCK_M, BLOCK_N, warps, stages), got {cfg}"
        )
    block_m, block_n, warps, stages = cfg
    if warps not in (4, 8):
        raise ValueError(f"{name}: num_warps must be 4 or 8, got config {cfg}")
    if any(x < 32 or x & (x - 1) for x in (block_m, block_n)):
        raise ValueError(f"{name}: BLOCK_M and BLOCK_N must be powers of two >= 32, got {cfg}")
    rows = block_n if kind == "kv" else block_m
    if rows < 64:
        which = "BLOCK_N" if kind == "kv" else "BLOCK_M"
        raise ValueError(
            f"{name}: {which} must be >= 64 for the {kind} kernel (a warpgroup multiplies 64 "
            f"rows at a time), got config {cfg}"
        )
    if stages < 1:
        raise ValueError(f"{name}: num_stages must be >= 1, got config {cfg}")
    return tuple(cfg)


def views(q, k, v, do):
    """3-D (batch * heads, N, d) views, each descriptor's tile then rows of one head."""
    B, H, N_q, d = q.shape
    H_kv, N_k = k.shape[1], k.shape[2]
    return (q.contiguous().view(B * H, N_q, d), k.contiguous().view(B * H_kv, N_k, d),
            v.contiguous().view(B * H_kv, N_k, d), do.contiguous().view(B * H, N_q, d))  # fmt: skip


def launch_kv(q3, k3, v3, do3, lse, delta, dq32, dk, dv, scale, H, causal, config, overlap,
              smem_p):  # fmt: skip
    """The dK/dV kernel (with dQ by atomics into dq32 when it is a tensor)."""
    bm, bn, warps, stages = config
    BH, N_q, _ = q3.shape
    N_k = k3.shape[1]
    group = BH // k3.shape[0]
    atomic = dq32 is not None
    _gluon_bwd_kv[(triton.cdiv(N_k, bn), BH)](
        descriptor(q3, bm), descriptor(k3, bn), descriptor(v3, bn), descriptor(do3, bm), lse,
        delta, dq32 if atomic else delta, dk, dv, scale * LOG2E, scale, scale, H, group, N_q, N_k,
        CAUSAL=bool(causal), ATOMIC_DQ=atomic, OVERLAP=bool(overlap), SMEM_P=bool(smem_p),
        NUM_STAGES=stages, num_warps=warps,
    )  # fmt: skip


def launch_dq(q3, k3, v3, do3, lse, delta, dq, scale, H, causal, config, overlap):
    """The dQ kernel (no atomics)."""
    bm, bn, warps, stages = config
    BH, N_q, _ = q3.shape
    N_k = k3.shape[1]
    _gluon_bwd_dq[(triton.cdiv(N_q, bm), BH)](
        descriptor(q3, bm), descriptor(k3, bn), descriptor(v3, bn), descriptor(do3, bm), lse,
        delta, dq, scale * LOG2E, scale, H, BH // k3.shape[0], N_q, N_k,
        CAUSAL=bool(causal), OVERLAP=bool(overlap), NUM_STAGES=stages, num_warps=warps,
    )  # fmt: skip


def backward(
    do, q, k, v, o, lse, *, causal=False, softmax_scale=None, dq_mode="separate",
    deterministic=False, config=None, dq_config=None, overlap=True, smem_p=None,
):  # fmt: skip
    """Gradients (dq, dk, dv) of sum(o * do) through the Gluon kernels.

    Args:
        do, o: (B, H, N_q, d); q, k, v and the options as for `triton_fwd.forward`; lse:
            (B, H, N_q) float32, the forward's.
        dq_mode: "separate" (a second kernel computes dQ; no atomics, the same bits every run;
            the default, faster on the H200) or "atomic" (dQ summed in the dK/dV pass by float32
            atomic adds). deterministic=True insists on "separate".
        config, dq_config: (BLOCK_M, BLOCK_N, num_warps, num_stages) of the dK/dV kernel and of
            the dQ kernel; default KV_CONFIGS / DQ_CONFIGS.
        overlap: the asynchronous schedule (False: every multiply waited for at once).
        smem_p: P^T and dS^T through shared memory (default SMEM_P[d]).
    Returns:
        dq (B, H, N_q, d), dk and dv (B, H_kv, N_k, d) in q's dtype; zero for fully masked rows.
    """
    name = "hopper.gluon_bwd.backward"
    (B, H, H_kv, N_q, N_k, d), scale = check_inputs(q, k, v, causal, softmax_scale, name)
    check_grad_inputs(do, o, lse, q, v, name)
    if dq_mode not in DQ_MODES:
        raise ValueError(f"{name}: dq_mode must be one of {DQ_MODES}, got {dq_mode!r}")
    if deterministic and dq_mode != "separate":
        raise ValueError(f"{name}: deterministic=True needs dq_mode='separate', got {dq_mode!r}")
    cfg = check_config(config or KV_CONFIGS[(d, bool(causal))], "kv", name)
    dq_cfg = check_config(dq_config or DQ_CONFIGS[(d, bool(causal))], "dq", name)
    if smem_p is None:
        smem_p = SMEM_P[d]
    if interpreting() or q.device.type != "cuda":
        raise HopperUnsupported(
            f"{name}: q, k, v must be CUDA tensors on an sm_90 GPU, got device {q.device} "
            "(Gluon kernels do not run under TRITON_INTERPRET=1)"
        )
    group = H // H_kv
    delta = preprocess(o, do)
    lse = lse.contiguous()
    q3, k3, v3, do3 = views(q, k, v, do)
    atomic = dq_mode == "atomic"
    dq32 = torch.zeros((B, H, N_q, d), device=q.device, dtype=torch.float32) if atomic else None
    if group == 1:
        dk = torch.empty((B, H_kv, N_k, d), device=q.device, dtype=q.dtype)
    else:  # one float32 dK, dV per query head; summed over each group below
        dk = torch.empty((B, H, N_k, d), device=q.device, dtype=torch.float32)
    dv = torch.empty_like(dk)
    launch_kv(q3, k3, v3, do3, lse, delta, dq32, dk, dv, scale, H, causal, cfg, overlap, smem_p)
    if atomic:
        dq = dq32.to(q.dtype)
    else:
        dq = torch.empty((B, H, N_q, d), device=q.device, dtype=q.dtype)
        launch_dq(q3, k3, v3, do3, lse, delta, dq, scale, H, causal, dq_cfg, overlap)
    if group > 1:
        dk = dk.view(B, H_kv, group, N_k, d).sum(2).to(q.dtype)
        dv = dv.view(B, H_kv, group, N_k, d).sum(2).to(q.dtype)
    return dq, dk, dv
