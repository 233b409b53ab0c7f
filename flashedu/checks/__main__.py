"""Grade notebooks headlessly: `python -m flashedu.checks NOTEBOOK... [--timeout SECONDS]`.

Each notebook is executed top to bottom with nbclient, in its own directory, with the environment
variable FLASHEDU_PROGRESS pointing at a fresh file; its graders record there what they found
(`_progress.py`), and a scorecard is printed, one line per exercise:

    notebooks/02_online_softmax.ipynb
      2.1  online_softmax  passed
      2.2  merge_states    wrong (3/5 cases)

The exercises of a notebook are the `checks.<grader>(...)` calls in its code cells, numbered by the
"Exercise N.M" heading above them. An exercise whose grader never ran (a cell above raised) is
"not run", and every cell that raised or ran past `--timeout` (it is interrupted, and the next
cells run) is listed. Every notebook given is graded whatever happens to another: one that cannot
be run to its end (not JSON, empty, a kernel name that is not installed, a kernel that dies) keeps
the scorecard of what it graded and gets one line `FAILED path: cause` at the end. The exit status
is 1 when an attempted exercise is wrong, a cell raised or timed out, or a notebook failed; 0
otherwise (all "not attempted" is a pass: the committed notebooks).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import tempfile
from pathlib import Path

from . import GRADERS, _progress

_CALL = re.compile(r"\bchecks\.(\w+)\(")
# "Exercise 2.1", and "Exercises 10.1-10.3" (or 10.1–10.3, 10.1-3, 10.1 to 10.3) for a section
# whose graders take the numbers of the range in order
_EXERCISE = re.compile(
    r"Exercises?\s+(\d+)\.(\d+)(?:\s*(?:-|\u2013|\u2014|to)\s*(?:(\d+)\.)?(\d+)\b)?"
)


def _numbers(markdown: str) -> list[str]:
    """The exercise numbers the last "Exercise(s) ..." heading in a markdown cell names."""
    found = list(_EXERCISE.finditer(markdown))
    if not found:
        return []
    chapter, first, chapter_to, last = found[-1].groups()
    if last is None or (chapter_to not in (None, chapter)) or int(last) < int(first):
        return [f"{chapter}.{first}"]
    return [f"{chapter}.{i}" for i in range(int(first), int(last) + 1)]


def exercises(nb) -> list[tuple[str, str]]:
    """[(exercise number or "", grader name)] in the order the notebook grades them."""
    found, numbers = [], [""]
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            numbers = _numbers(cell.source) or numbers
        elif cell.cell_type == "code":
            for name in _CALL.findall(cell.source):
                if name in GRADERS and all(name != g for _, g in found):
                    found.append((numbers.pop(0) if len(numbers) > 1 else numbers[0], name))
    return found


def _first_line(text, width: int = 80) -> str:
    lines = str(text).strip().splitlines()
    return lines[0][:width] if lines else ""


def _errors(nb, timed_out: dict[int, float]) -> list[str]:
    """'cell 12 raised NameError: ...' for every code cell with an error output, 'cell 3 timed
    out after 600 s' for each one stopped at the time limit."""
    lines = []
    for i, cell in enumerate(nb.cells):
        if i in timed_out:
            lines.append(f"cell {i} timed out after {timed_out[i]:g} s and was interrupted")
            continue
        for output in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if output.get("output_type") == "error":
                value = _first_line(output.get("evalue", ""))
                lines.append(
                    f"cell {i} raised {output.get('ename')}" + (f": {value}" if value else "")
                )
    return lines


class NotebookFailed(Exception):
    """A notebook that could not be run to its end; the message is the one-line cause."""


def _read(path: Path):
    import nbformat

    try:
        if path.stat().st_size == 0:
            raise NotebookFailed("not a notebook: the file is empty")
        return nbformat.read(path, as_version=4)
    except NotebookFailed:
        raise
    except UnicodeDecodeError:
        raise NotebookFailed("not a notebook: the file is not UTF-8 text") from None
    except OSError as e:
        raise NotebookFailed(f"cannot be read: {e.strerror or e}") from None
    except Exception as e:  # nbformat's NotJSONError, a KeyError or ValidationError for bad JSON
        what = "not JSON" if type(e).__name__ == "NotJSONError" else "not a notebook"
        raise NotebookFailed(f"{what} ({type(e).__name__}: {_first_line(e, 60)})") from None


def _kernel_name(nb) -> str:
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    name = nb.metadata.get("kernelspec", {}).get("name", "python3")
    manager = KernelSpecManager()
    try:
        manager.get_kernel_spec(name)
    except NoSuchKernel:
        have = ", ".join(sorted(manager.find_kernel_specs())) or "none"
        raise NotebookFailed(f"unknown kernel {name!r} (installed: {have})") from None
    return name


def _execute(nb, path: Path, timeout: float) -> dict[int, float]:
    """Run every cell; {cell index: seconds} for the cells stopped at the timeout."""
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    timed_out: dict[int, float] = {}

    def on_error(cell, cell_index, execute_reply):
        if execute_reply.get("content", {}).get("ename") == "CellTimeoutError":
            timed_out[cell_index] = timeout

    client = NotebookClient(
        nb,
        timeout=max(1, math.ceil(timeout)),
        allow_errors=True,
        interrupt_on_timeout=True,  # a cell past the limit is interrupted; the next cells run
        error_on_timeout={"ename": "CellTimeoutError", "evalue": "timed out", "traceback": []},
        on_cell_error=on_error,
        kernel_name=_kernel_name(nb),
        resources={"metadata": {"path": str(path.resolve().parent)}},
    )
    try:
        client.execute()
    except DeadKernelError as e:
        why = _first_line(e, 60) or "no reason given"
        raise NotebookFailed(f"the kernel died ({why})") from None
    except Exception as e:  # a kernel that never started, a lost connection, ...
        why = f"{type(e).__name__}: {_first_line(e, 60)}"
        raise NotebookFailed(f"could not be run ({why})") from None
    return timed_out


def run(path: Path, timeout: float) -> tuple[list[tuple[str, str, str]], list[str], str]:
    """Execute one notebook: ([(number, grader, status)], [cell errors], why it failed or "").

    Whatever happens to the notebook (not JSON, empty, an unknown kernel, a kernel that dies, a
    cell past the timeout), the exercises graded before it are reported and the cause is one line.
    """
    try:
        import nbclient  # noqa: F401
        import nbformat  # noqa: F401
    except ImportError as e:  # pragma: no cover (installed with jupyterlab)
        raise SystemExit(f"python -m flashedu.checks needs nbclient and nbformat: {e}") from None
    try:
        nb = _read(path)
    except NotebookFailed as e:
        return [], [], str(e)
    failure, timed_out = "", {}
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "progress.json"
        before = os.environ.get(_progress.ENV)
        os.environ[_progress.ENV] = str(record)  # the kernel inherits it
        try:
            timed_out = _execute(nb, path, timeout)
        except NotebookFailed as e:
            failure = str(e)
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
    return rows, _errors(nb, timed_out), failure


def scorecard(path: Path, rows, errors, out=print) -> None:
    out(str(path))
    w = max([len(name) for _, name, _ in rows] + [1])
    for number, name, status in rows:
        out(f"  {number or '-':<4} {name:<{w}}  {status}")
    if not rows:
        out("  (no graded exercises)")
    for line in errors:
        out(f"  {line}")


def _seconds(text: str) -> float:
    """An argparse type: a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flashedu.checks",
        description="Execute notebooks headlessly and print each exercise's grade.",
    )
    parser.add_argument("notebooks", nargs="+", type=Path, metavar="NOTEBOOK")
    parser.add_argument(
        "--timeout",
        type=_seconds,
        default=600,
        help="seconds one cell may run before it is interrupted (default 600)",
    )
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.notebooks if not p.is_file()]
    if missing:  # a typo in the command: said before anything runs
        parser.error(f"no such notebook: {', '.join(missing)}")
    failed, counts, broken = False, {"passed": 0, "wrong": 0, "not attempted": 0, "not run": 0}, []
    for path in args.notebooks:
        rows, errors, why = run(path, args.timeout)
        if rows or errors or not why:
            scorecard(path, rows, errors)
        if why:
            broken.append(f"{path}: {why}")
        for _, _, status in rows:
            counts[status.split(" (")[0]] += 1
        failed |= bool(errors or why) or any(s.startswith(("wrong", "not run")) for _, _, s in rows)
    for line in broken:
        print(f"FAILED {line}")
    print(", ".join(f"{n} {k}" for k, n in counts.items()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
