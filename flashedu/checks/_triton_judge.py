"""Judging one run of a learner's Triton kernel: where it stored, what it moved, how far its
numbers are from float64, and which known mistake explains them.

`judge_run` goes from the plainest evidence to the subtlest and stops at the first thing wrong:
stores past the last row or rows never stored (the sentinel-filled buffers of
`flashedu.checks._triton`), loads outside every tensor (the NaN gaps, charged to no tensor by
`traffic.measure`), the numbers against float64 (NaN and infinities named), then, if they are
wrong, one diagnosis: the case's own (rows that see no key), a float64 twin of a known mistake
that the answer equals (`_attn_variants`), a TF32-sized error; if they are right, the bytes
against the FA2 budget (`_triton_bytes`).

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
from ._triton import Run, measured_traffic, output_problem


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


def judge_run(
    run: Run,
    outs: list[Output],
    *,
    kernel_path: bool,
    budget: dict,
    variants: Callable[[], dict],
    tf32: Callable[[], tuple] | None = None,
    own: Callable[[tuple], str] | None = None,
    hint: str = "",
) -> tuple[bool, str, str]:
    """(ok, detail, diagnosis) for one case: the diagnosis names what is wrong (or is the case's
    hint when nothing known matches); '' when the case passes."""
    got = run.outputs
    if len(got) != len(outs):
        names = ", ".join(o.name for o in outs)
        return False, f"{len(got)} results", f"return {len(outs)} results ({names})"
    if kernel_path:
        for g, o in zip(got, outs):
            problem = output_problem(g, o.model, o.rows)
            if problem:
                return False, f"{o.name}: stores", problem
    measured = measured_traffic(run, {o.model: g for g, o in zip(got, outs)})
    if measured is not None and (UNKNOWN in measured.reads or UNKNOWN in measured.writes):
        return False, "bytes outside the tensors", _triton_bytes.judge(measured, budget, ())
    parts = [compare(o.name, g, o.expected, o.tol) for g, o in zip(got, outs)]
    text = "; ".join(t for _, t, _ in parts)
    if not all(ok for ok, _, _ in parts):
        why = (own(got) if own else "") or diagnose(got, outs, variants(), tf32() if tf32 else None)
        return False, text, why or hint
    if measured is None:
        return True, text, ""
    verdict = _triton_bytes.judge(measured, budget, tuple(o.model for o in outs))
    if verdict:
        return False, f"{text}; bytes differ from FA2's", verdict
    return True, f"{text}; bytes as FA2", ""
