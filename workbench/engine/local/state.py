"""What every engine operation shares: the model, the runs on it, the worker, the history.

`EngineState` is the engine's memory, and the operation modules (`forward_backward`, `optim_step`,
`sampling`, `checkpoints`, `model_lifecycle`, `merged_export`) are what acts on it: each validates its
input in the caller's thread, then `submit`s the work that changes anything to the one worker thread.
Nothing here runs a model; it holds what the operations need and the few rules they all follow.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from transformers import PreTrainedTokenizerBase

from workbench.engine.config import EngineConfig
from workbench.engine.local.checkpoint_writes import CheckpointWrites
from workbench.engine.local.collectives import Collectives
from workbench.engine.local.lora_models import LoraModel, RoleAdapter
from workbench.engine.local.ranks import FollowerRanks, RankOp
from workbench.engine.local.resource_use import ResourceMeter
from workbench.engine.local.stability_records import StabilityRecords
from workbench.engine.model.adapted_model import AdaptedModel
from workbench.engine.model.base_model import BaseModelInfo
from workbench.engine.model.sharded_base import ShardedBase
from workbench.engine.roles import Role
from workbench.engine.samplers.factory import EngineSampler
from workbench.engine.samplers.hf import HFSampler
from workbench.engine.worker import SessionClosedError, Worker
from workbench.futures import APIFuture
from workbench.metrics import MetricsHistory

T = TypeVar("T")

REFERENCE_LABEL = "reference"
"""The history's `model` column for operations on the base model with adapters off."""


@dataclass
class LoadedAdapter:
    """A sampler checkpoint loaded as an inference-only adapter, and how many sampling pins use it."""

    name: str
    version: int | None  # the weights version the checkpoint was saved at
    users: int = 0


class EngineState:
    """The engine's state; mutated on the worker thread only (reads from other threads see whole
    values: a run is in `runs` or not, a counter has one value)."""

    def __init__(
        self,
        config: EngineConfig,
        model: AdaptedModel,
        tokenizer: PreTrainedTokenizerBase,
        device: torch.device,
        dtype: torch.dtype,
        worker: Worker,
        streams: int,
        falls_back: bool,
    ):
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.dtype = dtype
        self.worker = worker  # the thread that loaded `model` and runs every operation on it
        # single-threaded streams for a CPU pass over several datums (`workbench.engine.local.streams`)
        self.streams = streams
        self.history = MetricsHistory()
        self.writes = CheckpointWrites()  # the checkpoint write in flight beside the worker
        self.resources = ResourceMeter(device)  # the `system/` metrics of each optim_step row
        self.lora_models: dict[str, LoraModel] = {}
        # Draws the seeds of sampling requests that give none, on the worker in submission order, so a
        # run's samples are reproducible from the engine seed; its state is saved with checkpoints.
        self.sampling_generator = torch.Generator().manual_seed(config.seed)
        # set by `Engine.interrupt_sampling` (a shutdown): the sampler stops between decoding steps
        self.sampling_interrupted = threading.Event()
        # the training model's own sampler: the HF backend, and the scorer any other backend leans on
        self.hf_sampler = HFSampler(
            model,
            tokenizer,
            device,
            model.info.vocab_size,
            model.info.logits_from_hidden_states,
            self.sampling_interrupted,
        )
        # the backend config.sampler names, started on first use (`sample.active_sampler`); under
        # sampler="auto" one that cannot start falls back to HF (and config.sampler follows)
        self.sampler = EngineSampler(config.sampler, falls_back=falls_back)
        self.models_made = 0  # numbers models (and so their adapters' names) over the engine's life
        self.sampler_adapters_made = 0  # numbers the adapters loaded for sampling clients
        self.loaded_adapters: dict[Path, LoadedAdapter] = {}  # sampler checkpoint folder -> its adapter
        self.stability_records = StabilityRecords()  # what samplers recorded for stable_reinforce
        self._sequence_prefix = f"seq-{secrets.token_hex(4)}"  # sequence ids are unique per engine
        # on several devices (`workbench.engine.local.ranks`): this rank's process group, and on rank 0
        # the follower ranks; both None on one device
        self.collectives: Collectives | None = None
        self.followers: FollowerRanks | None = None
        # the base sharded across the group (`shard_base=True`): every rank then runs every pass
        self.sharded: ShardedBase | None = None
        self._sequences_sampled = 0

    @property
    def base_info(self) -> BaseModelInfo:
        return self.model.info

    @property
    def closed(self) -> bool:
        return self.worker.closed

    def check_open(self) -> None:
        if self.worker.closed:
            raise SessionClosedError("this session is closed; create a new Session")
        if self.followers is not None:
            self.followers.check()

    def submit(
        self,
        work: Callable[[], T],
        mirror: Callable[[], RankOp] | None = None,
        *,
        beside_writes: bool = False,
    ) -> APIFuture[T]:
        """Queue work for the worker thread (raises SessionClosedError once closed). On several devices,
        an operation that changes a model names the op every follower repeats (`mirror`, made on the
        worker, so it may name what earlier operations made: a saved checkpoint's folder). Work waits
        for the checkpoint write in flight unless it touches memory alone (`beside_writes`; see
        `workbench.engine.local.checkpoint_writes`)."""
        if not beside_writes:
            work = self._after_writes(work)
        followers = self.followers
        if followers is None or mirror is None:
            return self.worker.submit(work)
        return self.worker.submit(lambda: followers.mirrored(mirror(), work))

    def _after_writes(self, work: Callable[[], T]) -> Callable[[], T]:
        def after() -> T:
            self.writes.wait()
            return work()

        return after

    def submit_batchable(
        self, key: Hashable, item: Any, run_batch: Callable[[Sequence[Any]], Sequence[Any]]
    ) -> APIFuture[Any]:
        return self.worker.submit_batchable(key, item, run_batch)

    def next_sequence_id(self) -> str:
        """A new `SampledSequence.sequence_id` (worker thread): unique within this engine, and across
        engines with overwhelming probability."""
        self._sequences_sampled += 1
        return f"{self._sequence_prefix}-{self._sequences_sampled}"

    def lora_model(self, model_id: str) -> LoraModel:
        """The model with this id; a clear error naming the ones there are."""
        lora_model = self.lora_models.get(model_id)
        if lora_model is None:
            raise ValueError(f"no model {model_id!r} on this engine; it has {sorted(self.lora_models)}")
        return lora_model

    def adapter_label(self, lora_model: LoraModel, role: Role) -> str:
        """The history's `model` column for an operation on `role` of `run`."""
        return REFERENCE_LABEL if role is Role.REFERENCE else lora_model.role_adapter(role).adapter

    def record(self, op: str, lora_model: LoraModel | None, label: str, metrics: Mapping[str, float]) -> None:
        """Append an operation's metrics to the history at the run's optimizer step (worker thread)."""
        self.history.record(op, label, lora_model.step if lora_model is not None else 0, metrics)

    def before_weights_change(self, lora_model: LoraModel, model: RoleAdapter) -> None:
        """Called right before `model`'s weights change (an optimizer step, a load): sampling clients
        pinned to the policy's current weights keep a copy of them first."""
        if model.role is Role.POLICY:
            lora_model.snapshots.before_change(model.weights_version)
