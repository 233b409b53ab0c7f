"""What every part of the grading machinery shares, defined below all of it.

- `Shortcut`: the exception a method guard raises (`_method`, `_watch`) and a report names.
- `GRADERS` (grader name -> grader) and `CHAPTER_OF` (grader name -> its chapter module): filled by
  `flashedu.checks` as it imports its chapter modules. Importing any module of the package loads
  `flashedu.checks` first, so both are complete by the time a grader runs; `_method` reads the
  graders' solutions from them and `_progress` lists every exercise.
- `solution_function`: the package function behind a grader's dotted solution name.

Nothing here imports another part of flashedu, so the grading modules above can all import it.
"""

from __future__ import annotations

import importlib
from typing import Callable

__all__ = ["Shortcut", "GRADERS", "CHAPTER_OF", "solution_function", "triton_stand_in"]


class Shortcut(Exception):
    """The answer was computed in a way the exercise rules out; the message names what was done."""


GRADERS: dict[str, Callable] = {}
CHAPTER_OF: dict[str, str] = {}  # grader name -> its module, e.g. "flashedu.checks.ch01"


def solution_function(g) -> Callable:
    """The package function that solves the exercise graded by `g` (a grader or a dotted name)."""
    dotted = g if isinstance(g, str) else getattr(g, "solution_name", None)
    if dotted is None:
        raise TypeError(f"solution: expected a grader from flashedu.checks, got {g!r}")
    module, _, attr = dotted.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def triton_stand_in(name: str) -> Callable:
    """Where Triton is not installed, the grader `name` (which launches a Triton kernel) as a
    function that says so in one line, with the same calling convention; it has no solution to
    show (the answers need Triton too)."""
    from .._env import TritonUnavailable

    def grader(*args, out=print, **kwargs):
        out(f"{name}: {TritonUnavailable('this exercise')}")

    grader.__name__ = grader.__qualname__ = name
    grader.solution_name, grader.solution_names = None, ()
    return grader


TILED_RULE = "a tiled loop holds one block of scores at a time, never all N_q x N_k of them"


def with_rule(e: Exception) -> Exception:
    """A memory shortcut ("built a 256x256 array", "held 300 KiB ...") with TILED_RULE added;
    any other shortcut (a call into flashedu, a fused attention, a second pass) as it is."""
    text = str(e)
    if text.startswith("built a") or (text.startswith("held") and "KiB" in text):
        return Shortcut(f"{text}: {TILED_RULE}")
    return e if isinstance(e, Shortcut) else Shortcut(text)
