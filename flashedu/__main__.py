"""`python -m flashedu <command> ...`: hands the command to its wing.

    python -m flashedu bench ...     # the same as python -m flashedu.bench ...
    python -m flashedu course ...    # the same as python -m flashedu.course ...

Each wing parses its own arguments (`flashedu/bench/__main__.py`, `flashedu/course/__main__.py`).
"""

from __future__ import annotations

import sys


def _bench(argv: list[str]) -> int:
    from .bench.__main__ import main

    return main(argv)


def _course(argv: list[str]) -> int:
    from .course.__main__ import main

    return main(argv)


COMMANDS = {"bench": _bench, "course": _course}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        got = repr(argv[0]) if argv else "nothing"
        print(f"usage: python -m flashedu {{{'|'.join(COMMANDS)}}} ..., got {got}", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
