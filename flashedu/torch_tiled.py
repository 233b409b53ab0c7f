"""The tiled FlashAttention-2 algorithm written in PyTorch ops: forward, and backward by
recomputation.

The same loops as the NumPy `flashedu.tiled`, on torch tensors, vectorised over batch and heads: an
outer loop over blocks of `block_m` query rows (forward) or `block_n` key rows (backward), an inner
loop over the other side, the online softmax in between. Neither pass ever holds an (N_q, N_k) score
matrix; the backward recomputes each block of P from Q, K and the saved log-sum-exp (Dao 2023,
FlashAttention-2, Algorithms 1 and 2).

It runs wherever PyTorch runs (CPU or GPU), so `flashedu.autograd` can wrap it as a
`torch.autograd.Function` and a model can train with it. The functions themselves do not build an
autograd graph.

Honest limits:
* It is a teaching implementation: every block is a separate PyTorch call from a Python loop, so on
  a GPU the "SRAM" tiles are ordinary tensors in device memory and it is far slower than a fused
  kernel (`flashedu.kernels.fwd`). It shows the algorithm and its memory footprint, not its
  speed.
* float16 and bfloat16 inputs are upcast to float32 for all the arithmetic; outputs come back in the
  input dtype. float64 inputs stay in float64.
* Plain and causal attention and GQA only: no sliding window, ALiBi, dropout or arbitrary masks.

Introduced in notebooks/05_pytorch_autograd.ipynb.
"""

from __future__ import annotations

import torch

from ._nonfinite import poison_hidden_values
from .dtypes import acc_dtype
from .validation import check_backward, check_block, check_causal, check_qkv, resolve_scale

BLOCK_M = 64
BLOCK_N = 64


def _group(q, k, v, H_kv, acc):
    """(B, H, N, d) -> (B*H_kv, G, N, d) for q and (B*H_kv, 1, N, d) for k, v (v keeps its own head
    dim d_v), with G = H // H_kv.

    Query head h reads K/V head h // G (GQA), so the G query heads of a group broadcast against one
    K/V head in every matmul below: K and V are never copied H // H_kv times.
    """
    B, H, N_q, d = q.shape
    q = q.to(acc).reshape(B * H_kv, H // H_kv, N_q, d)
    k = k.to(acc).reshape(B * H_kv, 1, k.shape[2], d)
    v = v.to(acc).reshape(B * H_kv, 1, v.shape[2], v.shape[3])
    return q, k, v


def _key_end(i1: int, N_k: int, causal: bool, offset: int) -> int:
    """One past the last key any of the query rows < i1 may see (causal: j <= i + offset)."""
    return min(N_k, i1 + offset) if causal else N_k


def _query_start(j0: int, causal: bool, offset: int) -> int:
    """The first query row that may see key j0 (causal: i >= j0 - offset)."""
    return max(0, j0 - offset) if causal else 0


def _scores(q_i, k_j, scale, i0, j0, causal, offset):
    """s_ij = scale * q_i k_j^T with keys above the causal diagonal set to -inf. (.., m, n)."""
    s_ij = torch.matmul(q_i, k_j.transpose(-1, -2)) * scale  # (BH_kv, G, m, n)
    m, n = q_i.shape[-2], k_j.shape[-2]
    if causal and j0 + n - 1 > i0 + offset:  # only blocks that cross the diagonal need a mask
        i = torch.arange(i0, i0 + m, device=s_ij.device)[:, None]
        j = torch.arange(j0, j0 + n, device=s_ij.device)[None, :]
        s_ij = s_ij.masked_fill(j > i + offset, float("-inf"))
    return s_ij


def forward_rows(q_i, k, v, i0, scale, causal, offset, block_n):
    """o_i and lse_i for one block of query rows, streaming K and V in blocks of `block_n` keys."""
    m_i = torch.full(
        q_i.shape[:-1], float("-inf"), dtype=q_i.dtype, device=q_i.device
    )  # running row max
    l_i = torch.zeros_like(m_i)  # running row sum
    o_i = q_i.new_zeros((*q_i.shape[:-1], v.shape[-1]))  # unnormalised output, (.., m, d_v)
    for j0 in range(0, _key_end(i0 + q_i.shape[-2], k.shape[-2], causal, offset), block_n):
        k_j, v_j = (
            k[..., j0 : j0 + block_n, :],
            v[..., j0 : j0 + block_n, :],
        )  # HBM: read one K and V block
        s_ij = _scores(
            q_i, k_j, scale, i0, j0, causal, offset
        )  # (BH_kv, G, m, n), never leaves "SRAM"
        m_new = torch.maximum(m_i, s_ij.amax(dim=-1))
        m_safe = torch.where(
            torch.isfinite(m_new), m_new, torch.zeros_like(m_new)
        )  # all -inf so far: use 0
        p_ij = torch.exp(s_ij - m_safe[..., None])  # masked entries: exp(-inf) = 0
        alpha = torch.exp(m_i - m_safe)  # rescale: the row max moved
        l_i = alpha * l_i + p_ij.sum(dim=-1)
        o_i = alpha[..., None] * o_i + torch.matmul(p_ij, v_j)  # (BH_kv, G, m, d_v)
        m_i = m_new
    seen = l_i > 0  # False only on fully masked rows
    o_i = o_i / torch.where(seen, l_i, torch.ones_like(l_i))[..., None]
    lse_i = torch.where(
        seen,
        m_i + torch.log(torch.where(seen, l_i, torch.ones_like(l_i))),
        torch.full_like(l_i, float("-inf")),
    )
    return o_i, lse_i


@torch.no_grad()
def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
):
    """Exact attention by tiles in PyTorch, never forming the (N_q, N_k) score matrix.

    Args:
        q: (B, H, N_q, d).  k: (B, H_kv, N_k, d), v: (B, H_kv, N_k, d_v) with H % H_kv == 0.
            float16, bfloat16, float32 or float64.
        causal: query i sees key j iff j <= i + N_k - N_q (bottom-right aligned); key blocks wholly
            above the diagonal are skipped, not masked.
        softmax_scale: multiplies q @ k^T before the softmax; default 1 / sqrt(d).
        block_m, block_n: rows of Q and of K/V per tile (B_r and B_c in the paper). Any N_q, N_k is
            allowed.
    Returns:
        o: (B, H, N_q, d_v) in q's dtype; a fully masked row is 0.
        lse: (B, H, N_q) float32 (float64 for float64 input), natural-log logsumexp of each scaled
            score row, -inf on fully masked rows.
    """
    B, H, H_kv, N_q, N_k, d = check_qkv(
        q, k, v, name="torch_tiled.forward", kind="torch", value_dim=True
    )
    scale = resolve_scale(softmax_scale, d, name="torch_tiled.forward")
    causal = check_causal(causal, name="torch_tiled.forward")
    block_m = check_block(block_m, "block_m", name="torch_tiled.forward")
    block_n = check_block(block_n, "block_n", name="torch_tiled.forward")
    acc = acc_dtype(q.dtype)
    qg, kg, vg = _group(q, k, v, H_kv, acc)
    o = qg.new_zeros((*qg.shape[:-1], v.shape[-1]))  # HBM: write B H N_q d_v
    lse = torch.full(qg.shape[:-1], float("-inf"), dtype=acc, device=q.device)  # HBM: write B H N_q
    for i0 in range(0, N_q, block_m):
        q_i = qg[..., i0 : i0 + block_m, :]  # HBM: read one Q block
        o[..., i0 : i0 + block_m, :], lse[..., i0 : i0 + block_m] = forward_rows(
            q_i, kg, vg, i0, scale, causal, N_k - N_q, block_n
        )
    o = o.reshape(B, H, N_q, v.shape[-1]).to(q.dtype)
    # the skipped blocks' keys: a non-finite v there is NaN in every row, as in the reference
    return poison_hidden_values(o, v, N_q, -1, 0 if causal else -1), lse.reshape(B, H, N_q)


def _backward_cols(j0, qg, kg, vg, dog, lse, delta, dq, scale, causal, block_m, block_n):
    """dk_j and dv_j for one block of keys; adds this block's share of dq into `dq` in place."""
    k_j, v_j = (
        kg[..., j0 : j0 + block_n, :],
        vg[..., j0 : j0 + block_n, :],
    )  # HBM: read K, V block once
    dk_j, dv_j = torch.zeros_like(k_j), torch.zeros_like(v_j)  # stay on chip for the whole Q loop
    N_q, offset = qg.shape[-2], kg.shape[-2] - qg.shape[-2]
    first = (
        _query_start(j0, causal, offset) // block_m * block_m
    )  # skip query blocks that cannot see j0
    for i0 in range(first, N_q, block_m):
        rows = slice(i0, i0 + block_m)
        q_i, do_i = qg[..., rows, :], dog[..., rows, :]  # HBM: read Q, dO blocks
        s_ij = _scores(q_i, k_j, scale, i0, j0, causal, offset)  # (BH_kv, G, m, n), recomputed
        p_ij = torch.exp(s_ij - lse[..., rows, None])  # P from the saved lse, never stored
        # forward: o_i = sum_j p_ij v_j  ->  backward: dv_j += p_ij^T do_i
        # (summed over the G heads of a group)
        dv_j += torch.matmul(p_ij.transpose(-1, -2), do_i).sum(dim=1, keepdim=True)
        dp_ij = torch.matmul(do_i, v_j.transpose(-1, -2))  # (BH_kv, G, m, n)
        ds_ij = p_ij * (dp_ij - delta[..., rows, None])  # softmax Jacobian with D = rowsum(dO o O)
        dq[..., rows, :] += scale * torch.matmul(ds_ij, k_j)  # HBM: read-modify-write dQ block
        dk_j += scale * torch.matmul(ds_ij.transpose(-1, -2), q_i).sum(dim=1, keepdim=True)
    return dk_j, dv_j  # HBM: write dK, dV block once


@torch.no_grad()
def backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
):
    """Gradients of sum(o * do) by recomputation: FlashAttention-2's backward in PyTorch ops.

    D = rowsum(dO o O) once, then an outer loop over key blocks j (dK_j, dV_j accumulate on chip)
    and an inner loop over query blocks i: P_ij = exp(S_ij - lse_i), dV_j += P_ij^T dO_i,
    dP_ij = dO_i V_j^T, dS_ij = P_ij o (dP_ij - D_i), dQ_i += scale dS_ij K_j,
    dK_j += scale dS_ij^T Q_i.

    Args:
        do, o: (B, H, N_q, d_v) in q's dtype; lse: (B, H, N_q) from `forward`. Other arguments as in
            `forward`, and they must be the same values forward used.
    Returns:
        dq (B, H, N_q, d), dk (B, H_kv, N_k, d) and dv (B, H_kv, N_k, d_v), in q's dtype. Fully
        masked rows contribute nothing.
    """
    B, H, H_kv, N_q, N_k, d = check_qkv(
        q, k, v, name="torch_tiled.backward", kind="torch", value_dim=True
    )
    check_backward(do, o, lse, q, name="torch_tiled.backward", kind="torch", v=v)
    scale = resolve_scale(softmax_scale, d, name="torch_tiled.backward")
    causal = check_causal(causal, name="torch_tiled.backward")
    block_m = check_block(block_m, "block_m", name="torch_tiled.backward")
    block_n = check_block(block_n, "block_n", name="torch_tiled.backward")
    acc = acc_dtype(q.dtype)
    qg, kg, vg = _group(q, k, v, H_kv, acc)
    dog, og = (x.to(acc).reshape(*qg.shape[:-1], v.shape[-1]) for x in (do, o))
    lse = lse.to(acc).reshape(qg.shape[:-1])
    lse = torch.where(
        torch.isfinite(lse), lse, torch.full_like(lse, float("inf"))
    )  # masked row: P = exp(-inf)
    delta = (dog * og).sum(dim=-1)  # D_i = rowsum(dO_i o O_i), (BH_kv, G, N_q)
    dq = torch.zeros_like(qg)
    dk, dv = torch.zeros_like(kg), torch.zeros_like(vg)
    for j0 in range(0, N_k, block_n):
        dk[..., j0 : j0 + block_n, :], dv[..., j0 : j0 + block_n, :] = _backward_cols(
            j0, qg, kg, vg, dog, lse, delta, dq, scale, causal, block_m, block_n
        )
    return (
        dq.reshape(B, H, N_q, d).to(q.dtype),
        dk.reshape(B, H_kv, N_k, d).to(q.dtype),
        dv.reshape(B, H_kv, N_k, v.shape[-1]).to(q.dtype),
    )
