"""tinker-cookbook's own training loops, unmodified, against `wb.ServiceClient` on the `tiny` model.

The only changes to the cookbook's world: `tinker.ServiceClient` is `wb.ServiceClient`, and the
cookbook's model-pricing download (`tinker_cookbook.utils.cost_estimation`) answers "no pricing"
without touching the network. The base model is the built-in `tiny` model's folder (the cookbook loads
its tokenizer from there), rendered with the cookbook's `qwen3_instruct` renderer (ChatML, as `tiny`'s
tokenizer). Everything else (datasets, rollouts, KL penalty, checkpoints, resume) is the cookbook's.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
import tinker
import tinker_cookbook
from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
from tinker_cookbook.rl import train as rl_train
from tinker_cookbook.supervised import train as sl_train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig
from tinker_cookbook.utils import cost_estimation

import workbench as wb
from workbench.engine.model.base_model import resolve_model_path

RENDERER = "qwen3_instruct"


@pytest.fixture
def cookbook(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """`tinker.ServiceClient` is ours; the pricing download is never reached; runs go to `tmp_path`."""
    monkeypatch.setattr(tinker, "ServiceClient", wb.ServiceClient)
    monkeypatch.setattr(cost_estimation, "load_model_pricing", lambda **_: None)
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))
    return tmp_path


def _rows(log_path: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (log_path / name).read_text().splitlines()]


def _sl_config(log_path: Path, *, num_epochs: int, max_steps: int) -> sl_train.Config:
    model = resolve_model_path("tiny")
    conversations = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    return sl_train.Config(
        log_path=str(log_path),
        model_name=model,
        recipe_name="workbench_test",
        renderer_name=RENDERER,
        dataset_builder=FromConversationFileBuilder(
            file_path=str(conversations),
            common_config=ChatDatasetBuilderCommonConfig(
                model_name_for_tokenizer=model, renderer_name=RENDERER, max_length=128, batch_size=32
            ),
        ),
        learning_rate=1e-2,
        lr_schedule="constant",
        lora_rank=4,
        num_epochs=num_epochs,
        max_steps=max_steps,
        save_every=0,
        eval_every=0,
    )


def test_supervised_loop_trains_and_resumes_from_its_saved_state(cookbook: Path) -> None:
    log_path = cookbook / "sl"
    # 128 conversations in batches of 32: 4 steps an epoch. Two steps, then the loop's final checkpoint.
    asyncio.run(sl_train.main(_sl_config(log_path, num_epochs=1, max_steps=2)))
    first = _rows(log_path, "checkpoints.jsonl")
    assert [record["name"] for record in first] == ["final"]
    first_run = tinker.ParsedCheckpointTinkerPath.from_tinker_path(first[0]["state_path"]).training_run_id

    # A second epoch: the loop resumes from the saved state (weights and optimizer) in a new run.
    asyncio.run(sl_train.main(_sl_config(log_path, num_epochs=2, max_steps=6)))
    records = _rows(log_path, "checkpoints.jsonl")
    final = records[-1]["state_path"]
    resumed_run = tinker.ParsedCheckpointTinkerPath.from_tinker_path(final).training_run_id
    assert resumed_run != first_run  # a new run: its "final" did not collide with the first run's

    metrics = _rows(log_path, "metrics.jsonl")
    steps = [row["step"] for row in metrics if "train_mean_nll" in row]
    assert steps == [0, 1, 4, 5] and all(isinstance(step, int) for step in steps)
    nll = [row["train_mean_nll"] for row in metrics if "train_mean_nll" in row]
    assert all(math.isfinite(value) for value in nll) and nll[-1] < nll[0]
    # The resumed run kept the optimizer's step count: 2 steps before the resume, 2 after.
    with wb.Session.from_checkpoint(final, wandb=False) as resumed:
        assert resumed.step == 4
    # The run metadata the cookbook attached (its renderer) is what the REST client returns.
    rest = wb.ServiceClient().create_rest_client()
    assert rest.get_training_run_by_tinker_path(final).result().user_metadata == {"renderer_name": RENDERER}


def _rl_config(log_path: Path, **overrides: object) -> rl_train.Config:
    model = resolve_model_path("tiny")
    settings: dict = {
        "learning_rate": 1e-3,
        "dataset_builder": ArithmeticDatasetBuilder(
            batch_size=2, model_name_for_tokenizer=model, renderer_name=RENDERER, n_batches=2, group_size=4
        ),
        "model_name": model,
        "recipe_name": "workbench_test",
        "renderer_name": RENDERER,
        "max_tokens": 6,
        "log_path": str(log_path),
        "lora_rank": 4,
        "eval_every": 0,
        "save_every": 0,
        "num_groups_to_log": 0,
        "rollout_json_export": False,
        "kl_penalty_coef": 0.1,
        "kl_reference_config": rl_train.KLReferenceConfig(base_model=model),
    }
    settings.update(overrides)
    return rl_train.Config(**settings)


def test_rl_loop_with_kl_penalty_on_arithmetic(cookbook: Path) -> None:
    log_path = cookbook / "rl"
    asyncio.run(rl_train.main(_rl_config(log_path)))
    steps = [row for row in _rows(log_path, "metrics.jsonl") if "env/all/reward/total" in row]
    assert [row["step"] for row in steps] == [0, 1]
    assert all("kl_policy_base" in row and math.isfinite(row["kl_policy_base"]) for row in steps)
    assert _rows(log_path, "checkpoints.jsonl")[-1]["name"] == "final"


def test_async_rl_loop_trains_with_stable_reinforce(cookbook: Path) -> None:
    """The cookbook's asynchronous loop: `stable_reinforce` by default, on samples it drew with
    `record_stability_info=True`, naming them in the datums' provenance spans."""
    log_path = cookbook / "rl_async"
    config = _rl_config(
        log_path, async_config=rl_train.AsyncConfig(max_steps_off_policy=1, groups_per_batch=2)
    )
    assert config.training_loss_fn() == "stable_reinforce"
    asyncio.run(rl_train.main(config))
    steps = [row for row in _rows(log_path, "metrics.jsonl") if "env/all/reward/total" in row]
    assert len(steps) == 2
    assert _rows(log_path, "checkpoints.jsonl")[-1]["name"] == "final"
