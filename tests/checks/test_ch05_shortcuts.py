"""Chapter 05, exercise 5.1 (an autograd Function over the learner's own PyTorch tiled loops, in
the grader's tiles): shortcuts a learner in a hurry writes, each rejected with the diagnosis that
names it, beside honest Functions (the grader's tiles, smaller tiles, a separate dQ loop, Python
objects piling up) that are accepted. Also: pure-torch code is never blamed for NumPy memory."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from flashedu import checks
from flashedu.testing import run_grader

_SPEC = importlib.util.spec_from_file_location(
    "learner_torch_tiled_5", Path(__file__).parents[1] / "fixtures" / "learner_torch_tiled.py"
)
learner = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(learner)

SEED = 13


def _function(forward, backward=None, extra_saved=None):
    """A torch.autograd.Function around forward(q, k, v, causal, bm, bn) -> (o, lse) and
    backward(do, q, k, v, o, lse, causal, bm, bn) -> grads; extra_saved(q, k, lse) adds tensors
    to what is saved."""
    backward = backward or learner.backward

    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, causal, block_m, block_n):
            o, lse = forward(q, k, v, causal, block_m, block_n)
            more = tuple(extra_saved(q, k, lse)) if extra_saved else ()
            ctx.save_for_backward(q, k, v, o, lse, *more)
            ctx.causal, ctx.blocks = causal, (block_m, block_n)
            return o

        @staticmethod
        def backward(ctx, do):
            q, k, v, o, lse = ctx.saved_tensors[:5]
            grads = backward(do, q, k, v, o, lse, ctx.causal, *ctx.blocks)
            return (*grads, None, None, None)

    return Attention.apply


def _half_tiles(q, k, v, causal, bm, bn):
    return learner.forward(q, k, v, causal, max(1, bm // 2), max(1, bn // 2))


def _separate_dq(do, q, k, v, o, lse, causal, bm, bn):
    """dK, dV from the learner's loop; dQ again in a loop of its own (P rebuilt once more)."""
    _, dk, dv = learner.backward(do, q, k, v, o, lse, causal, bm, bn)
    N_q, N_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    D = (do * o).sum(-1)
    safe = torch.where(torch.isinf(lse), torch.full_like(lse, math.inf), lse)
    dq = torch.zeros_like(q)
    for r0 in range(0, N_q, bm):
        r1 = min(r0 + bm, N_q)
        for c0 in range(0, N_k, bn):
            c1 = min(c0 + bn, N_k)
            s = q[..., r0:r1, :] @ k[..., c0:c1, :].transpose(-1, -2) / math.sqrt(d)
            if causal:
                keep = torch.arange(c0, c1)[None] <= torch.arange(r0, r1)[:, None] + N_k - N_q
                s = s.masked_fill(~keep, -math.inf)
            p = torch.exp(s - safe[..., r0:r1, None])
            ds = p * (do[..., r0:r1, :] @ v[..., c0:c1, :].transpose(-1, -2) - D[..., r0:r1, None])
            dq[..., r0:r1, :] += ds @ k[..., c0:c1, :] / math.sqrt(d)
    return dq, dk, dv


_JUNK: list = []


def _python_objects(q, k, v, causal, bm, bn):
    """Honest loops that also pile up a megabyte of Python floats on the way."""
    _JUNK[:] = [float(i) for i in range(40_000)]
    return learner.forward(q, k, v, causal, bm, bn)


@pytest.mark.parametrize(
    "fn",
    [
        learner.function(),
        _function(_half_tiles),
        _function(learner.forward, _separate_dq),
        _function(_python_objects),
    ],
    ids=["grader's tiles", "smaller tiles", "separate dQ loop", "Python objects"],
)
def test_honest_functions_are_accepted(fn):
    report, text = run_grader(checks.check_autograd_function, fn, seed=SEED)
    assert report.passed, text


# ---------------------------------------------------------------------------- shortcuts


def _row_chunks_autograd(q, k, v, causal, block_m, block_n):
    """Plain torch autograd over blocks of query rows, each against every key."""
    N_q, N_k = q.shape[-2], k.shape[-2]
    outs = []
    for r0 in range(0, N_q, block_m):
        r1 = min(r0 + block_m, N_q)
        s = q[..., r0:r1, :] @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if causal:
            keep = torch.arange(N_k)[None] <= torch.arange(r0, r1)[:, None] + N_k - N_q
            s = s.masked_fill(~keep, -math.inf)
        outs.append(torch.softmax(s, dim=-1).nan_to_num() @ v)
    return torch.cat(outs, dim=-2)


def _sdpa_rows(q, k, v, causal, block_m, block_n):
    """torch's SDPA called block of rows by block of rows."""
    N_q, N_k = q.shape[-2], k.shape[-2]
    outs = []
    for r0 in range(0, N_q, block_m):
        r1 = min(r0 + block_m, N_q)
        keep = torch.arange(N_k)[None] <= torch.arange(r0, r1)[:, None] + N_k - N_q
        out = torch.nn.functional.scaled_dot_product_attention(
            q[..., r0:r1, :], k, v, attn_mask=keep if causal else None
        )
        outs.append(out.nan_to_num())
    return torch.cat(outs, dim=-2)


def _two_pass_forward(q, k, v, causal, bm, bn):
    """Tiles of the right size, but the row max in one pass and the sums in a second."""
    N_q, N_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    o = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], -math.inf, dtype=q.dtype)
    for r0 in range(0, N_q, bm):
        r1 = min(r0 + bm, N_q)

        def tile(c0, r0=r0, r1=r1):
            c1 = min(c0 + bn, N_k)
            s = q[..., r0:r1, :] @ k[..., c0:c1, :].transpose(-1, -2) / math.sqrt(d)
            if causal:
                keep = torch.arange(c0, c1)[None] <= torch.arange(r0, r1)[:, None] + N_k - N_q
                s = s.masked_fill(~keep, -math.inf)
            return s, c1

        m = torch.full(q.shape[:-2] + (r1 - r0,), -math.inf, dtype=q.dtype)
        for c0 in range(0, N_k, bn):
            m = torch.maximum(m, tile(c0)[0].amax(-1))
        ref = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        l, acc = torch.zeros_like(m), torch.zeros_like(q[..., r0:r1, :])
        for c0 in range(0, N_k, bn):
            s, c1 = tile(c0)
            p = torch.exp(s - ref[..., None])
            l, acc = l + p.sum(-1), acc + p @ v[..., c0:c1, :]
        safe = torch.where(l > 0, l, torch.ones_like(l))
        o[..., r0:r1, :] = acc / safe[..., None]
        lse[..., r0:r1] = torch.where(l > 0, ref + torch.log(safe), torch.full_like(l, -math.inf))
    return o, lse


def _p(q, k, lse):
    return torch.exp(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) - lse[..., None])


def _padded(p):
    return torch.nn.functional.pad(p, (0, 2, 0, 2))


_KEPT: dict = {}


def _module_copy(q, k, v, causal, bm, bn):
    """K and V copied into a module-level dict; the loops read their tiles from there."""
    _KEPT["k"], _KEPT["v"] = k.detach().clone(), v.detach().clone()
    return learner.forward(q, _KEPT["k"], _KEPT["v"], causal, bm, bn)


@pytest.mark.parametrize(
    "fn,words",
    [
        (_row_chunks_autograd, "plain torch autograd recorded your loop and saved a 1x2x5x7"),
        (_sdpa_rows, "called scaled_dot_product_attention"),
        (_function(_two_pass_forward), "two passes over the keys: the forward"),
        (_function(learner.forward, extra_saved=lambda q, k, lse: [_p(q, k, lse).mT]),
         "saved a 1x2x7x5 tensor for backward"),
        (_function(learner.forward, extra_saved=lambda q, k, lse: [_p(q, k, lse).reshape(-1)]),
         "saved a 70 tensor for backward"),
        (_function(learner.forward, extra_saved=lambda q, k, lse: [_padded(_p(q, k, lse))]),
         "saved a 1x2x7x9 tensor for backward"),
        (_function(learner.forward,
                   extra_saved=lambda q, k, lse: list(_p(q, k, lse).split(1, dim=-2))),
         "saved 5 tiles of scores for backward"),
        (_function(_module_copy), "kept a copy of the whole K in a module-level variable `_KEPT`"),
    ],
    ids=["autograd row chunks", "SDPA by rows", "two-pass forward", "P transposed",
         "P flattened", "P padded", "P in tiles", "module copy"],
)  # fmt: skip
def test_each_shortcut_is_rejected_by_name(fn, words):
    report, text = run_grader(checks.check_autograd_function, fn, seed=SEED)
    assert not report.passed and report.diagnosis.startswith(words), text
    assert "ctx.save_for_backward(q, k, v, o, lse);" not in text  # the outline waits for hint


def test_the_method_case_names_row_chunks_by_their_width():
    report, _ = run_grader(checks.check_autograd_function, _row_chunks_autograd, seed=SEED)
    last = report.results[-1][2]
    assert "block of scores" in last and "the grader asked for block_n =" in last, last


def test_pure_torch_code_is_never_blamed_for_numpy_memory():
    report, text = run_grader(checks.check_autograd_function, _function(_python_objects), seed=1)
    assert report.passed and "NumPy" not in text, text


def test_tiles_of_the_learners_own_choosing_are_named():
    """BLOCK = 16 hard-coded, whatever block_m and block_n the grader passes."""
    fn = _function(lambda q, k, v, causal, bm, bn: learner.forward(q, k, v, causal, 16, 16),
                   lambda do, q, k, v, o, lse, causal, bm, bn: learner.backward(
                       do, q, k, v, o, lse, causal, 16, 16))  # fmt: skip
    report, text = run_grader(checks.check_autograd_function, fn, seed=SEED)
    assert not report.passed and "the grader asked for block_n = " in report.diagnosis, text
