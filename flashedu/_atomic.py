"""Files a learner keeps, written so that a crash or a second writer never leaves half a file.

`write_atomic(path, text)` writes to a unique temporary file in the target's folder, flushes it to
disk (fsync), then renames it over the target (`os.replace`, atomic within one file system): a
reader sees the old content or the new, never a mix, and a process killed before the rename
leaves the old file as it was. Used by the progress file (`flashedu/checks/_progress.py`, which
adds a cross-process lock for its read-modify-write) and by the benchmark's results
(`flashedu/bench/results.py`).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def temp_prefix(path: Path) -> str:
    """Temporary files for `path` are named .<name>.<random>.tmp in its folder."""
    return f".{Path(path).name}."


def _mode(path: Path) -> int:
    try:
        return path.stat().st_mode & 0o777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def write_atomic(path, text: str) -> Path:
    """Replace `path` with `text` atomically; on any failure `path` is left as it was and the
    temporary file removed. Returns the path."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=temp_prefix(path), suffix=".tmp")
    try:
        if hasattr(os, "fchmod"):  # mkstemp makes 0600: keep the old mode, or a new file's
            os.fchmod(fd, _mode(path))
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable where the OS allows it
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return path
