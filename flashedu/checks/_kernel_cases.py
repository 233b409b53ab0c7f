"""The cases of the kernel exercises (6.3 the forward, 7.3 dK/dV, 7.4 dQ): inputs, float64
answers, runs and judges.

Each case draws fresh inputs of one stage (a block multiple, ragged lengths, causal with
N_q != N_k, rows that see no key, GQA, float16), lays them out with NaN gaps
(`_triton.gapped`), launches the learner's kernel itself through the package launcher, into
NaN-filled outputs, with the grader's own block sizes (`_triton.run_learner`), and judges the run
(`_triton_judge.judge_run`): every tile within the grader's blocks, then the float64 reference,
the float64 twins of the usual mistakes and the FA2 byte budget. The blocks are BLOCK = 16 under
the interpreter and 64 on a GPU, and the stages differ in them (BLOCK x BLOCK, 2 BLOCK x BLOCK,
BLOCK x 2 BLOCK), so a kernel that assumes BLOCK_M == BLOCK_N, or keeps a tile size of its own,
shows; lengths are drawn several blocks long and ragged.

Used by the graders `triton_forward` (ch06.py), `triton_dkdv` and `triton_dq` (ch07.py).
"""

from __future__ import annotations

import numpy as np
import torch

from .. import reference
from ..kernels.exercises import launch_dkdv, launch_dq, launch_forward
from ..testing import Tolerance, random_qkv, to_numpy, tolerance
from . import _attn_variants, _triton, _triton_bytes, _triton_judge
from ._core import Case

BLOCK = 16 if _triton.INTERPRETER else 64  # the launchers' default block sizes
LSE_TOL = Tolerance(2e-5, 2e-5)  # lse is float32 for every input dtype


def stage_specs(rng, hints: dict, bs: int = BLOCK) -> list[tuple]:
    """(label, (B, H, H_kv, N_q, N_k, d), dtype, causal, hint, (block_m, block_n)) for the six
    stages, simplest first, sizes drawn around the block size bs; hints: stage -> what to look at
    when a case fails."""
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))
    rq, rk = bs * r(1, 2) + r(1, bs - 1), bs * r(2, 3) + r(1, bs - 1)
    cq = bs + r(1, bs - 1)
    ck = cq + bs + r(1, bs - 1)
    eq = ck - cq + bs + r(1, bs - 1)  # N_q - N_k > bs: a whole query block sees no key
    stages = [
        ("N a block multiple", (1, 2, 2, 2 * bs, 2 * bs, 16), "float32", False, "loop"),
        (f"ragged N_q={rq}, N_k={rk}", (1, 2, 2, rq, rk, 32), "float32", False, "ragged"),
        (f"causal, N_q={cq} < N_k={ck}", (1, 2, 2, cq, ck, 32), "float32", True, "causal"),
        (f"causal, N_q={eq} > N_k={ck - cq}: rows see no key", (2, 1, 1, eq, ck - cq, 16),
         "float32", True, "empty"),
        (f"GQA 4 heads on 2, causal, N_q={rq}, N_k={rk}", (1, 4, 2, rq, rk, 32), "float32", True,
         "gqa"),
        (f"float16, GQA 4 on 1, causal, N_q={rq}, N_k={rk + bs}", (1, 4, 1, rq, rk + bs, 32),
         "float16", True, "fp16"),
    ]  # fmt: skip
    blocks = {"gqa": (2 * bs, bs), "fp16": (bs, 2 * bs)}
    return [
        (label, dims, dtype, causal, hints[stage], blocks.get(stage, (bs, bs)))
        for label, dims, dtype, causal, stage in stages
    ]


NO_MATCH = "matches none of the usual mistakes: checks.hint(...) gives the update rule"
FORWARD_HINTS = {
    "loop": f"o and lse {NO_MATCH}",
    "ragged": "mask the loads of the last key block (cols < N_k) and its missing scores (-inf)",
    "causal": "causal, bottom-right: query i sees keys j <= i + N_k - N_q",
    "empty": _attn_variants.EMPTY_ROWS,
    "gqa": "with GQA query head h reads K/V head h // GROUP (the given prologue does it)",
    "fp16": "p goes into the second tl.dot in v's dtype (p.to(v.dtype)); keep m, l, acc in fp32",
}
DKDV_HINTS = {
    "loop": f"dk and dv {NO_MATCH}",
    "ragged": "mask the loads of the last query block (rows < N_q) and zero P^T past them",
    "causal": "causal: query i sees key j iff j <= i + N_k - N_q; loop from the first query "
    "block that sees this program's first key",
    "empty": _attn_variants.EMPTY_ROWS_BWD,
    "gqa": "with GQA every query head of the group adds into dk and dv (the loop over g)",
    "fp16": "P^T and dS^T go into tl.dot in the inputs' dtype; keep dk, dv in fp32",
}
DQ_HINTS = {
    "loop": f"dq {NO_MATCH}",
    "ragged": "mask the loads of the last key block (cols < N_k) and zero P past them",
    "causal": "causal, bottom-right: query i sees keys j <= i + N_k - N_q",
    "empty": _attn_variants.EMPTY_ROWS_BWD,
    "gqa": "with GQA query head h reads K/V head h // GROUP (the given prologue does it)",
    "fp16": "dS goes into tl.dot in k's dtype; keep dq in fp32",
}


class ForwardCase:
    """One case of exercise 6.3: gapped inputs, float64 answers, and the judge of a run."""

    def __init__(self, rng, label, dims, dtype, causal, hint, blocks=(BLOCK, BLOCK)):
        self.label, self.causal, self.hint, self.dtype = label, causal, hint, dtype
        B, H, H_kv, N_q, N_k, d = dims
        item = 2 if dtype == "float16" else 4
        self.shape = _triton_bytes.Shape(B, H, H_kv, N_q, N_k, d, item, causal, *blocks)
        q, k, v = random_qkv(B, H, N_q, N_k, d, dtype, H_kv=H_kv, seed=rng)
        tdtype = getattr(torch, dtype)
        self.q, self.k, self.v = (_triton.gapped(x, tdtype) for x in (q, k, v))
        self.q64, self.k64, self.v64 = (x.astype(np.float64) for x in (q, k, v))
        self.o, self.lse = reference.forward(q, k, v, causal=causal)
        self.tdtype = tdtype

    def run(self, learner, first: bool):
        s = self.shape
        names = {self.q.data_ptr(): "Q", self.k.data_ptr(): "K", self.v.data_ptr(): "V"}
        o = _triton.nan_output((s.B, s.H, s.N_q, s.d), self.tdtype)
        lse = _triton.nan_output((s.B, s.H, s.N_q), torch.float32)

        def work():
            return launch_forward(learner, self.q, self.k, self.v, causal=self.causal,
                                  out=(o, lse), block_m=s.block_m, block_n=s.block_n)  # fmt: skip

        run = _triton.run_learner(work, learner, names)
        if first and _triton.nothing_stored(run.outputs):
            raise NotImplementedError("the kernel stored nothing")
        return run

    def tiles(self) -> list:
        s = self.shape
        return [
            _triton.Tile("K", 2, s.block_n, "keys", "BLOCK_N"),
            _triton.Tile("V", 2, s.block_n, "keys", "BLOCK_N"),
            _triton.Tile("Q", 2, s.block_m, "query rows", "BLOCK_M"),
        ]

    def judge(self, run) -> tuple[bool, str]:
        s = self.shape
        outs = [
            _triton_judge.Output("o", "O", self.o, tolerance(self.dtype), s.N_q),
            _triton_judge.Output("lse", "lse", self.lse, LSE_TOL, s.N_q),
        ]
        return _triton_judge.judge_run(
            run,
            outs,
            budget=_triton_bytes.forward(s),
            variants=self._variants,
            tf32=self._tf32 if self.dtype == "float32" else None,
            own=self._empty_rows,
            hint=self.hint,
            tiles=self.tiles(),
            owner=("O", [(2, s.block_m, 0, "rows")]),
            locate=lambda got: _triton_judge.where_wrong(got, outs, s.block_m),
        )

    def _scale(self) -> float:
        return 1.0 / np.sqrt(self.shape.d)

    def _kv(self):
        return (_attn_variants.expand(x, self.shape.H) for x in (self.k64, self.v64))

    def _variants(self) -> dict:
        k, v = self._kv()
        s = self.shape
        return _attn_variants.forward_variants(
            self.q64, k, v, self._scale(), self.causal, s.block_m, s.block_n
        )

    def _tf32(self) -> tuple:
        k, v = self._kv()
        keep = _attn_variants.visible(self.shape.N_q, self.shape.N_k, self.causal)
        return _attn_variants.tf32_forward(self.q64, k, v, self._scale(), keep)

    def _empty_rows(self, got) -> str:
        """EMPTY_ROWS when only the rows that see no key are wrong."""
        empty = np.isinf(self.lse)
        if not empty.any():
            return ""
        o, lse = (to_numpy(g) for g in got)
        rest_ok = _triton_judge.compare("o", o[~empty], self.o[~empty], tolerance(self.dtype))[0]
        rows_ok = np.array_equal(lse[empty], self.lse[empty]) and (o[empty] == 0).all()
        return _attn_variants.EMPTY_ROWS if rest_ok and not rows_ok else ""


class BackwardCase:
    """One case of exercise 7.3 (kind "dkdv") or 7.4 (kind "dq"): gapped q, k, v, dO, lse and D
    (D = rowsum(dO * O) from O as stored in the input dtype), float64 gradients, a run, a judge."""

    def __init__(self, kind, rng, label, dims, dtype, causal, hint, blocks=(BLOCK, BLOCK)):
        self.kind, self.label, self.causal, self.hint, self.dtype = kind, label, causal, hint, dtype
        B, H, H_kv, N_q, N_k, d = dims
        item = 2 if dtype == "float16" else 4
        self.shape = _triton_bytes.Shape(B, H, H_kv, N_q, N_k, d, item, causal, *blocks)
        q, k, v = random_qkv(B, H, N_q, N_k, d, dtype, H_kv=H_kv, seed=rng)
        do = rng.standard_normal(q.shape).astype(dtype)
        o, lse = reference.forward(q, k, v, causal=causal)
        delta = (do.astype(np.float64) * o.astype(dtype).astype(np.float64)).sum(-1)
        self.inputs64 = [x.astype(np.float64) for x in (q, k, v, do)]
        self.lse64, self.delta64 = lse.astype(np.float32), delta.astype(np.float32)
        self.grads = reference.backward(do, q, k, v, causal=causal)  # dq, dk, dv
        self.tdtype = getattr(torch, dtype)
        self.q, self.k, self.v, self.do = (_triton.gapped(x, self.tdtype) for x in (q, k, v, do))
        self.lse, self.delta = (_triton.gapped(x, torch.float32) for x in (lse, delta))

    def run(self, learner, first: bool):
        s = self.shape
        names = {t.data_ptr(): n for t, n in ((self.q, "Q"), (self.k, "K"), (self.v, "V"),
                 (self.do, "dO"), (self.lse, "lse"), (self.delta, "D"))}  # fmt: skip
        args = (self.do, self.q, self.k, self.v, self.lse, self.delta)
        opts = dict(causal=self.causal, block_m=s.block_m, block_n=s.block_n)
        if self.kind == "dq":
            dq = _triton.nan_output(self.q.shape, self.tdtype)

            def work():
                return (launch_dq(learner, *args, out=dq, **opts),)
        else:
            dk, dv = (_triton.nan_output(self.k.shape, self.tdtype) for _ in range(2))

            def work():
                return launch_dkdv(learner, *args, out=(dk, dv), **opts)

        run = _triton.run_learner(work, learner, names)
        if first and _triton.nothing_stored(run.outputs):
            raise NotImplementedError("the kernel stored nothing")
        return run

    def tiles(self) -> list:
        s = self.shape
        keys = [_triton.Tile(t, 2, s.block_n, "keys", "BLOCK_N") for t in ("K", "V")]
        rows = [_triton.Tile(t, 2, s.block_m, "query rows", "BLOCK_M") for t in ("Q", "dO")]
        return keys + rows

    def _outputs(self) -> list:
        tol, s = tolerance(self.dtype, grad=True), self.shape
        dq, dk, dv = self.grads
        if self.kind == "dq":
            return [_triton_judge.Output("dq", "dQ", dq, tol, s.N_q)]
        return [
            _triton_judge.Output("dk", "dK", dk, tol, s.N_k),
            _triton_judge.Output("dv", "dV", dv, tol, s.N_k),
        ]

    def judge(self, run) -> tuple[bool, str]:
        budget = (_triton_bytes.dq if self.kind == "dq" else _triton_bytes.dkdv)(self.shape)
        outs = self._outputs()
        block = self.shape.block_m if self.kind == "dq" else self.shape.block_n
        owner = ("dQ", [(2, block, 0, "rows")]) if self.kind == "dq" else None
        owner = owner or ("dK", [(2, block, 0, "keys")])

        def locate(got):
            text = _triton_judge.where_wrong(got, outs, block)
            return text.replace("query block", "key block") if self.kind != "dq" else text

        return _triton_judge.judge_run(
            run, outs, budget=budget, hint=self.hint,
            variants=self._variants, tf32=self._tf32 if self.dtype == "float32" else None,
            own=self._empty_rows, tiles=self.tiles(), locate=locate, owner=owner,
        )  # fmt: skip

    def _common(self) -> tuple:
        q, k, v, do = self.inputs64
        H = self.shape.H
        scale = 1.0 / np.sqrt(self.shape.d)
        lse, delta = self.lse64.astype(np.float64), self.delta64.astype(np.float64)
        return q, _attn_variants.expand(k, H), _attn_variants.expand(v, H), do, lse, delta, scale

    def _pick(self, grads: tuple) -> tuple:
        return grads[:1] if self.kind == "dq" else grads[1:]

    def _variants(self) -> dict:
        s = self.shape
        found = _attn_variants.backward_variants(
            *self._common(), self.causal, s.block_m, s.block_n, s.H_kv
        )
        return {why: self._pick(g) for why, g in found.items()}

    def _tf32(self) -> tuple:
        keep = _attn_variants.visible(self.shape.N_q, self.shape.N_k, self.causal)
        return self._pick(_attn_variants.tf32_backward(*self._common(), keep, self.shape.H_kv))

    def _empty_rows(self, got) -> str:
        has_empty = bool(np.isinf(self.lse64).any())
        nan = any(np.isnan(to_numpy(g)).any() for g in got)
        return _attn_variants.EMPTY_ROWS_BWD if has_empty and nan else ""


def graded(learner, cases: list, grader: str, example: str) -> tuple:
    """(call, [Case]) for `grade`: call(case) launches the learner's kernel on a case (a Python
    function is a named shortcut); each Case judges its run, the first case's empty run meaning
    "not attempted yet"."""

    def call(case):
        _triton.require_kernel(learner, grader, example)
        return case.run(_triton.runnable(learner), first=case is cases[0])

    return call, [
        Case(
            c.label,
            (c,),
            None,
            check=lambda run, _, c=c: c.judge(run),
            inputs=describe(c.shape, c.dtype),
        )
        for c in cases
    ]


def describe(s: _triton_bytes.Shape, dtype: str) -> str:
    """How to reproduce a case: the shapes, dtype, causal and the launch's blocks."""
    heads = f"H={s.H}" + (f", H_kv={s.H_kv}" if s.H_kv != s.H else "")
    return (
        f"B={s.B}, {heads}, N_q={s.N_q}, N_k={s.N_k}, d={s.d}, {dtype}, causal={s.causal}, "
        f"blocks {s.block_m} x {s.block_n}"
    )
