"""The cases of the kernel exercises (6.3 the forward, 7.3 dK/dV, 7.4 dQ): inputs, float64
answers, runs and judges.

Each case draws fresh inputs of one stage (a block multiple, ragged lengths, causal with
N_q != N_k, rows that see no key, GQA, float16), lays them out with NaN gaps
(`_triton.gapped`), runs the learner's kernel through the package launcher or the learner's own
function (`_triton.run_learner`), and judges the run (`_triton_judge.judge_run`) against the
float64 reference, the float64 twins of the usual mistakes and the FA2 byte budget. Block sizes
are the launcher's: 16 under the interpreter, 64 on a GPU, so the stages are drawn around them.

Used by the graders `triton_forward` (ch06.py), `triton_dkdv` and `triton_dq` (ch07.py).
"""

from __future__ import annotations

import numpy as np
import torch

from .. import reference
from ..testing import Tolerance, random_qkv, to_numpy, tolerance
from ..triton_exercises import launch_forward
from . import _attn_variants, _triton, _triton_bytes, _triton_judge
from ._core import Case

BLOCK = 16 if _triton.INTERPRETER else 64  # the launchers' default block sizes
LSE_TOL = Tolerance(2e-5, 2e-5)  # lse is float32 for every input dtype


def forward_specs(rng, bs: int = BLOCK) -> list[tuple]:
    """(label, (B, H, H_kv, N_q, N_k, d), dtype, causal, hint), simplest first; bs = block size."""
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))  # noqa: E731
    rq, rk = bs * r(1, 2) + r(1, bs - 1), bs * r(2, 3) + r(1, bs - 1)
    cq = bs + r(1, bs - 1)
    ck = cq + bs + r(1, bs - 1)
    eq = ck - bs - r(1, bs - 1) + 2 * bs  # N_q - N_k > bs: a whole query block sees no key
    return [
        ("N a block multiple", (1, 2, 2, 2 * bs, 2 * bs, 16), "float32", False, HINT_LOOP),
        (f"ragged N_q={rq}, N_k={rk}", (1, 2, 2, rq, rk, 32), "float32", False, HINT_RAGGED),
        (f"causal, N_q={cq} < N_k={ck}", (1, 2, 2, cq, ck, 32), "float32", True, HINT_CAUSAL),
        (
            f"causal, N_q={eq} > N_k={ck - cq}: rows see no key",
            (2, 1, 1, eq, ck - cq, 16),
            "float32",
            True,
            _attn_variants.EMPTY_ROWS,
        ),
        (
            f"GQA 4 heads on 2, causal, N_q={rq}, N_k={rk}",
            (1, 4, 2, rq, rk, 32),
            "float32",
            True,
            HINT_GQA,
        ),
        (
            f"float16, GQA 4 on 1, causal, N_q={rk}, N_k={rq}",
            (1, 4, 1, rk, rq, 64),
            "float16",
            True,
            HINT_FP16,
        ),
    ]


HINT_LOOP = (
    "for each key block: s = q k^T * scale, the new row max m, p = exp(s - m), rescale l and acc "
    "by alpha = exp(m_old - m_new), add p's row sums and p @ v; at the end o = acc / l"
)
HINT_RAGGED = "mask the loads of the last key block (cols < N_k) and set its missing scores to -inf"
HINT_CAUSAL = "causal, bottom-right: query i sees keys j <= i + N_k - N_q"
HINT_GQA = "with GQA query head h reads K/V head h // GROUP (the given prologue does it)"
HINT_FP16 = "p goes into the second tl.dot in v's dtype (p.to(v.dtype)); keep m, l, acc in fp32"


class ForwardCase:
    """One case of exercise 6.3: gapped inputs, float64 answers, and the judge of a run."""

    def __init__(self, rng, label, dims, dtype, causal, hint, bs=BLOCK):
        self.label, self.causal, self.hint, self.dtype = label, causal, hint, dtype
        B, H, H_kv, N_q, N_k, d = dims
        item = 2 if dtype == "float16" else 4
        self.shape = _triton_bytes.Shape(B, H, H_kv, N_q, N_k, d, item, causal, bs, bs)
        q, k, v = random_qkv(B, H, N_q, N_k, d, dtype, H_kv=H_kv, seed=rng)
        tdtype = getattr(torch, dtype)
        self.q, self.k, self.v = (_triton.gapped(x, tdtype) for x in (q, k, v))
        self.q64, self.k64, self.v64 = (x.astype(np.float64) for x in (q, k, v))
        self.o, self.lse = reference.forward(q, k, v, causal=causal)
        self.tdtype = tdtype

    def run(self, learner, first: bool):
        s = self.shape
        names = {self.q.data_ptr(): "Q", self.k.data_ptr(): "K", self.v.data_ptr(): "V"}
        if _triton.is_kernel(learner):
            o = _triton.sentinel_like((s.B, s.H, s.N_q, s.d), self.tdtype)
            lse = _triton.sentinel_like((s.B, s.H, s.N_q), torch.float32)

            def work():
                return launch_forward(
                    learner,
                    self.q,
                    self.k,
                    self.v,
                    causal=self.causal,
                    out=(o, lse),
                    block_m=s.block_m,
                    block_n=s.block_n,
                )
        else:

            def work():
                return tuple(learner(self.q, self.k, self.v, causal=self.causal))

        run = _triton.run_learner(work, learner, names)
        if first and _triton.is_kernel(learner) and _triton.nothing_stored(run.outputs):
            raise NotImplementedError("the kernel stored nothing")
        return run

    def judge(self, run, kernel_path: bool) -> tuple[bool, str]:
        s = self.shape
        outs = [
            _triton_judge.Output("o", "O", self.o, tolerance(self.dtype), s.N_q),
            _triton_judge.Output("lse", "lse", self.lse, LSE_TOL, s.N_q),
        ]
        return _triton_judge.judge_run(
            run,
            outs,
            kernel_path=kernel_path,
            budget=_triton_bytes.forward(s),
            variants=self._variants,
            tf32=self._tf32 if self.dtype == "float32" else None,
            own=self._empty_rows,
            hint=self.hint,
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


def graded(learner, cases: list) -> tuple:
    """(call, [Case]) for `grade`: call(case) runs the learner on a case; each Case judges its
    run, the first case's empty run meaning "not attempted yet"."""
    kernel_path = _triton.is_kernel(learner)

    def call(case):
        return case.run(learner, first=case is cases[0])

    return call, [
        Case(c.label, (c,), None, check=lambda run, _, c=c: c.judge(run, kernel_path))
        for c in cases
    ]
