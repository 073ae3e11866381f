"""The Runs tab and a trigger's alert in a real browser (JupyterLab and Notebook 7, Debian's chromium), in
one page load each.

The notebook leaves two finished runs' folders (described with notes and tags), then shows a live
session's panel and starts a run whose trigger pauses it after its second step. The test sees the
trigger's alert (the banner in the panel and JupyterLab's notification), opens the Runs tab, sorts by
the learning rate (and back), filters on a tag, ticks the two earlier runs and overlays them in the
Metrics tab with one click; then, the application hidden from the page, resumes the run from the panel
and sees the next trigger's alert as the panel's own toast. Fixtures and helpers are `test_browser.py`'s.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from playwright.sync_api import expect

from tests.notebook.test_browser import (
    ARTIFACTS,
    STEP_MS,
    _browser_page,
    _open_in,
    _rendered_panel,
    _serve,
    _tab,
    _write_notebook,
)

pytestmark = pytest.mark.browser

RUNS_CELLS = [
    """import workbench as wb

tok = None


def step(sess, i):
    prompt = sess.tokenizer("User: Hello!").input_ids
    completion = sess.tokenizer(" Assistant: Hi there.").input_ids
    tokens = prompt + completion
    weights = [0.0] * len(prompt) + [1.0] * len(completion)
    datum = wb.Datum(
        model_input=wb.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights[1:]},
    )
    sess.policy.forward_backward([datum], "cross_entropy").result()
    sess.policy.optim_step(sess.current_run.adam_params).result()
    return {"reward:mean": 0.25 if i in (1, 3) else 0.0}


for steps, rate, notes, tags in ((2, 1e-4, "slow baseline", ["baseline"]), (3, 1e-2, "fast sweep", ["sweep"])):
    earlier = wb.Session("tiny", wb.LoraConfig(rank=4), wandb=False)
    earlier.run(step, steps, adam_params=wb.AdamParams(learning_rate=rate)).wait()
    earlier.describe(notes=notes, tags=tags)
    earlier.close()

sess = wb.Session("tiny", wb.LoraConfig(rank=4), wandb=False)""",
    """panel = sess.panel(metrics=("loss:sum", "reward:mean"))
panel""",
    """run = sess.run(step, 4, adam_params=wb.AdamParams(learning_rate=1e-3), pause_if={"reward:mean": ("above", 0.1)})""",
]


@pytest.mark.parametrize("front_end", ["lab", "notebook"])
def test_the_runs_tab_and_a_triggers_alert(front_end: str, tmp_path: Path) -> None:
    with (
        _serve(tmp_path, front_end) as server,
        _browser_page(tmp_path, 1400, f"browser-failure-runs-{front_end}.png") as page,
    ):
        _write_notebook(tmp_path / "notebooks" / "runs.ipynb", RUNS_CELLS)
        _open_in(page, server, front_end, "runs.ipynb")
        panel = _rendered_panel(page)

        # the trigger pauses the run after its step 1: a banner in the panel, JupyterLab's notification
        alert = panel.locator(".wb-alert")
        expect(alert).to_contain_text("a trigger paused the run", timeout=STEP_MS)
        expect(alert).to_contain_text("reward:mean = 0.25 (above 0.1) at run step 1")
        toast = page.locator(".Toastify__toast", has_text="a trigger paused the run")
        expect(toast).to_be_visible(timeout=STEP_MS)
        expect(toast).to_contain_text("reward:mean = 0.25")

        _tab(panel, "Runs")
        rows = panel.locator(".wb-runs-row")
        expect(rows).to_have_count(3, timeout=STEP_MS)  # the two earlier runs and this session's
        expect(rows.first).to_contain_text("● tiny-")  # newest first: this session's

        panel.locator(".wb-runs-sort-lr").click()  # ascending
        expect(rows.first).to_contain_text("slow baseline", timeout=STEP_MS)
        panel.locator(".wb-runs-sort-lr").click()  # and back
        expect(rows.first).to_contain_text("fast sweep", timeout=STEP_MS)

        filter_box = panel.locator(".wb-runs-filter input")
        filter_box.fill("baseline")
        expect(rows).to_have_count(1, timeout=STEP_MS)
        expect(rows.first).to_contain_text("slow baseline")
        filter_box.fill("")
        expect(rows).to_have_count(3, timeout=STEP_MS)

        for notes in ("slow baseline", "fast sweep"):
            rows.filter(has_text=notes).locator("input[type=checkbox]").check()
        page.wait_for_timeout(500)  # the ticks reach the kernel before the click
        if front_end == "lab":
            panel.screenshot(path=str(ARTIFACTS / "cockpit-runs.png"))
        panel.locator(".wb-runs-overlay").click()
        # one click: the Metrics tab opens with both runs overlaid
        expect(panel.locator(".lm-TabBar-tab.lm-mod-current")).to_have_text("Metrics", timeout=STEP_MS)
        expect(panel).to_contain_text(re.compile(r"overlaid tiny-\S+, tiny-\S+"), timeout=STEP_MS)
        expect(panel.locator(".wb-metrics-plot canvas").first).to_be_visible()

        # a page that does not expose JupyterLab's application gets the panel's own toast
        page.evaluate("() => { window.hiddenApp = window.jupyterapp; window.jupyterapp = undefined; }")
        _tab(panel, "Train")
        panel.locator(".wb-train-run").click()  # resume: the trigger fires again at run step 3
        expect(alert).to_contain_text("at run step 3", timeout=STEP_MS)
        fallback = page.locator(".wb-alert-toast")
        expect(fallback).to_be_visible(timeout=STEP_MS)
        expect(fallback).to_contain_text("reward:mean = 0.25 (above 0.1) at run step 3")
        fallback.click()  # closes it
        expect(fallback).to_have_count(0)
        page.evaluate("() => { window.jupyterapp = window.hiddenApp; }")
