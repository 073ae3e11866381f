"""The panel in a real browser: JupyterLab on 127.0.0.1, Debian's chromium driven by playwright.

The first test's notebook creates a session on the tiny model and shows its panel; the test runs it,
clicks the Train tab's Step button, and checks in the page that the status bar's step counter and the
Metrics tab's plot advanced. The second drives an RL run on the tiny model with a pause trigger and
checks each view of the cockpit: the trigger pausing the run and saying why in the progress line, the
Rollouts tab (groups, the reward histogram's click-through, the token view of what was trained on),
a run overlaid from its history file, and Resume. Screenshots go to `artifacts/`; `make screenshot`
copies them to `docs/` (`panel.png`, `cockpit-*.png`), which the README shows. Every process a test
starts (server, kernel, browser) is stopped at teardown.
"""

from __future__ import annotations

import contextlib
import html
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import nbformat
import psutil
import pytest
from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import Locator, Page, WebSocket, expect, sync_playwright

from tests.notebook import BYTES_PER_STEP_BUDGET

pytestmark = pytest.mark.browser

CHROMIUM = Path("/usr/bin/chromium")
REPO = Path(__file__).resolve().parents[2]
TUTORIAL_04 = REPO / "notebooks" / "04_rl_with_importance_sampling.ipynb"
"""The RL tutorial: its loop cell blocks in `run.wait()` for the whole run (15 steps on smollm2-135m)."""
ARTIFACTS = REPO / "artifacts"
"""Where screenshots go: the ones the docs use, and a failed test's page."""
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SERVER_START_S = 120
PANEL_RENDER_MS = 240_000  # kernel start, torch import and the tiny model on two shared cores
STEP_MS = 60_000

NOTEBOOK_CELLS = [
    """import workbench as wb

sess = wb.Session("tiny", wb.LoraConfig(rank=4), wandb=False)
tok = sess.tokenizer


def sft(prompt, completion):
    prompt_ids, completion_ids = tok(prompt).input_ids, tok(completion).input_ids
    tokens = prompt_ids + completion_ids
    weights = [0.0] * len(prompt_ids) + [1.0] * len(completion_ids)
    return wb.Datum(
        model_input=wb.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights[1:]},
    )


data = [sft("User: Hello!", " Assistant: Hi there."), sft("The quick brown fox", " jumps over the lazy dog.")]""",
    """sess.panel(train_data=data, metrics=("loss:sum", "grad_norm"))""",
]

COCKPIT_CELLS = [
    """import workbench as wb
from workbench.metrics import JsonlSink

sess = wb.Session("tiny", wb.LoraConfig(rank=4), wandb=False)
tok = sess.tokenizer
prompts = [wb.ModelInput.from_ints(tok.encode(text)) for text in ("Question one:", "Question two:")]

# a baseline run's history file, to overlay in the Metrics tab
baseline = wb.MetricsHistory()
baseline.sinks.append(JsonlSink(sess.model_dir.parent / "baseline" / "history.jsonl"))
for step in range(4):
    baseline.record("rollouts", "policy", step, {"reward:mean": 0.1 * step})


def rl_step(sess, i):
    sampler = sess.policy.save_weights_and_get_sampling_client()
    params = wb.SamplingParams(max_tokens=4, temperature=1.0, seed=i)
    groups = []
    for prompt, future in [(p, sampler.sample(p, 4, params)) for p in prompts]:
        response = future.result()
        rewards = [float(s.tokens[0] % 2 == 0) for s in response.sequences]
        groups.append(wb.RolloutGroup.of(prompt, response, rewards))
    data = wb.rollout_data(groups)
    trained = sess.policy.forward_backward(data, "importance_sampling").result() if data else None
    if data:
        sess.policy.optim_step(sess.current_run.adam_params).result()
    sess.record_rollouts(groups, trained=trained)
    return {"step_index": float(i)}""",
    """panel = sess.panel(metrics=("reward:mean", "kl_sample_train_v1:mean"))
panel""",
    """run = sess.run(rl_step, 4, pause_if={"step_index": ("above", -1.0)})""",
]
"""An RL run whose trigger fires at every step: it pauses after step 0, and again after each Resume."""

BUSY_CELLS = [
    COCKPIT_CELLS[0].replace(
        '("Question one:", "Question two:")', 'tuple(f"Question {n}:" for n in range(8))'
    ),
    """panel = sess.panel(metrics=("reward:mean", "step_index", "kl_sample_train_v1:mean"))
server = sess.serve()  # its address makes the status bar long
panel""",
    """run = sess.run(rl_step, 100_000)
run.wait()  # blocks this cell through the panel's Pause and Resume, until its Stop""",
    """print("ended", run.state.value)""",
]
"""Run All of a notebook whose cell blocks in `run.wait()`: the panel is driven while it does. Its run
samples 8 groups a step and its panel plots 3 metrics, as tutorial 04's do: what the layout must fit."""


TRAFFIC_STEPS = 10
"""How many run steps the traffic of each tab is counted over (at least)."""

ACK_MS = 30_000
"""How soon a control must be acknowledged while a cell is busy. Idle, each takes 0.01-1.5 s; with another
process's torch threads on the same two cores a step (and a callback queued behind one on the widget
subshell) has taken over 10 s. Still far from what it was when the clicks waited for the cell (the run's
end, hours later): the run is still going when the acknowledgement comes, which each test checks."""

if not CHROMIUM.exists():
    pytest.skip(
        "needs Debian's chromium at /usr/bin/chromium (apt-get install chromium; `make browser`)",
        allow_module_level=True,
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Lab:
    url: str
    token: str
    notebook: str
    process: subprocess.Popen[bytes]
    log: Path
    runs: Path  # the kernel's WORKBENCH_RUNS

    def api(self, path: str, method: str = "GET") -> bytes:
        request = urllib.request.Request(
            f"{self.url}{path}", method=method, headers={"Authorization": f"token {self.token}"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.read()


def _write_settings(settings_dir: Path) -> None:
    """User settings that keep JupyterLab's news and update toasts off the screenshot."""
    folder = settings_dir / "@jupyterlab" / "apputils-extension"
    folder.mkdir(parents=True)
    (folder / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False})
    )


def _write_notebook(path: Path, cells: list[str]) -> None:
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in cells]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, path)


def _stop(lab: Lab) -> None:
    """Shut the server down through its API (it stops its kernels), then make sure every process it
    started has exited, by pid."""
    started = [lab.process.pid]
    with contextlib.suppress(psutil.NoSuchProcess):
        started += [child.pid for child in psutil.Process(lab.process.pid).children(recursive=True)]
    try:
        lab.api("/api/shutdown", method="POST")
        lab.process.wait(timeout=30)
    except (urllib.error.URLError, OSError, subprocess.TimeoutExpired):
        lab.process.terminate()
        try:
            lab.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            lab.process.kill()
            lab.process.wait()
    for pid in started:
        try:
            process = psutil.Process(pid)
            process.terminate()
            process.wait(timeout=10)
        except psutil.NoSuchProcess:
            pass
        except psutil.TimeoutExpired:
            process.kill()


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    with _serve(tmp_path, "lab") as server:
        yield server


@contextlib.contextmanager
def _serve(tmp_path: Path, front_end: str) -> Iterator[Lab]:
    """JupyterLab (`front_end="lab"`) or Notebook 7 (`"notebook"`) on a free port, stopped at exit."""
    root = tmp_path / "notebooks"
    root.mkdir()
    _write_notebook(root / "panel.ipynb", NOTEBOOK_CELLS)
    _write_notebook(root / "cockpit.ipynb", COCKPIT_CELLS)
    _write_notebook(root / "busy.ipynb", BUSY_CELLS)
    shutil.copy(TUTORIAL_04, root / TUTORIAL_04.name)
    _write_settings(tmp_path / "jupyter" / "settings")
    port, token = _free_port(), secrets.token_hex(16)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "TOKENIZERS_PARALLELISM": "false",
        "WORKBENCH_RUNS": str(tmp_path / "runs"),
        "JUPYTER_CONFIG_DIR": str(tmp_path / "jupyter" / "config"),
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "jupyter" / "runtime"),
        "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "jupyter" / "settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "jupyter" / "workspaces"),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    env.pop("MPLBACKEND", None)  # the kernel picks its own inline backend
    # the kernel chooses its thread count as a user's does: the count tests/conftest.py fixes for the
    # in-process sessions' bit-for-bit comparisons keeps two OpenMP threads on a machine where another
    # process holds a core, which made tutorial 04's sampling 10-20x slower than the adaptive count
    env.pop("OMP_NUM_THREADS", None)
    log = tmp_path / f"jupyter-{front_end}.log"
    command = [
        sys.executable,
        "-m",
        "jupyter",
        front_end,
        "--no-browser",
        "--allow-root",
        "--ip=127.0.0.1",
        f"--port={port}",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        "--expose-app-in-browser",
        *(
            ["--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
            if front_end == "lab"
            else []
        ),
    ]
    with log.open("wb") as log_file:
        process = subprocess.Popen(command, cwd=root, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    lab = Lab(
        url=f"http://127.0.0.1:{port}",
        token=token,
        notebook="panel.ipynb",
        process=process,
        log=log,
        runs=tmp_path / "runs",
    )
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"JupyterLab exited with {process.returncode}:\n{log.read_text()[-3000:]}")
            try:
                json.loads(lab.api("/api/status"))
                break
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not start in {SERVER_START_S} s:\n{log.read_text()[-3000:]}")
                time.sleep(0.5)
        yield lab
    finally:
        _stop(lab)


@contextlib.contextmanager
def _browser_page(tmp_path: Path, width: int, failure_screenshot: str) -> Iterator[Page]:
    """A page of Debian's chromium, headless, with a profile of its own under `tmp_path` and a window
    `width` px wide; when the test fails in it, the page is saved as `artifacts/<failure_screenshot>`."""
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"),
            executable_path=str(CHROMIUM),
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": width, "height": 1000},
        )
        try:
            page = context.pages[0] if context.pages else context.new_page()
            try:
                yield page
            except BaseException:
                page.screenshot(path=str(ARTIFACTS / failure_screenshot), full_page=True)
                raise
        finally:
            context.close()


def test_the_panel_trains_from_a_click_in_jupyterlab(lab: Lab, tmp_path: Path) -> None:
    with _browser_page(tmp_path, 1280, "browser-failure.png") as page:
        _train_from_the_panel(page, lab, secrets.token_hex(4), ARTIFACTS / "panel.png")


def _train_from_the_panel(page: Page, lab: Lab, workspace: str, screenshot: Path) -> None:
    page.goto(f"{lab.url}/lab/workspaces/{workspace}/tree/{lab.notebook}?reset&token={lab.token}")
    page.wait_for_function(
        "() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
        " && window.jupyterapp.shell.currentWidget.sessionContext"
        " && window.jupyterapp.shell.currentWidget.sessionContext.isReady",
        timeout=PANEL_RENDER_MS,
    )
    page.evaluate("() => window.jupyterapp.commands.execute('application:toggle-left-area')")
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")

    panel = _rendered_panel(page)
    expect(page.get_by_text("Loading widget")).to_have_count(0)

    step = panel.locator('[data-field="step"]')
    expect(step).to_have_text("step 0")
    plot = panel.locator(".wb-metrics-plot canvas").first
    panel.locator(".lm-TabBar-tab", has_text="Metrics").click()
    expect(plot).to_be_visible(timeout=STEP_MS)
    page.wait_for_timeout(1000)
    before = plot.evaluate("canvas => canvas.toDataURL()")
    panel.locator(".lm-TabBar-tab", has_text="Train").click()

    for expected in (1, 2, 3):
        panel.locator(".wb-train-step").click(timeout=STEP_MS)
        expect(step).to_have_text(f"step {expected}", timeout=STEP_MS)
    expect(panel.locator('[data-field="run-progress"]')).to_contain_text("finished · 1/1", timeout=STEP_MS)

    panel.locator(".lm-TabBar-tab", has_text="Metrics").click()
    expect(plot).to_be_visible()
    page.wait_for_function(
        "([canvas, before]) => canvas.toDataURL() !== before",
        arg=[plot.element_handle(), before],
        timeout=STEP_MS,
    )
    page.wait_for_timeout(1500)  # let the last redraw land before the picture is taken
    box = plot.bounding_box()
    # two metrics side by side at the figure's own size (2 × 340 × 260 px), not stretched to the page
    assert box is not None and abs(box["width"] - 680) <= 10 and abs(box["height"] - 260) <= 10
    panel.screenshot(path=str(screenshot))


def _open(page: Page, lab: Lab, workspace: str, notebook: str) -> None:
    page.goto(f"{lab.url}/lab/workspaces/{workspace}/tree/{notebook}?reset&token={lab.token}")
    page.wait_for_function(
        "() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
        " && window.jupyterapp.shell.currentWidget.sessionContext"
        " && window.jupyterapp.shell.currentWidget.sessionContext.isReady",
        timeout=PANEL_RENDER_MS,
    )
    page.evaluate("() => window.jupyterapp.commands.execute('application:toggle-left-area')")
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")


def test_the_rl_cockpit_in_jupyterlab(lab: Lab, tmp_path: Path) -> None:
    with _browser_page(tmp_path, 1400, "browser-failure.png") as page:
        _drive_the_cockpit(page, lab, secrets.token_hex(4), ARTIFACTS)


def _drive_the_cockpit(page: Page, lab: Lab, workspace: str, artifacts: Path) -> None:
    _open(page, lab, workspace, "cockpit.ipynb")
    panel = _rendered_panel(page)
    expect(page.get_by_text("Loading widget")).to_have_count(0)

    # the status bar is one line at 1400 px
    status = panel.locator(".wb-status")
    expect(status.locator('[data-field="step"]')).to_be_visible(timeout=PANEL_RENDER_MS)  # first refresh
    # one measurement in the page: each refresh replaces the bar's fields, so two calls could see two bars
    bar_height, line_height = status.evaluate(
        "bar => [bar.getBoundingClientRect().height,"
        " bar.querySelector('[data-field=\"step\"]').getBoundingClientRect().height]"
    )
    assert line_height > 0 and bar_height < 2 * line_height + 8, (bar_height, line_height)

    # the trigger fires at the end of step 0: the run pauses and the progress line says why
    trigger = panel.locator('[data-field="trigger"]')
    expect(trigger).to_contain_text("paused by trigger", timeout=STEP_MS)
    expect(trigger).to_contain_text("step_index = 0 (above -1) at run step 0")
    expect(panel.locator('[data-field="run-step"]')).to_have_text("step 1/4")
    expect(panel.locator('[data-field="run-description"]')).to_contain_text("rl_step")
    panel.screenshot(path=str(artifacts / "cockpit-trigger.png"))

    # Rollouts: two groups side by side, a histogram whose bar opens its replies, the token view
    panel.locator(".lm-TabBar-tab", has_text="Rollouts").click()
    groups = panel.locator(".wb-rollout-group")
    expect(groups).to_have_count(2, timeout=STEP_MS)
    expect(panel.locator(".wb-rollouts-follow", has_text="follow newest")).to_be_visible()
    bars = panel.locator(".wb-reward-bar")
    expect(bars.first).to_be_visible()
    bar = bars.last
    count = int(bar.inner_text())
    bar.click()
    expect(panel.locator('.wb-rollout-groups tr[style*="background"]')).to_have_count(count, timeout=STEP_MS)
    tokens = panel.locator(".wb-rollout-tokens")
    expect(tokens).to_contain_text("reply")
    panel.locator(".widget-toggle-button", has_text="mismatch").click()
    expect(tokens).to_contain_text("sampler − trainer logprob")
    panel.screenshot(path=str(artifacts / "cockpit-rollouts.png"))

    # Metrics: a baseline run overlaid from its history file on the ipympl canvas
    panel.locator(".lm-TabBar-tab", has_text="Metrics").click()
    overlay = panel.locator(".wb-metrics-overlay")
    path_box = panel.locator("input[placeholder*='to overlay']")
    path_box.fill(str(lab.runs / "baseline"))
    overlay.click()
    expect(panel).to_contain_text("overlaid baseline", timeout=STEP_MS)
    canvas = panel.locator(".wb-metrics-plot canvas").first
    expect(canvas).to_be_visible()
    page.wait_for_timeout(1500)
    panel.screenshot(path=str(artifacts / "cockpit-metrics.png"))

    # Resume from the panel: the run goes on and the trigger pauses it again after the next step
    panel.locator(".lm-TabBar-tab", has_text="Train").click()
    panel.locator(".wb-train-run").click()
    expect(trigger).to_contain_text("at run step 1", timeout=STEP_MS)
    expect(panel.locator('[data-field="run-progress"]')).to_contain_text("paused · 2/4")


# --------------------------------------------------------------------------------------------------
# While a cell is busy: the controls answer during `run.wait()` and Run All, in both front ends


def _open_in(page: Page, server: Lab, front_end: str, notebook: str) -> None:
    """Open `notebook` in JupyterLab or Notebook 7 and Run All once its kernel is ready."""
    if front_end == "lab":
        page.goto(
            f"{server.url}/lab/workspaces/{secrets.token_hex(4)}/tree/{notebook}?reset&token={server.token}"
        )
    else:
        page.goto(f"{server.url}/notebooks/{notebook}?token={server.token}")
    page.wait_for_function(
        "() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
        " && window.jupyterapp.shell.currentWidget.sessionContext"
        " && window.jupyterapp.shell.currentWidget.sessionContext.isReady",
        timeout=PANEL_RENDER_MS,
    )
    if front_end == "lab":
        page.evaluate("() => window.jupyterapp.commands.execute('application:toggle-left-area')")
    # not awaited: the command's promise settles only when the last cell has run
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")


def _rendered_panel(page: Page) -> Locator:
    """The notebook's panel once it is visible; if it never renders, the cells' outputs say why."""
    panel = page.locator(".wb-panel")
    try:
        expect(panel).to_be_visible(timeout=PANEL_RENDER_MS)
    except AssertionError:
        outputs = page.locator(".jp-OutputArea-output").all_inner_texts()
        raise AssertionError(f"the panel never rendered; cell outputs: {outputs}") from None
    return panel


def _prompt(page: Page, code: str) -> str:
    """The input prompt of the first code cell containing `code`: `[*]:` while it runs."""
    return page.evaluate(
        """code => {
            const cells = window.jupyterapp.shell.currentWidget.content.widgets;
            const cell = cells.find(c => c.model.type === 'code' && c.model.sharedModel.getSource().includes(code));
            return cell.promptNode.textContent.trim();
        }""",
        code,
    )


def _run_step(panel: Locator) -> int:
    # the text, not what is drawn: a long notebook's Run All scrolls the panel out of view, where
    # JupyterLab skips drawing it (content-visibility) and its inner text reads empty
    text = panel.locator('[data-field="run-step"]').text_content() or ""  # "step 12/100000"
    return int(text.split()[1].split("/")[0])


def _wait_for_steps(page: Page, panel: Locator, steps: int, timeout_ms: int) -> int:
    deadline = time.monotonic() + timeout_ms / 1000
    while True:
        with contextlib.suppress(PlaywrightError, ValueError, IndexError):
            done = _run_step(panel)
            if done >= steps:
                return done
        if time.monotonic() > deadline:
            raise AssertionError(f"the run did not reach {steps} steps in {timeout_ms} ms")
        page.wait_for_timeout(250)


def _acknowledged(check: Callable[[], None], busy: Callable[[], bool]) -> float:
    """Seconds until `check` passes (a playwright expectation, ACK_MS at most); the cell must still be
    busy afterwards: the acknowledgement came during the run, not after it."""
    started = time.monotonic()
    check()
    took = time.monotonic() - started
    assert busy(), "the control was acknowledged only after the cell had finished"
    return took


def _tab(panel: Locator, name: str) -> None:
    panel.locator(".lm-TabBar-tab", has_text=name).click()


def _edit_learning_rate(panel: Locator, busy: Callable[[], bool], value: str = "0.0002") -> float:
    _tab(panel, "Train")
    field = panel.locator(".widget-text", has_text="learning_rate").locator("input")
    field.fill(value)
    field.press("Enter")
    field.press("Tab")
    # acknowledged at once as requested (or already applied, between two steps) ...
    took = _acknowledged(
        lambda: expect(panel.locator(".wb-train-settings")).to_contain_text("learning_rate", timeout=ACK_MS),
        busy,
    )
    expect(panel.locator(".wb-train-settings")).to_contain_text(
        re.compile(rf"{re.escape(value)} (requested|applied)")
    )
    # ... and shown as applied once the run has applied it, while the cell still waits
    expect(panel.locator('[data-field="applied-learning_rate"]')).to_contain_text(
        f"learning_rate = {value} applied from run step", timeout=STEP_MS
    )
    assert busy()
    return took


def _click_histogram(panel: Locator, busy: Callable[[], bool]) -> float:
    _tab(panel, "Rollouts")
    bar = panel.locator(".wb-reward-bar").first
    expect(bar).to_be_visible(timeout=STEP_MS)
    bar.click()
    return _acknowledged(lambda: expect(bar).to_have_class(re.compile(r"mod-info"), timeout=ACK_MS), busy)


def _zoom(page: Page, panel: Locator, busy: Callable[[], bool]) -> float:
    """Drag a rectangle with ipympl's zoom tool. The kernel answers the drag with the rubberband (drawn
    on the top canvas, which a redraw of the plot for a new step never touches: it shows only once the
    toolbar's Zoom button and the canvas's mouse events have both been handled), then redraws the
    figure with the zoomed axes."""
    _tab(panel, "Metrics")
    figure = panel.locator(".wb-metrics-plot")
    expect(figure.locator("canvas").first).to_be_visible(timeout=STEP_MS)
    figure.locator("button[title^='Zoom']").click()
    top = figure.locator("canvas").last  # the top canvas takes the mouse and shows the rubberband
    top.scroll_into_view_if_needed()
    box = top.bounding_box()
    assert box is not None
    page.mouse.move(box["x"] + box["width"] * 0.3, box["y"] + box["height"] * 0.3)
    page.mouse.down()
    before = figure.locator("canvas").first.evaluate("canvas => canvas.toDataURL()")

    def rubberband() -> None:
        page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + box["height"] * 0.6, steps=5)
        page.wait_for_function(
            """canvas => canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height)
                .data.some((value, i) => i % 4 === 3 && value > 0)""",
            arg=top.element_handle(),
            timeout=ACK_MS,
        )

    took = _acknowledged(rubberband, busy)
    page.mouse.up()
    page.wait_for_function(
        "([canvas, before]) => canvas.toDataURL() !== before",
        arg=[figure.locator("canvas").first.element_handle(), before],
        timeout=ACK_MS,
    )
    figure.locator("button[title^='Zoom']").click()  # the zoom tool off again
    return took


@pytest.mark.parametrize("front_end", ["lab", "notebook"])
def test_the_controls_answer_while_a_cell_waits_on_the_run(front_end: str, tmp_path: Path) -> None:
    """Run All of a notebook whose cells block in `run.wait()`: the LR field, a histogram bar, the
    plot's zoom, Pause and Stop are each acknowledged while a cell is still busy. In JupyterLab the
    notebook is then saved, its kernel restarted (the panel says it is stale and greys its controls)
    and the notebook reopened in a fresh page: the saved record shows the run's last state."""
    with (
        _serve(tmp_path, front_end) as server,
        _browser_page(tmp_path, 1400, f"browser-failure-{front_end}.png") as page,
    ):
        _drive_while_busy(page, server, front_end)


def _fits_1400_px(panel: Locator) -> None:
    """In a 1400 × 1000 window, the panel's parts stay within it: the three plots within the plot's
    box (Notebook 7 cut the third), the toolbar off every plot (it covered the rightmost one's title),
    every field of the status bar within the bar (its tail was clipped), every rollout card within the
    tab (they ran off to the right)."""

    def measured(script: str) -> dict[str, object]:
        return panel.evaluate(
            "panel => { const box = e => { const b = e.getBoundingClientRect();"
            " return {left: b.left, top: b.top, right: b.right, bottom: b.bottom}; };" + script + "}"
        )

    _tab(panel, "Metrics")
    expect(panel.locator(".wb-metrics-plot canvas").first).to_be_visible(timeout=STEP_MS)
    plot = measured(
        """const plot = panel.querySelector('.wb-metrics-plot');
        const scroller = plot.querySelector('.jupyter-matplotlib-canvas-container');
        return {panel: box(panel), plot: box(plot), canvas: box(plot.querySelector('canvas')),
                toolbar: box(plot.querySelector('.jupyter-matplotlib-toolbar')),
                hidden: scroller.scrollWidth - scroller.clientWidth};"""
    )
    canvas, toolbar = plot["canvas"], plot["toolbar"]
    assert canvas["right"] <= plot["plot"]["right"] <= plot["panel"]["right"] and plot["hidden"] <= 0, plot
    overlap = min(canvas["right"], toolbar["right"]) > max(canvas["left"], toolbar["left"]) and min(
        canvas["bottom"], toolbar["bottom"]
    ) > max(canvas["top"], toolbar["top"])
    assert not overlap, plot
    status = measured(
        """const bar = panel.querySelector('.wb-status');
        return {bar: box(bar), fields: [...bar.querySelectorAll('[data-field]')].map(f => box(f).right),
                hidden: Math.max(...[...bar.querySelectorAll('div')].map(d => d.scrollWidth - d.clientWidth))};"""
    )
    assert max(status["fields"]) <= status["bar"]["right"] and status["hidden"] <= 0, status
    _tab(panel, "Rollouts")
    expect(panel.locator(".wb-rollout-group")).to_have_count(8, timeout=STEP_MS)
    cards = measured(
        """const tab = panel.querySelector('.wb-rollouts');
        return {tab: box(tab), cards: [...tab.querySelectorAll('.wb-rollout-group')].map(c => box(c).right)};"""
    )
    assert max(cards["cards"]) <= cards["tab"]["right"], cards


class KernelTraffic:
    """Bytes the page receives on its kernel websockets (`/api/kernels/<id>/channels`): every widget
    update, plot image and output the kernel sends."""

    def __init__(self, page: Page) -> None:
        self.received = 0
        page.on("websocket", self._watch)

    def _watch(self, websocket: WebSocket) -> None:
        if "/channels" in websocket.url:
            websocket.on("framereceived", self._count)

    def _count(self, payload: str | bytes) -> None:
        self.received += len(payload.encode() if isinstance(payload, str) else payload)


def _bytes_per_step(
    page: Page, panel: Locator, traffic: KernelTraffic, tab: str, steps: int = TRAFFIC_STEPS
) -> float:
    """Kernel-to-page bytes per run step over `steps` steps with `tab` shown and nothing clicked,
    counted between two refreshes of the panel's step counter (whose rate adapts to the machine)."""
    _tab(panel, tab)
    page.wait_for_timeout(1000)  # the tab's first draw is the switch's, not the run's
    start = _wait_for_steps(page, panel, _run_step(panel) + 1, STEP_MS)
    received = traffic.received
    end = _wait_for_steps(page, panel, start + steps, STEP_MS * 2)
    return (traffic.received - received) / (end - start)


def _drive_while_busy(page: Page, server: Lab, front_end: str) -> None:
    traffic = KernelTraffic(page)
    _open_in(page, server, front_end, "busy.ipynb")
    panel = page.locator(".wb-panel")
    expect(panel).to_be_visible(timeout=PANEL_RENDER_MS)
    _wait_for_steps(page, panel, 2, STEP_MS * 2)  # a batch of rollouts and a point on the plot
    _fits_1400_px(panel)
    per_step = {tab: _bytes_per_step(page, panel, traffic, tab) for tab in ("Metrics", "Rollouts")}
    print(f"{front_end}: kernel-to-page bytes per step while a cell waits {per_step}")
    assert max(per_step.values()) <= BYTES_PER_STEP_BUDGET, per_step

    def waiting_on_the_run() -> bool:
        return _prompt(page, "until its Stop") == "[*]:"

    assert waiting_on_the_run()
    timings = {
        "learning_rate": _edit_learning_rate(panel, waiting_on_the_run),
        "histogram": _click_histogram(panel, waiting_on_the_run),
        "zoom": _zoom(page, panel, waiting_on_the_run),
    }
    timings.update(_pause_resume_stop(page, panel, waiting_on_the_run))
    # the cell ends only when the run does: the Stop was handled while it waited (the panel's text may
    # say "stopped" a refresh after the cell has ended)
    expect(page.locator(".jp-OutputArea-output", has_text="ended stopped")).to_be_visible(timeout=STEP_MS)
    expect(panel.locator('[data-field="run-progress"]')).to_contain_text("stopped", timeout=STEP_MS)
    print(f"{front_end}: acknowledged in seconds {timings}")
    if front_end == "lab":
        _stale_and_reopened(page, server, panel)


def _pause(page: Page, panel: Locator, busy: Callable[[], bool]) -> float:
    """Pause from the panel while a cell waits on the run: acknowledged, and the wait goes on through
    the pause (the cell stays busy, the run takes no step)."""
    _tab(panel, "Train")
    panel.locator(".wb-train-pause").click()
    progress = panel.locator('[data-field="run-progress"]')
    took = _acknowledged(lambda: expect(progress).to_contain_text("paused", timeout=ACK_MS), busy)
    expect(progress).not_to_contain_text("step in progress", timeout=STEP_MS)  # the last step's end
    paused_at = _run_step(panel)
    page.wait_for_timeout(2000)  # a refresh or two of the panel, and of the cell's prompt
    assert busy() and _run_step(panel) == paused_at, "the paused run ended the wait, or took a step"
    expect(progress).to_contain_text("paused")
    return took


def _resume_and_stop(page: Page, panel: Locator, busy: Callable[[], bool]) -> dict[str, float]:
    """Resume a paused run from the panel, then Stop it, each acknowledged while the cell still waits."""
    _tab(panel, "Train")
    progress = panel.locator('[data-field="run-progress"]')
    panel.locator(".wb-train-run").click()
    timings = {
        "resume": _acknowledged(lambda: expect(progress).to_contain_text("running", timeout=ACK_MS), busy)
    }
    expect(panel.locator(".wb-train-stop")).to_be_enabled(timeout=STEP_MS)
    panel.locator(".wb-train-stop").click()
    timings["stop"] = _acknowledged(
        lambda: expect(progress).to_contain_text(re.compile("stopping|stopped"), timeout=ACK_MS),
        lambda: True,
    )
    return timings


def _pause_resume_stop(page: Page, panel: Locator, busy: Callable[[], bool]) -> dict[str, float]:
    return {"pause": _pause(page, panel, busy), **_resume_and_stop(page, panel, busy)}


def _ran_to_the_end(page: Page, timeout_ms: int) -> None:
    """Every code cell of the notebook has run (a number in its prompt), and none shows an error."""
    page.wait_for_function(
        r"""() => window.jupyterapp.shell.currentWidget.content.widgets
            .filter(c => c.model.type === 'code')
            .every(c => /^\[\d+\]:$/.test(c.promptNode.textContent.trim()))""",
        timeout=timeout_ms,
    )
    errors = page.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.error"]')
    assert errors.count() == 0, errors.all_inner_texts()


def _stale_and_reopened(page: Page, server: Lab, panel: Locator) -> None:
    """Restart the kernel: the panel says it is stale and its controls are greyed and take neither the
    mouse nor the keyboard; save, and reopen the notebook in a new page: the record under the panel shows
    the stopped run, with no widget error above it. The saved notebook's HTML export shows the record,
    the panel's one-line text form and the run's last progress line."""
    # the record under the panel (hidden while the panel lives) has the run's end
    hidden_record = page.locator('.wb-record [data-field="run-progress"]')
    expect(hidden_record).to_contain_text("stopped", timeout=STEP_MS)
    # not awaited: the promise waits for the new kernel to be ready
    page.evaluate("() => { window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.restart(); }")
    expect(panel.locator('[data-field="stale"]')).to_be_visible(timeout=STEP_MS)
    pointer = panel.locator(".wb-train-stop").evaluate("button => getComputedStyle(button).pointerEvents")
    assert pointer == "none"
    _keyboard_proof(page, panel)
    page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
    page.wait_for_function(
        "() => !window.jupyterapp.shell.currentWidget.context.model.dirty", timeout=STEP_MS
    )
    saved = json.loads(server.api("/api/contents/busy.ipynb"))["content"]
    outputs = [output for cell in saved["cells"] for output in cell.get("outputs", [])]
    records = [o for o in outputs if "wb-record" in o.get("data", {}).get("text/html", "")]
    assert len(records) == 1
    _exported(saved)
    reopened = page.context.new_page()  # a new page, as a later visit is
    page.close()
    reopened.goto(
        f"{server.url}/lab/workspaces/{secrets.token_hex(4)}/tree/busy.ipynb?reset&token={server.token}"
    )
    record = reopened.locator(".wb-record")
    expect(record).to_be_visible(timeout=PANEL_RENDER_MS)
    expect(record.locator('[data-field="run-progress"]')).to_contain_text("stopped")
    expect(record.locator("img")).to_be_visible()
    expect(reopened.locator(".wb-panel")).to_have_count(0)
    expect(reopened.get_by_text("Error displaying widget")).to_be_hidden(timeout=PANEL_RENDER_MS)


def _keyboard_proof(page: Page, panel: Locator) -> None:
    """A stale panel's controls take no focus, so neither Tab + Enter (which sent a click on the closed
    comm: "Cannot send") nor typing (the LR field took it) reaches them."""
    controls = panel.locator("button, input, select, textarea")
    assert controls.count() > 0
    focusable = controls.evaluate_all(
        """elements => elements.filter(e => { e.focus(); return document.activeElement === e; })
            .map(e => e.textContent || e.value)"""
    )
    assert not focusable, f"controls of the stale panel take the keyboard's focus: {focusable}"


def _exported(saved: dict[str, object]) -> None:
    """The notebook as `jupyter nbconvert --to html` writes it (what GitHub and nbviewer show): the
    record, the panel's one-line text form rather than its widget repr, the run's last progress line
    rather than the "0/N" its bar had when first shown."""
    from nbconvert import HTMLExporter

    from workbench.notebook.panel.record import PANEL_TEXT

    body, _resources = HTMLExporter().from_notebook_node(nbformat.from_dict(saved))
    assert "wb-record" in body and html.escape(PANEL_TEXT) in body
    assert "Panel(children" not in body
    bars = re.findall(r"(\d+)/100000", body)
    assert bars and "0" not in bars, bars


TUTORIAL_STEPS = 15
"""Steps of tutorial 04's run."""
TUTORIAL_TRAFFIC_STEPS = 2
"""Steps each tab's traffic is counted over in tutorial 04 (at least: the panel's step counter may move by
more at once, and a count begins at the counter's next move)."""


@pytest.mark.tutorial_browser
@pytest.mark.parametrize("front_end", ["lab", "notebook"])
def test_tutorial_04_answers_while_run_all_waits_on_its_run(front_end: str, tmp_path: Path) -> None:
    """Run All of tutorial 04 as shipped: while its loop cell blocks in `run.wait()` (15 RL steps on
    smollm2-135m), the LR field (3.1e-4 for the run's 3e-4: a value it already has would send nothing)
    and Pause are acknowledged while the cell is still busy; paused, the cell keeps waiting, a histogram
    bar and the plot's zoom answer, then Resume and Stop; the notebook then runs to its end with the
    steps the run trained, as its text promises. The Rollouts and Metrics tabs' traffic per step is
    within the budget."""
    with (
        _serve(tmp_path, front_end) as server,
        _browser_page(tmp_path, 1400, f"browser-failure-04-{front_end}.png") as page,
    ):
        traffic = KernelTraffic(page)
        _open_in(page, server, front_end, TUTORIAL_04.name)
        panel = page.locator(".wb-panel")
        expect(panel).to_be_visible(timeout=PANEL_RENDER_MS)

        def waiting_on_the_run() -> bool:
            return _prompt(page, "pause_if=") == "[*]:"

        # the cells before the loop, then a first batch of rollouts
        _wait_for_steps(page, panel, 1, STEP_MS * 5)
        per_step = {
            "Rollouts": _bytes_per_step(page, panel, traffic, "Rollouts", steps=TUTORIAL_TRAFFIC_STEPS)
        }
        # the Metrics tab where the run has steps to spare for it (on a quiet machine a step takes 4 s and
        # the panel's counter moves every 2-3 of them; the clicks below need steps too)
        if _run_step(panel) + 3 * TUTORIAL_TRAFFIC_STEPS <= TUTORIAL_STEPS - 3:
            per_step["Metrics"] = _bytes_per_step(
                page, panel, traffic, "Metrics", steps=TUTORIAL_TRAFFIC_STEPS
            )
        print(f"{front_end} 04: kernel-to-page bytes per step while the loop cell waits {per_step}")
        assert max(per_step.values()) <= BYTES_PER_STEP_BUDGET, per_step
        assert waiting_on_the_run()
        timings = {
            "learning_rate": _edit_learning_rate(panel, waiting_on_the_run, value="0.00031"),
            "pause": _pause(page, panel, waiting_on_the_run),
            "histogram": _click_histogram(panel, waiting_on_the_run),
            "zoom": _zoom(page, panel, waiting_on_the_run),
            **_resume_and_stop(page, panel, waiting_on_the_run),
        }
        print(f"{front_end} 04: acknowledged in seconds {timings}")
        expect(page.locator(".jp-OutputArea-output", has_text="stopped after")).to_be_visible(
            timeout=STEP_MS * 2
        )
        _ran_to_the_end(page, STEP_MS * 10)
