"""The course manifest (`book.toml`) and its consistency check.

    python -m flashedu.course check       # manifest <-> notebooks <-> modules <-> exercises
    python -m flashedu.course list        # chapters in order
    python -m flashedu.course notebooks   # the notebooks in course order, one line (the Makefile)
    python -m flashedu.course book        # the static course in _build/html (flashedu.course.book)

Not taught in a notebook: it holds the course together, and it is the one reader of book.toml.
Checked, each problem reported as one sentence that names the chapter, the file and what is
expected:
- the manifest: a [book] title; per chapter an id, title, notebook, modules, objectives
  (non-empty list of text) and minutes (positive whole number); ids and notebooks unique; chapter NN
  (its place in the manifest, from 00) has an id starting "NN-" and a notebook named
  notebooks/NN_*.ipynb;
- the tree: every listed notebook exists and every notebook in notebooks/ is listed;
- each notebook's first cell is markdown stating the chapter title, every objective word for word
  and "NN minutes";
- each listed module imports and its docstring names the notebook that introduces it
  (one book.toml lists);
- exercises: flashedu/checks/chNN.py exports at least two graders, the notebook calls at least two
  of them on stubs (`exercise_stubs`: a function raising NotImplementedError("Exercise ..."), or
  a @triton.jit kernel that stores nothing yet, which its grader reports as not attempted), shows
  `checks.solution(...)`, and tests/checks/test_chNN.py exists.
Limits: it reads notebooks as text and does not run them; nbval does that (`make test`).
"""

from __future__ import annotations

import ast
import importlib
import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from .._env import ROOT

REQUIRED = ("id", "title", "notebook", "modules", "objectives", "minutes")
MIN_EXERCISES = 2


@dataclass(frozen=True)
class Chapter:
    id: str
    title: str
    notebook: str
    modules: tuple[str, ...]
    objectives: tuple[str, ...]
    minutes: int


def _chapter(i: int, c: dict) -> Chapter:
    where = f"book.toml: chapter {i} ({c.get('id', 'no id')})"
    missing = [k for k in REQUIRED if k not in c]
    if missing:
        raise ValueError(
            f"{where} lacks {', '.join(missing)} (every chapter needs {', '.join(REQUIRED)})"
        )
    for key in ("objectives", "modules"):
        if not isinstance(c[key], list) or not all(
            isinstance(x, str) and x.strip() for x in c[key]
        ):
            raise ValueError(f"{where}: {key} must be a list of non-empty strings, got {c[key]!r}")
    if not c["objectives"]:
        raise ValueError(f"{where}: objectives is empty; list what the learner will be able to do")
    if isinstance(c["minutes"], bool) or not isinstance(c["minutes"], int) or c["minutes"] <= 0:
        raise ValueError(f"{where}: minutes must be a positive whole number, got {c['minutes']!r}")
    return Chapter(
        c["id"],
        c["title"],
        c["notebook"],
        tuple(c["modules"]),
        tuple(c["objectives"]),
        c["minutes"],
    )


def load(root: Path = ROOT) -> tuple[dict, list[Chapter]]:
    """(book table, chapters in order) from root/book.toml; ValueError naming the first malformed
    chapter."""
    with open(root / "book.toml", "rb") as f:
        data = tomllib.load(f)
    return data.get("book", {}), [_chapter(i, c) for i, c in enumerate(data.get("chapter", []))]


def notebooks(root: Path = ROOT) -> list[str]:
    """The chapters' notebooks in course order, as book.toml lists them (paths from the root)."""
    return [c.notebook for c in load(root)[1]]


def read_notebook(path: Path) -> dict:
    """The notebook's JSON; ValueError naming the file when it is not a notebook."""
    try:
        nb = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path.name} is not valid JSON ({e})") from None
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        raise ValueError(f"{path.name} has no list of cells: not a Jupyter notebook")
    return nb


def cell_source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def first_cell_text(notebook: Path) -> tuple[str, str]:
    """(cell type, text) of the notebook's first cell; ("none", "") when it has no cells."""
    cells = read_notebook(notebook)["cells"]
    return (cells[0].get("cell_type", "none"), cell_source(cells[0])) if cells else ("none", "")


def _check_manifest(book: dict, chapters: list[Chapter]) -> list[str]:
    problems = [] if book.get("title") else ["book.toml: the [book] table needs a title"]
    for key in ("id", "notebook"):
        values = [getattr(c, key) for c in chapters]
        dupes = sorted({v for v in values if values.count(v) > 1})
        if dupes:
            problems.append(
                f"book.toml: chapter {key}s must be unique; repeated: {', '.join(dupes)}"
            )
    for i, c in enumerate(chapters):
        nn, name = f"{i:02d}", Path(c.notebook).name
        if not c.id.startswith(f"{nn}-"):
            problems.append(
                f"chapter {nn}: id {c.id!r} should start with '{nn}-' (its place in book.toml)"
            )
        if not (
            c.notebook.startswith("notebooks/")
            and name.startswith(f"{nn}_")
            and name.endswith(".ipynb")
        ):
            problems.append(
                f"chapter {nn} ({c.id}): notebook {c.notebook!r} "
                f"should be notebooks/{nn}_<name>.ipynb"
            )
    return problems


def check_first_cell(path: Path, label: str, c: Chapter) -> list[str]:
    try:
        kind, text = first_cell_text(path)
    except ValueError as e:
        return [f"{label}: {e}"]
    if kind != "markdown":
        return [
            f"{label}: the first cell of {c.notebook} must be markdown "
            f"stating title, objectives and minutes; it is a {kind} cell"
        ]
    problems = (
        [f"{label}: the first cell of {c.notebook} does not state the title {c.title!r}"]
        if c.title not in text
        else []
    )
    problems += [
        f"{label}: the first cell of {c.notebook} does not state the objective {o!r} "
        f"(copy it exactly from book.toml)"
        for o in c.objectives
        if o not in text
    ]
    if f"{c.minutes} minutes" not in text:
        problems.append(
            f"{label}: the first cell of {c.notebook} does not state 'Estimated time: {c.minutes} "
            f"minutes' (book.toml says {c.minutes})"
        )
    return problems


def _check_module(label: str, name: str, listed: set[str]) -> list[str]:
    try:
        mod = importlib.import_module(name)
    except Exception as e:  # any import failure is a problem to report, not to crash on
        return [f"{label}: module {name} does not import ({type(e).__name__}: {e})"]
    doc = (mod.__doc__ or "").strip()
    if not doc:
        return [
            f"{label}: module {name} has no docstring "
            "(say what it is and which notebook introduces it)"
        ]
    named = re.findall(r"notebooks/[\w.-]+\.ipynb", doc)
    if not named:
        return [
            f"{label}: the docstring of {name} does not name the notebook that introduces it "
            f"(e.g. 'Introduced in notebooks/NN_name.ipynb')"
        ]
    return [
        f"{label}: the docstring of {name} names {p}, which book.toml does not list"
        for p in named
        if p not in listed
    ]


def _python(src: str) -> str:
    """A cell's source without IPython magics and shell escapes, so `ast` can parse it."""
    return "\n".join(
        "" if line.lstrip().startswith(("%", "!")) else line for line in src.splitlines()
    )


def _raises_exercise(fn: ast.FunctionDef) -> bool:
    return any(
        isinstance(r, ast.Raise)
        and isinstance(r.exc, ast.Call)
        and getattr(r.exc.func, "id", "") == "NotImplementedError"
        and bool(r.exc.args)
        and isinstance(r.exc.args[0], ast.Constant)
        and str(r.exc.args[0].value).startswith("Exercise")
        for r in ast.walk(fn)
    )


def _unwritten_kernel(fn: ast.FunctionDef) -> bool:
    """A @triton.jit function that writes nothing to memory (no tl.store, no tl.atomic_*): what a
    kernel exercise looks like before the learner fills it in."""
    jit = any(
        isinstance(d, ast.Attribute) and d.attr == "jit" and getattr(d.value, "id", "") == "triton"
        for d in fn.decorator_list
    )
    writes = any(
        isinstance(n, ast.Attribute) and (n.attr == "store" or n.attr.startswith("atomic_"))
        for n in ast.walk(fn)
    )
    return jit and not writes


def exercise_stubs(source: str) -> set[str]:
    """Names of the exercise stubs defined in a notebook's code (cells joined or one at a time):
    functions whose body raises NotImplementedError("Exercise ..."), and @triton.jit kernels that
    store nothing yet (a grader launches them and reports "not attempted yet"). Code that does not
    parse has none."""
    try:
        tree = ast.parse(_python(source))
    except SyntaxError:
        return set()
    return {
        fn.name
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef) and (_raises_exercise(fn) or _unwritten_kernel(fn))
    }


def _check_exercises(root: Path, i: int, c: Chapter, cells: list[dict]) -> list[str]:
    """Graders in flashedu.checks.chNN, called by the notebook on stubs, tested in
    tests/checks/test_chNN.py."""
    nn, label = f"{i:02d}", f"chapter {i:02d} ({c.id})"
    text = "\n".join(cell_source(x) for x in cells)
    try:
        graders = list(importlib.import_module(f"flashedu.checks.ch{nn}").__all__)
    except ModuleNotFoundError as e:
        if e.name != f"flashedu.checks.ch{nn}":
            return [f"{label}: flashedu.checks does not import ({e})"]
        graders = []
    except Exception as e:
        return [f"{label}: flashedu/checks/ch{nn}.py does not import ({type(e).__name__}: {e})"]
    problems = []
    if len(graders) < MIN_EXERCISES:
        problems.append(
            f"{label}: flashedu/checks/ch{nn}.py should export at least {MIN_EXERCISES} graders in "
            f"__all__, found {len(graders)}"
        )
    called = sorted(g for g in graders if re.search(rf"\bchecks\.{g}\(", text))
    if graders and len(called) < MIN_EXERCISES:
        problems.append(
            f"{label}: {c.notebook} calls {len(called)} of its graders "
            f"({', '.join(called) or 'none'}); "
            f"at least {MIN_EXERCISES} exercises should be graded with checks.<grader>(...)"
        )
    stubs = len(
        set().union(*(exercise_stubs(cell_source(x)) for x in cells if x["cell_type"] == "code"))
    )
    if stubs < MIN_EXERCISES:
        problems.append(
            f"{label}: {c.notebook} has {stubs} exercise stub(s); each exercise needs one: a "
            f'function raising NotImplementedError("Exercise {i}.N: ...") or a @triton.jit kernel '
            "that stores nothing yet"
        )
    if "checks.solution(" not in text:
        problems.append(
            f"{label}: {c.notebook} never shows how to reveal a solution (checks.solution(...))"
        )
    if not (root / "tests" / "checks" / f"test_ch{nn}.py").exists():
        problems.append(
            f"{label}: tests/checks/test_ch{nn}.py is missing (the graders must be tested)"
        )
    return problems


def check(root: Path = ROOT) -> list[str]:
    """Every inconsistency between book.toml, notebooks/, flashedu/ and tests/, as sentences; []
    when none."""
    try:
        book, chapters = load(root)
    except (ValueError, tomllib.TOMLDecodeError) as e:
        return [str(e) if str(e).startswith("book.toml") else f"book.toml: {e}"]
    problems = _check_manifest(book, chapters)
    listed = {c.notebook for c in chapters}
    problems += [
        f"{p.relative_to(root).as_posix()} is not listed in book.toml "
        "(add a [[chapter]] or remove it)"
        for p in sorted((root / "notebooks").glob("*.ipynb"))
        if p.relative_to(root).as_posix() not in listed
    ]
    checked: set[str] = set()
    for i, c in enumerate(chapters):
        label = f"chapter {i:02d} ({c.id})"
        path = root / c.notebook
        if not path.exists():
            problems.append(f"{label}: notebook {c.notebook} does not exist")
        else:
            problems += check_first_cell(path, label, c)
            try:
                cells = read_notebook(path)["cells"]
            except ValueError:
                cells = None  # already reported by the first-cell check
            if cells is not None:
                problems += _check_exercises(root, i, c, cells)
        for m in c.modules:
            if m not in checked:  # a module shared by chapters is reported once, under the first
                problems += _check_module(label, m, listed)
                checked.add(m)
    return problems
