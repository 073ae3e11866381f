"""panel/runs_tab.py and alerts: the Runs tab over model folders that short runs on the tiny model left
(sort, filter, overlay in one click, this session's metrics summed up), and a trigger's alert in the
panel and in W&B (an offline run, read back from its run file)."""

from __future__ import annotations

import html
import math
import re
import struct
from pathlib import Path

import pytest

import workbench as wb
from tests.datums import sft_datum
from workbench.metrics import summarize
from workbench.notebook.alerts import ALERT_TITLE

WAIT_S = 120.0


def _step(sess: wb.Session, i: int) -> dict[str, float]:
    data = [sft_datum(sess.tokenizer, "User: Hello!", " Assistant: Hi there.")]
    sess.policy.forward_backward(data, "cross_entropy").result()
    sess.policy.optim_step(sess.current_run.adam_params).result()
    return {"reward:mean": 0.25 * i}


def _trained(steps: int, learning_rate: float, notes: str, tags: list[str]) -> str:
    sess = wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, wandb=False)
    try:
        run = sess.run(_step, steps, adam_params=wb.AdamParams(learning_rate=learning_rate))
        assert run.wait(WAIT_S) is wb.RunState.FINISHED
        sess.describe(notes=notes, tags=tags)
        return sess.model_id
    finally:
        sess.close()


def _shown_ids(panel: wb.Panel) -> list[str]:
    return [entry.model_id for entry in panel.runs.visible_entries()]


def test_the_runs_tab_sorts_filters_and_overlays_runs_in_one_click(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))
    slow = _trained(2, 1e-4, "a slow baseline", ["baseline"])
    fast = _trained(3, 1e-2, "fast", ["sweep"])
    sess = wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, wandb=False)
    panel = sess.panel(metrics=("loss:sum",))
    try:
        panel.stop_polling()  # the test refreshes
        assert sess.run(_step, 1, adam_params=wb.AdamParams(learning_rate=1e-3)).wait(WAIT_S) is (
            wb.RunState.FINISHED
        )
        panel.tabs.selected_index = panel.tab_index("Runs")
        panel.refresh()
        runs = panel.runs
        assert _shown_ids(panel) == [sess.model_id, fast, slow]  # newest first
        rows = [row.children[1].value for row in runs.rows.children]
        # the settings in full in the cells' tooltips
        assert "policy: {&quot;beta1&quot;: 0.9," in rows[1] and "&quot;learning_rate&quot;: 0.01" in rows[1]
        assert (
            "policy: {&quot;loss_fn&quot;: &quot;cross_entropy&quot;, &quot;loss_fn_config&quot;: {}}"
            in rows[1]
        )
        assert "● " + sess.model_id in rows[0] and "a slow baseline" in rows[2] and "cross_entropy" in rows[1]

        runs.sort_by("lr")
        assert _shown_ids(panel) == [slow, sess.model_id, fast]  # ascending at first
        runs.headers[[c.title for c in runs_columns()].index("lr")].click()  # the header again: reversed
        assert _shown_ids(panel) == [fast, sess.model_id, slow]
        assert "lr ▼" in [button.description for button in runs.headers]
        runs.metric.value = "reward:mean"
        runs.sort_by("max")
        assert _shown_ids(panel)[-1] == fast  # 0.5, above the others' 0.25 and 0

        runs.filter.value = "BASELINE"
        assert _shown_ids(panel) == [slow]
        runs.filter.value = "tiny cross_entropy"
        assert len(_shown_ids(panel)) == 3
        runs.filter.value = ""

        for row in runs.rows.children:  # tick two rows as a user does
            if any(model_id in row.children[1].value for model_id in (slow, fast)):
                row.children[0].value = True
        assert runs.selected == {slow, fast}
        runs.overlay_button.click()
        assert runs.feedback.text == "overlaid 2 runs in Metrics", runs.feedback.text
        assert panel.tabs.selected_index == panel.tab_index("Metrics")
        assert set(panel.metrics.compared) == {slow, fast}
        labels = set(panel.metrics.plot.lines["loss:sum"])
        assert {f"{slow} policy/forward_backward", f"{fast} policy/forward_backward"} <= labels

        runs.select([fast])  # one fewer, one click
        runs.overlay_button.click()
        assert set(panel.metrics.compared) == {fast}

        # every metric of this session, with its last / min / max
        panel.tabs.selected_index = panel.tab_index("Runs")
        panel.refresh()
        own = next(entry for entry in runs.entries if entry.model_id == sess.model_id)
        assert own.last_step == 1
        # a run that ends is read again without a click
        assert sess.run(_step, 1).wait(WAIT_S) is wb.RunState.FINISHED
        panel.refresh()
        own = next(entry for entry in runs.entries if entry.model_id == sess.model_id)
        assert own.last_step == 2
        summary = html.unescape(runs.summary.value)
        expected = sess.history.summary()
        assert expected == summarize(sess.history.rows)
        assert "grad_norm/" in summary and "system/rss_mb" in summary
        for name in ("loss:sum", "grad_norm", "learning_rate", "reward:mean", "system/rss_mb"):
            cells = re.search(rf"<td[^>]*>{re.escape(name)}</td>((?:<td[^>]*>[^<]*</td>){{4}})", summary)
            assert cells is not None, name
            values = re.findall(r"<td[^>]*>([^<]*)</td>", cells.group(1))
            s = expected[name]
            assert values == [f"{s.last:.4g}", f"{s.min:.4g}", f"{s.max:.4g}", str(s.count)]
        module = next(n for n in expected if n.startswith("update_norm/"))
        assert module in summary and math.isfinite(expected[module].last)

        # the per-module norms are one family in the Metrics tab: one plot, a line per module
        metrics = panel.metrics
        metrics.refresh()
        assert {"grad_norm/*", "update_norm/*"} <= set(metrics.add_metric.options)
        metrics.add("update_norm/*")
        modules = [n.split("/", 1)[1] for n in expected if n.startswith("update_norm/")]
        own = {
            label: line
            for label, line in metrics.plot.lines["update_norm/*"].items()
            if not label.startswith("tiny-")
        }
        assert sorted(own) == sorted(f"policy/optim_step {module}" for module in modules)
        line = own[f"policy/optim_step {modules[0]}"]
        assert list(line.get_ydata()) == sess.history.series(f"update_norm/{modules[0]}")[1]
        assert metrics.plot.axes["update_norm/*"].get_legend() is not None  # a line a layer: a legend
    finally:
        panel.close()
        sess.close()


def test_a_run_that_stopped_before_its_end_is_offered_for_resuming(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another kernel's folder whose run stopped at step 2 of 6 (its last run checkpoint has steps left)
    is marked in the step cell, and the line under the table gives the call that resumes it; a run
    that finished is not marked."""
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))
    finished = _trained(1, 1e-3, "done", [])

    def stopping(sess: wb.Session, i: int) -> dict[str, float]:
        metrics = _step(sess, i)
        if i == 1:
            sess.current_run.stop()
        return metrics

    stopped = wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, wandb=False)
    try:
        assert stopped.run(stopping, 6, save_every=2).wait(WAIT_S) is wb.RunState.STOPPED
        folder = stopped.model_dir
    finally:
        stopped.close()
    sess = wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, wandb=False)
    panel = sess.panel(metrics=("loss:sum",))
    try:
        panel.stop_polling()
        panel.tabs.selected_index = panel.tab_index("Runs")
        panel.refresh()
        runs = panel.runs
        cells = {
            entry.model_id: row.children[1].value
            for entry, row in zip(runs.visible_entries(), runs.rows.children, strict=True)
        }
        call = f"wb.Session.from_checkpoint({str(folder)!r}) resumes it"
        assert "2 ⏸" in cells[folder.name] and html.escape(call) in cells[folder.name]
        assert "⏸" not in cells[finished] and "⏸" not in cells[sess.model_id]
        line = html.unescape(runs.stopped.value)
        assert f"{folder.name}: run stopped at step 2 of 6: {call}" in re.sub("<[^>]+>", "", line)
        assert finished not in line
    finally:
        panel.close()
        sess.close()


def runs_columns():
    from workbench.notebook.panel.runs_tab import COLUMNS

    return COLUMNS


def _wandb_records(run_file: Path) -> list[bytes]:
    """The records of a W&B run file (`.wandb`): LevelDB's log format after W&B's 7-byte header, 32 KiB
    blocks of chunks, each with a 7-byte header (CRC, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    raw, block, position = run_file.read_bytes(), 32768, 7
    records, pending = [], b""
    while position + 7 <= len(raw):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[position : position + 7])
        pending += raw[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            records.append(pending)
            pending = b""
    return records


def test_a_trigger_that_pauses_a_run_alerts_the_panel_and_wandb(no_wandb_credentials: Path) -> None:
    import wandb
    from wandb.proto import wandb_internal_pb2

    sess = wb.Session(
        "tiny", wb.LoraConfig(rank=4), seed=0, model_dir=no_wandb_credentials / "runs" / "alerted"
    )
    panel = sess.panel()
    try:
        panel.stop_polling()
        sink = sess.wandb_run
        assert sink is not None and sink.mode == "offline"
        run_files = sink.directory
        sess.describe(notes="alert test", tags=["alerts"])
        assert (sink._run.notes, sink._run.tags) == ("alert test", ("alerts",))
        panel.refresh()
        assert (panel.alert.banner.value, panel.alert.script.outputs) == ("", ())

        def spike_at_step_1(sess: wb.Session, i: int) -> dict[str, float]:
            _step(sess, i)
            return {"reward:mean": 0.25 if i == 1 else 0.0}

        run = sess.run(spike_at_step_1, 3, pause_if={"reward:mean": ("above", 0.1)})
        assert run.wait(WAIT_S) is wb.RunState.PAUSED and run.i == 2  # paused after step 1
        panel.refresh()
        banner = html.unescape(panel.alert.banner.value)
        assert ALERT_TITLE in banner and "reward:mean = 0.25 (above 0.1) at run step 1" in banner
        (output,) = panel.alert.script.outputs
        script = output["data"]["application/javascript"]
        assert "apputils:notify" in script and "reward:mean = 0.25" in script
        panel.refresh()
        assert panel.alert.alerts == 1  # one alert per trigger, not per refresh

        run.resume()
        assert run.wait(WAIT_S) is wb.RunState.FINISHED
        panel.refresh()
        assert (panel.alert.banner.value, panel.alert.script.outputs) == ("", ())
    finally:
        panel.close()
        sess.close()  # finishes the offline W&B run: its file is complete

    (run_file,) = run_files.glob("*.wandb")
    wandb.teardown()  # W&B's service writes out the run file as it stops (a finished run's, 7 bytes till then)
    alerts = []
    for data in _wandb_records(run_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "alert":
            alerts.append(record.alert)
    assert [(a.title, a.level) for a in alerts] == [(ALERT_TITLE[:63], "WARN")]
    assert alerts[0].text.startswith("alerted: reward:mean = 0.25 (above 0.1) at run step 1")
