"""The package's import graph: no cycles, and no module takes another's private name.

Every module under flashedu/ is parsed (not imported), and every import in it counts, at module
level or inside a function: a lazy import still ties the two modules together. An edge goes from a
module to each flashedu module it imports (`from . import x` to the submodule x, `from .x import y`
to x, or to y when y is itself a submodule). A private name is one with a leading underscore that
is not a dunder; private *modules* (`_validate`, `_env`, `checks._core`) are the package's internal
API and may be imported, but their private names may not, nor any other module's, whether by
`from m import _name` or by `m._name` on an imported module.
"""

from __future__ import annotations

import ast
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


def graph() -> dict[str, set[str]]:
    return {m: {dep for dep, *_ in imports(m) if dep != m} for m in MODULES}


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
