"""tinker-cookbook recipes whose second model is another base model, unmodified, in-process and over
the server: on-policy distillation from a teacher of another base model, RL with a KL penalty against a
reference of another base model (`KLReferenceConfig(base_model=...)`), and rubric RL graded by an LLM on
another base model. The student is `tiny`; the other base model is its 3-layer twin (`tiny_teacher`).

In-process the recipes' `tinker.ServiceClient` is the session's service client, which loads the other
base model into the session on first use; over HTTP the session's server (`sess.serve()`, on 127.0.0.1)
loads it when the recipe first names it by its folder, as it would an HF id in the local HF cache.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import tinker
from tinker_cookbook.recipes.distillation import on_policy_distillation
from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
from tinker_cookbook.recipes.rubric import train as rubric_train
from tinker_cookbook.rl import train as rl_train
from tinker_cookbook.utils import cost_estimation

import workbench as wb
from tests.promises.conftest import SdkClients
from tests.promises.test_cookbook_distillation import GROUPS_PER_BATCH, _deepmath_cache
from workbench.engine.model.base_model import resolve_model_path

STEPS = 3


@pytest.fixture
def sess(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, sdk_clients: SdkClients) -> Iterator[wb.Session]:
    monkeypatch.setenv("TINKER_API_KEY", "tml-local")
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))
    monkeypatch.setattr(cost_estimation, "load_model_pricing", lambda **_: None)  # no pricing download
    session = wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, wandb=False)
    yield session
    sdk_clients.close()  # while the session's server still answers
    session.close()


def _mode(sess: wb.Session, mode: str, monkeypatch: pytest.MonkeyPatch) -> str | None:
    """The recipe's base_url: None in-process (the session's service client stands in for the SDK's);
    the session's server over HTTP, which loads the other base model when the recipe first names it."""
    if mode == "in-process":
        monkeypatch.setattr(tinker, "ServiceClient", sess.service_client)
        return None
    url = sess.serve().url
    monkeypatch.setenv("TINKER_BASE_URL", url)  # for recipe parts that take no base_url (the grader)
    return url


def _metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def _other_engine(sess: wb.Session, other: str) -> wb.Engine:
    """The other base model's engine, loaded beside the session's (over HTTP by the recipe's first
    request naming it)."""
    assert sess.base_models is not None
    engines = {engine.base_info.path: engine for engine in sess.base_models.engines()}
    assert list(engines)[1:] == [other]
    return engines[other]


@pytest.mark.parametrize("mode", ["in-process", "over-http"])
def test_on_policy_distillation_from_a_teacher_of_another_base_model(
    sess: wb.Session, tiny_teacher: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    _deepmath_cache(tmp_path / "datasets", monkeypatch)
    base_url = _mode(sess, mode, monkeypatch)
    config = on_policy_distillation.CLIConfig(
        model_name=resolve_model_path("tiny"),
        renderer_name="qwen3_instruct",
        teacher_model=tiny_teacher,
        dataset="deepmath",
        lora_rank=4,
        group_size=2,
        groups_per_batch=GROUPS_PER_BATCH,
        learning_rate=1e-2,
        max_tokens=8,
        eval_every=0,
        save_every=0,
        log_path=str(tmp_path / "log"),
        behavior_if_log_dir_exists="delete",
        max_steps=STEPS,
        base_url=base_url,
    )
    asyncio.run(on_policy_distillation.cli_main(config))
    teacher_kl = [row["teacher_kl"] for row in _metrics(tmp_path / "log")]
    assert len(teacher_kl) == STEPS and all(math.isfinite(kl) for kl in teacher_kl)
    _other_engine(sess, tiny_teacher)  # the teacher scored on its own base
    student_steps = [r for r in sess.history if r["op"] == "optim_step" and r["model"] != "policy"]
    assert len(student_steps) == STEPS


@pytest.mark.parametrize("mode", ["in-process", "over-http"])
def test_rl_with_a_kl_reference_of_another_base_model(
    sess: wb.Session, tiny_teacher: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    base_url = _mode(sess, mode, monkeypatch)
    model = resolve_model_path("tiny")
    config = rl_train.Config(
        learning_rate=1e-3,
        dataset_builder=ArithmeticDatasetBuilder(
            batch_size=2,
            model_name_for_tokenizer=model,
            renderer_name="qwen3_instruct",
            n_batches=2,
            group_size=2,
        ),
        model_name=model,
        recipe_name="rl_kl_other_base",
        max_tokens=4,
        lora_rank=4,
        log_path=str(tmp_path / "rl"),
        base_url=base_url,
        kl_penalty_coef=0.1,
        kl_reference_config=rl_train.KLReferenceConfig(base_model=tiny_teacher),
        save_every=0,
        eval_every=0,
    )
    asyncio.run(rl_train.main(config))
    rows = [row for row in _metrics(tmp_path / "rl") if "env/all/reward/total" in row]
    assert len(rows) == 2
    assert all(math.isfinite(row["kl_policy_base"]) and row["kl_policy_base"] != 0 for row in rows)
    _other_engine(sess, tiny_teacher)  # the reference scored on its own base


RUBRIC = {
    "rubric_str": "The answer names a fruit.",
    "extraction_regex": r"<score>(.*?)</score>",
    "grader_output_format_instruction": "Please output your score between 0 and 1 wrapped in <score> ... </score>",
}


@pytest.mark.parametrize("mode", ["in-process", "over-http"])
def test_rubric_rl_graded_by_an_llm_on_another_base_model(
    sess: wb.Session, tiny_teacher: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    rows = [
        {"convo": [{"role": "user", "content": f"Name a fruit ({i})."}], "rubric_items": [RUBRIC]}
        for i in range(4)
    ]
    data = tmp_path / "rubric.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    base_url = _mode(sess, mode, monkeypatch)
    config = rubric_train.CLIConfig(
        model_name=resolve_model_path("tiny"),
        renderer_name="qwen3_instruct",
        lora_rank=4,
        train_group_size=2,
        groups_per_batch=2,
        max_tokens=8,
        grader_llm_name=tiny_teacher,
        grader_renderer_name="qwen3_instruct",
        train_jsonl_path=str(data),
        test_jsonl_path=str(data),
        eval_every=0,
        save_every=0,
        log_path=str(tmp_path / "log"),
        behavior_if_log_dir_exists="delete",
        max_steps=1,
        base_url=base_url,
    )
    asyncio.run(rubric_train.cli_main(config))
    rows_logged = [row for row in _metrics(tmp_path / "log") if "env/all/reward/total" in row]
    assert len(rows_logged) == 1
    grader = _other_engine(sess, tiny_teacher)
    assert any(row["op"] == "sample" for row in grader.history)  # the grader answered on its own base
