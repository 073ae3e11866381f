"""Checkpoint operations on a run: save and load its state, and save the policy's adapter for samplers.

    p = sess.policy.save_state("step-20").result().path     # tinker://<run id>/weights/step-20
    sess.policy.load_state(p).result()                      # the weights (Tinker's load_state)
    sess.policy.load_state_with_optimizer(p).result()       # + optimizer state and counters
    sess2 = wb.Session.from_checkpoint(p)                   # a new kernel continues the same run exactly
    sess.policy.save_weights_for_sampler("step-20")         # tinker://<run id>/sampler_weights/step-20
    sess.policy.save_weights_external("final")              # tinker://<run id>/external_weights/final

A state checkpoint holds a run (policy and critic, optimizers, counters, RNG states, config);
`checkpoint_files` lists its files. A sampler checkpoint is the policy's adapter alone, in peft's format.
Both are written atomically (`workbench.storage.checkpoint_store`) into the run's folder (`model_folders`).

Saves and loads are ordered operations: a save captures the state the operations before it left, never
the middle of one; a load reads and verifies every file on the worker, after the operations before it
(a save of the same name included), and changes the run only once everything has been checked against
it. What can be checked without the files (names, paths) is checked in the caller's thread. A state
save's files are written beside the worker once captured (`workbench.engine.local.checkpoint_writes`):
training and sampling go on meanwhile, anything that touches checkpoint folders waits for the write,
and the save's future resolves once the files are on disk.

`ttl_seconds` is honoured: the checkpoint records when it expires; an expired checkpoint is no longer
listed or loadable, and `cleanup` removes it. `user_metadata` is stored with the checkpoint and
returned by listings.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from workbench.engine.interface import Restore
from workbench.engine.local import checkpoint_files
from workbench.engine.local.checkpoint_files import SavedState
from workbench.engine.local.lora_models import LoraModel
from workbench.engine.local.model_lifecycle import check_metadata
from workbench.engine.local.ranks import RankOp
from workbench.engine.local.state import EngineState
from workbench.engine.model.adapted_model import ADAPTER_CONFIG
from workbench.engine.roles import Role
from workbench.engine.worker import SessionClosedError
from workbench.futures import APIFuture
from workbench.storage import checkpoint_store, external_weights
from workbench.storage.checkpoint_store import CheckpointError, CheckpointKind, check_name, kind_dir
from workbench.storage.model_folders import TINKER_SCHEME, CheckpointAddress, address_of, resolve_checkpoint
from workbench.types import (
    LoadWeightsResponse,
    SaveWeightsExternalResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
)

SAMPLER_INFO = "sampler.json"


def known_models(state: EngineState) -> dict[str, Path]:
    """The engine's model folders by model id, for resolving `tinker://` paths to folders."""
    return {model_id: lora_model.model_dir for model_id, lora_model in list(state.lora_models.items())}


MAX_TTL_SECONDS = 100 * 365 * 24 * 3600
"""The longest time to live a checkpoint may be given (a hundred years; None keeps it until deleted):
an expiry past what a date can hold would break every listing that shows it."""


def _expires_at(ttl_seconds: int | None) -> float | None:
    if ttl_seconds is None:
        return None
    if (
        isinstance(ttl_seconds, bool)
        or not isinstance(ttl_seconds, int)
        or not 1 <= ttl_seconds <= MAX_TTL_SECONDS
    ):
        raise ValueError(
            f"ttl_seconds must be a positive integer up to {MAX_TTL_SECONDS} (a hundred years), or None "
            f"to keep the checkpoint until deleted; got {ttl_seconds!r}"
        )
    return time.time() + ttl_seconds


def check_path(path: object, argument: str = "path") -> str | Path:
    """A checkpoint as a user names it: a `tinker://` path, a name of the run's own, or a folder."""
    if isinstance(path, Path) or (isinstance(path, str) and path):
        return path
    raise ValueError(
        f"{argument} must be a tinker:// path, a checkpoint name or a folder, got {type(path).__name__} {path!r}"
    )


def _target(state: EngineState, model_id: str, kind: CheckpointKind, name: str, overwrite: bool) -> Path:
    if not isinstance(overwrite, bool):
        raise ValueError(f"overwrite must be True or False, got {overwrite!r}")
    target = (kind_dir(state.lora_model(model_id).model_dir, kind) / check_name(name)).absolute()
    checkpoint_store.check_free(target, overwrite)
    return target


def save_state(
    state: EngineState,
    model_id: str,
    name: str,
    *,
    overwrite: bool = False,
    ttl_seconds: int | None = None,
    user_metadata: Mapping[str, str] | None = None,
) -> APIFuture[SaveWeightsResponse]:
    """Queue a save of the run's whole state to `<model_dir>/checkpoints/<name>`."""
    state.check_open()
    target = _target(state, model_id, "state", name, overwrite)
    expires_at = _expires_at(ttl_seconds)
    metadata = check_metadata(user_metadata)

    saved: concurrent.futures.Future[SaveWeightsResponse] = concurrent.futures.Future()
    saved.set_running_or_notify_cancel()

    def work() -> None:
        lora_model = state.lora_model(model_id)
        files = checkpoint_files.capture(
            state, lora_model, name, expires_at=expires_at, user_metadata=metadata
        )
        # the row now, in order with the operations around it (a run counts the rows its save has seen)
        state.record(
            "save_state",
            lora_model,
            lora_model.policy.adapter,
            {"checkpoint_bytes": float(sum(map(len, files.values())))},
        )
        path = address_of(target).tinker_path
        event = {"name": name, "kind": "state", "path": path, "step": lora_model.step}

        def write() -> None:
            try:
                checkpoint_store.write_atomically(target, files, overwrite)
            except BaseException as error:  # the caller sees every failure
                saved.set_exception(error)
                return
            response = SaveWeightsResponse(path=path, folder=str(target))

            def announce() -> None:  # the sinks hear of the checkpoint before its caller does
                if not saved.done():
                    state.history.event("checkpoint", event)
                    saved.set_result(response)

            # on the worker, between operations, as every other event; once it has stopped, here
            try:
                announced = state.worker.submit(announce).future()
            except SessionClosedError:
                announce()
            else:
                announced.add_done_callback(lambda job: job.exception() is not None and announce())

        state.writes.start(write)  # the state is captured: the next operation need not wait for the disk

    def captured(job: concurrent.futures.Future[None]) -> None:
        error = job.exception()
        if error is not None:  # the capture failed, or the save never ran (the session closed first)
            saved.set_exception(error)

    state.submit(work).future().add_done_callback(captured)
    return APIFuture(saved, state.worker.thread)


def save_weights_for_sampler(
    state: EngineState,
    model_id: str,
    name: str,
    *,
    overwrite: bool = False,
    ttl_seconds: int | None = None,
    user_metadata: Mapping[str, str] | None = None,
) -> APIFuture[SaveWeightsForSamplerResponse]:
    """Queue a save of the policy's adapter to `<model_dir>/sampler_weights/<name>`: peft's
    `adapter_config.json` + `adapter_model.safetensors` (what `PeftModel.from_pretrained` and vLLM's
    `LoRARequest` load; the config names the base as the local folder or HF id it was loaded from),
    plus `sampler.json` (step, weights version, time, metadata) and the manifest, which both ignore."""
    state.check_open()
    target = _target(state, model_id, "sampler", name, overwrite)
    expires_at = _expires_at(ttl_seconds)
    metadata = check_metadata(user_metadata)

    def work() -> SaveWeightsForSamplerResponse:
        lora_model = state.lora_model(model_id)
        files = state.model.adapter_files(lora_model.policy.adapter)
        path = _write_adapter(
            "save_weights_for_sampler",
            state,
            lora_model,
            target,
            name,
            files,
            {"expires_at": expires_at, "user_metadata": metadata},
            overwrite,
        )
        return SaveWeightsForSamplerResponse(path=path, folder=str(target))

    return state.submit(work)


def save_weights_external(
    state: EngineState,
    model_id: str,
    name: str,
    *,
    ttl_seconds: int | None = None,
    age_encryption_recipients: Sequence[str] | None = None,
) -> APIFuture[SaveWeightsExternalResponse]:
    """Queue a save of the policy's adapter as external weights, `<model_dir>/external_weights/<name>`
    (`workbench.storage.external_weights`: peft's two files, each age-encrypted to the recipients when
    any are given), listed and deleted like any checkpoint and downloaded file by file from signed URLs
    (`get_external_weights_urls`)."""
    state.check_open()
    target = _target(state, model_id, "external", name, False)
    expires_at = _expires_at(ttl_seconds)
    recipients = external_weights.parse_recipients(age_encryption_recipients)

    def work() -> SaveWeightsExternalResponse:
        lora_model = state.lora_model(model_id)
        files = external_weights.external_files(
            state.model.adapter_files(lora_model.policy.adapter), recipients
        )
        path = _write_adapter(
            "save_weights_external",
            state,
            lora_model,
            target,
            name,
            files,
            {"expires_at": expires_at, "encrypted_to": len(recipients)},
            False,
        )
        return SaveWeightsExternalResponse(path=path, folder=str(target))

    return state.submit(work)


def _write_adapter(
    operation: str,
    state: EngineState,
    lora_model: LoraModel,
    target: Path,
    name: str,
    files: dict[str, bytes],
    info: Mapping[str, Any],
    overwrite: bool,
) -> str:
    """On the worker, for `operation` (`save_weights_for_sampler`, `save_weights_external`): write the
    policy's adapter `files` into `target` (a sampler or external checkpoint folder, its kind the
    folder's) with the kind's info file (step, weights version, run, base model, time, plus `info`),
    record the save and its history event. Returns its `tinker://` path."""
    address = address_of(target)
    kind = address.kind
    policy = lora_model.policy
    files[checkpoint_store.INFO_FILE[kind]] = checkpoint_store.json_bytes(
        {
            "format_version": checkpoint_store.FORMAT_VERSION,
            "kind": kind,
            "name": name,
            "saved_at": time.time(),
            "step": policy.step,
            "weights_version": policy.weights_version,
            "run_id": lora_model.model_id,
            "base_model": state.base_info.identity(),
            **info,
        }
    )
    checkpoint_store.write_atomically(target, files, overwrite)
    state.record(operation, lora_model, policy.adapter, {"weights_version": float(policy.weights_version)})
    state.history.event(
        "checkpoint", {"name": name, "kind": kind, "path": address.tinker_path, "step": policy.step}
    )
    return address.tinker_path


def describe(folder: Path) -> str:
    """A checkpoint folder as the `tinker://` path that names it, or the folder when none does."""
    try:
        return address_of(folder).tinker_path
    except CheckpointError:
        return str(folder.absolute())


def resolve(
    state: EngineState, model_id: str | None, path_or_name: str | Path, kind: CheckpointKind = "state"
) -> Path:
    """The checkpoint folder a user means (a `tinker://` path, a name of the run's own, or a folder)."""
    own = state.lora_model(model_id).model_dir if model_id is not None else None
    folder = resolve_checkpoint(path_or_name, kind, own, known_models(state))
    return checkpoint_store.require_checkpoint_folder(folder)


def adapter_folder(state: EngineState, path: str | Path) -> Path:
    """The peft adapter folder a sampling client of `path` loads: sampler weights
    (`tinker://<run>/sampler_weights/<name>` or their folder), or the policy of a state checkpoint
    (`tinker://<run>/weights/<name>` or its folder), verified against its manifest.

    Raises:
        CorruptCheckpointError: a file of the checkpoint is missing, extra or altered.
    """
    if isinstance(path, str) and path.startswith(TINKER_SCHEME):
        kind = CheckpointAddress.parse(path).kind
    else:
        kind = "sampler" if (Path(path).expanduser() / ADAPTER_CONFIG).is_file() else "state"
    folder = resolve(state, None, path, kind)
    checkpoint_store.read_verified(folder)  # every load verifies the manifest's hashes, as load_state does
    return folder if kind == "sampler" else folder / Role.POLICY.value


def saved_base_model(path: str | Path, known: Mapping[str, Path]) -> str:
    """The base model a checkpoint (either kind, `tinker://` path or folder) was saved on, as its engine
    was created with it: what an engine for it is created with."""
    if isinstance(path, str) and path.startswith(TINKER_SCHEME):
        address = CheckpointAddress.parse(path)
        folder = checkpoint_store.require_checkpoint_folder(
            resolve_checkpoint(path, address.kind, None, known)
        )
    else:
        folder = Path(path).expanduser()
    for info_file in (SAMPLER_INFO, checkpoint_store.INFO_FILE["state"]):
        if (folder / info_file).is_file():
            info = checkpoint_store.parse_json(folder, info_file, (folder / info_file).read_bytes())
            return str(info["base_model"]["name"])
    raise CheckpointError(f"{folder} is not a checkpoint: it has neither {SAMPLER_INFO} nor config.json")


def read_state(folder: Path) -> SavedState:
    """Verify and parse a state checkpoint; refuses one whose time to live has run out."""
    saved = checkpoint_files.read(folder)
    if saved.expires_at is not None and saved.expires_at < time.time():
        raise CheckpointError(f"{folder} expired at {time.ctime(saved.expires_at)} (its ttl_seconds ran out)")
    return saved


def load_state(
    state: EngineState, model_id: str, path_or_name: str | Path, restore: Restore
) -> APIFuture[LoadWeightsResponse]:
    """Queue a load of a state checkpoint into the run: found, read and verified on the worker after the
    operations before it, then checked against the run, and only then restored (see
    `checkpoint_files.restore` for what each `Restore` level puts back and how versions are set)."""
    state.check_open()
    state.lora_model(model_id)
    check_path(path_or_name)

    def work() -> LoadWeightsResponse:
        folder = resolve(state, model_id, path_or_name)
        saved = read_state(folder)
        lora_model = state.lora_model(model_id)
        checkpoint_files.restore(saved, state, lora_model, restore, exact_versions=False)
        state.record(
            "load_state",
            lora_model,
            lora_model.policy.adapter,
            {"weights_version": float(lora_model.policy.weights_version)},
        )
        return LoadWeightsResponse(path=describe(folder))

    return state.submit(
        work,
        mirror=lambda: RankOp("load_state", (model_id, str(resolve(state, model_id, path_or_name)), restore)),
    )
