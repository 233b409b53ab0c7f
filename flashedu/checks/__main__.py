"""Grade notebooks headlessly: `python -m flashedu.checks NOTEBOOK... [--timeout SECONDS]`.

Each notebook is executed top to bottom with nbclient, in its own directory, with the environment
variable FLASHEDU_PROGRESS pointing at a fresh file; its graders record there what they found
(`_progress.py`), and a scorecard is printed, one line per exercise:

    notebooks/02_online_softmax.ipynb
      2.1  online_softmax  passed
      2.2  merge_states    wrong (3/5 cases)

The exercises of a notebook are the `checks.<grader>(...)` calls in its code cells, numbered by the
"Exercise N.M" heading above them. An exercise whose grader never ran (a cell above raised) is
"not run", and every cell that raised is listed. The exit status is 1 when an attempted exercise
is wrong or a cell raised, 0 otherwise (all "not attempted" is a pass: the committed notebooks).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from pathlib import Path

from . import GRADERS, _progress

_CALL = re.compile(r"\bchecks\.(\w+)\(")
_EXERCISE = re.compile(r"Exercise\s+(\d+\.\d+)")


def exercises(nb) -> list[tuple[str, str]]:
    """[(exercise number or "", grader name)] in the order the notebook grades them."""
    found, number = [], ""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            number = (_EXERCISE.findall(cell.source) or [number])[-1]
        elif cell.cell_type == "code":
            for name in _CALL.findall(cell.source):
                if name in GRADERS and all(name != g for _, g in found):
                    found.append((number, name))
    return found


def _errors(nb) -> list[str]:
    """'cell 12 raised NameError: ...' for every code cell with an error output."""
    lines = []
    for i, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if output.get("output_type") == "error":
                value = (
                    str(output.get("evalue", "")).splitlines()[0][:80]
                    if output.get("evalue")
                    else ""
                )
                lines.append(
                    f"cell {i} raised {output.get('ename')}" + (f": {value}" if value else "")
                )
    return lines


def run(path: Path, timeout: int) -> tuple[list[tuple[str, str, str]], list[str]]:
    """Execute one notebook: ([(number, grader, status)], [cell errors])."""
    try:
        import nbformat
        from nbclient import NotebookClient
    except ImportError as e:  # pragma: no cover (installed with jupyterlab)
        raise SystemExit(f"python -m flashedu.checks needs nbclient and nbformat: {e}") from None
    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "progress.json"
        before = os.environ.get(_progress.ENV)
        os.environ[_progress.ENV] = str(record)  # the kernel inherits it
        try:
            client = NotebookClient(
                nb,
                timeout=timeout,
                allow_errors=True,
                kernel_name=nb.metadata.get("kernelspec", {}).get("name", "python3"),
                resources={"metadata": {"path": str(path.resolve().parent)}},
            )
            client.execute()
        finally:
            if before is None:
                os.environ.pop(_progress.ENV, None)
            else:
                os.environ[_progress.ENV] = before
        seen = _progress.load(record)
    rows = []
    for number, name in exercises(nb):
        entry = seen.get(name)
        status = entry["status"] if entry else "not run"
        if entry and status == "wrong":
            status += f" ({entry['cases']} cases)"
        rows.append((number, name, status))
    return rows, _errors(nb)


def scorecard(path: Path, rows, errors, out=print) -> None:
    out(str(path))
    w = max([len(name) for _, name, _ in rows] + [1])
    for number, name, status in rows:
        out(f"  {number or '-':<4} {name:<{w}}  {status}")
    if not rows:
        out("  (no graded exercises)")
    for line in errors:
        out(f"  {line}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flashedu.checks",
        description="Execute notebooks headlessly and print each exercise's grade.",
    )
    parser.add_argument("notebooks", nargs="+", type=Path, metavar="NOTEBOOK")
    parser.add_argument(
        "--timeout", type=int, default=600, help="seconds one cell may run (default 600)"
    )
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.notebooks if not p.is_file()]
    if missing:
        parser.error(f"no such notebook: {', '.join(missing)}")
    failed, counts = False, {"passed": 0, "wrong": 0, "not attempted": 0, "not run": 0}
    for path in args.notebooks:
        rows, errors = run(path, args.timeout)
        scorecard(path, rows, errors)
        for _, _, status in rows:
            counts[status.split(" (")[0]] += 1
        failed |= bool(errors) or any(s.startswith(("wrong", "not run")) for _, _, s in rows)
    print(", ".join(f"{n} {k}" for k, n in counts.items()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
