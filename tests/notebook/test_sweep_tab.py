"""panel/sweep_tab.py: the Sweep tab over a 3-member sweep on tiny: it lists the members with their
differing settings, sorts by a click on a header, each row's control does what it says on the sweep, the
overlay draws one line per member, a round's traffic stays within the panel's budget, and the saved
record holds the charts and the table."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import workbench as wb
from tests.notebook import BYTES_PER_STEP_BUDGET
from tests.notebook.test_run_checkpoints import sft_step
from workbench.notebook.panel.panel import panel_settled
from workbench.notebook.panel.sweep_tab import parse_changes

WAIT_S = 120.0
CONFIGS = [
    {"learning_rate": 1e-2, "seed": 0},
    {"learning_rate": 3e-3, "seed": 1},
    {"learning_rate": 1e-3, "seed": 2},
]


def _session(folder: Path) -> wb.Session:
    return wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, threads=1, model_dir=folder, wandb=False)


def _names(panel: wb.Panel) -> list[str]:
    return [row.name for row in panel.sweep.member_rows()]


def test_the_sweep_tab_lists_sorts_and_controls_the_members(tmp_path: Path) -> None:
    with _session(tmp_path / "sweep") as sess:
        panel = sess.panel(metrics=("loss:sum",))
        try:
            panel.stop_polling()  # the test refreshes
            sweep = sess.sweep(sft_step, CONFIGS, 3)
            assert sweep.wait(WAIT_S) is wb.RunState.FINISHED
            panel.tabs.selected_index = panel.tab_index("Sweep")
            panel.refresh()
            tab = panel.sweep
            names = [m.settings.name for m in sweep.members]
            assert _names(panel) == names  # in the sweep's order
            assert [c.title for c in tab.columns()] == [
                "#",
                "member",
                "state",
                "learning_rate",
                "seed",
                "step",
                "latest",
                "best",
            ]
            rows = [controls.cells.value for controls in tab.controls.values()]
            assert all("finished" in row and ">3<" in row for row in rows), rows
            # the overlay: one line per member in each chart, named by the settings that differ
            charts = tab.charts.value
            assert re.findall(r'data-metric="([^"]+)"', charts) == ["loss:sum"]
            lines = re.findall(r'class="wb-sweep-line" data-member="([^"]+)"', charts)
            assert lines == [
                "learning_rate=0.01, seed=0",
                "learning_rate=0.003, seed=1",
                "learning_rate=0.001, seed=2",
            ]
            # latest and best of the metric, by a header's click
            for member, row in zip(sweep.members, tab.member_rows(), strict=True):
                values = member.history.series("loss:sum")[1]
                assert len(values) == 3 and row.latest == values[-1] and row.best == min(values)
            tab._headers["learning_rate"].click()
            assert _names(panel) == [names[2], names[1], names[0]]  # ascending
            tab._headers["learning_rate"].click()
            assert _names(panel) == names
            assert tab._headers["learning_rate"].description == "learning_rate ▼"
            tab._headers["best"].click()
            bests = [row.best for row in tab.member_rows()]
            assert bests == sorted(bests)

            # clone with a changed learning rate, from the first member's row
            tab.changes.value = "learning_rate=2e-4"
            first = sweep.members[0]
            tab.controls[first.model_id].buttons["clone"].click()
            assert tab.feedback.text.startswith("cloned"), tab.feedback.text
            assert len(sweep.members) == 4
            clone = sweep.members[3]
            assert clone.clone_of == first.model_id and clone.adam_params.learning_rate == 2e-4
            assert clone.i == 3 and len(tab.rows.children) == 4
            # promote: the session's policy is now the member's model
            tab.controls[sweep.members[1].model_id].buttons["promote"].click()
            assert sess.step == sweep.members[1].step and "promoted" in tab.feedback.text
            # stop: the model is freed, the row says so and its buttons are off
            tab.controls[first.model_id].buttons["stop"].click()
            assert first.state is wb.RunState.STOPPED and first.model_id not in sess.engine.model_ids()
            controls = tab.controls[first.model_id]
            assert "stopped" in controls.cells.value and controls.buttons["clone"].disabled

            # the saved record: heading, charts, and the table, as plain HTML
            record = tab.record_html()
            assert "wb-sweep-chart" in record and "wb-sweep-table" in record
            assert all(name in record for name in names)
            body, _png = panel._snapshot()
            assert "wb-sweep-record" in body
        finally:
            panel.close()


def test_pause_and_resume_act_on_a_training_member_and_a_round_stays_in_budget(tmp_path: Path) -> None:
    release = threading.Event()

    def held_step(member: wb.Member, i: int) -> object:
        if i == 1:
            assert release.wait(WAIT_S)
        return sft_step(member, i)  # type: ignore[arg-type]  # a member answers as a session

    with _session(tmp_path / "sweep") as sess:
        panel = sess.panel(metrics=("loss:sum", "cursor"))
        try:
            panel.stop_polling()
            panel.tabs.selected_index = panel.tab_index("Sweep")
            sweep = sess.sweep(held_step, CONFIGS, 4)
            panel.refresh()
            tab = panel.sweep
            assert panel_settled(sess) is None  # the saved record waits for the sweep to settle
            paused = sweep.members[1]
            tab.controls[paused.model_id].buttons["pause"].click()
            assert paused.state is wb.RunState.PAUSED  # at once, before its step is done
            assert "paused" in tab.controls[paused.model_id].cells.value
            assert tab.controls[paused.model_id].buttons["resume"].disabled is False
            release.set()
            assert sweep.wait(WAIT_S) is wb.RunState.PAUSED
            assert paused.i < 4 and all(m.i == 4 for m in sweep.members if m is not paused)
            settled = panel_settled(sess)
            assert settled is not None  # settled: the record is rewritten, and again when it changes

            # bytes a round costs: every widget message the tab sends, counted as the comm sends it
            sent: list[int] = []
            for widget in _widgets(tab.widget):
                widget.comm.send = _counting(widget.comm.send, sent)
            tab.controls[paused.model_id].buttons["resume"].click()
            rounds_before = sweep.rounds
            while sweep.wait(0.05) is wb.RunState.RUNNING:
                panel.refresh()
            panel.refresh()
            rounds = max(1, sweep.rounds - rounds_before)
            per_round = sum(sent) / rounds
            print(f"sweep tab: {sum(sent)} bytes over {rounds} rounds, {per_round:.0f} per round")
            assert per_round <= BYTES_PER_STEP_BUDGET, per_round
            assert paused.i == 4 and tab.chart_renders >= 1
            assert panel_settled(sess) not in (None, settled)
        finally:
            panel.close()


def _widgets(root: object) -> list[object]:
    import ipywidgets

    found, pending = [], [root]
    while pending:
        widget = pending.pop()
        found.append(widget)
        pending.extend(getattr(widget, "children", ()))
    return [w for w in found if isinstance(w, ipywidgets.Widget) and w.comm is not None]


def _counting(send, sent: list[int]):  # type: ignore[no-untyped-def]
    import json

    def counted(data=None, metadata=None, buffers=None):  # type: ignore[no-untyped-def]
        sent.append(len(json.dumps(data, default=str)) + sum(len(b) for b in buffers or ()))
        return send(data=data, metadata=metadata, buffers=buffers)

    return counted


def test_clone_changes_are_name_value_pairs() -> None:
    assert parse_changes("learning_rate=3e-4, name=slow, loss_fn='ppo'") == {
        "learning_rate": 3e-4,
        "name": "slow",
        "loss_fn": "ppo",
    }
    assert parse_changes("  ") == {}
