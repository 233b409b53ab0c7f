"""The grader of chapter 12's Triton exercise: a tile of keys found through a paged KV cache's
block table, called by the package's paged decoding kernel.

The learner writes one `@triton.jit` function,

    @triton.jit
    def my_page_rows(BT_ROW, start_n, seqlen, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
        ...
        return rows, keep

which `flashedu.kernels.paged` calls for every tile of BLOCK_N keys it reads: BT_ROW points at
the sequence's row of the block table (int32 page numbers), start_n is the tile's first key (a
multiple of BLOCK_N, which divides PAGE_SIZE: a tile lies in one page), seqlen the sequence's
length. It returns `rows` (BLOCK_N,), each key's row in the cache seen as num_pages * PAGE_SIZE
rows (page * PAGE_SIZE + slot), and `keep` (BLOCK_N,) bool, which keys exist.

`paged_kernel` launches the package's kernel with the learner's function itself, with its own
BLOCK_N and page sizes (2 and 4 blocks a page, so a function that takes one for the other
shows), on scrambled block tables and ragged lengths several pages long (a partial last page, a
length under one block, a length of 0), GQA, causal, sinks and float16, into NaN-filled outputs,
and compares o and lse with a float64 reference. Slots past a length and pages no sequence uses
hold stale keys (finite values of an earlier sequence), so a function that reads them is named by
float64 twins of the usual mistakes: the block table ignored (page j of the pool read as the
sequence's j-th page, as if the cache were contiguous), the last, partial page dropped, read in
full, or one key too many (`cols <= seqlen`), the slot taken as cols without `% PAGE_SIZE`, the
page picked by cols // BLOCK_N. Under the interpreter the bytes are measured
(`traffic.measure`) against `traffic.paged_decode_bytes`: one block-table entry per tile, and
only the keys that exist. A Python function in place of the `@triton.jit` one (a gather of the
pages into a contiguous cache, say) is a named shortcut, as is flashedu's own function or one
that calls it. A function with no `return` (the notebook's stub) is "not attempted yet".

Registered in flashedu.checks by chapter 12's module (`from ._ch12_kernel import paged_kernel`).
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import numpy as np
import torch

from .. import traffic
from ..kernels import paged as paged_kernels
from ..testing import Tolerance, max_error, tolerance
from . import _triton
from ._core import Case, grade, grader, rng_for
from ._shared import Shortcut

__all__ = ["paged_kernel"]

BLOCK = 16 if _triton.INTERPRETER else 64  # the grader's BLOCK_N
LSE_TOL = Tolerance(2e-5, 2e-5)

IGNORED_TABLE = (
    "your function ignored the block table: it read page j of the pool as the sequence's j-th "
    "page, as if the cache were contiguous; load the physical page, tl.load(BT_ROW + start_n // "
    "PAGE_SIZE), and use it"
)
DROPPED_LAST = (
    "the last, partial page was dropped: a sequence of len keys holds ceil(len / PAGE_SIZE) "
    "pages, and keys len // PAGE_SIZE * PAGE_SIZE .. len - 1 exist too; keep = cols < seqlen"
)
PAST_LENGTH = (
    "the last page was read past the sequence's length: its slots after len - 1 hold stale keys "
    "of an earlier sequence; keep = cols < seqlen"
)
ONE_PAST = (
    "one key too many at the end of each sequence (cols <= seqlen): keys 0 .. seqlen - 1 exist; "
    "keep = cols < seqlen"
)
NO_MODULO = (
    "the slot inside the page is cols % PAGE_SIZE, not cols: rows = page * PAGE_SIZE + "
    "cols % PAGE_SIZE"
)
BLOCK_PAGES = (
    "the page was picked by cols // BLOCK_N: BLOCK_N is the kernel's tile, PAGE_SIZE the page "
    "(a page holds several tiles); the table's index is start_n // PAGE_SIZE"
)
GATHER = (
    "{what} is a Python function: checks.paged_kernel grades a @triton.jit function that the "
    "paged kernel calls for every tile of keys. A contiguous gather of the pages on the host "
    "(k_cache[block_table]) copies the whole cache at every decode step, the copy the block table "
    "exists to avoid"
)
EXTRA_TABLE = (
    "your function read {got:,} bytes of the block table where one int32 per tile ({want:,} "
    "bytes) is enough: a tile lies in one page, so load one entry"
)
EXTRA_KEYS = (
    "the kernel read {got:,} bytes of {name} where the keys that exist hold {want:,}: keep must "
    "be False for every key past the length"
)
OUTSIDE = (
    "the kernel read {n:,} bytes outside the cache and the block table: a row past the pool, or "
    "a table entry past the row (is keep False past the length, and the page index start_n // "
    "PAGE_SIZE?)"
)

FORMULA = """
A tile of keys start_n .. start_n + BLOCK_N - 1 lies in one page (BLOCK_N divides PAGE_SIZE):
  page = tl.load(BT_ROW + start_n // PAGE_SIZE)          # the physical page, one int32
  cols = start_n + tl.arange(0, BLOCK_N)                  # logical key positions
  rows = page * PAGE_SIZE + cols % PAGE_SIZE              # row in the (num_pages * PAGE_SIZE) cache
  keep = cols < seqlen                                    # the last page may be partial
  return rows, keep
(Convert page to tl.int64 before multiplying: a pool may hold more than 2**31 elements.)
"""


# ------------------------------------------------------------------------------------- the cases
class PagedCase:
    """One case: a pool of pages with stale keys where no sequence's keys are, a scrambled block
    table, ragged lengths, q and sinks; the float64 answer and the twins of the usual mistakes."""

    def __init__(self, rng, label, lens, page_size, H, H_kv, N_q, d, dtype, causal, sinks,
                 num_splits, hint):  # fmt: skip
        self.label, self.lens, self.ps, self.hint = label, list(lens), page_size, hint
        self.H, self.H_kv, self.N_q, self.d, self.dtype = H, H_kv, N_q, d, dtype
        self.causal, self.num_splits = causal, num_splits
        need = [-(-n // page_size) for n in lens]
        P = sum(need) + 3  # and a few pages of stale keys no sequence uses
        width = max(lens) // BLOCK + 2  # a wide table, as a server's: max_pages of a long context
        table = rng.integers(0, P, (len(lens), width))  # stale entries past each length
        order = rng.permutation(P)
        at = 0
        for b, m in enumerate(need):
            table[b, :m] = order[at : at + m]
            at += m
        tdtype = getattr(torch, dtype)
        cast = lambda a: torch.from_numpy(a).to(tdtype)
        k, v = (cast(rng.standard_normal((P, page_size, H_kv, d))) for _ in range(2))
        q = cast(rng.standard_normal((len(lens), H, N_q, d)))
        self.k64, self.v64, self.q64 = (x.double().numpy() for x in (k, v, q))
        self.sinks64 = rng.standard_normal(H) * 2 if sinks else None
        self.table = table.astype(np.int32)
        margin = -(-max(lens) // page_size) + 1  # NaN pages around the pool: a stray row lands
        self.inputs = [_device(q), _padded(k, margin), _padded(v, margin),  # in memory, not past
                       _padded(torch.from_numpy(self.table), 1),
                       _device(torch.tensor(self.lens, dtype=torch.int32))]  # fmt: skip
        self.sinks = None
        if sinks:
            self.sinks = _device(torch.from_numpy(self.sinks64).float())
        self.expected = self.attend(lambda b, cols: self._rows(b, cols), self.lens)

    # the float64 answer of reading keys `rows_of(b, cols)` for cols < n_b of each sequence
    def _rows(self, b, cols):
        return self.table[b, cols // self.ps].astype(np.int64) * self.ps + cols % self.ps

    def attend(self, rows_of, lens):
        """float64 (o, lse) when sequence b reads pool rows rows_of(b, arange(lens[b])); causal
        and the sinks follow the real lengths. None when a row falls outside the pool."""
        B, H, N_q, d = self.q64.shape
        flat_k = self.k64.reshape(-1, self.H_kv, d)
        flat_v = self.v64.reshape(-1, self.H_kv, d)
        group = H // self.H_kv
        o = np.zeros((B, H, N_q, d))
        lse = np.full((B, H, N_q), -np.inf)
        for b, n in enumerate(lens):
            cols = np.arange(n)
            rows = rows_of(b, cols)
            if rows is None or (rows.size and (rows.min() < 0 or rows.max() >= len(flat_k))):
                return None
            k = np.repeat(flat_k[rows].transpose(1, 0, 2), group, 0)  # (H, n, d)
            v = np.repeat(flat_v[rows].transpose(1, 0, 2), group, 0)
            s = self.q64[b] @ k.transpose(0, 2, 1) / np.sqrt(d)  # (H, N_q, n)
            if self.causal:
                diag = np.arange(N_q)[:, None] + self.lens[b] - N_q
                s = np.where(cols[None, :] <= diag, s, -np.inf)
            sink = np.full((H, N_q, 1), -np.inf)
            if self.sinks64 is not None:
                sink = np.broadcast_to(self.sinks64[:, None, None], (H, N_q, 1))
            s = np.concatenate([s, sink], -1)  # the sink: one more column, with no value
            m = s.max(-1, keepdims=True)
            m = np.where(np.isinf(m), 0.0, m)
            e = np.exp(s - m)
            total = e.sum(-1)
            with np.errstate(divide="ignore", invalid="ignore"):
                o[b] = np.where(total[..., None] > 0, (e[..., :-1] @ v) / total[..., None], 0.0)
                lse[b] = np.where(total > 0, m[..., 0] + np.log(total), -np.inf)
        return o, lse

    def twins(self) -> dict:
        """{what is wrong: float64 (o, lse)} for the usual mistakes on this case's inputs."""
        ps, bn = self.ps, BLOCK
        width = self.table.shape[1]

        def by_block(b, cols):
            idx = cols // bn
            return None if idx.size and idx.max() >= width else (
                self.table[b, idx].astype(np.int64) * ps + cols % ps
            )  # fmt: skip

        found = {
            IGNORED_TABLE: self.attend(lambda b, cols: cols, self.lens),
            DROPPED_LAST: self.attend(self._rows, [n // ps * ps for n in self.lens]),
            PAST_LENGTH: self.attend(self._rows, [-(-n // bn) * bn for n in self.lens]),
            ONE_PAST: self.attend(self._rows, [n + 1 if n % bn else n for n in self.lens]),
            NO_MODULO: self.attend(
                lambda b, cols: self.table[b, cols // ps].astype(np.int64) * ps + cols, self.lens
            ),
            BLOCK_PAGES: self.attend(by_block, self.lens),
        }
        return {why: t for why, t in found.items() if t is not None}

    def describe(self) -> str:
        return (
            f"lens={self.lens}, PAGE_SIZE={self.ps}, BLOCK_N={BLOCK}, H={self.H}, "
            f"H_kv={self.H_kv}, N_q={self.N_q}, d={self.d}, {self.dtype}, causal={self.causal}, "
            f"sinks={self.sinks is not None}, num_splits={self.num_splits}"
        )


def _device(x: torch.Tensor) -> torch.Tensor:
    return x.to("cuda" if torch.cuda.is_available() else "cpu")


def _padded(x: torch.Tensor, margin: int) -> torch.Tensor:
    """x as a view into a buffer with `margin` more entries of NaN (or -1) on both sides of its
    first axis, so that a stray index reads memory of the buffer (charged to no tensor by
    `traffic.measure`) instead of crashing the interpreter."""
    fill = float("nan") if x.dtype.is_floating_point else -1
    buf = torch.full((x.shape[0] + 2 * margin, *x.shape[1:]), fill, dtype=x.dtype)
    buf[margin : margin + x.shape[0]] = x
    return _device(buf)[margin : margin + x.shape[0]]


def _specs(rng) -> list[tuple]:
    """(label, lens, page_size, H, H_kv, N_q, d, dtype, causal, sinks, num_splits, hint), the
    simplest first; lengths drawn several pages long and ragged."""
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))
    bs = BLOCK
    p2, p4 = 2 * bs, 4 * bs
    ragged = [p2 * r(1, 2) + r(1, bs - 1), p2 * r(2, 3) + bs + r(1, bs - 1), p2 * r(1, 2) + bs]
    return [
        ("one sequence, whole pages", [2 * p2], p2, 2, 2, 1, 16, "float32", False, False, 1,
         "whole pages are read wrong: rows = page * PAGE_SIZE + cols % PAGE_SIZE"),
        (f"ragged lengths {ragged}: partial last pages", ragged, p2, 2, 2, 1, 16, "float32",
         False, False, 2, "the last, partial page of a sequence is read wrong: keep = cols < "
         "seqlen"),
        ("a length of 0 and one under a block", [0, r(1, bs - 1), p2 * 2 + r(1, bs - 1)], p2, 2,
         1, 1, 16, "float32", False, False, 2,
         "short sequences are read wrong: keep = cols < seqlen, whatever the length"),
        (f"pages of {p4} keys, GQA 4 on 2, N_q=3, causal, sinks",
         [p4 + r(1, p4 - 1), 2 * p4 + r(1, p4 - 1)], p4, 4, 2, 3, 16, "float32", True, True, 3,
         "with pages of 4 blocks it is wrong: the page is start_n // PAGE_SIZE, the slot "
         "cols % PAGE_SIZE"),
        ("float16, pages of 4 blocks, many splits", [3 * p4 + r(1, p4 - 1), r(1, p4)], p4, 2, 2,
         1, 32, "float16", False, True, 5, "float16 is wrong: rows and keep do not depend on "
         "the dtype; are rows int64?"),
    ]  # fmt: skip


# ------------------------------------------------------------------------------------ the grader
def _returns_nothing(learner) -> bool:
    """The notebook's stub: a @triton.jit function with no `return` of a value."""
    try:
        src = textwrap.dedent(inspect.getsource(learner.fn))
        tree = ast.parse(src)
    except (OSError, TypeError, SyntaxError):
        return False
    return not any(isinstance(n, ast.Return) and n.value is not None for n in ast.walk(tree))


def _require(learner) -> None:
    if _triton.is_kernel(learner):
        if _returns_nothing(learner):
            raise NotImplementedError("the function returns nothing yet")
        _triton.check_learner(learner)
        return
    try:
        _triton.require_kernel(learner, "paged_kernel", "my_page_rows")
    except _triton.NotAKernel:
        what = getattr(learner, "__name__", type(learner).__name__)
        raise Shortcut(GATHER.format(what=what)) from None


def _run(learner, case: PagedCase):
    _require(learner)
    fn = _triton.runnable(learner)
    B, H, N_q = len(case.lens), case.H, case.N_q
    o = _triton.nan_output((1, 1, B * H * N_q, case.d), getattr(torch, case.dtype))
    lse = _triton.nan_output((1, 1, B * H * N_q), torch.float32)
    out = (o.view(B, H, N_q, case.d), lse.view(B, H, N_q))
    measuring = traffic.measure() if _triton.INTERPRETER else None
    if measuring is None:
        paged_kernels.forward(*case.inputs, causal=case.causal, sinks=case.sinks,
                              num_splits=case.num_splits, block_n=BLOCK, page_fn=fn, out=out,
                              name="paged_kernel")  # fmt: skip
        return out, None
    with measuring as m:
        paged_kernels.forward(*case.inputs, causal=case.causal, sinks=case.sinks,
                              num_splits=case.num_splits, block_n=BLOCK, page_fn=fn, out=out,
                              name="paged_kernel")  # fmt: skip
    return out, m.traffic()


def _close(got, want, tol) -> bool:
    g, w = (np.asarray(x, dtype=np.float64) for x in (got, want))
    if g.shape != w.shape or np.isnan(g).any() or (np.isinf(g) != np.isinf(w)).any():
        return False
    fin = np.isfinite(w)
    if (g[~fin] != w[~fin]).any():
        return False
    return bool(np.all(np.abs(g[fin] - w[fin]) <= tol.atol + tol.rtol * np.abs(w[fin])))


def _judge(case: PagedCase):
    def check(run, expected):
        (o, lse), measured = run
        got = tuple(x.detach().double().cpu().numpy() for x in (o, lse))
        tols = (tolerance(case.dtype), LSE_TOL)
        ok = all(_close(g, w, t) for g, w, t in zip(got, expected, tols))
        errs = [max_error(g, w)[0] for g, w in zip(got, expected)]
        detail = f"o: max|diff|={errs[0]:.1e}; lse: max|diff|={errs[1]:.1e}"
        if np.isnan(got[0]).any():
            detail = f"o: {int(np.isnan(got[0]).sum())} NaN entries"
        if not ok:
            for why, twin in case.twins().items():
                if all(_close(g, w, t) for g, w, t in zip(got, twin, tols)):
                    return False, detail, why
            if measured is not None and measured.reads.get("unknown"):
                return False, detail, OUTSIDE.format(n=measured.reads["unknown"])
            return False, detail, ""
        return _bytes(case, measured, detail)

    return check


def _bytes(case: PagedCase, measured, detail):
    if measured is None:
        return True, detail
    model = traffic.paged_decode_bytes(
        case.lens, H=case.H, H_kv=case.H_kv, N_q=case.N_q, d=case.d, block_n=BLOCK,
        num_splits=case.num_splits, itemsize=2 if case.dtype == "float16" else 4,
        sinks=case.sinks is not None,
    )  # fmt: skip
    if measured.reads.get("unknown"):
        return False, "bytes outside the tensors", OUTSIDE.format(n=measured.reads["unknown"])
    got, want = measured.reads.get("TABLE", 0), model.reads.get("TABLE", 0)
    if got > want:
        return (
            False,
            "block table read more than once a tile",
            EXTRA_TABLE.format(got=got, want=want),
        )
    for name in ("K", "V"):
        got, want = measured.reads.get(name, 0), model.reads.get(name, 0)
        if got != want:
            return False, f"{name}: {got:,} bytes", EXTRA_KEYS.format(got=got, want=want, name=name)
    return True, detail + "; bytes as the closed form"


@grader("flashedu.kernels.paged_solution.page_rows", formula=FORMULA)
def paged_kernel(fn, *, seed=None, out=print):
    """Grade chapter 12's Triton exercise, `fn(BT_ROW, start_n, seqlen, PAGE_SIZE, BLOCK_N) ->
    (rows, keep)`, a @triton.jit function: the rows of keys start_n .. start_n + BLOCK_N - 1 of one
    sequence in the paged cache seen as (num_pages * PAGE_SIZE) rows, through the block table row
    BT_ROW, and which of them exist (< seqlen). The grader launches flashedu's paged decoding
    kernel with it (`kernels.paged.forward(..., page_fn=fn)`), with its own BLOCK_N and page
    sizes, on scrambled tables and ragged lengths, into NaN-filled o and lse."""
    rng = rng_for(seed)
    cases = []
    for label, *spec, hint in _specs(rng):
        case = PagedCase(rng, label, *spec, hint)
        cases.append(
            Case(
                label, (), case.expected, hint, check=_judge(case), inputs=case.describe(),
                call=lambda learner, case=case: _run(learner, case),
            )
        )  # fmt: skip
    return grade("paged_kernel", fn, cases, solution_name=paged_kernel.solution_name, out=out)
