"""The package's import graph: no cycles, and no module takes another's private name.

Every module under flashedu/ is parsed (not imported), and every import in it counts, at module
level or inside a function: a lazy import still ties the two modules together. An edge goes from a
module to each flashedu module it imports (`from . import x` to the submodule x, `from .x import y`
to x, or to y when y is itself a submodule), and to each module it imports by a string
(`importlib.import_module`, `__import__`): a literal names its module; an f-string whose holes are
loop variables over a literal tuple names each; any other f-string stands for every module its
pattern matches; a name computed from data (a grader's solution, book.toml's module list) must be
listed in DATA_DRIVEN with the modules it can reach. A module-level `__getattr__` may not import.
A private name is one with a leading underscore that is not a dunder; private *modules* (`_env`,
`checks._core`) are the package's internal API and may be imported, but their private names may
not, nor any other module's, whether by `from m import _name` or by `m._name` on an imported module.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "flashedu"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _base(module: str, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names, resolving leading dots against `module`."""
    if not node.level:
        return node.module or ""
    parts = module.split(".") if _is_package(module) else module.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def imports(module: str) -> list[tuple[str, str | None, int, str]]:
    """(imported flashedu module, private name taken from it or None, line, "import") for every
    import in `module`, and (module, name, line, "attribute") for every `alias._name` on a flashedu
    module bound by an import."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    found, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MODULES:
                    found.append((a.name, None, node.lineno, "import"))
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else None
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, node)
            if base not in MODULES:
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in MODULES:
                    found.append((sub, None, node.lineno, "import"))
                    aliases[a.asname or a.name] = sub
                else:
                    found.append(
                        (base, a.name if _private(a.name) else None, node.lineno, "import")
                    )
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and aliases.get(node.value.id)
            and _private(node.attr)
            and f"{aliases[node.value.id]}.{node.attr}" not in MODULES
        ):
            found.append((aliases[node.value.id], node.attr, node.lineno, "attribute"))
    return found


def _grader_solutions() -> set[str]:
    """The modules of every `@grader("flashedu....")` solution: what `solution_function` loads. A
    solution in its grader's own module is a lookup (that module is loaded: it defined the grader),
    not an import."""
    found = set()
    for name, path in MODULES.items():
        if name.startswith("flashedu.checks.ch"):
            for dotted in re.findall(r'"(flashedu\.[\w.]+)"', path.read_text()):
                found.add(_longest_module(dotted))
            found.discard(name)
    return found - {None}


def _chapter_graders() -> set[str]:
    return {n for n in MODULES if re.fullmatch(r"flashedu\.checks\.ch\d\d", n)}


def _book_modules() -> set[str]:
    book = tomllib.loads((PACKAGE.parent / "book.toml").read_text())
    listed = {m for ch in book["chapter"] for m in ch.get("modules", [])}
    return {_longest_module(m) for m in listed} | _chapter_graders()


def _longest_module(dotted: str) -> str | None:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in MODULES:
            return ".".join(parts[:i])
    return None


# (module, function or None at module level) -> the modules a data-driven import in it can load
DATA_DRIVEN = {
    ("flashedu.checks", None): _chapter_graders,  # pkgutil over the package, names "ch.."
    ("flashedu.checks._shared", "solution_function"): _grader_solutions,
    ("flashedu.course.manifest", "_check_module"): _book_modules,
}


def _is_string_import(call: ast.Call) -> bool:
    f = call.func
    return (isinstance(f, ast.Attribute) and f.attr == "import_module") or (
        isinstance(f, ast.Name) and f.id in ("import_module", "__import__")
    )


def _loop_values(tree: ast.AST, var: str) -> list[str] | None:
    """The strings a `for var in (...)` loop (over a literal tuple or a module-level one) binds."""
    consts = {
        t.id: node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name):
            if node.target.id == var:
                it = consts.get(node.iter.id) if isinstance(node.iter, ast.Name) else node.iter
                if isinstance(it, (ast.Tuple, ast.List)) and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str) for e in it.elts
                ):
                    return [e.value for e in it.elts]
    return None


def _absolute(module: str, target: str) -> str:
    if not target.startswith("."):
        return target
    level = len(target) - len(target.lstrip("."))
    base = module.split(".") if _is_package(module) else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target.lstrip(".")] if target.lstrip(".") else []))


def string_imports(module: str) -> tuple[set[str], list[str]]:
    """(flashedu modules `module` imports by a string, the string imports it cannot resolve)."""
    tree = ast.parse(MODULES[module].read_text())
    found, unresolved = set(), []
    functions = {
        id(n): fn.name
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef)
        for n in ast.walk(fn)
    }
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and _is_string_import(node) and node.args):
            continue
        arg, where = node.args[0], f"{module}:{node.lineno}"
        if (module, functions.get(id(node))) in DATA_DRIVEN:
            found |= DATA_DRIVEN[(module, functions.get(id(node)))]()
        elif isinstance(arg, ast.Name) and _loop_values(tree, arg.id) is not None:
            found |= set(_loop_values(tree, arg.id))
        elif isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            found.add(_absolute(module, arg.value))
        elif isinstance(arg, ast.JoinedStr):
            holes = [v.value for v in arg.values if isinstance(v, ast.FormattedValue)]
            values = [_loop_values(tree, h.id) if isinstance(h, ast.Name) else None for h in holes]
            parts = [c.value if isinstance(c, ast.Constant) else "HOLE" for c in arg.values]
            template = _absolute(module, "".join(parts))
            if len(values) == 1 and values[0] is not None:
                found |= {template.replace("HOLE", v) for v in values[0]}
            else:
                pattern = re.escape(template).replace("HOLE", r"\w+")
                found |= {m for m in MODULES if re.fullmatch(pattern, m)}
        else:
            unresolved.append(where)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            if any(isinstance(n, (ast.Import, ast.ImportFrom, ast.Call)) for n in ast.walk(node)):
                unresolved.append(f"{module}:{node.lineno} (a module __getattr__ that imports)")
    return {m for m in found if m in MODULES}, unresolved


def graph() -> dict[str, set[str]]:
    return {m: ({dep for dep, *_ in imports(m)} | string_imports(m)[0]) - {m} for m in MODULES}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_walk_sees_the_package_and_its_lazy_imports():
    assert {"flashedu", "flashedu.naive", "flashedu.bench", "flashedu.course.manifest"} <= set(
        MODULES
    )
    edges = graph()
    assert "flashedu.kernels.bwd" in edges["flashedu.kernels"]
    assert "flashedu.bench.gpu" in edges["flashedu.bench.__main__"]  # imported inside a function


def test_the_walk_finds_a_cycle_and_a_private_name_when_there_is_one(tmp_path, monkeypatch):
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    fake = tmp_path / "flashedu" / "fake.py"
    fake.parent.mkdir()
    fake.write_text(
        "from . import naive\nfrom .traffic import _x\n\n\ndef f():\n"
        "    from .tiled import forward\n    return naive._y\n"
    )
    monkeypatch.setitem(MODULES, "flashedu.fake", fake)
    monkeypatch.setattr(f"{__name__}.PACKAGE", tmp_path / "flashedu")
    assert set(imports("flashedu.fake")) == {
        ("flashedu.naive", None, 1, "import"),
        ("flashedu.naive", "_y", 7, "attribute"),
        ("flashedu.tiled", None, 6, "import"),
        ("flashedu.traffic", "_x", 2, "import"),
    }


def test_string_imports_are_edges_of_the_graph():
    edges = graph()
    assert "flashedu.checks.ch06" in edges["flashedu.checks"]  # f".{_m.name}" over the package
    assert "flashedu.tiled" in edges["flashedu.checks._method"]  # f"flashedu.{name}" over _CORE
    assert "flashedu.kernels.intro" in edges["flashedu.checks._shared"]  # a grader's solution
    assert cycles({**edges, "flashedu.naive": edges["flashedu.naive"] | {"flashedu.checks"}})


def test_every_string_import_is_resolved():
    unresolved = [u for m in MODULES for u in string_imports(m)[1]]
    assert not unresolved, "string imports the graph cannot follow: " + "; ".join(unresolved)


def test_no_import_cycles():
    found = cycles(graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_name_is_imported_from_another_module(module):
    taken = [
        f"{MODULES[module].relative_to(PACKAGE.parent)}:{line} takes {dep}.{name}"
        for dep, name, line, _ in imports(module)
        if name is not None and dep != module
    ]
    assert not taken, "make the name public or move it below both: " + "; ".join(taken)


def test_the_library_never_imports_the_test_helpers():
    """flashedu.testing serves tests/, the graders (checks) and the benchmarks (bench), which judge
    answers; the library they judge does not lean on it."""
    tools = ("flashedu.testing", "flashedu.checks", "flashedu.bench")
    leaning = sorted(
        f"{MODULES[m].relative_to(PACKAGE.parent)}:{line}"
        for m in MODULES
        if not m.startswith(tools)
        for dep, _, line, _ in imports(m)
        if dep == "flashedu.testing"
    )
    assert not leaning, f"imports flashedu.testing: {leaning}"


def test_import_flashedu_does_not_import_triton():
    """The registry lists the Triton implementations by loader functions: `import flashedu` (and
    the NumPy chapters) must work without triton, and load it only when a kernel is asked for."""
    import subprocess
    import sys

    code = (
        "import sys, flashedu\n"
        "from flashedu import naive, tiled, traffic, registry\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
        "flashedu.IMPLEMENTATIONS['triton'].module\n"
        "assert 'triton' in sys.modules\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
