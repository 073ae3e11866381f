"""Creating and removing a run's models: a run (its policy), a critic for a run, and removing either.

Each is an ordered operation like any other: it takes effect on the worker after everything submitted
before it, so a `forward_backward` queued before `create_critic` never sees the critic, and one queued
after always does. What can be checked without the model is checked in the caller's thread first.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from pathlib import Path

from workbench.engine.local.lora_models import TrainedModel, TrainingRun, adapter_name
from workbench.engine.local.state import EngineState
from workbench.engine.model.trainable_adapter import TrainableAdapter
from workbench.engine.model.value_head import ValueHead
from workbench.engine.model.weight_versions import WeightSnapshots
from workbench.engine.roles import Role
from workbench.futures import APIFuture
from workbench.storage.run_folders import hold_run_folder, release_run_folder, write_run_info
from workbench.types import LoraConfig, check_text


def check_metadata(user_metadata: Mapping[str, str] | None) -> dict[str, str]:
    """Tinker's `user_metadata`: a flat dict of strings."""
    if user_metadata is None:
        return {}
    if not isinstance(user_metadata, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in user_metadata.items()
    ):
        raise ValueError(f"user_metadata must be a dict of strings to strings, got {user_metadata!r}")
    for key, value in user_metadata.items():
        check_text(key, f"user_metadata key {key!r}")
        check_text(value, f"user_metadata[{key!r}]")
    return dict(user_metadata)


def _check_capacity(state: EngineState) -> None:
    if len(state.runs) >= state.config.max_models:
        raise ValueError(
            f"this engine already holds {len(state.runs)} models, its limit (max_models={state.config.max_models}); "
            "close a training client (or its session) first, or create the engine with a larger max_models"
        )


def add_run(
    state: EngineState,
    lora: LoraConfig,
    *,
    seed: int,
    model_id: str,
    run_dir: Path,
    user_metadata: Mapping[str, str],
) -> TrainingRun:
    """Add a training run now (worker thread): a new LoRA policy on the shared base, whose files go to
    `run_dir`, where `run.json` says what the run is (base model, adapter, seed, user metadata). Its
    adapter's A matrices are drawn from `lora.seed`, else `seed`; B starts at zero, so the new model
    starts equal to the base."""
    _check_capacity(state)
    if model_id in state.runs:
        raise ValueError(f"a model named {model_id!r} already exists on this engine")
    number = state.runs_made + 1
    name = adapter_name(Role.POLICY, number)
    parameters = state.model.add_adapter(name, lora, lora.seed if lora.seed is not None else seed)
    state.runs_made = number
    trainable = TrainableAdapter(name, parameters)
    created_at = time.time()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        hold_run_folder(run_dir)
    except BaseException:
        state.model.delete_adapter(name)
        raise
    try:
        write_run_info(
            run_dir,
            {
                "run_id": model_id,
                "base_model": state.config.base_model,
                "lora": dataclasses.asdict(lora),
                "seed": seed,
                "user_metadata": dict(user_metadata),
                "created_at": created_at,
            },
        )
    except BaseException:
        release_run_folder(run_dir)
        state.model.delete_adapter(name)
        raise
    training_run = TrainingRun(
        model_id=model_id,
        number=number,
        run_dir=run_dir,
        seed=seed,
        policy=TrainedModel(Role.POLICY, name, lora, trainable),
        snapshots=WeightSnapshots(trainable.parameters),
        user_metadata=dict(user_metadata),
        created_at=created_at,
    )
    state.runs[model_id] = training_run
    return training_run


def create_run(
    state: EngineState,
    lora: LoraConfig,
    *,
    seed: int,
    model_id: str,
    run_dir: Path,
    user_metadata: Mapping[str, str] | None = None,
) -> APIFuture[TrainingRun]:
    """Queue `add_run`, after checking what can be checked now."""
    state.check_open()
    metadata = check_metadata(user_metadata)
    if model_id in state.runs:
        raise ValueError(f"a model named {model_id!r} already exists on this engine")
    _check_capacity(state)
    return state.submit(
        lambda: add_run(state, lora, seed=seed, model_id=model_id, run_dir=run_dir, user_metadata=metadata)
    )


def remove_run(state: EngineState, model_id: str) -> None:
    """Remove a run's models now (worker thread)."""
    training_run = state.run(model_id)
    for model in reversed(training_run.models()):
        state.model.delete_adapter(model.adapter)
    del state.runs[model_id]
    release_run_folder(training_run.run_dir)


def delete_run(state: EngineState, model_id: str) -> APIFuture[None]:
    """Remove a run's models from the engine and free their weights and optimizer state (its files stay)."""
    state.check_open()

    return state.submit(lambda: remove_run(state, model_id))


def create_critic(state: EngineState, model_id: str, lora: LoraConfig, seed: int) -> APIFuture[None]:
    """Give a run a critic: a second LoRA adapter plus a zero-initialised value head on the same frozen
    base weights (one copy of the base in memory), with its own AdamW."""
    state.check_open()
    if lora.train_unembed:
        raise ValueError(
            "the critic reads hidden states, not logits: use train_unembed=False for its adapter"
        )

    return state.submit(lambda: add_critic(state, state.run(model_id), lora, seed))


def add_critic(state: EngineState, training_run: TrainingRun, lora: LoraConfig, seed: int) -> None:
    """Give a run its critic now (worker thread)."""
    if training_run.critic is not None:
        raise ValueError(f"run {training_run.model_id!r} already has a critic; delete_critic() first")
    name = adapter_name(Role.CRITIC, training_run.number)
    parameters = state.model.add_adapter(name, lora, lora.seed if lora.seed is not None else seed)
    head = ValueHead(state.base_info.hidden_size, state.device)
    parameters.update({f"value_head.{key}": param for key, param in head.named_parameters()})
    training_run.critic = TrainedModel(Role.CRITIC, name, lora, TrainableAdapter(name, parameters), head)


def delete_critic(state: EngineState, model_id: str) -> APIFuture[None]:
    """Remove a run's critic and free its adapter, value head and optimizer state; the policy's adapter,
    gradients and optimizer are untouched."""
    state.check_open()

    def run() -> None:
        training_run = state.run(model_id)
        if training_run.critic is None:
            raise ValueError(f"run {model_id!r} has no critic")
        state.model.delete_adapter(training_run.critic.adapter)
        training_run.critic = None

    return state.submit(run)
