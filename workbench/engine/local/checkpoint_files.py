"""A training run's whole state as checkpoint files, and back.

Files of a state checkpoint (relative paths; `workbench.storage.checkpoint_store` adds `manifest.json`):

    config.json                      format version, name, time, step, run id (also the W&B run id),
                                     base model identity, the ModelConfig, user metadata, expiry
    state.json                       per adapter: step, weights_version, pending_backward_calls;
                                     python and numpy RNG states
    rng.safetensors                  torch RNG states (uint8): `torch_cpu`, `sampling` (the engine's
                                     sampling generator), `cuda.<i>` when CUDA is available
    policy/adapter_config.json       the policy adapter in peft's format (PeftModel.from_pretrained loads it)
    policy/adapter_model.safetensors
    optimizer/policy.safetensors     AdamW state tensors keyed `<parameter name>/<exp_avg|exp_avg_sq|step>`
    optimizer/policy.json            AdamW param groups (hyperparameters, parameters by name)
    gradients/policy.safetensors     only when forward_backward calls are pending: the accumulated gradient
    critic/...                       the same for the critic when there is one, plus
    critic/value_head.safetensors

Tensors are safetensors, everything else JSON: nothing is pickled. No base-model weight is written (peft's
embedding-layer export is off), and nothing from the environment (tokens, keys) is.

Pending gradients round-trip: a checkpoint saved between `forward_backward` and `optim_step` holds the
accumulated gradient and the count of pending calls, and loading it restores both, so the next
`optim_step` applies exactly what it would have applied.

Parameter names are written with the role in place of the adapter's name (`...lora_A.policy.weight`),
so a checkpoint loads into any run whatever its adapters are called on that engine.

Loading is two-phase. `read` verifies the manifest and parses every file without looking at an engine;
`restore` (on the worker thread) checks the parsed state against the run (base model identity, critic
present or not, each adapter's rank/alpha/targets, tensor names and shapes) and only then changes
anything. How much it restores is the caller's choice (`Restore`): the weights alone, with the
optimizer started afresh and any pending gradient dropped (Tinker's `load_state`: "weights only,
optimizer resets", as `create_training_client_from_state` starts), the weights with the optimizer state
and counters (`load_state_with_optimizer`), or
everything including the process-global python, numpy and torch RNGs and the engine's sampling
generator, so a training loop that draws from them continues as the uninterrupted run would
(`Session.from_checkpoint`, `Session.load_state`).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch
from torch import Tensor

from workbench.engine.config import ModelConfig, to_quantization_config
from workbench.engine.interface import Restore
from workbench.engine.local.lora_models import LoraModel, RoleAdapter
from workbench.engine.local.state import EngineState
from workbench.engine.model.adapted_model import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from workbench.engine.roles import Role
from workbench.storage.checkpoint_store import (
    FORMAT_VERSION,
    CheckpointError,
    CorruptCheckpointError,
    json_bytes,
    parse_json,
    read_verified,
)
from workbench.storage.rng_state import RngStates
from workbench.types import LoraConfig

VALUE_HEAD = "value_head.safetensors"


def model_config(state: EngineState, lora_model: LoraModel) -> ModelConfig:
    """What defines `run` on this engine, as its checkpoints record it."""
    config = state.config
    return ModelConfig(
        base_model=config.base_model,
        lora=lora_model.policy.lora,
        critic=None if lora_model.critic is None else lora_model.critic.lora,
        seed=lora_model.seed,
        device=config.device,
        dtype=config.dtype,
        max_tokens_per_microbatch=config.max_tokens_per_microbatch,
        sampler=config.sampler,
        max_samples_per_request=config.max_samples_per_request,
        quantization=config.quantization,
    )


def canonical_names(model: RoleAdapter) -> dict[str, str]:
    """Live parameter name -> the name checkpoints use (the role in place of the adapter's name)."""
    marker = f".{model.adapter}."
    return {name: name.replace(marker, f".{model.role.value}.") for name in model.trainable.parameters}


# ---------------------------------------------------------------------------------------------- capture


def capture(
    state: EngineState,
    lora_model: LoraModel,
    name: str,
    *,
    expires_at: float | None,
    user_metadata: Mapping[str, str],
) -> dict[str, bytes]:
    """Every file of a state checkpoint of `run`. Runs on the worker thread, between operations."""
    files: dict[str, bytes] = {}
    counters: dict[str, dict[str, int]] = {}
    for model in lora_model.role_adapters():
        role = model.role.value
        files.update(
            {f"{role}/{rel}": data for rel, data in state.model.adapter_files(model.adapter).items()}
        )
        if model.value_head is not None:
            head = {
                key: value.detach().cpu().contiguous() for key, value in model.value_head.state_dict().items()
            }
            files[f"{role}/{VALUE_HEAD}"] = safetensors.torch.save(head)
        trainable = model.trainable
        names = list(canonical_names(model).values())
        saved = trainable.optimizer.state_dict()
        moments = {
            f"{names[index]}/{key}": value.detach().cpu().contiguous()
            for index, entry in saved["state"].items()
            for key, value in entry.items()
        }
        groups = [
            {**group, "params": [names[index] for index in group["params"]]}
            for group in saved["param_groups"]
        ]
        files[f"optimizer/{role}.safetensors"] = safetensors.torch.save(moments)
        files[f"optimizer/{role}.json"] = json_bytes({"param_groups": groups})
        if trainable.pending_backward_calls:
            canonical = canonical_names(model)
            grads = {
                canonical[n]: p.grad.detach().cpu().contiguous()
                for n, p in trainable.parameters.items()
                if p.grad is not None
            }
            files[f"gradients/{role}.safetensors"] = safetensors.torch.save(grads)
        counters[role] = {
            "step": trainable.step,
            "weights_version": trainable.weights_version,
            "pending_backward_calls": trainable.pending_backward_calls,
        }
    rng = RngStates.capture(state.sampling_generator)
    files["rng.safetensors"] = safetensors.torch.save(rng.tensors())
    files["state.json"] = json_bytes({"adapters": counters, "rng": rng.to_json()})
    files["config.json"] = json_bytes(
        {
            "format_version": FORMAT_VERSION,
            "kind": "state",
            "name": name,
            "saved_at": time.time(),
            "expires_at": expires_at,
            "step": lora_model.step,
            "run_id": lora_model.model_id,
            "base_model": state.base_info.identity(),
            "session": model_config(state, lora_model).to_dict(),
            "user_metadata": dict(user_metadata),
        }
    )
    return files


# ---------------------------------------------------------------------------------------------- parse


@dataclass
class AdapterState:
    """One adapter's saved state, parsed (not yet checked against a run)."""

    role: Role
    adapter_config: dict[str, Any]
    tensors: dict[str, Tensor]  # peft file keys
    value_head: dict[str, Tensor] | None
    param_groups: list[dict[str, Any]]  # params by name
    moments: dict[str, dict[str, Tensor]]  # parameter name -> AdamW state
    gradients: dict[str, Tensor]
    step: int
    weights_version: int
    pending_backward_calls: int


@dataclass
class SavedState:
    """A state checkpoint, verified and parsed."""

    folder: Path
    name: str
    model_id: str  # the model it was saved from (its config.json keeps the key "run_id")
    base_identity: dict[str, Any]
    # The Session arguments that rebuild the saved run; the device and the sampler kind follow the
    # machine it is rebuilt on.
    session_arguments: dict[str, Any]
    adapters: dict[Role, AdapterState]
    rng: RngStates
    user_metadata: dict[str, str]
    expires_at: float | None

    @property
    def run_id(self) -> str:
        """Deprecated: `model_id`."""
        warnings.warn("SavedState.run_id is now SavedState.model_id", DeprecationWarning, stacklevel=2)
        return self.model_id


def _tensors(folder: Path, files: Mapping[str, bytes], rel: str) -> dict[str, Tensor]:
    try:
        return safetensors.torch.load(files[rel])
    except KeyError:
        raise CorruptCheckpointError(f"{folder} has no {rel}") from None
    except (safetensors.SafetensorError, ValueError, RuntimeError) as error:
        raise CorruptCheckpointError(f"{folder / rel} is not a readable safetensors file: {error}") from None


def _json(folder: Path, files: Mapping[str, bytes], rel: str) -> dict[str, Any]:
    if rel not in files:
        raise CorruptCheckpointError(f"{folder} has no {rel}")
    return parse_json(folder, rel, files[rel])


def read(folder: Path) -> SavedState:
    """Verify a state checkpoint against its manifest and parse it; touches no engine.

    Raises:
        CheckpointError: not a state checkpoint, or written by a newer workbench.
        CorruptCheckpointError: a file does not match the manifest or cannot be parsed, naming it.
    """
    files = read_verified(folder)
    if "sampler.json" in files:
        raise CheckpointError(
            f"{folder} holds sampler weights, not a state checkpoint from save_state (the adapter only: no "
            "optimizer state, counters or RNG states)"
        )
    config = _json(folder, files, "config.json")
    if config.get("kind") != "state":
        raise CorruptCheckpointError(f"{folder / 'config.json'} does not describe a state checkpoint")
    if not isinstance(config.get("format_version"), int) or config["format_version"] > FORMAT_VERSION:
        raise CheckpointError(
            f"{folder} has checkpoint format {config.get('format_version')!r}; this workbench reads {FORMAT_VERSION}"
        )
    state = _json(folder, files, "state.json")
    try:
        adapters: dict[Role, AdapterState] = {}
        for role_name, counters in state["adapters"].items():
            role = Role(role_name)
            if role is Role.REFERENCE:
                raise ValueError("the reference has no adapter")
            moments: dict[str, dict[str, Tensor]] = {}
            for key, value in _tensors(folder, files, f"optimizer/{role}.safetensors").items():
                name, _, entry = key.rpartition("/")
                moments.setdefault(name, {})[entry] = value
            groups = _json(folder, files, f"optimizer/{role}.json")["param_groups"]
            grads_rel = f"gradients/{role}.safetensors"
            adapters[role] = AdapterState(
                role=role,
                adapter_config=_json(folder, files, f"{role}/{ADAPTER_CONFIG}"),
                tensors=_tensors(folder, files, f"{role}/{ADAPTER_WEIGHTS}"),
                value_head=_tensors(folder, files, f"{role}/{VALUE_HEAD}") if role is Role.CRITIC else None,
                # JSON turns tuples (AdamW's betas) into lists; torch keeps them as tuples
                param_groups=[
                    {k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()}
                    for g in groups
                ],
                moments=moments,
                gradients=_tensors(folder, files, grads_rel) if grads_rel in files else {},
                step=int(counters["step"]),
                weights_version=int(counters["weights_version"]),
                pending_backward_calls=int(counters["pending_backward_calls"]),
            )
        rng_tensors = _tensors(folder, files, "rng.safetensors")
        try:
            rng = RngStates.parse(state["rng"], rng_tensors)
        except (KeyError, TypeError, ValueError, RuntimeError) as error:
            raise CorruptCheckpointError(
                f"{folder}: unusable RNG state ({type(error).__name__}: {error})"
            ) from None
        session = config["session"]
        arguments = {
            "base_model": str(session["base_model"]),
            "lora": LoraConfig(**session["lora"]),
            "critic": False if session["critic"] is None else LoraConfig(**session["critic"]),
            "seed": int(session["seed"]),
            "dtype": str(session["dtype"]),
            "max_tokens_per_microbatch": int(session["max_tokens_per_microbatch"]),
            "max_samples_per_request": int(session["max_samples_per_request"]),
            "quantization": to_quantization_config(session.get("quantization")),
        }
        metadata = config.get("user_metadata") or {}
        expires_at = config.get("expires_at")
        return SavedState(
            folder=folder,
            name=str(config["name"]),
            model_id=str(config["run_id"]),
            base_identity=dict(config["base_model"]),
            session_arguments=arguments,
            adapters=adapters,
            rng=rng,
            user_metadata={str(k): str(v) for k, v in dict(metadata).items()},
            expires_at=None if expires_at is None else float(expires_at),
        )
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise CorruptCheckpointError(f"{folder}: malformed state ({type(error).__name__}: {error})") from None


# ---------------------------------------------------------------------------------------------- restore


def _describe_lora(config: Mapping[str, Any]) -> str:
    targets = config.get("target_modules")
    targets = sorted(targets) if isinstance(targets, set | list | tuple) else targets
    return f"rank {config.get('r')}, alpha {config.get('lora_alpha')}, targets {targets}"


def check_compatible(saved: SavedState, state: EngineState, lora_model: LoraModel, restore: Restore) -> None:
    """Everything that must agree before a checkpoint may be loaded into `run`, checked without
    changing anything: raises CheckpointError naming what differs, with both values."""
    current = state.base_info.identity()
    if saved.base_identity != current:
        diffs = [
            f"{key}: checkpoint {saved.base_identity.get(key)!r}, session {current.get(key)!r}"
            for key in sorted(set(saved.base_identity) | set(current))
            if saved.base_identity.get(key) != current.get(key)
        ]
        raise CheckpointError(f"{saved.folder} was saved on a different base model ({'; '.join(diffs)})")
    live_roles = {model.role for model in lora_model.role_adapters()}
    if set(saved.adapters) != live_roles:
        has = "has a critic" if Role.CRITIC in saved.adapters else "has no critic"
        session_has = "has one" if Role.CRITIC in live_roles else "has none"
        raise CheckpointError(
            f"{saved.folder} {has} and this session {session_has}: create_critic() or delete_critic() to match, "
            "or open it with Session.from_checkpoint"
        )
    for role, adapter_state in saved.adapters.items():
        model = lora_model.role_adapter(role)
        live = state.model.peft_config_dict(model.adapter)
        saved_lora = (
            adapter_state.adapter_config.get("r"),
            adapter_state.adapter_config.get("lora_alpha"),
            sorted(adapter_state.adapter_config.get("target_modules") or []),
        )
        if saved_lora != (live["r"], live["lora_alpha"], sorted(live["target_modules"])):  # type: ignore[arg-type]
            raise CheckpointError(
                f"{saved.folder}: the {role} adapter differs: checkpoint {_describe_lora(adapter_state.adapter_config)}; "
                f"session {_describe_lora(live)}"
            )
        _check_shapes(
            saved.folder,
            role,
            "adapter weights",
            adapter_state.tensors,
            state.model.adapter_tensors(model.adapter),
        )
        if adapter_state.value_head is not None:
            assert model.value_head is not None
            _check_shapes(
                saved.folder, role, "value head", adapter_state.value_head, model.value_head.state_dict()
            )
        if restore is not Restore.WEIGHTS:
            _check_training_state(saved.folder, role, adapter_state, model)


def _check_training_state(folder: Path, role: Role, adapter_state: AdapterState, model: RoleAdapter) -> None:
    """A full restore's optimizer state and gradient match the adapter's parameters, name by name and
    shape by shape: a mismatch here means a damaged checkpoint, since the adapters already agree."""
    params = {
        canonical: model.trainable.parameters[name] for name, canonical in canonical_names(model).items()
    }
    grouped = [name for group in adapter_state.param_groups for name in group["params"]]
    if len(adapter_state.param_groups) != len(model.trainable.optimizer.param_groups) or grouped != list(
        params
    ):
        raise CorruptCheckpointError(
            f"{folder}: the {role} optimizer's parameters do not match the adapter's"
        )
    for name, entries in adapter_state.moments.items():
        for key, value in entries.items():
            if name not in params or (key != "step" and value.shape != params[name].shape):
                raise CorruptCheckpointError(
                    f"{folder}: the {role} optimizer state {name}/{key} matches no parameter"
                )
    for name, grad in adapter_state.gradients.items():
        if name not in params or grad.shape != params[name].shape:
            raise CorruptCheckpointError(f"{folder}: the {role} gradient {name} matches no parameter")


def _check_shapes(
    folder: Path, role: Role, what: str, saved: Mapping[str, Tensor], live: Mapping[str, Tensor]
) -> None:
    missing, extra = sorted(set(live) - set(saved)), sorted(set(saved) - set(live))
    if missing or extra:
        raise CheckpointError(
            f"{folder}: the {role} {what} do not fit this session (missing {missing[:3]}, unexpected {extra[:3]})"
        )
    for key, value in saved.items():
        if value.shape != live[key].shape:
            raise CheckpointError(
                f"{folder}: the {role} {what} {key} has shape {tuple(value.shape)}, the session's {tuple(live[key].shape)}"
            )


def restore(
    saved: SavedState, state: EngineState, lora_model: LoraModel, restore: Restore, exact_versions: bool
) -> None:
    """Put a checked checkpoint into `run` (on the worker thread), as much of it as `restore` says.

    Versions: with `exact_versions` (a run built for this checkpoint) each weights_version is the saved
    one. Loading into a live run sets it to `max(saved, current) + 1` instead, so a version number never
    names two different sets of weights in one run.
    """
    check_compatible(saved, state, lora_model, restore)
    for model in lora_model.role_adapters():
        state.before_weights_change(lora_model, model)
    with torch.no_grad():
        for role, adapter_state in saved.adapters.items():
            model = lora_model.role_adapter(role)
            trainable = model.trainable
            live = state.model.adapter_tensors(model.adapter)
            for key, value in adapter_state.tensors.items():
                live[key].copy_(value)
            if adapter_state.value_head is not None:
                assert model.value_head is not None
                model.value_head.load_state_dict(adapter_state.value_head)
            trainable.weights_version = (
                adapter_state.weights_version
                if exact_versions
                else max(adapter_state.weights_version, trainable.weights_version) + 1
            )
            if restore is Restore.WEIGHTS:
                trainable.reset_optimizer()  # Tinker's weights-only load: the optimizer starts afresh
                continue
            index = {canonical: i for i, canonical in enumerate(canonical_names(model).values())}
            trainable.optimizer.load_state_dict(
                {
                    "state": {index[name]: dict(entries) for name, entries in adapter_state.moments.items()},
                    "param_groups": [
                        {**group, "params": [index[n] for n in group["params"]]}
                        for group in adapter_state.param_groups
                    ],
                }
            )
            canonical = canonical_names(model)
            for name, param in trainable.parameters.items():
                grad = adapter_state.gradients.get(canonical[name])
                param.grad = None if grad is None else grad.to(device=param.device, dtype=param.dtype)
            trainable.step = adapter_state.step
            trainable.pending_backward_calls = adapter_state.pending_backward_calls
    if restore is Restore.EVERYTHING:
        saved.rng.restore(state.sampling_generator, str(saved.folder))
