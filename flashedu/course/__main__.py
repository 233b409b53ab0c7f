"""The course's command line: `python -m flashedu.course [check|list|notebooks|book ...]`.

    python -m flashedu.course check       # every inconsistency as a sentence; exit 1 if any
    python -m flashedu.course list        # chapters in order, with their minutes and notebooks
    python -m flashedu.course notebooks   # notebook paths in course order on one line (Makefile)
    python -m flashedu.course book [--no-execute] [--all]   # `make book`

With no command it checks. Unknown commands and flags are refused with argparse's usage line and
exit status 2; `book` passes its own flags to `flashedu.course.book`.
"""

from __future__ import annotations

import argparse
import sys

from .manifest import check, load, notebooks


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flashedu.course", description="The course manifest and its tools."
    )
    commands = p.add_subparsers(dest="command", metavar="{check,list,notebooks,book}")
    commands.add_parser("check", help="check book.toml against notebooks/, flashedu/ and tests/")
    commands.add_parser("list", help="the chapters in order")
    commands.add_parser("notebooks", help="the notebooks in course order, space-separated")
    commands.add_parser("book", help="build the static course (its flags: book --help)")
    return p


def _check() -> int:
    problems = check()
    for p in problems:
        print("problem:", p)
    try:
        n = f"{len(load()[1])} chapters"
    except ValueError:
        n = "book.toml unreadable"
    print(f"{n}, {len(problems)} problem(s)" + ("" if problems else ": the course is consistent"))
    return 1 if problems else 0


def _list() -> int:
    for c in load()[1]:
        print(f"{c.id:<24} {c.minutes:>3} min  {c.notebook}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["book"]:  # the site builder parses its own flags
        from . import book

        return book.main(argv[1:])
    args = parser().parse_args(argv)
    if args.command == "list":
        return _list()
    if args.command == "notebooks":
        print(" ".join(notebooks()))
        return 0
    return _check()


if __name__ == "__main__":
    sys.exit(main())
