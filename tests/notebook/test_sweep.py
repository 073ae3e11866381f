"""Sweeps: each member trains bit for bit as its config would alone (SFT, and RL with seeded sampling);
clone starts from another member's state; promote makes a member the session's policy; successive
halving stops the worse half; a stopped member's adapter and optimizer memory is freed; no run starts
beside an active sweep."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import workbench as wb
from tests.notebook.test_run_checkpoints import rl_step, sft_step
from workbench.notebook.sweep import member_settings

WAIT_S = 60.0
STEPS = 3
RANK = 4


def _session(folder: Path, seed: int = 0) -> wb.Session:
    return wb.Session("tiny", wb.LoraConfig(rank=RANK), seed=seed, threads=1, model_dir=folder, wandb=False)


def _alone(
    folder: Path, step_fn: Callable[[wb.Session, int], object], lr: float, seed: int
) -> tuple[dict[str, bytes], torch.Tensor, dict, list]:
    """The trained bytes, sampling generator state, loop state and step metrics of `step_fn` run alone
    with `sess.run` in a fresh session."""
    with _session(folder, seed) as sess:
        run = sess.run(step_fn, STEPS, adam_params={"learning_rate": lr})
        assert run.wait(WAIT_S) is wb.RunState.FINISHED, run.traceback
        rng = sess.engine._state.sampling_generator.get_state()
        return _trained_bytes(sess), rng, run.loop_state, _metrics(sess.history)


def _trained_bytes(owner: wb.Session | wb.Member) -> dict[str, bytes]:
    """What training changed, as `save_state` writes it: the adapter, AdamW's moments and counters.
    (`state_digest` also hashes the adapter's name, which differs between a member and a session.)"""
    owner.policy.save_state("compared", overwrite=True).result()
    folder = owner.model_dir / "checkpoints" / "compared"
    names = ["policy/adapter_model.safetensors", "optimizer/policy.safetensors", "optimizer/policy.json"]
    return {name: (folder / name).read_bytes() for name in names}


def _metrics(history: wb.MetricsHistory) -> list[dict[str, float]]:
    """The metric values of the training rows, without the columns that name the model or the time, or
    measure the process (`system/...`: its memory and CPU use, which no two runs share)."""
    return [
        {k: v for k, v in row.items() if k not in ("model", "time") and not k.startswith("system/")}
        for row in history.rows
        if row["op"] in ("forward_backward", "optim_step", "run_step")
    ]


@pytest.mark.parametrize("step_fn", [sft_step, rl_step], ids=["sft", "rl"])
def test_each_member_of_a_sweep_is_bit_exact_against_its_config_alone(
    tmp_path: Path, step_fn: Callable[[wb.Session, int], object]
) -> None:
    configs = [
        {"learning_rate": 1e-2, "seed": 0},
        {"learning_rate": 3e-3, "seed": 1},
        {"learning_rate": 1e-2, "seed": 2},
    ]
    with _session(tmp_path / "sweep") as sess:
        own_digest = sess.state_digest()
        sweep = sess.sweep(step_fn, configs, STEPS)
        assert sweep.wait(WAIT_S) is wb.RunState.FINISHED
        members = sweep.members
        assert [m.settings.adam_params.learning_rate for m in members] == [1e-2, 3e-3, 1e-2]
        assert all(m.state is wb.RunState.FINISHED and m.i == STEPS for m in members), members
        got = [(_trained_bytes(m), m.rng_state, m.loop_state, _metrics(m.history)) for m in members]
        assert sess.state_digest() == own_digest  # the session's own model is untouched
        assert members[0].state_digest() != members[2].state_digest()  # the seed matters
        assert all((m.model_dir / "history.jsonl").exists() for m in members)
    for k, config in enumerate(configs):
        trained, rng, loop_state, metrics = _alone(
            tmp_path / f"alone{k}", step_fn, config["learning_rate"], config["seed"]
        )
        assert got[k][0] == trained, f"member {k} differs from its config alone"
        assert torch.equal(got[k][1], rng)  # the same sampling draws, and the same next one
        assert got[k][2] == loop_state
        assert got[k][3] == metrics


def test_a_clone_continues_from_its_source_with_its_own_settings(tmp_path: Path) -> None:
    with _session(tmp_path / "sweep") as sess:
        sweep = sess.sweep(sft_step, [{"learning_rate": 1e-2, "pause_if": {"cursor": ("above", 0.5)}}], 4)
        assert sweep.wait(WAIT_S) is wb.RunState.PAUSED
        source = sweep.members[0]
        assert source.i == 2  # cursor 1 crossed the rule
        clone = sweep.clone(source, learning_rate=1e-3, pause_if=None)
        assert (
            clone.i == 2 and clone.loop_state == source.loop_state and clone.adam_params.learning_rate == 1e-3
        )
        source.resume()
        source.pause_rules = []
        assert sweep.wait(WAIT_S) is wb.RunState.FINISHED
        assert clone.loop_state["trained"] == [0, 1, 2, 3]
        clone_bytes, source_bytes = _trained_bytes(clone), _trained_bytes(source)
    with _session(tmp_path / "alone") as alone:  # two steps at 1e-2, then two at 1e-3
        run = alone.run(sft_step, 4, adam_params={"learning_rate": 1e-2}, paused=True)
        run.step()
        run.step()
        assert run.wait(WAIT_S) is wb.RunState.PAUSED and run.i == 2
        run.set(learning_rate=1e-3)
        run.resume()
        assert run.wait(WAIT_S) is wb.RunState.FINISHED
        assert clone_bytes == _trained_bytes(alone)
    assert source_bytes != clone_bytes


def test_promote_makes_a_member_the_sessions_policy(tmp_path: Path) -> None:
    with _session(tmp_path / "sweep") as sess:
        sweep = sess.sweep(sft_step, wb.grid(rank=[RANK, 8]), 2)
        assert sweep.wait(WAIT_S) is wb.RunState.FINISHED
        wider = sweep.members[1]
        sweep.promote(wider)
        assert sess.config.lora.rank == 8 and sess.step == wider.step == 2
        assert _trained_bytes(sess) == _trained_bytes(wider)
        assert sess.model_dir == tmp_path / "sweep"  # the session's folder and history go on
        run = sess.run(sft_step, 1)
        assert run.wait(WAIT_S) is wb.RunState.FINISHED, run.traceback
        assert sess.step == 3 and wider.step == 2  # the member is its own model still


def test_successive_halving_stops_the_worse_half(tmp_path: Path) -> None:
    with _session(tmp_path / "sweep") as sess:
        configs = wb.grid(learning_rate=[1e-4, 3e-2, 1e-3, 1e-2])
        sweep = sess.sweep(sft_step, configs, 4, halve_at=[2], by="loss:sum", mode="min")
        assert sweep.wait(WAIT_S) is wb.RunState.FINISHED
        stopped = [m for m in sweep.members if m.state is wb.RunState.STOPPED]
        kept = [m for m in sweep.members if m.state is wb.RunState.FINISHED]
        assert len(stopped) == 2 and all(m.i == 2 for m in stopped)
        assert len(kept) == 2 and all(m.i == 4 for m in kept)
        losses_at_2 = {m.settings.name: m.history.series("loss:sum")[1][1] for m in sweep.members}
        assert max(losses_at_2[m.settings.name] for m in kept) <= min(
            losses_at_2[m.settings.name] for m in stopped
        )
        assert sweep.halvings == [
            (2, [m.settings.name for m in sorted(stopped, key=lambda m: losses_at_2[m.settings.name])])
        ]
        assert sorted(sess.engine.model_ids()) == sorted([sess.model_id, *(m.model_id for m in kept)])


def test_a_run_is_refused_while_a_sweep_of_the_session_trains_or_waits_paused(tmp_path: Path) -> None:
    release = threading.Event()

    def held_step(member: wb.Member, i: int) -> object:
        assert release.wait(WAIT_S), "the test never released the step"
        return sft_step(member, i)  # type: ignore[arg-type]  # a member answers as a session

    with _session(tmp_path / "sweep") as sess:
        own_digest = sess.state_digest()
        sweep = sess.sweep(held_step, [{"learning_rate": 1e-2}], 2)
        for state in (wb.RunState.RUNNING, wb.RunState.PAUSED):
            assert sweep.state is state
            with pytest.raises(wb.RunActiveError, match=f"a sweep of this session is still {state.value}"):
                sess.run(sft_step, 1)
            with pytest.raises(wb.RunActiveError, match="sweep"):
                sess.run_async(lambda s, client, j: [], lambda s, groups, j: {}, 1)
            assert sess.current_run is None and sess.state_digest() == own_digest  # nothing started
            sweep.members[0].pause()  # after the held step: the sweep then waits paused
            release.set()
            assert sweep.wait(WAIT_S) is wb.RunState.PAUSED
        sweep.stop()
        run = sess.run(sft_step, 1)
        assert run.wait(WAIT_S) is wb.RunState.FINISHED, run.traceback
        assert sess.step == 1


def _live_tensor_bytes() -> int:
    """Bytes of every torch tensor alive in the process (parameters, optimizer moments, gradients)."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads a dead weakref.proxy's __class__ and raises
        if issubclass(type(obj), torch.Tensor):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def test_a_stopped_member_frees_its_adapter_and_optimizer_memory(tmp_path: Path) -> None:
    with _session(tmp_path / "sweep") as sess:
        sweep = sess.sweep(sft_step, [{"rank": 16}, {"rank": 16}], 2)
        assert sweep.wait(WAIT_S) is wb.RunState.FINISHED
        member = sweep.members[0]
        adapter_bytes = sum(
            t.numel() * t.element_size() for t in sess.engine.inspect(member.model_id).parameters.values()
        )
        before = _live_tensor_bytes()
        member.stop()
        freed = before - _live_tensor_bytes()
        assert member.state is wb.RunState.STOPPED and member.model_id not in sess.engine.model_ids()
        # the adapter and AdamW's two moments per parameter, at least (gradients may be freed already)
        assert freed >= 3 * adapter_bytes, (freed, adapter_bytes)
        assert sweep.members[1].model_id in sess.engine.model_ids()
        sweep.stop()  # the finished member too: the sweep is over
        assert sess.engine.model_ids() == [sess.model_id]


def test_members_are_w_and_b_runs_of_one_group_and_controls_act_between_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    with _session(tmp_path / "sweep") as sess:
        sweep = sess.sweep(sft_step, wb.grid(seed=[0, 1]), 3, wandb={"mode": "offline"})
        sweep.members[1].pause()
        assert sweep.wait(WAIT_S) is not wb.RunState.RUNNING
        first, second = sweep.members
        assert first.state is wb.RunState.FINISHED and second.state is wb.RunState.PAUSED and second.i < 3
        runs = [m.wandb_run for m in sweep.members]
        assert all(r is not None and r.mode == "offline" for r in runs)
        assert {r._run.group for r in runs if r is not None} == {sweep.name}
        sweep.stop()
        assert second.state is wb.RunState.STOPPED


def test_grid_is_the_product_and_a_config_splits_into_adapter_optimizer_and_options() -> None:
    configs = wb.grid(learning_rate=[1e-3, 1e-4], rank=[4, 8])
    assert configs == [
        {"learning_rate": 1e-3, "rank": 4},
        {"learning_rate": 1e-3, "rank": 8},
        {"learning_rate": 1e-4, "rank": 4},
        {"learning_rate": 1e-4, "rank": 8},
    ]
    settings = member_settings(
        {"rank": 8, "weight_decay": 0.1, "loss_fn": "ppo", "seed": 3}, wb.LoraConfig(rank=4, alpha=16), 0, "m"
    )
    assert settings.lora == wb.LoraConfig(rank=8, alpha=16)  # the session's, with the config's changes
    assert settings.adam_params == wb.AdamParams(weight_decay=0.1)
    assert settings.seed == 3 and settings.options == {"loss_fn": "ppo"} and settings.name == "m"
    with pytest.raises(ValueError, match="non-empty list"):
        wb.grid(learning_rate=[])
    with pytest.raises(ValueError, match="pause_if"):
        member_settings({"pause_if": {"loss": ("sideways", 1.0)}}, wb.LoraConfig(), 0, "m")
