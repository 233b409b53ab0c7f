"""Exercise graders for the notebooks: spec in the notebook, stub for the learner, check here.

Each grader draws fresh ragged inputs, compares the learner's function with the float64 reference (or the
package's own answer), and prints one line per case: what was tried, the max error, ok or what is wrong.
A stub that still raises NotImplementedError reports "not attempted yet" and returns normally, so the
committed notebooks run top to bottom while the exercises stay open. `checks.solution(grader)` shows the
package function that solves an exercise.

Graders live in one module per chapter (`ch00.py`, `ch01.py`, ...) and are all re-exported here.
"""
from __future__ import annotations

import importlib
import pkgutil

from ._core import Case, Report, grade, grader, solution

__all__ = ["Case", "Report", "grade", "grader", "solution", "GRADERS"]

GRADERS: dict[str, object] = {}
for _m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _m.name.startswith("ch"):
        _mod = importlib.import_module(f".{_m.name}", __name__)
        for _name in _mod.__all__:
            globals()[_name] = GRADERS[_name] = getattr(_mod, _name)
            __all__.append(_name)
