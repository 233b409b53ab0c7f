"""Judging one run of a learner's Triton kernel: where it stored, what it moved, how far its
numbers are from float64, and which known mistake explains them.

`judge_run` goes from the plainest evidence to the subtlest and stops at the first thing wrong:
tiles larger than the grader's blocks and stores outside a program's own tile (the method, checked
before the numbers: right numbers from one tile of every key are still a shortcut), stores past the
last row or rows never stored (the NaN-filled buffers of `flashedu.checks._triton`), loads outside
every tensor (the NaN gaps, charged to no tensor by `traffic.measure`), the numbers against float64
(NaN and infinities named), then, if they are wrong, one diagnosis: the case's own (rows that see no
key), a float64 twin of a known mistake that the answer equals (`_attn_variants`), a TF32-sized
error, else where the answer is wrong; if they are right, the bytes against the FA2 budget
(`_triton_bytes`).

Used by the graders in ch06.py and ch07.py; tested in tests/checks/test_ch06.py and ch07.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..testing import Tolerance, to_numpy
from ..traffic.measured import UNKNOWN
from . import _triton_bytes
from ._attn_variants import TF32
from ._triton import Run, measured_traffic, output_problem, ownership_problem, tile_problem


@dataclass
class Output:
    """One output of a graded kernel: its name in messages, its name in the traffic model, its
    float64 value, tolerance and number of rows (for the sentinel check)."""

    name: str
    model: str
    expected: np.ndarray
    tol: Tolerance
    rows: int


def compare(name: str, got, expected: np.ndarray, tol: Tolerance) -> tuple[bool, str, float]:
    """(ok, text, max error) for one output against its float64 value; NaN and infinities named;
    the text starts with `name: ` when a name is given."""
    ok, text, worst = _compare(got, expected, tol)
    return ok, (f"{name}: {text}" if name else text), worst


def _compare(got, expected: np.ndarray, tol: Tolerance) -> tuple[bool, str, float]:
    try:
        g = to_numpy(got)
    except (TypeError, ValueError, AttributeError):
        return False, f"expected an array, got {type(got).__name__}", np.inf
    if g.shape != expected.shape:
        return False, f"shape {g.shape}, expected {expected.shape}", np.inf
    if np.isnan(g).any():
        return False, f"{int(np.isnan(g).sum())} NaN entries", np.inf
    bad_inf = np.isinf(g) != np.isinf(expected)
    if bad_inf.any() or (g[np.isinf(g)] != expected[np.isinf(g)]).any():
        n = int(bad_inf.sum())
        return (
            False,
            f"{n} entries infinite where finite values belong (or the reverse)",
            np.inf,
        )
    fin = np.isfinite(expected)
    err = np.abs(g[fin] - expected[fin])
    ok = bool(np.all(err <= tol.atol + tol.rtol * np.abs(expected[fin])))
    worst = float(err.max(initial=0.0))
    return ok, f"max|diff|={worst:.1e}", worst


def matches(got, variant: np.ndarray, expected: np.ndarray, tol: Tolerance) -> bool:
    """got equals the variant within twice the tolerance, where the variant differs from the
    right answer by more than the tolerance (so the mistake shows on this input)."""
    g = to_numpy(got)
    if g.shape != variant.shape:
        return False
    fin = np.isfinite(variant) & np.isfinite(expected)
    same_inf = np.array_equal(np.isinf(variant), np.isinf(g)) and np.array_equal(
        g[np.isinf(g)], variant[np.isinf(variant)]
    )
    differs = (np.isinf(variant) != np.isinf(expected)).any() or bool(
        np.any(np.abs(variant[fin] - expected[fin]) > tol.atol + tol.rtol * np.abs(expected[fin]))
    )
    if not differs or not same_inf or np.isnan(g).any():
        return False
    bound = 2 * (tol.atol + tol.rtol * np.abs(variant[fin]))
    return bool(np.all(np.abs(g[fin] - variant[fin]) <= bound))


def sized_like(got, twin: np.ndarray, expected: np.ndarray, tol: Tolerance) -> bool:
    """The error of got is outside the tolerance but no larger than 4x the error of a twin that
    computes in lower precision (a TF32 dot, fp16 sums): the fingerprint of that precision."""
    g = to_numpy(got)
    fin = np.isfinite(expected)
    if g.shape != expected.shape or not np.isfinite(g[fin]).all():
        return False
    err = np.abs(g[fin] - expected[fin])
    tf = np.abs(twin[fin] - expected[fin]).max(initial=0.0)
    outside = np.any(err > tol.atol + tol.rtol * np.abs(expected[fin]))
    return bool(outside and tf > tol.atol and err.max() <= 4 * tf)


def check_against(got, expected, tol, mistakes: dict, extra=None) -> tuple[bool, str, str]:
    """(ok, detail, diagnosis) for a one-array answer: the mistake whose variant (an array, or a
    list of candidate arrays) the answer equals, else `extra(got)`, else ''."""
    ok, detail, _ = compare("", got, expected, tol)
    if ok:
        return True, detail, ""
    for why, variant in mistakes.items():
        for v in variant if isinstance(variant, list) else [variant]:
            if matches(got, v, expected, tol):
                return False, detail, why
    return False, detail, (extra(got) if extra else "")


def _part_fits(got, variant, expected, tol) -> tuple[bool, bool]:
    """(fits, differs): does this part of the answer agree with a variant's part, and does that
    part of the variant differ from the right answer at all."""
    if variant is None:
        return True, False
    if matches(variant, variant, expected, tol):  # the mistake shows in this part
        return matches(got, variant, expected, tol), True
    return compare("", got, expected, tol)[0], False


def diagnose(got: tuple, outs: list[Output], variants: dict, tf32: tuple | None) -> str:
    """The known mistake whose float64 twin the answer equals, else a TF32-sized error, else ''."""
    for why, parts in variants.items():
        fits = [_part_fits(g, v, o.expected, o.tol) for g, v, o in zip(got, parts, outs)]
        if all(f for f, _ in fits) and any(d for _, d in fits):
            return why
    if tf32 is not None:
        wrong = [
            (g, t, o)
            for g, t, o in zip(got, tf32, outs)
            if not compare("", g, o.expected, o.tol)[0]
        ]
        if wrong and all(
            t is not None and sized_like(g, t, o.expected, o.tol) for g, t, o in wrong
        ):
            return TF32
    return ""


def where_wrong(got: tuple, outs: list[Output], block_m: int) -> str:
    """Where the answer is wrong, for a failure no known mistake explains: the rows (and query
    blocks) of the first wrong output, so the learner looks there."""
    for g, o in zip(got, outs):
        gg, e = to_numpy(g), o.expected
        if gg.shape != e.shape:
            continue
        bad = ~np.isclose(gg, e, rtol=o.tol.rtol, atol=o.tol.atol, equal_nan=False)
        bad |= np.isinf(gg) != np.isinf(e)
        bad &= ~(np.isinf(e) & (gg == e))
        if not bad.any():
            continue
        axis = 2 if bad.ndim >= 3 else 0
        other = tuple(i for i in range(bad.ndim) if i != axis)
        rows = np.flatnonzero(bad.any(axis=other))
        n = bad.shape[axis]
        blocks = sorted({int(r) // block_m for r in rows})
        which = (
            f"row {rows[0]}"
            if len(rows) == 1
            else f"{len(rows)} of {n} rows, {rows[0]}..{rows[-1]}"
        )
        where = "block" if len(blocks) == 1 else "blocks"
        return (
            f"{o.name} is wrong in {which} (query {where} "
            f"{', '.join(map(str, blocks[:6]))}{', ...' if len(blocks) > 6 else ''} of "
            f"BLOCK_M = {block_m}) and right elsewhere; it matches none of the usual mistakes"
        )
    return ""


def judge_run(
    run: Run,
    outs: list[Output],
    *,
    budget: dict,
    variants: Callable[[], dict],
    tf32: Callable[[], tuple] | None = None,
    own: Callable[[tuple], str] | None = None,
    hint: str = "",
    tiles: list | None = None,
    owner: tuple | None = None,
    locate: Callable[[tuple], str] | None = None,
) -> tuple[bool, str, str]:
    """(ok, detail, diagnosis) for one case: the diagnosis names what is wrong (or, when nothing
    known matches, says where the answer is wrong, else gives the case's hint); '' when the case
    passes. tiles: `_triton.Tile` limits; owner: (output, axes) for `_triton.ownership_problem`."""
    got = run.outputs
    named = {o.model: g for g, o in zip(got, outs)}
    problem = tile_problem(run, named, tiles or [])
    if problem:
        return False, "tiles larger than the grader's blocks", problem
    if owner is not None:
        problem = ownership_problem(run, named, *owner)
        if problem:
            return False, "a program stored outside its tile", problem
    for g, o in zip(got, outs):
        problem = output_problem(g, o.model, o.rows)
        if problem:
            return False, f"{o.name}: stores", problem
    measured = measured_traffic(run, named)
    if measured is not None and (UNKNOWN in measured.reads or UNKNOWN in measured.writes):
        return False, "bytes outside the tensors", _triton_bytes.judge(measured, budget, ())
    parts = [compare(o.name, g, o.expected, o.tol) for g, o in zip(got, outs)]
    text = "; ".join(t for _, t, _ in parts)
    if not all(ok for ok, _, _ in parts):
        why = (own(got) if own else "") or diagnose(got, outs, variants(), tf32() if tf32 else None)
        return False, text, why or (locate(got) if locate else "") or hint
    if measured is None:
        return True, text, ""
    verdict = _triton_bytes.judge(measured, budget, tuple(o.model for o in outs))
    if verdict:
        return False, f"{text}; bytes differ from FA2's", verdict
    return True, f"{text}; bytes as FA2", ""


def tile_case(
    label: str,
    launch: Callable,
    names: dict,
    out_shape: tuple,
    expected,
    hint: str,
    check: Callable,
    *,
    first: bool,
    out_name: str,
    tiles: list,
    owner_axes: list,
    grader: str,
    example: str,
    inputs: str,
):
    """A Case for a kernel whose grid the grader lays over its output (6.1, 7.1, 7.2): the grader
    launches the learner's kernel itself, `launch(kernel, out)`, into a NaN-filled output of
    `out_shape` with its own blocks; the judge checks the stores, loads outside the tensors, tile
    spans (`tiles`) and that each program stored only its own tile (`owner_axes`) before `check`
    compares the numbers."""
    import torch

    from ._core import Case
    from ._triton import (
        nan_output,
        nothing_stored,
        require_kernel,
        run_learner,
        runnable,
    )

    def call(kernel):
        require_kernel(kernel, grader, example)
        kernel = runnable(kernel)
        out = nan_output(out_shape, torch.float32)
        run = run_learner(lambda: (launch(kernel, out),), kernel, names)
        if first and nothing_stored(run.outputs):
            raise NotImplementedError("the kernel stored nothing")
        return run

    def judge(run, expected):
        got = run.outputs[0]
        named = {out_name: got}
        problem = tile_problem(run, named, tiles)
        if problem:
            return False, "tiles larger than the grader's blocks", problem
        problem = ownership_problem(run, named, out_name, owner_axes)
        if problem:
            return False, "a program stored outside its tile", problem
        rows = out_shape[0] if len(out_shape) == 2 else out_shape[2]
        problem = output_problem(got, out_name, rows)
        if problem:
            return False, f"{out_name}: stores", problem
        measured = measured_traffic(run, named)
        if measured is not None and (UNKNOWN in measured.reads or UNKNOWN in measured.writes):
            return False, "bytes outside the tensors", _triton_bytes.judge(measured, {}, ())
        result = check(got.detach().cpu(), expected)
        if result[0] or (len(result) > 2 and result[2]):
            return result
        return False, result[1], _where_in_matrix(got.detach().cpu(), expected, out_name) or hint

    return Case(label, (), expected, hint=hint, check=judge, call=call, inputs=inputs)


def _where_in_matrix(got, expected: np.ndarray, name: str) -> str:
    """For an answer no known mistake explains: the rows and columns (or rows of each head) where
    it is wrong, so the learner looks there rather than at a guessed cause."""
    g = to_numpy(got)
    if g.shape != expected.shape:
        return ""
    both_inf = np.isinf(expected) & (g == expected)
    bad = ~(np.isclose(g, expected, rtol=1e-4, atol=1e-5) | both_inf)
    if not bad.any():
        return ""
    idx = np.argwhere(bad)
    lo, hi = idx.min(0), idx.max(0)
    where = ", ".join(
        f"{axis} {a}..{b}" for axis, a, b in zip(("rows", "columns")[-g.ndim:] if g.ndim <= 2
                                                  else ("batch", "head", "rows"), lo, hi)
    )  # fmt: skip
    return (
        f"{name} is wrong in {int(bad.sum())} of {bad.size} entries ({where}) and right elsewhere; "
        "it matches none of the usual mistakes"
    )
