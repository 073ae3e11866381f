"""storage/run_listing.py and run_description.py: the model folders that short runs on the tiny model
leave under the models root, listed with their settings, notes, tags and metric summaries; and the
metrics summary (`metrics.summarize`) against the history by hand."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

import workbench as wb
from tests.datums import sft_datum
from workbench.metrics import summarize
from workbench.storage.run_description import SETTINGS_FILE
from workbench.storage.run_listing import RunListing


def _train(sess: wb.Session, steps: int, learning_rate: float) -> None:
    data = [sft_datum(sess.tokenizer, "User: Hello!", " Assistant: Hi there.")]

    def step(sess: wb.Session, i: int) -> dict[str, float]:
        sess.policy.forward_backward(data, "cross_entropy").result()
        sess.policy.optim_step(sess.current_run.adam_params).result()
        return {"reward:mean": float(i % 2)}

    run = sess.run(step, steps, adam_params=wb.AdamParams(learning_rate=learning_rate))
    assert run.wait(120) is wb.RunState.FINISHED


def _by_hand(history_file: Path, name: str) -> tuple[float, float, float]:
    values = [row[name] for row in map(json.loads, history_file.read_text().splitlines()) if name in row]
    return values[-1], min(values), max(values)


def test_the_listing_reads_every_model_folder_a_run_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))
    first = wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, wandb=False)
    try:
        _train(first, 3, 1e-2)
        first.describe(notes="baseline, high LR", tags=["sft", "baseline"])
    finally:
        first.close()
    second = wb.Session("tiny", wb.LoraConfig(rank=2, alpha=8), seed=1, wandb=False)
    try:
        _train(second, 2, 1e-4)
        second.describe(tags=["sft"])
        (tmp_path / "runs" / "not-a-model").mkdir()  # no run.json: not listed

        listing = RunListing()
        entries = listing.scan()
        assert [entry.model_id for entry in entries] == [second.model_id, first.model_id]  # newest first
        newest, oldest = entries
        assert (oldest.notes, oldest.tags) == ("baseline, high LR", ["sft", "baseline"])
        assert (newest.notes, newest.tags) == ("", ["sft"])
        assert (oldest.base_model, oldest.lora["rank"], newest.lora["rank"], newest.lora["alpha"]) == (
            "tiny",
            4,
            2,
            8.0,
        )
        assert (oldest.learning_rate, newest.learning_rate) == (1e-2, 1e-4)
        assert oldest.settings["policy"]["adam_params"] == dataclasses.asdict(
            wb.AdamParams(learning_rate=1e-2)
        )
        assert oldest.settings["policy"]["loss"] == {"loss_fn": "cross_entropy", "loss_fn_config": {}}
        assert (oldest.loss_fn, oldest.last_step, newest.last_step) == ("cross_entropy", 3, 2)
        for entry in entries:
            for name in ("loss:sum", "reward:mean", "grad_norm", "system/rss_mb"):
                summary = entry.metric(name)
                assert (summary.last, summary.min, summary.max) == pytest.approx(
                    _by_hand(entry.folder / "history.jsonl", name)
                )
        assert oldest.metric("reward:mean").count == 3
        assert math.isnan(oldest.metric("no such metric").last)

        assert [e.model_id for e in entries if e.matches("BASELINE sft")] == [first.model_id]
        assert [e.model_id for e in entries if e.matches("tiny")] == [second.model_id, first.model_id]

        # a live run's history is read on from where the last scan stopped
        _train(second, 1, 3e-4)
        again = {entry.model_id: entry for entry in listing.scan()}
        assert again[second.model_id].metric("reward:mean").count == 3
        assert again[second.model_id].learning_rate == 3e-4
        assert again[second.model_id].last_step == 3
        assert again[first.model_id].metrics == oldest.metrics
    finally:
        second.close()


def test_settings_follow_what_the_model_trains_with(tiny: wb.Session) -> None:
    data = [sft_datum(tiny.tokenizer, "User: Hello!", " Assistant: Hi there.")]
    path = tiny.model_dir / SETTINGS_FILE
    tiny.policy.forward_backward(data, "cross_entropy").result()
    tiny.policy.optim_step(wb.AdamParams(learning_rate=1e-3)).result()
    written = path.stat().st_mtime_ns, json.loads(path.read_text())
    tiny.policy.forward_backward(data, "cross_entropy").result()
    tiny.policy.optim_step(wb.AdamParams(learning_rate=1e-3)).result()
    assert (path.stat().st_mtime_ns, json.loads(path.read_text())) == written  # unchanged: not rewritten
    tiny.policy.forward_backward_custom(
        data, lambda d, logprobs: (-sum(lp.sum() for lp in logprobs), {})
    ).result()
    settings = json.loads(path.read_text())["policy"]
    assert settings["loss"]["loss_fn"].startswith("custom: ")
    assert settings["adam_params"]["learning_rate"] == 1e-3


def test_the_summary_is_each_metrics_last_least_and_greatest() -> None:
    rows = [
        {"step": 0, "op": "forward_backward", "model": "policy", "time": 0.0, "loss:sum": 3.0},
        {"step": 0, "op": "sample", "model": "policy", "time": 1.0, "reward:mean": 0.25},
        {"step": 1, "op": "forward_backward", "model": "policy", "time": 2.0, "loss:sum": math.nan},
        {
            "step": 1,
            "op": "forward_backward",
            "model": "policy",
            "time": 3.0,
            "loss:sum": 1.0,
            "discarded": True,
        },
        {"step": 2, "op": "forward_backward", "model": "policy", "time": 4.0, "loss:sum": 2.0},
    ]
    summary = summarize(rows[:3])
    assert list(summary) == ["loss:sum", "reward:mean"]
    assert math.isnan(summary["loss:sum"].last) and (summary["loss:sum"].min, summary["loss:sum"].max) == (
        3.0,
        3.0,
    )
    summarize(rows[3:], into=summary)  # carried on
    loss = summary["loss:sum"]
    assert (loss.last, loss.min, loss.max, loss.count) == (2.0, 2.0, 3.0, 3)  # the discarded row left out
    assert (summary["reward:mean"].last, summary["reward:mean"].count) == (0.25, 1)
