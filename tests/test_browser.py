"""Notebooks in a real browser: JupyterLab + headless Chromium (playwright), run all cells, and check
what a user sees. Notebook 01: the rank grid with one cell per rank, the memory/throughput explorer (its
figure and its tokens/s line), and that moving one of its controls in the page redraws it through the
kernel. Notebook 02: the live training view redraws while ``fit`` runs. Tutorial 01: its rank grid.

Chromium is the system package (``make browser``, i.e. ``apt-get install chromium``); playwright only
drives it (never ``playwright install``). Skips only when no chromium binary can be found. A screenshot
goes to ``$RLKIT_ARTIFACTS`` or ``runs/browser/`` (git-ignored); its path is printed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from _require import missing

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "01_parallel_plan.ipynb"
GRPO = ROOT / "notebooks" / "02_grpo.ipynb"
TUTORIAL_DP = ROOT / "tutorials" / "01_data_parallel.ipynb"
RANKS = 4 * 8 * 16  # the notebook's plan: ParallelPlan(dp=4, tp=8, pp=16)
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]


def _chromium() -> str | None:
    for candidate in ("/usr/bin/chromium", shutil.which("chromium"), shutil.which("chromium-browser")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, method: str = "GET", timeout: float = 5.0) -> bytes:
    req = urllib.request.Request(url, method=method)
    with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 (a local test server)
        return r.read()


class Lab:
    """A JupyterLab server on 127.0.0.1 without a token, in a temporary root holding a copy of the
    notebook (so autosave never writes outputs into the repo), with windowing off (JupyterLab 4 keeps
    off-screen cells out of the DOM otherwise) and the news pop-up off."""

    def __init__(self, tmp: Path) -> None:
        self.root = tmp / "root"
        for nb in (NOTEBOOK, GRPO, TUTORIAL_DP):  # the same relative paths as in the repo
            if nb.exists():
                (self.root / nb.parent.name).mkdir(parents=True, exist_ok=True)
                shutil.copy(nb, self.root / nb.relative_to(ROOT))
        settings = tmp / "user-settings"
        for plugin, value in (("notebook-extension/tracker", {"windowingMode": "none"}),
                              ("apputils-extension/notification", {"fetchNews": "false",
                                                                   "checkForUpdates": False})):
            path = settings / "@jupyterlab" / f"{plugin}.jupyterlab-settings"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(value))
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "jupyterlab.log"
        env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp / "config"), JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
                   RAY_USAGE_STATS_ENABLED="0", MPLBACKEND="Agg")
        env.pop("RLKIT_NOTEBOOK_STEPS", None)  # the notebooks at their default length: what a user runs
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={self.port}",
             "--allow-root", "--IdentityProvider.token=", "--ServerApp.password=",
             "--ServerApp.disable_check_xsrf=True",  # a loopback test server: lets the REST DELETEs through
             "--LabApp.expose_app_in_browser=True", f"--ServerApp.root_dir={self.root}",
             f"--LabApp.user_settings_dir={settings}", f"--LabApp.workspaces_dir={tmp / 'workspaces'}",
             "--LabApp.news_url=", "--ServerApp.open_browser=False"],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=self.root, start_new_session=True)

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"JupyterLab exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                _get(f"{self.url}/api/status", timeout=2)
                return
            except OSError:
                time.sleep(0.5)
        raise AssertionError(f"JupyterLab did not answer /api/status within {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def shutdown_kernels(self) -> None:
        """Shut every kernel down through the REST API: a notebook's Ray cluster and workers go with it,
        so the next notebook starts on a free machine."""
        if self.proc.poll() is None:
            for kernel in json.loads(_get(f"{self.url}/api/kernels")):
                _get(f"{self.url}/api/kernels/{kernel['id']}", method="DELETE", timeout=30)

    def stop(self) -> None:
        """Shut the kernels down, then the server (SIGTERM, then SIGKILL)."""
        try:
            self.shutdown_kernels()
        except OSError:
            pass
        finally:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)  # the server's own process group
                    self.proc.wait(timeout=10)
            self._log.close()


@pytest.fixture(scope="module")
def chromium() -> str:
    path = _chromium()
    if path is None:
        missing("the chromium binary (/usr/bin/chromium or on PATH)", "RLKIT_REQUIRE_BROWSER",
                "run `make browser` (apt-get install chromium, as root) to enable the browser test")
    return path


@pytest.fixture(scope="module")
def lab(tmp_path_factory, chromium):
    server = Lab(tmp_path_factory.mktemp("lab"))
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture
def page(chromium):
    """A fresh headless Chromium page, the browser closed after the test."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        try:
            yield browser.new_page(viewport={"width": 1400, "height": 1000})
        finally:
            browser.close()


def _artifacts() -> Path:
    out = Path(os.environ.get("RLKIT_ARTIFACTS") or ROOT / "runs" / "browser")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _wait(page, expression: str, what: str, timeout_s: float, lab: Lab, arg=None) -> None:
    """Wait until the JS ``expression`` is truthy; on timeout fail saying what was awaited."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(expression, arg=arg, timeout=timeout_s * 1000, polling=250)
    except PlaywrightTimeout:
        raise AssertionError(f"waited {timeout_s:.0f} s for {what}; JupyterLab log:\n{lab.log_tail()}") from None


# JS helpers: the notebook panel and its code cells through JupyterLab's own model (window.jupyterapp)
PANEL = "(() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget; " \
        "return w && w.content && w.sessionContext ? w : null; })()"
KERNEL_IDLE = f"(() => {{ const p = {PANEL}; const k = p && p.sessionContext.session && " \
              "p.sessionContext.session.kernel; return !!k && k.status === 'idle'; })()"
ALL_RAN = f"""(() => {{
  const p = {PANEL}; if (!p) return false;
  const cells = p.content.widgets.filter(c => c.model.type === 'code');
  const done = cells.every(c => c.model.executionCount !== null && c.model.executionCount !== undefined);
  const busy = [...document.querySelectorAll('.jp-InputPrompt')].some(e => e.textContent.includes('*'));
  return done && !busy && {KERNEL_IDLE};
}})()"""
ERRORS = f"""(() => {{
  const p = {PANEL}; const out = [];
  p.content.widgets.forEach((c, i) => {{
    if (c.model.type !== 'code') return;
    for (const o of c.model.outputs.toJSON())
      if (o.output_type === 'error') out.push(`cell ${{i}}: ${{o.ename}}: ${{o.evalue}}`);
  }});
  return out;
}})()"""
# buttons per code cell: PlanView draws one ipywidgets Button per rank (the DP/TP/PP switch is a ToggleButtons)
BUTTONS_PER_CELL = """(() => [...document.querySelectorAll('.jp-CodeCell')].map(
    c => c.querySelectorAll('.jp-OutputArea .widget-button').length))()"""


def _open_and_run_all(page, lab: Lab, notebook: Path, run_timeout_s: float = 240) -> dict[str, float]:
    """Open ``notebook`` (its repo-relative path under the lab's root), run all cells, wait (bounded) until
    every code cell ran and the kernel is idle, and fail naming any cell that raised."""
    t0 = time.monotonic()
    lab.shutdown_kernels()  # the previous test's notebook (and its Ray) must not hold the machine
    # ?reset: a fresh workspace, or JupyterLab would reopen the previous test's notebook beside this one
    page.goto(f"{lab.url}/lab/tree/{notebook.relative_to(ROOT).as_posix()}?reset", wait_until="domcontentloaded",
              timeout=120_000)
    _wait(page, f"(() => {{ const p = {PANEL}; return !!p && p.context.path === {json.dumps(notebook.relative_to(ROOT).as_posix())}; }})()",
          f"JupyterLab to open {notebook.name} as the current notebook panel", 120, lab)
    _wait(page, KERNEL_IDLE, f"{notebook.name}'s kernel to start and go idle", 120, lab)
    out = {"lab_open_s": time.monotonic() - t0}
    page.evaluate(WATCH_IMAGES)
    t = time.monotonic()
    # the command's promise settles once the cells are queued or run; the waits below decide
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
    # a first prompt turns busy, so 'all ran' below is not the state before the run
    _wait(page, f"(() => {{ const p = {PANEL}; return p.content.widgets.some("
                "c => c.model.type === 'code' && c.model.executionCount); })()",
          "the first cell to run after notebook:run-all-cells", 60, lab)
    _wait(page, ALL_RAN, f"every code cell of {notebook.name} to run and the kernel to go idle", run_timeout_s, lab)
    out["run_all_s"] = time.monotonic() - t
    errors = page.evaluate(ERRORS)
    assert not errors, f"cells of {notebook.name} raised: {errors}"
    return out


# counts, per code cell (by the text of its input), how often an output image appeared or changed its src;
# and logs each such draw with what the page showed at that moment: whether the cell was still running
# (its prompt reads [*]) and the 'step k/N' of the cell's status line, if it has one (the live view)
WATCH_IMAGES = """() => {
  window.__imageDraws = new Map();
  window.__drawLog = [];
  const bump = (img) => {
    const cell = img.closest('.jp-CodeCell'); if (!cell) return;
    const code = (cell.querySelector('.jp-InputArea-editor') || {}).innerText || '';
    window.__imageDraws.set(code, (window.__imageDraws.get(code) || 0) + 1);
    const prompt = (cell.querySelector('.jp-InputPrompt') || {}).textContent || '';
    const m = (cell.querySelector('.jp-OutputArea') || {}).innerText?.match(/step (\\d+)\\/(\\d+)/);
    window.__drawLog.push({code, running: prompt.includes('*'), step: m ? +m[1] : null,
                           total: m ? +m[2] : null, src: (img.getAttribute('src') || '').length});
  };
  new MutationObserver(records => records.forEach(r => {
    if (r.type === 'attributes' && r.target.tagName === 'IMG') bump(r.target);
    r.addedNodes && r.addedNodes.forEach(n => {
      if (n.tagName === 'IMG') bump(n); else if (n.querySelectorAll) n.querySelectorAll('img').forEach(bump);
    });
  })).observe(document.body, {subtree: true, childList: true, attributes: true, attributeFilter: ['src']});
}"""
DRAWS_OF = "(needle) => [...window.__imageDraws.entries()].filter(([code]) => code.includes(needle))" \
           ".reduce((n, [, k]) => n + k, 0)"
DRAW_LOG_OF = "(needle) => window.__drawLog.filter(d => d.code.includes(needle))" \
              ".map(({running, step, total, src}) => ({running, step, total, src}))"


def _grpo_default_steps() -> int:
    """Notebook 02's ``DEFAULT_STEPS`` (the lab runs it without RLKIT_NOTEBOOK_STEPS), read from its source."""
    source = "".join("".join(c["source"]) for c in json.loads(GRPO.read_text())["cells"])
    m = re.search(r"^DEFAULT_STEPS = (\d+)", source, re.M)
    assert m, "notebook 02 no longer sets DEFAULT_STEPS = <int>"
    return int(m.group(1))


def test_notebook_02_live_view_redraws_during_fit(lab, page):
    """The GRPO notebook run from the browser: no cell raises, and the live view's dashboard image in the
    ``trainer.fit`` cell is redrawn while the run goes, not only at the start and the end. The page logs
    each draw as it happens, with what it showed then: the cell still running ([*]) and its status line at
    a middle step. The first update (step 1) and ``close()`` (the last step) would not satisfy that."""
    timings = _open_and_run_all(page, lab, GRPO, run_timeout_s=420)
    draws = page.evaluate(DRAWS_OF, "trainer.fit(")
    log = page.evaluate(DRAW_LOG_OF, "trainer.fit(")
    total = _grpo_default_steps()  # the notebook's trainer.fit(steps=STEPS) at its default length
    drawn = [d for d in log if d["src"] > 0 and d["step"] is not None]  # an image with a PNG in it
    assert drawn and all(d["total"] == total for d in drawn), log
    # while fit still ran: draws at two or more different steps strictly between the first and the last
    middle = sorted({d["step"] for d in drawn if d["running"] and 1 < d["step"] < total})
    assert len(middle) >= 2, f"live view draws while fit ran, at middle steps: {middle}; all draws: {log}"
    # what the page showed moved forward in order, and the run reached its last step
    steps = [d["step"] for d in drawn]
    assert steps == sorted(steps) and steps[-1] == total, steps
    fit_cell = page.locator(".jp-CodeCell").filter(has_text="trainer.fit(").first
    shot = _artifacts() / "notebook02_live_view.png"
    fit_cell.screenshot(path=str(shot))
    print(f"\nlive view drawn {draws} times, at steps {middle} while fit ran; screenshot: {shot}; timings:",
          {k: round(v, 1) for k, v in timings.items()})


def test_tutorial_01_rank_grid(lab, page):
    """Tutorial 01 run from the browser: no cell raises and its rank grid shows one cell per rank."""
    if not TUTORIAL_DP.exists():
        pytest.fail(f"{TUTORIAL_DP.relative_to(ROOT)} is missing")
    timings = _open_and_run_all(page, lab, TUTORIAL_DP)
    _wait(page, f"(() => {BUTTONS_PER_CELL}.some(n => n > 0))()", "the tutorial's rank grid to render", 60, lab)
    grids = [n for n in page.evaluate(BUTTONS_PER_CELL) if n]
    # the grid's plan is the first ParallelPlan the tutorial displays; its cells are its ranks
    labels = page.locator(".jp-CodeCell").filter(has=page.locator(".widget-button")).first \
        .locator(".widget-button").all_inner_texts()
    ranks = [int(x) for x in labels if x.strip().isdigit()]
    assert ranks and ranks == list(range(len(ranks))), labels
    shot = _artifacts() / "tutorial01.png"
    page.screenshot(path=str(shot))
    print(f"\ntutorial 01 grids (buttons per cell): {grids}; screenshot: {shot}; timings:",
          {k: round(v, 1) for k, v in timings.items()})


def test_notebook_01_in_chromium(lab, page):
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    console: list[str] = []
    page.on("console", lambda m: console.append(f"{m.type}: {m.text}"[:300]))
    timings.update(_open_and_run_all(page, lab, NOTEBOOK))

    # the rank grid: the `plan` cell and the `view = plan.show(...)` cell each draw one button per rank
    # (a grid's buttons arrive in batches: wait for both to hold all of them, then check the counts exactly)
    _wait(page, f"(() => {BUTTONS_PER_CELL}.filter(n => n >= {RANKS}).length >= 2)()",
          f"both PlanView rank grids to render their {RANKS} buttons", 60, lab)
    grids = [n for n in page.evaluate(BUTTONS_PER_CELL) if n]
    assert grids == [RANKS, RANKS], f"buttons per PlanView output: {grids}, expected two grids of {RANKS}"
    first_grid = page.locator(".jp-CodeCell").filter(has=page.locator(".widget-button")).first
    labels = first_grid.locator(".widget-button").all_inner_texts()
    assert [int(x) for x in labels] == list(range(RANKS)), "grid cells are not ranks 0..511 in order"

    # the explorer: one panel, its memory image loaded, its tokens/s line
    explorer = page.locator(".rlkit-plan-explorer")
    _wait(page, "(() => { const i = document.querySelector('.rlkit-plan-explorer img.rlkit-explorer-memory');"
                " return !!i && i.complete && i.naturalWidth > 100; })()",
          "the explorer's memory figure to load", 60, lab)
    assert explorer.count() == 1
    status = explorer.locator(".rlkit-explorer-status")
    before = status.inner_text()
    assert "tokens/s" in before and "MFU" in before and "every rank fits" in before, before
    image_before = explorer.locator("img.rlkit-explorer-memory").get_attribute("src")
    select = explorer.locator(".rlkit-explorer-recompute select")
    # the notebook's update(recompute="full") reached the page too
    assert select.evaluate("s => s.options[s.selectedIndex].text") == "full"

    # change a control in the page: back to no recompute; the kernel recomputes and redraws
    t = time.monotonic()
    select.select_option(label="none")
    _wait(page, "([b]) => { const e = document.querySelector('.rlkit-plan-explorer .rlkit-explorer-status');"
                " return !!e && e.innerText !== b && e.innerText.includes('tokens/s'); }",
          "the explorer's status line to change after selecting recompute=none", 60, lab, arg=[before])
    _wait(page, "([src]) => { const i = document.querySelector('.rlkit-plan-explorer img.rlkit-explorer-memory');"
                " return !!i && i.getAttribute('src') !== src && i.complete && i.naturalWidth > 100; }",
          "the explorer's memory figure to be redrawn", 60, lab, arg=[image_before])
    timings["redraw_s"] = time.monotonic() - t
    after = status.inner_text()

    def peak(text: str) -> float:
        m = re.search(r"peak ([\d.]+) GiB", text)
        assert m, text
        return float(m.group(1))

    # without recompute activations are kept: a higher peak, and more tokens/s (no extra forward)
    assert peak(after) > peak(before), (before, after)
    assert after.split(" tokens/s")[0] != before.split(" tokens/s")[0], (before, after)

    out = _artifacts()
    shot = out / "notebook01_explorer.png"
    explorer.screenshot(path=str(shot))
    page_shot = out / "notebook01.png"
    page.screenshot(path=str(page_shot))  # the lab scrolls inside: the viewport, at the explorer
    widget_errors = [c for c in console if c.startswith("error") and "widget" in c.lower()]
    assert not widget_errors, widget_errors
    timings["total_s"] = time.monotonic() - t0
    print(f"\nscreenshots: {shot} and {page_shot}")
    print("browser timings:", {k: round(v, 1) for k, v in timings.items()})
    print(f"explorer before: {before}\nexplorer after:  {after}")
