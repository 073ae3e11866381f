"""The kernel-resident Session: one frozen base model, a LoRA policy, and the Tinker training API on it.

A Session owns the model, the adapters' optimizers, the worker thread that runs every operation, the
weight versions and the metrics history. Users reach it through Tinker-named clients: `sess.policy` (a
`TrainingClient`), `sess.reference` (the base model with adapters off, forward only).

Every operation is validated in the caller's thread before it is queued, so bad input raises at once
and changes nothing; then it runs on the worker thread, in submission order, and returns an `APIFuture`.
"""

from __future__ import annotations

import gc
import hashlib
import os
import re
import secrets
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from workbench.batching import MicroBatch, PreparedDatum, prepare_batch
from workbench.critic import CRITIC, ValueHead, critic_values, default_critic_lora
from workbench.forward_backward import CustomLossFn, run_custom, run_loss
from workbench.futures import APIFuture
from workbench.logprobs import target_logprobs
from workbench.losses import LossSpec, resolve_loss
from workbench.metrics import JsonlSink, MetricsHistory, WandbSetting, WandbSink, open_wandb_run
from workbench.models import (
    adapter_parameters,
    add_lora_adapter,
    attach_lora,
    load_base_model,
    resolve_device_and_dtype,
)
from workbench.run import Run, StepFn, start_run
from workbench.sampling import SamplerChoice, resolve_sampler
from workbench.sampling.hf import HFSampler
from workbench.sampling.vllm import VLLMSampler
from workbench.training import TrainableAdapter
from workbench.types import (
    AdamParams,
    ForwardBackwardOutput,
    LoraConfig,
    OptimStepResponse,
    to_adam_params,
    to_lora_config,
)
from workbench.versions import WeightSnapshots
from workbench.worker import SessionClosedError, Worker

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from workbench.checkpoint_store import CheckpointInfo, CheckpointKind
    from workbench.clients import SamplingClient, TrainingClient
    from workbench.panel import Panel

POLICY = "policy"
REFERENCE = "reference"
WANDB_PROJECT = "workbench"



@dataclass(frozen=True)
class SessionConfig:
    """Everything that defines a session; saved with every checkpoint and logged to W&B."""

    base_model: str
    lora: LoraConfig
    critic: LoraConfig | None = None
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    max_tokens_per_microbatch: int = 8192
    sampler: str = "hf"
    max_samples_per_request: int = 128

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_run_dir(base_model: str) -> Path:
    """A fresh folder for a session's files: `$WORKBENCH_RUNS` (default `./runs`) /
    `<model>-<date>-<time>-<random>`. Its name is also the W&B run id."""
    root = Path(os.environ.get("WORKBENCH_RUNS", "runs"))
    model = re.sub(r"[^A-Za-z0-9]+", "-", Path(base_model).name).strip("-").lower() or "model"
    return root / f"{model}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


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
        sampler: `"hf"` (generate in-process), `"vllm"` (GPU, LoRA hot-swap) or `"auto"` (vLLM when
            installed with a CUDA device, else HF).
        max_samples_per_request: the largest `num_samples` one sample call may ask for; bounds memory.
        run_dir: where the session writes its history (`history.jsonl`), checkpoints and W&B files;
            default a fresh folder under `./runs` (see `default_run_dir`).
        wandb: False for no W&B run; None/True for a run that is online when W&B credentials are
            configured and offline otherwise; a dict of extra `wandb.init` arguments.
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
        max_tokens_per_microbatch: int = 8192,
        sampler: SamplerChoice = "auto",
        max_samples_per_request: int = 128,
        run_dir: str | Path | None = None,
        wandb: WandbSetting = None,
    ):
        lora_config = to_lora_config(lora if lora is not None else LoraConfig())
        if max_tokens_per_microbatch < 1:
            raise ValueError(f"max_tokens_per_microbatch must be >= 1, got {max_tokens_per_microbatch}")
        if max_samples_per_request < 1:
            raise ValueError(f"max_samples_per_request must be >= 1, got {max_samples_per_request}")
        resolved_device, resolved_dtype = resolve_device_and_dtype(device, dtype)
        sampler_kind = resolve_sampler(sampler, resolved_device, lora_config)
        self.config = SessionConfig(
            base_model=base_model,
            lora=lora_config,
            seed=seed,
            device=str(resolved_device),
            dtype=str(resolved_dtype).removeprefix("torch."),
            max_tokens_per_microbatch=max_tokens_per_microbatch,
            sampler=sampler_kind,
            max_samples_per_request=max_samples_per_request,
        )
        self.device = resolved_device
        self.dtype = resolved_dtype
        base, self.tokenizer, self.base_info = load_base_model(base_model, resolved_device, resolved_dtype)
        self._model = attach_lora(base, self.base_info, lora_config, POLICY, seed=lora_config.seed if lora_config.seed is not None else seed)
        self._adapters: dict[str, TrainableAdapter] = {POLICY: TrainableAdapter(POLICY, adapter_parameters(self._model, POLICY))}
        self._active_adapter = POLICY
        # Draws the seeds of sampling requests that give none: sampling is reproducible from the session
        # seed, and its state is saved with checkpoints.
        self._sampling_generator = torch.Generator().manual_seed(seed)
        self._snapshots = WeightSnapshots(self._adapters[POLICY].parameters)
        self._hf_sampler = HFSampler(self._model, self.tokenizer, resolved_device)
        self._vllm_sampler: VLLMSampler | None = None  # started on first use when sampler == "vllm"
        self.history = MetricsHistory()
        self.run_dir = (Path(run_dir) if run_dir is not None else default_run_dir(base_model)).absolute()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.history.sinks.append(JsonlSink(self.run_dir / "history.jsonl"))
        self.wandb_run = self._open_wandb(wandb)
        self._worker = Worker()
        self._closed = False

        from workbench.clients import TrainingClient

        self.policy = TrainingClient(self, POLICY)
        self.reference = TrainingClient(self, REFERENCE)
        self.critic: TrainingClient | None = None
        self._value_head: ValueHead | None = None
        if critic is not False:
            self.create_critic(None if critic is True else critic)

    def _open_wandb(self, setting: WandbSetting) -> WandbSink | None:
        """Start the session's W&B run; a W&B failure leaves W&B off with a warning, never the session."""
        try:
            sink = open_wandb_run(
                setting, config=self.config.to_dict(), run_id=self.run_dir.name, project=WANDB_PROJECT, directory=self.run_dir
            )
        except Exception as error:
            warnings.warn(f"W&B is off for this session: {error!r}", RuntimeWarning, stacklevel=3)
            return None
        if sink is not None:
            self.history.sinks.append(sink)
        return sink

    # ------------------------------------------------------------------------------------------ state

    @property
    def step(self) -> int:
        """The policy's optimizer step count: the x-axis of the history."""
        return self._adapters[POLICY].step

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise SessionClosedError("this session is closed; create a new Session")

    def _adapter(self, role: str) -> TrainableAdapter:
        if role not in self._adapters:
            raise ValueError(f"the {role} is not trainable")
        return self._adapters[role]

    # ------------------------------------------------------------------------------------------ critic

    def create_critic(self, lora: LoraConfig | Mapping[str, Any] | None = None) -> TrainingClient:
        """Add a critic: a second LoRA adapter plus a zero-initialised value head on the same frozen base
        weights (one copy of the base in memory), with its own AdamW. Returns `sess.critic`.

        Default adapter: the policy's rank and alpha on attention and MLP layers.
        """
        self._check_open()
        if self.critic is not None:
            raise ValueError("this session already has a critic; delete_critic() first")
        critic_lora = default_critic_lora(self.config.lora) if lora is None else to_lora_config(lora)
        if critic_lora.train_unembed:
            raise ValueError("the critic reads hidden states, not logits: use train_unembed=False for its adapter")
        seed = critic_lora.seed if critic_lora.seed is not None else self.config.seed + 1
        self._worker.submit(lambda: self._add_critic(critic_lora, seed)).result()
        from workbench.clients import TrainingClient

        self.critic = TrainingClient(self, CRITIC)
        self.config = replace(self.config, critic=critic_lora)
        return self.critic

    def _add_critic(self, lora: LoraConfig, seed: int) -> None:
        add_lora_adapter(self._model, self.base_info, lora, CRITIC, seed=seed)
        self._active_adapter = ""  # peft's add_adapter leaves the active adapter as it was; resync on next use
        self._activate(POLICY)
        head = ValueHead(self.base_info.hidden_size, self.device)
        parameters = adapter_parameters(self._model, CRITIC)
        parameters.update({f"value_head.{name}": param for name, param in head.named_parameters()})
        self._value_head = head
        self._adapters[CRITIC] = TrainableAdapter(CRITIC, parameters)

    def delete_critic(self) -> None:
        """Remove the critic and free its adapter, value head and optimizer state. The policy's adapter,
        gradients and optimizer are untouched."""
        self._check_open()
        if self.critic is None:
            raise ValueError("this session has no critic")
        self._worker.submit(self._remove_critic).result()
        self.critic = None
        self.config = replace(self.config, critic=None)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _remove_critic(self) -> None:
        self._activate(POLICY)
        self._model.delete_adapter(CRITIC)
        self._active_adapter = ""  # resync peft's active adapter on next use
        self._activate(POLICY)
        del self._adapters[CRITIC]
        self._value_head = None

    # ------------------------------------------------------------------------------------------ state

    def state_digest(self, model: str | None = None) -> str:
        """A sha256 over everything training can change: every adapter's weights, accumulated gradients,
        optimizer state and counters (of one model, `"policy"` or `"critic"`, when given). Equal digests
        mean bit-identical training state."""
        digest = hashlib.sha256()
        for name in sorted(self._adapters) if model is None else [model]:
            self._adapter(name).update_digest(digest)
        return digest.hexdigest()

    def close(self) -> None:
        """Finish queued work, then free the model and optimizer memory. Safe to call twice."""
        if self._closed:
            return
        if self.current_run is not None and self.current_run.active:
            self.current_run.stop()  # the step in progress finishes; none starts after it
            self.current_run.wait()
        self._closed = True
        self._worker.close()
        for sink in self.history.sinks:
            sink.close()
        if self._vllm_sampler is not None:
            self._vllm_sampler.close()
        # every holder of the model or its tensors lets go, so that the memory is really freed
        del self._model, self._hf_sampler, self._snapshots, self._vllm_sampler, self._value_head
        self._adapters.clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"step {self.step}"
        return f"Session({self.config.base_model!r}, rank={self.config.lora.rank}, {self.device}/{self.config.dtype}, {state})"

    # ------------------------------------------------------------------------------------------ validation

    def _prepare(self, data: Sequence[Any], required: Sequence[str], optional: Mapping[str, float | None], strict: bool = True) -> list[PreparedDatum]:
        return prepare_batch(
            data,
            required=required,
            optional=optional,
            vocab_size=self.base_info.vocab_size,
            max_length=self.base_info.max_length,
            strict=strict,
        )

    def _check_loss_role(self, role: str, spec: LossSpec, loss_name: str) -> None:
        wants = "values" if role == CRITIC else "logprobs"
        if spec.head != wants:
            if role == CRITIC:
                raise ValueError(f"{loss_name!r} is a policy loss; the critic trains with 'ppo_critic'")
            raise ValueError(f"{loss_name!r} is the critic's loss; the {role} uses a policy loss such as 'ppo'")

    # ------------------------------------------------------------------------------------------ submission

    def _submit_forward(
        self, role: str, data: Sequence[Any], loss_fn: str, loss_fn_config: Mapping[str, float] | None, backward: bool
    ) -> APIFuture[ForwardBackwardOutput]:
        self._check_open()
        if backward:
            self._adapter(role)
        spec, config = resolve_loss(loss_fn, loss_fn_config)
        self._check_loss_role(role, spec, loss_fn)
        required = spec.required_inputs + (spec.training_inputs if backward else ())
        optional: dict[str, float | None] = dict(spec.optional_inputs)
        if not backward:
            optional.update(dict.fromkeys(spec.training_inputs))
        batch = self._prepare(data, required, optional)
        with_loss = backward or all(key in item.inputs for item in batch for key in spec.training_inputs)
        if not with_loss and any(key in item.inputs for item in batch for key in spec.training_inputs):
            raise ValueError(
                f"some datums carry {list(spec.training_inputs)} and some do not: give them to all datums "
                "(to compute the loss) or to none (values only)"
            )
        op = "forward_backward" if backward else "forward"
        return self._worker.submit(lambda: run_loss(self, op, role, batch, spec, config, with_loss))

    def _submit_custom(self, role: str, data: Sequence[Any], loss_fn: CustomLossFn) -> APIFuture[ForwardBackwardOutput]:
        self._check_open()
        self._adapter(role)
        if not callable(loss_fn):
            raise ValueError(f"forward_backward_custom needs a function fn(data, logprobs_list) -> (loss, metrics), got {loss_fn!r}")
        batch = self._prepare(data, ("target_tokens",), {}, strict=False)
        user_data = list(data)
        return self._worker.submit(lambda: run_custom(self, role, batch, loss_fn, user_data))

    def _submit_optim_step(self, role: str, adam_params: Any) -> APIFuture[OptimStepResponse]:
        self._check_open()
        self._adapter(role)
        params = to_adam_params(adam_params)
        return self._worker.submit(lambda: self._run_optim_step(role, params))

    # ------------------------------------------------------------------------------------------ worker ops

    def _activate(self, role: str) -> None:
        """Make `role`'s adapter the one the forward pass uses (the reference disables adapters instead)."""
        if role != REFERENCE and role != self._active_adapter:
            self._model.set_adapter(role)
            self._active_adapter = role

    def _predict(self, role: str, micro: MicroBatch, with_entropy: bool = False) -> tuple[Tensor, dict[str, Tensor]]:
        """The model's prediction for a micro-batch: the critic's values, or the targets' logprobs for the
        policy and the reference (and, when asked, the detached entropy of each next-token distribution)."""
        self._activate(role)
        if role == CRITIC:
            assert self._value_head is not None
            return critic_values(self._model, self._value_head, micro), {}
        if role == REFERENCE:
            with self._model.disable_adapter():
                logits_B_T_V = self._logits(micro)
        else:
            logits_B_T_V = self._logits(micro)
        logprobs_B_T, entropy_B_T = target_logprobs(logits_B_T_V, micro.inputs["target_tokens"], with_entropy)
        return logprobs_B_T, {} if entropy_B_T is None else {"entropy": entropy_B_T}

    def _logits(self, micro: MicroBatch) -> Tensor:
        return self._model(
            input_ids=micro.input_ids_B_T, attention_mask=micro.attention_mask_B_T, use_cache=False
        ).logits

    def _record(self, op: str, role: str, metrics: Mapping[str, float]) -> None:
        self.history.record(op, role, self.step, metrics)

    def _before_weights_change(self, role: str) -> None:
        """Called on the worker thread right before `role`'s weights change (an optimizer step, a load):
        samplers pinned to the current weights keep a copy of them first."""
        if role == POLICY:
            self._snapshots.before_change(self._adapters[POLICY].weights_version)

    def _run_optim_step(self, role: str, params: AdamParams) -> OptimStepResponse:
        adapter = self._adapters[role]
        if adapter.pending_backward_calls:
            self._before_weights_change(role)
        response = adapter.optim_step(params)
        self._record("optim_step", role, response.metrics)
        return response

    # ------------------------------------------------------------------------------------------ sampling

    def sampling_client(self, version: int | None = None, *, base: bool = False) -> SamplingClient:
        """A client that samples the policy's weights at `version` (default: the current ones), or the
        base model with adapters off (`base=True`). A past version is available while some live client
        is pinned to it (see `live_versions`)."""
        self._check_open()
        from workbench.clients import SamplingClient

        if base:
            if version is not None:
                raise ValueError("a base-model client has no version: pass base=True or a version, not both")
            return SamplingClient(self, None)
        current = self.policy.weights_version
        if version is None:
            version = current
        if not self._snapshots.is_available(version, current):
            raise ValueError(f"weights version {version} is not held; available: {self.live_versions()}")
        return SamplingClient(self, version)

    def live_versions(self) -> list[int]:
        """The policy weight versions a sampling client can use now: the current one and those that live
        clients are pinned to."""
        return sorted({*self._snapshots.pinned_versions(), self.policy.weights_version})

    def _pin_version(self, version: int | None) -> None:
        if version is not None:
            self._snapshots.pin(version)

    def _unpin_version(self, version: int | None) -> None:
        if version is None or self._closed:  # a closed session has dropped every copy already
            return
        self._snapshots.unpin(version)
        if self._vllm_sampler is not None and version not in self.live_versions():
            engine = self._vllm_sampler
            self._worker.submit(lambda: engine.forget(version))

    # ------------------------------------------------------------------------------------------ checkpoints

    @classmethod
    def from_checkpoint(
        cls, path: str | Path, *, device: str | None = None, run_dir: str | Path | None = None, wandb: WandbSetting = None
    ) -> Session:
        """A new session that continues the run saved by `save_state` at `path`, exactly: same config
        (base model, adapters, critic, seed, dtype), weights, optimizer state, counters, weight versions
        and RNG states. It continues in the checkpoint's run folder and W&B run (see
        `workbench.checkpoints.from_checkpoint`). `device` (and with it the sampler) follows this machine
        unless given; `run_dir` and `wandb` as for `Session(...)`."""
        from workbench.checkpoints import from_checkpoint

        return from_checkpoint(cls, path, device, run_dir, wandb)

    def list_checkpoints(self) -> list[CheckpointInfo]:
        """This run's complete checkpoints, state (`save_state`) and sampler (`save_weights_for_sampler`),
        oldest first. Leftovers of interrupted saves are not listed (`cleanup_checkpoints` removes them)."""
        from workbench.checkpoint_store import list_checkpoints

        return list_checkpoints(self.run_dir)

    def delete_checkpoint(self, name: str, kind: CheckpointKind = "state") -> None:
        """Delete this run's checkpoint `name` (`kind="sampler"` for sampler weights). Runs between
        operations, so it never races a save."""
        self._check_open()
        from workbench.checkpoint_store import delete

        self._worker.submit(lambda: delete(self.run_dir, name, kind)).result()

    def cleanup_checkpoints(self) -> list[Path]:
        """Remove what interrupted saves and deletions left behind in this run's checkpoint folders;
        returns the removed paths. Runs between operations, so it never removes a save in progress."""
        self._check_open()
        from workbench.checkpoint_store import cleanup

        return self._worker.submit(lambda: cleanup(self.run_dir)).result()

    def export_merged(self, path: str | Path) -> Path:
        """Write the policy merged into the base weights, with the tokenizer, as a new HF model folder
        at `path` (for `AutoModelForCausalLM.from_pretrained` and serving); the session is unchanged.
        See `workbench.merged_export`."""
        from workbench.merged_export import export_merged

        return export_merged(self, path)

    # ------------------------------------------------------------------------------------------ runs and views

    current_run: Run | None = None
    """The latest run started by `run()` (active or ended; its state, error and traceback stay readable),
    None before the first. Step functions read their live settings from it: `sess.current_run.adam_params`."""

    def run(self, step_fn: StepFn, steps: int, *, adam_params: Any = None, paused: bool = False) -> Run:
        """Call `step_fn(sess, i)` for `i = 0 .. steps-1` on a background thread; returns the `Run` at once.

        The kernel stays free while it trains, so the panel and later cells can `pause()`, `step()`,
        `resume()`, `stop()` or `set(learning_rate=...)` it between steps (see `workbench.run`). Each
        step's returned metrics are recorded in the history as op `"run_step"`.

        Args:
            step_fn: One training step; it reads `sess.current_run.adam_params` for its `optim_step`.
            steps: How many steps to run.
            adam_params: The run's initial optimizer settings (`AdamParams`, the SDK's, or a dict).
            paused: Start paused, to go step by step with `run.step()`.
        """
        return start_run(self, step_fn, steps, adam_params, paused)

    def plot(self, *names: str) -> Figure:
        """A matplotlib figure of these history metrics against the optimizer step (all when none are
        named); the panel's Metrics tab shows the same plot, updated live."""
        from workbench.plots import plot_history

        return plot_history(self.history, *names)

    def panel(self, train_data: Sequence[Any] | None = None, *, metrics: Sequence[str] = ("loss:sum",)) -> Panel:
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
        from workbench.panel import Panel

        return Panel(self, train_data=train_data, metrics=metrics)
