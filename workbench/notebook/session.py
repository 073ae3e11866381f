"""The kernel-resident Session: the notebook's front door to one model on an engine.

A Session makes an engine (the base model on the local GPU or CPU), one model on it (a Tinker model:
a LoRA policy and, when asked, a critic), and the Tinker clients for them: `sess.policy` and
`sess.critic` (`TrainingClient`s) and `sess.reference` (the base model with adapters off, forward
only). Around the engine it adds what a notebook needs: the model's folder with a JSONL history and a
W&B run, the background training loop (`sess.run`, a `Run`), plots, the panel, checkpoints by name.

Every operation goes through the engine's public interface (`workbench.engine.interface`): validated
in the caller's thread, taking effect in submission order, returning an `APIFuture`. The engine is the
local `Engine`, or, for a session made with `Session.connect(url, ...)`, a `RemoteEngine` that drives a
Tinker-compatible service (`workbench serve` on a GPU machine, SkyRL, hosted Tinker) through the
`tinker` SDK; everything else the session gives works the same over either.
The session's own state is only which model it speaks for; everything else (the critic, the counters,
the config) is read from the engine, so an interrupted call can never leave the session and the
engine disagreeing.

A script may end without `close()`: at interpreter exit every open session is closed
(`_close_open_sessions`), so its run stops after the current step, its servers stop and its queued
operations finish while every thread can still run, and the process exits with the script's status.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import warnings
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedTokenizerBase

from workbench.engine.config import (
    DEFAULT_MAX_MODELS,
    DEFAULT_MAX_TOKENS_PER_MICROBATCH,
    ModelConfig,
    QuantizationConfig,
)
from workbench.engine.interface import EngineInterface, Restore
from workbench.engine.local.base_models import BaseModels, format_size
from workbench.engine.local.engine import Engine
from workbench.engine.model.base_model import BaseModelInfo
from workbench.engine.remote.engine import DEFAULT_PROBE_INTERVAL_S, RemoteEngine, RemoteUnsupportedError
from workbench.engine.roles import Role
from workbench.engine.samplers import SamplerChoice
from workbench.engine.threads import ThreadUse
from workbench.futures import wait_or_withdraw
from workbench.loops.data_checks import check_data
from workbench.loops.health import rollout_health
from workbench.loops.rollout_groups import RolloutGroup, attach_trainer_logprobs
from workbench.metrics import (
    DISCARDED,
    JsonlSink,
    MetricsHistory,
    WandbSetting,
    WandbSink,
    history_run_name,
    open_wandb_run,
)
from workbench.notebook.async_run import AsyncRun, SampleFn, TrainFn, start_async_run
from workbench.notebook.evaluation import EvalFn, with_evaluation
from workbench.notebook.rollout_log import ROLLOUTS_FILE, RolloutLog
from workbench.notebook.run import Run, StepFn, start_run
from workbench.notebook.run_checkpoints import (
    HISTORY_FILE,
    RunCheckpoint,
    discard_history,
    newest_run_checkpoint,
    rewind_logs,
)
from workbench.notebook.sweep import Mode, Sweep, start_sweep
from workbench.notebook.triggers import PauseIf
from workbench.sdk_conversion import to_datum, to_lora_config
from workbench.server import ServerConfig, TinkerServer
from workbench.storage.checkpoint_store import STATE_DIR, CheckpointError, CheckpointInfo, CheckpointKind
from workbench.storage.model_folders import models_root, new_model_id
from workbench.storage.run_description import read_notes, write_notes
from workbench.tinker_api.clients import SamplingClient, TrainingClient
from workbench.tinker_api.service_client import ServiceClient
from workbench.types import ForwardBackwardOutput, LoadWeightsResponse, LoraConfig

if TYPE_CHECKING:
    import openai
    from matplotlib.figure import Figure

    from workbench.notebook.panel import Panel
    from workbench.notebook.panel.rollouts_tab import RolloutExplorer

WANDB_PROJECT = "workbench"


def _count_rows(path: Path) -> int:
    if not path.exists():
        return 0
    with path.open(encoding="utf-8") as lines:
        return sum(1 for line in lines if line.strip())


def _model_dir_from(model_dir: str | Path | None, run_dir: str | Path | None) -> str | Path | None:
    """`model_dir`, or `run_dir`, its deprecated name, with a DeprecationWarning."""
    if run_dir is None:
        return model_dir
    if model_dir is not None:
        raise TypeError("pass model_dir, or run_dir (its deprecated name), not both")
    warnings.warn("the run_dir argument is now model_dir", DeprecationWarning, stacklevel=3)
    return run_dir


class Session:
    """A base model with a LoRA policy, trained through Tinker's API, in this process.

    Args:
        base_model: a built-in alias (`"tiny"`, `"smollm2-135m"`), a local HF folder or an HF hub id.
        lora: the policy's adapter (`LoraConfig`, the SDK's, or a dict); default rank 32 on every layer.
        critic: True for a critic (a value model sharing the frozen base, see `create_critic`), or its
            adapter's `LoraConfig`; False for none.
        seed: seeds the adapters' initialisation (unless `lora.seed` is set) and the samplers.
        device, dtype: default CUDA/bf16 when a GPU is present, else CPU/fp32.
        max_tokens_per_microbatch: padded tokens per forward pass; bounds activation memory.
        sampler: `"hf"` (generate in-process), `"vllm"` (LoRA hot-swap, on a GPU or with the CPU build;
            a script needs the `if __name__ == "__main__":` guard, as vLLM spawns its engine processes)
            or `"auto"` (vLLM when a build for the device is installed and runs the model, else HF).
        max_samples_per_request: the largest `num_samples` one sample call may ask for; bounds memory.
        max_models: how many LoRA models may share the base (this session's run, and those that clients
            of `serve()` create).
        threads: torch CPU threads for every operation. None (default): before each operation, one per
            usable core (affinity, cgroup quota) that other processes leave free, since a busy core slows
            every parallel kernel several times over (`workbench.engine.threads`); `OMP_NUM_THREADS`,
            when set, fixes it. `sess.threads` says what is in force.
        model_dir: the model's folder, where the session writes its history (`history.jsonl`),
            checkpoints and W&B files; default `$WORKBENCH_RUNS/<model id>` (`./runs` when unset). Its
            name is the model id: the Tinker model id, the W&B run id and the first part of its
            `tinker://` checkpoint paths. (The argument's old name is still accepted, with a warning.)
        wandb: False for no W&B run; None/True for a run that is online when W&B credentials are
            configured and offline otherwise; a dict of extra `wandb.init` arguments (which win over
            W&B's environment variables, which win over workbench's defaults).
        memory_budget_bytes: what the base models this session holds may take together (its own, and
            a teacher or grader its service clients load); a load past it first frees idle ones, then
            is refused naming the budget and what holds it. None: no bound.
        quantize: `"nf4"`, `"fp4"`, `"int8"` or a `QuantizationConfig` (double quantization, compute
            dtype): the frozen base's linear layers quantized at load with bitsandbytes (QLoRA); the
            adapters, their gradients and optimizer state stay as on an unquantized base, and the critic
            shares the quantized base. None (default): the base in `dtype`. See docs/models.md.
        devices: None or 1 (default): the session on one device (`device`). A count, `"all"` (every CUDA
            device) or device names (`["cuda:0", "cuda:1"]`): the engine trains on that many ranks,
            data parallel through torch.distributed (two CPU ranks on a machine without CUDA for
            `devices=2`), with the same results as one device; the ranks are processes the session starts
            and ends. See docs/architecture.md.
        shard_base: With several devices: True shards the frozen base across the ranks (FSDP2), each
            holding about 1/N of it, for a base bigger than one device (every rank then runs every pass,
            and sampling is refused); None (default) does so when the base does not fit one device,
            with a warning saying so; False never.
    """

    def __init__(
        self,
        base_model: str = "tiny",
        lora: LoraConfig | Mapping[str, Any] | None = None,
        *,
        critic: bool | LoraConfig | Mapping[str, Any] = False,
        seed: int = 0,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        max_tokens_per_microbatch: int = DEFAULT_MAX_TOKENS_PER_MICROBATCH,
        sampler: SamplerChoice = "auto",
        max_samples_per_request: int = 128,
        max_models: int = DEFAULT_MAX_MODELS,
        threads: int | None = None,
        model_dir: str | Path | None = None,
        wandb: WandbSetting = None,
        memory_budget_bytes: int | None = None,
        quantize: str | QuantizationConfig | None = None,
        run_dir: str | Path | None = None,  # deprecated name of model_dir
        devices: int | str | Sequence[str] | None = None,
        shard_base: bool | None = None,
    ):
        model_dir = _model_dir_from(model_dir, run_dir)
        lora_config = to_lora_config(lora if lora is not None else LoraConfig())
        critic_config = None if isinstance(critic, bool) else to_lora_config(critic)
        if memory_budget_bytes is not None and (
            isinstance(memory_budget_bytes, bool)
            or not isinstance(memory_budget_bytes, int)
            or memory_budget_bytes <= 0
        ):
            raise ValueError(f"memory_budget_bytes must be a positive integer, got {memory_budget_bytes!r}")
        if shard_base and devices in (None, 1):
            raise ValueError("shard_base=True shards the base across several ranks: give devices= too")
        engine = Engine(
            base_model,
            seed=seed,
            device=device,
            dtype=dtype,
            max_tokens_per_microbatch=max_tokens_per_microbatch,
            sampler=sampler,
            max_samples_per_request=max_samples_per_request,
            max_models=max_models,
            threads=threads,
            quantize=quantize,
            devices=devices,
            shard_base=shard_base,
        )
        folder = (
            Path(model_dir) if model_dir is not None else models_root() / new_model_id(base_model)
        ).absolute()
        try:
            model_id = engine.create_model(
                lora_config, seed=seed, model_id=folder.name, model_dir=folder
            ).result()
            if critic is not False:
                engine.create_critic(model_id, critic_config).result()
        except BaseException:
            engine.close()
            raise
        self._attach(engine, model_id, wandb)
        if self.base_models is not None:
            self.base_models.memory_budget_bytes = memory_budget_bytes

    @classmethod
    def connect(
        cls,
        url: str | None = None,
        *,
        base_model: str,
        lora: LoraConfig | Mapping[str, Any] | None = None,
        api_key: str | None = None,
        seed: int = 0,
        model_dir: str | Path | None = None,
        wandb: WandbSetting = None,
        probe_interval_s: float = DEFAULT_PROBE_INTERVAL_S,
        run_dir: str | Path | None = None,  # deprecated name of model_dir
    ) -> Session:
        """A session whose model lives on a Tinker-compatible service, driven through the `tinker` SDK.

        The clients, the run loop, the panel, the history (JSONL and W&B, kept in this process), plots
        and token views work as for a local session. What the service cannot do raises a
        `RemoteUnsupportedError` before anything is sent: a critic, a loss it does not list,
        `state_digest`, checkpoints named by local folders rather than `tinker://` paths. An operation
        whose service stops answering fails with `EngineUnreachableError` (within `probe_interval_s`
        and a health check); the history records only the operations that completed.

        Args:
            url: The service's base URL; default `$TINKER_BASE_URL`.
            base_model: The base model, as the service names it (its capabilities list them).
            lora: The policy's adapter, as for `Session(...)`; default: `LoraConfig()` in the layout
                the service builds (SkyRL's: alpha 32, attention and MLP, no unembedding), shown in the
                session's repr and its config in the history.
            api_key: The service's key; default `$TINKER_API_KEY` (read by the SDK).
            seed: Seeds the adapter's initialisation unless `lora.seed` is set.
            model_dir: The local folder for the history and W&B files; default `<models root>/<model id>`.
            wandb: As for `Session(...)`.
            probe_interval_s: How long an operation waits before checking that the service answers.
        """
        model_dir = _model_dir_from(model_dir, run_dir)
        url = url or os.environ.get("TINKER_BASE_URL")
        if not url:
            raise ValueError("Session.connect needs the service's URL: pass url=... or set TINKER_BASE_URL")
        engine = RemoteEngine(url, base_model, api_key=api_key, seed=seed, probe_interval_s=probe_interval_s)
        # no adapter named: the one the service builds (an explicit one it would not honour is refused)
        lora_config = to_lora_config(lora) if lora is not None else engine.default_lora()
        folder = (
            Path(model_dir) if model_dir is not None else models_root() / new_model_id(base_model)
        ).absolute()
        try:
            model_id = engine.create_model(
                lora_config, seed=seed, model_id=folder.name, model_dir=folder
            ).result()
        except BaseException:
            engine.close()
            raise
        session = cls.__new__(cls)
        cls._attach(session, engine, model_id, wandb)
        if lora is None:  # say which adapter the service's layout gave (W&B's events; the repr)
            engine.history.event(
                "adapter", {"lora": dataclasses.asdict(lora_config), "from": "the service's layout"}
            )
        return session

    def _attach(
        self,
        engine: EngineInterface,
        model_id: str,
        wandb: WandbSetting,
        resume_point: RunCheckpoint | None = None,
        new_model: bool = True,
    ) -> None:
        """Speak for `model_id` on `engine`: its clients, its history sinks, its W&B run. With a
        `resume_point`, the folder's logs are first rewound to it and its history rows read back; for a
        `new_model` (not loaded from a checkpoint), rows an earlier model left in the folder (a run
        started over after a kernel died before its first save) are marked discarded."""
        self.engine: EngineInterface = engine
        self.base_models = BaseModels(engine) if isinstance(engine, Engine) else None
        """The base models this session holds (None for a remote engine: its service holds them): its
        own, and those its service clients loaded (a teacher, a grader, a reference), each on its
        engine; `serve()` serves them all."""
        self.model_id = model_id
        self.policy = TrainingClient(engine, model_id, Role.POLICY)
        self.reference = TrainingClient(engine, model_id, Role.REFERENCE)
        self._critic = TrainingClient(engine, model_id, Role.CRITIC)
        self.policy.on_batch = self._check_first_batch
        self.current_run: Run | None = None
        """The latest run started by `run()` (active or ended; its state, error and traceback stay
        readable), None before the first. Step functions read their live settings from it:
        `sess.current_run.adam_params`."""
        self.sweeps: list[Sweep] = []
        """The sweeps `sweep()` started (ended ones included), newest last: no `run()` starts while
        one is active."""
        self.servers: list[TinkerServer] = []
        """The servers `serve()` started (stopped ones included), newest last."""
        self.resume_point = resume_point
        """The run checkpoint the next `run()` continues from (`from_checkpoint` on a model folder)."""
        if resume_point is not None:
            engine.history.rows[:0] = rewind_logs(self.model_dir, resume_point)
            self.history_offset = 0
        elif new_model:  # an earlier model's rows are kept, marked discarded
            self.history_offset = discard_history(self.model_dir)
        else:
            self.history_offset = _count_rows(self.model_dir / HISTORY_FILE)
        """Rows of `history.jsonl` this session's history does not hold (written by an earlier session)."""
        self._wandb_setting = wandb  # what `restart()` opens the W&B run with again
        self._history_sink = JsonlSink(self.model_dir / HISTORY_FILE)
        engine.history.sinks.append(self._history_sink)
        self.rollouts = RolloutLog(self.model_dir / ROLLOUTS_FILE)
        """The rollout groups `record_rollouts` recorded, one batch per call (also in `rollouts.jsonl`)."""
        self.wandb_run = self._open_wandb(wandb)
        _open_sessions.add(self)

    def rewind_logs(self, saved: RunCheckpoint) -> None:
        """Rewind the history (file and memory: rows after `saved` marked discarded) and the rollout log
        to the run checkpoint `saved`, which the model was just loaded back to (a run's failed step)."""
        rewind_logs(self.model_dir, saved)
        self._history_sink.reopen()
        for row in self.engine.history.rows[max(saved.history_rows - self.history_offset, 0) :]:
            row[DISCARDED] = True
        self.rollouts = RolloutLog(self.model_dir / ROLLOUTS_FILE)

    def _check_first_batch(self, data: Sequence[Any]) -> None:
        """The data check of a run's first policy batch (`wb.check_data`): its problems go to
        `run.data_problems` (the panel shows them) and a warning. A batch that does not convert is left
        to `forward_backward` to refuse."""
        run = self.current_run
        if run is None or not run.busy or run.data_problems is not None:
            return
        try:
            batch = [to_datum(datum) for datum in data]
        except (TypeError, ValueError):
            return
        run.data_problems = check_data(
            batch, end_of_turn=self.tokenizer.eos_token_id, max_length=self.base_info.max_length
        )
        if run.data_problems:
            listed = "; ".join(map(str, run.data_problems[:5]))
            more = f" (and {len(run.data_problems) - 5} more)" if len(run.data_problems) > 5 else ""
            warnings.warn(f"the run's first batch: {listed}{more}", RuntimeWarning, stacklevel=3)

    def _open_wandb(self, setting: WandbSetting) -> WandbSink | None:
        """Start the session's W&B run; a W&B failure leaves W&B off with a warning, never the session."""
        try:
            sink = open_wandb_run(
                setting,
                config=self.config.to_dict(),
                run_id=self.model_id,
                project=WANDB_PROJECT,
                directory=self.model_dir,
            )
        except Exception as error:
            warnings.warn(f"W&B is off for this session: {error!r}", RuntimeWarning, stacklevel=3)
            return None
        if sink is not None:
            self.engine.history.sinks.append(sink)
        return sink

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        *,
        device: str | None = None,
        model_dir: str | Path | None = None,
        wandb: WandbSetting = None,
        threads: int | None = None,
        devices: int | str | Sequence[str] | None = None,
        shard_base: bool | None = None,
        run_dir: str | Path | None = None,  # deprecated name of model_dir
    ) -> Session:
        """A new session that continues the run saved by `save_state` at `path` (a `tinker://` path or the
        checkpoint's folder), exactly: same config (base model, adapters, critic, seed, dtype), weights,
        optimizer state, counters, weight versions and RNG states.

        `path` may also be a model folder: its newest complete run checkpoint (what `run(...,
        save_every=k)` saves) is loaded, the folder's history and rollout log are rewound to it, and the
        session's next `run()` continues that run at the saved step (`resume_point`; see
        `workbench.notebook.run_checkpoints`). `threads` as for `Session(...)`: a resume that must
        repeat bit for bit fixes it.

        It continues in the checkpoint's model folder (`<model_dir>` for a checkpoint at
        `<model_dir>/checkpoints/<name>`) when that folder's name is the saved model id, else in
        `<models root>/<model id>`; the model id stays the same, so the W&B run resumes too. `device` (and with
        it the sampler) follows this machine unless given; `model_dir`, `wandb`, `devices` and `shard_base`
        as for `Session(...)` (a state saved on any number of ranks loads on any other).
        """
        model_dir = _model_dir_from(model_dir, run_dir)
        resume_point = None
        if Path(path).is_dir() and (Path(path) / STATE_DIR).is_dir():  # a model folder
            resume_point = newest_run_checkpoint(Path(path).absolute())
            if resume_point is None or resume_point.path is None:
                raise CheckpointError(
                    f"{path} holds no complete run checkpoint (a run with save_every saves them)"
                )
            path = resume_point.path
        probe = Engine.folder_of_checkpoint(path)
        saved = Engine.parse_checkpoint(probe)
        arguments = saved.session_arguments
        if model_dir is None:
            own = probe.absolute().parent.parent
            model_dir = (
                own
                if probe.absolute().parent.name == STATE_DIR and own.name == saved.model_id
                else models_root() / saved.model_id
            )
        engine = Engine(
            arguments["base_model"],
            seed=arguments["seed"],
            device=device,
            dtype=arguments["dtype"],
            max_tokens_per_microbatch=arguments["max_tokens_per_microbatch"],
            max_samples_per_request=arguments["max_samples_per_request"],
            quantize=arguments["quantization"],
            threads=threads,
            devices=devices,
            shard_base=shard_base,
        )
        try:
            model_id = engine.create_model_from_state(
                probe, restore=Restore.EVERYTHING, model_id=saved.model_id, model_dir=model_dir
            ).result()
        except BaseException:
            engine.close()
            raise
        session = cls.__new__(cls)
        cls._attach(session, engine, model_id, wandb, resume_point, new_model=False)
        return session

    def restart(self) -> Session:
        """A new session in this one's place, from its model's last saved state: what a session must do
        after a rank of its devices died or the ranks fell apart (`RankFailedError`), when no operation
        can run on it any more.

        The last saved state is the model folder's newest complete state checkpoint (`save_state`, or a
        run's `save_every` checkpoint, whose run the new session's next `run()` then continues at the
        saved step, as `from_checkpoint(model_dir)` does). This session is closed first (its follower
        ranks ended, its folder freed); the new one has the same devices, base sharding, threads and W&B
        setting, continues in the same folder with the same model id (the W&B run resumes), and holds
        what the checkpoint holds: operations after it are lost. Use it as `sess = sess.restart()`.

        Raises `CheckpointError`, leaving this session as it is, when the model has no saved state.
        """
        engine = self._local_engine("restart() loads a local checkpoint on a local engine")
        model_dir, threads = self.model_dir, engine.config.threads
        saved = [info for info in self.list_checkpoints() if info.kind == "state"]
        if not saved:
            raise CheckpointError(
                f"{model_dir} holds no saved state to restart from: save_state (or run(..., save_every=k)) "
                "saves one; without one, make a new Session"
            )
        newest = max(saved, key=lambda info: info.time)
        run_point = newest_run_checkpoint(model_dir)
        resume_from = model_dir if run_point is not None and run_point.path == newest.path else newest.path
        devices = engine.devices if len(engine.devices) > 1 else None
        shard_base = engine.sharded if devices is not None else None
        self.close()
        return Session.from_checkpoint(
            resume_from,
            device=None if devices is not None else engine.config.device,
            model_dir=model_dir,
            wandb=self._wandb_setting,
            threads=threads,
            devices=devices,
            shard_base=shard_base,
        )

    # ------------------------------------------------------------------------------------------ state

    @property
    def config(self) -> ModelConfig:
        """Everything that defines this session's model (what its checkpoints and W&B run record)."""
        return self.engine.model_config(self.model_id)

    @property
    def model_dir(self) -> Path:
        """The model's folder: its history, checkpoints and W&B files."""
        return self.engine.model_status(self.model_id).model_dir

    @property
    def run_dir(self) -> Path:
        """Deprecated: `model_dir`."""
        warnings.warn("Session.run_dir is now Session.model_dir", DeprecationWarning, stacklevel=2)
        return self.model_dir

    @property
    def critic(self) -> TrainingClient | None:
        """The critic's training client, or None while the run has no critic."""
        return self._critic if self.engine.model_status(self.model_id).critic_lora is not None else None

    @property
    def step(self) -> int:
        """The policy's optimizer step count: the x-axis of the history."""
        return self.engine.model_status(self.model_id).step

    @property
    def history(self) -> MetricsHistory:
        return self.engine.history

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    @property
    def base_info(self) -> BaseModelInfo:
        return self.engine.base_info

    @property
    def device(self) -> torch.device:
        where = self.engine.endpoint
        return self._local_engine(f"the model lives on the engine at {where}: it has no local device").device

    @property
    def threads(self) -> ThreadUse | None:
        """The torch CPU thread count the engine's operations use now, and why; None for a remote
        engine (its threads are its server's)."""
        return self.engine.threads if isinstance(self.engine, Engine) else None

    @property
    def dtype(self) -> torch.dtype:
        where = self.engine.endpoint
        return self._local_engine(
            f"the model lives on the engine at {where}: its dtype is not reported"
        ).dtype

    @property
    def closed(self) -> bool:
        return self.engine.closed

    def state_digest(self, model: str | None = None) -> str:
        """A sha256 over everything training can change: every adapter's weights, accumulated gradients,
        optimizer state and counters (of one model, `"policy"` or `"critic"`, when given), taken between
        operations. Equal digests mean bit-identical training state."""
        engine = self._local_engine(
            f"state_digest hashes local tensors; the training state lives on the engine at {self.engine.endpoint}"
        )
        return engine.state_digest(self.model_id, None if model is None else Role(model))

    # ------------------------------------------------------------------------------------------ critic

    def create_critic(self, lora: LoraConfig | Mapping[str, Any] | None = None) -> TrainingClient:
        """Add a critic: a second LoRA adapter plus a zero-initialised value head on the same frozen base
        weights (one copy of the base in memory), with its own AdamW. Returns `sess.critic`.

        Default adapter: the policy's rank and alpha on attention and MLP layers. Interrupted while it
        waits behind queued work, the call is withdrawn (or, once started, completes): never half-done.
        """
        engine = self._local_engine(
            f"the engine at {self.engine.endpoint} is driven through the tinker SDK, which has no critic models: "
            "a remote session trains its policy only"
        )
        wait_or_withdraw(engine.create_critic(self.model_id, None if lora is None else to_lora_config(lora)))
        return self._critic

    def delete_critic(self) -> None:
        """Remove the critic and free its adapter, value head and optimizer state. The policy's adapter,
        gradients and optimizer are untouched. Interruptible like `create_critic`."""
        engine = self._local_engine(
            f"{self.model_id!r} has no critic on the engine at {self.engine.endpoint}"
        )
        wait_or_withdraw(engine.delete_critic(self.model_id))

    # ------------------------------------------------------------------------------------------ sampling

    def sampling_client(self, version: int | None = None, *, base: bool = False) -> SamplingClient:
        """A client that samples the policy's weights at `version` (default: the weights the operations
        submitted before this call leave), or the base model with adapters off (`base=True`). A past
        version is available while some live client is pinned to it (see `live_versions`)."""
        if base and version is not None:
            raise ValueError("a base-model client has no version: pass base=True or a version, not both")
        return SamplingClient(self.engine, self.engine.pin_sampler(None if base else self.model_id, version))

    def _local_engine(self, why: str) -> Engine:
        """The local engine, for what needs the model in this process; a session that drives a remote
        engine refuses, before anything is sent, with a `RemoteUnsupportedError` saying `why`."""
        if not isinstance(self.engine, Engine):
            raise RemoteUnsupportedError(why)
        return self.engine

    def service_client(self, *sdk_arguments: Any, **sdk_keywords: Any) -> ServiceClient:
        """A Tinker `ServiceClient` whose clients for this session's base model live on this session's
        engine: code written for the `tinker` SDK (a tinker-cookbook training loop) trains new runs
        next to this one, in this session's history and panel. Takes `tinker.ServiceClient`'s
        arguments, so it can stand in for it: `tinker.ServiceClient = sess.service_client`. Closing the
        client leaves the session open."""
        self._local_engine(
            f"service_client() needs the model in this process; this session drives {self.engine.endpoint}"
        )
        return ServiceClient(*sdk_arguments, base_models=self.base_models, **sdk_keywords)

    def live_versions(self) -> list[int]:
        """The policy weight versions a sampling client can use now: the current one and those that live
        clients are pinned to."""
        return self.engine.model_status(self.model_id).live_versions

    # ------------------------------------------------------------------------------------------ checkpoints

    def load_state(self, path: str | Path) -> LoadWeightsResponse:
        """Put the run back exactly as a `save_state` checkpoint holds it: weights, optimizer state,
        counters, pending gradients and RNG states (what `from_checkpoint` restores, into this session).
        Verified before anything changes; each weights_version becomes max(saved, current) + 1."""
        return self.engine.load_state(self.model_id, path, Restore.EVERYTHING).result()

    def list_checkpoints(self) -> list[CheckpointInfo]:
        """This run's complete checkpoints, state (`save_state`) and sampler (`save_weights_for_sampler`),
        oldest first. Leftovers of interrupted saves and expired checkpoints are not listed
        (`cleanup_checkpoints` removes them)."""
        return self.engine.list_checkpoints(self.model_id)

    def delete_checkpoint(self, name: str, kind: CheckpointKind = "state") -> None:
        """Delete this run's checkpoint `name` (`kind="sampler"` for sampler weights). Runs between
        operations, so it never races a save."""
        self.engine.delete_checkpoint(self.model_id, name, kind).result()

    def cleanup_checkpoints(self) -> list[Path]:
        """Remove what interrupted saves and deletions left behind in this run's checkpoint folders, and
        expired checkpoints; returns the removed paths. Runs between operations."""
        engine = self._local_engine(
            f"the engine at {self.engine.endpoint} keeps its own checkpoint folders tidy"
        )
        return engine.cleanup_checkpoints(self.model_id).result()

    def export_merged(self, path: str | Path) -> Path:
        """Write the policy merged into the base weights, with the tokenizer, as a new HF model folder
        at `path` (for `AutoModelForCausalLM.from_pretrained` and serving); the session is unchanged.
        See `workbench.engine.local.merged_export`."""
        engine = self._local_engine(
            f"the weights live on the engine at {self.engine.endpoint}: export a merged model there, or download "
            "the sampler weights (RestClient.get_checkpoint_archive_url) and merge them with peft"
        )
        return engine.export_merged(self.model_id, path).result()

    # ------------------------------------------------------------------------------------------ runs and views

    def run(
        self,
        step_fn: StepFn,
        steps: int,
        *,
        adam_params: Any = None,
        paused: bool = False,
        pause_if: PauseIf | None = None,
        evaluate: EvalFn | None = None,
        eval_every: int = 10,
        save_every: int | None = None,
        keep: int = 3,
        keep_every: int | None = None,
    ) -> Run:
        """Call `step_fn(sess, i)` for `i = 0 .. steps-1` on a background thread; returns the `Run` at once.

        The kernel stays free while it trains, so the panel and later cells can `pause()`, `step()`,
        `resume()`, `stop()` or `set(learning_rate=...)` it between steps (see `workbench.notebook.run`). Each
        step's returned metrics are recorded in the history as op `"run_step"`.

        Args:
            step_fn: One training step; it reads `sess.current_run.adam_params` for its `optim_step`.
            steps: How many steps to run.
            adam_params: The run's initial optimizer settings (`AdamParams`, the SDK's, or a dict).
            paused: Start paused, to go step by step with `run.step()`.
            pause_if: Pause triggers, `{metric: ("above" | "below", threshold)}`: the run pauses at the
                end of the first step whose recorded rows cross one (or hold NaN there), and
                `run.trigger` says which (see `workbench.notebook.triggers`).
            evaluate: A held-out evaluation `evaluate(sess) -> metrics`, run before steps 0,
                `eval_every`, 2·`eval_every`, … and after the last step, recorded as op `"eval"`
                (see `workbench.notebook.evaluation`).
            eval_every: How many steps apart the evaluations are.
            save_every: Save a run checkpoint (`run-<step>`: the model's whole state and the run's, with
                `run.loop_state`) every this many steps, and when the run pauses, stops, fails or ends; a
                failed save pauses the run (`run.save_error`). None: no run checkpoints. 100
                (`RECOMMENDED_SAVE_EVERY`) costs about 3% of the run's time on `tiny`, less on larger
                models.
            keep, keep_every: Pruning: the newest `keep` run checkpoints stay, and every one whose step
                is a multiple of `keep_every`.

        A session made by `from_checkpoint(model_dir)` continues the saved run: `step_fn` is called
        for `i` from the saved step to `steps - 1`, with `run.loop_state` and the optimizer settings as
        saved (`adam_params` is then ignored), and the saved pause triggers unless `pause_if` is given.
        """
        if evaluate is not None:
            step_fn = with_evaluation(step_fn, evaluate, eval_every)
        resume_from, self.resume_point = self.resume_point, None
        return start_run(
            self, step_fn, steps, adam_params, paused, pause_if, save_every, keep, keep_every, resume_from
        )

    def sweep(
        self,
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
        """Train one LoRA model per config on this session's base, side by side: `step_fn(member, i)`
        for each member in turn, a step each, on a sweep thread; returns the `Sweep` at once.

        A step function written for `run` runs unmodified: a member answers what it uses of a session
        (`policy`, `tokenizer`, `current_run.adam_params`, `record_rollouts`, ...) for its own model, and
        each member trains bit for bit as its config would alone in a session of its seed (see
        `workbench.notebook.sweep`). Every member is also a model of this engine (up to `max_models`).

        Args:
            step_fn: One training step of a member.
            configs: One dict of settings per member (`wb.grid(...)` makes a product): `lora` or its
                fields (`rank`, `train_mlp`, ...), `adam_params` or its fields (`learning_rate`, ...),
                `seed`, `pause_if`, `name`; other keys are `member.options` for the step function. What
                a config leaves out is this session's (its `LoraConfig`, its seed).
            steps: How many steps each member takes.
            halve_at: Successive halving: at each of these steps, once every member still training has
                reached it, the worse half by `by` is stopped.
            by: The metric that ranks members (a step function's, or an op's such as `"loss:sum"`).
            mode: `"min"` when lower `by` is better, `"max"` when higher is.
            wandb: The members' W&B runs, as for `Session(...)`, in one group (the sweep's name); None:
                as the session, a run each when the session has one.
            save_every: Save the whole sweep every this many rounds (a round: each member that may,
                one step), and where it starts, waits paused or ends, and a member when it stops: each
                member's run checkpoint in its folder, the sweep's own state in `sweep.folder`
                (`workbench.notebook.sweep_checkpoints`). A member whose step raises then goes back to
                its newest save. None: nothing saved. Options must then be JSON values.
            keep: How many run checkpoints of each member pruning keeps (the newest).
            name: The sweep's name (its folder beside the session's, the stem of its members' model
                ids, their W&B group); default `<model id>-sweep-<4 hex digits>`.
            resume: A saved sweep's name (a folder beside this session's) or folder: rebuild its
                members where it saved them and continue, calling `step_fn` from each member's saved
                step on. `configs` must be the saved sweep's (its clones come back by themselves);
                `halve_at`, `by` and `mode` are the saved ones.
        """
        engine = self._local_engine(
            f"a sweep keeps its members in this process's engine; this session drives {self.engine.endpoint}"
        )
        return start_sweep(
            self,
            engine,
            step_fn,
            configs,
            steps,
            halve_at=halve_at,
            by=by,
            mode=mode,
            wandb=wandb,
            save_every=save_every,
            keep=keep,
            name=name,
            resume=resume,
        )

    def run_async(
        self,
        sample_fn: SampleFn,
        train_fn: TrainFn,
        steps: int,
        *,
        max_steps_off_policy: int = 1,
        inflight: bool = True,
        adam_params: Any = None,
        paused: bool = False,
        pause_if: PauseIf | None = None,
    ) -> AsyncRun:
        """An asynchronous run: `sample_fn(sess, sampling_client, j)` samples (and rewards) batch j on
        sampler threads (up to k + 1 batches at once, k = `max_steps_off_policy`), up to k optimizer
        steps ahead of the trainer, while
        `train_fn(sess, i, batch)` trains step i on the run thread; the new weights are published to
        the sampler after each step, by an inflight save (`inflight=True`) or a new snapshot client.
        Controls, `adam_params`, `paused` and `pause_if` as for `run`; each step's row adds
        `async/staleness:max`, `async/trainer_wait_s`, `async/sample_wait_s`, ... With
        `max_steps_off_policy=0` it is the synchronous loop (see `workbench.notebook.async_run`). With
        k >= 1 several batches' requests interleave on the engine in timing's order, so draws without
        an explicit `SamplingParams.seed` depend on timing: seed each request for reproducible draws."""
        return start_async_run(
            self,
            sample_fn,
            train_fn,
            steps,
            max_steps_off_policy=max_steps_off_policy,
            inflight=inflight,
            adam_params=adam_params,
            paused=paused,
            pause_if=pause_if,
        )

    def record_rollouts(
        self,
        groups: Sequence[RolloutGroup],
        *,
        trained: ForwardBackwardOutput | None = None,
        pass_threshold: float = 1.0,
        model_id: str | None = None,
    ) -> dict[str, float]:
        """Record one RL step's rollout groups: for the rollout explorer (`self.rollouts`, the run
        folder's `rollouts.jsonl`) and as the step's health signals (`workbench.loops.health`), a history
        row of op `"rollouts"` (hence the panel, the plots, W&B and `pause_if` triggers). The row leaves
        out the signals `trained`'s own metrics report under the same name (a built-in RL loss's
        `kl_sample_train_v1/v2`, over the tokens it trained on), so that each is one line in a plot.

        Args:
            groups: The step's `RolloutGroup`s.
            trained: The `forward_backward` output of `rollout_data(groups)`: its logprobs give the
                sampler-vs-trainer mismatch (`kl_sample_train_v1/v2`) and the explorer's token view.
            pass_threshold: The reward at or above which a reply counts as passed.
            model_id: The model whose policy sampled the groups, when it is not the session's: another
                model on the session's engine, such as the one a `tinker` SDK training client creates
                through `sess.serve()` (its `model_id`). The row then goes under that model's label at
                its optimizer step, and groups that carry no weights version (the SDK's sample
                responses carry none) take its current one, so the cockpit follows the model that
                trains rather than the session's policy, which does not move.

        The row's step is, inside a run, the optimizer step the run's step started from (the weights
        that sampled, even when called after `optim_step`); outside a run the model's current one (call
        it before `optim_step` there).

        Returns:
            The health signals recorded.
        """
        groups = list(groups)
        if trained is not None:
            groups = attach_trainer_logprobs(groups, trained)
        metrics = rollout_health(groups, pass_threshold)
        sampler = self.engine.model_status(model_id or self.model_id)
        run = self.current_run if model_id in (None, self.model_id) else None
        started = run.step_started_at if run is not None else None
        step = started if started is not None else sampler.step
        if model_id is not None:
            groups = [
                group
                if group.weights_version is not None
                else dataclasses.replace(group, weights_version=sampler.weights_version)
                for group in groups
            ]
        groups = [dataclasses.replace(group, step=step) for group in groups]
        self.rollouts.append(groups)
        label = sampler.adapter
        # a built-in RL loss's own row already has the mismatch (over the tokens it trained on): one
        # metric, one line in a plot
        recorded = {
            name: value for name, value in metrics.items() if trained is None or name not in trained.metrics
        }
        self.engine.record("rollouts", label, step, recorded).result()
        return metrics

    def rollout_explorer(self) -> RolloutExplorer:
        """The rollout explorer over what `record_rollouts` recorded: each batch's groups side by side,
        a reward histogram whose bars open their replies, and each reply token by token (see
        `workbench.notebook.panel.rollouts_tab`). The panel's Rollouts tab is the same view, kept live."""
        from workbench.notebook.panel.rollouts_tab import RolloutExplorer  # ipywidgets loads with it

        return RolloutExplorer(self.rollouts, self.tokenizer)

    def plot(
        self,
        *names: str,
        smoothing: float = 0.0,
        log_scale: bool = False,
        x_axis: str = "step",
        compare: Mapping[str, str | Path] | Sequence[str | Path] = (),
    ) -> Figure:
        """A matplotlib figure of these history metrics against the optimizer step (all when none are
        named); the panel's Metrics tab shows the same plot, updated live.

        Args:
            smoothing: The weight of a debiased moving average in [0, 1), drawn over the raw values.
            log_scale: A log y axis for each metric whose values are all positive.
            x_axis: `"step"` or `"time"` (seconds since the history's first row).
            compare: Other runs to overlay: their model folders or `history.jsonl` files, as a list
                (named after their folders) or a `{name: path}` dict.
        """
        from workbench.notebook.plots import (
            plot_history,  # imported here: matplotlib loads with the first plot
        )

        paths = compare if isinstance(compare, Mapping) else {history_run_name(p): p for p in compare}
        others = {name: MetricsHistory.from_jsonl(path) for name, path in paths.items()}
        return plot_history(
            self.history, *names, smoothing=smoothing, log_scale=log_scale, x_axis=x_axis, compare=others
        )

    def describe(self, notes: str | None = None, tags: Sequence[str] | None = None) -> None:
        """Note what this model is for: free-text `notes` and short `tags` (None keeps what is there),
        kept in the model folder's `notes.json` and set on the W&B run. The panel's Runs tab lists them,
        and filters on them, for every model folder under the models root."""
        old_notes, old_tags = read_notes(self.model_dir)
        notes = old_notes if notes is None else notes
        tags = old_tags if tags is None else list(tags)
        write_notes(self.model_dir, notes, tags)
        if self.wandb_run is not None:
            self.wandb_run.describe(notes, tags)

    def panel(
        self, train_data: Sequence[Any] | None = None, *, metrics: Sequence[str] = ("loss:sum",)
    ) -> Panel:
        """The notebook panel over this session: status bar, Train, Sample, Checkpoints and Metrics tabs.

        The Train tab's buttons act on `current_run` while it is active (Step single-steps a paused run,
        Run resumes it, Pause and Stop); otherwise Step and Run start a run on `train_data`, of one step
        or of the tab's step count: `self.run(wb.train_step(train_data, loss), steps, adam_params=...)`
        with the tab's loss and AdamParams.

        Args:
            train_data: The datums the Train tab trains on; without them its buttons control runs
                started from cells only.
            metrics: The history metrics the Metrics tab plots at first.
        """
        from workbench.notebook.panel import (
            Panel,  # imported here: ipywidgets and matplotlib load with a panel
        )

        return Panel(self, train_data=train_data, metrics=metrics)

    def serve(self, host: str = "127.0.0.1", port: int = 0, *, api_key: str | None = None) -> TinkerServer:
        """Serve the Tinker REST protocol for this session's engine, on a background thread.

        The unmodified `tinker` SDK and tinker-cookbook scripts then train on this machine's model:
        `tinker.ServiceClient(base_url=srv.url)` (their key, `TINKER_API_KEY`, must start with `tml-`).
        Each client's `create_lora_training_client` adds a LoRA model on the same base (up to
        `max_models`, this session's run included); every operation runs on the engine's worker in
        order with this session's own, and lands in the history (its `model` column names the
        adapter, `policy_2`, ...) and the panel. See `workbench.server`.

        Args:
            host: The address to bind; the default reaches this machine only. Any other address
                requires `api_key`.
            port: The port; 0 picks a free one (`srv.url` tells which).
            api_key: A key clients must send (their `TINKER_API_KEY`), starting with `tml-`.

        Returns:
            The running server: `srv.url`, `srv.stop()`. `close()` stops it too.
        """
        self._local_engine(
            f"serve() needs the model in this process; this session drives {self.engine.endpoint}"
        )
        assert self.base_models is not None
        server = TinkerServer(self.base_models, ServerConfig(host=host, port=port, api_key=api_key))
        self.servers.append(server)
        return server

    def openai_client(self, **client_options: Any) -> openai.OpenAI:
        """An `openai.OpenAI` client of this session's engine, for code written against OpenAI's API
        (evaluation harnesses, agent frameworks): `model=sess.model_id` samples the policy's current
        weights, the base model's name the base, a `tinker://.../sampler_weights/...` path a checkpoint.

        A local session serves it from its running server (the newest that still runs), starting one
        with `serve()` if there is none; a remote session (`Session.connect`) talks to its service's
        `<url>/oai/api/v1`, as hosted Tinker and `workbench serve` have it, with the session's key.
        `client_options` go to `openai.OpenAI` (`timeout`, `max_retries`, ...).
        """
        import openai  # the openai package is needed only here

        if isinstance(self.engine, Engine):
            running = [server for server in self.servers if server.running]
            server = running[-1] if running else self.serve()
            base_url, api_key = server.url, server.config.api_key or "tml-local"
        else:
            assert isinstance(self.engine, RemoteEngine)
            base_url = str(self.engine.endpoint).rstrip("/")
            api_key = self.engine.api_key or os.environ.get("TINKER_API_KEY") or "tml-local"
        return openai.OpenAI(base_url=f"{base_url}/oai/api/v1", api_key=api_key, **client_options)

    # ------------------------------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Stop the servers and the run loop (after its current step), pause the sweeps (after each
        member's current step; one with `save_every` is saved there, to train on when resumed), finish
        queued work, then free the model and optimizer memory. Safe to call twice, and again after an
        interrupted call."""
        for server in self.servers:
            server.stop()
        if self.current_run is not None and self.current_run.active:
            self.current_run.stop()  # the step in progress finishes; none starts after it
            self.current_run.wait()
        for sweep in self.sweeps:
            if sweep.active:
                sweep.close()
        if self.base_models is not None:
            self.base_models.close()  # the other base models (a teacher, a grader); its own is next
        self.engine.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def quantized_base(self) -> str | None:
        """How the base is quantized and what it holds (`"nf4+dq 0.52 MiB"`), or None for a base in
        full precision (or one on a remote engine, which does not say)."""
        quantization = self.engine.config.quantization
        if quantization is None or not isinstance(self.engine, Engine):
            return None
        return f"{quantization.describe()} {format_size(self.engine.base_memory_bytes)}"

    def __repr__(self) -> str:
        config = self.engine.config
        if self.closed:
            return f"Session({config.base_model!r}, closed)"
        where = self.engine.endpoint or f"{config.device}/{config.dtype}"
        if isinstance(self.engine, Engine) and len(self.engine.devices) > 1:
            where = f"{len(self.engine.devices)} ranks on {', '.join(self.engine.devices)}/{config.dtype}"
            if self.engine.sharded:
                where += ", base sharded"
        quantized = self.quantized_base()
        if quantized is not None:
            where += f", base {quantized}"
        lora = self.config.lora
        layers = "+".join(
            name
            for name, on in (
                ("attn", lora.train_attn),
                ("mlp", lora.train_mlp),
                ("unembed", lora.train_unembed),
            )
            if on
        )
        others = ""
        if self.base_models is not None and len(self.base_models.engines()) > 1:
            others = f", {self.base_models!r}"
        return (
            f"Session({config.base_model!r}, rank={lora.rank}, alpha={lora.alpha:g}, {layers}, {where}, "
            f"step {self.step}{others})"
        )


_open_sessions: weakref.WeakSet[Session] = weakref.WeakSet()
"""Every session not yet freed (a closed one stays until freed; closing it again does nothing)."""


def _close_open_sessions() -> None:
    """Close every open session when the main thread finishes: its run stops after the current step (a
    step function may run torch on the run's thread), its servers stop, its worker finishes its queue.

    Registered with `threading._register_atexit` after the workers' own exit hook (this module imports
    `workbench.engine.worker` first), so it runs before that hook: runs stop before their workers do.
    A session that fails to close is reported and the others are still closed.
    """
    for session in list(_open_sessions):
        try:
            session.close()
        except Exception as error:
            warnings.warn(
                f"{session!r} did not close cleanly at exit: {error!r}", RuntimeWarning, stacklevel=1
            )


# The stdlib's hook for exactly this (what concurrent.futures uses); it has no public spelling.
threading._register_atexit(_close_open_sessions)  # noqa: SLF001
