"""The course wing: the manifest (`book.toml`), its consistency check, and the static book.

    python -m flashedu.course check       # manifest <-> notebooks <-> modules <-> exercises
    python -m flashedu.course list        # chapters in order
    python -m flashedu.course notebooks   # the notebooks in course order (the Makefile asks this)
    python -m flashedu.course book        # the static course in _build/html (`make book`)

Modules: `manifest` (reading and checking book.toml: the one reader of it), `book` (the Jupyter
Book build; imports its renderer's dependencies only when it builds) and `__main__` (the command
line). The manifest's API is re-exported here: `from flashedu import course; course.load()`.
Not taught in a notebook: it holds the course together.
"""

from __future__ import annotations

from .manifest import (
    MIN_EXERCISES,
    REQUIRED,
    Chapter,
    cell_source,
    check,
    check_first_cell,
    exercise_stubs,
    first_cell_text,
    load,
    notebooks,
    read_notebook,
)

__all__ = [
    "MIN_EXERCISES",
    "REQUIRED",
    "Chapter",
    "cell_source",
    "check",
    "check_first_cell",
    "exercise_stubs",
    "first_cell_text",
    "load",
    "notebooks",
    "read_notebook",
]
