"""Run checkpoints: `sess.run(..., save_every=k)` saves the model and the run; a session made from the
model folder continues the run at the saved step, bit-exact against an uninterrupted run (SFT and RL
with seeded sampling); pruning keeps what it promises; a failed save pauses the run and keeps the last."""

from __future__ import annotations

import resource
import shutil
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import workbench as wb
from tests.datums import sft_datum

WAIT_S = 60.0
STEPS = 6


def _session(folder: Path) -> wb.Session:
    return wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, threads=1, model_dir=folder, wandb=False)


def sft_step(sess: wb.Session, i: int) -> dict[str, float]:
    """Trains datum `cursor` of a fixed list, advancing the cursor kept in `run.loop_state`."""
    run = sess.current_run
    assert run is not None
    cursor = run.loop_state.get("cursor", 0)
    datum = sft_datum(sess.tokenizer, f"User: question {cursor}.", f" Assistant: answer {cursor * 7}.")
    sess.policy.forward_backward([datum], "cross_entropy").result()
    sess.policy.optim_step(run.adam_params).result()
    run.loop_state["cursor"] = cursor + 1
    run.loop_state.setdefault("trained", []).append(cursor)
    return {"cursor": float(cursor)}


def rl_step(sess: wb.Session, i: int) -> dict[str, float]:
    """Samples two replies with the session's seeded sampler and trains them with made-up advantages."""
    run = sess.current_run
    assert run is not None
    prompt = wb.ModelInput.from_ints(sess.tokenizer(f"Count to {i}:").input_ids)
    sampler = sess.policy.save_weights_and_get_sampling_client()
    replies = sampler.sample(
        prompt, num_samples=2, sampling_params=wb.SamplingParams(max_tokens=4, temperature=1.0)
    ).result()
    data = [wb.policy_datum(prompt, seq, 1.0 if k == 0 else -1.0) for k, seq in enumerate(replies.sequences)]
    sess.policy.forward_backward(data, "importance_sampling").result()
    sess.policy.optim_step(run.adam_params).result()
    run.loop_state.setdefault("trained", []).append([seq.tokens for seq in replies.sequences])
    return {"reply_tokens": float(sum(len(seq.tokens) for seq in replies.sequences))}


def _uninterrupted(folder: Path, step_fn: Callable[[wb.Session, int], object]) -> tuple[str, dict]:
    with _session(folder) as sess:
        run = sess.run(step_fn, STEPS, adam_params={"learning_rate": 1e-2})
        assert run.wait(WAIT_S) is wb.RunState.FINISHED, run.traceback
        return sess.state_digest(), run.loop_state


def _run_steps(history: wb.MetricsHistory) -> list[int]:
    """The optimizer steps of the kept `optim_step` rows, in order."""
    return [row["step"] for row in history.rows if row["op"] == "optim_step" and not row.get("discarded")]


@pytest.mark.parametrize("step_fn", [sft_step, rl_step], ids=["sft", "rl"])
def test_a_run_resumed_from_its_model_folder_ends_bit_exact(
    tmp_path: Path, step_fn: Callable[[wb.Session, int], object]
) -> None:
    expected_digest, expected_state = _uninterrupted(tmp_path / "whole", step_fn)

    folder = tmp_path / "cut"
    with _session(folder) as sess:
        run = sess.run(step_fn, STEPS - 1, adam_params={"learning_rate": 1e-2}, save_every=2)
        assert run.wait(WAIT_S) is wb.RunState.FINISHED, run.traceback
    # as if the kernel died after step 5, before its save: the newest complete checkpoint is at step 4
    assert sorted(p.name for p in (folder / "checkpoints").iterdir()) == [
        "run-000002",
        "run-000004",
        "run-000005",
    ]
    shutil.rmtree(folder / "checkpoints" / "run-000005")

    with wb.Session.from_checkpoint(folder, threads=1, wandb=False) as sess:
        assert sess.resume_point is not None and sess.resume_point.next_step == 4
        seen: list[int] = []

        def recorded(s: wb.Session, i: int) -> object:
            seen.append(i)
            return step_fn(s, i)

        run = sess.run(recorded, STEPS, save_every=2)
        assert run.wait(WAIT_S) is wb.RunState.FINISHED, run.traceback
        assert seen == [4, 5]
        assert run.adam_params.learning_rate == 1e-2  # the saved settings, not the default
        assert sess.state_digest() == expected_digest
        assert run.loop_state["trained"] == expected_state["trained"]
        assert _run_steps(sess.history) == list(
            range(1, STEPS + 1)
        )  # each step once; step 4's first try discarded
    on_disk = wb.MetricsHistory.from_jsonl(folder)
    assert _run_steps(on_disk) == list(range(1, STEPS + 1))
    assert sum(1 for row in on_disk.rows if row.get("discarded") and row["op"] == "optim_step") == 1


def test_pruning_keeps_the_newest_and_every_keep_every(tmp_path: Path) -> None:
    with _session(tmp_path / "m") as sess:
        run = sess.run(sft_step, 7, save_every=1, keep=2, keep_every=3)
        assert run.wait(WAIT_S) is wb.RunState.FINISHED, run.traceback
        assert [c.name for c in sess.list_checkpoints()] == ["run-000003", "run-000006", "run-000007"]


@contextmanager
def _writes_fail_past(size: int) -> Iterator[None]:
    """Every write past `size` bytes of a file fails with EFBIG, as a full disk fails a write (root
    ignores a read-only folder, not the file-size limit)."""
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, limits[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, previous)


def test_a_failed_save_pauses_the_run_and_leaves_the_previous_checkpoint_loadable(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    with _session(folder) as sess:
        run = sess.run(sft_step, 6, save_every=2, paused=True)
        run.step()
        run.step()
        assert run.wait(WAIT_S) is wb.RunState.PAUSED and run.saved_at == 2 and run.save_error is None
        with _writes_fail_past(4096):  # the adapter's file is larger
            run.step()
            run.step()
            assert run.wait(WAIT_S) is wb.RunState.PAUSED and run.i == 4
        assert run.save_error is not None and "at step 4 could not be saved" in run.save_error
        assert "File too large" in run.save_error
        assert [c.name for c in sess.list_checkpoints()] == ["run-000000", "run-000002"]  # paused at 0: saved
        run.resume()  # the disk has room again: the next save succeeds
        assert run.wait(WAIT_S) is wb.RunState.FINISHED and run.save_error is None
    with wb.Session.from_checkpoint(folder / "checkpoints" / "run-000002", wandb=False) as again:
        assert again.step == 2
