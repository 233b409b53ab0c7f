"""Checks on how an answer was computed: the shortcuts a grader rejects, each named.

Where the method is the lesson, right numbers are not enough. Three guards:

- `forbid_flashedu()`: while it is active, a call into flashedu's own implementations (every
  function and method of the package's modules, its Triton kernels, the solutions the graders show,
  and the graders' float64 "mistake twins") raises `Shortcut("called flashedu.tiled.forward")`. A
  grader computes its expected answers before entering it. It swaps the code of those functions for
  a stub and puts it back on exit, so `from flashedu.tiled import forward` is caught too. Only
  modules already imported are covered. Copies are caught by their code, not their names: a function
  whose normalised bytecode or source is that of a guarded function (a `types.FunctionType` clone of
  its code object, its `inspect.getsource` text run through `exec`, a copy pasted into a notebook,
  renamed or not) raises `Shortcut` when it is called inside the guard (a trace hook compares
  every Python frame's code), and `same_code_as_flashedu(obj)` names the guarded function a
  learner's function or `@triton.jit` kernel copies before it runs. Functions shorter than a few
  lines are not compared (a learner's two-line `split_heads` may well equal ours).
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
chapters 02, 03, 04, 05 and 09 (and the Triton chapters); tested in tests/checks/test_method.py.
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
import threading
import types
from contextlib import contextmanager
from typing import Any, Callable, Iterable

from ._shared import GRADERS, Shortcut, solution_function
from ._watch import ArrayWatch, OnePass, WatchedArray, largest_array, watch_arrays

__all__ = [
    "Shortcut",
    "forbid_flashedu",
    "same_code_as_flashedu",
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
    "flashedu.validation",
    "flashedu.book",
    "flashedu.checks",  # the grading machinery; its twins and solutions are guarded (_GUARDED)
    "flashedu.course",
    "flashedu.data",
    "flashedu.dtypes",  # the dtype names and accumulation rule testing.tolerance uses
    "flashedu.traffic.measured",  # traffic.measure's hooks run inside a graded kernel
    "flashedu.traffic.ledger",
    "flashedu.nb",
    "flashedu.registry",
    "flashedu.testing",
    "flashedu.kernels.exercises",  # the launchers and given prologues of the kernel exercises
    "flashedu.viz",
    "flashedu.widgets",
)
# Modules of flashedu.checks that compute answers (float64 twins of the usual mistakes, with the
# mistake switched off they are the answer): guarded although flashedu.checks is a tool.
_GUARDED = (
    "flashedu.checks._attn_variants",
    "flashedu.checks._tile_mistakes",
    "flashedu.checks._tiled_twins",
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
    for name in _GUARDED:
        importlib.import_module(name)
    return [
        m
        for name, m in list(sys.modules.items())
        if name.startswith("flashedu.")
        and m is not None
        and (not name.startswith(_TOOLS) or name in _GUARDED)
    ]


def _install(allow: Iterable[str], trace: bool) -> None:
    # resolve and import everything first, then patch
    allowed = [solution_function(dotted) for dotted in allow]
    modules, solutions = _forbidden_modules(), _solutions()
    table = _copies_table(modules, solutions) if trace else {}
    for dotted, f in zip(allow, allowed):
        _patch_function(getattr(f, "__func__", f), "+" + dotted)
    for mod in modules:
        _patch_module(mod)
    for f in solutions:
        if isinstance(f, type):
            _patch_class(f)
        elif isinstance(f, types.FunctionType):
            _patch_function(f, _dotted(f))
    if trace:
        _start_trace(table)


def _uninstall() -> None:
    _stop_trace()
    for obj, attr, value in reversed(_GUARD.saved):
        setattr(obj, attr, value)
    _GUARD.saved.clear()
    _GUARD.targets.clear()


# ------------------------------------------------------------- copies, recognised by their code

# Shorter functions are not compared: a learner's natural two-line answer (split_heads, a cdiv)
# may well be ours instruction for instruction.
MIN_INSTRUCTIONS = 40


def _big_enough(code: types.CodeType) -> bool:
    if len(code.co_code) < 2 * MIN_INSTRUCTIONS:
        return False
    import dis

    return sum(1 for i in dis.get_instructions(code) if i.opname != "CACHE") >= MIN_INSTRUCTIONS


_PACKAGE_DIR = __file__.rsplit("checks", 1)[0]  # .../flashedu/


def _norm_const(c):
    if isinstance(c, types.CodeType):
        return ("code", code_fingerprint(c))
    if isinstance(c, (tuple, frozenset)):
        return (type(c).__name__, tuple(_norm_const(x) for x in c))
    return (type(c).__name__, repr(c))


_SAME_OP = {"LOAD_METHOD": "LOAD_ATTR"}  # 3.11 reads a specialised LOAD_METHOD back as LOAD_ATTR


def _instructions(code: types.CodeType) -> tuple:
    """The instructions as (name, argument) pairs: stable whether or not the code has run (the
    interpreter specialises bytecode as it runs, and `co_code` does not always undo that)."""
    import dis

    out = []
    for ins in dis.get_instructions(code):
        if ins.opname == "CACHE":
            continue
        arg = ins.argval
        arg = ("code", code_fingerprint(arg)) if isinstance(arg, types.CodeType) else repr(arg)
        out.append((_SAME_OP.get(ins.opname, ins.opname), arg if ins.arg is not None else None))
    return tuple(out)


def code_fingerprint(code: types.CodeType) -> tuple:
    """A code object without what a copy changes: its name, file, line numbers and docstring
    (bytecode, constants, names and local variables stay)."""
    consts = list(code.co_consts)
    if consts and isinstance(consts[0], str) and code.co_flags & inspect.CO_NEWLOCALS:
        consts = consts[1:]  # the docstring
    consts = [c for c in consts if c is not None]  # None also marks "no docstring"
    return (
        _instructions(code),
        code.co_argcount,
        code.co_kwonlyargcount,
        code.co_names,
        code.co_varnames,
        code.co_freevars,
        tuple(_norm_const(c) for c in consts),
    )


def source_fingerprint(obj) -> str:
    """The function's syntax tree without its name, decorators, docstring, comments and layout;
    '' when its source cannot be read."""
    fn = getattr(obj, "fn", obj)
    try:
        src = getattr(obj, "src", None) or inspect.getsource(fn)
        tree = ast.parse(textwrap.dedent(src))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return ""
    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return _def_fingerprint(defs[0]) if defs else ""


def _cheap_key(code: types.CodeType) -> tuple:
    """What a copy keeps and is cheap to read: argument counts, global and local names."""
    return (code.co_argcount, code.co_kwonlyargcount, code.co_names, code.co_varnames)


class _Copies:
    """What the guard compares. Guarded and tool code objects are indexed by `_cheap_key`; the
    full `code_fingerprint` is computed only for a code object that shares a key with one."""

    def __init__(self):
        self.code: dict[tuple, list] = {}  # cheap key -> [(code, dotted)]
        self.tools: dict[tuple, list] = {}  # cheap key -> [code] of the tools' own functions
        self.source: dict[tuple, list] = {}  # argument names -> [(code, dotted)]
        self.seen: dict[int, tuple[types.CodeType, str]] = {}  # id(code) -> (code, dotted or '')
        self.prints: dict[int, tuple] = {}  # id(code) -> fingerprint (codes kept alive by seen)
        self.sources_done = False

    def _print(self, code) -> tuple:
        fp = self.prints.get(id(code))
        if fp is None:
            fp = self.prints[id(code)] = code_fingerprint(code)
            self.seen.setdefault(id(code), (code, None))
        return fp

    def _match(self, code) -> str:
        key = _cheap_key(code)  # the table holds only functions long enough to compare
        for cand, dotted in self.code.get(key, ()):
            if cand is code or self._print(cand) == self._print(code):
                if any(self._print(t) == self._print(code) for t in self.tools.get(key, ())):
                    return ""
                return dotted
        return ""

    def lookup(self, code: types.CodeType) -> str:
        hit = self.seen.get(id(code))
        if hit is None or hit[1] is None:
            hit = self.seen[id(code)] = (code, self._match(code))
        return hit[1]


_COPIES = _Copies()
_COPIES_KEY: list = [None]


def _guarded_functions(modules, solutions):
    """[(dotted, function or kernel)] of everything the guard protects."""
    found = []
    for mod in modules:
        for v in list(vars(mod).values()):
            if isinstance(v, types.FunctionType) and v.__module__ == mod.__name__:
                found.append((_dotted(v), v))
            elif isinstance(v, type) and v.__module__ == mod.__name__:
                for m in vars(v).values():
                    m = m.__func__ if isinstance(m, (staticmethod, classmethod)) else m
                    if isinstance(m, types.FunctionType):
                        found.append((_dotted(m), m))
            elif _is_kernel(v) and getattr(v.fn, "__module__", "") == mod.__name__:
                found.append((_dotted(v.fn), v))
    for f in solutions:
        if isinstance(f, types.FunctionType):
            found.append((_dotted(f), f))
        elif _is_kernel(f):
            found.append((_dotted(f.fn), f))
    return found


def _tool_codes(guarded_names, solutions) -> dict:
    """{cheap key: [code]} of the tools' own functions (a grader's solution is no tool): never
    reported, even where one equals a guarded function."""
    answers = {id(getattr(getattr(f, "fn", f), "__code__", None)) for f in solutions}
    out: dict = {}
    for name, mod in list(sys.modules.items()):
        if not name.startswith("flashedu") or mod is None or name in guarded_names:
            continue
        if name.startswith(_TOOLS) or name == "flashedu":
            for v in list(vars(mod).values()):
                f = getattr(v, "fn", v)
                if isinstance(f, types.FunctionType) and f.__module__ == name:
                    if id(f.__code__) not in answers:
                        out.setdefault(_cheap_key(f.__code__), []).append(f.__code__)
    return out


def _own_code(f):
    """The code object of a guarded function or kernel worth comparing, or None."""
    code = getattr(getattr(f, "fn", f), "__code__", None)
    if code is None or _GUARD_CODE(code) or not _big_enough(code):
        return None
    if not code.co_filename.startswith(_PACKAGE_DIR):  # a decorator's wrapper (torch's)
        return None
    return code


def _copies_table(modules=None, solutions=None) -> _Copies:
    """The index of every guarded function, built once per set of loaded modules."""
    if modules is None:
        modules, solutions = _forbidden_modules(), _solutions()
    key = tuple(sorted(m.__name__ for m in modules))
    if _COPIES_KEY[0] == key:
        return _COPIES
    fresh = _Copies()
    fresh.tools = _tool_codes({m.__name__ for m in modules}, solutions)
    fresh.guarded = _guarded_functions(modules, solutions)
    for dotted, f in fresh.guarded:
        code = _own_code(f)
        if code is not None:
            fresh.code.setdefault(_cheap_key(code), []).append((code, dotted))
    _COPIES.__dict__.clear()
    _COPIES.__dict__.update(fresh.__dict__)
    _COPIES_KEY[0] = key
    return _COPIES


def _GUARD_CODE(code) -> bool:
    return code in _GUARD.targets  # a stub in place while a guard is active


def _module_defs(path: str, cache: dict) -> dict:
    """{line: FunctionDef} for every function of a source file (by its def line and its first
    decorator's line), the file parsed once."""
    if path not in cache:
        defs: dict = {}
        try:
            with open(path, encoding="utf-8") as fh:
                tree = ast.parse(fh.read())
        except (OSError, SyntaxError):
            tree = ast.Module(body=[], type_ignores=[])
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defs[node.lineno] = node
                if node.decorator_list:
                    defs[min(d.lineno for d in node.decorator_list)] = node
        cache[path] = defs
    return cache[path]


def _def_fingerprint(node) -> str:
    """A FunctionDef without its name, decorators, return annotation and docstring, dumped."""
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        if isinstance(body[0].value.value, str):
            body = body[1:]
    parts = [node.args, *body]
    return "|".join(ast.dump(p, annotate_fields=False, include_attributes=False) for p in parts)


def _arg_names(code: types.CodeType) -> tuple:
    return code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]


_FILES: dict = {}  # path -> {line: FunctionDef}, each file parsed once


def _source_match(obj, fn) -> str:
    """The guarded function whose source `obj`'s is, names, docstring and layout aside: only the
    guarded functions with the same argument names are read (their files parsed once)."""
    table = _copies_table()
    if not table.sources_done:
        for dotted, f in table.guarded:
            code = _own_code(f)
            if code is not None:
                table.source.setdefault(_arg_names(code), []).append((code, dotted))
        table.sources_done = True
    candidates = table.source.get(_arg_names(fn.__code__), [])
    if not candidates:
        return ""
    mine = source_fingerprint(obj)
    for code, dotted in candidates:
        node = _module_defs(code.co_filename, _FILES).get(code.co_firstlineno)
        if mine and node is not None and _def_fingerprint(node) == mine:
            return dotted
    return ""


def _jit_parts(obj, seen=None) -> list:
    """obj's Python function and, for a @triton.jit kernel, every @triton.jit function it names
    (through its globals, or one attribute away from a module it names), recursively."""
    seen = set() if seen is None else seen
    fn = getattr(obj, "fn", obj)
    if not isinstance(fn, types.FunctionType) or id(fn) in seen:
        return []
    seen.add(id(fn))
    parts = [(obj, fn)]
    if not _is_kernel(obj):
        return parts
    g = fn.__globals__
    names = fn.__code__.co_names
    for n in names:
        v = g.get(n)
        candidates = [v]
        if isinstance(v, types.ModuleType):
            candidates = [getattr(v, a, None) for a in names]
        for c in candidates:
            if _is_kernel(c):
                parts += _jit_parts(c, seen)
    return parts


def same_code_as_flashedu(obj) -> str:
    """The dotted name of the guarded flashedu function (or kernel) whose code `obj` copies, or of
    one a learner's kernel calls; '' when none. Names are not compared: code and source are."""
    if obj is None:
        return ""
    table = _copies_table()
    parts = _jit_parts(obj)
    for part, fn in parts:
        hit = table.lookup(fn.__code__) or _source_match(part, fn)
        if hit:
            return hit
    for part, fn in parts:
        if fn.__module__.startswith("flashedu.") and (
            not fn.__module__.startswith(_TOOLS) or fn.__module__ in _GUARDED
        ):
            return _dotted(fn)
    return ""


def copy_message(dotted: str) -> str:
    return (
        f"your code is flashedu's {dotted} (the same code under another name): the exercise is to "
        "write it yourself"
    )


_PREVIOUS: list = []  # the trace function active before the guard's, chained and restored


def _trace(frame, event, arg):
    """A global trace function: it sees each new Python frame once ('call'), never C calls, and
    asks for no per-line tracing unless the tracer it replaced (a debugger, coverage) does."""
    if event == "call" and not _GUARD.allowed:
        hit = _COPIES.lookup(frame.f_code)
        if hit:
            _GUARD.hits.append("copy:" + hit)
            raise Shortcut(copy_message(hit))
    previous = _PREVIOUS[0] if _PREVIOUS else None
    return previous(frame, event, arg) if previous is not None else None


def _start_trace(table) -> None:
    """On the main thread only (where notebook cells and the checks CLI grade): off it, the time
    limit stops a learner's loop with an asynchronous exception (`_limits._watchdog`), which a
    Python trace function in the same thread can swallow, leaving the grader hung. There, copies
    of the package's code are still caught where they are patched, not by their code."""
    if threading.current_thread() is not threading.main_thread():
        return
    _PREVIOUS[:] = [sys.gettrace()]
    sys.settrace(_trace)


def _stop_trace() -> None:
    if _PREVIOUS:
        sys.settrace(_PREVIOUS[0])
        _PREVIOUS.clear()


@contextmanager
def forbid_flashedu(allow: Iterable[str] = (), *, trace: bool = True):
    """Within the block, calling flashedu's own implementations raises Shortcut naming the call.

    allow: dotted names the exercise permits, e.g. ("flashedu.api.attention",); they run normally,
    together with everything they call. trace: also catch copies of them (a trace hook compares
    the code of every Python function called; the Triton graders check kernels at launch instead).
    Yields the list of forbidden calls made so far (a learner's `except Exception` may swallow the
    Shortcut; the list still holds it).
    """
    if _GUARD.depth == 0:
        _GUARD.hits = []
        try:
            _install(allow, trace)
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
        hit = _GUARD.hits[0]
        copy = hit.startswith("copy:")
        raise Shortcut(copy_message(hit[5:]) if copy else f"called {hit}")
