"""Notebook conveniences: one seed for everything, and showing the package's real source.

Introduced in notebooks/00_memory_hierarchy.ipynb.
"""

from __future__ import annotations

import inspect
import random
import re

import numpy as np


def seed_everything(seed: int = 0) -> np.random.Generator:
    """Seed Python, NumPy and torch (if installed); return a fresh NumPy Generator seeded the
    same."""
    random.seed(seed)
    np.random.seed(seed)
    try:
        import torch

        torch.manual_seed(seed)
    except ImportError:  # pragma: no cover
        pass
    return np.random.default_rng(seed)


def source(obj) -> str:
    """The source text of a function, class, module or @triton.jit kernel from flashedu."""
    if type(obj).__module__.startswith("triton") and hasattr(obj, "fn"):
        obj = obj.fn  # a kernel object wraps the Python function it was written as
    return inspect.getsource(obj)


# What the formatter and the linter read, not the learner: a trailing "fmt: skip" or bare "noqa"
# (with codes or none) comment, and a line that is only "fmt: off" or "fmt: on".
_CODES = r"(?::[ \t]*[A-Z]+[0-9]+(?:,[ \t]*[A-Z]+[0-9]+)*)?"
_TOOL_COMMENT = re.compile(r"[ \t]*# (?:fmt: (?:skip|off|on)|noqa" + _CODES + r")[ \t]*$")


def readable(text: str) -> str:
    """`text` without the comments addressed to the formatter and the linter (the code is
    unchanged): the form in which `show_source` displays it."""
    lines = []
    for line in text.split("\n"):
        bare = _TOOL_COMMENT.sub("", line)
        if bare.strip() or not line.strip():
            lines.append(bare)
    return "\n".join(lines)


def show_source(obj):
    """Display the source of `obj` with syntax highlighting (plain text outside IPython), without
    the formatter's and linter's comments (`readable`).

    Notebooks call this instead of copying package code, so the learner reads exactly what the tests
    cover.
    """
    text = readable(source(obj))
    try:
        from IPython.display import Code, display
    except ImportError:  # pragma: no cover
        print(text)
        return
    display(Code(text, language="python"))


def fmt_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; binary units, three significant figures."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover
