"""The Sweep tab in a real browser (JupyterLab and Notebook 7, Debian's chromium), in one page load each.

The notebook shows a session's panel, then starts a 3-member sweep on tiny (learning rates apart, a
short sleep in the step so that the sweep outlasts the clicks) and waits on it in the same cell. While
that cell is busy the test opens the Sweep tab, pauses one member, clones another with a lower learning
rate and sorts the table by learning rate; each is acknowledged in the page (the row says "paused", the
message line says "cloning", the header's arrow), the time to each printed, the median within 1 s.
The kernel-to-page bytes per sweep round with the tab shown are within the panel's budget. Fixtures and
helpers are `test_browser.py`'s.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from playwright.sync_api import Locator, Page, expect

from tests.notebook import BYTES_PER_STEP_BUDGET
from tests.notebook.test_browser import (
    ACK_MS,
    ARTIFACTS,
    STEP_MS,
    KernelTraffic,
    _acknowledged,
    _browser_page,
    _open_in,
    _prompt,
    _rendered_panel,
    _serve,
    _tab,
    _write_notebook,
)

pytestmark = pytest.mark.browser

SWEEP_CELLS = [
    """import time

import workbench as wb

sess = wb.Session("tiny", wb.LoraConfig(rank=4), wandb=False)


def step(member, i):
    prompt = member.tokenizer("User: Hello!").input_ids
    completion = member.tokenizer(" Assistant: Hi there.").input_ids
    tokens = prompt + completion
    weights = [0.0] * len(prompt) + [1.0] * len(completion)
    datum = wb.Datum(
        model_input=wb.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights[1:]},
    )
    member.policy.forward_backward([datum], "cross_entropy").result()
    member.policy.optim_step(member.current_run.adam_params).result()
    time.sleep(0.1)
    return {"step_index": float(i)}""",
    """panel = sess.panel(metrics=("loss:sum",))
panel""",
    """sweep = sess.sweep(step, wb.grid(learning_rate=[1e-2, 3e-3, 1e-3]), 60)
sweep.wait()  # blocks this cell while the Sweep tab is driven""",
    """print("ended", sweep.state.value)""",
]

TRAFFIC_ROUNDS = 5
"""Rounds the Sweep tab's traffic is counted over (at least)."""
ACK_MEDIAN_S = 1.0


def _rounds(panel: Locator) -> int:
    text = panel.locator(".wb-sweep").text_content() or ""
    found = re.search(r"round (\d+) of", text)
    return int(found.group(1)) if found else -1


def _wait_for_rounds(page: Page, panel: Locator, rounds: int) -> int:
    deadline = time.monotonic() + STEP_MS / 1000
    while (done := _rounds(panel)) < rounds:
        if time.monotonic() > deadline:
            raise AssertionError(f"the sweep did not reach round {rounds} in {STEP_MS} ms (at {done})")
        page.wait_for_timeout(100)
    return done


def _drive(page: Page, panel: Locator, busy: Callable[[], bool], traffic: KernelTraffic) -> None:
    _tab(panel, "Sweep")
    rows = panel.locator(".wb-sweep-row")
    expect(rows).to_have_count(3, timeout=STEP_MS)
    expect(panel.locator(".wb-sweep-line")).to_have_count(3, timeout=STEP_MS)  # one line per member
    page.wait_for_timeout(1000)  # the tab's first draw is the switch's, not the sweep's
    start = _wait_for_rounds(page, panel, _rounds(panel) + 1)
    received = traffic.received
    end = _wait_for_rounds(page, panel, start + TRAFFIC_ROUNDS)
    per_round = (traffic.received - received) / (end - start)
    print(f"sweep tab: kernel-to-page bytes per round while a cell waits {per_round:.0f}")
    assert per_round <= BYTES_PER_STEP_BUDGET, per_round

    timings = {}
    paused = rows.nth(1)
    paused.locator(".wb-sweep-pause").click()
    timings["pause"] = _acknowledged(lambda: expect(paused).to_contain_text("paused", timeout=ACK_MS), busy)

    panel.locator(".wb-sweep-changes input").fill("learning_rate=2e-4")
    page.wait_for_timeout(500)  # the field's value reaches the kernel before the click
    rows.nth(0).locator(".wb-sweep-clone").click()
    timings["clone"] = _acknowledged(
        lambda: expect(panel).to_contain_text(re.compile("cloning|cloned"), timeout=ACK_MS), busy
    )
    expect(rows).to_have_count(4, timeout=STEP_MS)
    expect(panel.locator(".wb-sweep-line")).to_have_count(4, timeout=STEP_MS)

    header = panel.locator(".wb-sweep-sort-learning-rate")
    header.click()
    timings["sort"] = _acknowledged(lambda: expect(header).to_contain_text("▲", timeout=ACK_MS), busy)
    expect(rows.first).to_contain_text("0.0002", timeout=STEP_MS)  # the clone's lowest rate first
    print(f"sweep tab: acknowledged in seconds {timings}")
    assert statistics.median(timings.values()) <= ACK_MEDIAN_S, timings


@pytest.mark.parametrize("front_end", ["lab", "notebook"])
def test_the_sweep_tab_answers_while_a_cell_waits_on_the_sweep(front_end: str, tmp_path: Path) -> None:
    with (
        _serve(tmp_path, front_end) as server,
        _browser_page(tmp_path, 1400, f"browser-failure-sweep-{front_end}.png") as page,
    ):
        traffic = KernelTraffic(page)
        _write_notebook(tmp_path / "notebooks" / "sweep.ipynb", SWEEP_CELLS)
        _open_in(page, server, front_end, "sweep.ipynb")
        panel = _rendered_panel(page)

        def waiting_on_the_sweep() -> bool:
            return _prompt(page, "blocks this cell") == "[*]:"

        expect(panel.locator(".lm-TabBar-tab", has_text="Sweep")).to_be_visible()
        deadline = time.monotonic() + STEP_MS / 1000
        while not waiting_on_the_sweep():
            assert time.monotonic() < deadline, "the sweep's cell never started"
            page.wait_for_timeout(250)
        _drive(page, panel, waiting_on_the_sweep, traffic)
        if front_end == "lab":  # the docs' picture of the tab (`make screenshot`)
            panel.screenshot(path=str(ARTIFACTS / "cockpit-sweep.png"))
        expect(page.locator(".jp-OutputArea-output", has_text="ended")).to_be_visible(timeout=STEP_MS * 2)
