"""The course manifest (`book.toml`) and its consistency check.

    python -m flashedu.course check     # manifest <-> notebooks <-> modules
    python -m flashedu.course list      # chapters in order

Checked: every chapter has id, title, notebook, modules, objectives and minutes; every listed notebook and
module exists; every notebook in notebooks/ is listed; each module's docstring names the notebook that
introduces it; each notebook's first cell is a markdown cell that states the chapter's objectives and minutes.
"""
from __future__ import annotations

import importlib
import json
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REQUIRED = ("id", "title", "notebook", "modules", "objectives", "minutes")


@dataclass(frozen=True)
class Chapter:
    id: str
    title: str
    notebook: str
    modules: tuple[str, ...]
    objectives: tuple[str, ...]
    minutes: int


def load(root: Path = ROOT) -> tuple[dict, list[Chapter]]:
    """(book table, chapters in order) from root/book.toml."""
    with open(root / "book.toml", "rb") as f:
        data = tomllib.load(f)
    chapters = []
    for i, c in enumerate(data.get("chapter", [])):
        missing = [k for k in REQUIRED if k not in c]
        if missing:
            raise ValueError(f"book.toml: chapter {i} ({c.get('id', '?')}) lacks {', '.join(missing)}")
        chapters.append(Chapter(c["id"], c["title"], c["notebook"], tuple(c["modules"]), tuple(c["objectives"]),
                                int(c["minutes"])))
    return data.get("book", {}), chapters


def first_cell_text(notebook: Path) -> tuple[str, str]:
    nb = json.loads(notebook.read_text())
    cell = nb["cells"][0] if nb.get("cells") else {"cell_type": "none", "source": ""}
    src = cell["source"]
    return cell["cell_type"], "".join(src) if isinstance(src, list) else src


def check(root: Path = ROOT) -> list[str]:
    """Every inconsistency between book.toml, notebooks/ and flashedu/, as sentences; [] when consistent."""
    problems: list[str] = []
    book, chapters = load(root)
    if not book.get("title"):
        problems.append("book.toml: [book] needs a title")
    ids = [c.id for c in chapters]
    if len(set(ids)) != len(ids):
        problems.append(f"book.toml: duplicate chapter ids in {ids}")
    listed = {c.notebook for c in chapters}
    for nb_path in sorted((root / "notebooks").glob("*.ipynb")):
        rel = nb_path.relative_to(root).as_posix()
        if rel not in listed:
            problems.append(f"{rel} is not listed in book.toml")
    for c in chapters:
        if not c.objectives:
            problems.append(f"{c.id}: no objectives")
        if c.minutes <= 0:
            problems.append(f"{c.id}: minutes must be positive, got {c.minutes}")
        path = root / c.notebook
        if not path.exists():
            problems.append(f"{c.id}: notebook {c.notebook} does not exist")
        else:
            kind, text = first_cell_text(path)
            if kind != "markdown":
                problems.append(f"{c.notebook}: first cell must be markdown stating the objectives, got {kind}")
            for obj in c.objectives:
                if obj not in text:
                    problems.append(f"{c.notebook}: first cell does not state the objective {obj!r}")
            if f"{c.minutes} minutes" not in text:
                problems.append(f"{c.notebook}: first cell does not state '{c.minutes} minutes'")
        for m in c.modules:
            try:
                mod = importlib.import_module(m)
            except ImportError as e:
                problems.append(f"{c.id}: module {m} does not import ({e})")
                continue
            if not (mod.__doc__ or "").strip():
                problems.append(f"{m}: module has no docstring")
            elif "notebooks/" not in mod.__doc__:
                problems.append(f"{m}: module docstring does not name the notebook that introduces it")
    return problems


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    cmd = args[0] if args else "check"
    if cmd == "check":
        problems = check()
        for p in problems:
            print("problem:", p)
        _, chapters = load()
        print(f"{len(chapters)} chapters, {len(problems)} problem(s)")
        return 1 if problems else 0
    if cmd == "list":
        _, chapters = load()
        for c in chapters:
            print(f"{c.id:<24} {c.minutes:>3} min  {c.notebook}")
        return 0
    if cmd == "book":
        from . import book  # the static site builder

        return book.main(args[1:])
    print(f"usage: python -m flashedu.course [check|list|book], got {cmd!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
