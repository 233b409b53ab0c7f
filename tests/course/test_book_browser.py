"""The static course on a phone and in dark mode: pages at 390 px wide never scroll sideways, the
landing page renders its maths, widget fonts load, the theme mode is valid, and an unchecked widget
checkbox reads as unchecked in dark mode.

Three layers. The builder's output is checked without a browser (the landing page's maths is TeX,
the theme mode and the widget-path script are configured). The book's stylesheet is checked in
Chromium on a fixture page that reproduces what overflowed a phone: Sphinx's unbreakable inline
code and a row of widget controls. The built site, when `make book` has made one in _build/html,
is checked page by page in Chromium, light and dark.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import threading
from pathlib import Path

import pytest

from flashedu.course import book, manifest

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "_build" / "html"
PHONE = {"width": 390, "height": 844}
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync"]

# ---------------------------------------------------------------------- the builder's output


def test_landing_page_maths_is_tex_for_mathjax():
    info, chapters = manifest.load(ROOT)
    text = book.intro(info, chapters)
    outside_math = re.sub(r"\$[^$]+\$", "", text)
    assert "^" not in outside_math, "write maths in book.toml as $...$, e.g. $QK^\\top$"
    assert "$S = QK^\\top$" in text and "$O(N^2)$" in text


def test_theme_mode_defaults_to_auto_not_empty():
    info, _ = manifest.load(ROOT)
    sphinx = book.config(info, execute=False, vendored=True)["sphinx"]["config"]
    assert sphinx["html_context"]["default_mode"] == "auto"


def test_widget_script_maps_the_manager_modules_to_the_vendored_files():
    script = (book.STATIC / "flashedu-widgets.js").read_text()
    assert '"@jupyter-widgets": widgets' in script
    assert '"@jupyter-widgets/html-manager/dist": widgets' in script
    assert book.WIDGETS_JS.index("flashedu-widgets.js") == 1  # after RequireJS, before the manager


# ---------------------------------------------------------------------- in Chromium


def _chromium() -> str:
    path = shutil.which("chromium") or (
        "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None
    )
    if path is None:
        pytest.skip("chromium is not installed: apt-get install chromium (or make browser)")
    return path


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=_chromium(), headless=True, args=FLAGS)
        yield b
        b.close()


def _serve(directory: Path):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


FIXTURE = """<!doctype html>
<html data-theme="{theme}"><head><meta name="viewport" content="width=device-width">
<style>
  body {{ margin: 0 16px; font: 16px sans-serif; }}
  span.pre {{ white-space: nowrap; }}  /* Sphinx's basic.css */
  .widget-hbox {{ display: flex; flex-direction: row; }}  /* ipywidgets' boxes */
  .widget-vbox {{ display: flex; flex-direction: column; overflow: auto; }}
  .control {{ width: 300px; flex: none; height: 28px; }}
</style>
<link rel="stylesheet" href="flashedu.css"></head>
<body><article class="bd-article"><section>
<p>Call <code class="docutils literal notranslate"><span class="pre">{code}</span></code>.</p>
<div class="cell_output"><div class="jupyter-widgets widget-box widget-vbox">
  <div class="jupyter-widgets widget-box widget-hbox">
    <div class="jupyter-widgets widget-box widget-vbox"><div class="control" id="left"></div></div>
    <div class="jupyter-widgets widget-box widget-vbox"><div class="control" id="right"></div>
      <label><input type="checkbox" id="causal"> causal</label></div>
  </div></div></div>
</section></article></body></html>
"""


@pytest.mark.browser
@pytest.mark.parametrize("theme", ["light", "dark"])
def test_the_stylesheet_keeps_a_phone_page_from_scrolling_sideways(browser, tmp_path, theme):
    shutil.copy(book.STATIC / "flashedu.css", tmp_path / "flashedu.css")
    code = 'viz.explorer_state(N=4096,&nbsp;d=64,&nbsp;algorithm="fa2")["roofline"].intensity'
    (tmp_path / "page.html").write_text(FIXTURE.format(theme=theme, code=code))
    server, base = _serve(tmp_path)
    try:
        page = browser.new_page(viewport=PHONE)
        page.goto(f"{base}/page.html")
        assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
        for control in ("#left", "#right"):  # each widget control is shown whole, not cut off
            right = page.evaluate(
                f"document.querySelector('{control}').getBoundingClientRect().right"
            )
            assert right <= PHONE["width"], f"{control} ends at {right} px"
        scheme = page.evaluate("getComputedStyle(document.querySelector('#causal')).colorScheme")
        assert scheme == ("light" if theme == "dark" else "normal")
        page.close()
    finally:
        server.shutdown()


def _pages() -> list[str]:
    return ["intro.html"] + sorted(
        f"notebooks/{p.name}" for p in (SITE / "notebooks").glob("*.html")
    )


@pytest.fixture(scope="module")
def site():
    if not (SITE / "intro.html").exists():
        pytest.skip(
            "no built book in _build/html: run `make book` (BOOK_ARGS=--no-execute is fast)"
        )
    server, base = _serve(SITE)
    yield base
    server.shutdown()


SETTLED = """async () => {
  if (window.MathJax && MathJax.startup) { await MathJax.startup.promise; }
  await document.fonts.ready;
}"""


def _settle(page) -> None:
    """Wait for the page, its maths and its fonts, then give the widget manager a moment."""
    page.wait_for_load_state("load")
    page.evaluate(SETTLED)
    page.wait_for_timeout(1500)


@pytest.mark.browser
@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_every_built_page_fits_a_phone_and_loads_cleanly(browser, site, scheme):
    context = browser.new_context(viewport=PHONE, color_scheme=scheme)
    problems = []
    for path in _pages():
        page = context.new_page()
        missing, errors = [], []
        page.on("response", lambda r: missing.append(r.url) if r.status >= 400 else None)
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.goto(f"{site}/{path}")
        _settle(page)
        width = page.evaluate("document.documentElement.scrollWidth")
        if width > PHONE["width"]:
            problems.append(f"{path}: {width} px wide at {PHONE['width']} px")
        missing = [u for u in missing if not u.endswith("/favicon.ico")]  # the host's, not ours
        problems += [f"{path}: 404 {u}" for u in missing]
        problems += [f"{path}: {e}" for e in errors if "theme mode" in e]
        for box in page.locator(".jupyter-widgets input[type=checkbox]").all():
            if scheme == "dark" and box.evaluate("e => getComputedStyle(e).colorScheme") != "light":
                problems.append(f"{path}: a widget checkbox is drawn in the dark native style")
        page.close()
    context.close()
    assert problems == [], "\n".join(problems)


@pytest.mark.browser
def test_built_landing_page_renders_its_maths(browser, site):
    page = browser.new_page(viewport=PHONE)
    page.goto(f"{site}/intro.html")
    page.wait_for_function("document.querySelectorAll('article mjx-container').length > 0")
    text = page.locator("article").inner_text()
    assert "^" not in text and "QK^T" not in text
    page.close()
