"""tinker-cookbook's distillation code, unmodified, on the `tiny` model, in-process and over `workbench
serve`: the SDFT recipe (`recipes/sdft/train.py`, `distillation/sdft.py`) with its top-K path, and the
on-policy distillation recipe (`recipes/distillation/on_policy_distillation.py`,
`distillation/train_on_policy.py`).

SDFT (Shenfeld et al. 2026, https://arxiv.org/abs/2601.19897): the student samples answers on-policy; the
teacher (here the base model with adapters off, the recipe's static teacher) reads the question with a
golden answer as a demonstration, scores the student's answer with `topk_prompt_logprobs=K`, and the
student trains with `cross_entropy` on (N, K) soft targets (the teacher's renormalised top-K). The data
is a local file in the recipe's ToolAlpaca format (`load_from_disk` of `prompt` / `golden_response`
columns). The only patches: `tinker.ServiceClient` is ours on the test's session engine (in-process), and
the cookbook's pricing download answers "no pricing".

On-policy distillation (Agarwal et al. 2024, https://arxiv.org/abs/2306.13649; Thinking Machines' "On-Policy
Distillation", 2025): the student samples, the teacher scores the student's tokens with `compute_logprobs`,
and each token's advantage is the negative per-token reverse KL, -(log p_student - log p_teacher), under
`importance_sampling`; the recipe logs the mean of log p_student - log p_teacher as `teacher_kl`. It reads
its prompts with `load_dataset("zwhe99/DeepMath-103K")`; the test writes a few prompts into a datasets
cache folder in tmp_path and points `datasets.config.HF_DATASETS_CACHE` at it (what the
`HF_DATASETS_CACHE` variable sets at import), which `load_dataset` reads offline as it would a cached
download; the recipe's code runs unpatched. The test trains the session's adapter to answer "apple apple
apple": its sampler checkpoint after 3 steps is the recipe's `teacher_checkpoint`, and its state after 8
steps, far more sure of that answer, is the student's `load_checkpoint_path`. Reverse KL is mode-seeking:
the student's own samples show where it is overconfident, and pushing those down brings it to the
teacher.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from pathlib import Path

import datasets
import pytest
import tinker
from tinker_cookbook.recipes.distillation import on_policy_distillation
from tinker_cookbook.recipes.sdft import train as sdft_train
from tinker_cookbook.utils import cost_estimation

import workbench as wb
from tests.promises.conftest import SdkClients
from workbench.engine.model.base_model import resolve_model_path
from workbench.loops.chat import chat_datum

QUESTION = "Name a fruit."
GOLDEN = "apple apple apple"
STEPS = 5


@pytest.fixture
def sess(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, sdk_clients: SdkClients) -> Iterator[wb.Session]:
    monkeypatch.setenv("TINKER_API_KEY", "tml-local")
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))
    monkeypatch.setattr(cost_estimation, "load_model_pricing", lambda **_: None)  # no pricing download
    session = wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, wandb=False)
    yield session
    sdk_clients.close()  # while the session's server still answers
    session.close()


def _toolalpaca_file(folder: Path) -> Path:
    """A small dataset in the format the recipe's `toolalpaca_data_path` reads (Arrow, `load_from_disk`)."""
    rows = {"prompt": [QUESTION] * 16, "golden_response": [[GOLDEN]] * 16}
    datasets.Dataset.from_dict(rows).save_to_disk(str(folder))
    return folder


def _run_sdft(tmp_path: Path, base_url: str | None) -> None:
    config = sdft_train.CLIConfig(
        model_name=resolve_model_path("tiny"),
        renderer_name="qwen3_instruct",
        dataset="toolalpaca",
        toolalpaca_data_path=str(_toolalpaca_file(tmp_path / "data")),
        lora_rank=4,
        group_size=2,
        groups_per_batch=2,
        learning_rate=3e-3,
        max_tokens=8,
        topk=20,
        eval_every=0,
        save_every=0,
        log_path=str(tmp_path / "log"),
        behavior_if_log_dir_exists="delete",
        max_steps=STEPS,
        base_url=base_url,
    )
    asyncio.run(sdft_train.cli_main(config))


def _student_losses(session: wb.Session) -> list[float]:
    """The soft-target loss per scored position of each training step, from the session's history."""
    rows = [
        row
        for row in session.history
        if row["op"] == "forward_backward" and row["model"] != "policy" and row.get("num_tokens:sum")
    ]
    return [row["loss:sum"] / row["num_tokens:sum"] for row in rows]


def _check_the_student_learned(session: wb.Session, log_path: Path) -> None:
    metrics = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["sdft/topk"] for row in metrics] == [20.0] * STEPS  # the recipe's top-K path ran
    assert all(0 < row["sdft/mean_teacher_entropy"] <= math.log(20) for row in metrics)
    losses = _student_losses(session)
    assert len(losses) == STEPS
    print("soft-target loss per position, by step:", [round(loss, 3) for loss in losses])
    # the student moves towards the teacher's top-K: the loss on its own fresh samples falls
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.05
    teacher_scores = [row for row in session.history if row["op"] == "sample" and row["model"] == "reference"]
    assert teacher_scores  # the teacher (the base, adapters off) scored the student's answers


def test_the_cookbook_sdft_recipe_distils_with_top_k_soft_targets_in_process(
    sess: wb.Session, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tinker, "ServiceClient", sess.service_client)
    _run_sdft(tmp_path, None)
    _check_the_student_learned(sess, tmp_path / "log")


def test_the_cookbook_sdft_recipe_distils_with_top_k_soft_targets_over_http(
    sess: wb.Session, tmp_path: Path
) -> None:
    server = sess.serve()
    _run_sdft(tmp_path, server.url)
    _check_the_student_learned(sess, tmp_path / "log")


def test_the_cookbook_sdft_reverse_kl_path_runs_its_custom_loss_on_n_by_k_logprobs_over_http(
    sess: wb.Session, tmp_path: Path
) -> None:
    """`reverse=True`: the recipe's analytical reverse KL over the teacher's top-K, a custom loss the SDK
    runs on the (N, K) logprobs the server's `forward` returns for (N, K) `target_tokens`."""
    server = sess.serve()
    config = sdft_train.CLIConfig(
        model_name=resolve_model_path("tiny"),
        renderer_name="qwen3_instruct",
        dataset="toolalpaca",
        toolalpaca_data_path=str(_toolalpaca_file(tmp_path / "data")),
        lora_rank=4,
        group_size=2,
        groups_per_batch=2,
        learning_rate=3e-3,
        max_tokens=8,
        topk=20,
        reverse=True,
        eval_every=0,
        save_every=0,
        log_path=str(tmp_path / "log"),
        behavior_if_log_dir_exists="delete",
        max_steps=2,
        base_url=server.url,
    )
    asyncio.run(sdft_train.cli_main(config))
    metrics = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2
    assert all(row["sdft/reverse_kl_positions"] > 0 and row["sdft/reverse_kl_mean"] >= 0 for row in metrics)
    ops = [row["op"] for row in sess.history if row["model"] != "policy" and row["op"].startswith("forward")]
    assert ops == ["forward", "forward_backward"] * 2  # the SDK's custom-loss path, once a step


# ------------------------------------------------------------------------------- on-policy distillation

OPD_STEPS = 10
GROUPS_PER_BATCH = 2


def _deepmath_cache(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A datasets cache holding a few prompts as `zwhe99/DeepMath-103K`'s train split (its `question`
    column), laid out as `load_dataset` leaves a download: offline, `load_dataset` reads it back."""
    split_folder = folder / "zwhe99___deep_math-103_k" / "default" / "0.0.0" / "local"
    rows = datasets.Dataset.from_dict({"question": [QUESTION] * (GROUPS_PER_BATCH * OPD_STEPS)})
    rows.save_to_disk(str(folder / "rows"))
    split_folder.mkdir(parents=True)
    (folder / "rows" / "data-00000-of-00001.arrow").rename(split_folder / "deep_math-103_k-train.arrow")
    split = datasets.SplitInfo("train", num_examples=len(rows), dataset_name="deep_math-103_k")
    info = datasets.DatasetInfo(
        features=rows.features,
        config_name="default",
        dataset_name="deep_math-103_k",
        splits=datasets.SplitDict({"train": split}),
    )
    info.write_to_directory(str(split_folder))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", folder)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


def _student_and_teacher(session: wb.Session) -> tuple[str, str]:
    """The session's own adapter trained to answer the question with "apple apple apple": its training
    state after 8 steps (the student) and its sampler checkpoint after 3 (the teacher, less sure)."""
    answer = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": GOLDEN}]
    datum = chat_datum(session.tokenizer, answer)
    for step in range(8):
        if step == 3:
            teacher = session.policy.save_weights_for_sampler("teacher").result().path
        session.policy.forward_backward([datum], "cross_entropy")
        session.policy.optim_step(wb.AdamParams(learning_rate=1e-2))
    return session.policy.save_state("student").result().path, teacher


def _run_on_policy_distillation(
    tmp_path: Path, base_url: str | None, student: str, teacher: str
) -> list[float]:
    config = on_policy_distillation.CLIConfig(
        model_name=resolve_model_path("tiny"),
        renderer_name="qwen3_instruct",
        load_checkpoint_path=student,
        teacher_model=resolve_model_path("tiny"),
        teacher_checkpoint=teacher,
        dataset="deepmath",
        lora_rank=4,
        group_size=4,
        groups_per_batch=GROUPS_PER_BATCH,
        learning_rate=1e-2,
        max_tokens=8,
        eval_every=0,
        save_every=0,
        log_path=str(tmp_path / "log"),
        behavior_if_log_dir_exists="delete",
        max_steps=OPD_STEPS,
        base_url=base_url,
    )
    asyncio.run(on_policy_distillation.cli_main(config))
    metrics = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    return [row["teacher_kl"] for row in metrics]


def _check_the_student_moved_towards_the_teacher(session: wb.Session, teacher_kl: list[float]) -> None:
    """`teacher_kl` is computed from the teacher's `compute_logprobs` of the student's samples: large at
    the start, it falls once the student's updates push its overconfident answer down."""
    print("teacher_kl by step:", [round(kl, 3) for kl in teacher_kl])
    assert len(teacher_kl) == OPD_STEPS
    assert teacher_kl[0] > 1  # the student starts far from the teacher: more sure of its answer
    later = teacher_kl[OPD_STEPS // 2 :]
    assert sum(later) / len(later) < teacher_kl[0] / 2
    student_steps = [row for row in session.history if row["op"] == "optim_step" and row["model"] != "policy"]
    assert len(student_steps) == OPD_STEPS  # the recipe's student trained next to the session's own run


def test_the_cookbook_on_policy_distillation_recipe_lowers_the_reverse_kl_in_process(
    sess: wb.Session, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _deepmath_cache(tmp_path / "datasets", monkeypatch)
    student, teacher = _student_and_teacher(sess)
    monkeypatch.setattr(tinker, "ServiceClient", sess.service_client)
    teacher_kl = _run_on_policy_distillation(tmp_path, None, student, teacher)
    _check_the_student_moved_towards_the_teacher(sess, teacher_kl)


def test_the_cookbook_on_policy_distillation_recipe_lowers_the_reverse_kl_over_http(
    sess: wb.Session, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _deepmath_cache(tmp_path / "datasets", monkeypatch)
    student, teacher = _student_and_teacher(sess)
    teacher_kl = _run_on_policy_distillation(tmp_path, sess.serve().url, student, teacher)
    _check_the_student_moved_towards_the_teacher(sess, teacher_kl)
