"""The static build's generation logic (flashedu/course/book.py): config, table of contents and
landing page come from book.toml; assets are pinned and checked. The full `make book` is not run
here (it executes every chapter); these tests build nothing with Sphinx."""

import io
import json
import re
import tarfile
from pathlib import Path

import pytest
import yaml

from flashedu import course
from flashedu.course import book

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def manifest():
    return course.load()


def test_toc_lists_every_chapter_in_manifest_order(manifest):
    _, chapters = manifest
    toc = book.toc(chapters)
    assert toc["format"] == "jb-book" and toc["root"] == "intro"
    assert [e["file"] + ".ipynb" for e in toc["chapters"]] == [c.notebook for c in chapters]
    assert [e["title"] for e in toc["chapters"]] == [
        f"{i:02d} · {c.title}" for i, c in enumerate(chapters)
    ]


def test_config_takes_title_and_author_from_the_manifest(manifest):
    info, _ = manifest
    cfg = book.config(info, execute=True, vendored=True)
    assert cfg["title"] == info["title"] and cfg["author"] == info["author"]
    assert cfg["only_build_toc_files"] is True
    assert (
        cfg["execute"]["execute_notebooks"] == "force" and cfg["execute"]["allow_errors"] is False
    )
    assert cfg["sphinx"]["config"]["nb_execution_raise_on_error"] is True
    assert {"dollarmath", "amsmath"} <= set(cfg["parse"]["myst_enable_extensions"])
    assert book.config(info, execute=False, vendored=True)["execute"]["execute_notebooks"] == "off"


def test_vendored_build_points_math_and_widgets_at_local_files(manifest):
    info, _ = manifest
    local = book.config(info, execute=True, vendored=True)["sphinx"]["config"]
    assert local["mathjax_path"] == "mathjax/tex-mml-chtml.js"
    assert list(local["nb_ipywidgets_js"]) == [
        "widgets/require.js",
        "flashedu-widgets.js",  # where the manager's fonts are, between RequireJS and the manager
        "widgets/embed-amd.js",
    ]
    assert not any("://" in p for p in [local["mathjax_path"], *local["nb_ipywidgets_js"]])
    cdn = book.config(info, execute=True, vendored=False)["sphinx"]["config"]
    assert (
        "mathjax_path" not in cdn and "nb_ipywidgets_js" not in cdn
    )  # the renderer's CDN defaults


def test_config_has_no_launch_buttons_or_repository_links(manifest):
    cfg = book.config(manifest[0], execute=True, vendored=True)
    assert not any(
        cfg["launch_buttons"][k] for k in ("binderhub_url", "jupyterhub_url", "thebe", "colab_url")
    )
    assert cfg["repository"]["url"] == "" and not cfg["html"]["use_repository_button"]


def test_landing_page_states_every_chapter_objective_and_time(manifest):
    info, chapters = manifest
    page = book.intro(info, chapters)
    assert page.startswith(f"# {info['title']}\n")
    total = sum(c.minutes for c in chapters)
    assert f"about {total // 60} h {total % 60:02d} min" in page
    for i, c in enumerate(chapters):
        assert f"[{i:02d} · {c.title}]({c.notebook})** · {c.minutes} minutes" in page
        for o in c.objectives:
            assert f"- {o}\n" in page


def _toy_root(tmp_path):
    (tmp_path / "notebooks" / "results").mkdir(parents=True)
    (tmp_path / "book.toml").write_text((ROOT / "tests" / "fixtures" / "toy_book.toml").read_text())
    nb = {"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    (tmp_path / "notebooks" / "00_memory_hierarchy.ipynb").write_text(json.dumps(nb))
    (tmp_path / "notebooks" / "results" / "run.json").write_text("{}")
    (tmp_path / "notebooks" / ".ipynb_checkpoints").mkdir()
    (tmp_path / "notebooks" / ".ipynb_checkpoints" / "x.ipynb").write_text("{}")
    return tmp_path


def test_stage_writes_sources_from_the_manifest_and_copies_the_notebooks(tmp_path):
    root = _toy_root(tmp_path)
    src = root / "_build" / "src"
    notebooks = book.stage(root, src, execute=False, vendored=False)
    assert notebooks == [src / "notebooks" / "00_memory_hierarchy.ipynb"] and notebooks[0].exists()
    info, chapters = course.load(root)
    assert yaml.safe_load((src / "_config.yml").read_text()) == book.config(
        info, execute=False, vendored=False
    )
    assert yaml.safe_load((src / "_toc.yml").read_text()) == book.toc(chapters)
    assert (src / "intro.md").read_text() == book.intro(info, chapters)
    assert (src / "notebooks" / "results" / "run.json").exists()  # data the notebooks read
    assert not (src / "notebooks" / ".ipynb_checkpoints").exists()  # editor leftovers stay out
    assert (src / "_assets" / "flashedu.css").exists()
    stamps = {p: p.stat().st_mtime_ns for p in src.rglob("*") if p.is_file()}
    book.stage(root, src, execute=False, vendored=False)  # unchanged input: nothing rewritten
    assert stamps == {p: p.stat().st_mtime_ns for p in src.rglob("*") if p.is_file()}


def test_stage_refuses_a_manifest_whose_notebooks_are_missing(tmp_path):
    root = _toy_root(tmp_path)
    (root / "notebooks" / "00_memory_hierarchy.ipynb").unlink()
    with pytest.raises(FileNotFoundError, match="notebooks/00_memory_hierarchy.ipynb"):
        book.stage(root, root / "_build" / "src", execute=False, vendored=False)


def test_main_refuses_to_build_an_inconsistent_course(tmp_path, capsys):
    root = _toy_root(tmp_path)
    assert book.main(["--root", str(root), "--no-execute"]) == 1
    assert "fix the course check first" in capsys.readouterr().err
    assert not (root / "_build").exists()


def test_vendor_pins_are_exact_and_integrity_checked():
    for name, (version, sha, mapping) in book.VENDOR.items():
        assert re.fullmatch(r"\d+\.\d+\.\d+", version), name
        assert re.fullmatch(r"sha512-[A-Za-z0-9+/]{86}==", sha), name
        assert mapping and all(k.startswith("package/") for k in mapping), name
    assert book.integrity(b"") == (
        "sha512-z4PhNX7vuL3xVChQ1m2AB9Yg5AULVxXcg/SpIdNs6c5H0NE8XYXysP+DGNKHfuwvY7kxvUdBeoGl"
        "ODJ6+SfaPg=="
    )


def _tarball(path: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_extract_keeps_what_pages_load_and_drops_maps_and_other_builds(tmp_path):
    tgz = _tarball(
        tmp_path / "p.tgz",
        {
            "package/dist/embed-amd.js": b"a",
            "package/dist/embed-amd.js.map": b"m",
            "package/dist/embed.js": b"e",
            "package/dist/f00.woff2": b"w",
            "package/LICENSE": b"l",
            "package/src/index.ts": b"t",
        },
    )
    book._extract(
        tgz,
        {"package/dist/": "widgets/", "package/LICENSE": "widgets/LICENSE"},
        tmp_path / "assets",
    )
    got = sorted(
        p.relative_to(tmp_path / "assets").as_posix()
        for p in (tmp_path / "assets").rglob("*")
        if p.is_file()
    )
    assert got == ["widgets/LICENSE", "widgets/embed-amd.js", "widgets/f00.woff2"]


def test_vendor_without_npm_falls_back_to_cdns_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(book.shutil, "which", lambda name: None)
    assert book.vendor(tmp_path / "assets", tmp_path / "npm") is False
    assert "npm not found" in capsys.readouterr().out


def test_vendor_rejects_a_tarball_whose_integrity_differs(tmp_path, monkeypatch):
    monkeypatch.setattr(book.shutil, "which", lambda name: "/usr/bin/npm")

    def fake_pack(cmd, **kw):
        _tarball(tmp_path / "npm" / "x.tgz", {"package/LICENSE": b"tampered"})
        return type("Done", (), {"stdout": json.dumps([{"filename": "x.tgz"}])})()

    monkeypatch.setattr(book.subprocess, "run", fake_pack)
    with pytest.raises(RuntimeError, match="differs from the pinned"):
        book.vendor(tmp_path / "assets", tmp_path / "npm")
    assert not (tmp_path / "assets" / "vendor.json").exists()


def test_external_assets_finds_scripts_and_stylesheets_from_other_hosts(tmp_path):
    (tmp_path / "a.html").write_text(
        '<script src="../_static/x.js"></script><script src="https://cdn.example/m.js"></script>'
        '<link rel="stylesheet" href="https://cdn.example/s.css"><a href="https://paper.example/">paper</a>'
        '<link rel="canonical" href="https://site.example/a.html">'
    )
    assert book.external_assets(tmp_path) == [
        "https://cdn.example/m.js",
        "https://cdn.example/s.css",
    ]


def _pins(path: Path) -> dict[str, str]:
    lines = [l.split("#")[0].strip() for l in path.read_text().splitlines()]
    return {l.split("==")[0].lower().replace("_", "-"): l.split("==")[1] for l in lines if l}


def test_book_requirements_are_pinned_and_agree_with_the_course_pins():
    book_pins, course_pins = _pins(ROOT / "requirements-book.txt"), _pins(ROOT / "constraints.txt")
    assert book_pins["jupyter-book"].startswith("1."), (
        "Jupyter Book 2 needs a theme download: stay on 1.x"
    )
    assert all(re.fullmatch(r"[\w.+-]+", v) for v in book_pins.values())
    clashes = {
        k: (v, course_pins[k])
        for k, v in book_pins.items()
        if k in course_pins and course_pins[k] != v
    }
    assert clashes == {}


def test_make_book_installs_the_pinned_renderer_then_builds():
    text = (ROOT / "Makefile").read_text()
    assert re.search(r"^book: \$\(BOOK_STAMP\)\n\t\$\(PY\) -m flashedu.course book", text, re.M)
    assert "-r requirements-book.txt -c constraints.txt" in text


def test_chapter_numbers_come_from_the_notebook_names():
    c = course.Chapter(
        "08-benchmarks", "Benchmarks", "notebooks/08_benchmarks.ipynb", (), ("x",), 5
    )
    assert book.chapter_label(3, c) == "08 · Benchmarks"  # also in a manifest that lists a subset


def test_staged_notebooks_lose_nbval_markers_and_nothing_else():
    cells = [
        {
            "cell_type": "code",
            "metadata": {},
            "outputs": [],
            "execution_count": 1,
            "source": "# NBVAL_IGNORE_OUTPUT\nwidgets.explorer()  # NBVAL_ not a marker here",
        },
        {"cell_type": "markdown", "metadata": {}, "source": "# NBVAL_SKIP is explained here"},
    ]
    data = json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}).encode()
    out = json.loads(book.strip_test_markers(Path("x.ipynb"), data))
    assert out["cells"][0]["source"] == "widgets.explorer()  # NBVAL_ not a marker here"
    assert out["cells"][1] == cells[1]
    assert book.strip_test_markers(Path("x.json"), data) == data
