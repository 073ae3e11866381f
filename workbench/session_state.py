"""A session's whole training state as checkpoint files, and back.

Files of a state checkpoint (relative paths; `workbench.checkpoint_store` adds `manifest.json`):

    config.json                      format version, name, time, step, W&B run id, base model identity,
                                     the SessionConfig
    state.json                       per adapter: step, weights_version, pending_backward_calls;
                                     python and numpy RNG states
    rng.safetensors                  torch RNG states (uint8): `torch_cpu`, `sampling` (the session's
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

Loading is two-phase. `read` verifies the manifest and parses every file without looking at a session;
`restore` (on the worker thread) checks the parsed state against the session (base model identity,
critic present or not, each adapter's rank/alpha/targets, tensor names and shapes) and only then changes
anything. The process-global python, numpy and torch RNGs are restored too, so a training loop that
draws from them continues as the uninterrupted run would.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import peft
import safetensors
import safetensors.torch
import torch
from peft.utils import get_peft_model_state_dict
from torch import Tensor

from workbench.checkpoint_store import (
    FORMAT_VERSION,
    CheckpointError,
    CorruptCheckpointError,
    json_bytes,
    parse_json,
    read_verified,
)
from workbench.critic import CRITIC
from workbench.rng_state import RngStates
from workbench.types import LoraConfig

if TYPE_CHECKING:
    from workbench.session import Session

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
VALUE_HEAD = "value_head.safetensors"


# ---------------------------------------------------------------------------------------------- peft format


def adapter_tensors(model: peft.PeftModel, role: str) -> dict[str, Tensor]:
    """One adapter's tensors under peft's file keys (the adapter name removed), as views of the live
    parameters: writing into them writes the adapter. The embedding layers stay out (peft would add
    the base model's full embeddings when the output layer is adapted)."""
    return get_peft_model_state_dict(model, adapter_name=role, save_embedding_layers=False)


def peft_adapter_files(model: peft.PeftModel, role: str, base_model_path: str) -> dict[str, bytes]:
    """One adapter as peft's two files, loadable on their own by `PeftModel.from_pretrained` and by vLLM.

    The config is peft's own (`LoraConfig.to_dict()`, as `save_pretrained` writes it) with
    `base_model_name_or_path` set to the folder or HF id the base was loaded from, and set-valued
    fields sorted so the same adapter always gives the same bytes.
    """
    config = copy.deepcopy(model.peft_config[role])
    config.base_model_name_or_path = base_model_path
    config.inference_mode = True
    config_dict = {key: sorted(value) if isinstance(value, set) else value for key, value in config.to_dict().items()}
    tensors = {key: value.detach().cpu().contiguous() for key, value in adapter_tensors(model, role).items()}
    return {
        ADAPTER_CONFIG: json_bytes(config_dict),
        ADAPTER_WEIGHTS: safetensors.torch.save(tensors, metadata={"format": "pt"}),
    }


# ---------------------------------------------------------------------------------------------- capture


def capture(sess: Session, name: str) -> dict[str, bytes]:
    """Every file of a state checkpoint of `sess`. Runs on the worker thread, between operations."""
    files: dict[str, bytes] = {}
    counters: dict[str, dict[str, int]] = {}
    for role, adapter in sess._adapters.items():
        files.update({f"{role}/{rel}": data for rel, data in peft_adapter_files(sess._model, role, sess.base_info.path).items()})
        if role == CRITIC:
            assert sess._value_head is not None
            head = {key: value.detach().cpu().contiguous() for key, value in sess._value_head.state_dict().items()}
            files[f"{role}/{VALUE_HEAD}"] = safetensors.torch.save(head)
        names = list(adapter.parameters)
        saved = adapter.optimizer.state_dict()
        moments = {
            f"{names[index]}/{key}": value.detach().cpu().contiguous()
            for index, state in saved["state"].items()
            for key, value in state.items()
        }
        groups = [{**group, "params": [names[index] for index in group["params"]]} for group in saved["param_groups"]]
        files[f"optimizer/{role}.safetensors"] = safetensors.torch.save(moments)
        files[f"optimizer/{role}.json"] = json_bytes({"param_groups": groups})
        if adapter.pending_backward_calls:
            grads = {n: p.grad.detach().cpu().contiguous() for n, p in adapter.parameters.items() if p.grad is not None}
            files[f"gradients/{role}.safetensors"] = safetensors.torch.save(grads)
        counters[role] = {
            "step": adapter.step,
            "weights_version": adapter.weights_version,
            "pending_backward_calls": adapter.pending_backward_calls,
        }
    rng = RngStates.capture(sess._sampling_generator)
    files["rng.safetensors"] = safetensors.torch.save(rng.tensors())
    files["state.json"] = json_bytes({"adapters": counters, "rng": rng.to_json()})
    files["config.json"] = json_bytes(
        {
            "format_version": FORMAT_VERSION,
            "kind": "state",
            "name": name,
            "saved_at": time.time(),
            "step": sess.step,
            "run_id": sess.run_dir.name,
            "base_model": sess.base_info.identity(),
            "session": sess.config.to_dict(),
        }
    )
    return files


# ---------------------------------------------------------------------------------------------- parse


@dataclass
class AdapterState:
    """One adapter's saved state, parsed (not yet checked against a session)."""

    role: str
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
    run_id: str
    base_identity: dict[str, Any]
    # The Session arguments that rebuild the saved session; the device and the sampler kind follow the
    # machine it is rebuilt on.
    session_arguments: dict[str, Any]
    adapters: dict[str, AdapterState]
    rng: RngStates


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
    """Verify a state checkpoint against its manifest and parse it; touches no session.

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
        raise CheckpointError(f"{folder} has checkpoint format {config.get('format_version')!r}; this workbench reads {FORMAT_VERSION}")
    state = _json(folder, files, "state.json")
    try:
        adapters = {}
        for role, counters in state["adapters"].items():
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
                value_head=_tensors(folder, files, f"{role}/{VALUE_HEAD}") if role == CRITIC else None,
                # JSON turns tuples (AdamW's betas) into lists; torch keeps them as tuples
                param_groups=[{k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()} for g in groups],
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
            raise CorruptCheckpointError(f"{folder}: unusable RNG state ({type(error).__name__}: {error})") from None
        session = config["session"]
        arguments = {
            "base_model": str(session["base_model"]),
            "lora": LoraConfig(**session["lora"]),
            "critic": False if session["critic"] is None else LoraConfig(**session["critic"]),
            "seed": int(session["seed"]),
            "dtype": str(session["dtype"]),
            "max_tokens_per_microbatch": int(session["max_tokens_per_microbatch"]),
            "max_samples_per_request": int(session["max_samples_per_request"]),
        }
        return SavedState(
            folder=folder,
            run_id=str(config["run_id"]),
            base_identity=dict(config["base_model"]),
            session_arguments=arguments,
            adapters=adapters,
            rng=rng,
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


def check_compatible(saved: SavedState, sess: Session) -> None:
    """Everything that must agree before a checkpoint may be loaded into `sess`, checked without
    changing anything: raises CheckpointError naming what differs, with both values."""
    current = sess.base_info.identity()
    if saved.base_identity != current:
        diffs = [f"{key}: checkpoint {saved.base_identity.get(key)!r}, session {current.get(key)!r}"
                 for key in sorted(set(saved.base_identity) | set(current)) if saved.base_identity.get(key) != current.get(key)]
        raise CheckpointError(f"{saved.folder} was saved on a different base model ({'; '.join(diffs)})")
    if set(saved.adapters) != set(sess._adapters):
        has = "has a critic" if CRITIC in saved.adapters else "has no critic"
        session_has = "has one" if CRITIC in sess._adapters else "has none"
        raise CheckpointError(
            f"{saved.folder} {has} and this session {session_has}: create_critic() or delete_critic() to match, "
            "or open it with Session.from_checkpoint"
        )
    for role, state in saved.adapters.items():
        live = sess._model.peft_config[role].to_dict()
        if (state.adapter_config.get("r"), state.adapter_config.get("lora_alpha"), sorted(state.adapter_config.get("target_modules") or [])) != (
            live["r"], live["lora_alpha"], sorted(live["target_modules"])
        ):
            raise CheckpointError(
                f"{saved.folder}: the {role} adapter differs: checkpoint {_describe_lora(state.adapter_config)}; "
                f"session {_describe_lora(live)}"
            )
        _check_shapes(saved.folder, role, "adapter weights", state.tensors, adapter_tensors(sess._model, role))
        params = sess._adapters[role].parameters
        if state.value_head is not None:
            assert sess._value_head is not None
            _check_shapes(saved.folder, role, "value head", state.value_head, sess._value_head.state_dict())
        grouped = [name for group in state.param_groups for name in group["params"]]
        if len(state.param_groups) != len(sess._adapters[role].optimizer.param_groups) or grouped != list(params):
            raise CorruptCheckpointError(f"{saved.folder}: the {role} optimizer's parameters do not match the adapter's")
        for name, entries in state.moments.items():
            for key, value in entries.items():
                if name not in params or (key != "step" and value.shape != params[name].shape):
                    raise CorruptCheckpointError(f"{saved.folder}: the {role} optimizer state {name}/{key} matches no parameter")
        for name, grad in state.gradients.items():
            if name not in params or grad.shape != params[name].shape:
                raise CorruptCheckpointError(f"{saved.folder}: the {role} gradient {name} matches no parameter")


def _check_shapes(folder: Path, role: str, what: str, saved: Mapping[str, Tensor], live: Mapping[str, Tensor]) -> None:
    missing, extra = sorted(set(live) - set(saved)), sorted(set(saved) - set(live))
    if missing or extra:
        raise CheckpointError(f"{folder}: the {role} {what} do not fit this session (missing {missing[:3]}, unexpected {extra[:3]})")
    for key, value in saved.items():
        if value.shape != live[key].shape:
            raise CheckpointError(f"{folder}: the {role} {what} {key} has shape {tuple(value.shape)}, the session's {tuple(live[key].shape)}")


def restore(saved: SavedState, sess: Session, exact_versions: bool) -> None:
    """Put a checked checkpoint into `sess` (on the worker thread): weights, optimizer state, pending
    gradients, counters and RNG states.

    Versions: with `exact_versions` (a session built for this checkpoint) each weights_version is the
    saved one. Loading into a live session sets it to `max(saved, current) + 1` instead, so a version
    number never names two different sets of weights in one session. Step counters are the saved ones
    either way.
    """
    check_compatible(saved, sess)
    for role in saved.adapters:
        sess._before_weights_change(role)
    with torch.no_grad():
        for role, state in saved.adapters.items():
            adapter = sess._adapters[role]
            live = adapter_tensors(sess._model, role)
            for key, value in state.tensors.items():
                live[key].copy_(value)
            if state.value_head is not None:
                assert sess._value_head is not None
                sess._value_head.load_state_dict(state.value_head)
            names = list(adapter.parameters)
            index = {name: i for i, name in enumerate(names)}
            adapter.optimizer.load_state_dict(
                {
                    "state": {index[name]: dict(entries) for name, entries in state.moments.items()},
                    "param_groups": [{**group, "params": [index[n] for n in group["params"]]} for group in state.param_groups],
                }
            )
            for name, param in adapter.parameters.items():
                grad = state.gradients.get(name)
                param.grad = None if grad is None else grad.to(device=param.device, dtype=param.dtype)
            adapter.step = state.step
            adapter.pending_backward_calls = state.pending_backward_calls
            adapter.weights_version = state.weights_version if exact_versions else max(state.weights_version, adapter.weights_version) + 1
    saved.rng.restore(sess._sampling_generator, str(saved.folder))
