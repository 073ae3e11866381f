"""The engine: one base model on one device, the LoRA models trained on it, and every operation on them.

Every surface reaches the model through this class: the Tinker clients (`workbench.tinker_api.clients`), the
notebook's `Session`, the run loop, the panel and the REST server. Its methods are what both engines do
(`workbench.engine.interface.EngineInterface`) and what needs the model in this process (critics, local
tensors, checkpoint folders, merged exports, the models the REST server adds); each validates its input in the caller's thread (bad input raises and changes nothing) and returns an
`APIFuture` for work that runs on the engine's one worker thread, in submission order, whatever the
surface that submitted it. The operations themselves live one per module beside this one.

A model is addressed by its `model_id` (Tinker's model id and training run id: the model's folder name)
and a `Role`: the model's policy, its critic, or the reference (the base model with adapters off).

An engine that is dropped without `close()` stops its worker when it is garbage-collected, so
re-running a notebook cell that makes a session frees the old one's memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import threading
import warnings
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoConfig, PreTrainedTokenizerBase

from workbench.engine.config import (
    DEFAULT_MAX_MODELS,
    DEFAULT_MAX_TOKENS_PER_MICROBATCH,
    EngineConfig,
    ModelConfig,
    QuantizationConfig,
    to_quantization_config,
)
from workbench.engine.interface import CheckedSample, CustomLossFn, ModelStatus, Restore, SamplerPin
from workbench.engine.local import (
    checkpoint_files,
    checkpoints,
    data_parallel,
    forward_backward,
    merged_export,
    model_lifecycle,
    optim_step,
    rank_sampling,
    sample,
)
from workbench.engine.local.checkpoint_files import SavedState, model_config
from workbench.engine.local.collectives import Collectives, GroupAddress, backend_for, open_store
from workbench.engine.local.ranks import Devices, FollowerRanks, FollowerSettings, RankOp, rank_devices
from workbench.engine.local.state import EngineState
from workbench.engine.model.adapted_model import AdaptedModel
from workbench.engine.model.base_model import (
    BaseModelInfo,
    adapts_by_parametrization,
    load_base_model,
    resolve_device_and_dtype,
    resolve_model_path,
)
from workbench.engine.model.quantization import base_memory_bytes
from workbench.engine.model.sharded_base import (
    fits_one_device,
    resident_base_bytes,
    shard_base,
    sharding_notice,
    unsharded_base_bytes,
)
from workbench.engine.model.value_head import default_critic_lora
from workbench.engine.roles import Role
from workbench.engine.samplers import SamplerChoice
from workbench.engine.samplers.factory import choose_sampler, sampler_for_model, sampler_on_ranks
from workbench.engine.samplers.prefix_cache import PromptPrefixCache
from workbench.engine.samplers.requests import TokenSink
from workbench.engine.samplers.sample_request import SampleRequest
from workbench.engine.threads import ThreadPolicy, ThreadUse
from workbench.engine.worker import SessionClosedError, Worker
from workbench.futures import APIFuture
from workbench.metrics import MetricsHistory, metric_values
from workbench.storage import checkpoint_store
from workbench.storage.checkpoint_store import CheckpointInfo, CheckpointKind
from workbench.storage.model_folders import (
    models_root,
    new_model_id,
    read_model_info,
    release_model_folder,
    resolve_checkpoint,
)
from workbench.types import (
    ForwardBackwardOutput,
    LoadWeightsResponse,
    LoraConfig,
    ModelInput,
    OptimStepResponse,
    SampleResponse,
    SaveWeightsExternalResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
)


@dataclass(frozen=True)
class ModelTensors:
    """One model's trainable tensors as they stood between two operations (detached copies)."""

    parameters: dict[str, torch.Tensor]  # by live parameter name (a critic's include its value head)
    gradients: dict[str, torch.Tensor | None]  # the accumulated gradient (None: nothing accumulated)
    pending_backward_calls: int


def _close_sinks(history: MetricsHistory) -> None:
    for sink in list(history.sinks):
        with contextlib.suppress(Exception):  # a finalizer has nobody to report to
            sink.close()


def _close_sinks_and_sampler(state: EngineState) -> None:
    _close_sinks(state.history)
    with contextlib.suppress(Exception):
        state.sampler.close()
    with contextlib.suppress(Exception):
        _leave_ranks(state)


def _leave_ranks(state: EngineState) -> None:
    """End the follower ranks (rank 0) and leave the process group (every rank)."""
    if state.followers is not None:
        state.followers.close()
    if state.collectives is not None:
        state.collectives.leave()
        state.collectives = None


def _shutdown(state: EngineState) -> None:
    """What a dropped engine's finalizer does: stop the worker once the operations queued before are
    done; on the worker, after them, close the history's sinks and stop the sampler's processes."""
    if not state.worker.post(lambda: _close_sinks_and_sampler(state)):  # the worker was already stopping
        _close_sinks_and_sampler(state)
    state.worker.close(wait=False)


def choose_sharding(
    shard: bool | None,
    base_model: str,
    ranks: list[str],
    device: torch.device,
    dtype: torch.dtype,
    quantization: QuantizationConfig | None,
) -> bool:
    """Whether rank 0 shards the base: `shard_base` as asked, or, left out (None) on several ranks,
    whether the whole base does not fit one device (`sharded_base.fits_one_device`; CPU ranks share the
    host's memory, so N copies must fit it), saying so when it shards. A quantized base is never
    sharded (bitsandbytes' layers hold their own packed tensors)."""
    if shard and len(ranks) < 2:
        raise ValueError("shard_base=True shards the base across several ranks: give devices= too")
    if shard and quantization is not None:
        raise ValueError("a quantized base cannot be sharded (bitsandbytes packs its own tensors)")
    if len(ranks) < 2 or quantization is not None:
        return False
    if shard is not None:
        return shard
    base_bytes = unsharded_base_bytes(AutoConfig.from_pretrained(resolve_model_path(base_model)), dtype)
    copies = len(ranks) if device.type == "cpu" else 1
    if fits_one_device(copies * base_bytes, device):
        return False
    warnings.warn(sharding_notice(base_bytes, device, len(ranks)), stacklevel=3)
    return True


def _shard(state: EngineState) -> None:
    """Shard the frozen base across the group (FSDP2, `sharded_base.shard_base`; on every rank, on its
    worker, collective). Its passes then run one at a time, on the worker (FSDP keeps per-pass state on
    the model), and every rank runs every pass of a call (`data_parallel`, `rank_sampling`)."""
    assert state.collectives is not None
    mesh = init_device_mesh(state.device.type, (state.collectives.world_size,))
    state.sharded = shard_base(state.model.base, mesh)
    state.hf_sampler.make_passes_collective()
    state.streams = 1


def _start_followers(
    config: EngineConfig, ranks: list[str], device: torch.device, shard: bool
) -> tuple[FollowerRanks, GroupAddress, dist.TCPStore]:
    """Start ranks 1..N-1 (each on its device of `ranks`), and open the group's store: rank 0's address."""
    if dist.is_initialized():
        raise RuntimeError(
            "this process already runs an engine on several devices: close that session first "
            "(one multi-device session per process)"
        )
    store = open_store(len(ranks))
    addresses = [
        GroupAddress("127.0.0.1", store.port, rank, len(ranks), backend_for(device))
        for rank in range(len(ranks))
    ]
    followers = FollowerRanks(
        [
            FollowerSettings(
                config.base_model,
                config.seed,
                ranks[rank],
                config.dtype,
                config.max_tokens_per_microbatch,
                config.threads,
                config.quantization,
                addresses[rank],
                shard,
            )
            for rank in range(1, len(ranks))
        ],
        {**data_parallel.REPLY_TYPES, **rank_sampling.REPLY_TYPES},
    )
    return followers, addresses[0], store


class Engine:
    """A base model on a device, the LoRA models on it, and their operations.

    Args:
        base_model: A built-in alias (`"tiny"`, `"smollm2-135m"`), a local HF folder or an HF hub id.
        seed: Seeds the sampling generator (the seeds of requests that give none).
        device, dtype: Default CUDA/bf16 when a GPU is present, else CPU/fp32.
        max_tokens_per_microbatch: Padded tokens per forward pass; bounds activation memory.
        sampler: a backend of `workbench.engine.samplers.factory.SAMPLERS` (`"hf"`, `"vllm"`) or
            `"auto"` (vLLM when a build for the device is installed and runs the model, else HF, with a
            notice saying why). On several devices a backend samples for all of them
            (`factory.sampler_on_ranks`, before any rank starts): vLLM in rank 0's process, tensor
            parallel over the ranks' devices, or HF, which spreads each sample call over the ranks
            (`workbench.engine.local.rank_sampling`); one named that cannot (vLLM on a sharded base)
            is refused, saying why, and `"auto"` takes HF with a notice.
        max_samples_per_request: The largest `num_samples` one sample call may ask for.
        max_models: How many LoRA models may share the base at once.
        threads: torch CPU threads for every operation; None (default) chooses before each operation
            one per usable core that other processes leave free (`OMP_NUM_THREADS`, when set, fixes it).
        quantize: `"nf4"`, `"fp4"`, `"int8"` or a `QuantizationConfig`: the frozen base's linear layers
            quantized at load (bitsandbytes); None (default) keeps them in `dtype`.
        devices: None or 1 (default): one device, `device`. A count, `"all"` or device names
            (`["cuda:0", "cuda:1"]`): data parallel over that many ranks, one per device (on a machine
            without CUDA, `devices=2` is two CPU ranks), joined by torch.distributed. Rank 0 is this
            engine; the others are processes it starts and ends (`workbench.engine.local.ranks`), and
            every training call is split across them (`workbench.engine.local.data_parallel`).
        shard_base: With several devices: True shards the frozen base across the ranks with FSDP2
            (`workbench.engine.model.sharded_base`), each rank holding about 1/N of it, for a base bigger
            than one device; every rank then runs every pass of a call (the same passes in the same
            order, as FSDP needs), so a call takes one device's time. False keeps a whole base on every
            rank; None (default) shards when the whole base does not fit one device, with a warning
            saying so. Sampling and `compute_logprobs` run on every rank then, the same passes
            (`workbench.engine.local.rank_sampling`). On one device (a
            follower rank's engine before `join_group`) True only loads a CUDA base on the CPU, where
            sharding takes it to its device.
    """

    def __init__(
        self,
        base_model: str = "tiny",
        *,
        seed: int = 0,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        max_tokens_per_microbatch: int = DEFAULT_MAX_TOKENS_PER_MICROBATCH,
        sampler: SamplerChoice = "auto",
        max_samples_per_request: int = 128,
        max_models: int = DEFAULT_MAX_MODELS,
        threads: int | None = None,
        quantize: str | QuantizationConfig | None = None,
        devices: Devices = None,
        shard_base: bool | None = None,
    ):
        ranks = rank_devices(devices, None if device is None else str(device), torch.cuda.device_count())
        if len(ranks) == 1:
            device = ranks[0]
        self._devices = ranks if len(ranks) > 1 else []
        resolved_device, resolved_dtype = resolve_device_and_dtype(
            device if len(ranks) < 2 else ranks[0], dtype
        )
        quantization = to_quantization_config(quantize)
        follower_rank = shard_base is True and not devices  # `rank_follower`: sharded once it joins
        shard = not follower_rank and choose_sharding(
            shard_base, base_model, ranks, resolved_device, resolved_dtype, quantization
        )
        # a base to be sharded may not fit its device whole: it loads on the CPU, shards go to the device
        load_device = torch.device("cpu") if shard or follower_rank else resolved_device
        config = EngineConfig(
            base_model=base_model,
            seed=seed,
            device=str(resolved_device),
            dtype=str(resolved_dtype).removeprefix("torch."),
            max_tokens_per_microbatch=max_tokens_per_microbatch,
            sampler=sampler_on_ranks(sampler, [torch.device(rank) for rank in ranks], shard)
            if self._devices
            else choose_sampler(sampler, resolved_device),
            max_samples_per_request=max_samples_per_request,
            max_models=max_models,
            threads=threads,
            quantization=quantization,
        )
        # The model is loaded on the worker thread, like every later operation on it. On a CPU the first
        # thread to run a parallel torch kernel keeps an OpenMP thread pool for life; with a second pool
        # (the caller's) libgomp counts more threads than cores and cuts the spin-wait between kernels,
        # which slows every small kernel on the worker: 25% on decoding steps, 12% on a training step of
        # 32 short sequences (SmolLM2-135M, 2 cores). A notebook that leaves the heavy work to its session
        # then has a single pool.
        thread_policy = ThreadPolicy(threads, on_cpu=resolved_device.type == "cpu")
        worker = Worker(before_each=thread_policy.apply)

        def load() -> tuple[AdaptedModel, PreTrainedTokenizerBase]:
            base, tokenizer, info = load_base_model(base_model, load_device, resolved_dtype, quantization)
            return AdaptedModel(base, info, resolved_device), tokenizer

        followers: FollowerRanks | None = None
        collectives: Collectives | None = None
        try:
            if self._devices:  # the followers load their engines while this one loads its own
                followers, address, store = _start_followers(config, ranks, resolved_device, shard)
            model, tokenizer = worker.submit(load).result()
            if followers is not None:
                followers.wait_loaded()
                collectives = worker.submit(
                    lambda: Collectives.join(address, resolved_device, store)
                ).result()
            chosen = sampler_for_model(config.sampler, sampler == "auto", base_model, model.info)
        except BaseException:
            worker.close(wait=False)  # the thread ends once the load does (at once, if it failed)
            if followers is not None:
                followers.close()
            if collectives is not None:
                collectives.leave()
            raise
        config = dataclasses.replace(config, sampler=chosen)
        # peft adapts an expert stack (and a linear layer it targets through its weight) by registering
        # a parametrization on its layer for the length of each forward call (`ParamWrapper`): a pass
        # changes the model, so passes on such a model cannot share it across streams, and run on the
        # worker's threads
        if adapts_by_parametrization(model.base, model.info):
            thread_policy.keep_passes_on_the_worker()
        self._state = state = EngineState(
            config,
            model,
            tokenizer,
            resolved_device,
            resolved_dtype,
            worker,
            thread_policy.streams,
            falls_back=sampler == "auto",
        )
        state.collectives, state.followers = collectives, followers
        self._shards_on_joining = follower_rank
        if followers is not None:
            # every operation still queued fails at once, naming the rank that died and its op
            followers.watch(state.worker.fail_queued)
        thread_policy.count_as_own(lambda: state.sampler.processes)
        self._thread_policy = thread_policy
        self._finalizer = weakref.finalize(self, _shutdown, self._state)
        if shard and followers is not None:
            self._shard_now(thread_policy)

    # ------------------------------------------------------------------------------------------ identity

    @property
    def endpoint(self) -> None:
        return None

    @property
    def config(self) -> EngineConfig:
        return self._state.config

    @property
    def devices(self) -> list[str]:
        """The device of each rank, rank 0's first (this process); one device: `[config.device]`."""
        return list(self._devices) or [self.config.device]

    def rank_memory_bytes(self) -> list[int]:
        """The memory each rank's model lives in, rank 0 first, read from this process without waiting
        on the operations queued (a status bar refreshes during a step): CUDA memory allocated by this
        process on rank 0's GPU and the memory in use on each follower's GPU (NVML), or each rank's
        process RSS on CPUs. One device: `[rank 0's]`."""
        device = self._state.device
        if device.type == "cuda":
            own = torch.cuda.memory_allocated(device)
            return [own, *(torch.cuda.device_memory_used(name) for name in self._devices[1:])]
        pids = [os.getpid(), *self.rank_pids]
        used = []
        for pid in pids:
            try:
                used.append(psutil.Process(pid).memory_info().rss)
            except psutil.NoSuchProcess:  # a follower that died: the session says so on its next op
                used.append(0)
        return used

    @property
    def rank_pids(self) -> list[int]:
        """The processes of ranks 1..N-1 (none on one device)."""
        followers = self._state.followers
        return [] if followers is None else followers.pids

    @property
    def threads(self) -> ThreadUse:
        """The torch thread count the worker uses now, and why (`workbench.engine.threads`)."""
        return self._thread_policy.in_force

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._state.tokenizer

    @property
    def base_info(self) -> BaseModelInfo:
        return self._state.base_info

    @property
    def device(self) -> torch.device:
        return self._state.device

    @property
    def dtype(self) -> torch.dtype:
        return self._state.dtype

    @property
    def history(self) -> MetricsHistory:
        return self._state.history

    @property
    def closed(self) -> bool:
        return self._state.closed

    def check_open(self) -> None:
        self._state.check_open()

    # ------------------------------------------------------------------------------------------ models

    def create_model(
        self,
        lora: LoraConfig,
        *,
        seed: int = 0,
        model_id: str | None = None,
        model_dir: str | Path | None = None,
        user_metadata: Mapping[str, str] | None = None,
    ) -> APIFuture[str]:
        """The model's checkpoints are saved in its folder too."""
        model_id = model_id or new_model_id(self.config.base_model)
        folder = (Path(model_dir) if model_dir is not None else models_root() / model_id).absolute()
        future = model_lifecycle.create_model(
            self._state, lora, seed=seed, model_id=model_id, model_dir=folder, user_metadata=user_metadata
        )
        return future.then(lambda lora_model: lora_model.model_id)

    def create_model_from_state(
        self,
        path: str | Path,
        *,
        restore: Restore,
        model_id: str | None = None,
        model_dir: str | Path | None = None,
        user_metadata: Mapping[str, str] | None = None,
    ) -> APIFuture[str]:
        """Add a model built from a state checkpoint (its adapters, critic included, and seed), restored as
        far as `restore` says, with the saved weight versions. A new model (own id and folder) unless
        `model_id` names the saved model's id, which then continues in its folder. The model's
        `user_metadata` is the one given; None keeps what the model's folder already says (a model
        continuing), else none."""
        self.check_open()
        checkpoints.check_path(path)
        state = self._state

        new_id = model_id or new_model_id(self.config.base_model)

        def work() -> str:
            folder = checkpoints.resolve(state, None, path)
            saved = checkpoints.read_state(folder)
            folder_for_model = Path(model_dir).absolute() if model_dir is not None else models_root() / new_id
            arguments = saved.session_arguments
            if user_metadata is not None:
                metadata = model_lifecycle.check_metadata(user_metadata)
            else:  # the same model continuing keeps its metadata; a new one starts with none
                previous = read_model_info(folder_for_model) or {}
                metadata = dict(previous.get("user_metadata") or {})
            lora_model = model_lifecycle.add_model(
                state,
                arguments["lora"],
                seed=arguments["seed"],
                model_id=new_id,
                model_dir=folder_for_model,
                user_metadata=metadata,
            )
            try:
                if arguments["critic"] is not False:
                    model_lifecycle.add_critic(state, lora_model, arguments["critic"], arguments["seed"] + 1)
                checkpoint_files.restore(saved, state, lora_model, restore, exact_versions=True)
            except BaseException:
                model_lifecycle.remove_model(state, new_id)
                raise
            return new_id

        return self._state.submit(
            work,
            mirror=lambda: RankOp(
                "create_model_from_state", (str(checkpoints.resolve(state, None, path)), restore, new_id)
            ),
        )

    def delete_model(self, model_id: str) -> APIFuture[None]:
        """Remove a model's models from the engine and free their memory (its files stay). On a sharded
        base the last model stays (removing its adapters would unwrap the sharded base:
        `sharded_base.shard_base`): close the session instead."""
        state = self._state
        if state.sharded is not None and list(state.lora_models) == [model_id]:
            raise ValueError(
                f"{model_id} is the last model on a base sharded across ranks, which cannot be unwrapped: "
                "close the session instead"
            )
        return model_lifecycle.delete_model(state, model_id)

    def create_critic(self, model_id: str, lora: LoraConfig | None = None) -> APIFuture[None]:
        """Give a model a critic: a LoRA adapter (default: the policy's rank and alpha on attention and MLP
        layers) and a zero-initialised value head on the same frozen base, with its own AdamW."""
        lora_model = self._state.lora_model(model_id)
        critic_lora = default_critic_lora(lora_model.policy.lora) if lora is None else lora
        return model_lifecycle.create_critic(self._state, model_id, critic_lora, lora_model.seed + 1)

    def delete_critic(self, model_id: str) -> APIFuture[None]:
        """Remove a model's critic and free its adapter, value head and optimizer state."""
        return model_lifecycle.delete_critic(self._state, model_id)

    def model_ids(self) -> list[str]:
        return list(self._state.lora_models)

    def model_status(self, model_id: str) -> ModelStatus:
        lora_model = self._state.lora_model(model_id)
        policy, critic = lora_model.policy, lora_model.critic
        return ModelStatus(
            model_id=lora_model.model_id,
            model_dir=lora_model.model_dir,
            lora=policy.lora,
            critic_lora=None if critic is None else critic.lora,
            seed=lora_model.seed,
            step=policy.step,
            weights_version=policy.weights_version,
            pending_backward_calls=policy.trainable.pending_backward_calls,
            critic_step=None if critic is None else critic.step,
            critic_weights_version=None if critic is None else critic.weights_version,
            live_versions=sorted({*lora_model.snapshots.pinned_versions(), policy.weights_version}),
            user_metadata=dict(lora_model.user_metadata),
            created_at=lora_model.created_at,
            adapter=policy.adapter,
            critic_adapter=None if critic is None else critic.adapter,
            snapshot_bytes=lora_model.snapshots.held_bytes(),
        )

    @property
    def torch_model(self) -> torch.nn.Module:
        """The torch module every forward pass runs (the peft model over the base; the passes run its
        decoder, `get_decoder()`, and its output layer), for reading and inspection: comparing with plain
        transformers, counting parameters, registering hooks. Changing it bypasses everything the engine
        guarantees."""
        return self._state.model.module

    @property
    def base_memory_bytes(self) -> int:
        """What the frozen base holds (its weights, a quantized one's packed data and scales, and its
        buffers), without the adapters."""
        return base_memory_bytes(self._state.model.module)

    @property
    def prompt_cache(self) -> PromptPrefixCache:
        """The HF sampler's cache of prompts' keys and values across calls: its entries, its size in
        bytes and bound, and `stats` (prompt tokens prefilled and computed, its hit rate)."""
        return self._state.hf_sampler.prefix_cache

    def inspect(self, model_id: str, role: Role = Role.POLICY) -> ModelTensors:
        """Copies of one model's trainable tensors and accumulated gradient, taken between operations
        (after everything submitted before this call)."""
        self.check_open()
        state = self._state

        def copy() -> ModelTensors:
            trainable = state.lora_model(model_id).role_adapter(role).trainable
            return ModelTensors(
                parameters={name: p.detach().clone() for name, p in trainable.parameters.items()},
                gradients={
                    name: None if p.grad is None else p.grad.detach().clone()
                    for name, p in trainable.parameters.items()
                },
                pending_backward_calls=trainable.pending_backward_calls,
            )

        return state.submit(copy).result()

    def model_config(self, model_id: str) -> ModelConfig:
        return model_config(self._state, self._state.lora_model(model_id))

    # ------------------------------------------------------------------------------------------ training

    def forward(
        self,
        model_id: str,
        role: Role,
        data: Sequence[Any],
        loss_fn: str,
        loss_fn_config: Mapping[str, float] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        return self._loss_call(model_id, role, data, loss_fn, loss_fn_config, backward=False)

    def forward_backward(
        self,
        model_id: str,
        role: Role,
        data: Sequence[Any],
        loss_fn: str,
        loss_fn_config: Mapping[str, float] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        return self._loss_call(model_id, role, data, loss_fn, loss_fn_config, backward=True)

    def _loss_call(
        self,
        model_id: str,
        role: Role,
        data: Sequence[Any],
        loss_fn: str,
        loss_fn_config: Mapping[str, float] | None,
        backward: bool,
    ) -> APIFuture[ForwardBackwardOutput]:
        state, followers = self._state, self._state.followers
        if followers is None:
            return forward_backward.submit(state, model_id, role, data, loss_fn, loss_fn_config, backward)
        call = forward_backward.check_call(state, model_id, role, data, loss_fn, loss_fn_config, backward)
        if backward:
            forward_backward.note_loss(state, model_id, role, loss_fn, call.config)
        return state.submit(
            lambda: data_parallel.run_loss(
                state, followers, model_id, role, call.op, call.batch, loss_fn, loss_fn_config, call.with_loss
            ),
            beside_writes=True,
        )

    def forward_backward_custom(
        self, model_id: str, role: Role, data: Sequence[Any], loss_fn: CustomLossFn
    ) -> APIFuture[ForwardBackwardOutput]:
        state, followers = self._state, self._state.followers
        if followers is None:
            return forward_backward.submit_custom(state, model_id, role, data, loss_fn)
        batch = forward_backward.check_custom(state, model_id, role, data, loss_fn)
        forward_backward.note_loss(state, model_id, role, loss_fn, {})
        user_data = list(data)
        return state.submit(
            lambda: data_parallel.run_custom(state, followers, model_id, role, batch, loss_fn, user_data),
            beside_writes=True,
        )

    def join_group(self, address: GroupAddress) -> None:
        """Make this engine rank `address.rank` of a multi-device engine's group (what a follower rank's
        process does once its engine is loaded: `workbench.engine.local.rank_follower`), and shard its
        base across the group when it was made with `shard_base=True`."""
        state = self._state
        state.collectives = state.submit(lambda: Collectives.join(address, state.device)).result()
        if self._shards_on_joining:
            self._shard_now(self._thread_policy)

    def _shard_now(self, thread_policy: ThreadPolicy) -> None:
        thread_policy.keep_passes_on_the_worker()
        state = self._state
        try:
            state.submit(lambda: _shard(state)).result()
        except BaseException:
            self.close()
            raise

    @property
    def sharded(self) -> bool:
        """Whether the frozen base is sharded across the ranks (`shard_base`)."""
        return self._state.sharded is not None

    @property
    def resident_base_bytes(self) -> int:
        """The bytes of base weights this rank holds: its shards on a sharded base, else the whole base
        (`sharded_base.resident_base_bytes`)."""
        state = self._state
        return state.submit(lambda: resident_base_bytes(state.model.base)).result()

    def rank_base_bytes(self) -> list[int]:
        """`resident_base_bytes` on every rank, rank 0 first."""
        own = self.resident_base_bytes
        followers = self._state.followers
        if followers is None:
            return [own]
        others = self._state.submit(
            lambda: [followers.ask(rank, ("base_bytes",)) for rank in followers.ranks]
        ).result()
        return [own, *others]

    def run_shard(self, shard: data_parallel.Shard) -> Any:
        """A follower rank's part of a training call, on its worker, in turn (`data_parallel.run_shard`)."""
        state = self._state
        return state.submit(lambda: data_parallel.run_shard(state, shard)).result()

    def run_sample_shard(self, shard: rank_sampling.SampleShard | rank_sampling.LogprobsShard) -> Any:
        """A follower rank's part of a sample call or of `compute_logprobs`, on its worker, in turn
        (`rank_sampling`)."""
        state = self._state
        if isinstance(shard, rank_sampling.LogprobsShard):
            return state.submit(lambda: rank_sampling.follower_logprobs(state, shard)).result()
        return state.submit(lambda: rank_sampling.follower_sample(state, shard)).result()

    def rank_digests(self, model_id: str, role: Role | None = None) -> list[str]:
        """`state_digest(model_id, role)` on every rank, rank 0 first: equal when every rank holds the
        same model (weights, accumulated gradient, optimizer state, counters). Without a role it covers
        the sampling generator too, which only rank 0's samples move; with one, the role's state alone."""
        own = self.state_digest(model_id, role)
        followers = self._state.followers
        if followers is None:
            return [own]
        others = self._state.submit(
            lambda: [followers.ask(rank, ("digest", model_id, role)) for rank in followers.ranks]
        ).result()
        return [own, *others]

    def optim_step(self, model_id: str, role: Role, adam_params: Any = None) -> APIFuture[OptimStepResponse]:
        return optim_step.submit(self._state, model_id, role, adam_params)

    # ------------------------------------------------------------------------------------------ sampling

    def pin_sampler(
        self, model_id: str | None, version: int | None = None, *, inflight: bool = False
    ) -> APIFuture[SamplerPin]:
        """Any version the model's sampling clients still hold can be pinned again (`live_versions`)."""
        if inflight:
            return sample.pin_inflight(self._state, model_id)
        return sample.pin(self._state, model_id, version)

    def pin_sampler_checkpoint(self, path: str | Path) -> APIFuture[SamplerPin]:
        """The checkpoint may also be named by its folder; its weights load as an inference adapter."""
        state = self._state
        checkpoints.check_path(path, "model_path")
        return sample.pin_checkpoint(state, lambda: checkpoints.adapter_folder(state, path))

    def release_sampler(self, pin: APIFuture[SamplerPin], wait: bool = False) -> None:
        """On the worker thread itself, `wait` returns at once: the weights go right after the running
        operation."""
        if not self.closed:
            sample.release(self._state, pin)
            if wait and threading.current_thread() is not self._state.worker.thread:
                with contextlib.suppress(
                    SessionClosedError
                ):  # closed meanwhile: every pin went with the models
                    self._state.submit(lambda: None).result()

    def sample(
        self,
        pin: APIFuture[SamplerPin],
        request: SampleRequest | CheckedSample,
        token_sink: TokenSink | None = None,
    ) -> APIFuture[SampleResponse]:
        """The request is checked against the model in the caller's thread (`requests.prepare_request`),
        unless `check_sample` checked it, and `token_sink` is told each sequence's tokens as the sampler
        draws them."""
        return sample.submit_sample(self._state, pin, request, token_sink)

    def check_sample(self, request: SampleRequest) -> CheckedSample:
        """`requests.prepare_request`'s checks against the model and `max_samples_per_request`."""
        return sample.check_sample(self._state, request)

    def compute_logprobs(
        self,
        pin: APIFuture[SamplerPin],
        prompt: ModelInput | Sequence[int],
        *,
        prompt_logprobs_last_n: int | None = None,
    ) -> APIFuture[list[float | None]]:
        return sample.submit_compute_logprobs(self._state, pin, prompt, prompt_logprobs_last_n)

    # ------------------------------------------------------------------------------------------ checkpoints

    def save_state(
        self,
        model_id: str,
        name: str,
        *,
        overwrite: bool = False,
        ttl_seconds: int | None = None,
        user_metadata: Mapping[str, str] | None = None,
    ) -> APIFuture[SaveWeightsResponse]:
        """The state is all of the model's: the critic, the counters and every RNG too, for an exact
        resume; it is written to `<model folder>/checkpoints/<name>` (`.folder`)."""
        return checkpoints.save_state(
            self._state,
            model_id,
            name,
            overwrite=overwrite,
            ttl_seconds=ttl_seconds,
            user_metadata=user_metadata,
        )

    def save_weights_for_sampler(
        self,
        model_id: str,
        name: str,
        *,
        overwrite: bool = False,
        ttl_seconds: int | None = None,
        user_metadata: Mapping[str, str] | None = None,
    ) -> APIFuture[SaveWeightsForSamplerResponse]:
        """Written in peft's format to `<model folder>/sampler_weights/<name>` (`.folder`), which other
        samplers and `PeftModel.from_pretrained` load too."""
        return checkpoints.save_weights_for_sampler(
            self._state,
            model_id,
            name,
            overwrite=overwrite,
            ttl_seconds=ttl_seconds,
            user_metadata=user_metadata,
        )

    def save_weights_external(
        self,
        model_id: str,
        name: str,
        *,
        ttl_seconds: int | None = None,
        age_encryption_recipients: Sequence[str] | None = None,
    ) -> APIFuture[SaveWeightsExternalResponse]:
        """Written to `<model folder>/external_weights/<name>` (`.folder`)."""
        return checkpoints.save_weights_external(
            self._state,
            model_id,
            name,
            ttl_seconds=ttl_seconds,
            age_encryption_recipients=age_encryption_recipients,
        )

    def load_state(self, model_id: str, path: str | Path, restore: Restore) -> APIFuture[LoadWeightsResponse]:
        """The checkpoint may also be named by its folder or by a name of the model's own;
        `Restore.EVERYTHING` puts back every RNG as well, for an exact resume. Every file is verified
        against the model before anything changes (`checkpoint_files.restore` says what each level
        puts back)."""
        return checkpoints.load_state(self._state, model_id, path, restore)

    def checkpoint_folder(
        self, path: str | Path, kind: CheckpointKind = "state", model_id: str | None = None
    ) -> Path:
        """The folder of a checkpoint named by a `tinker://` path, a folder, or a name of `model_id`'s run."""
        return checkpoints.resolve(self._state, model_id, path, kind)

    def read_state(self, path: str | Path) -> SavedState:
        """Verify and parse a state checkpoint (nothing changes)."""
        return checkpoints.read_state(self.checkpoint_folder(path))

    @staticmethod
    def folder_of_checkpoint(path: str | Path, kind: CheckpointKind = "state") -> Path:
        """The folder of a checkpoint named by a `tinker://` path (under the models root) or a folder, for
        callers without an engine yet (`Session.from_checkpoint`)."""
        return checkpoint_store.require_checkpoint_folder(resolve_checkpoint(path, kind, None, {}))

    @staticmethod
    def checkpoint_base_model(path: str | Path, known_models: Mapping[str, Path] | None = None) -> str:
        """The base model a checkpoint (state or sampler; a `tinker://` path or a folder) was saved on,
        as its engine was created with it, for callers choosing the engine to load it on. `known_models`
        maps model ids to folders outside the models root."""
        return checkpoints.saved_base_model(path, known_models or {})

    @staticmethod
    def parse_checkpoint(folder: Path) -> SavedState:
        """Verify and parse a state checkpoint folder, for callers without an engine yet."""
        return checkpoints.read_state(folder)

    def list_checkpoints(self, model_id: str) -> list[CheckpointInfo]:
        return checkpoint_store.list_checkpoints(self._state.lora_model(model_id).model_dir)

    def delete_checkpoint(self, model_id: str, name: str, kind: CheckpointKind = "state") -> APIFuture[None]:
        self.check_open()
        model_dir = self._state.lora_model(model_id).model_dir
        return self._state.submit(lambda: checkpoint_store.delete(model_dir, name, kind))

    def cleanup_checkpoints(self, model_id: str) -> APIFuture[list[Path]]:
        """Remove leftovers of interrupted saves and expired checkpoints, between operations."""
        self.check_open()
        model_dir = self._state.lora_model(model_id).model_dir
        return self._state.submit(lambda: checkpoint_store.cleanup(model_dir))

    def export_merged(self, model_id: str, path: str | Path) -> APIFuture[Path]:
        """Write the model's policy merged into the base weights as a new HF model folder."""
        return merged_export.export_merged(self._state, model_id, path)

    # ------------------------------------------------------------------------------------------ misc

    def record(self, op: str, label: str, step: int, metrics: Mapping[str, float]) -> APIFuture[None]:
        self.check_open()
        history = self._state.history
        values = metric_values(metrics)

        def append() -> None:
            history.record(op, label, step, values)

        return self._state.submit(append, beside_writes=True)

    def swap_sampling_generator(self, state: torch.Tensor) -> APIFuture[torch.Tensor]:
        """After the queued operations, set the sampling generator (which draws the seeds of sampling
        requests that give none) to `state`; resolves to the state it replaces. A sweep gives each of
        its models its own stream this way (`workbench.notebook.sweep`), so each samples as it would
        alone on an engine of its seed."""
        self.check_open()
        generator = self._state.sampling_generator
        torch.Generator().set_state(state)  # a state no generator takes fails here, in the caller's thread

        def swap() -> torch.Tensor:
            previous = generator.get_state()
            generator.set_state(state)
            return previous

        return self._state.submit(swap)

    def state_digest(self, model_id: str | None = None, role: Role | None = None) -> str:
        """A sha256 over everything training can change: weights, accumulated gradients, optimizer state
        and counters, of every model (or of one model, or one role of it), between operations; unless one
        model is named, the sampling generator's state too."""
        self.check_open()
        state = self._state

        def digest() -> str:
            hasher = hashlib.sha256()
            runs = (
                [state.lora_model(model_id)]
                if model_id is not None
                else [state.lora_models[key] for key in sorted(state.lora_models)]
            )
            for lora_model in runs:
                for model in (
                    [lora_model.role_adapter(role)] if role is not None else lora_model.role_adapters()
                ):
                    model.trainable.update_digest(hasher)
            if role is None:
                hasher.update(state.sampling_generator.get_state().numpy().tobytes())
            return hasher.hexdigest()

        return self._state.submit(digest).result()

    def interrupt_sampling(self) -> None:
        """Stop sampling for good, from any thread, for a prompt shutdown (`workbench serve` on
        SIGINT/SIGTERM): the generation in progress ends at its next decoding step and it, and every
        sample request after it, fails with `SamplingInterrupted`, whatever the sampler (one with its own
        engine aborts the requests in flight); other operations run as before."""
        self._state.sampling_interrupted.set()

    def close(self) -> None:
        """The memory freed is the base model's, the adapters' and the optimizers'."""
        state = self._state
        state.worker.close()
        state.writes.wait()  # the checkpoint write in flight lands before the engine goes
        if not self._finalizer.alive:  # freed by an earlier call
            return
        _leave_ranks(state)
        for sink in list(state.history.sinks):
            sink.close()
        state.history.sinks.clear()
        state.sampler.close()
        for lora_model in state.lora_models.values():
            release_model_folder(lora_model.model_dir)
        state.lora_models.clear()
        state.loaded_adapters.clear()
        state.model.free()
        self._finalizer.detach()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self._state.lora_models)} model(s)"
        where = (
            f"{self.config.device}" if not self._devices else f"{len(self._devices)} ranks on {self._devices}"
        )
        if self.sharded:
            where += ", base sharded"
        return f"Engine({self.config.base_model!r}, {where}/{self.config.dtype}, {state})"
