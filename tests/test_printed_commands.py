"""Every shell command the course prints runs as printed.

The commands are read where a learner reads them: the README (inline code and fenced blocks), the
notebooks' markdown, and the text the notebooks' code cells printed (their stored outputs). A
`python -m X ...` must name a module that exists; where X parses its arguments with argparse,
`python -m X --help` must exit 0 and list every option and subcommand the printed command uses,
and a file it reads must exist. A `make T ...` must name a target of the Makefile.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_PY = re.compile(r"(?:\S+=\S+\s+)*python3?\s+-m\s+([A-Za-z_][\w.]*)((?:[ \t]+[^\s;`'\"|]+)*)")
_MAKE = re.compile(r"^make\s+([A-Za-z][\w-]*)((?:\s+\S+)*)$")


def _code_spans(text: str) -> list[str]:
    """Inline `code` and the lines of fenced blocks, comments cut."""
    spans = re.findall(r"(?<!`)`([^`\n]+)`(?!`)", re.sub(r"```.*?```", "", text, flags=re.S))
    for block in re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S):
        spans += [line.split("  #")[0].strip() for line in block.splitlines()]
    return [s.strip() for s in spans if s.strip()]


def _sources() -> dict[str, list[str]]:
    """Where each text a learner reads comes from -> its code spans, or (outputs) its lines."""
    found = {"README.md": _code_spans((ROOT / "README.md").read_text())}
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        spans = []
        for cell in cells:
            if cell["cell_type"] == "markdown":
                spans += _code_spans("".join(cell["source"]))
            for out in cell.get("outputs", []):
                text = out.get("text") or out.get("data", {}).get("text/plain") or ""
                lines = "".join(text).splitlines()
                spans += [m.group(0) for line in lines for m in _PY.finditer(line)]
        found[nb.name] = spans
    return found


def _commands() -> list[tuple[str, str]]:
    """(where, command) for every `python -m` and `make` command printed."""
    cmds = set()
    for where, spans in _sources().items():
        for span in spans:
            for m in _PY.finditer(span):
                cmds.add((where, m.group(0).strip()))
            if _MAKE.match(span):
                cmds.add((where, span))
    return sorted(cmds)


COMMANDS = _commands()


@functools.cache
def _help(module: str) -> str | None:
    """`python -m module --help`'s output when the module uses argparse, else None."""
    spec = importlib.util.find_spec(module)
    origin = spec.origin
    if spec.submodule_search_locations:  # a package runs its __main__
        origin = str(Path(spec.submodule_search_locations[0]) / "__main__.py")
    if "argparse" not in Path(origin).read_text():
        return None
    run = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, f"python -m {module} --help exited {run.returncode}: {run.stderr}"
    return run.stdout


def _targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w-]*)\s*:(?!=)", text, flags=re.M))


def test_the_course_prints_commands_to_check():
    modules = {c.split(" -m ")[1].split()[0] for _, c in COMMANDS if " -m " in c}
    assert "flashedu.bench.gpu_check" in modules and "flashedu.checks" in modules, COMMANDS
    assert any(c.startswith("make lab") for _, c in COMMANDS), COMMANDS


# The README's manual install (its "Installing" section): the standard library's venv and pip.
_INSTALLERS = {"venv", "pip"}


def _installer_runs(where: str, command: str, module: str, words: list[str]) -> None:
    """`python -m venv DIR` and `python -m pip install ...`: the files they read are the project's
    own (-r/-c files, the `.` of an editable install) and every option is pip's."""
    if module == "venv":
        assert len(words) == 1 and not words[0].startswith("-"), f"{where}: `{command}`"
        return
    assert words[:1] == ["install"], f"{where}: `{command}`: the course only prints pip install"
    known = {"-r", "-c", "-e", "--no-deps", "--index-url", "--extra-index-url", "--upgrade"}
    for before, word in zip([""] + words, words):
        if word.startswith("-"):
            assert word.split("=")[0] in known, f"{where}: `{command}`: pip option {word}?"
        elif before in ("-r", "-c", "-e"):
            assert (ROOT / word).exists(), f"{where}: `{command}`: no file {word}"


@pytest.mark.parametrize("where,command", COMMANDS, ids=[f"{w}: {c}" for w, c in COMMANDS])
def test_a_printed_command_runs_as_printed(where, command):
    if command.startswith("make"):
        target = _MAKE.match(command).group(1)
        assert target in _targets(), f"{where}: `{command}`: the Makefile has no target {target!r}"
        return
    module, *args = _PY.search(command).group(1, 2)
    if module in _INSTALLERS:
        _installer_runs(where, command, module, args[0].split())
        return
    assert module.startswith("flashedu"), f"{where}: `{command}` runs a module outside the course"
    assert importlib.util.find_spec(module) is not None, f"{where}: `{command}`: no module {module}"
    text = _help(module)
    if text is None:
        return
    words = args[0].split()
    for before, word in zip([""] + words, words):
        if "/" in word and not before.startswith("--out"):  # an input file: it must be there
            assert (ROOT / word).exists(), f"{where}: `{command}`: no file {word}"
        elif word.startswith("-"):
            flag = word.split("=")[0]
            assert flag in text, f"{where}: `{command}`: {module} has no option {flag}"
        elif re.fullmatch(r"[a-z][a-z_-]*", word):  # a subcommand
            assert word in text, f"{where}: `{command}`: {module} has no subcommand {word!r}"
