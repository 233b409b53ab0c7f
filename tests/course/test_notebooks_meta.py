"""House rules for every notebook in book.toml, read from the committed .ipynb files
(nbval runs them).

First cell states the chapter; first code cell imports flashedu and seeds; executed top to bottom in
one run with no stored errors; small; imports only flashedu and libraries; never copies package
code; exercise stubs stored as "not attempted yet"; no plot reprs, absolute paths or notes to self
in the outputs; timing cells kept out of nbval's comparison; widget views backed by saved widget
state (the book embeds it).
"""

import ast
import inspect
import pkgutil
import re
import sys
from functools import lru_cache
from pathlib import Path

import pytest

import flashedu
from flashedu import checks, course

ROOT = Path(__file__).resolve().parents[2]
MAX_BYTES = 1_048_576  # ~1 MB with outputs
LIBRARIES = {"flashedu", "numpy", "torch", "triton", "matplotlib", "ipywidgets", "IPython"}
COPY_WINDOW = 6  # this many consecutive statements equal to package code = a copy
TIMING = re.compile(r"%%?timeit|%%time\b|perf_counter|time\.time\(|timeit\.|do_bench")
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
NBVAL_TAGS = {"nbval-ignore-output", "nbval-skip"}

_, CHAPTERS = course.load()


@lru_cache(maxsize=None)
def _load(path: str) -> dict:
    return course.read_notebook(ROOT / path)


@pytest.fixture(params=CHAPTERS, ids=[c.id for c in CHAPTERS])
def chapter(request):
    if not (ROOT / request.param.notebook).exists():
        pytest.skip(
            f"{request.param.notebook} does not exist yet "
            "(tests/course/test_manifest.py reports it)"
        )
    return request.param


def _code_cells(nb):
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def _python(src: str) -> str:
    """Cell source without IPython magics and shell escapes, so `ast` can parse it."""
    return "\n".join(
        "" if line.lstrip().startswith(("%", "!")) else line for line in src.splitlines()
    )


def _texts(cell) -> list[str]:
    """Every text a cell's outputs carry: streams, plain-text results, errors."""
    out = []
    for o in cell.get("outputs", []):
        if o["output_type"] == "stream":
            out.append(course.cell_source({"source": o.get("text", "")}))
        elif o["output_type"] in ("execute_result", "display_data"):
            out.append(course.cell_source({"source": o.get("data", {}).get("text/plain", "")}))
        elif o["output_type"] == "error":
            out.append("\n".join(o.get("traceback", [])))
    return out


def test_first_cell_states_title_objectives_and_minutes(chapter):
    assert course.check_first_cell(ROOT / chapter.notebook, chapter.id, chapter) == []
    assert (
        f"Estimated time: {chapter.minutes} minutes"
        in course.first_cell_text(ROOT / chapter.notebook)[1]
    )


def test_first_code_cell_imports_flashedu_and_seeds_everything(chapter):
    src = course.cell_source(_code_cells(_load(chapter.notebook))[0])
    assert re.search(r"^\s*from flashedu import|^\s*import flashedu", src, re.M), (
        "import the course from flashedu"
    )
    assert re.search(r"rng = nb\.seed_everything\(0\)", src), (
        "seed with rng = nb.seed_everything(0)"
    )


def test_executed_top_to_bottom_in_one_run_without_errors(chapter):
    cells = [c for c in _code_cells(_load(chapter.notebook)) if course.cell_source(c).strip()]
    counts = [c.get("execution_count") for c in cells]
    assert None not in counts, (
        f"{counts.count(None)} code cells were never run: execute the whole notebook"
    )
    assert counts == list(range(1, len(cells) + 1)), (
        f"execution counts {counts}: run once, top to bottom"
    )
    errors = [
        o.get("ename") for c in cells for o in c.get("outputs", []) if o["output_type"] == "error"
    ]
    assert errors == [], f"stored errors: {errors}"
    assert not any("Traceback (most recent call last)" in t for c in cells for t in _texts(c))


def test_notebook_is_small(chapter):
    size = (ROOT / chapter.notebook).stat().st_size
    assert size <= MAX_BYTES, (
        f"{size:,} bytes with outputs; keep it under {MAX_BYTES:,} (fewer or smaller figures)"
    )


def _imports(tree) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add("." if node.level else node.module.split(".")[0])
    return names


def test_imports_come_from_flashedu_or_libraries(chapter):
    allowed = LIBRARIES | set(sys.stdlib_module_names)
    for cell in _code_cells(_load(chapter.notebook)):
        src = course.cell_source(cell)
        assert not re.search(r"sys\.path|%run|exec\(open|%load\b", src), (
            f"no path tricks or pasted files:\n{src}"
        )
        bad = _imports(ast.parse(_python(src))) - allowed
        assert not bad, f"imports {sorted(bad)}: take course code from flashedu\n{src}"


def _statements(fn_body) -> list[str]:
    """Statements of a function body, docstring dropped, unparsed to one normal form
    (comments gone)."""
    body = (
        fn_body[1:]
        if fn_body
        and isinstance(fn_body[0], ast.Expr)
        and isinstance(getattr(fn_body[0], "value", None), ast.Constant)
        and isinstance(fn_body[0].value.value, str)
        else fn_body
    )
    return [
        line.strip() for stmt in body for line in ast.unparse(stmt).splitlines() if line.strip()
    ]


@lru_cache(maxsize=1)
def _package_windows() -> dict[tuple[str, ...], str]:
    windows = {}
    for info in pkgutil.walk_packages(flashedu.__path__, "flashedu."):
        path = Path(flashedu.__file__).parent.joinpath(*info.name.split(".")[1:])
        path = path.with_suffix(".py") if path.with_suffix(".py").exists() else path / "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = _statements(node.body)
                for i in range(len(lines) - COPY_WINDOW + 1):
                    windows.setdefault(
                        tuple(lines[i : i + COPY_WINDOW]), f"{info.name}.{node.name}"
                    )
    return windows


def test_no_package_code_is_copied_into_the_notebook(chapter):
    windows = _package_windows()
    for cell in _code_cells(_load(chapter.notebook)):
        tree = ast.parse(_python(course.cell_source(cell)))
        lines = _statements(tree.body) + [
            l for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) for l in _statements(n.body)
        ]
        for i in range(len(lines) - COPY_WINDOW + 1):
            origin = windows.get(tuple(lines[i : i + COPY_WINDOW]))
            assert origin is None, (
                f"copies {origin}; show it with nb.show_source({origin}) instead:\n"
                + "\n".join(lines[i : i + COPY_WINDOW])
            )


def test_every_exercise_stub_is_stored_as_not_attempted(chapter):
    cells = _code_cells(_load(chapter.notebook))
    stubs = set().union(*(course.exercise_stubs(course.cell_source(c)) for c in cells))
    assert len(stubs) >= course.MIN_EXERCISES, f"found exercise stubs {sorted(stubs)}"
    for cell in cells:
        for name, arg in re.findall(r"\bchecks\.(\w+)\(\s*(\w+)", course.cell_source(cell)):
            if name in checks.GRADERS and arg in stubs:
                assert any(f"{name}: not attempted yet" in t for t in _texts(cell)), (
                    f"checks.{name}({arg}) should print '{name}: not attempted yet' "
                    "in the committed notebook"
                )


def test_outputs_hold_no_plot_reprs_paths_or_notes(chapter):
    nb = _load(chapter.notebook)
    for cell in nb["cells"]:
        src = course.cell_source(cell)
        assert not re.search(r"\b(TODO|FIXME|XXX)\b", src), f"note to self in a cell:\n{src}"
        for text in _texts(cell) if cell["cell_type"] == "code" else []:
            assert not re.match(r"\[?<matplotlib\.|Text\(", text), (
                f"end the plot cell with ';':\n{src}"
            )
            assert not re.search(r"(/work/|/tmp/|/root/|/home/)\S", text), (
                f"absolute path in an output:\n{text}"
            )


def test_timing_cells_are_kept_out_of_nbval(chapter):
    for cell in _code_cells(_load(chapter.notebook)):
        src = course.cell_source(cell)
        tags = set(cell.get("metadata", {}).get("tags", []))
        if TIMING.search(src) and cell.get("outputs"):
            assert "NBVAL_IGNORE_OUTPUT" in src or "NBVAL_SKIP" in src or tags & NBVAL_TAGS, (
                f"a timing cell needs the nbval-ignore-output tag:\n{src}"
            )


def test_widget_views_have_saved_state_to_embed(chapter):
    nb = _load(chapter.notebook)
    views = {
        o["data"][WIDGET_VIEW]["model_id"]
        for c in _code_cells(nb)
        for o in c.get("outputs", [])
        if WIDGET_VIEW in o.get("data", {})
    }
    saved = set(nb["metadata"].get("widgets", {}).get(WIDGET_STATE, {}).get("state", {}))
    assert views <= saved, (
        f"{len(views - saved)} widget views without saved state: execute with nbconvert"
    )


def test_kernel_is_the_course_python(chapter):
    assert _load(chapter.notebook)["metadata"].get("kernelspec", {}).get("name") == "python3"


def test_copy_detector_catches_a_pasted_package_function():
    source = inspect.getsource(flashedu.reference.probabilities)
    tree = ast.parse(source)
    lines = _statements(tree.body[0].body)
    assert any(
        tuple(lines[i : i + COPY_WINDOW]) in _package_windows()
        for i in range(len(lines) - COPY_WINDOW + 1)
    )
