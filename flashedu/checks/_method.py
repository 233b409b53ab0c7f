"""Checks on how an answer was computed: the shortcuts a grader rejects, each named.

Where the method is the lesson, right numbers are not enough. Three guards:

- `forbid_flashedu()`: while it is active, a call into flashedu's own implementations (every
  function and method of the package's modules, its Triton kernels, and the solutions the graders
  show) raises `Shortcut("called flashedu.tiled.forward")`. A grader computes its expected answers
  before entering it. It swaps the code of those functions for a stub and puts it back on exit, so
  `from flashedu.tiled import forward` is caught too. Only modules already imported are covered.
- `watch_arrays(limit_elems)` and `largest_array(fn, ...)`: the largest NumPy array or torch tensor
  made during a call. NumPy arrays the grader hands in are watched (`ArrayWatch.wrap`): every
  result computed from them is recorded with its shape; torch operations are seen through a
  `TorchFunctionMode`; tracemalloc catches NumPy memory made some other way (`np.zeros((N, N))`),
  and `largest_array` then reruns the call to find the array's shape among the frames' locals.
  Over the limit: `Shortcut("built a 300x300 array")`.
- `OnePass`: the columns of a 2-D array, handed out in blocks through an iterator that can be
  walked once. A block expires when the next one is handed out (its values become NaN), and
  using an expired block, or walking the blocks again, raises `Shortcut("read the row twice")`.

The watcher and the stream are written in _watch.py, `Shortcut` in _shared.py; all are re-exported
here. Used by the graders of
chapters 02, 03, 04, 05 and 09 (and the Triton chapters); tested in tests/test_checks_method.py.
"""

from __future__ import annotations

import sys
import types
from contextlib import contextmanager
from typing import Any, Callable, Iterable

from ._shared import GRADERS, Shortcut, solution_function
from ._watch import ArrayWatch, OnePass, WatchedArray, largest_array, watch_arrays

__all__ = [
    "Shortcut",
    "forbid_flashedu",
    "ArrayWatch",
    "WatchedArray",
    "watch_arrays",
    "largest_array",
    "OnePass",
]


# ---------------------------------------------------------------------------- forbid_flashedu

# Modules a learner may use while being graded: tools, not answers.
_TOOLS = (
    "flashedu._env",
    "flashedu._validate",
    "flashedu.book",
    "flashedu.checks",
    "flashedu.course",
    "flashedu.data",
    "flashedu.dtypes",  # the dtype names and accumulation rule testing.tolerance uses
    "flashedu.kernel_traffic",  # traffic.measure's hooks run inside a graded kernel
    "flashedu.ledger",
    "flashedu.nb",
    "flashedu.registry",
    "flashedu.testing",
    "flashedu.triton_exercises",  # the launchers and given prologues of the kernel exercises
    "flashedu.viz",
    "flashedu.widgets",
)
# Imported before patching so that a call made through a lazily loaded submodule is caught.
_CORE = (
    "api",
    "autograd",
    "decoding",
    "gpt",
    "masks",
    "naive",
    "reference",
    "ring",
    "softmax",
    "tiled",
    "tiled_backward",
    "torch_tiled",
    "traffic",
)


def _stub(*args, **kwargs):  # its code replaces a forbidden function's while the guard is on
    return __import__("flashedu.checks._method", None, None, ["_"])._called(args, kwargs)


class _Guard:
    def __init__(self):
        self.depth = 0  # nested forbid_flashedu contexts
        self.allowed = 0  # > 0 while an allowed function runs: its internals may call anything
        self.targets: dict[types.CodeType, tuple[str, Callable]] = {}
        self.saved: list[tuple[Any, str, Any]] = []  # (object, attribute, original value)
        self.hits: list[str] = []


_GUARD = _Guard()


def _called(args, kwargs):
    name, original = _GUARD.targets[sys._getframe(1).f_code]
    if _GUARD.allowed:
        return original(*args, **kwargs)
    if name.startswith("+"):  # an allowed function: run it, and whatever it calls
        _GUARD.allowed += 1
        try:
            return original(*args, **kwargs)
        finally:
            _GUARD.allowed -= 1
    _GUARD.hits.append(name)
    raise Shortcut(f"called {name}")


def _dotted(obj) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def _patch_function(f: types.FunctionType, name: str) -> None:
    if f.__code__.co_freevars:  # a decorator's wrapper: its cells cannot be carried over,
        inner = getattr(f, "__wrapped__", None)  # so stop the function it wraps instead
        if isinstance(inner, types.FunctionType):
            _patch_function(inner, name)
        return
    if f.__code__ in _GUARD.targets:
        return  # already patched (a function re-exported by another module)
    original = types.FunctionType(f.__code__, f.__globals__, f.__name__, f.__defaults__)
    original.__kwdefaults__ = f.__kwdefaults__
    stub = _stub.__code__.replace(co_name=name.lstrip("+"))
    _GUARD.targets[stub] = (name, original)
    _GUARD.saved.append((f, "__code__", f.__code__))
    f.__code__ = stub


def _kernel_class(cls: type) -> type:
    """A subclass of a Triton kernel class whose launch and device call raise Shortcut."""

    def refuse(self):
        if _GUARD.allowed:
            return False
        _GUARD.hits.append(_dotted(self.fn))
        raise Shortcut(f"called {_dotted(self.fn)}")

    def run(self, *args, **kwargs):
        return refuse(self) or cls.run(self, *args, **kwargs)

    def call(self, *args, **kwargs):
        return refuse(self) or cls.__call__(self, *args, **kwargs)

    return type(cls.__name__, (cls,), {"run": run, "__call__": call, "_forbidden": True})


def _patch_kernel(k) -> None:
    if getattr(type(k), "_forbidden", False):
        return
    _GUARD.saved.append((k, "__class__", type(k)))
    k.__class__ = _kernel_class(type(k))


def _is_kernel(v) -> bool:
    return type(v).__module__.startswith("triton") and hasattr(v, "run") and hasattr(v, "fn")


def _patch_class(cls: type) -> None:
    for attr, m in list(vars(cls).items()):
        m = m.__func__ if isinstance(m, (staticmethod, classmethod)) else m
        if isinstance(m, types.FunctionType) and not attr.startswith("__"):
            _patch_function(m, _dotted(m))


def _patch_module(mod) -> None:
    for v in list(vars(mod).values()):
        if isinstance(v, types.FunctionType) and v.__module__ == mod.__name__:
            if not v.__name__.startswith("__"):  # not a module's __getattr__ / __dir__
                _patch_function(v, _dotted(v))
        elif isinstance(v, type) and v.__module__ == mod.__name__:
            _patch_class(v)
        elif _is_kernel(v) and getattr(v.fn, "__module__", "") == mod.__name__:
            _patch_kernel(v)


def _solutions() -> list:
    found = []
    for g in GRADERS.values():
        for dotted in getattr(g, "solution_names", (g.solution_name,)):
            found.append(solution_function(dotted))
    return found


def _forbidden_modules() -> list:
    import importlib

    for name in _CORE:
        importlib.import_module(f"flashedu.{name}")
    return [
        m
        for name, m in list(sys.modules.items())
        if name.startswith("flashedu.") and m is not None and not name.startswith(_TOOLS)
    ]


def _install(allow: Iterable[str]) -> None:
    # resolve and import everything first, then patch
    allowed = [solution_function(dotted) for dotted in allow]
    modules, solutions = _forbidden_modules(), _solutions()
    for dotted, f in zip(allow, allowed):
        _patch_function(getattr(f, "__func__", f), "+" + dotted)
    for mod in modules:
        _patch_module(mod)
    for f in solutions:
        if isinstance(f, type):
            _patch_class(f)
        elif isinstance(f, types.FunctionType):
            _patch_function(f, _dotted(f))


def _uninstall() -> None:
    for obj, attr, value in reversed(_GUARD.saved):
        setattr(obj, attr, value)
    _GUARD.saved.clear()
    _GUARD.targets.clear()


@contextmanager
def forbid_flashedu(allow: Iterable[str] = ()):
    """Within the block, calling flashedu's own implementations raises Shortcut naming the call.

    allow: dotted names the exercise permits, e.g. ("flashedu.api.attention",); they run normally,
    together with everything they call. Yields the list of forbidden calls made so far (a learner's
    `except Exception` may swallow the Shortcut; the list still holds it).
    """
    if _GUARD.depth == 0:
        _GUARD.hits = []
        try:
            _install(allow)
        except BaseException:
            _uninstall()
            raise
    _GUARD.depth += 1
    try:
        yield _GUARD.hits
    finally:
        _GUARD.depth -= 1
        if _GUARD.depth == 0:
            _uninstall()
    if _GUARD.hits:
        raise Shortcut(f"called {_GUARD.hits[0]}")
