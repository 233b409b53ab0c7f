"""Exercise graders for the notebooks: spec in the notebook, stub for the learner, check here.

Each grader draws fresh ragged inputs, compares the learner's function with the float64 reference
(or the package's own answer), and prints one line per case: what was tried, the max error, ok or
what is wrong. A stub that still raises NotImplementedError reports "not attempted yet" and returns
normally, so the committed notebooks run top to bottom while the exercises stay open.
`checks.solution(grader)` shows the package function that solves an exercise.

Graders live in one module per chapter (`ch00.py`, `ch01.py`, ...), each listing its graders in
`__all__`; all are re-exported here and collected in GRADERS (name -> grader). Two chapters may not
export the same name: the import fails, naming both, rather than let one grader silently replace the
other.
Introduced in notebooks/01_naive_attention.ipynb; the machinery is in `_core.py`.
"""

from __future__ import annotations

import importlib
import pkgutil

from ._core import Case, Report, grade, grader, solution, solution_function

__all__ = [
    "Case",
    "Report",
    "grade",
    "grader",
    "solution",
    "solution_function",
    "GRADERS",
    "CHAPTER_OF",
]

GRADERS: dict[str, object] = {}
CHAPTER_OF: dict[
    str, str
] = {}  # grader name -> module that defines it, e.g. "flashedu.checks.ch01"
for _m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _m.name.startswith("ch"):
        _mod = importlib.import_module(f".{_m.name}", __name__)
        for _name in _mod.__all__:
            if _name in globals() and _name not in GRADERS:
                raise ImportError(
                    f"{_mod.__name__} exports {_name!r}, a name flashedu.checks already uses"
                )
            if _name in GRADERS:
                raise ImportError(
                    f"grader {_name!r} is exported by both {CHAPTER_OF[_name]} and {_mod.__name__}"
                )
            globals()[_name] = GRADERS[_name] = getattr(_mod, _name)
            CHAPTER_OF[_name] = _mod.__name__
            __all__.append(_name)
