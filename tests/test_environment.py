"""The environment files (requirements*.txt, constraints.txt, environment*.yml, pyproject.toml) say
one consistent thing, and CI resolves every one of them (`.ci/resolve-pins`).

The resolver itself needs the package index, so it runs in CI (`make pins`), not here; these tests
hold the files to each other and to the check that covers them."""

import importlib.machinery
import importlib.util
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What may differ between the CPU files: pip takes PyPI's torch 2.13.0 in environment.yml, whose
# Linux build requires triton 3.7.1 (and triton 3.7 runs with numpy 2.4).
TORCH_COMPANIONS = {"triton", "numpy"}


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
    loader.exec_module(module)
    return module


def test_environment_yml_pins_equal_requirements_but_for_torchs_companions():
    req, env = _file_pins("requirements.txt"), _file_pins("environment.yml")
    assert set(env) == set(req)
    assert {n for n in req if req[n] != env[n]} <= TORCH_COMPANIONS
    assert env["torch"] == req["torch"] == "2.13.0" and env["triton"] == "3.7.1"
    env_text = (ROOT / "environment.yml").read_text()
    assert "- -e ." in env_text and re.search(r"python=3\.11", env_text)


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


def test_the_resolver_check_covers_every_environment_file():
    files = {p.name for p in ROOT.glob("requirements*.txt")} | {
        p.name for p in ROOT.glob("environment*.yml")
    }
    table = _resolve_pins().checks(ROOT)
    assert set(table) == files
    assert {python for python, _, _ in table["requirements-gpu.txt"]} == {"3.11", "3.12"}
    assert table["environment-gpu.yml"][0][0] == "3.12" and table["environment.yml"][0][0] == "3.11"
    assert "-e" not in table["environment.yml"][0][1]  # the package itself is not on the index


def test_ci_runs_the_readme_test_command_then_the_resolver():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make test" in ci and "make test" in readme
    assert ci.index("make test") < ci.index("make pins")
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^pins:.*\n\t.*\.ci/resolve-pins", makefile, re.M)
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
