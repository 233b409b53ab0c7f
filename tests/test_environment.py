"""environment.yml, requirements.txt, constraints.txt and pyproject.toml describe one
environment."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _pins(lines) -> dict[str, str]:
    pins = {}
    for line in lines:
        m = re.match(r"^\s*(?:-\s+)?([A-Za-z0-9_.\-]+)==([^\s#]+)", line)
        if m:
            pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    return pins


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[ ;]", req, maxsplit=1)[0].lower().replace("_", "-")


def test_environment_yml_pins_equal_requirements():
    req = _pins((ROOT / "requirements.txt").read_text().splitlines())
    env_text = (ROOT / "environment.yml").read_text()
    env = _pins(env_text.split("- pip:", 1)[1].splitlines())
    assert env == req
    assert "- -e ." in env_text and re.search(r"python=3\.11", env_text)


def test_every_pyproject_dependency_is_pinned_everywhere():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {_name(r) for r in project["dependencies"]}
    for extra in project["optional-dependencies"].values():
        wanted |= {_name(r) for r in extra}
    req = _pins((ROOT / "requirements.txt").read_text().splitlines())
    assert wanted <= set(req), f"not pinned in requirements.txt: {sorted(wanted - set(req))}"


def test_constraints_agree_with_requirements():
    req = _pins((ROOT / "requirements.txt").read_text().splitlines())
    con = _pins((ROOT / "constraints.txt").read_text().splitlines())
    for name, version in req.items():
        assert con.get(name) == version, (
            f"{name}: requirements.txt has {version}, constraints.txt {con.get(name)}"
        )


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make test" in ci and "make test" in readme
