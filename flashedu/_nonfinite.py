"""One behaviour for a NaN or an infinity in the inputs, in every implementation: it propagates as
in the float64 reference (and PyTorch's SDPA).

In the reference, o = P @ V with P exactly 0 for every key a row may not see, and 0 x NaN and
0 x inf are NaN: a non-finite entry v[j, c] makes column c of EVERY row NaN, including rows that
cannot see key j (causal or sliding-window masks). A NaN in q or k reaches only the rows whose
scores it enters, in every implementation alike. Kernels that skip the K/V blocks a row cannot
see never multiply those zeros by v, so they would keep such rows finite: `poison_hidden_values`
restores the reference's answer after the kernel, with O(N d) elementwise work beside the kernel's
O(N^2 d), and leaves the kernels themselves as they are. On a GPU that work is two small Triton
kernels (`flashedu.kernels.nonfinite`: one row of o when there is no left window edge, else one
read of v; no host sync); the torch version below, a dozen passes over index tensors the size of v
and o, cost as much as a causal forward on the H200.

Used by `flashedu.tiled.forward` (NumPy, `poison_hidden_values_np`),
`flashedu.torch_tiled.forward`, `flashedu.kernels.forward` and the Hopper kernels' dispatch
(`flashedu.hopper.dispatch.forward`); `flashedu.naive` multiplies the whole P by V and agrees
already. Only the forward's output is covered: gradients of non-finite inputs are not specified.
Tested in tests/faults/test_faults_silent.py.
"""

from __future__ import annotations

import numpy as np


def poison_hidden_values(o, v, N_q: int, left: int, right: int):
    """o (B, H, N_q, d_v) with NaN in column c of each row that cannot see some key j whose
    v[j, c] is not finite. Row i sees keys i + N_k - N_q - left ... i + N_k - N_q + right (-1:
    unbounded), as in `masks.band`. Nothing is masked when both sides are unbounded: o returned."""
    if left < 0 and right < 0:
        return o
    if o.is_cuda:  # o is the kernel's own fresh output: poisoned in place
        from .kernels import nonfinite

        return nonfinite.poison_hidden_values(o, v, N_q, left, right)
    import torch  # here, so that the NumPy implementations need not import it

    B, H_kv, N_k, _ = v.shape
    bad = ~torch.isfinite(v)  # (B, H_kv, N_k, d_v)
    j = torch.arange(N_k, device=v.device)[:, None]  # (N_k, 1)
    last = torch.where(bad, j, -1).amax(dim=-2)[..., None, :]  # (B, H_kv, 1, d_v); -1: none
    first = torch.where(bad, j, N_k).amin(dim=-2)[..., None, :]  # N_k: none
    diag = torch.arange(N_q, device=v.device)[:, None] + (N_k - N_q)  # (N_q, 1)
    hidden = torch.zeros((B, H_kv, N_q, v.shape[-1]), dtype=torch.bool, device=v.device)
    if right >= 0:
        hidden |= (last >= 0) & (last > diag + right)
    if left >= 0:
        hidden |= (first < N_k) & (first < diag - left)
    hidden = hidden.repeat_interleave(o.shape[1] // H_kv, dim=1)
    return o.masked_fill(hidden, float("nan"))


def poison_hidden_values_np(o: np.ndarray, v: np.ndarray, N_q: int, left: int, right: int):
    """`poison_hidden_values` for NumPy arrays: o (B, H, N_q, d_v), v (B, H_kv, N_k, d_v)."""
    if left < 0 and right < 0:
        return o
    B, H_kv, N_k, d_v = v.shape
    bad = ~np.isfinite(v)
    j = np.arange(N_k)[:, None]
    last = np.where(bad, j, -1).max(axis=-2)[..., None, :]  # (B, H_kv, 1, d_v)
    first = np.where(bad, j, N_k).min(axis=-2)[..., None, :]
    diag = np.arange(N_q)[:, None] + (N_k - N_q)
    hidden = np.zeros((B, H_kv, N_q, d_v), dtype=bool)
    if right >= 0:
        hidden |= (last >= 0) & (last > diag + right)
    if left >= 0:
        hidden |= (first < N_k) & (first < diag - left)
    hidden = np.repeat(hidden, o.shape[1] // H_kv, axis=1)
    return np.where(hidden, np.nan, o).astype(o.dtype, copy=False) if hidden.any() else o
