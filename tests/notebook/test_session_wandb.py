"""Every step logged, at the Session level: the offline W&B run in the model folder, its id, resuming it,
the JSONL history next to it, and sinks that fail without breaking a step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import workbench as wb
from tests.datums import sft_datum
from workbench.metrics import STEP_METRIC, WandbSink

WAIT_S = 30.0


def _data(sess: wb.Session) -> list[wb.Datum]:
    return [sft_datum(sess.tokenizer, "User: Hello!", " Assistant: Hi there.")]


def _reward_step(sess: wb.Session, i: int) -> dict[str, float]:
    assert sess.current_run is not None
    sess.policy.forward_backward(_data(sess), "cross_entropy")
    sess.policy.optim_step(sess.current_run.adam_params).result()
    return {"reward:mean": 0.5 + i}


def test_without_a_key_the_session_run_is_offline_in_its_run_folder(no_wandb_credentials: Path) -> None:
    model_dir = no_wandb_credentials / "runs" / "tiny-offline-0001"
    sess = wb.Session("tiny", wb.LoraConfig(rank=4), model_dir=model_dir, wandb=None)
    try:
        sink = sess.wandb_run
        assert sink is not None
        assert (sink.mode, sink.run_id, sink.url) == ("offline", model_dir.name, None)
        assert sink.directory.parent == model_dir / "wandb"
        assert sink.directory.name.endswith(f"-{model_dir.name}")
        assert (
            sink._run.config["base_model"] == "tiny" and sink._run.config["lora"]["rank"] == 4
        )  # config, once

        logged: list[dict[str, Any]] = []
        log = sink._run.log
        sink._run.log = lambda data, **kwargs: (logged.append(dict(data)), log(data, **kwargs))[1]
        assert sess.run(_reward_step, steps=2).wait(WAIT_S) is wb.RunState.FINISHED
        prompt = wb.ModelInput.from_ints(sess.tokenizer("Hi").input_ids)
        sess.sampling_client().sample(prompt, 2, wb.SamplingParams(max_tokens=3, seed=0)).result()
        panel = sess.panel()
        panel.refresh()
        assert (
            f"offline {model_dir.name}" in panel.status.widget.value
            and "wandb sync" in panel.status.widget.value
        )
        panel.close()
    finally:
        sess.close()

    keyed = [
        (sorted(k for k in row if k != STEP_METRIC)[0].rsplit("/", 1)[0], row[STEP_METRIC]) for row in logged
    ]
    assert keyed == [
        ("policy/forward_backward", 0),
        ("policy/optim_step", 1),
        ("run/run_step", 0),
        ("policy/forward_backward", 1),
        ("policy/optim_step", 2),
        ("run/run_step", 1),
        ("policy/sample", 2),
    ]
    assert [row["run/run_step/reward:mean"] for row in logged if "run/run_step/reward:mean" in row] == [
        0.5,
        1.5,
    ]
    assert any(sink.directory.glob("*.wandb"))


def test_a_resumed_session_continues_the_run_and_the_jsonl_history(no_wandb_credentials: Path) -> None:
    model_dir = no_wandb_credentials / "runs" / "tiny-resume-0002"
    run_ids = []
    for _ in range(2):
        sess = wb.Session("tiny", wb.LoraConfig(rank=4), model_dir=model_dir, wandb=None)
        assert sess.wandb_run is not None
        run_ids.append(sess.wandb_run.run_id)
        sess.run(_reward_step, steps=1).wait(WAIT_S)
        sess.close()
    assert run_ids == [model_dir.name, model_dir.name]
    rows = [json.loads(line) for line in (model_dir / "history.jsonl").read_text().splitlines()]
    assert [row["op"] for row in rows] == ["forward_backward", "optim_step", "run_step"] * 2


def test_wandb_false_opens_no_run_and_still_writes_the_jsonl_history(no_wandb_credentials: Path) -> None:
    model_dir = no_wandb_credentials / "runs" / "tiny-off"
    with wb.Session("tiny", wb.LoraConfig(rank=4), model_dir=model_dir, wandb=False) as sess:
        assert sess.wandb_run is None
        sess.run(_reward_step, steps=1).wait(WAIT_S)
    assert not (model_dir / "wandb").exists()
    assert len((model_dir / "history.jsonl").read_text().splitlines()) == 3


class RaisingSink:
    def write(self, row: Any) -> None:
        raise ConnectionError("W&B is unreachable")

    def close(self) -> None:
        pass


def test_a_sink_that_raises_does_not_break_a_step(tiny: wb.Session) -> None:
    tiny.history.sinks.insert(0, RaisingSink())
    with pytest.warns(RuntimeWarning, match="RaisingSink failed"):
        out = tiny.policy.forward_backward(_data(tiny), "cross_entropy").result()
        assert tiny.policy.optim_step().result().applied
    assert out.metrics["loss:sum"] > 0 and tiny.step == 1
    assert [row["op"] for row in tiny.history] == ["forward_backward", "optim_step"]
    with pytest.warns(RuntimeWarning, match="RaisingSink failed"):
        run = tiny.run(_reward_step, steps=2)
        assert run.wait(WAIT_S) is wb.RunState.FINISHED
    assert tiny.history.series("reward:mean", op="run_step")[1] == [0.5, 1.5]
    lines = (tiny.model_dir / "history.jsonl").read_text().splitlines()
    assert len(lines) == len(tiny.history)  # the JSONL sink after the failing one still got every row


class OnlineRun:
    """Stands in for an online `wandb.Run`: what the sink and the status bar read."""

    offline = False
    id = "abc123"
    url = "https://wandb.ai/team/workbench/runs/abc123"

    def define_metric(self, name: str, step_metric: str | None = None) -> None:
        pass


def test_the_status_bar_links_an_online_run(tiny: wb.Session) -> None:
    tiny.wandb_run = WandbSink(OnlineRun())  # type: ignore[arg-type]
    panel = tiny.panel()
    try:
        assert (
            '<a href="https://wandb.ai/team/workbench/runs/abc123" target="_blank" rel="noopener">abc123</a>'
            in panel.status.widget.value
        )
    finally:
        panel.close()
