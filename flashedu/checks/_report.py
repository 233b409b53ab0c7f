"""How a grader's report is put together: mistake matching, the lead case, the printed lines.

`grade` (in _core.py) runs the cases; this module picks the case to lead with and its one
diagnosis (`choose`), names a known mistake by comparing the answer with the outputs of buggy
variants (`same`, `candidates`), and lays the report out in at most 100 columns. Tested through
tests/checks/test_core.py.
"""

from __future__ import annotations

import inspect
import textwrap
from typing import Any

import numpy as np

from ..testing import Tolerance, to_numpy

WIDTH = 100
_MATCH = Tolerance(1e-8, 1e-6)  # how close an answer must be to a buggy variant to be named by it


def same(got, variant, tol: Tolerance = _MATCH) -> bool:
    """True when got equals a variant's output: the same structure and shapes, NaN where it has
    NaN, infinities alike, finite values within tol; exact for ints, strings and lists of them."""
    if isinstance(variant, (tuple, list)) and not _is_number_list(variant):
        return (
            isinstance(got, (tuple, list))
            and len(got) == len(variant)
            and all(same(g, v, tol) for g, v in zip(got, variant))
        )
    if isinstance(variant, (str, bool, int, np.integer)) or _is_number_list(variant):
        try:
            return bool(got == variant) if not isinstance(got, np.ndarray) else False
        except Exception:
            return False
    try:
        g, v = to_numpy(got), to_numpy(variant)
    except (TypeError, ValueError):
        return False
    if g.shape != v.shape or (np.isnan(g) != np.isnan(v)).any():
        return False
    fin = np.isfinite(v)
    if (np.isinf(g) != np.isinf(v)).any() or (g[np.isinf(v)] != v[np.isinf(v)]).any():
        return False
    return bool(np.all(np.abs(g[fin] - v[fin]) <= tol.atol + tol.rtol * np.abs(v[fin])))


def _is_number_list(x) -> bool:
    return isinstance(x, list) and all(isinstance(v, (int, np.integer)) for v in x)


def _variants(case) -> list[tuple[str, Any]]:
    """(name, output) for every known mistake of a case; a variant that fails to run is left
    out."""
    found = []
    for name, value in case.mistakes.items():
        try:
            value = value() if callable(value) else value
        except Exception:
            continue
        for v in value if isinstance(value, _Candidates) else [value]:
            found.append((name, v))
    return found


class _Candidates(list):
    """Several possible outputs of one buggy variant (e.g. for different block sizes)."""


def candidates(*outputs) -> _Candidates:
    """Mark several outputs as alternatives for one mistake: any of them matches."""
    return _Candidates(outputs)


def _explains(got, variant, case) -> int:
    """2 when got equals the variant's output; 1 when, for a tuple answer, every part got wrong
    equals the variant's part (a part the learner got right may differ, e.g. where the bug shows
    as NaN); else 0."""
    if same(got, variant):
        return 2
    parts = isinstance(case.expected, tuple) and isinstance(variant, tuple)
    if not parts or not isinstance(got, (tuple, list)) or len(got) != len(variant):
        return 0
    return int(
        all(same(g, v) or same(g, e, case.tol) for g, v, e in zip(got, variant, case.expected))
    )


def _match(cases: list, outcomes: list) -> tuple[str, int | None]:
    """The mistake that best explains the answers: (name, index of the first case it explains).

    A mistake explains a failing case when the answer equals its variant there (exactly, or in
    every part the learner got wrong); it is contradicted by a case where its variant differs from
    the right answer but the learner's answer does not equal it. The name with the fewest
    contradictions wins, then the one with the most exact matches, then the most explained."""
    if not any(c.mistakes for c in cases):
        return "", None
    table: dict[str, list[int]] = {}  # name -> [explained, exact, contradicted, first case]
    for i, (case, res) in enumerate(zip(cases, outcomes)):
        if not res.ran or not case.mistakes:
            continue
        seen: dict[str, int] = {}
        for name, v in _variants(case):
            if same(v, case.expected, case.tol):
                continue  # this bug does not show on this input
            seen[name] = max(seen.get(name, 0), _explains(res.got, v, case))
        for name, level in seen.items():
            row = table.setdefault(name, [0, 0, 0, -1])
            if level and not res.ok:
                row[0] += 1
                row[1] += level == 2
                row[3] = i if row[3] < 0 else row[3]
            elif not level:
                row[2] += 1
    scored = [(r[2], -r[1], -r[0], r[3], n) for n, r in table.items() if r[0] > 0]
    if not scored:
        return "", None
    *_, first, name = min(scored)
    return name, first


# ---------------------------------------------------------------------------- the printed report


def _wrap(text: str, indent: str, width: int = WIDTH) -> list[str]:
    """Lines of at most `width` columns, broken after '; ' or '. ' where possible, else at
    spaces."""
    if any(len(indent) + len(seg) > width for seg in _segments(text)):
        return textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=indent)
    pieces, line = [], ""
    for seg in _segments(text):
        if line and len(indent) + len(line) + len(seg) > width:
            pieces.append(line.rstrip())
            line = ""
        line += seg
    pieces.append(line.rstrip())
    lines = []
    for p in pieces:
        if len(indent) + len(p) <= width:
            lines.append(indent + p)
        else:
            lines += textwrap.wrap(p, width, initial_indent=indent, subsequent_indent=indent)
    return lines


def _segments(text: str) -> list[str]:
    """text cut after each '; ' and after each '. ' that ends a sentence."""
    out, start = [], 0
    for i in range(len(text) - 2):
        if text[i + 1] == " " and (text[i] == ";" or text[i] == "." and text[i + 2].isupper()):
            out.append(text[start : i + 2])
            start = i + 2
    out.append(text[start:])
    return [s for s in out if s]


def _shape(x) -> str:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        dt = str(x.dtype).replace("torch.", "")
        return f"{tuple(x.shape)}" + ("" if dt == "float64" else f" {dt}")
    if isinstance(x, (tuple, list)) and x and all(hasattr(v, "shape") for v in x):
        return "(" + ", ".join(_shape(v) for v in x) + ")"
    return repr(x)


def _inputs(fn, case) -> str:
    """'q (13, 8), k (27, 8), causal=False': the case's arguments, named as fn names them."""
    if case.inputs:
        return case.inputs
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    parts = [
        f"{names[i] if i < len(names) else f'arg{i}'} {_shape(a)}"
        if hasattr(a, "shape") or isinstance(a, (tuple, list))
        else f"{names[i] if i < len(names) else f'arg{i}'}={a!r}"
        for i, a in enumerate(case.args)
    ]
    return ", ".join(parts + [f"{k}={v!r}" for k, v in case.kwargs.items()])


def table(cases: list, outcomes: list) -> list[str]:
    w = min(max(len(c.label) for c in cases), 44)
    lines = [f"   #  {'case':<{w}}  result"]
    for i, (c, r) in enumerate(zip(cases, outcomes), 1):
        label = c.label if len(c.label) <= w else c.label[: w - 3] + "..."
        row = f"  {i:>2}  {label:<{w}}  {'ok   ' if r.ok else 'WRONG'}  {r.detail}"
        lines.append(row if len(row) <= WIDTH else row[: WIDTH - 3] + "...")
    return lines


def lead_block(name, fn, cases, outcomes, lead, diagnosis, seed, formula) -> list[str]:
    c, r = cases[lead], outcomes[lead]
    detail = r.detail.removesuffix(f": {diagnosis}")  # a check's detail may end with it
    head = f"  case {lead + 1}: {c.label}: {detail}"
    if len(head) <= WIDTH:
        lines = [head]
    else:
        lines = _wrap(f"case {lead + 1}: {c.label}", "  ") + _wrap(detail, "    ")
    lines += _wrap(f"what is wrong: {diagnosis}", "  ")
    seeded = f"; seed={seed}" if seed is not None else ""
    lines += _wrap(f"inputs: {_inputs(fn, c)}{seeded}", "  ")
    if seed is not None:
        lines.append(f"  the same inputs again: checks.{name}(your_function, seed={seed})")
    if formula:
        lines.append(f"  the formula, if you want it: checks.hint(checks.{name})")
    return lines


def choose(cases, outcomes) -> tuple[int, str]:
    """The case to lead with and its one diagnosis."""
    for i, r in enumerate(outcomes):
        if r.shortcut:
            return i, r.shortcut
    name, first = _match(cases, outcomes)
    if name:
        return first, name
    for i, r in enumerate(outcomes):
        if not r.ok and r.diagnosis:
            return i, r.diagnosis
    i = next(i for i, r in enumerate(outcomes) if not r.ok)
    return i, cases[i].hint or outcomes[i].detail
