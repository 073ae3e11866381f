"""The metrics history's sinks: the JSONL file and W&B runs (offline only; nothing here goes online)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from workbench.metrics import STEP_METRIC, JsonlSink, MetricsHistory, WandbSink, open_wandb_run


def fill(history: MetricsHistory) -> None:
    """Two micro-batches and a held-out forward at step 0, the optimizer step, then step 1."""
    history.record("forward_backward", "policy", 0, {"loss:sum": 2.0, "tokens": 8})
    history.record("forward_backward", "policy", 0, {"loss:sum": 1.5, "tokens": 6})
    history.record("forward", "policy", 0, {"loss:sum": 2.5})
    history.record("optim_step", "policy", 1, {"grad_norm": 0.7})
    history.record("forward_backward", "policy", 1, {"loss:sum": math.nan, "tokens": 8})


# ------------------------------------------------------------------------------------------------ JSONL


def test_jsonl_sink_writes_each_row_as_it_is_recorded(tmp_path: Path) -> None:
    path = tmp_path / "run" / "metrics.jsonl"
    history = MetricsHistory()
    sink = JsonlSink(path)
    history.sinks.append(sink)
    history.record("forward_backward", "policy", 0, {"loss:sum": 2.0})
    assert json.loads(path.read_text()) == history.rows[0]  # flushed before close

    history.rows.clear()
    fill(history)
    sink.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 1 + len(history)
    read_back = [json.loads(line) for line in lines[1:]]
    assert read_back[:-1] == history.rows[:-1]
    assert math.isnan(read_back[-1]["loss:sum"])
    assert {k: v for k, v in read_back[-1].items() if k != "loss:sum"} == {
        k: v for k, v in history.rows[-1].items() if k != "loss:sum"
    }


def test_jsonl_sink_appends_to_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    for step in range(2):
        sink = JsonlSink(path)
        sink.write({"step": step, "op": "optim_step", "model": "policy", "time": 0.0})
        sink.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1]


# ------------------------------------------------------------------------------------ W&B, without I/O


class RecordingRun:
    """Stands in for a `wandb.Run`: records what the sink asks of it."""

    def __init__(self) -> None:
        self.defined: list[tuple[str, str | None]] = []
        self.logged: list[tuple[dict[str, Any], dict[str, Any]]] = []
        self.summary: dict[str, Any] = {}

    def define_metric(self, name: str, step_metric: str | None = None) -> None:
        self.defined.append((name, step_metric))

    def log(self, data: dict[str, Any], **kwargs: Any) -> None:
        self.logged.append((data, kwargs))


def test_wandb_sink_logs_every_row_against_the_optimizer_step() -> None:
    run = RecordingRun()
    history = MetricsHistory()
    history.sinks.append(WandbSink(run))  # type: ignore[arg-type]
    fill(history)
    history.record("forward", "critic", 1, {"loss:sum": 0.3})

    assert len(run.logged) == len(history)  # rows sharing a step are all kept
    assert all(kwargs == {} for _, kwargs in run.logged)  # no explicit W&B step that would drop them
    assert run.logged[0][0] == {
        "policy/forward_backward/loss:sum": 2.0,
        "policy/forward_backward/tokens": 8.0,
        STEP_METRIC: 0,
    }
    assert run.logged[2][0] == {"policy/forward/loss:sum": 2.5, STEP_METRIC: 0}
    assert run.logged[3][0] == {"policy/optim_step/grad_norm": 0.7, STEP_METRIC: 1}
    assert run.defined == [(STEP_METRIC, None), ("policy/*", STEP_METRIC), ("critic/*", STEP_METRIC)]


def test_wandb_sink_puts_events_in_the_summary() -> None:
    run = RecordingRun()
    sink = WandbSink(run)  # type: ignore[arg-type]
    sink.log_event("checkpoint", {"name": "a", "step": 3})
    sink.log_event("checkpoint", {"name": "b", "step": 5})
    assert run.summary == {"event/checkpoint": {"name": "b", "step": 5}}


def test_open_wandb_run_rejects_other_settings(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="wandb must be"):
        open_wandb_run("offline", config={}, run_id=None, project="p", directory=tmp_path)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------- W&B, offline runs


@pytest.fixture
def wandb_dir(no_wandb_credentials: Path) -> Path:
    """Where the tests' W&B runs go (`open_wandb_run`'s `directory`)."""
    return no_wandb_credentials / "runs"


def test_wandb_off_opens_nothing(wandb_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kwargs: dict[str, Any] = {"config": {}, "run_id": "off", "project": "p", "directory": wandb_dir}
    assert open_wandb_run(False, **kwargs) is None
    assert open_wandb_run({"mode": "disabled"}, **kwargs) is None
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert open_wandb_run(None, **kwargs) is None
    assert not wandb_dir.exists()


def test_without_credentials_the_run_is_offline(wandb_dir: Path) -> None:
    sink = open_wandb_run(
        None, config={"seed": 0}, run_id="wbtest01", project="workbench-tests", directory=wandb_dir
    )
    assert sink is not None
    history = MetricsHistory()
    history.sinks.append(sink)
    fill(history)
    sink.log_event("checkpoint", {"name": "first", "step": 1})
    sink.close()

    assert (sink.mode, sink.run_id, sink.url) == ("offline", "wbtest01", None)
    assert sink.directory.parent == wandb_dir / "wandb"
    assert sink.directory.name.startswith("offline-run-")
    assert sink.directory.name.endswith("-wbtest01")
    assert any(sink.directory.glob("*.wandb"))


def test_wandb_environment_variables_win_over_workbench_defaults(
    wandb_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    elsewhere = wandb_dir.parent / "wandb-env-dir"
    elsewhere.mkdir()
    monkeypatch.setenv("WANDB_DIR", str(elsewhere))
    sink = open_wandb_run(None, config={}, run_id="wbenv01", project="workbench-tests", directory=wandb_dir)
    assert sink is not None
    sink.close()
    assert sink.directory.parent == elsewhere / "wandb"
    assert not wandb_dir.exists()


def test_a_failing_wandb_sink_never_breaks_recording(wandb_dir: Path) -> None:
    sink = open_wandb_run(
        {"mode": "offline"}, config={}, run_id=None, project="workbench-tests", directory=wandb_dir
    )
    assert sink is not None
    sink.close()  # logging to a finished run raises
    history = MetricsHistory()
    history.sinks.append(sink)
    with pytest.warns(RuntimeWarning, match="WandbSink failed"):
        row = history.record("forward_backward", "policy", 0, {"loss:sum": 1.0})
    assert history.rows == [row]


def test_a_resumed_session_continues_the_same_run(wandb_dir: Path) -> None:
    run_ids = []
    for _ in range(2):
        sink = open_wandb_run(
            None, config={"seed": 0}, run_id="wbresume", project="workbench-tests", directory=wandb_dir
        )
        assert sink is not None
        sink.write({"step": 0, "op": "optim_step", "model": "policy", "time": 0.0, "grad_norm": 1.0})
        sink.close()
        run_ids.append(sink.run_id)
    assert run_ids == ["wbresume", "wbresume"]
    assert len(list((wandb_dir / "wandb").glob("offline-run-*-wbresume"))) >= 1
