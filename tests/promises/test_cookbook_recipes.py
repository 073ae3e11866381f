"""The tinker-cookbook 0.6.1 recipes the other promise tests do not run, unmodified, in-process and over
the session's server: multi-teacher on-policy distillation (two teachers, each on its own base model),
twenty questions (the answerer on another base model), off-policy reasoning distillation, the RL
numerics check (a tool-calling environment) and the true-thinking score.

What stands in for what they download: the tiny model and its twins (`build_tiny_twin`: another
depth, other weights, 4,096 positions where a 20-turn game or a 2,048-token reasoning trace needs
them) for their models, and a few local rows for their datasets (each recipe's own `load_dataset`
answers them). Twenty questions and the true-thinking score pick a renderer from their model's name,
so those models are local folders named like the HF ids, relative to the working directory. Twenty
questions' default answerer, Qwen3.5, has a renderer that needs Qwen3.5's tokenizer (`</think>` as one
token), so its answerer is a `Qwen/Qwen3-8B` folder.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import chz
import datasets
import pytest
from tinker_cookbook.distillation import datasets as distillation_datasets
from tinker_cookbook.recipes.distillation import off_policy_reasoning, on_policy_multi_teacher
from tinker_cookbook.recipes.multiplayer_rl.twenty_questions import train as twenty_questions
from tinker_cookbook.recipes.rl_numerics_check import env as numerics_env
from tinker_cookbook.recipes.rl_numerics_check import train as rl_numerics_check
from tinker_cookbook.recipes.true_thinking_score import run_small_experiment as true_thinking_score
from tinker_cookbook.rl import train as rl_train
from tinker_cookbook.utils import cost_estimation

import workbench as wb
from tests.conftest import build_tiny_twin
from tests.promises.conftest import SdkClients
from tests.promises.test_cookbook_multi_base import _metrics, _mode
from workbench.engine.model.base_model import resolve_model_path

MODES = ["in-process", "over-http"]
OpenSession = Callable[[str], wb.Session]


@pytest.fixture
def open_session(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, sdk_clients: SdkClients
) -> Iterator[OpenSession]:
    """Opens the recipe's session on a base model; the SDK's clients close before it does."""
    monkeypatch.setenv("TINKER_API_KEY", "tml-local")
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))
    monkeypatch.setattr(cost_estimation, "load_model_pricing", lambda **_: None)  # no pricing download
    sessions: list[wb.Session] = []

    def open_session(base_model: str) -> wb.Session:
        sessions.append(wb.Session(base_model, wb.LoraConfig(rank=4), seed=0, wandb=False))
        return sessions[-1]

    yield open_session
    sdk_clients.close()  # while the sessions' servers still answer
    for session in sessions:
        session.close()


def _base_models(sess: wb.Session) -> list[str]:
    """The base models the session holds an engine for (in-process, each loaded on its first use)."""
    assert sess.base_models is not None
    return [engine.base_info.path for engine in sess.base_models.engines()]


@pytest.mark.parametrize("mode", MODES)
def test_multi_teacher_distillation_with_two_teachers_on_two_other_base_models(
    open_session: OpenSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    math_teacher = build_tiny_twin(tmp_path / "math-teacher", layers=3, seed=1)
    chat_teacher = build_tiny_twin(tmp_path / "chat-teacher", layers=4, seed=2)
    rows = {
        "zwhe99/DeepMath-103K": datasets.Dataset.from_dict(
            {"question": [f"What is {i}+{i}?" for i in range(8)]}
        ),
        "allenai/tulu-3-sft-mixture": datasets.Dataset.from_dict(
            {
                "messages": [
                    [
                        {"role": "user", "content": f"Name a fruit ({i})."},
                        {"role": "assistant", "content": "A pear."},
                    ]
                    for i in range(8)
                ]
            }
        ),
    }

    def load_dataset(
        name: str, *args: object, split: str | None = None, **kwargs: object
    ) -> datasets.Dataset:
        if split != "train":
            raise ValueError(f"{name} has no {split} split here")  # the recipe then holds out none
        return rows[name]

    monkeypatch.setattr(distillation_datasets, "load_dataset", load_dataset)
    sess = open_session("tiny")
    sess.service_client().create_sampling_client(base_model=chat_teacher).result()  # both served over HTTP
    config = on_policy_multi_teacher.CLIConfig(
        model_name=resolve_model_path("tiny"),
        renderer_name="qwen3_instruct",
        lora_rank=4,
        deepmath_teacher_model=math_teacher,
        tulu3_teacher_model=chat_teacher,
        deepmath_groups_per_batch=2,
        tulu3_groups_per_batch=2,
        group_size=2,
        learning_rate=1e-3,
        max_tokens=8,
        eval_every=0,
        save_every=0,
        log_path=str(tmp_path / "log"),
        behavior_if_log_dir_exists="delete",
        max_steps=2,
        base_url=_mode(sess, mode, monkeypatch),
    )
    asyncio.run(on_policy_multi_teacher.cli_main(config))
    rows_logged = _metrics(tmp_path / "log")
    assert len(rows_logged) == 2
    assert all("teacher_kl/dataset_0" in row and "teacher_kl/dataset_1" in row for row in rows_logged)
    assert _base_models(sess)[1:] == [chat_teacher, math_teacher]  # each teacher on its own base model


@pytest.mark.parametrize("mode", MODES)
def test_twenty_questions_with_the_answerer_on_another_base_model(
    open_session: OpenSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    monkeypatch.chdir(tmp_path)
    answerer = "Qwen/Qwen3-8B"
    build_tiny_twin(tmp_path / answerer, layers=3, seed=1)
    student = build_tiny_twin(tmp_path / "student", layers=2, seed=0)  # a 20-turn game needs 4,096 positions
    sess = open_session(student)
    _mode(sess, mode, monkeypatch)  # the recipe takes no base_url: TINKER_BASE_URL over HTTP
    config = twenty_questions.build_config(
        twenty_questions.CLIConfig(
            model_name=student,
            renderer_name="qwen3_instruct",
            group_size=2,
            batch_size=2,
            num_epochs=1,
            learning_rate=1e-3,
            max_tokens=8,
            eval_every=0,
            save_every=0,
            log_path=str(tmp_path / "log"),
            behavior_if_log_dir_exists="delete",
            max_steps=1,
        )
    )
    config = chz.replace(
        config, dataset_builder=chz.replace(config.dataset_builder, answerer_base_model=answerer)
    )
    asyncio.run(rl_train.main(config))
    (row,) = [row for row in _metrics(tmp_path / "log") if "env/all/reward/total" in row]
    assert row["env/all/turns_per_episode"] == 20  # random players never guess: every game runs out
    assert _base_models(sess)[1:] == [answerer]


@pytest.mark.parametrize("mode", MODES)
def test_off_policy_reasoning_distillation(
    open_session: OpenSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    rows = [
        {
            "conversations": [
                {"from": "human", "value": f"What is {i}+{i}?"},
                {"from": "gpt", "value": f"<think>{i} plus {i} is {2 * i}.</think> The answer is {2 * i}."},
            ]
        }
        for i in range(16)
    ]

    def load_dataset(name: str, *args: object, streaming: bool = False, **kwargs: object) -> object:
        assert name == "open-thoughts/OpenThoughts3-1.2M"
        table = datasets.Dataset.from_list(rows)
        return table.to_iterable_dataset() if streaming else table

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    sess = open_session("tiny")
    config = off_policy_reasoning.CLIConfig(
        model_name=resolve_model_path("tiny"),
        renderer_name="qwen3_instruct",
        lora_rank=4,
        batch_size=4,
        learning_rate=1e-3,
        max_length=256,
        buffer_size=8,
        max_prompts=12,
        eval_every=0,
        save_every=0,
        log_path=str(tmp_path / "log"),
        behavior_if_log_dir_exists="delete",
        max_steps=3,
        base_url=_mode(sess, mode, monkeypatch),
    )
    off_policy_reasoning.cli_main(config)
    losses = [row["train_mean_nll"] for row in _metrics(tmp_path / "log") if "train_mean_nll" in row]
    assert len(losses) == 3 and losses[-1] < losses[0]


@pytest.mark.parametrize("mode", MODES)
def test_the_rl_numerics_check_finds_sampler_and_trainer_agree(
    open_session: OpenSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    words = ["the", "river", "was", "until", "after", "war", "and", "a", "city", "grew", "along", "coast"]
    lines = [" ".join(words[(i + j) % len(words)] for j in range(30)) for i in range(200)]

    def load_dataset(name: str, *args: object, **kwargs: object) -> datasets.Dataset:
        assert name == "Salesforce/wikitext"
        return datasets.Dataset.from_dict({"text": lines})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    student = build_tiny_twin(tmp_path / "student", layers=2, seed=0)  # the tool prompt outgrows 512
    sess = open_session(student)
    config = rl_numerics_check.build_config(
        rl_numerics_check.CLIConfig(
            model_name=student,
            renderer_name="qwen3_instruct",
            lora_rank=4,
            learning_rate=1e-3,
            group_size=2,
            groups_per_batch=2,
            max_tokens=16,
            max_trajectory_tokens=3000,
            task=numerics_env.CountingTaskConfig(
                num_pages_min=1, num_pages_max=1, page_chars=200, words=("until",)
            ),
            eval_every=0,
            save_every=0,
            max_steps=2,
            base_url=_mode(sess, mode, monkeypatch),
            log_path=str(tmp_path / "log"),
            behavior_if_log_dir_exists="delete",
        )
    )
    asyncio.run(rl_train.main(config))
    rows = [row for row in _metrics(tmp_path / "log") if "env/all/reward/total" in row]
    assert len(rows) == 2
    # the check's own figure: the sampler's logprobs of what it sampled against the trainer's
    assert all(abs(row["optim/kl_sample_train_v1"]) < 1e-3 for row in rows), rows


@pytest.mark.parametrize("mode", MODES)
def test_the_true_thinking_score_experiment_runs_on_another_base_model(
    open_session: OpenSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TINKER_COOKBOOK_RUNS_DIR", str(tmp_path / "cookbook-runs"))
    model = true_thinking_score.MODEL_NAME  # the recipe's own, a local folder here
    build_tiny_twin(tmp_path / model, layers=3, seed=1)
    monkeypatch.setattr(true_thinking_score, "PROBLEMS", true_thinking_score.PROBLEMS[:1])
    sess = open_session("tiny")
    _mode(sess, mode, monkeypatch)  # the recipe takes no base_url: TINKER_BASE_URL over HTTP
    asyncio.run(true_thinking_score.main())
    results = json.loads((tmp_path / "cookbook-runs" / "tts-experiment" / "tts_results.json").read_text())
    assert [problem.get("error") for problem in results["problems"]] == [None]
    assert _base_models(sess)[1:] == [model]
