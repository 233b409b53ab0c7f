"""Where graded runs are recorded, and `progress()`: every exercise's latest outcome, by chapter.

Each call of a grader writes {grader name: {"status", "cases", "chapter", "time"}} to a small JSON
file: the path in the environment variable FLASHEDU_PROGRESS when it is set, otherwise
~/.flashedu/progress.json. Under pytest nothing is recorded unless FLASHEDU_PROGRESS is set, so
tests never touch the home directory or the repository. A status is "passed", "wrong" or
"not attempted"; the latest run of an exercise wins (re-running a stub resets it).

Nothing recorded is lost, whatever runs at the same time or dies half way:
* every read-modify-write holds a lock file beside the target (`filelock`), so two notebooks, or a
  notebook and `python -m flashedu.checks`, grading at once both keep their records;
* the new content goes to a unique temporary file in the same folder, is flushed to disk (fsync),
  and only then replaces the target (`flashedu._atomic.write_atomic`): a process killed
  before the replace leaves the previous file as it was (its temporary file is removed by the next
  writer, which holds the lock and so knows no one else is writing);
* a file that cannot be read (not JSON, cut short, or JSON of the wrong shape) is moved aside to
  `progress.json.unreadable-YYYYmmdd-HHMMSS[-n]`, with one line saying where, and never
  overwritten;
* a record that cannot be written (a read-only folder, a lock held too long) is said in one line;
  grading itself goes on.

The scorecard is the learner's own record, not a certificate: anyone can edit this file.

`python -m flashedu.checks NOTEBOOK...` points FLASHEDU_PROGRESS at a fresh file per notebook and
reads the results back to print its scorecard (flashedu/checks/__main__.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

from filelock import FileLock

from .._atomic import temp_prefix, write_atomic
from ._shared import CHAPTER_OF, GRADERS

ENV = "FLASHEDU_PROGRESS"
LOCK_TIMEOUT = 10.0  # seconds a writer waits for another; each write takes milliseconds
STATUSES = ("passed", "wrong", "not attempted")


def _say(line: str) -> None:
    print(line, file=sys.stderr)


def path() -> Path | None:
    """The progress file, or None when nothing should be recorded (under pytest, unset)."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser()
    if "PYTEST_CURRENT_TEST" in os.environ:
        return None
    return Path.home() / ".flashedu" / "progress.json"


def lock(p: Path) -> FileLock:
    """The cross-process lock that serialises every read-modify-write of `p`."""
    return FileLock(str(p) + ".lock", timeout=LOCK_TIMEOUT)


def _shape_error(data) -> str:
    """Why `data` is not a progress record ("" when it is one)."""
    if not isinstance(data, dict):
        return f"expected a JSON object, got {type(data).__name__}"
    for name, entry in data.items():
        if not isinstance(entry, dict):
            return f"entry {name!r} is {type(entry).__name__}, expected an object"
        if entry.get("status") not in STATUSES:
            return f"entry {name!r} has status {entry.get('status')!r}"
        if not all(isinstance(entry.get(k, ""), str) for k in ("cases", "chapter", "time")):
            return f"entry {name!r} has a field that is not a string"
    return ""


def _read(p: Path) -> tuple[dict, str]:
    """(records, why the file cannot be read or ""); a missing file is an empty record."""
    try:
        text = p.read_text()
    except FileNotFoundError:
        return {}, ""
    except (OSError, UnicodeDecodeError) as e:
        return {}, f"{type(e).__name__}: {e}"
    try:
        data = json.loads(text)
    except ValueError as e:
        return {}, ("it is empty" if not text.strip() else f"not JSON ({e})")
    why = _shape_error(data)
    return ({} if why else data), why


def _backup_name(p: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    candidate, n = p.with_name(f"{p.name}.unreadable-{stamp}"), 1
    while candidate.exists():
        candidate, n = p.with_name(f"{p.name}.unreadable-{stamp}-{n}"), n + 1
    return candidate


def _move_aside(p: Path, why: str, say: Callable) -> None:
    """Keep an unreadable file under a timestamped name (the caller holds the lock)."""
    backup = _backup_name(p)
    try:
        os.replace(p, backup)
    except OSError as e:
        say(f"progress: {p} cannot be read ({why}) nor moved aside ({e}); left as it is")
        raise
    say(f"progress: {p} could not be read ({why}); moved it to {backup} and started afresh")


def load(p: Path | None = None, *, say: Callable = _say) -> dict:
    """The recorded outcomes; {} when there is no file. A file that cannot be read is moved aside
    (one line says where) and {} returned."""
    p = p or path()
    if p is None:
        return {}
    p = Path(p)
    data, why = _read(p)
    if why:
        try:
            with lock(p):
                data, why = _read(p)  # another process may have repaired it meanwhile
                if why:
                    _move_aside(p, why, say)
        except OSError:
            return {}
    return data


def _remove_stale(p: Path) -> None:
    """Temporary files of writers that died before their replace (the caller holds the lock, so
    no writer is alive)."""
    for stale in p.parent.glob(f"{temp_prefix(p)}*.tmp"):
        with contextlib.suppress(OSError):
            stale.unlink()


def record(name: str, chapter: str, report, *, say: Callable = _say) -> bool:
    """Record a grader's report; True when it was written. A failure is said in one line and
    grading goes on (a read-only home directory must not stop a notebook)."""
    p = path()
    if p is None:
        return False
    n_ok = sum(ok for _, ok, _ in report.results)
    entry = {
        "status": report.status,
        "cases": f"{n_ok}/{len(report.results)}",
        "chapter": chapter.rsplit(".", 1)[-1],
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        with lock(p):
            _remove_stale(p)
            data, why = _read(p)
            if why:
                _move_aside(p, why, say)
            data[name] = entry
            write_atomic(p, json.dumps(data, indent=1, sort_keys=True))
    except OSError as e:  # filelock.Timeout is an OSError (TimeoutError) too
        reason = f"the lock {p}.lock was held too long" if isinstance(e, TimeoutError) else e
        say(f"progress: {name} ({report.status}) was not recorded in {p}: {reason}")
        return False
    return True


def progress(out: Callable = print, p: Path | None = None) -> dict[str, str]:
    """Print every exercise's latest outcome, chapter by chapter; return {grader: status}.

    The record is the learner's own (a JSON file anyone can edit), not a certificate."""
    data = load(p, say=out)
    status = {n: data.get(n, {}).get("status", "not attempted") for n in GRADERS}
    counts = {s: list(status.values()).count(s) for s in STATUSES}
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
