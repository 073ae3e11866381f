"""tinker-cookbook's own training loops, unmodified, against the server (`base_url`), on `tiny`.

Offline: the model is the built-in tiny model's local folder, the supervised data the cookbook's own
`example_data/conversations.jsonl`, the RL environment the cookbook's arithmetic problems (generated,
no dataset). The only patch is the cookbook's pricing download (no network here).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import tinker

import workbench as wb
from tests.promises.conftest import SdkClients
from workbench.engine.local.ranks import FOLLOWER_MODULE
from workbench.engine.model.base_model import resolve_model_path

cookbook = pytest.importorskip("tinker_cookbook")

from tinker_cookbook.rl import train as rl_train  # noqa: E402
from tinker_cookbook.supervised import train as sl_train  # noqa: E402
from tinker_cookbook.supervised.data import FromConversationFileBuilder  # noqa: E402
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig  # noqa: E402
from tinker_cookbook.utils import cost_estimation  # noqa: E402

CONVERSATIONS = Path(cookbook.__file__).parent / "example_data" / "conversations.jsonl"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def served(
    monkeypatch: pytest.MonkeyPatch, tiny_no_wandb: wb.Session, sdk_clients: SdkClients
) -> Iterator[tuple[wb.Session, str]]:
    """The served session; the SDK clients the cookbook's loop makes (it never closes them) are closed
    after the test, while the server still answers, so no heartbeat outlives it."""
    monkeypatch.setenv("TINKER_API_KEY", "tml-local")
    monkeypatch.setattr(cost_estimation, "load_model_pricing", lambda **_: None)  # no pricing download
    yield tiny_no_wandb, tiny_no_wandb.serve().url
    sdk_clients.close()


def _metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def _sl_config(log_path: Path, base_url: str, max_steps: int, save_every: int = 2) -> sl_train.Config:
    """The cookbook's supervised loop on its example conversations, on tiny, against `base_url`."""
    model = resolve_model_path("tiny")
    return sl_train.Config(
        log_path=str(log_path),
        model_name=model,
        recipe_name="sl_test",
        renderer_name="qwen3_instruct",
        dataset_builder=FromConversationFileBuilder(
            file_path=str(CONVERSATIONS),
            common_config=ChatDatasetBuilderCommonConfig(
                model_name_for_tokenizer=model,
                renderer_name="qwen3_instruct",
                max_length=256,
                batch_size=4,
            ),
        ),
        learning_rate=1e-3,
        lora_rank=4,
        base_url=base_url,
        save_every=save_every,
        eval_every=0,
        max_steps=max_steps,
    )


def test_the_cookbook_supervised_loop_trains_through_the_server(
    served: tuple[wb.Session, str], tmp_path: Path
) -> None:
    session, url = served

    def config(max_steps: int) -> sl_train.Config:
        return _sl_config(tmp_path / "sl", url, max_steps)

    asyncio.run(sl_train.main(config(3)))
    assert [row["step"] for row in _metrics(tmp_path / "sl") if "train_mean_nll" in row] == [0, 1, 2]
    # The run is cut short after its step-2 checkpoint (its final save never happened): the cookbook
    # resumes from that state with its optimizer (create_training_client_from_state_with_optimizer).
    checkpoints = tmp_path / "sl" / "checkpoints.jsonl"
    records = [json.loads(line) for line in checkpoints.read_text().splitlines()]
    checkpoints.write_text("".join(json.dumps(r) + "\n" for r in records if r["name"] != "final"))
    asyncio.run(sl_train.main(config(4)))
    assert [row["step"] for row in _metrics(tmp_path / "sl") if "train_mean_nll" in row] == [0, 1, 2, 3]
    steps = [row for row in session.history if row["op"] == "optim_step" and row["model"] != "policy"]
    first, resumed = steps[:3], steps[3:]
    assert [row["model"] for row in first] == ["policy_2"] * 3
    saved = [r for r in records if r["name"] != "final"][-1]
    assert [row["model"] for row in resumed] == ["policy_3"] * (4 - saved["batch"])
    # the optimizer's step count goes on from the checkpoint's (the cookbook submits one batch ahead,
    # so its step-2 save runs after the third step, in seq_id order)
    saved_step = session.engine.read_state(saved["state_path"]).adapters[wb.Role.POLICY].step
    assert saved_step == 3
    assert [row["step"] for row in resumed] == list(range(saved_step + 1, saved_step + 1 + len(resumed)))
    assert session.engine.model_ids() == [session.model_id]  # the cookbook closed its sessions
    run = tinker.RestClient(base_url=url).get_training_run_by_tinker_path(records[0]["state_path"]).result()
    assert run.user_metadata["renderer_name"] == "qwen3_instruct"  # what the cookbook checks on resume


@contextlib.contextmanager
def _workbench_serve(
    monkeypatch: pytest.MonkeyPatch, sdk_clients: SdkClients, tmp_path: Path, *options: str
) -> Iterator[tuple[str, list[str], int]]:
    """`workbench serve --base-model tiny` with `options` in a subprocess: its URL, its startup lines and
    its pid; stopped with SIGINT after the SDK clients are closed, and checked to exit 0."""
    monkeypatch.setattr(cost_estimation, "load_model_pricing", lambda **_: None)  # no pricing download
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "WORKBENCH_RUNS": str(tmp_path / "runs"),
        "TINKER_API_KEY": "tml-local",
    }
    monkeypatch.setenv("TINKER_API_KEY", "tml-local")
    serve = ["serve", "--base-model", "tiny", *options, "--port", "0", "--no-wandb"]
    server = subprocess.Popen(
        [sys.executable, "-m", "workbench.cli", *serve],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    try:
        assert server.stdout is not None
        for line in server.stdout:  # the address, then what it serves
            lines.append(line)
            if "workbench: base model " in line:
                break
        (url,) = [line.split(" at ")[-1].strip() for line in lines if "serving the Tinker API at" in line]
        yield url, lines, server.pid
        sdk_clients.close()  # while the server still answers
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=60)
        output = server.stdout.read() if server.stdout is not None else ""
    assert server.returncode == 0, output


def test_the_cookbook_supervised_loop_trains_through_a_quantized_server(
    monkeypatch: pytest.MonkeyPatch, sdk_clients: SdkClients, tmp_path: Path
) -> None:
    """`workbench serve --quantize nf4` says so at startup, and the cookbook's loop runs on it unmodified."""
    with _workbench_serve(monkeypatch, sdk_clients, tmp_path, "--quantize", "nf4") as (url, lines, _):
        asyncio.run(sl_train.main(_sl_config(tmp_path / "sl", url, max_steps=2, save_every=0)))
    (base_line,) = [line for line in lines if "workbench: base model " in line]
    assert "nf4+dq" in base_line, lines
    nll = [row["train_mean_nll"] for row in _metrics(tmp_path / "sl") if "train_mean_nll" in row]
    assert len(nll) == 2 and all(math.isfinite(x) and x > 0 for x in nll), nll


def test_the_cookbook_loops_train_through_a_server_on_two_devices(
    monkeypatch: pytest.MonkeyPatch, sdk_clients: SdkClients, tmp_path: Path
) -> None:
    """`workbench serve --devices 2` (two CPU ranks) says so at startup; the cookbook's supervised loop
    (a checkpoint each step) and its synchronous RL loop (a KL penalty against the base model) run on it
    unmodified, one server for both; the server ends its follower rank when it stops.

    The RL loop's draws are unseeded and its concurrent sample requests reach the server in no fixed
    order, so its numbers are not compared with a one-device run's (`tests/engine/test_devices.py` and
    `tests/promises/test_invariants_two_ranks.py` compare the calls it makes); what it measures itself
    is: the sampler's logprobs (rank 0's, one device's) against the trainer's over both ranks, the
    cookbook's `kl_sample_train` (v1 their mean difference, v2 half its mean square), ~6e-8 measured."""
    with _workbench_serve(monkeypatch, sdk_clients, tmp_path, "--devices", "2") as (url, lines, pid):
        asyncio.run(sl_train.main(_sl_config(tmp_path / "sl", url, max_steps=2, save_every=1)))
        reference = rl_train.KLReferenceConfig(base_model=resolve_model_path("tiny"))
        rl = _arithmetic_rl_config(
            url, tmp_path / "rl", "rl_test", kl_penalty_coef=0.1, kl_reference_config=reference
        )
        asyncio.run(rl_train.main(rl))
    (base_line,) = [line for line in lines if "workbench: base model " in line]
    assert "on cpu+cpu/" in base_line, lines
    nll = [row["train_mean_nll"] for row in _metrics(tmp_path / "sl") if "train_mean_nll" in row]
    assert len(nll) == 2 and all(math.isfinite(x) and x > 0 for x in nll), nll
    steps = [row for row in _metrics(tmp_path / "rl") if "env/all/reward/total" in row]
    assert len(steps) == 2 and all(math.isfinite(row["env/all/reward/total"]) for row in steps), steps
    for row in steps:
        assert abs(row["optim/kl_sample_train_v1"]) < 1e-5 and row["optim/kl_sample_train_v2"] < 1e-10, row
    followers = [
        process.pid
        for process in psutil.process_iter(["cmdline"])
        if process.info["cmdline"]
        and process.info["cmdline"][-3:-2] == [FOLLOWER_MODULE]
        and process.info["cmdline"][-1] == str(pid)
    ]
    assert followers == []  # the server's follower rank (given the server's pid) ended with it


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "stable_reinforce"])
def test_the_cookbook_rl_loop_trains_through_the_server(
    served: tuple[wb.Session, str], tmp_path: Path, loss_fn: str
) -> None:
    """The synchronous RL loop with its default loss, and with `stable_reinforce` (samples recorded by
    the engine under the ids the server promised, named again by the training data's provenance)."""
    session, url = served
    model = resolve_model_path("tiny")
    config = _arithmetic_rl_config(
        url,
        tmp_path / "rl",
        "rl_test",
        kl_penalty_coef=0.1,
        kl_reference_config=rl_train.KLReferenceConfig(base_model=model),
        loss_fn=loss_fn,
    )
    asyncio.run(rl_train.main(config))
    rows = [row for row in _metrics(tmp_path / "rl") if "env/all/reward/total" in row]
    assert len(rows) == 2
    ops = {row["op"] for row in session.history if row["model"] != "policy"}
    assert {"sample", "forward_backward", "optim_step"} <= ops
    trained = [row for row in session.history if row["op"] == "forward_backward" and row["model"] != "policy"]
    # stable_reinforce reports how many tokens its ratio cap truncated: it ran on the recorded samples
    assert all(("truncated_fraction:mean" in row) == (loss_fn == "stable_reinforce") for row in trained)


def test_the_cookbook_async_rl_loop_trains_through_the_server(
    served: tuple[wb.Session, str], tmp_path: Path
) -> None:
    """The cookbook's asynchronous loop (`AsyncConfig(max_steps_off_policy=1)`, `stable_reinforce` by
    default) over HTTP, unmodified."""
    _, url = served
    config = _arithmetic_rl_config(
        url,
        tmp_path / "rl_async",
        "rl_async_test",
        async_config=rl_train.AsyncConfig(max_steps_off_policy=1, groups_per_batch=2),
    )
    asyncio.run(rl_train.main(config))
    assert len([row for row in _metrics(tmp_path / "rl_async") if "env/all/reward/total" in row]) == 2


def _arithmetic_rl_config(url: str, log_path: Path, recipe_name: str, **options: Any) -> rl_train.Config:
    """The cookbook's RL config on its arithmetic task, small (2 batches of 2 groups of 2, 4 tokens) on
    `tiny` served at `url`; `options` are the fields a test varies."""
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder

    model = resolve_model_path("tiny")
    return rl_train.Config(
        learning_rate=1e-3,
        dataset_builder=ArithmeticDatasetBuilder(
            batch_size=2,
            model_name_for_tokenizer=model,
            renderer_name="qwen3_instruct",
            n_batches=2,
            group_size=2,
        ),
        model_name=model,
        recipe_name=recipe_name,
        max_tokens=4,
        lora_rank=4,
        log_path=str(log_path),
        base_url=url,
        save_every=0,
        eval_every=0,
        **options,
    )
