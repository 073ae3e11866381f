"""Sweep checkpoints: `sess.sweep(..., save_every=k)` saves every member and the sweep's own state; a
new session resumes the sweep (`resume=<name>`) and each member ends bit-exact against the uninterrupted
sweep (SFT, and RL with seeded sampling); paused and stopped members, clones and live settings come back
as saved; a raising step puts its member back at its newest save; bad resumes are refused."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import workbench as wb
from tests.notebook.test_run_checkpoints import _writes_fail_past, rl_step, sft_step
from tests.notebook.test_sweep import _trained_bytes

WAIT_S = 60.0
STEPS = 4
CONFIGS = [{"learning_rate": 1e-2, "seed": 0}, {"learning_rate": 3e-3, "seed": 1}]


@pytest.fixture(autouse=True)
def models_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A models root of the test's own: a resumed sweep is found by name beside the session's folder."""
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))
    return tmp_path / "runs"


def _session() -> wb.Session:
    return wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, threads=1, wandb=False)


def _finished(sweep: wb.Sweep) -> list[tuple[dict[str, bytes], torch.Tensor, dict]]:
    """Each member's trained bytes, sampling stream and loop state, once the sweep has ended."""
    assert sweep.wait(WAIT_S) is wb.RunState.FINISHED, [m.traceback for m in sweep.members]
    assert all(m.i == STEPS for m in sweep.members)
    return [(_trained_bytes(m), m.rng_state, m.loop_state) for m in sweep.members]


def _kept_steps(history: wb.MetricsHistory) -> list[int]:
    return [row["step"] for row in history.rows if row["op"] == "optim_step" and not row.get("discarded")]


class _Recorded:
    """`step_fn`, recording the `(model id, i)` of each call; the engine is closed beneath the session
    (as a lost kernel leaves it: nothing saved after) when the first member reaches step `close_at`."""

    def __init__(self, step_fn: Callable[[wb.Session, int], object], close_at: int | None = None) -> None:
        self.step_fn, self.close_at = step_fn, close_at
        self.seen: list[tuple[str, int]] = []

    def __call__(self, member: wb.Member, i: int) -> object:
        if i == self.close_at:
            member.engine.close()
            return None
        self.seen.append((member.model_id, i))
        return self.step_fn(member, i)  # type: ignore[arg-type]  # a member answers as a session


@pytest.mark.parametrize("step_fn", [sft_step, rl_step], ids=["sft", "rl"])
def test_an_interrupted_sweep_resumed_by_a_new_session_ends_bit_exact(
    models_root: Path, step_fn: Callable[[wb.Session, int], object]
) -> None:
    with _session() as sess:
        expected = _finished(sess.sweep(step_fn, CONFIGS, STEPS))

    # saved after rounds 2; round 3 trained and lost; the session closes as round 4 begins
    interrupted = _Recorded(step_fn, close_at=3)
    with _session() as sess:
        sweep = sess.sweep(interrupted, CONFIGS, STEPS, save_every=2, name="lr")
        assert sweep.wait(WAIT_S) is not wb.RunState.RUNNING
        assert sess.closed and sweep.members[1].state is wb.RunState.FAILED  # its step found no engine
    first, second = (m.model_id for m in sweep.members)
    assert sweep.folder == models_root / "lr" and (sweep.folder / "sweep.json").is_file()
    assert interrupted.seen == [(model, i) for i in range(3) for model in (first, second)]

    resumed = _Recorded(step_fn)
    with _session() as again:
        sweep = again.sweep(resumed, CONFIGS, STEPS, save_every=2, resume="lr")
        got = _finished(sweep)
        assert [m.model_id for m in sweep.members] == [first, second]
        assert resumed.seen == [(model, i) for i in (2, 3) for model in (first, second)]
        for member in sweep.members:
            assert _kept_steps(member.history) == list(range(1, STEPS + 1))  # each step once
        assert sorted(again.engine.model_ids()) == sorted([again.model_id, first, second])
    for k, (trained, rng, loop_state) in enumerate(expected):
        assert got[k][0] == trained, f"member {k} differs from the uninterrupted sweep's"
        assert torch.equal(got[k][1], rng)
        assert got[k][2] == loop_state
    on_disk = wb.MetricsHistory.from_jsonl(sweep.folder.parent / first)
    assert _kept_steps(on_disk) == list(range(1, STEPS + 1))
    assert [row["step"] for row in on_disk.rows if row["op"] == "optim_step" and row.get("discarded")] == [3]


def test_paused_and_stopped_members_and_clones_come_back_as_saved() -> None:
    configs = [
        {"learning_rate": 1e-2},
        {"learning_rate": 1e-2, "pause_if": {"cursor": ("above", 0.5)}},
        {"learning_rate": 3e-3},
    ]
    sess = _session()
    sweep = sess.sweep(sft_step, configs, 3, save_every=1, name="kept")
    assert sweep.wait(WAIT_S) is wb.RunState.PAUSED
    done, paused, stopped = sweep.members
    assert paused.state is wb.RunState.PAUSED and paused.i == 2  # cursor 1 crossed its rule
    clone = sweep.clone(paused, learning_rate=1e-3, pause_if=None)
    assert sweep.wait(WAIT_S) is wb.RunState.PAUSED and clone.i == 3
    stopped.stop()
    kept = {m.model_id: _trained_bytes(m) for m in (done, paused, clone)}
    sess.close()

    with _session() as again:
        own = again.engine.model_ids()
        with pytest.raises(ValueError, match="the configs differ from those of the sweep"):
            again.sweep(sft_step, configs[:2], 3, resume="kept")
        with pytest.raises(ValueError, match="resume='kept' continues it"):
            again.sweep(sft_step, configs, 3, save_every=1, name="kept")
        with pytest.raises(ValueError, match=r"options .* are not"):
            again.sweep(sft_step, [{"loss": object()}], 3, save_every=1)
        with pytest.raises(FileNotFoundError, match="holds no saved sweep"):
            again.sweep(sft_step, configs, 3, resume="nowhere")
        assert again.engine.model_ids() == own  # nothing was created by the refused calls

        sweep = again.sweep(sft_step, configs, 3, save_every=1, resume="kept")
        assert sweep.wait(WAIT_S) is wb.RunState.PAUSED
        states = [(m.state, m.i) for m in sweep.members]
        assert states == [
            (wb.RunState.FINISHED, 3),
            (wb.RunState.PAUSED, 2),
            (wb.RunState.STOPPED, 3),
            (wb.RunState.FINISHED, 3),
        ]
        done, paused, stopped, clone = sweep.members
        assert clone.clone_of == paused.model_id and clone.adam_params.learning_rate == 1e-3
        assert stopped.model_id not in again.engine.model_ids()
        assert {m.model_id: _trained_bytes(m) for m in (done, paused, clone)} == kept
        paused.pause_rules = []
        paused.resume()
        assert sweep.wait(WAIT_S) is wb.RunState.FINISHED
        assert paused.loop_state["trained"] == [0, 1, 2]


class _FailsOnce:
    """`sft_step`, except that the first member's step `at` raises once, after its whole work."""

    def __init__(self, at: int) -> None:
        self.at, self.raised = at, False

    def __call__(self, member: wb.Member, i: int) -> object:
        metrics = sft_step(member, i)  # type: ignore[arg-type]  # a member answers as a session
        if i == self.at and not self.raised:
            self.raised = True
            raise RuntimeError(f"the reward model went away at step {i}")
        return metrics


def test_a_raising_step_puts_its_member_back_at_its_newest_save() -> None:
    with _session() as sess:
        expected = _finished(sess.sweep(sft_step, CONFIGS, STEPS))
    with _session() as sess:
        with pytest.warns(RuntimeWarning, match=r"raised .* it paused .rewound to its newest save"):
            sweep = sess.sweep(_FailsOnce(at=3), CONFIGS, STEPS, save_every=2)
            assert sweep.wait(WAIT_S) is wb.RunState.PAUSED
        failed = sweep.members[0]
        assert failed.i == 2 and failed.loop_state["trained"] == [0, 1] and failed.error is not None
        failed.resume()
        got = _finished(sweep)
        assert _kept_steps(failed.history) == list(range(1, STEPS + 1))
    assert [g[0] for g in got] == [e[0] for e in expected]
    assert [g[2] for g in got] == [e[2] for e in expected]


def test_closing_the_session_saves_the_sweep_after_each_members_step_to_train_on_when_resumed() -> None:
    held, release = threading.Event(), threading.Event()

    def holds_once(member: wb.Member, i: int) -> object:
        if i == 1 and not held.is_set():
            held.set()
            assert release.wait(WAIT_S), "the test never released the step"
        return sft_step(member, i)  # type: ignore[arg-type]  # a member answers as a session

    sess = _session()
    sweep = sess.sweep(holds_once, CONFIGS, STEPS, save_every=100, name="closed")  # no round saves
    assert held.wait(WAIT_S)
    closer = threading.Thread(target=sess.close)
    closer.start()
    deadline = time.monotonic() + WAIT_S
    while any(m.state is not wb.RunState.PAUSED for m in sweep.members) and time.monotonic() < deadline:
        time.sleep(0.01)  # close() pauses the members first, the held one during its step
    release.set()
    closer.join(WAIT_S)
    assert not closer.is_alive() and sess.closed
    assert [(m.state, m.i) for m in sweep.members] == [(wb.RunState.PAUSED, 2), (wb.RunState.PAUSED, 1)]

    resumed = _Recorded(sft_step)
    with _session() as again:
        sweep = again.sweep(resumed, CONFIGS, STEPS, resume="closed")
        _finished(sweep)
        first, second = (m.model_id for m in sweep.members)
        assert sorted(resumed.seen) == sorted([(first, 2), (first, 3), (second, 1), (second, 2), (second, 3)])


def test_a_failed_save_pauses_the_sweep_and_keeps_the_previous_save() -> None:
    with _session() as sess:
        configs = [{"learning_rate": 1e-2, "pause_if": {"cursor": ("above", 0.5)}}]
        sweep = sess.sweep(sft_step, configs, STEPS, save_every=1, name="full")
        assert sweep.wait(WAIT_S) is wb.RunState.PAUSED
        member = sweep.members[0]
        assert member.i == 2 and sweep.save_error is None  # cursor 1 crossed its rule
        before = (sweep.folder / "sweep.json").read_text()
        member.pause_rules = []
        # the history and sweep.json fit; the adapter's file does not
        with _writes_fail_past(32768), pytest.warns(RuntimeWarning, match="could not be saved after round 3"):
            member.step_once()
            assert sweep.wait(WAIT_S) is wb.RunState.PAUSED
        assert member.i == 3 and sweep.save_error is not None and "File too large" in sweep.save_error
        assert (sweep.folder / "sweep.json").read_text() == before  # still naming run-000002
        member.resume()  # the disk has room again: the next save succeeds
        assert sweep.wait(WAIT_S) is wb.RunState.FINISHED and sweep.save_error is None
        assert sorted(p.name for p in (member.model_dir / "checkpoints").iterdir())[-1] == "run-000004"
