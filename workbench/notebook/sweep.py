"""Sweeps: several configurations trained side by side, each its own LoRA model on the session's base.

`Session.sweep(step_fn, configs, steps)` makes one LoRA model per configuration on the session's engine
(one base in memory, so a member costs its adapter, optimizer state and activations) and calls
`step_fn(member, i)` for each member in turn, a step each, in submission order, on one sweep thread. It
returns the `Sweep` at once; the kernel stays free to watch, pause, clone or stop members.

A step function written for `Session.run` runs unmodified: a `Member` answers what step functions use of
a session (`policy`, `reference`, `sampling_client`, `tokenizer`, `config`, `step`, `record_rollouts`,
`current_run.adam_params`, `current_run.loop_state`, ...), for its own model. `member.current_run` is the
member itself: it holds the live settings and loop state a run holds.

Each member is what it would be alone, bit for bit: its adapter is initialised from its seed as a
session of that seed initialises its policy, and the engine's sampling generator (which draws the seeds
of sampling requests that give none) is swapped to the member's own stream, seeded like a session of its
seed, for the member's step and back after it (`Engine.swap_sampling_generator`, on the worker in
submission order). Its history rows (the `model` column names its adapter) go to its own
`MetricsHistory`, `history.jsonl` in its folder and its own W&B run, one W&B group per sweep.

Controls act between steps: per member `pause()`, `resume()`, `step()`... (`Member`), for the whole sweep
`pause()`, `resume()`, `stop()`; `clone(member, **changes)` starts a new member from another's adapter
and optimizer state with changed settings; `promote(member)` makes a member the session's policy.
Early stopping: a `pause_if` per member (as for `Session.run`), and successive halving (`halve_at`: at
each of those steps the worse half of the members still training, by a metric, is stopped). A stopped
member's model is deleted from the engine, freeing its adapter, gradients and optimizer state.

With `save_every=k` the whole sweep is saved every k rounds (a round: each member that may, one step),
where it starts, waits paused or ends, and a member when it stops: each member's run checkpoint in its
folder, the sweep's own state in `sweep.json` (`workbench.notebook.sweep_checkpoints`); a member whose
step raises goes back to its newest save. `Session.sweep(..., resume=<name>)` in a new session continues
it, each member ending as it would have without the interruption, bit for bit.

Members are models of the session's engine, so a served session (`Session.serve`) lists, samples and
checkpoints them over REST like any model; on a session of several devices each member trains
data-parallel over all of them, as the session's own model does.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import math
import secrets
import threading
import traceback
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from transformers import PreTrainedTokenizerBase

from workbench.engine.config import ModelConfig
from workbench.engine.interface import Restore
from workbench.engine.local.engine import Engine
from workbench.engine.model.base_model import BaseModelInfo
from workbench.engine.roles import Role
from workbench.futures import APIFuture
from workbench.loops.health import rollout_health
from workbench.loops.rollout_groups import RolloutGroup, attach_trainer_logprobs
from workbench.metrics import DISCARDED, JsonlSink, MetricsHistory, WandbSetting, WandbSink, open_wandb_run
from workbench.notebook.rollout_log import ROLLOUTS_FILE, RolloutLog
from workbench.notebook.run import PAUSED_POLL_S, RunState, StepFn, check_no_active_run
from workbench.notebook.run_checkpoints import (
    HISTORY_FILE,
    RUN_KEY,
    RunCheckpoint,
    checkpoint_name,
    rewind_logs,
    run_checkpoints,
    to_prune,
)
from workbench.notebook.sweep_checkpoints import (
    SWEEP_FILE,
    SavedMember,
    SavedSweep,
    check_json_options,
    decode_rng,
    encode_rng,
    read_sweep,
    write_sweep,
)
from workbench.notebook.triggers import PauseIf, Trigger, first_trigger, pause_rules
from workbench.sdk_conversion import to_adam_params, to_lora_config
from workbench.storage.model_folders import check_model_id
from workbench.tinker_api.clients import SamplingClient, TrainingClient
from workbench.types import AdamParams, ForwardBackwardOutput, LoraConfig

if TYPE_CHECKING:
    from workbench.notebook.session import Session

Mode = Literal["min", "max"]
"""Which end of a halving metric is better: `"min"` for a loss, `"max"` for a reward."""

SWEEP_PROJECT = "workbench"
"""The W&B project of the members' runs (the sessions' own)."""

_ADAM_FIELDS = frozenset(field.name for field in dataclasses.fields(AdamParams))
_LORA_FIELDS = frozenset(field.name for field in dataclasses.fields(LoraConfig)) - {"seed"}


def grid(**axes: Sequence[Any]) -> list[dict[str, Any]]:
    """The cartesian product of the axes, as `sweep` configs, the last axis varying fastest:
    `grid(learning_rate=[1e-3, 1e-4], seed=[0, 1])` is four configs."""
    names = list(axes)
    for name, values in axes.items():
        if isinstance(values, str) or not isinstance(values, Sequence) or not values:
            raise ValueError(f"grid({name}=...) needs a non-empty list of values, got {values!r}")
    return [dict(zip(names, values, strict=True)) for values in itertools.product(*axes.values())]


@dataclasses.dataclass(frozen=True)
class MemberSettings:
    """What defines a member: its adapter, optimizer settings, seed, pause triggers and the `options`
    its step function reads (`member.options["loss_fn"]`)."""

    name: str
    lora: LoraConfig
    adam_params: AdamParams
    seed: int
    pause_if: PauseIf | None = None
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The settings as `sweep.json` holds them (`workbench.notebook.sweep_checkpoints`)."""
        rules = pause_rules(self.pause_if)
        return json.loads(
            json.dumps(
                {
                    "name": self.name,
                    "lora": dataclasses.asdict(self.lora),
                    "adam_params": dataclasses.asdict(self.adam_params),
                    "seed": self.seed,
                    "pause_if": {rule.metric: [rule.direction, rule.threshold] for rule in rules},
                    "options": dict(self.options),
                }
            )
        )

    @classmethod
    def from_json(cls, fields: Mapping[str, Any]) -> MemberSettings:
        pause_if = {metric: (rule[0], rule[1]) for metric, rule in fields["pause_if"].items()}
        return cls(
            name=fields["name"],
            lora=to_lora_config(fields["lora"]),
            adam_params=to_adam_params(fields["adam_params"]),
            seed=fields["seed"],
            pause_if=pause_if or None,
            options=fields["options"],
        )


def member_settings(config: Mapping[str, Any], lora: LoraConfig, seed: int, name: str) -> MemberSettings:
    """A config's settings, the session's `lora` and `seed` where it leaves them out. Keys: `lora` (a
    `LoraConfig` or dict) or its fields (`rank`, `alpha`, `train_mlp`, ...); `adam_params` or its fields
    (`learning_rate`, `weight_decay`, ...); `seed`; `pause_if`; `name`; any other key is an option."""
    if not isinstance(config, Mapping):
        raise TypeError(f"a sweep config is a dict of settings, got {config!r}")
    settings = dict(config)
    lora_config = to_lora_config(settings.pop("lora", lora))
    lora_fields = {key: settings.pop(key) for key in list(settings) if key in _LORA_FIELDS}
    adam = to_adam_params(settings.pop("adam_params", AdamParams()))
    adam_fields = {key: settings.pop(key) for key in list(settings) if key in _ADAM_FIELDS}
    seed_value = settings.pop("seed", seed)
    if isinstance(seed_value, bool) or not isinstance(seed_value, int):
        raise ValueError(f"a member's seed must be an integer, got {seed_value!r}")
    pause_if = settings.pop("pause_if", None)
    pause_rules(pause_if)  # a malformed rule is refused before anything is created
    return MemberSettings(
        name=str(settings.pop("name", name)),
        lora=dataclasses.replace(lora_config, **lora_fields),
        adam_params=dataclasses.replace(adam, **adam_fields),
        seed=seed_value,
        pause_if=pause_if,
        options=settings,
    )


class _ModelRows:
    """A history sink that forwards the rows of one model (its adapter's label in the `model` column)
    to that model's own history."""

    def __init__(self, label: str, history: MetricsHistory) -> None:
        self.label = label
        self.history = history

    def write(self, row: Mapping[str, Any]) -> None:
        if row.get("model") != self.label:
            return
        self.history.rows.append(dict(row))
        for sink in self.history.sinks:
            sink.write(row)

    def log_event(self, name: str, payload: Mapping[str, Any]) -> None:
        """Events are the session's (a checkpoint saved, a member promoted): not a member's."""

    def close(self) -> None:
        for sink in self.history.sinks:
            sink.close()
        self.history.sinks.clear()


class Member:
    """One configuration of a sweep: its own LoRA model on the session's base, driven by the sweep.

    What a step function uses of a session, for this member's model: `policy`, `reference`,
    `sampling_client()`, `tokenizer`, `base_info`, `engine`, `model_id`, `model_dir`, `config` (its
    `ModelConfig`), `step`, `history` (its rows only), `rollouts`, `record_rollouts`, `state_digest()`,
    and `current_run` (the member itself: `adam_params`, `loop_state`, `step_started_at`). Its settings
    are `settings` (`options` those of the step function's own).

    Controls (between steps, like a run's): `pause()`, `resume()`, `step()` (one step while paused),
    `stop()` (ends it and frees its model), `set(**adam_fields)`.
    """

    def __init__(
        self,
        sweep: Sweep,
        settings: MemberSettings,
        model_id: str,
        rng_state: torch.Tensor,
        wandb: WandbSetting,
    ) -> None:
        engine = sweep.engine
        self.sweep = sweep
        self.settings = settings
        self.engine = engine
        self.model_id = model_id
        self.policy = TrainingClient(engine, model_id, Role.POLICY)
        self.reference = TrainingClient(engine, model_id, Role.REFERENCE)
        self.critic: TrainingClient | None = None  # a member trains its policy only
        self.adam_params = settings.adam_params
        """The optimizer settings the member's next step uses (`set()` edits them)."""
        self.pause_rules = pause_rules(settings.pause_if)
        self.loop_state: dict[str, Any] = {}
        """The step function's own state (a data cursor), as a run's `loop_state`."""
        self.steps = sweep.steps
        self.i = 0
        """Steps this member has completed."""
        self.step_started_at: int | None = None
        """The optimizer step the step in progress started from (None between steps)."""
        self.data_problems = None  # a run's data check of its first batch; a member does not run it
        self.trigger: Trigger | None = None
        self.error: BaseException | None = None
        self.traceback: str | None = None
        self.state = RunState.RUNNING
        # the sweep's bookkeeping, read and written with `sweep.changed` held
        self.busy = False  # the step function is executing
        self.single_steps = 0  # steps granted by step_once() while paused
        self.stop_requested = False  # stop() came during a step
        self._rng_state = rng_state
        self.rng_swap: APIFuture[torch.Tensor] | None = None
        """The swap that handed the engine its generator back after this member's last step: it resolves
        to the member's stream, read when first needed (by its next step, long done by then)."""
        status = engine.model_status(model_id)
        self.history = MetricsHistory()
        """This member's rows of the engine's history (also in its folder's `history.jsonl`)."""
        self.history_file = JsonlSink(status.model_dir / HISTORY_FILE)
        self.history.sinks.append(self.history_file)
        self.wandb_run = self._open_wandb(wandb, status.model_dir)
        if self.wandb_run is not None:
            self.history.sinks.append(self.wandb_run)
        self.rows = _ModelRows(status.adapter, self.history)
        """Forwards the engine's rows of this member's model (`rows.label`) to `history`."""
        engine.history.sinks.append(self.rows)
        self.rollouts = RolloutLog(status.model_dir / ROLLOUTS_FILE)
        self.clone_of: str | None = None
        """The model id of the member this one was cloned from (None for a config's)."""
        # with save_every: the newest run checkpoint with the sampling stream at it, and the member's
        # entry in sweep.json (`workbench.notebook.sweep_checkpoints`)
        self.saved: tuple[RunCheckpoint, torch.Tensor] | None = None
        self.saved_entry: SavedMember | None = None

    def _open_wandb(self, setting: WandbSetting, folder: Path) -> WandbSink | None:
        """The member's W&B run, in the sweep's group; a W&B failure leaves it off with a warning."""
        if setting is False:
            return None
        extra = {"group": self.sweep.name, "name": self.settings.name}
        extra.update(setting if isinstance(setting, Mapping) else {})
        try:
            return open_wandb_run(
                extra,
                config=self.config.to_dict(),
                run_id=self.model_id,
                project=SWEEP_PROJECT,
                directory=folder,
            )
        except Exception as error:
            warnings.warn(f"W&B is off for {self.settings.name}: {error!r}", RuntimeWarning, stacklevel=3)
            return None

    # ------------------------------------------------------------------------------------------ a session's face

    @property
    def rng_state(self) -> torch.Tensor:
        """The member's sampling generator state between its steps."""
        if self.rng_swap is not None:
            self._rng_state, self.rng_swap = self.rng_swap.result(), None
        return self._rng_state

    @property
    def current_run(self) -> Member:
        """The member itself: a step function reads `sess.current_run.adam_params` and `.loop_state`."""
        return self

    @property
    def options(self) -> Mapping[str, Any]:
        """The config's own keys, for the step function (a loss name, its config)."""
        return self.settings.options

    @property
    def config(self) -> ModelConfig:
        return self.engine.model_config(self.model_id)

    @property
    def model_dir(self) -> Path:
        return self.engine.model_status(self.model_id).model_dir

    @property
    def step(self) -> int:
        """The member's optimizer step count."""
        return self.engine.model_status(self.model_id).step

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    @property
    def base_info(self) -> BaseModelInfo:
        return self.engine.base_info

    @property
    def active(self) -> bool:
        return self.state in (RunState.RUNNING, RunState.PAUSED)

    def sampling_client(self, version: int | None = None) -> SamplingClient:
        """A client that samples this member's weights at `version` (default: the current ones)."""
        return SamplingClient(self.engine, self.engine.pin_sampler(self.model_id, version))

    def state_digest(self) -> str:
        """A sha256 of the member's adapter, gradients, optimizer state and counters (`Session.state_digest`).
        It hashes the adapter's name (`policy_2`, ...) and the engine's sampling generator too (the
        session's stream between steps): compare it with the member's own earlier digests; against a
        session, compare what `policy.save_state` writes and `rng_state`."""
        return self.engine.state_digest(self.model_id)

    def record_rollouts(
        self,
        groups: Sequence[RolloutGroup],
        *,
        trained: ForwardBackwardOutput | None = None,
        pass_threshold: float = 1.0,
    ) -> dict[str, float]:
        """`Session.record_rollouts` for this member: the groups go to its rollout log, their health
        signals to a history row of op `"rollouts"` at the step the member's step started from."""
        groups = list(groups)
        if trained is not None:
            groups = attach_trainer_logprobs(groups, trained)
        metrics = rollout_health(groups, pass_threshold)
        step = self.step_started_at if self.step_started_at is not None else self.step
        self.rollouts.append([dataclasses.replace(group, step=step) for group in groups])
        recorded = {
            name: value for name, value in metrics.items() if trained is None or name not in trained.metrics
        }
        self.engine.record("rollouts", self.rows.label, step, recorded).result()
        return metrics

    def rewind_to(self, saved: RunCheckpoint, rng_state: torch.Tensor) -> None:
        """Put the member's step index, `loop_state`, sampling stream and logs (rows since marked
        discarded) back to its run checkpoint `saved`, which its model was just loaded back to."""
        rewind_logs(self.model_dir, saved)
        self.history_file.reopen()
        for row in self.history.rows[saved.history_rows :]:
            row[DISCARDED] = True
        self.rollouts = RolloutLog(self.model_dir / ROLLOUTS_FILE)
        _ = self.rng_state  # the failed step's stream, handed back by its swap: dropped
        with self.sweep.changed:
            self._rng_state = rng_state.clone()
            self.loop_state.clear()
            self.loop_state.update(copy.deepcopy(saved.state))
            self.i = saved.next_step

    def latest(self, metric: str) -> float:
        """The member's newest value of `metric` (NaN when it has none)."""
        _, values = self.history.series(metric)
        return values[-1] if values else math.nan

    # ------------------------------------------------------------------------------------------ controls

    def pause(self) -> None:
        """Pause after the current step."""
        with self.sweep.changed:
            if self.state is RunState.RUNNING:
                self.state = RunState.PAUSED
                self.sweep.claim_save()
                self.sweep.changed.notify_all()

    def resume(self) -> None:
        """Continue a paused member (a failed step is retried)."""
        with self.sweep.changed:
            if self.state is RunState.PAUSED:
                self.state = RunState.RUNNING
                self.single_steps = 0
                self.trigger = self.error = self.traceback = None
                self.sweep.changed.notify_all()

    def step_once(self) -> None:
        """Take exactly one more step of a paused member, which then stays paused."""
        with self.sweep.changed:
            if self.state is not RunState.PAUSED:
                raise RuntimeError(
                    f"step_once() steps a paused member; {self.settings.name} is {self.state.value}"
                )
            self.single_steps += 1
            self.sweep.changed.notify_all()

    def stop(self) -> None:
        """End the member after its current step and delete its model, freeing its adapter, gradients
        and optimizer state (its folder stays). Clone or promote a member before stopping it."""
        with self.sweep.changed:
            if self.state is RunState.STOPPED:
                return
            if self.busy:
                self.stop_requested = True
                return
            self.state = RunState.STOPPED
            self.sweep.changed.notify_all()
        self.sweep.free(self)

    def set(self, **fields: Any) -> AdamParams:
        """Edit the member's `AdamParams` from its next step on."""
        with self.sweep.changed:
            self.adam_params = dataclasses.replace(self.adam_params, **fields)
            return self.adam_params

    def __repr__(self) -> str:
        lr = self.adam_params.learning_rate
        return f"Member({self.settings.name!r}, {self.state.value}, step {self.i}/{self.steps}, lr={lr:g})"


class Sweep:
    """Members trained in turn, a step each, on the sweep thread; made by `Session.sweep`.

    `members` in config order (clones after them); `wait()`; sweep-wide `pause()`, `resume()`, `stop()`;
    `clone(member, **changes)`; `promote(member)`; successive halving at `halve_at` steps by `by`.
    `halvings` lists what each halving stopped. With `save_every`, the whole sweep is saved in `folder`
    (`workbench.notebook.sweep_checkpoints`); `save_error` says why a save failed.
    """

    def __init__(
        self,
        session: Session,
        engine: Engine,
        step_fn: StepFn,
        steps: int,
        *,
        name: str,
        halve_at: Sequence[int] = (),
        by: str | None = None,
        mode: Mode = "min",
        wandb: WandbSetting = None,
        save_every: int | None = None,
        keep: int = 3,
        folder: Path | None = None,
    ) -> None:
        if not callable(step_fn):
            raise TypeError(f"step_fn must be a function step_fn(member, i) -> metrics, got {step_fn!r}")
        _check_schedule(steps, halve_at, by, mode)
        if save_every is not None and (
            isinstance(save_every, bool) or not isinstance(save_every, int) or save_every < 1
        ):
            raise ValueError(f"save_every must be a positive integer or None, got {save_every!r}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be a positive integer, got {keep!r}")
        self.session = session
        self.engine = engine
        self.step_fn = step_fn
        self.steps = steps
        self.name = name
        """The sweep's name: its members' W&B group and the stem of their model ids."""
        self.by, self.mode = by, mode
        self.wandb = wandb
        """The members' W&B setting (clones' too)."""
        self.halve_at = sorted(set(halve_at))
        self.halvings: list[tuple[int, list[str]]] = []
        """`(step, names of the members it stopped)` for each halving done."""
        self.members: list[Member] = []
        self.save_every, self.keep = save_every, keep
        self.folder = folder if folder is not None else session.model_dir.parent / name
        """Where `sweep.json` goes (with `save_every`): beside the members' folders."""
        self.rounds = 0
        """Rounds taken: in each, every member that may takes one step."""
        self.save_error: str | None = None
        """Why the newest save failed (the sweep paused), None after a save that succeeded."""
        self._saved_text: str | None = None  # what sweep.json holds now
        self._restoring = False  # members are being rebuilt from sweep.json: it is not rewritten meanwhile
        self._saving = False  # the loop saves the sweep where it now waits (`_claim_save`)
        self._looping = False  # the loop thread runs, or is about to
        self._closing: set[str] = set()  # members paused by close(): saved as running
        self.changed = threading.Condition()
        # held while a member takes a step, and by saves and clones; re-entered when a step stops a member
        self._between_steps = threading.RLock()
        self._thread = threading.Thread(target=self._loop, name="workbench-sweep", daemon=True)

    # ------------------------------------------------------------------------------------------ members

    def add(self, settings: MemberSettings) -> Member:
        """A new member: a LoRA model of its settings on the base, its sampling stream seeded as a
        session of its seed seeds its own."""
        model_id = f"{self.name}-{len(self.members)}"
        folder = self.folder.parent / model_id
        self.engine.create_model(
            settings.lora, seed=settings.seed, model_id=model_id, model_dir=folder
        ).result()
        rng = torch.Generator().manual_seed(settings.seed).get_state()
        return self._append(Member(self, settings, model_id, rng, self.wandb))

    def _append(self, member: Member) -> Member:
        with self.changed:
            self.members.append(member)
            self.changed.notify_all()
        return member

    def clone(self, member: Member, **changes: Any) -> Member:
        """A new member that starts where `member` is now (its adapter, optimizer state, step, loop
        state and sampling stream) with `changes` to its settings: `AdamParams` fields
        (`learning_rate=...`), `pause_if`, `name`, options. Made between steps; it trains from the
        sweep's next turn, after the others."""
        unknown = {key for key in changes if key in _LORA_FIELDS or key in ("lora", "seed")}
        if unknown:
            raise ValueError(
                f"a clone keeps its source's adapter and seed; it cannot change {sorted(unknown)}"
            )
        with self._between_steps:
            if member.state is RunState.STOPPED:
                raise RuntimeError(f"{member.settings.name} is stopped: its model is gone")
            base = {
                "lora": member.settings.lora,
                "adam_params": member.adam_params,
                "seed": member.settings.seed,
                "pause_if": member.settings.pause_if,
                **member.settings.options,
                "name": f"{member.settings.name}+{','.join(f'{k}={v}' for k, v in changes.items())}",
            }
            settings = member_settings({**base, **changes}, member.settings.lora, member.settings.seed, "")
            model_id = f"{self.name}-{len(self.members)}"
            saved = member.policy.save_state(f"clone-{model_id}", overwrite=True).result()
            self.engine.create_model_from_state(
                saved.path,
                restore=Restore.WITH_OPTIMIZER,
                model_id=model_id,
                model_dir=self.folder.parent / model_id,
            ).result()
            clone = Member(self, settings, model_id, member.rng_state.clone(), self.wandb)
            clone.i, clone.loop_state = member.i, copy.deepcopy(member.loop_state)
            clone.state = RunState.RUNNING if member.i < self.steps else RunState.FINISHED
            clone.clone_of = member.model_id
            self._append(clone)
            self._save([clone])
        self._start_thread()
        return clone

    def promote(self, member: Member) -> None:
        """Make `member`'s model the session's policy: the session's model is replaced by one built from
        the member's current state (adapter, optimizer state, counters), in the session's folder and
        history, so `sess.policy`, `sess.run` and checkpoints go on from the member. Between steps; the
        member itself trains on."""
        check_no_active_run(self.session)
        with self._between_steps:
            if member.state is RunState.STOPPED:
                raise RuntimeError(f"{member.settings.name} is stopped: its model is gone")
            saved = member.policy.save_state(f"promoted-{member.i}", overwrite=True).result()
            session, folder = self.session, self.session.model_dir
            self.engine.delete_model(session.model_id).result()
            self.engine.create_model_from_state(
                saved.path, restore=Restore.WITH_OPTIMIZER, model_id=session.model_id, model_dir=folder
            ).result()
        session.history.event("promoted", {"member": member.settings.name, "path": str(saved.path)})

    def free(self, member: Member) -> None:
        """Delete a stopped member's model from the engine (its adapter, gradients, optimizer state) and
        close its history's files; its folder stays. With `save_every` it is saved first, stopped."""
        if self.save_every is not None and not self.engine.closed:
            with self._between_steps:
                self._save([member])
        if member.rows in self.engine.history.sinks:
            self.engine.history.sinks.remove(member.rows)
        member.rows.close()
        if not self.engine.closed:
            self.engine.delete_model(member.model_id).result()

    # ------------------------------------------------------------------------------------------ controls

    @property
    def state(self) -> RunState:
        """`running` while a member trains, `paused` while members wait paused, else `finished`."""
        states = {member.state for member in self.members}
        if RunState.RUNNING in states:
            return RunState.RUNNING
        return RunState.PAUSED if RunState.PAUSED in states else RunState.FINISHED

    @property
    def active(self) -> bool:
        """Whether a member trains or waits paused (`Session.run` refuses meanwhile)."""
        return self.state is not RunState.FINISHED

    def pause(self) -> None:
        """Pause every running member after its current step."""
        for member in list(self.members):
            member.pause()

    def resume(self) -> None:
        """Resume every paused member."""
        for member in list(self.members):
            member.resume()

    def stop(self) -> None:
        """Stop every member (one training, after its current step), freeing their models: the sweep
        is over. Promote or clone a member first to keep it."""
        for member in list(self.members):
            member.stop()

    def close(self) -> None:
        """Pause every running member after its current step and wait for that (`Session.close`); with
        `save_every` the sweep is saved there, those members recorded running, so that a resumed sweep
        trains on at once."""
        with self.changed:
            self._closing = {m.model_id for m in self.members if m.state is RunState.RUNNING}
        self.pause()
        if threading.current_thread() is not self._thread:  # a step that closes its session goes on
            self.wait()

    def wait(self, timeout: float | None = None) -> RunState:
        """Block until no member trains: each has ended or waits paused (or until `timeout`)."""
        with self.changed:
            self.changed.wait_for(self._idle, timeout)
            return self.state

    def _idle(self) -> bool:
        return not self._saving and not self._runnable(busy=True)

    def _runnable(self, busy: bool = False) -> bool:
        """Whether a member trains or may take a step (or, with `busy`, is taking one). With `changed` held."""
        return any(m.state is RunState.RUNNING or m.single_steps or (busy and m.busy) for m in self.members)

    def claim_save(self) -> None:
        """Called with `changed` held when the sweep may have become idle: with `save_every`, `wait()`
        returns only after the loop has saved it where it waits."""
        if self.save_every is not None and not self._runnable(busy=True):
            self._saving = True

    def start(self) -> Sweep:
        """Save the sweep where it starts (with `save_every`: what a step failing before the first
        periodic save goes back to) and start its thread."""
        self._save()
        self._start_thread()
        return self

    def _start_thread(self) -> None:
        with self.changed:
            if not self._looping:
                if self._thread.ident is not None:  # it ended (every member had); a clone trains on
                    self._thread = threading.Thread(target=self._loop, name="workbench-sweep", daemon=True)
                self._looping = True
                self._thread.start()

    def __repr__(self) -> str:
        return f"Sweep({self.name!r}, {self.state.value}, {len(self.members)} members)"

    # ------------------------------------------------------------------------------------------ loop

    def _granted(self, member: Member) -> bool:
        """Whether `member` may take a step now (called with `changed` held)."""
        if member.state is RunState.RUNNING:
            return True
        if member.state is RunState.PAUSED and member.single_steps:
            member.single_steps -= 1
            return True
        return False

    def _loop(self) -> None:
        """Each member that may, in submission order, takes one step; then again, until none is left.
        With `save_every` the sweep is saved every that many rounds, and where it waits or ends."""
        while True:
            if self.session.closed:
                self._fail_all(RuntimeError("the session was closed"))
                return
            with self.changed:
                turn, waiting = list(self.members), not self._runnable()
            if waiting:
                if self.save_error is None:  # a failed save is retried by the next round's, not here
                    self._save()
                with self.changed:
                    self._saving = False
                    self.changed.notify_all()
                    if not any(member.active for member in self.members):
                        self._looping = False
                        return
                    if not self._runnable():
                        self.changed.wait(PAUSED_POLL_S)
                continue
            if not self._take_turn(turn):
                return

    def _take_turn(self, turn: Sequence[Member]) -> bool:
        """A round: one step of each member of `turn` that may take one. False once nothing can train."""
        stepped = False
        for member in turn:
            with self.changed:
                if not self._granted(member):
                    continue
                member.busy = True
                self.changed.notify_all()
            try:
                with self._between_steps:
                    self._take_step(member)
            except BaseException as error:  # the engine is gone (closed): nothing can train on
                self._fail_all(error)
                return False
            stepped = True
            self._halve()
        if stepped:
            self.rounds += 1
            if self.save_every is not None and self.rounds % self.save_every == 0:
                self._save()
        return True

    def _fail_all(self, error: BaseException) -> None:
        """End every member that is still active, `failed` with `error` (its session can take no steps)."""
        with self.changed:
            for member in self.members:
                if member.active or member.busy:
                    member.state, member.busy, member.error = RunState.FAILED, False, error
            self._saving = self._looping = False
            self.changed.notify_all()

    def _take_step(self, member: Member) -> None:
        """One step of `member`, with the engine's sampling generator on the member's own stream."""
        first_row = len(member.history.rows)
        failure: BaseException | None = None
        # neither swap is waited for here: the worker runs them in order with the step's operations
        swap_in = self.engine.swap_sampling_generator(member.rng_state)
        try:
            member.step_started_at = member.step
            metrics = self.step_fn(member, member.i)  # type: ignore[arg-type]  # a member answers as a session
            if metrics:
                self.engine.record("run_step", member.rows.label, member.step_started_at, metrics).result()
        except BaseException as error:  # a failed step pauses the member; the sweep trains on
            failure = error
            formatted = traceback.format_exc()
        finally:
            member.step_started_at = None
            if not self.engine.closed:
                member.rng_swap = self.engine.swap_sampling_generator(swap_in.result())
        trigger = first_trigger(member.pause_rules, member.history.rows[first_row:], member.i)
        with self.changed:
            member.busy = False
            if failure is not None:
                member.error, member.traceback = failure, formatted
                if member.state is RunState.RUNNING:
                    member.state = RunState.PAUSED
                member.single_steps = 0
            else:
                member.i += 1
                if trigger is not None:
                    member.trigger = trigger
                    if member.state is RunState.RUNNING:
                        member.state = RunState.PAUSED
                    member.single_steps = 0
            stop = member.stop_requested
            if stop:
                member.state, member.stop_requested = RunState.STOPPED, False
            elif failure is None and member.i >= self.steps:
                member.state = RunState.FINISHED
            self.claim_save()
            self.changed.notify_all()
        if failure is not None:
            self._after_failure(member, failure)
        if stop:
            self.free(member)

    def _after_failure(self, member: Member, failure: BaseException) -> None:
        """A member's step raised: with `save_every` it goes back to its newest save; it is paused."""
        rewound = self.save_every is not None and member.saved is not None and not self.engine.closed
        if rewound:
            self._rewind(member)
        warnings.warn(
            f"{member.settings.name}: step {member.i} raised {failure!r}; it paused"
            + (" (rewound to its newest save)" if rewound else ""),
            RuntimeWarning,
            stacklevel=3,
        )

    # ------------------------------------------------------------------------------------------ saving

    def _save(self, members: Sequence[Member] | None = None) -> None:
        """Save `members` (default: every member not stopped) where they are, then `sweep.json`, then
        prune their older run checkpoints (`workbench.notebook.sweep_checkpoints`). A failed save pauses
        the sweep and says why in `save_error`; the previous save is untouched."""
        if self.save_every is None or self.engine.closed:
            return
        with self._between_steps:
            chosen = (
                [m for m in self.members if m.state is not RunState.STOPPED] if members is None else members
            )
            try:
                saved = [member for member in chosen if self._save_member(member)]
                self._write_file()
                for member in saved:
                    for name in to_prune(member.model_dir, self.keep, None):
                        self.engine.delete_checkpoint(member.model_id, name).result()
            except Exception as error:
                self._save_failed(error)
                return
            self.save_error = None

    def _save_member(self, member: Member) -> bool:
        """A run checkpoint of `member` at its step (unless it has one there: False), and its `sweep.json`
        entry."""
        saving = member.saved is None or member.saved[0].next_step != member.i
        if saving:
            # a queued row: once it is recorded, every row of the member's steps before is in its history
            self.engine.record(
                "run_checkpoint", member.rows.label, member.step, {"run_step": member.i}
            ).result()
            wandb = member.wandb_run
            saved = RunCheckpoint(
                next_step=member.i,
                adam_params=dataclasses.asdict(member.adam_params),
                adam_params_from=member.i,
                history_rows=len(member.history.rows),
                rollout_batches=len(member.rollouts),
                wandb_run_id=wandb.run_id if wandb is not None else None,
                state=copy.deepcopy(member.loop_state),
                steps=self.steps,
                pause_if={rule.metric: (rule.direction, rule.threshold) for rule in member.pause_rules},
            )
            member.policy.save_state(
                checkpoint_name(member.i), overwrite=True, user_metadata={RUN_KEY: saved.to_json()}
            ).result()
            member.saved = (saved, member.rng_state.clone())
        saved, rng = member.saved
        member.saved_entry = SavedMember(
            model_id=member.model_id,
            settings=member.settings.to_json(),
            state=RunState.RUNNING.value if member.model_id in self._closing else member.state.value,
            adam_params=dataclasses.asdict(member.adam_params),
            rng_state=encode_rng(rng),
            checkpoint=checkpoint_name(saved.next_step),
            clone_of=member.clone_of,
        )
        return saving

    def _write_file(self) -> None:
        """Write `sweep.json` from the members' entries, unless it holds them already."""
        if self._restoring:
            return
        saved = SavedSweep(
            name=self.name,
            steps=self.steps,
            rounds=self.rounds,
            by=self.by,
            mode=self.mode,
            halve_at=list(self.halve_at),
            halvings=[(step, list(names)) for step, names in self.halvings],
            members=[m.saved_entry for m in self.members if m.saved_entry is not None],
        )
        text = saved.to_json()
        if text != self._saved_text:
            write_sweep(self.folder, saved)
            self._saved_text = text

    def _save_failed(self, error: Exception) -> None:
        with self.changed:
            self.save_error = (
                f"the sweep could not be saved after round {self.rounds} ({error!r}); it paused, its "
                "previous save is intact"
            )
            for member in self.members:
                if member.state is RunState.RUNNING:
                    member.state = RunState.PAUSED
                member.single_steps = 0
            self.changed.notify_all()
        warnings.warn(self.save_error, RuntimeWarning, stacklevel=3)

    def _rewind(self, member: Member) -> None:
        """Put a member whose step raised back at its newest run checkpoint: its model (adapter,
        optimizer state, counters, pending gradients), sampling stream, step index, `loop_state` and logs
        (rows since marked discarded), so that `resume()` retrains from there as if the step never ran."""
        assert member.saved is not None
        saved, rng = member.saved
        self.engine.load_state(
            member.model_id, checkpoint_name(saved.next_step), Restore.WITH_OPTIMIZER
        ).result()
        member.rewind_to(saved, rng)

    def restore_members(self, entries: Sequence[SavedMember]) -> None:
        """Rebuild the members `sweep.json` lists (`restore`), in order; if one cannot be, those
        rebuilt are freed again and the error raised. `sweep.json` is left as it is meanwhile."""
        self._restoring = True
        try:
            for entry in entries:
                self.restore(entry)
        except BaseException:
            for member in self.members:
                if member.state is not RunState.STOPPED:
                    self.free(member)
            raise
        finally:
            self._restoring = False

    def restore(self, entry: SavedMember) -> Member:
        """Rebuild the member `entry` of `sweep.json` describes: its model from its run checkpoint
        (`Restore.WITH_OPTIMIZER`: the engine's RNGs stay the session's), its folder's logs rewound to
        it, its step index, `loop_state`, optimizer settings, sampling stream and state as saved. A
        stopped member's model is freed again at once."""
        model_dir = self.folder.parent / entry.model_id
        found = {info.name: (info, saved) for info, saved in run_checkpoints(model_dir)}
        if entry.checkpoint not in found:
            raise FileNotFoundError(
                f"{model_dir} holds no run checkpoint {entry.checkpoint}, which {self.folder} names"
            )
        info, saved = found[entry.checkpoint]
        self.engine.create_model_from_state(
            info.path, restore=Restore.WITH_OPTIMIZER, model_id=entry.model_id, model_dir=model_dir
        ).result()
        rows = rewind_logs(model_dir, saved)
        rng = decode_rng(entry.rng_state)
        member = Member(self, MemberSettings.from_json(entry.settings), entry.model_id, rng, self.wandb)
        member.history.rows[:0] = rows
        member.i, member.loop_state = saved.next_step, copy.deepcopy(saved.state)
        member.adam_params = to_adam_params(entry.adam_params)
        member.clone_of = entry.clone_of
        member.saved, member.saved_entry = (saved, rng.clone()), entry
        member.state = _resumed_state(entry.state, saved.next_step, self.steps)
        self._append(member)
        if member.state is RunState.STOPPED:
            self.free(member)
        return member

    def _halve(self) -> None:
        """At each `halve_at` step that every member still training has reached, stop the worse half
        of them by `by` (NaN, or no value, counts as worst); the better ceil(n/2) train on."""
        if not self.halve_at:
            return
        at = self.halve_at[0]
        contestants = [
            m for m in self.members if m.state is not RunState.STOPPED and m.state is not RunState.FAILED
        ]
        if any(m.active and m.i < at for m in contestants):
            return
        self.halve_at.pop(0)
        assert self.by is not None
        sign = 1.0 if self.mode == "min" else -1.0

        def badness(member: Member) -> float:
            value = member.latest(self.by or "")
            return math.inf if math.isnan(value) else sign * value

        ranked = sorted(contestants, key=badness)  # stable: ties keep submission order
        losers = ranked[math.ceil(len(ranked) / 2) :]
        self.halvings.append((at, [member.settings.name for member in losers]))  # before a stop saves
        for member in losers:
            member.stop()


def _check_schedule(steps: int, halve_at: Sequence[int], by: str | None, mode: str) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if halve_at and by is None:
        raise ValueError("halve_at needs by=<metric> to rank the members")
    if mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
    if any(isinstance(s, bool) or not isinstance(s, int) or not 0 < s < steps for s in halve_at):
        raise ValueError(f"halve_at must be steps between 1 and {steps - 1}, got {list(halve_at)!r}")


def _resumed_state(saved: str, next_step: int, steps: int) -> RunState:
    """A resumed member's state: paused and stopped as saved; otherwise running until its last step."""
    if saved in (RunState.PAUSED.value, RunState.STOPPED.value):
        return RunState(saved)
    return RunState.RUNNING if next_step < steps else RunState.FINISHED


def _check_room(engine: Engine, members: int) -> None:
    free = engine.config.max_models - len(engine.model_ids())
    if members > free:
        raise ValueError(
            f"{members} members need {members} more models; the engine holds {free} more "
            f"(Session(max_models=...))"
        )


def _saved_folder(session: Session, resume: str | Path) -> Path:
    """A saved sweep's folder: a path, or a sweep's name (a folder beside the session's)."""
    if isinstance(resume, Path) or "/" in resume:
        return Path(resume).absolute()
    return session.model_dir.parent / resume


def _resume(
    session: Session,
    engine: Engine,
    step_fn: StepFn,
    settings: Sequence[MemberSettings],
    steps: int,
    resume: str | Path,
    **options: Any,
) -> Sweep:
    """The sweep saved in `resume`'s folder, its members rebuilt where they were saved."""
    folder = _saved_folder(session, resume)
    saved = read_sweep(folder)
    originals = [entry.settings for entry in saved.members if entry.clone_of is None]
    if [member.to_json() for member in settings] != originals:
        raise ValueError(
            f"a resumed sweep continues the members it saved: the configs differ from those of the sweep "
            f"in {folder} ({[entry['name'] for entry in originals]})"
        )
    _check_room(engine, sum(entry.state != RunState.STOPPED.value for entry in saved.members))
    sweep = Sweep(
        session,
        engine,
        step_fn,
        steps,
        name=saved.name,
        halve_at=saved.halve_at,
        by=saved.by,
        mode=saved.mode,  # type: ignore[arg-type]  # written from a Mode
        folder=folder,
        **options,
    )
    sweep.rounds, sweep.halvings = saved.rounds, saved.halvings
    sweep.restore_members(saved.members)
    return sweep


def _new_name(session: Session, name: str | None) -> str:
    if name is None:
        return f"{session.model_id}-sweep-{secrets.token_hex(2)}"
    check_model_id(f"{name}-0")  # the members' model ids
    return name


def start_sweep(
    session: Session,
    engine: Engine,
    step_fn: StepFn,
    configs: Sequence[Mapping[str, Any]],
    steps: int,
    *,
    halve_at: Sequence[int] = (),
    by: str | None = None,
    mode: Mode = "min",
    wandb: WandbSetting = None,
    save_every: int | None = None,
    keep: int = 3,
    name: str | None = None,
    resume: str | Path | None = None,
) -> Sweep:
    """Create the members of `configs` on `session`'s engine and start the sweep (`Session.sweep`), or,
    with `resume`, rebuild the sweep saved there and continue it."""
    check_no_active_run(session)
    configs = list(configs)
    if not configs:
        raise ValueError("a sweep needs at least one config")
    if wandb is None and session.wandb_run is None:
        wandb = False  # as the session: no W&B run for it, none for its members
    lora, seed = session.config.lora, session.config.seed
    settings = [
        member_settings(config, lora, seed, ",".join(f"{k}={v}" for k, v in config.items()) or f"m{k}")
        for k, config in enumerate(configs)
    ]
    if save_every is not None:
        for member in settings:
            check_json_options(member.name, member.options)
    saving = {"wandb": wandb, "save_every": save_every, "keep": keep}
    if resume is not None:
        sweep = _resume(session, engine, step_fn, settings, steps, resume, **saving)
    else:
        _check_room(engine, len(configs))
        sweep_name = _new_name(session, name)
        sweep = Sweep(
            session, engine, step_fn, steps, name=sweep_name, halve_at=halve_at, by=by, mode=mode, **saving
        )
        if save_every is not None and (sweep.folder / SWEEP_FILE).exists():
            raise ValueError(
                f"a sweep is saved in {sweep.folder}: resume={sweep_name!r} continues it, or name another"
            )
        for member in settings:
            sweep.add(member)
    session.sweeps.append(sweep)  # from here on the session refuses a run beside it
    return sweep.start()
