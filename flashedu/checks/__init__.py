"""Exercise graders for the notebooks: spec in the notebook, stub for the learner, check here.

Each grader runs the learner's function on fresh ragged inputs, simplest first, compares it with
the float64 reference, and prints a compact report that leads with one failure and one diagnosis
(a named shortcut, a known mistake, or what is wrong), with the inputs and seed that reproduce it.
Where the method is the lesson it is checked too (`_method.py`): no call into flashedu's own
implementations, no N_q x N_k array in a tiled exercise, one pass in the online softmax. A stub that
still raises NotImplementedError reports "not attempted yet" and returns normally, so the committed
notebooks run top to bottom while the exercises stay open. Help comes in steps:
`checks.hint(grader)` prints the formula, `checks.solution(grader)` the package's answer, and
`checks.progress()` every exercise's latest outcome; `python -m flashedu.checks NOTEBOOK...` grades
whole notebooks.

Graders live in one module per chapter (`ch00.py`, `ch01.py`, ...), each listing its graders in
`__all__`; all are re-exported here and collected in GRADERS (name -> grader; the dict lives in
`_shared.py`, below the machinery that reads it). Two chapters may not export the same name: the
import fails, naming both, rather than let one grader silently replace the other. Nothing in the
package imports this module but `python -m flashedu.checks`: it sits on top, and importing any
submodule runs it first.
Introduced in notebooks/01_naive_attention.ipynb; the machinery is in `_core.py`.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil
from pathlib import Path
from types import SimpleNamespace

from .._env import is_triton_missing
from ._core import Case, Report, grade, grader, hint, solution
from ._progress import progress
from ._shared import CHAPTER_OF, GRADERS, Shortcut, solution_function, triton_stand_in

__all__ = [
    "Case",
    "Report",
    "Shortcut",
    "grade",
    "grader",
    "hint",
    "progress",
    "solution",
    "solution_function",
    "GRADERS",
    "CHAPTER_OF",
]


def _triton_stand_ins(module: str) -> dict:
    """Without Triton, a chapter module whose graders need it cannot be imported: its graders (the
    names in its `__all__`, read from the source) become stand-ins that say so in one line."""
    source = Path(importlib.util.find_spec(module).origin).read_text()
    names = next(
        ast.literal_eval(node.value)
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign)
        and any(getattr(t, "id", "") == "__all__" for t in node.targets)
    )

    return {name: triton_stand_in(name) for name in names}


for _m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _m.name.startswith("ch"):
        try:
            _mod = importlib.import_module(f".{_m.name}", __name__)
            _exports = {_name: getattr(_mod, _name) for _name in _mod.__all__}
        except ImportError as _e:
            if not is_triton_missing(_e):
                raise
            _mod = SimpleNamespace(__name__=f"{__name__}.{_m.name}")
            _exports = _triton_stand_ins(_mod.__name__)
        for _name, _grader in _exports.items():
            if _name in globals() and _name not in GRADERS:
                raise ImportError(
                    f"{_mod.__name__} exports {_name!r}, a name flashedu.checks already uses"
                )
            if _name in GRADERS:
                raise ImportError(
                    f"grader {_name!r} is exported by both {CHAPTER_OF[_name]} and {_mod.__name__}"
                )
            globals()[_name] = GRADERS[_name] = _grader
            CHAPTER_OF[_name] = _mod.__name__
            __all__.append(_name)
