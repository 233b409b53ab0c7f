"""The environment files (requirements*.txt, constraints.txt, environment*.yml, pyproject.toml) say
one consistent thing, CI resolves every one of them from the public index alone on every platform
the README promises (`.ci/resolve-pins`, `make pins`), and that check can fail.

Resolving every file takes minutes and runs in `make pins`; here the files are held to each other
and to the check's table, and one small resolve (which needs the package index) proves the check
rejects a pair that cannot install."""

import importlib.machinery
import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What may differ between the CPU and GPU files: torch, and the triton and numpy each torch needs.
TORCH_COMPANIONS = {"triton", "numpy"}
LINUX_ONLY = 'sys_platform == "linux"'


def _pins(lines) -> dict[str, str]:
    pins = {}
    for line in lines:
        m = re.match(r"^\s*(?:-\s+)?([A-Za-z0-9_.\-]+)==([^\s#]+)", line)
        if m:
            pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    return pins


def _file_pins(name: str) -> dict[str, str]:
    text = (ROOT / name).read_text()
    return _pins(
        text.split("- pip:", 1)[1].splitlines() if name.endswith(".yml") else text.splitlines()
    )


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[ ;]", req, maxsplit=1)[0].lower().replace("_", "-")


def _resolve_pins():
    loader = importlib.machinery.SourceFileLoader(
        "resolve_pins", str(ROOT / ".ci" / "resolve-pins")
    )
    spec = importlib.util.spec_from_loader("resolve_pins", loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules["resolve_pins"] = module  # dataclasses look their module up there
    loader.exec_module(module)
    return module


def test_one_cpu_pin_set_requirements_constraints_and_environment_yml_agree():
    req, env = _file_pins("requirements.txt"), _file_pins("environment.yml")
    assert env == req
    assert (req["torch"], req["triton"]) == ("2.13.0", "3.7.1")  # the public index's Linux pair
    assert req["numpy"].startswith("2.4.")  # triton 3.7's interpreter runs with numpy 2.4
    env_text = (ROOT / "environment.yml").read_text()
    assert "- -e ." in env_text and re.search(r"python=3\.11", env_text)


def test_triton_is_a_linux_only_requirement_everywhere_the_cpu_course_names_it():
    for name in ("requirements.txt", "constraints.txt", "environment.yml"):
        line = next(ln for ln in (ROOT / name).read_text().splitlines() if "triton==" in ln)
        assert LINUX_ONLY in line, f"{name}: {line!r} lacks the marker {LINUX_ONLY}"
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert all(LINUX_ONLY in r for r in extra["triton"])


def test_gpu_files_pin_the_measured_pair_and_agree():
    gpu, conda = _file_pins("requirements-gpu.txt"), _file_pins("environment-gpu.yml")
    assert gpu == conda
    assert (gpu["torch"], gpu["triton"]) == ("2.11.0", "3.6.0")  # GPU_NOTES.md's machine
    text = (ROOT / "environment-gpu.yml").read_text()
    assert "- -e ." in text and re.search(r"python=3\.12", text)
    cpu = _file_pins("requirements.txt")
    shared = set(gpu) - {"torch"} - TORCH_COMPANIONS
    assert {n: gpu[n] for n in shared} == {n: cpu[n] for n in shared}  # same course, same versions


def test_every_pyproject_dependency_is_pinned_everywhere():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {_name(r) for r in project["dependencies"]}
    extras = {k: {_name(r) for r in v} for k, v in project["optional-dependencies"].items()}
    for name in ("requirements.txt", "environment.yml"):
        missing = runtime.union(*extras.values()) - set(_file_pins(name))
        assert not missing, f"not pinned in {name}: {sorted(missing)}"
    for name in ("requirements-gpu.txt", "environment-gpu.yml"):
        missing = (runtime | extras["triton"] | extras["course"]) - set(_file_pins(name))
        assert not missing, f"not pinned in {name}: {sorted(missing)}"
    assert project["requires-python"] == ">=3.11"  # tomllib


def test_constraints_agree_with_requirements():
    req = _pins((ROOT / "requirements.txt").read_text().splitlines())
    con = _pins((ROOT / "constraints.txt").read_text().splitlines())
    for name, version in req.items():
        assert con.get(name) == version, (
            f"{name}: requirements.txt has {version}, constraints.txt {con.get(name)}"
        )
    assert req["ruff"] == con["ruff"]  # the linter make test runs is pinned like the rest


def test_the_resolver_check_covers_every_file_platform_and_python_the_readme_promises():
    files = {p.name for p in ROOT.glob("requirements*.txt")} | {
        p.name for p in ROOT.glob("environment*.yml")
    }
    rp = _resolve_pins()
    table = rp.checks(ROOT)
    assert {c.name for c in table} == files

    def where(name):
        return {(c.platform.name, c.python) for c in table if c.name == name}

    cpu = {
        (p, py)
        for p in ("Linux x86-64", "Linux aarch64", "macOS arm64", "Windows amd64")
        for py in ("3.11", "3.12")
    }
    assert where("requirements.txt") == cpu
    assert where("requirements-gpu.txt") == {("Linux x86-64", "3.11"), ("Linux x86-64", "3.12")}
    assert {p for p, _ in where("environment.yml")} == {p for p, _ in cpu}
    assert rp.PYTHONS == {"3.11": "3.11.0", "3.12": "3.12.0"}  # the oldest patch of each
    env_yml = next(c for c in table if c.name == "environment.yml")
    assert "-e" not in env_yml.args and "." not in env_yml.args  # the package is not on the index
    readme = (ROOT / "README.md").read_text()
    for promised in ("macOS", "Windows", "aarch64", "3.12"):
        assert promised in readme


def test_the_resolver_check_sets_the_machines_pip_configuration_aside(monkeypatch):
    monkeypatch.setenv("PIP_FIND_LINKS", "/somewhere/local")
    monkeypatch.setenv("UV_INDEX_URL", "file:///somewhere")
    env = _resolve_pins()._clean_env()
    assert not any(k.startswith(("PIP_", "UV_")) for k in env if k != "PIP_CONFIG_FILE")
    assert env["PIP_CONFIG_FILE"] == "/dev/null"


def test_the_resolver_check_fails_on_a_pair_that_cannot_install(tmp_path):
    """torch 2.13.0 from the public index requires triton 3.7.1: pinning 3.6.0 beside it must fail,
    naming the conflict (needs the package index, as `make install` does)."""
    bad = tmp_path / "requirements.txt"
    bad.write_text("torch==2.13.0\ntriton==3.6.0\n")
    proc = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "resolve-pins"), "--file", str(bad)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL" in proc.stdout and "0 passed, 1 failed" in proc.stdout
    assert "triton" in proc.stdout and "conflict" in proc.stdout


def test_ci_runs_the_readme_test_command_then_the_resolver():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make test" in ci and "make test" in readme
    assert ci.index("make test") < ci.index("make pins") < ci.index("make test-container")
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^pins:.*\n(\t.*\n)*\t.*\.ci/resolve-pins", makefile, re.M)
    assert re.search(r"^test:.*\n.*\n\t\$\(MAKE\).* lint test-unit", makefile, re.M)


def test_readme_names_the_gpu_environment_and_its_install_command():
    readme = (ROOT / "README.md").read_text()
    gpu = readme[readme.index("**On a GPU**") :].split("## ", 1)[0]
    assert "requirements-gpu.txt" in gpu and "environment-gpu.yml" in gpu
    assert "pip install -r requirements-gpu.txt -e ." in gpu
    assert "conda env create -f environment-gpu.yml" in gpu
    assert "python -m flashedu.bench.gpu_check" in gpu


def test_makefile_asks_the_package_for_the_notebooks():
    """book.toml has one reader, flashedu.course: the Makefile does not parse it."""
    makefile = (ROOT / "Makefile").read_text()
    assert "tomllib" not in makefile and "book.toml" not in makefile.split("NOTEBOOKS =", 1)[1][:80]
    assert "-m flashedu.course notebooks" in makefile


FAKE_PYTHON = """#!/bin/sh
# Answers make's Python check as a Python 3.10 would.
case "$2" in
  *python_version*) echo 3.10.12 ;;
  *sys.executable*) echo /usr/bin/python3.10 ;;
  *version_info*) exit 1 ;;
  *) exit 0 ;;
esac
"""


def _make(*args, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "--no-print-directory", *args], capture_output=True, text=True, cwd=cwd, timeout=60
    )


def test_make_names_the_python_it_found_and_the_one_it_needs_before_creating_anything(tmp_path):
    fake = tmp_path / "python3.10"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    venv = tmp_path / "venv"
    proc = _make("install", f"PYTHON={fake}", f"VENV={venv}")
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "Python 3.10.12" in out and "/usr/bin/python3.10" in out
    assert "needs Python 3.11 or 3.12" in out and "make PYTHON=" in out
    assert not venv.exists()
    proc = _make("install", f"PYTHON={tmp_path / 'nothing-here'}", f"VENV={venv}")
    assert proc.returncode != 0 and "no '" in proc.stdout and not venv.exists()


def test_make_install_shows_pips_progress():
    recipe = (ROOT / "Makefile").read_text().split("$(STAMP):", 1)[1].split("\n\n", 1)[0]
    assert "--quiet" not in recipe and "-q " not in recipe
    assert recipe.count("==> [") == 3  # each long step says what it is doing
