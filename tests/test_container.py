"""The container route (Dockerfile, .devcontainer/devcontainer.json) holds together: what it
copies exists, what it runs are Makefile targets, and the port JupyterLab listens on is the one
published and forwarded."""

import json
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def _instructions(name: str) -> list[str]:
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE)  # join continued lines
    return [m.group(1).strip() for m in re.finditer(rf"^{name}\s+(.*)$", text, re.M)]


def _make_targets() -> set[str]:
    makefile = (ROOT / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([a-z][\w-]*):", makefile, re.M)}


def test_the_image_is_debian_12_with_python_311():
    assert _instructions("FROM") == ["${BASE}"]
    base = next(a.split("=", 1)[1] for a in _instructions("ARG") if a.startswith("BASE="))
    assert base.startswith("python:3.11-") and "bookworm" in base


def test_every_path_the_dockerfile_copies_exists():
    for args in _instructions("COPY"):
        *sources, _dest = shlex.split(args)
        for src in sources:
            assert (ROOT / src).exists(), f"COPY {src}: no such path in the repository"


def test_the_dockerfile_runs_the_readmes_make_targets():
    runs = " ".join(_instructions("RUN"))
    assert "make install" in runs
    cmd = json.loads(_instructions("CMD")[0])
    assert cmd[:2] == ["make", "lab"] and "HOST=0.0.0.0" in cmd
    targets = _make_targets()
    commands = [c.strip() for c in re.split(r"&&|;", " ".join(_instructions("RUN")))]
    for target in [c.split()[1] for c in commands if c.startswith("make ")] + [cmd[1]]:
        assert target in targets, f"make {target}: not a Makefile target"
    readme = (ROOT / "README.md").read_text()
    assert "docker build -t flashedu ." in readme and "-p 8888:8888" in readme


def test_the_lab_port_is_exposed_published_and_forwarded():
    cmd = json.loads(_instructions("CMD")[0])
    port = int(next(a.split("=", 1)[1] for a in cmd if a.startswith("PORT=")))
    assert _instructions("EXPOSE") == [str(port)]
    dev = json.loads((ROOT / ".devcontainer" / "devcontainer.json").read_text())
    assert port in dev["forwardPorts"]
    assert dev["build"]["dockerfile"] == "../Dockerfile"
    assert f"PORT={port}" in dev["postAttachCommand"] and "HOST=0.0.0.0" in dev["postAttachCommand"]


def test_the_environment_lives_outside_the_folder_a_devcontainer_mounts():
    env = dict(a.split("=", 1) for a in " ".join(_instructions("ENV")).split())
    dev = json.loads((ROOT / ".devcontainer" / "devcontainer.json").read_text())
    mounted = dev["workspaceFolder"]
    assert not env["VENV"].startswith(mounted + "/"), "the mount would hide the image's .venv"
    assert re.search(r"^VENV \?=", (ROOT / "Makefile").read_text(), re.M)  # make reads $VENV


def test_dockerignore_keeps_local_environments_out_of_the_image():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git"} <= set(ignored)
