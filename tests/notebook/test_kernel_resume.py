"""A run outlives its kernel: a real Jupyter kernel trains with `save_every=2` (SFT, and RL with seeded
sampling), is SIGKILLed at seeded random steps, and a new kernel running the same cells continues the run;
the end state equals an uninterrupted run's bit for bit, each step is in the history once and each batch
was trained once (the RL batches are the very replies the uninterrupted run sampled)."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
from jupyter_client.manager import KernelManager

import workbench as wb

STEPS = 14  # room for five kills past the first save, each one to two steps past the one before
KILLS = 5
SETUP = """
import json, time, workbench as wb
from tests.datums import sft_datum
STEPS = {steps}

def sft(sess, i):
    run = sess.current_run
    cursor = run.loop_state.get("cursor", 0)
    datum = sft_datum(sess.tokenizer, f"User: question {{cursor}}.", f" Assistant: answer {{cursor * 7}}.")
    sess.policy.forward_backward([datum], "cross_entropy").result()
    sess.policy.optim_step(run.adam_params).result()
    run.loop_state["cursor"] = cursor + 1
    run.loop_state.setdefault("trained", []).append(cursor)
    time.sleep({pause})  # room for the kill to land mid-run

def rl(sess, i):
    run = sess.current_run
    prompt = wb.ModelInput.from_ints(sess.tokenizer(f"Count to {{i}}:").input_ids)
    sampler = sess.policy.save_weights_and_get_sampling_client()
    params = wb.SamplingParams(max_tokens=4, temperature=1.0)
    replies = sampler.sample(prompt, num_samples=2, sampling_params=params).result()
    data = [wb.policy_datum(prompt, seq, 1.0 - 2.0 * k) for k, seq in enumerate(replies.sequences)]
    sess.policy.forward_backward(data, "importance_sampling").result()
    sess.policy.optim_step(run.adam_params).result()
    run.loop_state.setdefault("trained", []).append([seq.tokens for seq in replies.sequences])
    time.sleep({pause})

step = {step}
"""
START = """
import pathlib
folder = pathlib.Path({folder!r})
if (folder / "checkpoints").is_dir():
    sess = wb.Session.from_checkpoint(folder, threads=1, wandb={{"mode": "offline"}})
else:
    sess = wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, threads=1, model_dir=folder, wandb={{"mode": "offline"}})
run = sess.run(step, STEPS, adam_params={{"learning_rate": 1e-2}}, save_every=2)
run.wait()
print(json.dumps({{"state": run.state.value, "digest": sess.state_digest(), "trained": run.loop_state["trained"]}}))
"""


def _kept_steps(folder: Path) -> int:
    """The optimizer steps the history holds now, discarded rows left out (a new kernel marks the rows
    after its checkpoint discarded before it trains again)."""
    path = folder / "history.jsonl"
    if not path.exists():
        return 0
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a row being written
            continue
    return sum(row.get("op") == "optim_step" and not row.get("discarded") for row in rows)


def _kernel(cwd: Path) -> KernelManager:
    manager = KernelManager(kernel_name="python3")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "HF_HUB_OFFLINE": "1"}
    manager.start_kernel(cwd=str(cwd), env=env)
    return manager


def _execute(manager: KernelManager, code: str, timeout: float = 120) -> str:
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
        reply = client.execute_interactive(code, timeout=timeout, output_hook=(out := _Collect()))
        assert reply["content"]["status"] == "ok", reply["content"]
        return out.text
    finally:
        client.stop_channels()


class _Collect:
    def __init__(self) -> None:
        self.text = ""

    def __call__(self, message: dict) -> None:
        if message["msg_type"] == "stream" and message["content"]["name"] == "stdout":
            self.text += message["content"]["text"]


def _uninterrupted(folder: Path, step: str) -> tuple[str, list]:
    """The digest and the trained batches of the same run in this process, never killed."""
    namespace: dict = {}
    exec(SETUP.format(steps=STEPS, pause=0, step=step), namespace)
    with wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, threads=1, model_dir=folder, wandb=False) as sess:
        run = sess.run(namespace["step"], STEPS, adam_params={"learning_rate": 1e-2})
        assert run.wait(120) is wb.RunState.FINISHED, run.traceback
        return sess.state_digest(), run.loop_state["trained"]


@pytest.mark.parametrize("step", ["sft", "rl"])
def test_a_run_killed_five_times_ends_as_if_never_killed(tmp_path: Path, step: str) -> None:
    expected, expected_trained = _uninterrupted(tmp_path / "whole", step)
    folder = tmp_path / "killed"
    rng = random.Random(58)
    cells = SETUP.format(steps=STEPS, pause=0.1, step=step) + START.format(folder=str(folder))
    killed_at: list[int] = []
    for _ in range(KILLS):
        # past the first save (run-000002), and past the step the kernel before was killed at: every
        # kill lands mid-run, at a step no kernel before reached
        target = min(max([2, *killed_at]) + rng.randint(1, 2), STEPS - 1)
        manager = _kernel(tmp_path)
        try:
            client = manager.client()
            client.start_channels()
            client.wait_for_ready(timeout=60)
            client.execute(cells)
            deadline = time.monotonic() + 120
            while _kept_steps(folder) < target:
                assert time.monotonic() < deadline, "the run never reached its kill step"
                time.sleep(0.02)
            manager.signal_kernel(signal.SIGKILL)  # no atexit, no final save
            killed_at.append(target)
            while manager.is_alive():
                time.sleep(0.02)
            client.stop_channels()
        finally:
            manager.cleanup_resources()
    manager = _kernel(tmp_path)
    try:
        result = json.loads(_execute(manager, cells).strip().splitlines()[-1])
    finally:
        manager.shutdown_kernel(now=True)
    assert len(set(killed_at)) == KILLS, killed_at  # five kills at five different steps
    assert result["state"] == "finished"
    assert result["digest"] == expected
    assert result["trained"] == expected_trained  # no batch trained twice, none skipped, RL replies resampled
    if step == "sft":
        assert expected_trained == list(range(STEPS))
    kept = [
        row["step"]
        for row in wb.MetricsHistory.from_jsonl(folder).rows
        if row["op"] == "optim_step" and not row.get("discarded")
    ]
    assert kept == list(range(1, STEPS + 1))
    runs = {path.name.rsplit("-", 1)[-1] for path in (folder / "wandb").glob("offline-run-*")}
    assert runs == {folder.name}, runs  # every kernel logged to the one W&B run
