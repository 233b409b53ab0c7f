"""Chapter 04, exercise 4.2 (the tiled backward of one head): shortcuts a learner in a hurry
writes, each rejected with the diagnosis that names it, beside honest backward loops (FA2 order,
a separate dQ loop as the Triton backward does, query blocks outside, smaller tiles) that are
accepted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashedu import checks
from flashedu.testing import run_grader

SEED = 9


def _visible(rows, cols, N_q, N_k, causal):
    return cols[None, :] <= rows[:, None] + N_k - N_q if causal else None


def _p_tile(q, k, lse, rows, cols, causal):
    """One tile of P rebuilt from the saved lse; rows with lse = -inf give 0."""
    s = q[rows] @ k[cols].T / np.sqrt(q.shape[1])
    keep = _visible(rows, cols, q.shape[0], k.shape[0], causal)
    if keep is not None:
        s = np.where(keep, s, -np.inf)
    return np.exp(s - np.where(np.isneginf(lse[rows]), np.inf, lse[rows])[:, None])


def _fa2(do, q, k, v, o, lse, *, causal=False, block_m, block_n):
    """Honest: key blocks outside, query blocks inside, P from lse."""
    N_q, N_k, tau = q.shape[0], k.shape[0], 1 / np.sqrt(q.shape[1])
    D = (do * o).sum(axis=1)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for c0 in range(0, N_k, block_n):
        cols = np.arange(c0, min(c0 + block_n, N_k))
        for r0 in range(0, N_q, block_m):
            rows = np.arange(r0, min(r0 + block_m, N_q))
            p = _p_tile(q, k, lse, rows, cols, causal)
            dv[cols] += p.T @ do[rows]
            ds = p * (do[rows] @ v[cols].T - D[rows, None])
            dq[rows] += tau * ds @ k[cols]
            dk[cols] += tau * ds.T @ q[rows]
    return dq, dk, dv


def _separate_dq(do, q, k, v, o, lse, *, causal=False, block_m, block_n):
    """Honest: dK and dV in one loop, dQ in a second that rebuilds P once more."""
    N_q, N_k, tau = q.shape[0], k.shape[0], 1 / np.sqrt(q.shape[1])
    D = (do * o).sum(axis=1)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for c0 in range(0, N_k, block_n):
        cols = np.arange(c0, min(c0 + block_n, N_k))
        for r0 in range(0, N_q, block_m):
            rows = np.arange(r0, min(r0 + block_m, N_q))
            p = _p_tile(q, k, lse, rows, cols, causal)
            dv[cols] += p.T @ do[rows]
            dk[cols] += tau * (p * (do[rows] @ v[cols].T - D[rows, None])).T @ q[rows]
    for r0 in range(0, N_q, block_m):
        rows = np.arange(r0, min(r0 + block_m, N_q))
        for c0 in range(0, N_k, block_n):
            cols = np.arange(c0, min(c0 + block_n, N_k))
            p = _p_tile(q, k, lse, rows, cols, causal)
            dq[rows] += tau * (p * (do[rows] @ v[cols].T - D[rows, None])) @ k[cols]
    return dq, dk, dv


def _queries_outside(do, q, k, v, o, lse, *, causal=False, block_m, block_n):
    """Honest: query blocks outside, dK and dV accumulated across them."""
    N_q, N_k, tau = q.shape[0], k.shape[0], 1 / np.sqrt(q.shape[1])
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for r0 in range(0, N_q, block_m):
        rows = np.arange(r0, min(r0 + block_m, N_q))
        D = (do[rows] * o[rows]).sum(axis=1)
        for c0 in range(0, N_k, block_n):
            cols = np.arange(c0, min(c0 + block_n, N_k))
            p = _p_tile(q, k, lse, rows, cols, causal)
            dv[cols] += p.T @ do[rows]
            ds = p * (do[rows] @ v[cols].T - D[:, None])
            dq[rows] += tau * ds @ k[cols]
            dk[cols] += tau * ds.T @ q[rows]
    return dq, dk, dv


def _smaller_tiles(do, q, k, v, o, lse, *, causal=False, block_m, block_n):
    return _fa2(do, q, k, v, o, lse, causal=causal, block_m=max(1, block_m // 2),
                block_n=max(1, block_n // 2))  # fmt: skip


@pytest.mark.parametrize(
    "fn", [_fa2, _separate_dq, _queries_outside, _smaller_tiles],
    ids=["FA2 order", "separate dQ loop", "queries outside", "smaller tiles"],
)  # fmt: skip
def test_honest_backward_loops_are_accepted(fn):
    report, text = run_grader(checks.tiled_attention_backward, fn, seed=SEED)
    assert report.passed, text


# ---------------------------------------------------------------------------- shortcuts


def _recompute_stats(do, q, k, v, o, lse, *, causal=False, block_m, block_n):
    """Ignores the saved lse: a pass over the keys rebuilds each row's max and sum first."""
    N_q, N_k = q.shape[0], k.shape[0]
    mine = np.zeros(N_q)
    for r0 in range(0, N_q, block_m):
        rows = np.arange(r0, min(r0 + block_m, N_q))
        m, l = np.full(rows.size, -np.inf), np.zeros(rows.size)
        for c0 in range(0, N_k, block_n):
            cols = np.arange(c0, min(c0 + block_n, N_k))
            s = q[rows] @ k[cols].T / np.sqrt(q.shape[1])
            keep = _visible(rows, cols, N_q, N_k, causal)
            s = s if keep is None else np.where(keep, s, -np.inf)
            m_new = np.maximum(m, s.max(axis=1))
            ref = np.where(np.isneginf(m_new), 0.0, m_new)
            l, m = np.exp(m - ref) * l + np.exp(s - ref[:, None]).sum(axis=1), m_new
        with np.errstate(divide="ignore"):
            mine[rows] = np.where(l > 0, np.where(np.isneginf(m), 0.0, m) + np.log(l), -np.inf)
    return _fa2(do, q, k, v, o, mine, causal=causal, block_m=block_m, block_n=block_n)


def _row_chunks(do, q, k, v, o, lse, *, causal=False, block_m, block_n):
    """Each block of query rows against every key at once: a block_m x N_k P."""
    return _fa2(do, q, k, v, o, lse, causal=causal, block_m=block_m, block_n=k.shape[0])


def _materialised_p(do, q, k, v, o, lse, *, causal=False, block_m, block_n):
    """P rebuilt tile by tile into one N_q x N_k array, then the gradients from it."""
    N_q, N_k, tau = q.shape[0], k.shape[0], 1 / np.sqrt(q.shape[1])
    P = np.zeros((N_q, N_k))
    for r0 in range(0, N_q, block_m):
        rows = np.arange(r0, min(r0 + block_m, N_q))
        for c0 in range(0, N_k, block_n):
            cols = np.arange(c0, min(c0 + block_n, N_k))
            P[r0 : r0 + rows.size, c0 : c0 + cols.size] = _p_tile(q, k, lse, rows, cols, causal)
    dS = P * (do @ v.T - (do * o).sum(axis=1)[:, None])
    return tau * dS @ k, tau * dS.T @ q, P.T @ do


def _three_loops(do, q, k, v, o, lse, *, causal=False, block_m, block_n):
    """dV, dK and dQ each in its own loop, each rebuilding every tile of P."""
    N_q, N_k, tau = q.shape[0], k.shape[0], 1 / np.sqrt(q.shape[1])
    D = (do * o).sum(axis=1)
    grads = [np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)]
    for which in ("dv", "dk", "dq"):
        for c0 in range(0, N_k, block_n):
            cols = np.arange(c0, min(c0 + block_n, N_k))
            for r0 in range(0, N_q, block_m):
                rows = np.arange(r0, min(r0 + block_m, N_q))
                p = _p_tile(q, k, lse, rows, cols, causal)
                if which == "dv":
                    grads[2][cols] += p.T @ do[rows]
                    continue
                ds = p * (do[rows] @ v[cols].T - D[rows, None])
                if which == "dk":
                    grads[1][cols] += tau * ds.T @ q[rows]
                else:
                    grads[0][rows] += tau * ds @ k[cols]
    return tuple(grads)


def _torch_autograd_rows(do, q, k, v, o, lse, *, causal=False, block_m, block_n):
    """torch autograd over row chunks: the forward rerun block of rows by block of rows."""
    tq, tk, tv = (torch.tensor(np.array(x), requires_grad=True) for x in (q, k, v))
    N_q, N_k = q.shape[0], k.shape[0]
    for r0 in range(0, N_q, block_m):
        r1 = min(r0 + block_m, N_q)
        s = tq[r0:r1] @ tk.T / q.shape[1] ** 0.5
        if causal:
            keep = torch.arange(N_k)[None] <= torch.arange(r0, r1)[:, None] + N_k - N_q
            s = s.masked_fill(~keep, -torch.inf)
        out = torch.softmax(s, dim=-1).nan_to_num() @ tv
        out.backward(torch.from_numpy(np.array(do[r0:r1])))
    return tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()


@pytest.mark.parametrize(
    "fn,words",
    [
        (_recompute_stats, "never read the saved lse"),
        (_row_chunks, "your code held a "),
        (_materialised_p, "built a 256x256 array"),
        (_three_loops, "three passes over the keys"),
        (_torch_autograd_rows, "your code held a "),
    ],
    ids=["recomputed statistics", "row chunks", "P materialised", "three loops", "torch autograd"],
)
def test_each_shortcut_is_rejected_by_name(fn, words):
    with np.errstate(all="ignore"):
        report, text = run_grader(checks.tiled_attention_backward, fn, seed=SEED)
    assert not report.passed and report.diagnosis.startswith(words), text
    assert "dS = P * (dP - D)" not in text  # the formula waits for checks.hint


def test_a_materialised_p_is_named_as_the_matrix_of_all_scores_in_the_method_case():
    report, _ = run_grader(checks.tiled_attention_backward, _materialised_p, seed=SEED)
    last = report.results[-1][2]
    assert "matrix of all scores" in last and "block_n =" in last, last


def _own_tiles(do, q, k, v, o, lse, *, causal=False, block_m, block_n):
    """Ignores the grader's tiles and uses 16 x 16 whatever it asks."""
    return _fa2(do, q, k, v, o, lse, causal=causal, block_m=16, block_n=16)


def test_tiles_of_the_learners_own_choosing_are_named():
    report, text = run_grader(checks.tiled_attention_backward, _own_tiles, seed=SEED)
    assert not report.passed and "the grader asked for block_n = " in report.diagnosis, text
