"""Where graded runs are recorded, and `progress()`: every exercise's latest outcome, by chapter.

Each call of a grader writes {grader name: {"status", "cases", "chapter", "time"}} to a small JSON
file: the path in the environment variable FLASHEDU_PROGRESS when it is set, otherwise
~/.flashedu/progress.json. Under pytest nothing is recorded unless FLASHEDU_PROGRESS is set, so
tests never touch the home directory or the repository. A status is "passed", "wrong" or
"not attempted"; the latest run of an exercise wins (re-running a stub resets it).

`python -m flashedu.checks NOTEBOOK...` points FLASHEDU_PROGRESS at a fresh file per notebook and
reads the results back to print its scorecard (flashedu/checks/__main__.py).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

from ._shared import CHAPTER_OF, GRADERS

ENV = "FLASHEDU_PROGRESS"


def path() -> Path | None:
    """The progress file, or None when nothing should be recorded (under pytest, unset)."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser()
    if "PYTEST_CURRENT_TEST" in os.environ:
        return None
    return Path.home() / ".flashedu" / "progress.json"


def load(p: Path | None = None) -> dict:
    """The recorded outcomes ({} when there is no file or it cannot be read)."""
    p = p or path()
    try:
        data = json.loads(Path(p).read_text()) if p else {}
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def record(name: str, chapter: str, report) -> None:
    """Record a grader's report; a file that cannot be written is skipped silently (grading
    must not fail because a home directory is read-only)."""
    p = path()
    if p is None:
        return
    data = load(p)
    n_ok = sum(ok for _, ok, _ in report.results)
    data[name] = {
        "status": report.status,
        "cases": f"{n_ok}/{len(report.results)}",
        "chapter": chapter.rsplit(".", 1)[-1],
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(p)
    except OSError:
        pass


def progress(out: Callable = print, p: Path | None = None) -> dict[str, str]:
    """Print every exercise's latest outcome, chapter by chapter; return {grader: status}."""
    data = load(p)
    status = {n: data.get(n, {}).get("status", "not attempted") for n in GRADERS}
    counts = {s: list(status.values()).count(s) for s in ("passed", "wrong", "not attempted")}
    out(
        f"progress: {counts['passed']} passed, {counts['wrong']} wrong, "
        f"{counts['not attempted']} not attempted (of {len(status)} exercises)"
    )
    w = max(len(n) for n in GRADERS)
    for name in sorted(GRADERS, key=lambda n: CHAPTER_OF[n]):  # stable: __all__ order
        chapter = CHAPTER_OF[name].rsplit(".ch", 1)[-1]
        cases = data.get(name, {}).get("cases", "")
        out(f"  {chapter}  {name:<{w}}  {status[name]:<13}  {cases}".rstrip())
    return status
