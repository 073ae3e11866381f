"""Run checkpoints: `sess.run(..., save_every=k)` saves the model and the run; a session made from the
model folder continues the run at the saved step, bit-exact against an uninterrupted run (SFT and RL
with seeded sampling); pruning keeps what it promises; a failed save pauses the run and keeps the last."""

from __future__ import annotations

import html
import resource
import shutil
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import workbench as wb
from tests.datums import sft_datum
from workbench.notebook.panel.progress_line import run_alerts
from workbench.notebook.panel.status import StatusBar
from workbench.notebook.run_checkpoints import stopped_run_note

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


def test_a_resumed_run_keeps_the_saved_pause_triggers(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    with _session(folder) as sess:
        run = sess.run(sft_step, STEPS, save_every=2, pause_if={"cursor": ("above", 2.5)})
        assert run.wait(WAIT_S) is wb.RunState.PAUSED and run.i == 4, run.traceback  # cursor 3 crossed
    with wb.Session.from_checkpoint(folder, threads=1, wandb=False) as sess:
        run = sess.run(sft_step, STEPS, save_every=2)  # the resuming cell names no triggers
        assert run.wait(WAIT_S) is wb.RunState.PAUSED and run.i == 5
        assert run.trigger is not None and run.trigger.rule == wb.PauseRule("cursor", "above", 2.5)
        run.stop()


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


class _FailsOnce:
    """`step_fn`, except that step `at` raises once: after the whole step's work (`after="step"`: its
    gradients, optimizer step, sampling draws and `loop_state` edits all made) or after its
    `forward_backward` alone (`after="forward_backward"`: gradients accumulated, no optimizer step)."""

    def __init__(self, step_fn: Callable[[wb.Session, int], object], at: int, after: str) -> None:
        self.step_fn, self.at, self.after, self.raised = step_fn, at, after, False
        self.seen: list[int] = []

    def __call__(self, sess: wb.Session, i: int) -> object:
        self.seen.append(i)
        if i != self.at or self.raised:
            return self.step_fn(sess, i)
        self.raised = True
        if self.after == "step":
            self.step_fn(sess, i)
        else:
            datum = sft_datum(sess.tokenizer, "User: a half step.", " Assistant: never applied.")
            sess.policy.forward_backward([datum], "cross_entropy").result()
        raise RuntimeError(f"the reward model went away at step {i}")


def _trained_state(sess: wb.Session) -> dict[str, bytes]:
    """The bytes of what training changed, as `save_state` writes them: adapters, optimizer moments and
    counters, RNGs. (`state_digest` also hashes the weights version, which a load into a live model
    moves on, so that no version number names two sets of weights.)"""
    sess.policy.save_state("compared", overwrite=True).result()
    folder = sess.model_dir / "checkpoints" / "compared"
    names = ["policy/adapter_model.safetensors", "optimizer/policy.safetensors", "optimizer/policy.json"]
    return {name: (folder / name).read_bytes() for name in [*names, "rng.safetensors"]}


@pytest.mark.parametrize(
    ("step_fn", "after"),
    [(sft_step, "forward_backward"), (sft_step, "step"), (rl_step, "step")],
    ids=["sft-mid-step", "sft-whole-step", "rl-whole-step"],
)
def test_a_raising_step_pauses_the_run_rewound_and_resuming_ends_bit_exact(
    tmp_path: Path, step_fn: Callable[[wb.Session, int], object], after: str
) -> None:
    with _session(tmp_path / "whole") as sess:
        run = sess.run(step_fn, STEPS, adam_params={"learning_rate": 1e-2})
        assert run.wait(WAIT_S) is wb.RunState.FINISHED, run.traceback
        expected, expected_trained = _trained_state(sess), run.loop_state["trained"]
    failing = _FailsOnce(step_fn, at=3, after=after)
    folder = tmp_path / "m"
    with _session(folder) as sess:
        with pytest.warns(RuntimeWarning, match="step 3 raised"):
            run = sess.run(failing, STEPS, adam_params={"learning_rate": 1e-2}, save_every=2)
            assert run.wait(WAIT_S) is wb.RunState.PAUSED
        assert run.failed_step == 3 and run.i == 2  # back at the newest run checkpoint, run-000002
        assert run.traceback is not None and "the reward model went away at step 3" in run.traceback
        alerts = dict(run_alerts(run))
        assert alerts["step-error"].startswith("step 3 raised, paused at step 2: RuntimeError")
        assert "run-000003" not in [c.name for c in sess.list_checkpoints()]  # the failed step is not saved
        run.resume()
        assert run.wait(WAIT_S) is wb.RunState.FINISHED, run.traceback
        assert failing.seen == [0, 1, 2, 3, 2, 3, 4, 5]
        assert _trained_state(sess) == expected
        assert run.loop_state["trained"] == expected_trained
        assert _run_steps(sess.history) == list(range(1, STEPS + 1))
    assert _run_steps(wb.MetricsHistory.from_jsonl(folder)) == list(range(1, STEPS + 1))


def test_a_step_raising_before_the_first_periodic_save_goes_back_to_the_start(tmp_path: Path) -> None:
    with _session(tmp_path / "whole") as sess:
        assert (
            sess.run(sft_step, STEPS, adam_params={"learning_rate": 1e-2}).wait(WAIT_S)
            is wb.RunState.FINISHED
        )
        expected = _trained_state(sess)
    failing = _FailsOnce(sft_step, at=1, after="step")
    with _session(tmp_path / "m") as sess:
        with pytest.warns(RuntimeWarning, match="step 1 raised"):
            run = sess.run(failing, STEPS, adam_params={"learning_rate": 1e-2}, save_every=4)
            assert run.wait(WAIT_S) is wb.RunState.PAUSED
        assert run.i == 0 and run.loop_state == {} and sess.step == 0  # run-000000, saved at the start
        run.resume()
        assert run.wait(WAIT_S) is wb.RunState.FINISHED, run.traceback
        assert _trained_state(sess) == expected


def test_a_new_model_in_a_folder_marks_the_earlier_history_discarded(tmp_path: Path) -> None:
    """A kernel killed before the first save leaves rows and no checkpoint: the next kernel starts the
    run over, and the rows of the lost attempt must not count as its steps."""
    folder = tmp_path / "m"
    with _session(folder) as sess:
        assert sess.run(sft_step, 2).wait(WAIT_S) is wb.RunState.FINISHED
    with _session(folder) as sess:
        assert sess.run(sft_step, 3).wait(WAIT_S) is wb.RunState.FINISHED
        assert _run_steps(sess.history) == [1, 2, 3]
    on_disk = wb.MetricsHistory.from_jsonl(folder)
    assert _run_steps(on_disk) == [1, 2, 3]
    assert [row["step"] for row in on_disk.rows if row["op"] == "optim_step" and row.get("discarded")] == [
        1,
        2,
    ]


def test_the_panel_says_where_an_unfinished_run_stopped_and_how_to_resume_it(tmp_path: Path) -> None:
    folder = tmp_path / "m"

    def stops_after_two(s: wb.Session, i: int) -> object:
        metrics = sft_step(s, i)
        if i == 1:
            run = s.current_run
            assert run is not None
            run.stop()  # as a kernel lost after step 2 would leave it, its save at 2 the newest
        return metrics

    with _session(folder) as sess:
        run = sess.run(stops_after_two, 4, save_every=2)
        assert run.wait(WAIT_S) is wb.RunState.STOPPED, run.traceback
    with _session(folder) as fresh:  # a new model here: the folder's run checkpoints are still there
        assert f"run stopped at step 2 of 4: wb.Session.from_checkpoint({str(folder)!r})" in (
            html.unescape(_status(fresh))
        )
    with wb.Session.from_checkpoint(folder, threads=1, wandb=False) as resumed:
        assert "run stopped at step 2 of 4: sess.run(step_fn, 4) continues it" in _status(resumed)
        run = resumed.run(sft_step, 4, save_every=2)
        assert run.wait(WAIT_S) is wb.RunState.FINISHED, run.traceback
        assert "stopped" not in _status(resumed)
        assert stopped_run_note(folder, None) is None  # finished: nothing to say


def _status(sess: wb.Session) -> str:
    bar = StatusBar(sess)
    bar.refresh()
    return bar.widget.value
