"""FlashAttention forward for Hopper (sm_90) written in Gluon, with FlashAttention-3's
intra-warpgroup overlap spelled out by hand.

Why Gluon. Plain Triton 3.6 waits for the Q K^T warpgroup multiply (`wgmma`) to finish right after
issuing it, so the softmax of a key block never runs while the tensor cores work. In Gluon we
place every asynchronous operation and every wait ourselves. The schedule, for key blocks
j = 0, 1, ..., n - 1:

    prologue:    S_0 = Q K_0^T (waited for; see below)
    iteration j: start S_{j+1} = Q K_{j+1}^T          (tensor cores, asynchronous)
                 wait until S_j (and O += P_{j-1} V_{j-1}) are done; S_{j+1} stays in flight
                 softmax of S_j on the CUDA cores     (runs while S_{j+1} is computed)
                 rescale O, start O += P_j V_j         (asynchronous)
    last block:  the same, with nothing left to start; then wait for everything.

Two things the compiler (ptxas) forces on the code, both explained where they happen:
  * the loop body covers two key blocks, so S_{j+1} and S_j take turns in two register sets
    (a one-block body would copy an S that is still being computed: ptxas then serialises
    every wgmma and the overlap is gone);
  * no wgmma may be in flight where control passes between the prologue and a loop, so S_0 is
    waited for before the loop starts.
Two S tiles live at once (one in the softmax, one in flight), which is what limits the tile: at
d = 128 the key block is 64 wide (BLOCK_N = 128 needs more than 255 registers a thread).

Everything else mirrors `triton_fwd.forward` (same contract, same masking and the same results
up to rounding): one program owns BLOCK_M query rows of one (batch, head); keys stream past in
blocks of BLOCK_N, first the blocks every row sees in full (no mask arithmetic), then the blocks
on the causal diagonal or the ragged end of the sequence (masked); blocks no row sees are never
read. Q arrives once through the copy engine (TMA); K and V tiles arrive through TMA into a ring of
NUM_STAGES shared-memory buffers, each with its own mbarrier, loads issued ahead of use.

Contract: q (B, H, N_q, d), k and v (B, H_kv, N_k, d), H % H_kv == 0 (GQA: head h reads K/V head
h // (H // H_kv)); fp16 or bf16; d 64 or 128. Causal masking is bottom-right aligned: query i sees
key j iff j <= i + N_k - N_q. Returns o (B, H, N_q, d) in the input dtype and lse (B, H, N_q)
float32, the natural-log log-sum-exp of the scaled scores. A row that sees no key (causal with
N_q > N_k) gives o = 0 and lse = -inf.

Measured on the H200 (notebooks/results/h200_hopper.json, round 4, one run; TFLOP/s, forward):
  bf16, B=2, H=16, N=8192, d=128: 540 (causal 499) against cuDNN 600 (538), FA2 484 (463).
  bf16, B=4, H=16, N=4096, d=64:  424 (causal 370) against cuDNN 472 (410), FA2 398 (326).
0.85-0.93x cuDNN and 1.04-1.13x the FA2 kernel over fp16 and bf16; correct on 28 of 28 cases
(ragged, GQA, causal N_q != N_k, fully masked rows). GPU_NOTES.md, "Gluon forward", has the steps
and what still separates it from cuDNN (no producer warpgroup, no explicit ping-pong, not
persistent).

Host side: the tensors are viewed as 3-D (B * heads, N, d) and each descriptor's tile is
[1, rows, d]: one head's rows only, so a tile that runs past the end of a sequence is zero-filled
by TMA instead of reading the next head.

Introduced in notebooks/11_hopper.ipynb (the Hopper kernels on the H200).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .triton_fwd import HopperUnsupported, check_inputs, interpreting

LOG2E = 1.4426950408889634  # exp(x) = exp2(x * log2(e))
LN2 = 0.6931471805599453
_LN2 = gl.constexpr(LN2)  # a global a kernel may read
# every thread of the program waits here (Triton 3.6 calls it thread_barrier, 3.7 barrier)
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
_GL_DTYPE = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}

# (d, causal) -> (BLOCK_M, BLOCK_N, num_warps, num_stages): the fastest measured on the H200
# (GPU_NOTES.md, "Gluon forward"). One warpgroup owns 64 query rows; registers and shared memory
# then leave room for two programs on an SM, whose warps the SM can interleave (one's softmax
# beside the other's matmuls, as FA3's ping-pong does by design). At d = 128 the key block is 64
# wide: two S tiles (one in flight, one in the softmax) and O must fit the 255 registers a thread
# may have.
CONFIGS = {
    (64, False): (64, 128, 4, 3),
    (64, True): (64, 128, 4, 3),
    (128, False): (64, 64, 4, 2),
    (128, True): (64, 64, 4, 2),
}


# ------------------------------------------------------------------------------------------------
# Layouts (compile-time helpers)
# ------------------------------------------------------------------------------------------------
@gluon.constexpr_function
def mma_layout(block_m, n, num_warps):
    """Register layout of a wgmma accumulator with BLOCK_M rows and n columns.

    A warpgroup (4 warps) multiplies 64 rows at a time, each warp owning 16 of them. With 8 warps
    the two warpgroups stack along the rows ([8, 1]): each takes 64 of the 128 rows and runs its
    own wgmma, so a row's whole softmax stays inside one warp (the row max and sum need only
    shuffles, never shared memory). One wgmma instruction covers 16 rows x n columns x 16 (fp16 or
    bf16) of the reduction dimension."""
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16]
    )


# ------------------------------------------------------------------------------------------------
# Kernel pieces
# ------------------------------------------------------------------------------------------------
@gluon.jit
def _expect_kv(desc, bars, block, pred, NUM_STAGES: gl.constexpr):
    """Arm the mbarrier of ring slot block % NUM_STAGES for the next fill: it will complete its
    current phase once desc's tile (its byte count) has landed. Touches no tile data."""
    mbarrier.expect(bars.index(block % NUM_STAGES), desc.block_type.nbytes, pred=pred)


@gluon.jit
def _copy_kv(
    desc, smem, bars, block, kv_row, pred, NUM_STAGES: gl.constexpr, BLOCK_N: gl.constexpr
):
    """Start the TMA copy of key block `block` (BLOCK_N rows of one K or V head) into ring slot
    block % NUM_STAGES; the copy engine reports the bytes to that slot's mbarrier."""
    slot = block % NUM_STAGES
    tma.async_copy_global_to_shared(
        desc, [kv_row, block * BLOCK_N, 0], bars.index(slot), smem.index(slot), pred=pred
    )


@gluon.jit
def _wait_kv(bars, block, NUM_STAGES: gl.constexpr):
    """Wait until key block `block` has landed in its ring slot. Slot s is filled for blocks s,
    s + NUM_STAGES, s + 2 NUM_STAGES, ...; its barrier flips phase 0, 1, 0, ... once per fill."""
    mbarrier.wait(bars.index(block % NUM_STAGES), (block // NUM_STAGES) & 1)


@gluon.jit
def _tile(smem, block, NUM_STAGES: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """The 2-D (BLOCK_N, d) view of ring slot block % NUM_STAGES (stored as [1, BLOCK_N, d])."""
    return smem.index(block % NUM_STAGES).reshape([BLOCK_N, HEAD_DIM])


@gluon.jit
def _softmax_step(
    s, m_i, l_i, start_n, rows, N_k, offset, qk_scale, MASK: gl.constexpr, CAUSAL: gl.constexpr,
    SCALE_POS: gl.constexpr, BLOCK_N: gl.constexpr,
):  # fmt: skip
    """Online softmax of one block of scores, in base 2, on the accumulator's register layout.

    s holds raw q . k products (fp32). Scaled scores are s * qk_scale with qk_scale = softmax
    scale * log2(e), so exp2 of them is exp of the true scaled scores. Returns the probabilities
    p = exp2(scaled - m_new) (fp32), alpha = exp2(m_old - m_new) (the factor that rescales the
    running O and l), and the new running max and sum."""
    if MASK:  # causal diagonal or ragged end: keys past N_k were zero-filled, mask them too
        cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        keep = gl.expand_dims(cols, 0) < N_k
        if CAUSAL:
            keep = keep & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1) + offset)
        s = gl.where(keep, s * qk_scale, -float("inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        # a row that has seen no key yet keeps max -inf; use 0 there so exp2 gives 0, not NaN
        m_use = gl.where(m_new == -float("inf"), 0.0, m_new)
        p = gl.exp2(s - gl.expand_dims(m_use, 1))
    else:  # every row sees every key of this block: no mask, scale folded into one FMA
        if SCALE_POS:
            m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        else:  # a negative scale turns the smallest product into the largest score
            m_new = gl.maximum(m_i, gl.min(s, 1) * qk_scale)
        m_use = m_new
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    l_new = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_new


@gluon.jit
def attend_block(
    j, n_blocks, q_smem, k_smem, v_smem, k_bars, v_bars, desc_k, desc_v, kv_row, s_cur, acc, p_prev,
    m_i, l_i, rows, N_k, offset, qk_scale, MASK: gl.constexpr, HAS_NEXT: gl.constexpr, CAUSAL:
    gl.constexpr, SCALE_POS: gl.constexpr, NUM_STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
):  # fmt: skip
    """One iteration of the pipelined loop, for key block j.

    On entry, S_j = Q K_j^T (s_cur) and O += P_{j-1} V_{j-1} (acc) may still be running on the
    tensor cores. On exit, S_{j+1} (returned as s_next, when HAS_NEXT) and O += P_j V_j (acc) are
    running; P_j (p) must stay untouched in registers until the latter is done."""
    s_layout: gl.constexpr = s_cur.type.tensor_type.layout
    o_layout: gl.constexpr = acc.type.tensor_type.layout
    BLOCK_M: gl.constexpr = q_smem.shape[0]

    # Phase 1 - keep the tensor cores busy: start S_{j+1} = Q K_{j+1}^T before touching S_j.
    # K_{j+1}^T is just a transposed view of the K tile; wgmma reads it from shared memory.
    if HAS_NEXT:
        _wait_kv(k_bars, j + 1, NUM_STAGES)
        k_next = _tile(k_smem, j + 1, NUM_STAGES, BLOCK_N, HEAD_DIM)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        s_next = warpgroup_mma(q_smem, k_next.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        # Phase 2 - wait for S_j. wgmma groups finish in the order they were started: S_j,
        # then O += P_{j-1} V_{j-1}, then S_{j+1}. Allowing one group in flight waits for the
        # first two and leaves S_{j+1} running under the softmax below. P_{j-1} is listed so
        # that its registers stay reserved until the multiply that reads them is done.
        s, acc, p_prev = warpgroup_mma_wait(num_outstanding=1, deps=[s_cur, acc, p_prev])
    else:
        s_next = s_cur  # nothing left to start
        s, acc, p_prev = warpgroup_mma_wait(num_outstanding=0, deps=[s_cur, acc, p_prev])

    # Refill the ring. K_j (read by S_j) and V_{j-1} (read by P_{j-1} V_{j-1}) are free now, in
    # this warpgroup; the barrier makes sure the other warpgroup is done with them too before
    # the copy engine overwrites them with K_{j+NUM_STAGES} and V_{j-1+NUM_STAGES}.
    # (Arming the barriers touches no tile, so it may come before the CTA-wide barrier.)
    k_pred = j + NUM_STAGES < n_blocks
    v_pred = (j >= 1) & (j + NUM_STAGES - 1 < n_blocks)
    _expect_kv(desc_k, k_bars, j + NUM_STAGES, k_pred, NUM_STAGES)
    _expect_kv(desc_v, v_bars, j + NUM_STAGES - 1, v_pred, NUM_STAGES)
    _cta_barrier()
    _copy_kv(desc_k, k_smem, k_bars, j + NUM_STAGES, kv_row, k_pred, NUM_STAGES, BLOCK_N)
    _copy_kv(desc_v, v_smem, v_bars, j + NUM_STAGES - 1, kv_row, v_pred, NUM_STAGES, BLOCK_N)

    # Phase 3 - softmax of S_j on the CUDA cores while S_{j+1} runs on the tensor cores.
    p, alpha, m_i, l_i = _softmax_step(
        s, m_i, l_i, j * BLOCK_N, rows, N_k, offset, qk_scale, MASK, CAUSAL, SCALE_POS, BLOCK_N
    )

    # Phase 4 - O = alpha * O + P_j V_j. P_j is rounded to the input dtype and handed to wgmma
    # straight from registers (the A operand); V_j is the B operand, in shared memory.
    alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
    acc = acc * gl.expand_dims(alpha_o, 1)
    p16 = gl.convert_layout(p.to(q_smem.dtype), gl.DotOperandLayout(0, o_layout, 2))
    _wait_kv(v_bars, j, NUM_STAGES)
    acc = warpgroup_mma(p16, _tile(v_smem, j, NUM_STAGES, BLOCK_N, HEAD_DIM), acc, is_async=True)
    return s_next, acc, p16, m_i, l_i


@gluon.jit
def _attend_pair(
    j, n_blocks, q_smem, k_smem, v_smem, k_bars, v_bars, desc_k, desc_v, kv_row, s_cur, acc, p, m_i,
    l_i, rows, N_k, offset, qk_scale, MASK: gl.constexpr, CAUSAL: gl.constexpr, SCALE_POS:
    gl.constexpr, NUM_STAGES: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
):  # fmt: skip
    """Blocks j and j + 1, each starting the S of the block after it (see the main loop)."""
    s_cur, acc, p, m_i, l_i = attend_block(
        j, n_blocks, q_smem, k_smem, v_smem, k_bars, v_bars, desc_k, desc_v, kv_row, s_cur, acc, p,
        m_i, l_i, rows, N_k, offset, qk_scale, MASK, True, CAUSAL, SCALE_POS, NUM_STAGES, BLOCK_N,
        HEAD_DIM,
    )  # fmt: skip
    s_cur, acc, p, m_i, l_i = attend_block(
        j + 1, n_blocks, q_smem, k_smem, v_smem, k_bars, v_bars, desc_k, desc_v, kv_row, s_cur, acc,
        p, m_i, l_i, rows, N_k, offset, qk_scale, MASK, True, CAUSAL, SCALE_POS, NUM_STAGES,
        BLOCK_N, HEAD_DIM,
    )  # fmt: skip
    return s_cur, acc, p, m_i, l_i


@gluon.jit
def _key_ranges(
    m0, N_q, N_k, offset, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr
):
    """Block-aligned (full_hi, hi), as in triton_fwd: keys [0, full_hi) are visible to every
    row of the block, keys [full_hi, hi) need the mask (diagonal, ragged end), keys past hi are
    seen by no row."""
    hi = N_k
    full = N_k
    if CAUSAL:
        last = gl.minimum(m0 + BLOCK_M, N_q) - 1
        hi = gl.minimum(gl.maximum(last + offset + 1, 0), N_k)
        full = gl.minimum(gl.maximum(m0 + offset + 1, 0), N_k)
    hi = gl.cdiv(hi, BLOCK_N) * BLOCK_N
    full_hi = gl.minimum((full // BLOCK_N) * BLOCK_N, hi)
    return full_hi, hi


@gluon.jit(do_not_specialize=["H", "GROUP", "N_q", "N_k"])
def _gluon_fwd(
    desc_q, desc_k, desc_v, O, LSE, qk_scale, H, GROUP, N_q, N_k, CAUSAL: gl.constexpr, SCALE_POS:
    gl.constexpr, NUM_STAGES: gl.constexpr,
):  # fmt: skip
    """One program: BLOCK_M query rows of one (batch, head). Grid (cdiv(N_q, BLOCK_M), B * H)."""
    BLOCK_M: gl.constexpr = desc_q.block_type.shape[1]
    HEAD_DIM: gl.constexpr = desc_q.block_type.shape[2]
    BLOCK_N: gl.constexpr = desc_k.block_type.shape[1]
    NUM_WARPS: gl.constexpr = gl.num_warps()
    dtype: gl.constexpr = desc_q.dtype
    s_layout: gl.constexpr = mma_layout(BLOCK_M, BLOCK_N, NUM_WARPS)  # S = Q K^T, (BM, BN)
    o_layout: gl.constexpr = mma_layout(BLOCK_M, HEAD_DIM, NUM_WARPS)  # O, (BM, d)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)  # one value per query row

    # Which rows, which heads.
    pid_m = gl.num_programs(0) - 1 - gl.program_id(0)  # heaviest causal blocks first
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    kv_row = b * (H // GROUP) + h // GROUP  # GQA: GROUP query heads share one K/V head
    m0 = pid_m * BLOCK_M
    offset = N_k - N_q
    rows = m0 + gl.arange(0, BLOCK_M, layout=row_layout)
    full_hi, hi = _key_ranges(m0, N_q, N_k, offset, CAUSAL, BLOCK_M, BLOCK_N)
    n_blocks = hi // BLOCK_N  # key blocks this program reads
    n_full = full_hi // BLOCK_N  # of which the first n_full need no mask

    # Shared memory: the Q tile, a ring of NUM_STAGES K tiles and one of V tiles, and one
    # mbarrier per buffer (a barrier counts the bytes TMA delivers into its buffer).
    q_smem = gl.allocate_shared_memory(dtype, desc_q.block_type.shape, desc_q.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + desc_k.block_type.shape, desc_k.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES] + desc_v.block_type.shape, desc_v.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)

    # Running softmax state and the output accumulator, fp32 in registers.
    m_i = gl.full([BLOCK_M], -float("inf"), gl.float32, row_layout)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_layout)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)

    if n_blocks > 0:
        # Prologue: Q once, and the first NUM_STAGES K and V tiles, all in flight at once.
        mbarrier.expect(q_bar, desc_q.block_type.nbytes)
        tma.async_copy_global_to_shared(desc_q, [bh, m0, 0], q_bar, q_smem)
        for i in gl.static_range(NUM_STAGES):
            _expect_kv(desc_k, k_bars, i, i < n_blocks, NUM_STAGES)
            _expect_kv(desc_v, v_bars, i, i < n_blocks, NUM_STAGES)
        _cta_barrier()
        for i in gl.static_range(NUM_STAGES):
            _copy_kv(desc_k, k_smem, k_bars, i, kv_row, i < n_blocks, NUM_STAGES, BLOCK_N)
            _copy_kv(desc_v, v_smem, v_bars, i, kv_row, i < n_blocks, NUM_STAGES, BLOCK_N)
        mbarrier.wait(q_bar, 0)
        q2 = q_smem.reshape([BLOCK_M, HEAD_DIM])

        # Start S_0 = Q K_0^T. The loop then always has one S in flight when it starts.
        _wait_kv(k_bars, 0, NUM_STAGES)
        s_cur = warpgroup_mma(
            q2,
            _tile(k_smem, 0, NUM_STAGES, BLOCK_N, HEAD_DIM).permute((1, 0)),
            gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout),
            use_acc=False,
            is_async=True,
        )
        # Wait for S_0 here, once. Reason: before the loop, the compiler sets up the loop's
        # registers (O = 0 and the like) with ordinary moves; if a wgmma were still in flight
        # there, ptxas would see plain instructions writing accumulator registers "inside" the
        # asynchronous stretch and would serialise every wgmma in the kernel. So no wgmma may be
        # in flight where one loop hands over to the next; a single exposed S per program is
        # the price.
        s_cur = warpgroup_mma_init(warpgroup_mma_wait(num_outstanding=0, deps=[s_cur]))
        acc_t = warpgroup_mma_init(acc)  # O as an asynchronous accumulator, like wgmma results
        p = gl.zeros([BLOCK_M, BLOCK_N], dtype, gl.DotOperandLayout(0, o_layout, 2))

        # The pipelined loop runs over PAIRS of key blocks. Why pairs: S_{j+1} is computed into
        # registers while S_j is still being read, so two sets of S registers take turns. A loop
        # whose iteration is one block would have to copy S_{j+1} into S_j's registers at the
        # end of every iteration - while the multiply that writes them is still running, which
        # makes ptxas serialise every wgmma of the kernel. With two blocks per iteration, the S
        # in flight at the end of an iteration sits in the same registers as at its start.
        # Each block of a pair starts the S of the block after it, so the pairs cover blocks
        # [0, 2 n_pairs) and leave one or two blocks (the last has nothing after it) to the tail.
        n_pairs = (n_blocks - 1) // 2
        # First the pairs whose two blocks need no mask...
        n_pairs_full = gl.minimum(n_full // 2, n_pairs)
        for t in range(0, n_pairs_full):
            s_cur, acc_t, p, m_i, l_i = _attend_pair(
                2 * t, n_blocks, q2, k_smem, v_smem, k_bars, v_bars, desc_k, desc_v, kv_row, s_cur,
                acc_t, p, m_i, l_i, rows, N_k, offset, qk_scale, False, CAUSAL, SCALE_POS,
                NUM_STAGES, BLOCK_N, HEAD_DIM,
            )  # fmt: skip
        # ...then the rest, masked (causal diagonal, ragged end; a mask that keeps everything,
        # on a pair that straddles the boundary, costs a little arithmetic and nothing else).
        for t in range(n_pairs_full, n_pairs):
            s_cur, acc_t, p, m_i, l_i = _attend_pair(
                2 * t, n_blocks, q2, k_smem, v_smem, k_bars, v_bars, desc_k, desc_v, kv_row, s_cur,
                acc_t, p, m_i, l_i, rows, N_k, offset, qk_scale, True, CAUSAL, SCALE_POS,
                NUM_STAGES, BLOCK_N, HEAD_DIM,
            )  # fmt: skip
        # Tail, masked: blocks n-2 and n-1, or n-1 alone. The last block starts nothing new;
        # then wait for its P V.
        if n_blocks - 2 * n_pairs == 2:
            s_cur, acc_t, p, m_i, l_i = attend_block(
                n_blocks - 2, n_blocks, q2, k_smem, v_smem, k_bars, v_bars, desc_k, desc_v, kv_row,
                s_cur, acc_t, p, m_i, l_i, rows, N_k, offset, qk_scale, True, True, CAUSAL,
                SCALE_POS, NUM_STAGES, BLOCK_N, HEAD_DIM,
            )  # fmt: skip
            s_cur, acc_t, p, m_i, l_i = attend_block(
                n_blocks - 1, n_blocks, q2, k_smem, v_smem, k_bars, v_bars, desc_k, desc_v, kv_row,
                s_cur, acc_t, p, m_i, l_i, rows, N_k, offset, qk_scale, True, False, CAUSAL,
                SCALE_POS, NUM_STAGES, BLOCK_N, HEAD_DIM,
            )  # fmt: skip
            acc, p = warpgroup_mma_wait(num_outstanding=0, deps=[acc_t, p])
        else:
            s_cur, acc_t, p, m_i, l_i = attend_block(
                n_blocks - 1, n_blocks, q2, k_smem, v_smem, k_bars, v_bars, desc_k, desc_v, kv_row,
                s_cur, acc_t, p, m_i, l_i, rows, N_k, offset, qk_scale, True, False, CAUSAL,
                SCALE_POS, NUM_STAGES, BLOCK_N, HEAD_DIM,
            )  # fmt: skip
            acc, p = warpgroup_mma_wait(num_outstanding=0, deps=[acc_t, p])

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(k_bars.index(i))
        mbarrier.invalidate(v_bars.index(i))

    # Epilogue: o = acc / l; lse = (m + log2 l) * ln 2. A row that saw no key has l = 0: o = 0,
    # lse = -inf.
    empty = l_i == 0.0
    l_use = gl.where(empty, 1.0, l_i)
    lse = gl.where(empty, -float("inf"), (m_i + gl.log2(l_use)) * _LN2)
    gl.store(LSE + bh.to(gl.int64) * N_q + rows, lse, mask=rows < N_q)
    o = acc / gl.expand_dims(gl.convert_layout(l_use, gl.SliceLayout(1, o_layout)), 1)
    # O is a fresh contiguous (B, H, N_q, d) tensor: a plain store, rows past N_q masked off.
    o_rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    offs = gl.expand_dims((bh.to(gl.int64) * N_q + o_rows) * HEAD_DIM, 1) + gl.expand_dims(dims, 0)
    gl.store(O + offs, o.to(dtype), mask=gl.expand_dims(o_rows < N_q, 1))


# ------------------------------------------------------------------------------------------------
# Host side
# ------------------------------------------------------------------------------------------------
def shared_layout(rows: int, d: int, dtype: torch.dtype):
    """The shared-memory layout of one [1, rows, d] tile: 128-byte swizzle (d >= 64 at 16 bits),
    what both TMA and wgmma want. Kernel and descriptor must agree on it."""
    return gl.NVMMASharedLayout.get_default_for([1, rows, d], _GL_DTYPE[dtype])


def descriptor(x3: torch.Tensor, rows: int) -> TensorDescriptor:
    """A descriptor over a 3-D (B * heads, N, d) view whose tile is [1, rows, d]: rows of one
    head only, zero-filled past N."""
    d = x3.shape[-1]
    return TensorDescriptor(
        x3, list(x3.shape), list(x3.stride()), [1, rows, d], shared_layout(rows, d, x3.dtype)
    )


def config_for(d: int, causal: bool) -> tuple:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for this head dim and mask."""
    return CONFIGS[(d, bool(causal))]


def check_config(cfg, name="hopper.gluon_fwd.forward") -> tuple:
    """cfg itself if the kernel can run it: 4 or 8 warps, 16 query rows per warp, block sizes
    powers of two from 16, at least two K/V stages (the loop reads block j + 1 while the copy
    engine refills block j's slot)."""
    if len(cfg) != 4 or not all(isinstance(x, int) and not isinstance(x, bool) for x in cfg):
        raise ValueError(
            f"{name}: config must be 4 ints (BLOCK_M, BLOCK_N, warps, stages), got {cfg}"
        )
    block_m, block_n, warps, stages = cfg
    if warps not in (4, 8) or block_m != 16 * warps * (block_m // (16 * warps)) or block_m < 64:
        raise ValueError(
            f"{name}: need num_warps 4 or 8 and BLOCK_M a multiple of 16 * num_warps (16 rows "
            f"per warp), got config {cfg}"
        )
    if block_n < 16 or block_n & (block_n - 1) or block_m & (block_m - 1):
        raise ValueError(f"{name}: BLOCK_M and BLOCK_N must be powers of two >= 16, got {cfg}")
    if stages < 2:
        raise ValueError(f"{name}: num_stages must be >= 2, got config {cfg}")
    return cfg


def forward(q, k, v, *, causal=False, softmax_scale=None, config=None):
    """Exact attention, forward only, through the Gluon kernel (same contract as
    `triton_fwd.forward`). config = (BLOCK_M, BLOCK_N, num_warps, num_stages).
    Returns o (B, H, N_q, d) in q's dtype and lse (B, H, N_q) float32."""
    name = "hopper.gluon_fwd.forward"
    (B, H, H_kv, N_q, N_k, d), scale = check_inputs(q, k, v, causal, softmax_scale, name)
    cfg = tuple(config or config_for(d, causal))
    block_m, block_n, warps, stages = check_config(cfg, name)
    if interpreting() or q.device.type != "cuda":
        raise HopperUnsupported(
            f"{name}: q, k, v must be CUDA tensors on an sm_90 GPU, got device {q.device} "
            "(Gluon kernels do not run under TRITON_INTERPRET=1; triton_fwd.forward does)"
        )
    q3 = q.contiguous().view(B * H, N_q, d)  # 3-D views: (batch * heads, N, d)
    k3 = k.contiguous().view(B * H_kv, N_k, d)
    v3 = v.contiguous().view(B * H_kv, N_k, d)
    o = torch.empty((B, H, N_q, d), device=q.device, dtype=q.dtype)
    lse = torch.empty((B, H, N_q), device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(N_q, block_m), B * H)
    _gluon_fwd[grid](
        descriptor(q3, block_m), descriptor(k3, block_n), descriptor(v3, block_n), o, lse,
        scale * LOG2E, H, H // H_kv, N_q, N_k,
        CAUSAL=causal, SCALE_POS=scale >= 0, NUM_STAGES=stages, num_warps=warps,
    )  # fmt: skip
    return o, lse
