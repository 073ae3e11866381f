"""The models and checkpoints the server lists, describes and deletes over REST.

Tinker's REST protocol calls a model a training run (`training_run_id`, `/api/v1/training_runs`); the
wire keeps its words, and everything behind it speaks of models. A model on an engine is described from
the engine; one off the engines (its session ended, or it is from before this server started) from its
folder under the models root (its run.json). The folders are the record, so the listings survive a
restart and hold nothing in memory per model that left.

These are reads of what the service holds and of the folders, with one write: a client deleting a
checkpoint of a model a client made. They never queue behind a model's ordered operations, except that
deletion, which goes through the model's engine while the model is live so that no operation races it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from workbench.server import schemas
from workbench.server.errors import RequestError, message_of
from workbench.server.service import TinkerService
from workbench.storage import checkpoint_store, external_weights
from workbench.storage.checkpoint_store import CheckpointError, CheckpointInfo, CheckpointKind
from workbench.storage.model_folders import (
    CheckpointAddress,
    check_model_id,
    model_folders,
    models_root,
    read_model_info,
)
from workbench.types import LoraConfig, check_text

HOST_OWNER = "workbench"
"""The owner the listings give the serving session's own models (and models found on disk)."""

CHECKPOINT_TYPES: dict[CheckpointKind, str] = {
    "state": "training",
    "sampler": "sampler",
    "external": "external",
}
"""Tinker's `checkpoint_type` of each kind of checkpoint."""

log = logging.getLogger("workbench.server")


@dataclasses.dataclass(frozen=True)
class ModelRecord:
    """A model as the listings describe it, whether it is on an engine or only in its folder."""

    model_dir: Path
    base_model: str
    owner: str  # the client session that made it ("workbench": the serving session's own)
    lora_rank: int
    last_request: float
    created_at: float
    user_metadata: dict[str, str]


def _iso(seconds: float | None) -> str | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, UTC).isoformat()


class ModelListings:
    """The REST listings of the models the server knows and their checkpoints, over `service`'s tables
    and the models root.

    Args:
        service: The service whose engines, served models and client-made models are listed.
    """

    def __init__(self, service: TinkerService):
        self.service = service

    # ------------------------------------------------------------------------------------------ finding a model

    def _live_model(self, training_run_id: str) -> str | None:
        """The engine model a training run id (or a served model id, for a critic its policy's) names,
        if it is on an engine."""
        model = self.service.models.get(training_run_id)
        model_id = model.engine_model_id if model is not None else training_run_id
        return model_id if self.service.engine_of_model(model_id) is not None else None

    def _stored_model(self, model_id: str) -> ModelRecord | None:
        """A model off the engines, described by its folder under the models root (its run.json); None
        for an id that names no readable folder (a folder that cannot be read is logged)."""
        try:
            model_dir = models_root() / check_model_id(model_id)
        except ValueError:
            return None  # not a model id: no folder to look at
        try:
            info = read_model_info(model_dir)
            if info is None:
                return None
            metadata = info.get("user_metadata") or {}
            return ModelRecord(
                model_dir=model_dir,
                base_model=str(info.get("base_model", "")),
                owner=self.service.client_models.get(model_id, HOST_OWNER),
                lora_rank=int(info["lora"]["rank"]),
                last_request=float(info["created_at"]),
                created_at=float(info["created_at"]),
                user_metadata={
                    check_text(str(k), "key"): check_text(str(v), "value") for k, v in metadata.items()
                },
            )
        except (CheckpointError, OSError, KeyError, TypeError, ValueError, AttributeError) as error:
            log.warning("model folder %s cannot be described: %s", model_id, error)
            return None

    def _known_model(self, training_run_id: str) -> str:
        """A model on an engine, or one in the models root (its files stay); 404 otherwise."""
        model_id = self._live_model(training_run_id)
        if model_id is not None:
            return model_id
        if self._stored_model(training_run_id) is not None:
            return training_run_id
        raise RequestError(f"no training run {training_run_id!r} on this server", 404)

    def _live_record(self, model_id: str) -> ModelRecord:
        """What a model on an engine is; its last request is the latest of the served models on it."""
        engine = self.service.engine_of_model(model_id)
        assert engine is not None
        status = engine.model_status(model_id)
        model = self.service.models.get(model_id)
        times = [m.last_request for m in self.service.models.values() if m.engine_model_id == model_id]
        return ModelRecord(
            model_dir=status.model_dir,
            base_model=engine.config.base_model,
            owner=model.session_id if model is not None else HOST_OWNER,
            lora_rank=status.lora.rank,
            last_request=max(times, default=status.created_at),
            created_at=status.created_at,
            user_metadata=status.user_metadata,
        )

    def _all_models(self) -> list[str]:
        """Every model the server knows, on an engine or in the models root, newest first."""
        created = {
            model_id: engine.model_status(model_id).created_at
            for model_id, engine in self.service.live_models().items()
        }
        for model_id in model_folders({}):
            stored = None if model_id in created else self._stored_model(model_id)
            if stored is not None:
                created[model_id] = stored.created_at
        return sorted(created, key=created.__getitem__, reverse=True)

    def _model_checkpoints(self, model_id: str) -> list[CheckpointInfo]:
        engine = self.service.engine_of_model(model_id)
        if engine is not None:
            return engine.list_checkpoints(model_id)
        stored = self._stored_model(model_id)
        return [] if stored is None else checkpoint_store.list_checkpoints(stored.model_dir)

    def _base_model_of(self, model_id: str) -> str | None:
        engine = self.service.engine_of_model(model_id)
        if engine is not None:
            return engine.config.base_model
        stored = self._stored_model(model_id)
        return None if stored is None else stored.base_model

    # ------------------------------------------------------------------------------------------ listings

    def checkpoint_json(self, model_id: str, info: CheckpointInfo) -> dict[str, Any]:
        """A checkpoint as Tinker's `Checkpoint` has it."""
        address = CheckpointAddress(model_id, info.kind, info.name)
        return {
            "checkpoint_id": address.checkpoint_id,
            "checkpoint_type": CHECKPOINT_TYPES[info.kind],
            "base_model": self._base_model_of(model_id),  # SDK 0.39 reads it; 0.38 ignores it
            "time": _iso(info.time),
            "tinker_path": address.tinker_path,
            "size_bytes": info.size_bytes,
            "public": False,
            "user_metadata": dict(info.user_metadata or {}),
            "expires_at": _iso(info.expires_at),
        }

    def training_run(self, training_run_id: str) -> dict[str, Any]:
        """A model as Tinker's `TrainingRun` has it; 404 for one the server does not know."""
        model_id = self._known_model(training_run_id)
        engine = self.service.engine_of_model(model_id)
        record = self._live_record(model_id) if engine is not None else self._stored_model(model_id)
        if record is None:
            raise RequestError(f"no training run {training_run_id!r} on this server", 404)
        checkpoints = self._model_checkpoints(model_id)
        last = {kind: [c for c in checkpoints if c.kind == kind] for kind in ("state", "sampler")}
        return {
            "training_run_id": model_id,
            "base_model": engine.config.base_model if engine is not None else record.base_model,
            "model_owner": record.owner,
            "is_lora": True,
            "corrupted": False,
            "lora_rank": record.lora_rank,
            "last_request_time": _iso(record.last_request),
            "last_checkpoint": self.checkpoint_json(model_id, last["state"][-1]) if last["state"] else None,
            "last_sampler_checkpoint": (
                self.checkpoint_json(model_id, last["sampler"][-1]) if last["sampler"] else None
            ),
            "user_metadata": dict(record.user_metadata),
        }

    def _listed_model(self, model_id: str) -> dict[str, Any] | None:
        """A model as a listing shows it, or None (with a warning in the log) when it cannot be read: one
        model's bad files must not break the listing for everyone."""
        try:
            return self.training_run(model_id)
        except (OSError, ValueError, KeyError, TypeError, OverflowError) as error:
            log.warning("listing leaves out model %s: %s", model_id, error)
            return None

    def training_runs(self, limit: int, offset: int) -> dict[str, Any]:
        """A page of the models the server knows, newest first."""
        model_ids = self._all_models()
        listed = [self._listed_model(model_id) for model_id in model_ids[offset : offset + limit]]
        return {
            "training_runs": [model for model in listed if model is not None],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(model_ids)},
        }

    def checkpoints(self, training_run_id: str) -> dict[str, Any]:
        """A model's checkpoints, oldest first."""
        model_id = self._known_model(training_run_id)
        return {"checkpoints": [self.checkpoint_json(model_id, c) for c in self._model_checkpoints(model_id)]}

    def user_checkpoints(self, limit: int, offset: int) -> dict[str, Any]:
        """A page of every model's checkpoints, newest first."""
        every = [(model_id, c) for model_id in self._all_models() for c in self._model_checkpoints(model_id)]
        every.sort(key=lambda item: item[1].time, reverse=True)
        return {
            "checkpoints": [
                self.checkpoint_json(model_id, c) for model_id, c in every[offset : offset + limit]
            ],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(every)},
        }

    # ------------------------------------------------------------------------------------------ one checkpoint

    def checkpoint_address(self, training_run_id: str, checkpoint_id: str) -> CheckpointAddress:
        """The checkpoint `<weights|sampler_weights>/<name>` of a known model, checked (a name that could
        leave the model's folder is refused)."""
        model_id = self._known_model(training_run_id)
        try:
            return CheckpointAddress.parse(f"tinker://{model_id}/{checkpoint_id}")
        except CheckpointError as error:
            raise RequestError(str(error)) from None

    def checkpoint_folder(self, address: CheckpointAddress) -> Path:
        """The folder of an existing checkpoint; 404 when there is none."""
        engine = self.service.engine_of_model(address.model_id)
        known = None if engine is not None else self._stored_model(address.model_id)
        try:
            if known is not None:
                return checkpoint_store.require_checkpoint_folder(
                    checkpoint_store.kind_dir(known.model_dir, address.kind) / address.name
                )
            return (engine or self.service.engine).checkpoint_folder(address.tinker_path, address.kind)
        except CheckpointError as error:
            raise RequestError(str(error), 404) from None

    def external_files(self, address: CheckpointAddress) -> tuple[Path, list[str]]:
        """An external weights checkpoint's folder and the files a client downloads from it."""
        if address.kind != "external":
            raise RequestError(
                f"{address.tinker_path} is not external weights: only tinker://<run>/external_weights/<name> "
                "checkpoints (save_weights_external) are downloaded file by file"
            )
        folder = self.checkpoint_folder(address)
        return folder, external_weights.downloadable_files(folder)

    def _made_by_a_client(self, model_id: str) -> bool:
        """Whether a client session made the model (over HTTP), rather than this server's own session."""
        return model_id in self.service.models or model_id in self.service.client_models

    async def delete_checkpoint(self, training_run_id: str, checkpoint_id: str) -> None:
        """Delete a checkpoint of a model a client session made. Every client holds the same key (one
        account, as a Tinker API key is), so any of them may delete what any client session made; the
        checkpoints of the serving session's own models are read-only over HTTP (the notebook deletes
        them with `Session.delete_checkpoint`)."""
        address = self.checkpoint_address(training_run_id, checkpoint_id)
        self.checkpoint_folder(address)
        if not self._made_by_a_client(address.model_id):
            raise RequestError(
                f"{address.tinker_path} belongs to a run made by this server's own session, not by a "
                "client: its checkpoints cannot be deleted over HTTP",
                403,
            )
        engine = self.service.engine_of_model(address.model_id)
        if engine is None:  # no operation of the model is left to race
            stored = self._stored_model(address.model_id)
            if stored is not None:
                checkpoint_store.delete(stored.model_dir, address.name, address.kind)
            return
        removal = engine.delete_checkpoint(address.model_id, address.name, address.kind)
        await asyncio.wrap_future(removal.future())

    async def weights_info(self, request: schemas.WeightsInfoRequest) -> dict[str, Any]:
        """What a checkpoint's weights are (base model, adapter rank and targets); 404 when unreadable."""
        try:
            address = CheckpointAddress.parse(request.tinker_path)
            engine = self.service.engine_of_model(address.model_id) or self.service.engine
            if address.kind == "state":
                saved = await asyncio.to_thread(engine.read_state, request.tinker_path)
                lora: LoraConfig = saved.session_arguments["lora"]
                return {
                    "base_model": saved.session_arguments["base_model"],
                    "is_lora": True,
                    "lora_rank": lora.rank,
                    "train_unembed": lora.train_unembed,
                    "train_mlp": lora.train_mlp,
                    "train_attn": lora.train_attn,
                }
            folder = engine.checkpoint_folder(request.tinker_path, "sampler")
            adapter = json.loads((folder / "adapter_config.json").read_text())
            base_model = self.service.saved_base_model(request.tinker_path)
        except (CheckpointError, ValueError, OSError) as error:
            raise RequestError(f"weights_info: {message_of(error)}", 404) from None
        return {"base_model": base_model, "is_lora": True, "lora_rank": adapter.get("r")}
