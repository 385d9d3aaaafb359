"""The user journey in JupyterLab: open notebook 03, run every cell, move a slider of its grid widget.

    python3 ci/lab_check.py            # about 2-4 minutes on 2 CPU cores

Starts ``.venv/bin/jupyter lab`` headless on 127.0.0.1 with a token, on a temporary copy of the
notebooks (the committed ones are never touched; figures go to a temporary folder) and an empty
Jupyter configuration, so nothing the user has set changes the run. Debian's chromium, driven by
playwright, opens the notebook on the ``tpuattn`` kernel that ci/_venv.py installs, clears the
committed outputs, runs all cells, waits for the grid widget, drags its ``q_len`` slider and checks
that the slider's value and the figure both changed. Screenshots go to
``out/book/screenshots/lab_*.png``. Exits 1, saying which step failed, if a cell raises, the widget
does not render, or the figure does not follow the slider.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _venv  # noqa: E402

ROOT = _venv.ROOT
NOTEBOOK = "03_pallas_kernel.ipynb"
SHOTS = ROOT / "out" / "book" / "screenshots"
RUN_TIMEOUT_S = 420

# JavaScript run in the page (JupyterLab started with expose_app_in_browser).
NOTEBOOK_STATE = """() => {
  const panel = window.jupyterapp.shell.currentWidget;
  if (!panel || !panel.content || !panel.content.model || !panel.sessionContext.session) return null;
  const kernel = panel.sessionContext.session.kernel;
  const cells = panel.content.model.cells;
  let code = 0, executed = 0; const errors = [];
  for (let i = 0; i < cells.length; i++) {
    const cell = cells.get(i);
    if (cell.type !== 'code') continue;
    code += 1;
    if (cell.executionCount !== null) executed += 1;
    const outputs = cell.outputs.toJSON();
    for (const o of outputs) if (o.output_type === 'error') errors.push(`cell ${i}: ${o.ename}: ${o.evalue}`);
  }
  return {kernel: kernel ? kernel.name : null, status: kernel ? kernel.status : 'none',
          code, executed, errors};
}"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prepare(tmp: Path) -> Path:
    """A copy of the notebooks on the tpuattn kernel, and an empty Jupyter configuration."""
    notebooks = tmp / "notebooks"
    notebooks.mkdir()
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        nb = json.loads(path.read_text())
        nb["metadata"]["kernelspec"] = {"name": _venv.KERNEL_NAME, "display_name": "tpuattn",
                                        "language": "python"}
        (notebooks / path.name).write_text(json.dumps(nb))
    labconfig = tmp / "config" / "labconfig"
    labconfig.mkdir(parents=True)
    # No news prompt or update check over the notebook (nothing may leave the machine anyway).
    (labconfig / "page_config.json").write_text(json.dumps(
        {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))
    (tmp / "figures").mkdir()
    return notebooks


def start_lab(tmp: Path, port: int, token: str) -> subprocess.Popen:
    env = {**os.environ, **_venv.CPU_WITH_TPU_COMPILER,
           "JUPYTER_CONFIG_DIR": str(tmp / "config"), "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "workspaces"),
           "TPUATTN_FIGURES_DIR": str(tmp / "figures"), "MPLCONFIGDIR": str(tmp / "mpl")}
    cmd = [str(_venv.MAIN.bin("jupyter")), "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={tmp}",
           *(["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []),
           "--LabApp.expose_app_in_browser=True",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    log = (tmp / "lab.log").open("w")
    process = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 90
    while time.time() < deadline:
        if process.poll() is not None:
            sys.exit(f"[lab] FAILED: jupyter lab exited ({process.returncode}):\n"
                     + (tmp / "lab.log").read_text()[-3000:])
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=2):
                return process
        except OSError:
            time.sleep(0.5)
    process.terminate()
    sys.exit("[lab] FAILED: jupyter lab did not answer within 90 s:\n"
             + (tmp / "lab.log").read_text()[-3000:])


def journey(port: int, token: str, shots: Path) -> list[str]:
    """Run notebook 03 in JupyterLab and move a slider; return the problems found."""
    sys.path.insert(0, str(ROOT / "ci"))
    from browser_check import launch
    from playwright.sync_api import sync_playwright

    problems = []
    with sync_playwright() as playwright:
        browser = launch(playwright)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        console = []
        page.on("console", lambda m: console.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: console.append(f"uncaught: {e}"))
        page.goto(f"http://127.0.0.1:{port}/lab/tree/notebooks/{NOTEBOOK}?token={token}")
        page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                               " && window.jupyterapp.shell.currentWidget.content"
                               " && window.jupyterapp.shell.currentWidget.content.model", timeout=90000)
        idle = f"() => {{ const s = ({NOTEBOOK_STATE})(); return s && s.status === 'idle'; }}"
        page.wait_for_function(idle, timeout=90000)
        state = page.evaluate(NOTEBOOK_STATE)
        print(f"[lab] {NOTEBOOK} open on kernel {state['kernel']!r} ({state['code']} code cells)", flush=True)
        if state["kernel"] != _venv.KERNEL_NAME:
            problems.append(f"kernel is {state['kernel']!r}, expected {_venv.KERNEL_NAME!r}")
        page.screenshot(path=str(shots / "lab_1_opened.png"))
        page.evaluate("() => window.jupyterapp.commands.execute('notebook:clear-all-cell-outputs')")
        start = time.perf_counter()
        page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
        deadline = time.time() + RUN_TIMEOUT_S
        while True:
            page.wait_for_timeout(2000)
            state = page.evaluate(NOTEBOOK_STATE)
            if state["errors"] or (state["status"] == "idle" and state["executed"] == state["code"]):
                break
            if time.time() > deadline:
                problems.append(f"run all: {state['executed']}/{state['code']} cells after {RUN_TIMEOUT_S} s")
                break
        print(f"[lab] run all: {state['executed']}/{state['code']} cells in "
              f"{time.perf_counter() - start:.0f} s", flush=True)
        problems += [f"run all: {error}" for error in state["errors"]]

        widget = page.locator(".jp-OutputArea-output .widget-vbox").filter(
            has=page.locator(".widget-label", has_text="block_q")).first
        try:
            widget.wait_for(state="visible", timeout=60000)
            figure = widget.locator("img.widget-image").first
            figure.wait_for(state="visible", timeout=60000)
        except Exception:  # noqa: BLE001
            page.screenshot(path=str(shots / "lab_2_no_widget.png"), full_page=False)
            problems.append("the grid widget (sliders and figure) did not render after the run")
            browser.close()
            return problems + [f"browser console: {c}" for c in console]
        widget.scroll_into_view_if_needed()
        page.wait_for_timeout(500)
        widget.screenshot(path=str(shots / "lab_2_widget_before.png"))
        before_src = figure.get_attribute("src")
        slider = widget.locator(".widget-slider").filter(
            has=page.locator(".widget-label", has_text="q_len")).first
        readout = slider.locator(".widget-readout")
        before_value = readout.inner_text().strip()
        handle = slider.locator(".noUi-handle, .ui-slider-handle").first   # ipywidgets 8 / 7
        track = slider.locator(".noUi-target, .ui-slider").first
        box, lane = handle.bounding_box(), track.bounding_box()
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        page.mouse.down()
        page.mouse.move(lane["x"] + lane["width"] * 0.75, box["y"] + box["height"] / 2, steps=8)
        page.mouse.up()
        with contextlib.suppress(Exception):   # judged below, with the slider's value
            page.wait_for_function("([el, src]) => { const img = el.querySelector('img.widget-image');"
                                   " return img && img.src !== src; }",
                                   arg=[widget.element_handle(), before_src], timeout=60000)
        page.wait_for_timeout(500)
        after_value = readout.inner_text().strip()
        after_src = widget.locator("img.widget-image").first.get_attribute("src")
        widget.screenshot(path=str(shots / "lab_3_widget_after.png"))
        page.screenshot(path=str(shots / "lab_4_page.png"))
        print(f"[lab] dragged q_len: {before_value} -> {after_value}; figure "
              f"{'changed' if after_src != before_src else 'UNCHANGED'}", flush=True)
        if after_value == before_value:
            problems.append(f"dragging the q_len slider did not change its value ({before_value})")
        if after_src == before_src:
            problems.append("the figure did not change after the slider moved")
        widget_errors = [c for c in console if "widget" in c.lower() or "uncaught" in c]
        problems += [f"browser console: {c}" for c in widget_errors]
        browser.close()
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (lab.log)")
    args = parser.parse_args()
    _venv.reexec_in(_venv.MAIN)
    start = time.perf_counter()
    SHOTS.mkdir(parents=True, exist_ok=True)
    for old in SHOTS.glob("lab_*.png"):
        old.unlink()
    tmp = Path(tempfile.mkdtemp(prefix="tpuattn-lab-"))
    token = secrets.token_hex(16)
    port = free_port()
    prepare(tmp)
    process = start_lab(tmp, port, token)
    print(f"[lab] jupyter lab on 127.0.0.1:{port} ({time.perf_counter() - start:.0f} s)", flush=True)
    try:
        problems = journey(port, token, SHOTS)
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
        if args.keep:
            print(f"[lab] kept {tmp}", flush=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    seconds = time.perf_counter() - start
    if problems:
        print(f"[lab] FAILED ({seconds:.0f} s):")
        for problem in problems:
            print("  " + problem)
        return 1
    print(f"[lab] ok ({seconds:.0f} s): screenshots in {os.path.relpath(SHOTS, ROOT)}/lab_*.png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
