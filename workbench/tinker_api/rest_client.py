"""Tinker's `RestClient` over local model folders: training runs, their checkpoints, the models on offer.

A training run is a model, and a model is a folder (`workbench.storage.model_folders`): its `run.json` says what it
is (base model, adapter, user metadata), and its checkpoint folders are listed by `workbench.storage.checkpoint_store`.
So models trained by an earlier process (under the models root, `$WORKBENCH_RUNS`) are found as well as the live
models of the engines this client was given; deleting a live model's checkpoint is ordered with its saves (it goes
through the engine), deleting one of a model off the engines is immediate. Every method returns an `APIFuture`
(resolved already: reading folders takes no queue), and has the SDK's `*_async` twin where the SDK has
one. Responses have the SDK's shapes (`TrainingRun`, `Checkpoint`, `CheckpointsListResponse`, ...).

External weights (`save_weights_external`) are downloaded file by file: `get_external_weights_urls`
gives `file://` URLs of their files here (a server gives URLs of its own, signed), valid for
`EXTERNAL_URL_LIFETIME_S`, as the SDK's are.

The SDK's account, session, project, billing and publishing methods have no local meaning and are not
here (docs/tinker-parity.md).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, TypeVar

from workbench.engine.local.base_models import BaseModels
from workbench.engine.local.engine import Engine
from workbench.engine.model.builtin_models import BUILTIN_MODELS
from workbench.futures import APIFuture
from workbench.storage import checkpoint_store, external_weights
from workbench.storage.checkpoint_store import CheckpointError, CheckpointInfo, CheckpointKind
from workbench.storage.model_folders import (
    CheckpointAddress,
    address_of,
    model_folders,
    models_root,
    read_model_info,
)
from workbench.types import ExternalWeightsUrlsResponse

T = TypeVar("T")

CheckpointType = Literal["training", "sampler", "external"]
CHECKPOINT_TYPES: dict[CheckpointKind, CheckpointType] = {
    "state": "training",
    "sampler": "sampler",
    "external": "external",
}
EXTERNAL_URL_LIFETIME_S = 900
"""How long the URLs of external weights' files are valid (a server's are signed for as long)."""
LOCAL_OWNER = "local"


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint, in the shape of Tinker's `Checkpoint`."""

    checkpoint_id: str  # "weights/<name>", "sampler_weights/<name>" or "external_weights/<name>"
    checkpoint_type: CheckpointType
    time: datetime
    tinker_path: str
    size_bytes: int | None = None
    public: bool = False
    user_metadata: dict[str, str] | None = None
    expires_at: datetime | None = None
    base_model: str | None = None  # the run's base model (SDK 0.39 reads it)


@dataclass(frozen=True)
class Cursor:
    offset: int
    limit: int
    total_count: int


@dataclass(frozen=True)
class CheckpointsListResponse:
    checkpoints: list[Checkpoint]
    cursor: Cursor | None = None


@dataclass(frozen=True)
class TrainingRun:
    """A training run, in the shape of Tinker's `TrainingRun` (the run id is the model id)."""

    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool
    last_request_time: datetime
    corrupted: bool = False
    lora_rank: int | None = None
    last_checkpoint: Checkpoint | None = None
    last_sampler_checkpoint: Checkpoint | None = None
    user_metadata: dict[str, str] | None = None


@dataclass(frozen=True)
class TrainingRunsResponse:
    training_runs: list[TrainingRun]
    cursor: Cursor


@dataclass(frozen=True)
class WeightsInfoResponse:
    """What it takes to load a checkpoint (Tinker's `WeightsInfoResponse`)."""

    base_model: str
    is_lora: bool
    lora_rank: int | None = None
    train_unembed: bool | None = None
    train_mlp: bool | None = None
    train_attn: bool | None = None


@dataclass(frozen=True)
class SupportedModel:
    model_name: str | None = None
    max_context_length: int | None = None
    trainable: bool | None = None
    sampleable: bool | None = None


@dataclass(frozen=True)
class GetServerCapabilitiesResponse:
    """The base models on offer: the built-in aliases and the engines already running. Any HF model
    folder or (with a reachable hub) HF id works as well."""

    supported_models: list[SupportedModel] = field(default_factory=list)


def server_capabilities(engines: Sequence[Engine]) -> GetServerCapabilitiesResponse:
    running = {engine.config.base_model: engine.base_info.max_length for engine in engines}
    names = [*running, *(alias for alias in BUILTIN_MODELS if alias not in running)]
    return GetServerCapabilitiesResponse(
        supported_models=[
            SupportedModel(
                model_name=name, max_context_length=running.get(name), trainable=True, sampleable=True
            )
            for name in names
        ]
    )


def _base_model_of(folder: Path) -> str | None:
    info = read_model_info(folder) or {}
    return None if info.get("base_model") is None else str(info["base_model"])


def _done(value: T) -> APIFuture[T]:
    future: concurrent.futures.Future[T] = concurrent.futures.Future()
    future.set_result(value)
    return APIFuture(future)


def _datetime(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)


def _checkpoint(info: CheckpointInfo, base_model: str | None) -> Checkpoint:
    address = address_of(info.path)
    return Checkpoint(
        checkpoint_id=address.checkpoint_id,
        checkpoint_type=CHECKPOINT_TYPES[info.kind],
        time=_datetime(info.time),
        tinker_path=address.tinker_path,
        size_bytes=info.size_bytes,
        user_metadata=dict(info.user_metadata or {}),
        expires_at=None if info.expires_at is None else _datetime(info.expires_at),
        base_model=base_model,
    )


class RestClient:
    """Tinker's `RestClient`, reading local model folders.

    Args:
        base_url, api_key: Tinker's connection arguments; there is no server to connect to.
        base_models: The base models whose live models this client describes (and whose checkpoint
            deletions go through their engines, in order); `ServiceClient.create_rest_client()` passes
            its own. None: only the folders under the models root.
    """

    def __init__(
        self,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        base_models: BaseModels | None = None,
    ):
        self._base_models = base_models

    @property
    def _engines(self) -> list[Engine]:
        return [] if self._base_models is None else self._base_models.engines()

    # ------------------------------------------------------------------------------------------ models

    def _live(self) -> dict[str, tuple[Engine, Path]]:
        """The live models by id: their engine and folder."""
        return {
            model_id: (engine, engine.model_status(model_id).model_dir)
            for engine in self._engines
            if not engine.closed
            for model_id in engine.model_ids()
        }

    def _folders(self) -> dict[str, Path]:
        return model_folders({model_id: folder for model_id, (_, folder) in self._live().items()})

    def _model_folder(self, training_run_id: str) -> Path:
        live = self._live()
        if training_run_id in live:
            return live[training_run_id][1]
        folder = models_root() / training_run_id
        if read_model_info(folder) is None:
            raise CheckpointError(
                f"no training run {training_run_id!r}: not live on this client's engines and no {folder}/run.json"
            )
        return folder

    def _list(self, training_run_id: str, folder: Path) -> list[CheckpointInfo]:
        live = self._live()
        if training_run_id in live:
            return live[training_run_id][0].list_checkpoints(training_run_id)
        return checkpoint_store.list_checkpoints(folder)

    def _training_run(self, training_run_id: str) -> TrainingRun:
        folder = self._model_folder(training_run_id)
        info = read_model_info(folder)
        if info is None:
            raise CheckpointError(f"{folder} has no run.json: it was made before runs described themselves")
        checkpoints = self._list(training_run_id, folder)
        states = [c for c in checkpoints if c.kind == "state"]
        samplers = [c for c in checkpoints if c.kind == "sampler"]
        lora = info.get("lora") or {}
        last_time = max([float(info.get("created_at", 0.0)), *(c.time for c in checkpoints)])
        base_model = str(info["base_model"])
        return TrainingRun(
            training_run_id=training_run_id,
            base_model=base_model,
            model_owner=LOCAL_OWNER,
            is_lora=True,
            last_request_time=_datetime(last_time),
            lora_rank=lora.get("rank"),
            last_checkpoint=_checkpoint(states[-1], base_model) if states else None,
            last_sampler_checkpoint=_checkpoint(samplers[-1], base_model) if samplers else None,
            user_metadata=dict(info.get("user_metadata") or {}),
        )

    def get_training_run(
        self, training_run_id: str, access_scope: Literal["owned", "accessible"] = "owned"
    ) -> APIFuture[TrainingRun]:
        """A run by id (`access_scope` has no local meaning: every local run is the user's)."""
        return _done(self._training_run(training_run_id))

    async def get_training_run_async(
        self, training_run_id: str, access_scope: Literal["owned", "accessible"] = "owned"
    ) -> TrainingRun:
        return await self.get_training_run(training_run_id, access_scope)

    def get_training_run_by_tinker_path(
        self, tinker_path: str, access_scope: Literal["owned", "accessible"] = "owned"
    ) -> APIFuture[TrainingRun]:
        """The run a checkpoint path belongs to, its `user_metadata` included."""
        return _done(self._training_run(CheckpointAddress.parse(tinker_path).model_id))

    async def get_training_run_by_tinker_path_async(
        self, tinker_path: str, access_scope: Literal["owned", "accessible"] = "owned"
    ) -> TrainingRun:
        return await self.get_training_run_by_tinker_path(tinker_path, access_scope)

    def list_training_runs(
        self,
        limit: int = 20,
        offset: int = 0,
        access_scope: Literal["owned", "accessible"] = "owned",
        project_id: str | None = None,
    ) -> APIFuture[TrainingRunsResponse]:
        """Every model (live, or a folder with a `run.json` under the models root), newest first."""
        runs = sorted(
            (self._training_run(model_id) for model_id in self._folders()),
            key=lambda run: run.last_request_time,
            reverse=True,
        )
        page = runs[offset : offset + limit]
        return _done(TrainingRunsResponse(page, Cursor(offset=offset, limit=limit, total_count=len(runs))))

    async def list_training_runs_async(
        self,
        limit: int = 20,
        offset: int = 0,
        access_scope: Literal["owned", "accessible"] = "owned",
        project_id: str | None = None,
    ) -> TrainingRunsResponse:
        return await self.list_training_runs(limit, offset, access_scope, project_id)

    # ------------------------------------------------------------------------------------------ checkpoints

    def list_checkpoints(self, training_run_id: str) -> APIFuture[CheckpointsListResponse]:
        """The run's complete, unexpired checkpoints (state and sampler), oldest first."""
        folder = self._model_folder(training_run_id)
        base_model = _base_model_of(folder)
        return _done(
            CheckpointsListResponse([_checkpoint(c, base_model) for c in self._list(training_run_id, folder)])
        )

    async def list_checkpoints_async(self, training_run_id: str) -> CheckpointsListResponse:
        return await self.list_checkpoints(training_run_id)

    def list_user_checkpoints(self, limit: int = 100, offset: int = 0) -> APIFuture[CheckpointsListResponse]:
        """Every run's checkpoints, newest first."""
        every = sorted(
            (
                _checkpoint(info, _base_model_of(folder))
                for model_id, folder in self._folders().items()
                for info in self._list(model_id, folder)
            ),
            key=lambda checkpoint: checkpoint.time,
            reverse=True,
        )
        page = every[offset : offset + limit]
        return _done(
            CheckpointsListResponse(page, Cursor(offset=offset, limit=limit, total_count=len(every)))
        )

    async def list_user_checkpoints_async(self, limit: int = 100, offset: int = 0) -> CheckpointsListResponse:
        return await self.list_user_checkpoints(limit, offset)

    def delete_checkpoint(self, training_run_id: str, checkpoint_id: str) -> APIFuture[None]:
        """Delete a run's checkpoint, `checkpoint_id` being `weights/<name>` or `sampler_weights/<name>`."""
        return self.delete_checkpoint_from_tinker_path(f"tinker://{training_run_id}/{checkpoint_id}")

    async def delete_checkpoint_async(self, training_run_id: str, checkpoint_id: str) -> None:
        return await self.delete_checkpoint(training_run_id, checkpoint_id)

    def delete_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture[None]:
        """Delete the checkpoint a `tinker://` path names: a live run's after its queued operations,
        a finished run's now."""
        address = CheckpointAddress.parse(tinker_path)
        live = self._live()
        if address.model_id in live:
            engine, _ = live[address.model_id]
            return engine.delete_checkpoint(address.model_id, address.name, address.kind)
        checkpoint_store.delete(self._model_folder(address.model_id), address.name, address.kind)
        return _done(None)

    async def delete_checkpoint_from_tinker_path_async(self, tinker_path: str) -> None:
        return await self.delete_checkpoint_from_tinker_path(tinker_path)

    def get_weights_info_by_tinker_path(self, tinker_path: str) -> APIFuture[WeightsInfoResponse]:
        """The base model and adapter a checkpoint needs."""
        address = CheckpointAddress.parse(tinker_path)
        folder = self._model_folder(address.model_id)
        if not (checkpoint_store.kind_dir(folder, address.kind) / address.name).is_dir():
            raise CheckpointError(f"no checkpoint {address.checkpoint_id!r} in run {address.model_id!r}")
        info = read_model_info(folder) or {}
        lora: dict[str, Any] = info.get("lora") or {}
        return _done(
            WeightsInfoResponse(
                base_model=str(info.get("base_model")),
                is_lora=True,
                lora_rank=lora.get("rank"),
                train_unembed=lora.get("train_unembed"),
                train_mlp=lora.get("train_mlp"),
                train_attn=lora.get("train_attn"),
            )
        )

    def get_external_weights_urls(self, tinker_path: str) -> APIFuture[ExternalWeightsUrlsResponse]:
        """A URL per file of an external weights checkpoint (`tinker://<run>/external_weights/<name>`,
        as `save_weights_external` returns it), valid until `.expires`: `file://` URLs here, which
        `urllib` (tinker-cookbook's `weights.download`) reads as it reads a server's."""
        address = CheckpointAddress.parse(tinker_path)
        if address.kind != "external":
            raise ValueError(
                "get_external_weights_urls only accepts external weights checkpoints "
                f"(tinker://<training_run_id>/external_weights/<name>), got {tinker_path!r}"
            )
        folder = checkpoint_store.require_checkpoint_folder(
            checkpoint_store.kind_dir(self._model_folder(address.model_id), "external") / address.name
        )
        urls = {name: (folder / name).as_uri() for name in external_weights.downloadable_files(folder)}
        expires = _datetime(time.time() + EXTERNAL_URL_LIFETIME_S)
        return _done(ExternalWeightsUrlsResponse(urls=urls, expires=expires))

    async def get_external_weights_urls_async(self, tinker_path: str) -> ExternalWeightsUrlsResponse:
        return await self.get_external_weights_urls(tinker_path)

    # ------------------------------------------------------------------------------------------ server

    def get_server_capabilities(self) -> APIFuture[GetServerCapabilitiesResponse]:
        return _done(server_capabilities(self._engines))

    def get_telemetry(self) -> None:
        """No telemetry is collected locally."""
        return None
