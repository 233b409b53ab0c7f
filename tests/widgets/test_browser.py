"""The one real-browser test: JupyterLab on 127.0.0.1, Debian's Chromium driven by Playwright.

It writes a small notebook that shows the traffic explorer, the tile stepper and the measured
explorer, serves it with JupyterLab (a token, a free port, a throwaway config), runs it, moves the N
slider with the keyboard on the real widget and checks that the HBM byte count on the page becomes
what `flashedu.traffic` computes; presses the stepper's step button and checks the bytes against
the ledger of `tiled.forward`; then checks that the measured replay of the Triton forward shows the
closed form's bytes and steps to its next program. Screenshots go to test-artifacts/.
A second test checks that `make lab` serves JupyterLab. Run with `make test-browser` (pytest -m
browser).

Chromium comes from the system (`make browser` installs Debian's package); Playwright never
downloads one. Without Chromium, or without Playwright, the tests skip with the reason when not
root, and fail when root (`make browser` should have installed it).
"""

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

import nbformat
import pytest

from flashedu import traffic

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
NOTEBOOK = [
    """\
from flashedu import widgets

explorer = widgets.traffic_explorer(N=1024, d=64, algorithm="naive")
explorer""",
    """\
stepper = widgets.tile_stepper(N_q=40, N_k=40, d=16, block_m=8, block_n=8, causal=True)
stepper""",
    """\
measured = widgets.measured_explorer("forward", N_q=64, N_k=64, d=32, block_m=16, block_n=16)
measured""",
]
MEASURED = dict(B=1, H=2, N_q=64, N_k=64, d=32, block_m=16, block_n=16)  # the third cell's run


def _chromium() -> str:
    path = shutil.which("chromium") or (
        "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None
    )
    if path is None:
        if os.geteuid() == 0:
            pytest.fail(
                "chromium is missing although we are root: run `make browser` (apt-get install "
                "chromium)"
            )
        pytest.skip(
            "chromium is not installed and we are not root to apt-get it: apt-get install chromium"
        )
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _isolated_env(home: Path) -> dict:
    """Jupyter config, data, runtime and workspace dirs in `home`: no user settings leak into the
    test, and JupyterLab does not offer to fetch news (a toast over the page, and a network
    request)."""
    env = dict(os.environ)
    for var, sub in [
        ("JUPYTER_CONFIG_DIR", "config"),
        ("JUPYTER_DATA_DIR", "data"),
        ("JUPYTER_RUNTIME_DIR", "run"),
        ("JUPYTERLAB_SETTINGS_DIR", "settings"),
        ("JUPYTERLAB_WORKSPACES_DIR", "workspaces"),
        ("IPYTHONDIR", "ipython"),
    ]:
        (home / sub).mkdir(parents=True, exist_ok=True)
        env[var] = str(home / sub)
    news = (
        home
        / "settings"
        / "@jupyterlab"
        / "apputils-extension"
        / "notification.jupyterlab-settings"
    )
    news.parent.mkdir(parents=True, exist_ok=True)
    news.write_text('{"fetchNews": "false"}')
    return env


def _wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 60) -> int:
    """Poll `url` until the server answers (any HTTP status); the status code."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(
                f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            )
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"no answer from {url} within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    """End the server we started (its whole process group: make, jupyter, kernels)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


@pytest.fixture
def lab(tmp_path):
    """JupyterLab serving a one-cell notebook from tmp_path: (base url, token)."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in NOTEBOOK])
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
    }
    nbformat.write(nb, tmp_path / "explorer.ipynb")
    port, token, log = _free_port(), os.urandom(16).hex(), tmp_path / "lab.log"
    cmd = [
        sys.executable,
        "-m",
        "jupyter",
        "lab",
        "--no-browser",
        "--ip=127.0.0.1",
        f"--port={port}",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={tmp_path}",
        "--LabApp.expose_app_in_browser=True",
    ] + (["--allow-root"] if os.geteuid() == 0 else [])
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_isolated_env(tmp_path / "home"),
            cwd=tmp_path,
            start_new_session=True,
        )
    try:
        base = f"http://127.0.0.1:{port}"
        assert _wait_http(f"{base}/api/status?token={token}", proc, log) == 200
        yield base, token
    finally:
        _stop(proc)


KERNEL_READY = """() => {
    const panel = window.jupyterapp.shell.currentWidget;
    const kernel = panel && panel.sessionContext && panel.sessionContext.session &&
        panel.sessionContext.session.kernel;
    return Boolean(kernel) && kernel.status === "idle" && kernel.connectionStatus === "connected";
}"""


def _bytes_shown(page) -> int:
    return int(page.locator(".fe-total").get_attribute("data-bytes"))


def test_moving_the_n_slider_updates_the_traffic_shown(lab, tmp_path):
    chromium = _chromium()
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (requirements.txt)"
    )
    base, token = lab
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"),
            executable_path=chromium,
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": 1280, "height": 1100},
        )
        try:
            page = context.new_page()
            page.goto(f"{base}/lab/tree/explorer.ipynb?token={token}")
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
            page.wait_for_function("() => Boolean(window.jupyterapp)", timeout=60_000)
            page.wait_for_function(
                KERNEL_READY, timeout=60_000
            )  # a cell run before this is dropped
            page.locator(".jp-Cell .jp-InputArea-editor").first.click()
            for _ in NOTEBOOK:  # run every cell: explorer, stepper, measured replay
                page.keyboard.press("Shift+Enter")
            total = page.locator(".fe-total")
            total.wait_for(timeout=60_000)
            assert _bytes_shown(page) == traffic.naive_forward(1, 1, 1024, 1024, 64).total_bytes
            figure = page.locator(".jp-OutputArea-output img").first
            src_before = figure.get_attribute("src")

            slider = page.locator(
                ".widget-slider", has=page.locator(".widget-label", has_text="N (tokens)")
            )
            slider.locator(".noUi-handle").focus()
            page.keyboard.press("ArrowRight")  # SelectionSlider: the next option, N = 2048

            expected = traffic.naive_forward(1, 1, 2048, 2048, 64).total_bytes
            page.wait_for_function(
                f"document.querySelector('.fe-total').dataset.bytes === '{expected}'",
                timeout=30_000,
            )
            assert total.inner_text() == f"{expected:,} bytes"
            assert figure.get_attribute("src") != src_before, "the traffic figure did not redraw"
            assert "2,048" in slider.inner_text()
            page.locator(".jp-OutputArea-output").first.screenshot(
                path=str(ARTIFACTS / "traffic_explorer.png")
            )
            _step_five_times(page)
            _measured_replay(page)
            page.screenshot(path=str(ARTIFACTS / "jupyterlab_page.png"))
        finally:
            context.close()


def _stepper_bytes_after(step: int) -> int:
    """HBM bytes the ledger of tiled.forward records up to the end of `step` (the stepper cell's
    problem)."""
    from flashedu import testing, tiled

    q, k, v = testing.random_qkv(1, 1, 40, 40, 16, "float32", seed=0)
    ledger = traffic.Ledger()
    tiled.forward(q, k, v, causal=True, block_m=8, block_n=8, ledger=ledger)
    return sum(t.nbytes for t in ledger.transfers if t.step <= step)


def _step_five_times(page) -> None:
    """Press the stepper's "step" button five times: from tile (0, 0) to tile (1, 0), past the four
    tiles of row block 0 that the causal mask skips; the bytes shown become the ledger's after step
    5."""
    shown = page.locator(".fe-step-total")
    shown.wait_for(timeout=60_000)
    assert int(shown.get_attribute("data-bytes")) == _stepper_bytes_after(0)
    button = page.get_by_role("button", name="step ▶")
    for _ in range(5):
        button.click()
    expected = _stepper_bytes_after(5)
    assert expected != _stepper_bytes_after(0)
    page.wait_for_function(
        f"document.querySelector('.fe-step-total').dataset.bytes === '{expected}'", timeout=30_000
    )
    assert "step 6 of 25: S tile (1, 0)" in page.locator(".fe-stepper").inner_text()
    page.locator(".jp-OutputArea-output").nth(1).screenshot(
        path=str(ARTIFACTS / "tile_stepper.png")
    )


def _measured_replay(page) -> None:
    """The measured explorer shows the Triton forward's bytes, equal to the closed form, and its
    "▶" button moves to the kernel's second program (two programs' bytes so far)."""
    m = MEASURED
    model = traffic.flash_forward(
        m["B"], m["H"], m["N_q"], m["N_k"], m["d"], block_m=m["block_m"], block_n=m["block_n"]
    )
    shown = page.locator(".fe-measured-total")
    shown.wait_for(timeout=120_000)  # the kernel runs under the interpreter in the notebook
    assert int(shown.get_attribute("data-bytes")) == model.total_bytes
    assert "equal to the model, byte for byte" in page.locator(".fe-measured").inner_text()
    program = page.locator(".fe-program-total")
    per_program = model.total_bytes // (m["N_q"] // m["block_m"] * m["B"] * m["H"])  # all alike
    assert int(program.get_attribute("data-bytes")) == per_program
    page.get_by_role("button", name="▶", exact=True).click()
    page.wait_for_function(
        f"document.querySelector('.fe-program-total').dataset.bytes === '{2 * per_program}'",
        timeout=30_000,
    )
    assert "program 2 of 8" in page.locator(".fe-program").inner_text()
    page.locator(".jp-OutputArea-output").nth(2).screenshot(
        path=str(ARTIFACTS / "measured_explorer.png")
    )


def test_make_lab_serves_jupyterlab(tmp_path):
    """`make lab` (what the README tells a learner to run) answers on its port."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    if not (ROOT / ".venv" / "bin" / "jupyter").exists():
        pytest.skip(
            "no .venv here: `make lab` would build it first (minutes); `make test` runs install "
            "first"
        )
    port, log = _free_port(), tmp_path / "make-lab.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            ["make", "--no-print-directory", "lab", f"PORT={port}"],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_isolated_env(tmp_path / "home"),
            start_new_session=True,
        )
    try:
        status = _wait_http(f"http://127.0.0.1:{port}/lab", proc, log, timeout=90)
        assert status in (200, 302, 403), status
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/login", timeout=5) as r:
            assert r.status == 200 and b"Jupyter" in r.read()
    finally:
        _stop(proc)
