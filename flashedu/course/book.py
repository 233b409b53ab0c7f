"""The static course: `make book` builds _build/html from book.toml with Jupyter Book 1
(Sphinx + MyST-NB).

    python -m flashedu.course book               # execute every chapter afresh, then render
    python -m flashedu.course book --no-execute  # render the outputs stored in the notebooks (fast)
    python -m flashedu.course book --all         # rebuild every page, not only those whose
                                                 # notebook changed

Not taught in a notebook: this is the course's build tool. It writes no HTML itself. From book.toml
it generates the renderer's `_config.yml`, its table of contents `_toc.yml` (chapters in manifest
order) and a landing page into `_build/src/`, copies the notebooks beside them, and runs
`jupyter-book build`.

Executing is the default, so the site shows what today's code prints. `--no-execute` is safe too:
`make test` runs every notebook under nbval, which fails when a stored output differs from a fresh
run (PNG plots are not compared there, so execute before publishing).

MathJax 3 and the ipywidgets embed bundle are fetched with `npm pack` from the npm registry at the
pinned versions below, checked against their sha512 integrity, and served from the site itself: a
built page needs no CDN. Honest limits: widgets are snapshots of the state saved at execution
(controls render, but moving one recomputes nothing, as there is no kernel); a widget module other
than ipywidgets' own would still load from a CDN (the course uses none); without npm the pages fall
back to CDNs, and the build says so.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from .._env import ROOT
from . import manifest

# npm package -> (version, sha512 integrity,
# {path prefix in the tarball: destination under _assets/}). Only what a page loads: MathJax's
# TeX+MathML/CHTML bundle and what it fetches on demand (TeX extensions, fonts, menu,
# accessibility), and the AMD build of the ipywidgets embed manager with the fonts it uses.
_MJ = "package/es5/"
VENDOR = {
    "mathjax": (
        "3.2.2",
        "sha512-Bt+SSVU8eBG27zChVewOicYs7Xsdt40qm4+UpHyX7k0/O9NliPc+x77k1/FEsPsjKPZGJvtRZM1vO+geW0OhGw==",
        {
            "package/LICENSE": "mathjax/LICENSE",
            **{
                _MJ + p: "mathjax/" + p
                for p in (
                    "tex-mml-chtml.js",
                    "input/",
                    "output/chtml",
                    "ui/",
                    "a11y/",
                    "sre/",
                    "adaptors/",
                )
            },
        },
    ),
    "@jupyter-widgets/html-manager": (
        "1.0.15",
        "sha512-5thBIV6ymNgmPVOHvzx+gGy8ZSKmSazhtGw4/c4xJDVzRhG9PTeQsRjF3FUTopvFi//SABeNz1yp47bCrJ3CQA==",
        {"package/LICENSE": "widgets/LICENSE", "package/dist/": "widgets/"},
    ),
    "requirejs": (
        "2.3.8",
        "sha512-7/cTSLOdYkNBNJcDMWf+luFvMriVm7eYxp4BcFCsAX0wF421Vyce5SXP17c+Jd5otXKGNehIonFlyQXSowL6Mw==",
        {
            "package/require.js": "widgets/require.js",
            "package/README.md": "widgets/requirejs-README.md",
        },
    ),
}
SKIP_SUFFIXES = (
    ".map",
    ".ts",
    "/embed.js",
    "/libembed-amd.js",
)  # maps, typings, the non-AMD and library builds
MATHJAX = "mathjax/tex-mml-chtml.js"  # relative to the site's _static/
# flashedu-widgets.js (book/_static) tells RequireJS where the widget manager's files are, so the
# fonts its CSS asks for come from _static/widgets/ rather than a 404 beside each page.
WIDGETS_JS = ("widgets/require.js", "flashedu-widgets.js", "widgets/embed-amd.js")
NBVAL_LINE = re.compile(r"\s*#\s*NBVAL_[A-Z_]+\s*$")
STATIC = ROOT / "book" / "_static"


def chapter_label(index: int, chapter: manifest.Chapter) -> str:
    """'03 · The tiled forward pass': the number of the notebook's file name (else the manifest
    position)."""
    prefix = Path(chapter.notebook).name[:2]
    return f"{prefix if prefix.isdigit() else f'{index:02d}'} · {chapter.title}"


def toc(chapters: list[manifest.Chapter]) -> dict:
    """sphinx-external-toc's jb-book format: the landing page, then every chapter in manifest
    order."""
    return {
        "format": "jb-book",
        "root": "intro",
        "chapters": [
            {"file": Path(c.notebook).with_suffix("").as_posix(), "title": chapter_label(i, c)}
            for i, c in enumerate(chapters)
        ],
    }


def config(book: dict, *, execute: bool, vendored: bool) -> dict:
    """Jupyter Book's _config.yml: execution, MyST math, the theme without launch buttons, local
    assets."""
    sphinx = {
        "html_static_path": ["_assets"],
        "html_css_files": ["flashedu.css"],
        "html_show_sourcelink": False,
        "nb_execution_raise_on_error": True,
        "nb_merge_streams": True,
        "html_theme_options": {
            "use_download_button": True,
            "show_toc_level": 2,
            "navigation_with_keys": False,
            "use_fullscreen_button": False,
            "navbar_persistent": [],  # no second search box on top
        },
        # light or dark as the reader's system says; the theme's default, "", is an invalid mode
        "html_context": {"default_mode": "auto"},
    }
    if vendored:
        sphinx["mathjax_path"] = MATHJAX
        sphinx["nb_ipywidgets_js"] = {path: {} for path in WIDGETS_JS}
    return {
        "title": book.get("title", "flashedu"),
        "author": book.get("author", ""),
        "copyright": "",
        "only_build_toc_files": True,
        "exclude_patterns": ["_build", "**.ipynb_checkpoints", "_assets"],
        "execute": {
            "execute_notebooks": "force" if execute else "off",
            "timeout": 600,
            "allow_errors": False,
            "run_in_temp": False,
            "stderr_output": "show",
        },
        "parse": {
            "myst_enable_extensions": [
                "amsmath",
                "dollarmath",
                "colon_fence",
                "deflist",
                "substitution",
            ]
        },
        "html": {
            "home_page_in_navbar": True,
            "use_repository_button": False,
            "use_issues_button": False,
            "use_edit_page_button": False,
        },
        "launch_buttons": {
            "binderhub_url": "",
            "jupyterhub_url": "",
            "thebe": False,
            "colab_url": "",
        },
        "repository": {"url": "", "path_to_book": "", "branch": "main"},
        "sphinx": {"config": sphinx},
    }


def intro(book: dict, chapters: list[manifest.Chapter]) -> str:
    """The landing page (MyST Markdown): what the course is, how to run it, every chapter with its
    objectives."""
    total = sum(c.minutes for c in chapters)
    lines = [
        f"# {book.get('title', 'flashedu')}",
        "",
        book.get("description", ""),
        "",
        f"{len(chapters)} chapters, about {total // 60} h {total % 60:02d} min in all. Each "
        "chapter is a notebook backed by a tested module of the `flashedu` package; the notebooks "
        "import it and never copy it. To run them yourself: `make lab` in the repository, then "
        "open the URL it prints last (it carries the server's token).",
        "",
        "## Chapters",
        "",
    ]
    for i, c in enumerate(chapters):
        lines += [
            f"**[{chapter_label(i, c)}]({c.notebook})** · {c.minutes} minutes",
            "",
            *[f"- {o}" for o in c.objectives],
            f"- *Package:* {', '.join(f'`{m}`' for m in c.modules)}",
            "",
        ]
    return "\n".join(lines)


def stage(root: Path, src: Path, *, execute: bool, vendored: bool) -> list[Path]:
    """Write config, toc and landing page into `src` and copy the notebooks/ tree there; returns the
    notebooks."""
    import yaml

    book, chapters = manifest.load(root)
    missing = [c.notebook for c in chapters if not (root / c.notebook).exists()]
    if missing:
        raise FileNotFoundError(
            f"book.toml lists notebooks that do not exist: {', '.join(missing)}"
        )
    src.mkdir(parents=True, exist_ok=True)
    _write(
        src / "_config.yml",
        yaml.safe_dump(config(book, execute=execute, vendored=vendored), sort_keys=False),
    )
    _write(src / "_toc.yml", yaml.safe_dump(toc(chapters), sort_keys=False, allow_unicode=True))
    _write(src / "intro.md", intro(book, chapters))
    _sync_tree(root / "notebooks", src / "notebooks", strip_test_markers)
    _sync_tree(STATIC, src / "_assets")
    return [src / c.notebook for c in chapters]


def _write(path: Path, text: str) -> None:
    """Write only on change, so Sphinx's incremental build sees untouched pages as unchanged."""
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def _sync_tree(source: Path, dest: Path, transform=None) -> None:
    """Copy `source` into `dest` (skipping dot-folders), rewriting only files whose content changed.
    `transform(path, data) -> data` may edit a file on the way."""
    for f in source.rglob("*"):
        rel = f.relative_to(source)
        if f.is_dir() or any(p.startswith(".") for p in rel.parts):
            continue
        data = transform(f, f.read_bytes()) if transform else f.read_bytes()
        target = dest / rel
        if not target.exists() or target.read_bytes() != data:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)


def strip_test_markers(path: Path, data: bytes) -> bytes:
    """Drop nbval's `# NBVAL_...` comment lines from a notebook's code cells: test machinery, not
    course text."""
    if path.suffix != ".ipynb" or b"NBVAL_" not in data:
        return data
    nb = json.loads(data)
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            lines = manifest.cell_source(cell).splitlines(keepends=True)
            cell["source"] = "".join(l for l in lines if not NBVAL_LINE.match(l)).rstrip("\n")
    return (json.dumps(nb, indent=1, ensure_ascii=False) + "\n").encode()


def integrity(data: bytes) -> str:
    """npm's integrity string for a tarball: 'sha512-' + base64 of its SHA-512."""
    return "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()


def vendor(assets: Path, cache: Path) -> bool:
    """Fetch MathJax, the widget embed bundle and RequireJS with `npm pack` into `assets`; False
    without npm."""
    npm = shutil.which("npm")
    stamp = assets / "vendor.json"
    wanted = json.dumps({name: pin[0] for name, pin in VENDOR.items()}, sort_keys=True)
    if stamp.exists() and stamp.read_text() == wanted:
        return True
    if npm is None:
        print(
            "==> warning: npm not found; pages will load MathJax and the widget bundle from public "
            "CDNs"
        )
        return False
    cache.mkdir(parents=True, exist_ok=True)
    for name, (version, sha, mapping) in VENDOR.items():
        print(f"==> fetching {name}@{version} from the npm registry")
        out = subprocess.run(
            [npm, "pack", f"{name}@{version}", "--json", "--pack-destination", str(cache)],
            check=True,
            capture_output=True,
            text=True,
        )
        tarball = cache / json.loads(out.stdout)[0]["filename"]
        data = tarball.read_bytes()
        if integrity(data) != sha:
            raise RuntimeError(
                f"{tarball.name}: integrity {integrity(data)} differs from the pinned {sha}"
            )
        _extract(tarball, mapping, assets)
    stamp.write_text(wanted)
    return True


def _extract(tarball: Path, mapping: dict[str, str], assets: Path) -> None:
    """Unpack the members of `tarball` named by `mapping` (prefix -> destination under `assets`)."""
    with tarfile.open(tarball) as tar:
        for member in tar.getmembers():
            for prefix, dest in mapping.items():
                if (
                    not member.isfile()
                    or member.name.endswith(SKIP_SUFFIXES)
                    or not member.name.startswith(prefix)
                ):
                    continue
                target = assets / (dest + member.name[len(prefix) :])
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(member).read())


def external_assets(html_dir: Path) -> list[str]:
    """URLs of scripts, stylesheets and fonts that the built pages load from another host (ideally
    none)."""
    pattern = re.compile(r"<(?:script|link)\b[^>]*?\b(?:src|href)=\"(https?://[^\"]+)\"[^>]*>")
    found = set()
    for page in html_dir.rglob("*.html"):
        for m in pattern.finditer(page.read_text(errors="replace")):
            tag = m.group(0)
            if tag.startswith("<script") or "stylesheet" in tag or "preload" in tag:
                found.add(m.group(1))
    return sorted(found)


def build(root: Path, *, execute: bool = True, rebuild_all: bool = False) -> Path:
    """Stage the sources under root/_build/src, run `jupyter-book build`, return the site's
    directory."""
    out = root / "_build"
    src = out / "src"
    vendored = vendor(src / "_assets", out / "npm")
    notebooks = stage(root, src, execute=execute, vendored=vendored)
    print(
        f"==> building {len(notebooks)} chapters "
        f"({'executing each' if execute else 'stored outputs'}) "
        f"into {out / 'html'}"
    )
    jb = Path(sys.executable).with_name("jupyter-book")
    cmd = [
        str(jb if jb.exists() else "jupyter-book"),
        "build",
        str(src),
        "--path-output",
        str(root),
    ]
    subprocess.run(cmd + (["--all"] if rebuild_all else []), check=True)
    html = out / "html"
    _sync_tree(
        src / "_assets", html / "_static"
    )  # Sphinx skips static files when no page is out of date
    remote = external_assets(html)
    if remote:
        print("==> note: pages still load from other hosts:\n    " + "\n    ".join(remote))
    print(f"==> done: open {html / 'index.html'}")
    return html


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flashedu.course book", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--no-execute",
        action="store_true",
        help=(
            "render the notebooks' stored outputs instead of executing them (nbval keeps those "
            "current)"
        ),
    )
    parser.add_argument(
        "--all",
        action="store_true",
        help="rebuild (and re-execute) every chapter, not only those whose notebook changed; "
        "use it after changing the package",
    )
    parser.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    problems = manifest.check(args.root)
    if problems:
        print("\n".join(f"problem: {p}" for p in problems), file=sys.stderr)
        print("==> fix the course check first (python -m flashedu.course check)", file=sys.stderr)
        return 1
    try:
        build(args.root, execute=not args.no_execute, rebuild_all=args.all)
    except subprocess.CalledProcessError as e:
        print(
            f"==> build failed: {' '.join(map(str, e.cmd))} exited with {e.returncode}",
            file=sys.stderr,
        )
        return 1
    return 0
