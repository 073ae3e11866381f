"""Creating and removing a model's models: a run (its policy), a critic for a run, and removing either.

Each is an ordered operation like any other: it takes effect on the worker after everything submitted
before it, so a `forward_backward` queued before `create_critic` never sees the critic, and one queued
after always does. What can be checked without the model is checked in the caller's thread first.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from pathlib import Path

from workbench.engine.local.lora_models import LoraModel, RoleAdapter, adapter_name
from workbench.engine.local.ranks import RankOp
from workbench.engine.local.state import EngineState
from workbench.engine.model.trainable_adapter import TrainableAdapter
from workbench.engine.model.value_head import ValueHead
from workbench.engine.model.weight_versions import WeightSnapshots
from workbench.engine.roles import Role
from workbench.futures import APIFuture
from workbench.storage.model_folders import hold_model_folder, release_model_folder, write_model_info
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
    if len(state.lora_models) >= state.config.max_models:
        raise ValueError(
            f"this engine already holds {len(state.lora_models)} models, its limit (max_models={state.config.max_models}); "
            "close a training client (or its session) first, or create the engine with a larger max_models"
        )


def add_model(
    state: EngineState,
    lora: LoraConfig,
    *,
    seed: int,
    model_id: str,
    model_dir: Path,
    user_metadata: Mapping[str, str],
) -> LoraModel:
    """Add a model now (worker thread): a new LoRA policy on the shared base, whose files go to
    `model_dir`, where `run.json` says what the model is (base model, adapter, seed, user metadata). Its
    adapter's A matrices are drawn from `lora.seed`, else `seed`; B starts at zero, so the new model
    starts equal to the base."""
    _check_capacity(state)
    if model_id in state.lora_models:
        raise ValueError(f"a model named {model_id!r} already exists on this engine")
    number = state.models_made + 1
    name = adapter_name(Role.POLICY, number)
    parameters = state.model.add_adapter(name, lora, lora.seed if lora.seed is not None else seed)
    state.models_made = number
    trainable = TrainableAdapter(name, parameters)
    created_at = time.time()
    try:
        model_dir.mkdir(parents=True, exist_ok=True)
        hold_model_folder(model_dir)
    except BaseException:
        state.model.delete_adapter(name)
        raise
    try:
        write_model_info(
            model_dir,
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
        release_model_folder(model_dir)
        state.model.delete_adapter(name)
        raise
    lora_model = LoraModel(
        model_id=model_id,
        number=number,
        model_dir=model_dir,
        seed=seed,
        policy=RoleAdapter(Role.POLICY, name, lora, trainable),
        snapshots=WeightSnapshots(trainable.parameters),
        user_metadata=dict(user_metadata),
        created_at=created_at,
    )
    state.lora_models[model_id] = lora_model
    return lora_model


def create_model(
    state: EngineState,
    lora: LoraConfig,
    *,
    seed: int,
    model_id: str,
    model_dir: Path,
    user_metadata: Mapping[str, str] | None = None,
) -> APIFuture[LoraModel]:
    """Queue `add_model`, after checking what can be checked now."""
    state.check_open()
    metadata = check_metadata(user_metadata)
    if model_id in state.lora_models:
        raise ValueError(f"a model named {model_id!r} already exists on this engine")
    _check_capacity(state)
    return state.submit(
        lambda: add_model(
            state, lora, seed=seed, model_id=model_id, model_dir=model_dir, user_metadata=metadata
        ),
        mirror=lambda: RankOp("create_model", (lora, seed, model_id, metadata)),
    )


def remove_model(state: EngineState, model_id: str) -> None:
    """Remove a model's models now (worker thread)."""
    lora_model = state.lora_model(model_id)
    for model in reversed(lora_model.role_adapters()):
        state.model.delete_adapter(model.adapter)
    del state.lora_models[model_id]
    release_model_folder(lora_model.model_dir)


def delete_model(state: EngineState, model_id: str) -> APIFuture[None]:
    """Remove a model's models from the engine and free their weights and optimizer state (its files stay)."""
    state.check_open()

    return state.submit(
        lambda: remove_model(state, model_id), mirror=lambda: RankOp("delete_model", (model_id,))
    )


def create_critic(state: EngineState, model_id: str, lora: LoraConfig, seed: int) -> APIFuture[None]:
    """Give a model a critic: a second LoRA adapter plus a zero-initialised value head on the same frozen
    base weights (one copy of the base in memory), with its own AdamW."""
    state.check_open()
    if lora.train_unembed:
        raise ValueError(
            "the critic reads hidden states, not logits: use train_unembed=False for its adapter"
        )

    return state.submit(
        lambda: add_critic(state, state.lora_model(model_id), lora, seed),
        mirror=lambda: RankOp("create_critic", (model_id, lora)),
    )


def add_critic(state: EngineState, lora_model: LoraModel, lora: LoraConfig, seed: int) -> None:
    """Give a model its critic now (worker thread)."""
    if lora_model.critic is not None:
        raise ValueError(f"model {lora_model.model_id!r} already has a critic; delete_critic() first")
    name = adapter_name(Role.CRITIC, lora_model.number)
    parameters = state.model.add_adapter(name, lora, lora.seed if lora.seed is not None else seed)
    head = ValueHead(state.base_info.hidden_size, state.device)
    parameters.update({f"value_head.{key}": param for key, param in head.named_parameters()})
    lora_model.critic = RoleAdapter(Role.CRITIC, name, lora, TrainableAdapter(name, parameters), head)


def delete_critic(state: EngineState, model_id: str) -> APIFuture[None]:
    """Remove a model's critic and free its adapter, value head and optimizer state; the policy's adapter,
    gradients and optimizer are untouched."""
    state.check_open()

    def work() -> None:
        lora_model = state.lora_model(model_id)
        if lora_model.critic is None:
            raise ValueError(f"model {model_id!r} has no critic")
        state.model.delete_adapter(lora_model.critic.adapter)
        lora_model.critic = None

    return state.submit(work, mirror=lambda: RankOp("delete_critic", (model_id,)))
