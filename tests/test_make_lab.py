"""`make lab`: once JupyterLab answers, the last line printed is the URL to open, token included,
and that token is the server's (the URL without it is refused)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("make") is None, reason="needs make"),
    pytest.mark.skipif(
        not (Path(sys.prefix) / "bin" / "jupyter").exists(), reason="needs jupyter in this env"
    ),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lines_until_ready(proc, deadline: float) -> list[str]:
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if lines[-1].startswith("http://") and "token=" in lines[-1]:
            return lines  # the server logs to stderr; make's own lines come on stdout
    pytest.fail("make lab printed no URL with a token:\n" + "\n".join(lines[-20:]))


def _status(url: str) -> int:
    try:
        return urllib.request.urlopen(url, timeout=5).status
    except urllib.error.HTTPError as e:
        return e.code


def test_make_lab_prints_the_tokened_url_last():
    port = _free_port()
    cmd = ["make", "--no-print-directory", "-o", "install", "lab", f"VENV={sys.prefix}"]
    proc = subprocess.Popen(
        [*cmd, f"PORT={port}"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # the server's log
        text=True,
        start_new_session=True,
    )
    try:
        lines = _lines_until_ready(proc, time.monotonic() + 120)
        url = lines[-1]
        assert url.startswith(f"http://127.0.0.1:{port}/lab/tree/notebooks/00_")
        token = url.split("token=", 1)[1]
        assert len(token) >= 32
        assert lines[-2].startswith("==> JupyterLab is ready")
        api = f"http://127.0.0.1:{port}/api/status"
        assert _status(f"{api}?token={token}") == 200
        assert _status(api) == 403  # the token is required, and it is this one
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
