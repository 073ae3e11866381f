"""The Tinker service: what each endpoint does, on the engine, between the HTTP layer and the model.

Everything here runs on the server's event loop thread (the HTTP layer calls in; engine futures
resolve back through `FutureTable`), so the tables need no locks. The engine is driven only through
its public methods, the same op path the in-process clients use: an operation is validated in this
thread when it is handed over (bad input fails its future with category "user" and changes nothing),
then runs on the engine's worker in the order it was handed over, which `Sequencer` makes the
`seq_id` order of each model.

Models: a client's `create_model` adds a run to the engine (a LoRA policy sharing the base, up to the
engine's `max_models`), under the id the SDK itself derives for `create_training_client_from_state`,
`"<session id>:train:<model_seq_id>"`. With SkyRL's `model_role: "critic"` it becomes the critic of the
session's latest policy run instead. A sampling session pins weights on the engine: the base model, a
sampler checkpoint, or (`save_weights_and_get_sampling_client`) a model's current weights; a model
keeps its `EPHEMERAL_SAMPLERS_KEPT` newest ephemeral samplers and releases older ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from workbench.engine.interface import Restore
from workbench.engine.local.engine import Engine
from workbench.engine.model.base_model import resolve_model_path
from workbench.engine.roles import Role
from workbench.engine.samplers.requests import check_num_samples
from workbench.futures import APIFuture
from workbench.losses import LOSSES
from workbench.server import schemas, wire
from workbench.server.config import ServerConfig
from workbench.server.errors import RequestError, message_of
from workbench.server.future_table import FutureTable, PendingResult
from workbench.server.ordering import Sequencer, digest_of
from workbench.server.sessions import ClientSession, ServedModel, ServedSampler, SessionTable
from workbench.server.wire import ForwardBackwardCall
from workbench.storage import checkpoint_store
from workbench.storage.checkpoint_store import CheckpointError, CheckpointInfo
from workbench.storage.model_folders import (
    TINKER_SCHEME,
    CheckpointAddress,
    check_model_id,
    model_folders,
    read_model_info,
    runs_root,
)
from workbench.types import ForwardBackwardOutput, LoraConfig, SampleResponse, SamplingParams, check_text

RELEASED_SAMPLERS_KEPT = 10_000
"""Released sampler ids remembered (for a clearer error than 'no such sampler')."""

CLIENT_RUNS_KEPT = 10_000
"""Runs remembered as made by a client (their checkpoints stay deletable over HTTP); older ones count as
the host's, so the table has a bound however many sessions come and go."""

HOST_OWNER = "workbench"
"""The owner the training-run endpoints give the serving session's own runs (and runs found on disk)."""

EPHEMERAL_SAMPLERS_KEPT = 4
"""Ephemeral samplers (`save_weights_and_get_sampling_client`) a model keeps; older ones are released,
so a loop that makes one per step holds a bounded number of weight snapshots."""

log = logging.getLogger("workbench.server")


@dataclasses.dataclass(frozen=True)
class SampleResult:
    """A finished sample request: the response and the ids the client was promised for its sequences."""

    response: SampleResponse
    sequence_ids: list[str]
    target_layout: wire.SparseLayout | None = None  # a sparse target_prompt_logprobs request's layout


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """A run as the training-run endpoints describe it (kept for runs whose session ended)."""

    model_dir: Path
    owner: str  # the client session that made it ("workbench": the serving session's own)
    lora_rank: int
    last_request: float
    created_at: float
    user_metadata: dict[str, str]


def _iso(seconds: float | None) -> str | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, UTC).isoformat()


def _string_metadata(metadata: dict[str, Any] | None, where: str) -> dict[str, str] | None:
    if metadata is None:
        return None
    bad = [key for key, value in metadata.items() if not isinstance(value, str)]
    if bad:
        raise RequestError(f"{where}.user_metadata values must be strings; {bad} are not")
    return dict(metadata)


def _checkpoint_path(path: str, where: str) -> str:
    """A checkpoint a client names: by its `tinker://` path only. A folder of this machine (absolute,
    relative or `~`) is an in-process convenience; over HTTP it would let a client read any folder the
    server can, and learn where things are."""
    if not path.startswith(TINKER_SCHEME):
        raise RequestError(
            f"{where}: name a checkpoint by its tinker:// path (as save_state and "
            "save_weights_for_sampler return it); this server does not load folders for remote clients"
        )
    return path


def _check_optimizer(config: schemas.OptimizerConfigBody | None, where: str) -> None:
    if config is not None and config.type != "adamw":
        raise RequestError(
            f"{where}: optimizer {config.type!r} is not available here; this server trains with AdamW"
        )


class TinkerService:
    """The server's state and the work of every endpoint.

    Args:
        engine: The engine every operation runs on.
        config: The server's settings.
        loop: The server's event loop (engine futures are resolved onto it).
    """

    def __init__(self, engine: Engine, config: ServerConfig, loop: asyncio.AbstractEventLoop):
        self.engine = engine
        self.config = config
        self.futures = FutureTable(loop)
        self.futures.on_finish = self._log_finished
        self.sequencer = Sequencer()
        self.sessions = SessionTable(engine.config.base_model)
        self.models: dict[str, ServedModel] = {}
        self.samplers: dict[str, ServedSampler] = {}
        self.released_samplers: dict[str, None] = {}  # newest last, at most RELEASED_SAMPLERS_KEPT
        # run id -> the client session that made it, newest last (at most CLIENT_RUNS_KEPT): what a client
        # may delete over HTTP. The runs themselves are described from their folders once off the engine.
        self.client_runs: dict[str, str] = {}
        self._creations: dict[str, tuple[str, PendingResult]] = {}  # model id -> (request digest, entry)

    # ------------------------------------------------------------------------------------------ identity

    @property
    def base_model(self) -> str:
        return self.engine.config.base_model

    @property
    def model_name(self) -> str:
        """The base model as clients name it for a tokenizer: the folder (or hub id) it was loaded from."""
        return self.engine.base_info.path

    def check_base_model(self, name: str, where: str) -> None:
        """A request names this server's base model: its alias, its folder, or its hub id."""
        served = {self.base_model, self.model_name}
        if name in served or resolve_model_path(name) in served:
            return
        raise RequestError(f"{where}: this server serves {self.base_model!r}, not {name!r}")

    def client_message(self, text: str) -> str:
        """An error message as a client may read it: a checkpoint's folder named by its tinker:// path,
        a run's folder by its run, and the runs root, the base model's folder and the home folder by what
        they are, so that no answer tells a client where things are on this machine."""
        runs = {run_id: self.engine.model_status(run_id).model_dir for run_id in self.engine.model_ids()}
        root = str(runs_root())
        for kind, segment in (("state", "weights"), ("sampler", "sampler_weights")):
            folder = (
                re.escape(root)
                + r"/([A-Za-z0-9][A-Za-z0-9._:-]*)/"
                + checkpoint_store.kind_dir(Path(), kind).name
            )
            text = re.sub(folder + r"/([A-Za-z0-9._-]+)", rf"tinker://\1/{segment}/\2", text)
        text = re.sub(re.escape(root) + r"/([A-Za-z0-9][A-Za-z0-9._:-]*)", r"tinker://\1", text)
        for run_id, model_dir in sorted(runs.items(), key=lambda item: -len(str(item[1]))):
            for kind, segment in (("state", "weights"), ("sampler", "sampler_weights")):
                folder = re.escape(str(checkpoint_store.kind_dir(model_dir, kind)))
                text = re.sub(
                    folder + r"/([A-Za-z0-9._-]+)",
                    lambda found, segment=segment, run_id=run_id: f"tinker://{run_id}/{segment}/{found[1]}",
                    text,
                )
            text = text.replace(str(model_dir), f"tinker://{run_id}")
        for folder, name in (
            (str(runs_root()), "<runs folder>"),
            (self.model_name, self.base_model),
            (str(Path.home()), "~"),
        ):
            text = text.replace(folder, name)
        return text

    def client_config(self) -> dict[str, Any]:
        return {"pjwt_auth_enabled": False, "proto_compress_fwdbwd": self.config.compress_requests}

    def capabilities(self) -> dict[str, Any]:
        return {
            "supported_models": [
                {
                    "model_name": self.base_model,
                    "max_context_length": self.engine.base_info.max_length,
                    "trainable": True,
                    "sampleable": True,
                }
            ],
            # beyond the SDK's fields (its response model keeps extras): the losses forward_backward takes
            "supported_loss_fns": sorted(LOSSES),
        }

    # ------------------------------------------------------------------------------------------ sessions

    def create_session(self, request: schemas.CreateSessionRequest) -> dict[str, Any]:
        session = self.sessions.create(request.sdk_version, request.user_metadata or {}, request.tags)
        log.info("session %s opened (SDK %s)", session.session_id, request.sdk_version or "?")
        return {"type": "create_session", "session_id": session.session_id}

    def heartbeat(self, request: schemas.SessionHeartbeatRequest) -> dict[str, Any]:
        self.sessions.heartbeat(request.session_id)
        return {"type": "session_heartbeat"}

    def end_session(self, session: ClientSession, why: str) -> list[APIFuture[None]]:
        """Free what a session created: its samplers' pins, its critics, then its runs. Returns the
        engine's removals (they run after the operations already queued)."""
        if session.ended is not None:
            return []
        self.sessions.end(session, why)
        for sampler_id in session.samplers:
            self._release_sampler(sampler_id)
        served = [self.models.pop(model_id) for model_id in session.models if model_id in self.models]
        for model in served:
            for start in self.sequencer.forget(model.model_id):
                start()
        for model_id in [m for m in self._creations if m.startswith(f"{session.session_id}:")]:
            del self._creations[model_id]
        policy_runs = {m.run_id for m in served if m.role is Role.POLICY}
        removals = [
            self.engine.delete_critic(m.run_id)
            for m in served
            if m.role is Role.CRITIC and m.run_id not in policy_runs
        ]
        removals += [self.engine.delete_model(m.run_id) for m in served if m.role is Role.POLICY]
        log.info("session %s ended (%s): freeing %d model(s)", session.session_id, why, len(served))
        return removals

    async def finish_session(self, session_id: str, request: schemas.FinishSessionRequest) -> None:
        """The SDK's `ServiceClient.close()`: the session ends; returns once its models are freed. A
        session that already ended (it expired) has nothing left to free."""
        session = self.sessions.find(session_id)
        reason = (request.reason or {}).get("type", "finished")
        for removal in self.end_session(session, f"finished: {reason}"):
            with contextlib.suppress(ValueError):  # gone already (a critic with its run)
                await asyncio.wrap_future(removal.future())

    def expire_silent_sessions(self) -> None:
        """End sessions that stopped heartbeating, and forget those that ended a while ago."""
        for session in self.sessions.silent_for(self.config.session_timeout_s):
            self.end_session(session, f"expired: no heartbeat for {self.config.session_timeout_s:g} s")
        self.sessions.forget_ended()

    # ------------------------------------------------------------------------------------------ models

    def served(self, model_id: str) -> ServedModel:
        model = self.models.get(model_id)
        if model is None:
            raise ValueError(f"no model {model_id!r} on this server (its session may have ended)")
        model.last_request = time.time()
        return model

    def create_model(self, request: schemas.CreateModelRequest, payload: bytes) -> dict[str, Any]:
        session = self.sessions.get(request.session_id)
        model_id = f"{session.session_id}:train:{request.model_seq_id}"
        earlier = self._creations.get(model_id)
        if earlier is not None:
            if earlier[0] != digest_of(payload):
                raise RequestError(
                    f"model_seq_id {request.model_seq_id} was already used by another request", 409
                )
            return {"request_id": earlier[1].request_id, "model_id": model_id}
        self.check_base_model(request.base_model, "create_model")
        _check_optimizer(request.optimizer_config, "create_model")
        metadata = _string_metadata(request.user_metadata, "create_model")
        body = request.lora_config or schemas.LoraConfigBody()
        entry = self.futures.add("create_model", model_id)
        self._creations[model_id] = (digest_of(payload), entry)
        try:
            if request.model_role == "critic":
                run_id = self._critic_run(session)
                critic = LoraConfig(
                    rank=body.rank,
                    seed=body.seed,
                    train_unembed=False,
                    train_mlp=body.train_mlp,
                    train_attn=body.train_attn,
                )
                future: APIFuture[Any] = self.engine.create_critic(run_id, critic)
                role = Role.CRITIC
            else:
                lora = LoraConfig(**body.model_dump())
                future = self.engine.create_model(
                    lora, seed=self.engine.config.seed, model_id=model_id, user_metadata=metadata
                )
                run_id, role = model_id, Role.POLICY
        except (ValueError, TypeError) as error:
            self.futures.fail(entry, error)
            return {"request_id": entry.request_id, "model_id": model_id}

        def created(_: Any) -> dict[str, Any]:
            self._register(ServedModel(model_id, run_id, role, session.session_id), session)
            return {"type": "create_model", "model_id": model_id}

        self.futures.resolve_with(entry, future.future(), created)
        return {"request_id": entry.request_id, "model_id": model_id}

    def _critic_run(self, session: ClientSession) -> str:
        policies = [m for m in session.models if m in self.models and self.models[m].role is Role.POLICY]
        if not policies:
            raise ValueError(
                "a critic (model_role 'critic') shares a policy's run: create the policy with "
                "create_lora_training_client in this session first"
            )
        return self.models[policies[-1]].run_id

    def _register(self, model: ServedModel, session: ClientSession) -> None:
        if session.ended is not None:  # the session ended while the model was being made
            (self.engine.delete_critic if model.role is Role.CRITIC else self.engine.delete_model)(
                model.run_id
            )
            return
        self.models[model.model_id] = model
        session.models.append(model.model_id)
        if model.role is Role.POLICY:
            self.client_runs[model.run_id] = session.session_id
            for old in list(self.client_runs)[:-CLIENT_RUNS_KEPT]:
                del self.client_runs[old]

    def get_info(self, request: schemas.GetInfoRequest) -> dict[str, Any]:
        try:
            model = self.served(request.model_id)
        except ValueError as error:
            raise RequestError(str(error), 404) from None
        status = self.engine.model_status(model.run_id)
        lora = status.critic_lora if model.role is Role.CRITIC else status.lora
        return {
            "type": "get_info",
            "model_id": model.model_id,
            "model_data": {
                "arch": self.engine.base_info.model_type,
                "model_name": self.model_name,
                "tokenizer_id": self.model_name,
            },
            "is_lora": True,
            "lora_rank": None if lora is None else lora.rank,
            "model_name": self.model_name,
        }

    # ------------------------------------------------------------------------------------------ ordered ops

    def _ordered(
        self,
        op: str,
        model_id: str,
        seq_id: int,
        payload: bytes,
        submit: Callable[[ServedModel], tuple[APIFuture[Any], Callable[[Any], Any]]],
    ) -> dict[str, Any]:
        """Take a model's request: it is handed to the engine after every lower seq_id. A request for a
        model that is not (or no longer) served is refused: no seq_id of it will ever come again."""
        if model_id not in self.models:
            raise RequestError(f"no model {model_id!r} on this server (its session may have ended)", 404)

        def start(entry: PendingResult) -> None:
            try:
                future, convert = submit(self.served(model_id))
            except BaseException as error:  # bad input: the operation fails, nothing changed
                self.futures.fail(entry, error)
                return
            self.futures.resolve_with(entry, future.future(), convert)

        request_id = self.sequencer.take(
            model_id, seq_id, payload, lambda: self.futures.add(op, model_id), start
        )
        return {"request_id": request_id, "model_id": model_id}

    def refused(self, payload: bytes, error: BaseException) -> None:
        """A request to a model's ordered endpoint was refused before its seq_id was taken (its body too
        large, not valid, a field wrong): the SDK counted that seq_id, so it is taken here by an operation
        that fails with the same error, and the model's later requests run rather than wait for it."""
        named = wire.envelope(payload)
        if named is None or named[0] not in self.models:
            return
        model_id, seq_id = named
        self.sequencer.consume(
            model_id,
            seq_id,
            payload,
            lambda: self.futures.add("refused", model_id),
            lambda entry: self.futures.fail(entry, error),
        )

    def forward_backward(self, call: ForwardBackwardCall, payload: bytes) -> dict[str, Any]:
        def submit(model: ServedModel) -> tuple[APIFuture[ForwardBackwardOutput], Callable[[Any], Any]]:
            run = self.engine.forward if call.forward_only else self.engine.forward_backward
            return run(model.run_id, model.role, call.data(), call.loss_fn, call.loss_fn_config()), _same

        op = "forward" if call.forward_only else "forward_backward"
        return self._ordered(op, call.model_id, call.seq_id, payload, submit)

    def optim_step(self, request: schemas.OptimStepRequest, payload: bytes) -> dict[str, Any]:
        def submit(model: ServedModel) -> tuple[APIFuture[Any], Callable[[Any], Any]]:
            if request.optimizer_params is not None:
                raise ValueError(
                    f"optimizer_params {request.optimizer_params.get('type')!r}: this server trains with AdamW (adam_params)"
                )
            params = (request.adam_params or schemas.AdamParamsBody()).model_dump(exclude={"type"})
            future = self.engine.optim_step(model.run_id, model.role, params)
            return future, lambda response: {"type": "optim_step", "metrics": dict(response.metrics)}

        return self._ordered("optim_step", request.model_id, request.seq_id, payload, submit)

    def save_weights(self, request: schemas.SaveWeightsRequest, payload: bytes) -> dict[str, Any]:
        def submit(model: ServedModel) -> tuple[APIFuture[Any], Callable[[Any], Any]]:
            if request.path is None:
                raise ValueError("save_weights needs a checkpoint name (path)")
            future = self.engine.save_state(
                model.run_id,
                request.path,
                overwrite=request.overwrite,
                ttl_seconds=request.ttl_seconds,
                user_metadata=request.user_metadata,
            )
            return future, lambda response: {"type": "save_weights", "path": response.path}

        return self._ordered("save_weights", request.model_id, request.seq_id, payload, submit)

    def save_weights_for_sampler(
        self, request: schemas.SaveWeightsForSamplerRequest, payload: bytes
    ) -> dict[str, Any]:
        def submit(model: ServedModel) -> tuple[APIFuture[Any], Callable[[Any], Any]]:
            if model.role is not Role.POLICY:
                raise ValueError(f"{model.model_id} is a critic: only a policy has weights to sample")
            if request.kind != "snapshot":
                raise ValueError(
                    f"sampling client kind {request.kind!r} is not available here; use 'snapshot'"
                )
            if request.path is not None:
                future = self.engine.save_weights_for_sampler(
                    model.run_id,
                    request.path,
                    ttl_seconds=request.ttl_seconds,
                    user_metadata=request.user_metadata,
                )
                return future, lambda response: {"type": "save_weights_for_sampler", "path": response.path}
            if request.sampling_session_seq_id is None:
                raise ValueError("save_weights_for_sampler needs a name (path) or a sampling_session_seq_id")
            sampler_id = f"{model.session_id}:sample:{request.sampling_session_seq_id}"
            pin = self.engine.pin_sampler(model.run_id)
            self._add_sampler(ServedSampler(sampler_id, pin, model.session_id, None, model.model_id))
            return pin, lambda _: {
                "type": "save_weights_for_sampler",
                "path": None,
                "sampling_session_id": sampler_id,
            }

        return self._ordered("save_weights_for_sampler", request.model_id, request.seq_id, payload, submit)

    def load_weights(self, request: schemas.LoadWeightsRequest, payload: bytes) -> dict[str, Any]:
        restore = Restore.WITH_OPTIMIZER if request.optimizer else Restore.WEIGHTS
        _checkpoint_path(request.path, "load_weights.path")
        if request.weights_access_token is not None:
            raise RequestError("weights_access_token: this server has no other accounts to read weights from")
        if request.model_id is None:
            return self._create_from_state(request, restore, payload)
        if request.seq_id is None:
            raise RequestError("load_weights into a model needs its seq_id")

        def submit(model: ServedModel) -> tuple[APIFuture[Any], Callable[[Any], Any]]:
            future = self.engine.load_state(model.run_id, request.path, restore)
            return future, lambda response: {"type": "load_weights", "path": response.path}

        return self._ordered("load_weights", request.model_id, request.seq_id, payload, submit)

    def _create_from_state(
        self, request: schemas.LoadWeightsRequest, restore: Restore, payload: bytes
    ) -> dict[str, Any]:
        """SDK 0.38's `create_training_client_from_state*`: a new model built from a state checkpoint."""
        if request.session_id is None or request.model_seq_id is None:
            raise RequestError(
                "load_weights needs model_id + seq_id, or session_id + model_seq_id to create a model"
            )
        session = self.sessions.get(request.session_id)
        model_id = f"{session.session_id}:train:{request.model_seq_id}"
        earlier = self._creations.get(model_id)
        if earlier is not None:
            if earlier[0] != digest_of(payload):
                raise RequestError(
                    f"model_seq_id {request.model_seq_id} was already used by another request", 409
                )
            return {"request_id": earlier[1].request_id, "model_id": model_id}
        if request.base_model is not None:
            self.check_base_model(request.base_model, "load_weights")
        _check_optimizer(request.optimizer_config, "load_weights")
        metadata = _string_metadata(request.user_metadata, "load_weights")
        entry = self.futures.add("load_weights", model_id)
        self._creations[model_id] = (digest_of(payload), entry)
        try:
            future = self.engine.create_model_from_state(
                request.path, restore=restore, model_id=model_id, user_metadata=metadata
            )
        except (ValueError, TypeError) as error:
            self.futures.fail(entry, error)
            return {"request_id": entry.request_id, "model_id": model_id}

        def created(_: Any) -> dict[str, Any]:
            self._register(ServedModel(model_id, model_id, Role.POLICY, session.session_id), session)
            return {"type": "load_weights", "path": request.path, "model_id": model_id}

        self.futures.resolve_with(entry, future.future(), created)
        return {"request_id": entry.request_id, "model_id": model_id}

    # ------------------------------------------------------------------------------------------ sampling

    def _add_sampler(self, sampler: ServedSampler) -> None:
        session = self.sessions.get(sampler.session_id)
        self.samplers[sampler.sampler_id] = sampler
        session.samplers.append(sampler.sampler_id)
        if sampler.model_id is not None:
            ephemeral = [
                s
                for s in session.samplers
                if s in self.samplers and self.samplers[s].model_id == sampler.model_id
            ]
            for old in ephemeral[:-EPHEMERAL_SAMPLERS_KEPT]:
                self._release_sampler(old)

    def _release_sampler(self, sampler_id: str) -> None:
        sampler = self.samplers.pop(sampler_id, None)
        self.sequencer.forget(sampler_id)
        if sampler is not None:
            self.released_samplers[sampler_id] = None
            for old in list(self.released_samplers)[:-RELEASED_SAMPLERS_KEPT]:
                del self.released_samplers[old]
            with contextlib.suppress(RequestError):  # its session is already forgotten
                owner = self.sessions.find(sampler.session_id)
                if owner.ended is None and sampler_id in owner.samplers:
                    owner.samplers.remove(sampler_id)  # a live session lists the samplers still pinned
            self.engine.release_sampler(sampler.pin)

    def sampler(self, sampler_id: str) -> ServedSampler:
        sampler = self.samplers.get(sampler_id)
        if sampler is not None:
            return sampler
        if sampler_id in self.released_samplers:
            raise ValueError(
                f"sampler {sampler_id!r} was released: a model keeps its {EPHEMERAL_SAMPLERS_KEPT} newest "
                "samplers from save_weights_and_get_sampling_client (or its session ended)"
            )
        raise ValueError(f"no sampler {sampler_id!r} on this server")

    async def create_sampling_session(self, request: schemas.CreateSamplingSessionRequest) -> dict[str, Any]:
        session = self.sessions.get(request.session_id)
        sampler_id = f"{session.session_id}:sample:{request.sampling_session_seq_id}"
        if sampler_id not in self.samplers:
            if request.base_model is not None:
                self.check_base_model(request.base_model, "create_sampling_session")
            if request.model_path is not None:
                _checkpoint_path(request.model_path, "create_sampling_session.model_path")
            try:
                pin = (
                    self.engine.pin_sampler(None)
                    if request.model_path is None
                    else self.engine.pin_sampler_checkpoint(request.model_path)
                )
                await asyncio.wrap_future(pin.future())
            except (ValueError, TypeError) as error:
                raise RequestError(f"create_sampling_session: {message_of(error)}") from None
            self._add_sampler(ServedSampler(sampler_id, pin, session.session_id, request.model_path, None))
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    def get_sampler(self, sampler_id: str) -> dict[str, Any]:
        try:
            sampler = self.sampler(sampler_id)
        except ValueError as error:
            raise RequestError(str(error), 404) from None
        return {"sampler_id": sampler_id, "base_model": self.model_name, "model_path": sampler.model_path}

    def asample(self, request: schemas.SampleRequest, payload: bytes) -> dict[str, Any]:
        if request.sampling_session_id is None:
            raise RequestError("asample needs a sampling_session_id (create_sampling_session)")
        if request.seq_id is None:
            raise RequestError("asample needs a seq_id")

        def start(entry: PendingResult) -> None:
            layout: wire.SparseLayout | None = None
            try:
                target_ids = None
                if request.target_prompt_logprobs is not None:
                    target_ids, layout = wire.target_ids(request.target_prompt_logprobs)
                sampler = self.sampler(request.sampling_session_id or "")
                params = SamplingParams(**request.sampling_params.model_dump())
                check_num_samples(request.num_samples, self.engine.config.max_samples_per_request)
                ids = _sequence_ids(entry.request_id, request.num_samples)
                future = self.engine.sample(
                    sampler.pin,
                    request.prompt.text_tokens(),
                    request.num_samples,
                    params,
                    bool(request.prompt_logprobs),
                    prompt_logprobs_last_n=request.prompt_logprobs_last_n,
                    record_stability_info=bool(request.record_stability_info),
                    sequence_ids=ids,
                    topk_prompt_logprobs=request.topk_prompt_logprobs,
                    topk_sample_logprobs=request.topk_sample_logprobs,
                    target_prompt_logprobs=target_ids,
                    prompt_alt_tokens_k=request.prompt_alt_tokens_k,
                )
            except BaseException as error:
                self.futures.fail(entry, error)
                return
            self.futures.resolve_with(
                entry, future.future(), lambda response: SampleResult(response, ids, layout)
            )

        request_id = self.sequencer.take(
            request.sampling_session_id,
            request.seq_id,
            payload,
            lambda: self.futures.add("sample", request.sampling_session_id),
            start,
            ordered=False,
        )
        counted = 1 <= request.num_samples <= self.engine.config.max_samples_per_request
        return {
            "request_id": request_id,
            # a count out of range fails the request (above); no ids are made for it
            "sample_sequence_ids": _sequence_ids(request_id, request.num_samples) if counted else [],
        }

    # ------------------------------------------------------------------------------------------ runs and checkpoints

    def _live_run(self, training_run_id: str) -> str | None:
        """The engine run a training run id (or a served model id) names, if it is on the engine."""
        model = self.models.get(training_run_id)
        run_id = model.run_id if model is not None else training_run_id
        return run_id if run_id in self.engine.model_ids() else None

    def _stored_run(self, run_id: str) -> RunRecord | None:
        """A run off the engine, described by its folder under the runs root (its run.json): a run whose
        session ended, or one from before this server started. The runs folder is the record, so the
        listings survive a restart and hold nothing in memory per ended run."""
        try:
            model_dir = runs_root() / check_model_id(run_id)
        except ValueError:
            return None  # not a run id: no folder to look at
        try:
            info = read_model_info(model_dir)
            if info is None:
                return None
            metadata = info.get("user_metadata") or {}
            return RunRecord(
                model_dir=model_dir,
                owner=self.client_runs.get(run_id, HOST_OWNER),
                lora_rank=int(info["lora"]["rank"]),
                last_request=float(info["created_at"]),
                created_at=float(info["created_at"]),
                user_metadata={
                    check_text(str(k), "key"): check_text(str(v), "value") for k, v in metadata.items()
                },
            )
        except (CheckpointError, OSError, KeyError, TypeError, ValueError, AttributeError) as error:
            log.warning("model folder %s cannot be described: %s", run_id, error)
            return None

    def _known_run(self, training_run_id: str) -> str:
        """A run on the engine, or one in the runs folder (its files stay); 404 otherwise."""
        run_id = self._live_run(training_run_id)
        if run_id is not None:
            return run_id
        if self._stored_run(training_run_id) is not None:
            return training_run_id
        raise RequestError(f"no training run {training_run_id!r} on this server", 404)

    def _run_checkpoints(self, run_id: str) -> list[CheckpointInfo]:
        if run_id in self.engine.model_ids():
            return self.engine.list_checkpoints(run_id)
        stored = self._stored_run(run_id)
        return [] if stored is None else checkpoint_store.list_checkpoints(stored.model_dir)

    def checkpoint_json(self, run_id: str, info: CheckpointInfo) -> dict[str, Any]:
        address = CheckpointAddress(run_id, info.kind, info.name)
        return {
            "checkpoint_id": address.checkpoint_id,
            "checkpoint_type": "training" if info.kind == "state" else "sampler",
            "time": _iso(info.time),
            "tinker_path": address.tinker_path,
            "size_bytes": info.size_bytes,
            "public": False,
            "user_metadata": dict(info.user_metadata or {}),
            "expires_at": _iso(info.expires_at),
        }

    def _run_record(self, run_id: str, owner: str | None = None) -> RunRecord:
        """What a run on the engine is, as the training-run endpoints describe it; `owner` for a run
        whose model has already left the table (its session ending)."""
        status = self.engine.model_status(run_id)
        model = self.models.get(run_id)
        times = [m.last_request for m in self.models.values() if m.run_id == run_id]
        if owner is None:
            owner = model.session_id if model is not None else HOST_OWNER
        return RunRecord(
            model_dir=status.model_dir,
            owner=owner,
            lora_rank=status.lora.rank,
            last_request=max(times, default=status.created_at),
            created_at=status.created_at,
            user_metadata=status.user_metadata,
        )

    def training_run(self, training_run_id: str) -> dict[str, Any]:
        run_id = self._known_run(training_run_id)
        record = self._run_record(run_id) if run_id in self.engine.model_ids() else self._stored_run(run_id)
        if record is None:
            raise RequestError(f"no training run {training_run_id!r} on this server", 404)
        checkpoints = self._run_checkpoints(run_id)
        last = {kind: [c for c in checkpoints if c.kind == kind] for kind in ("state", "sampler")}
        return {
            "training_run_id": run_id,
            "base_model": self.base_model,
            "model_owner": record.owner,
            "is_lora": True,
            "corrupted": False,
            "lora_rank": record.lora_rank,
            "last_request_time": _iso(record.last_request),
            "last_checkpoint": self.checkpoint_json(run_id, last["state"][-1]) if last["state"] else None,
            "last_sampler_checkpoint": (
                self.checkpoint_json(run_id, last["sampler"][-1]) if last["sampler"] else None
            ),
            "user_metadata": dict(record.user_metadata),
        }

    def _all_runs(self) -> list[str]:
        """Every run the server knows, newest first."""
        live = self.engine.model_ids()
        created = {run_id: self.engine.model_status(run_id).created_at for run_id in live}
        for run_id in model_folders({}):
            stored = None if run_id in created else self._stored_run(run_id)
            if stored is not None:
                created[run_id] = stored.created_at
        return sorted(created, key=created.__getitem__, reverse=True)

    def _listed_run(self, run_id: str) -> dict[str, Any] | None:
        """A run as a listing shows it, or None (with a warning in the log) when it cannot be read: one
        run's bad files must not break the listing for everyone."""
        try:
            return self.training_run(run_id)
        except (OSError, ValueError, KeyError, TypeError, OverflowError) as error:
            log.warning("listing leaves out run %s: %s", run_id, error)
            return None

    def training_runs(self, limit: int, offset: int) -> dict[str, Any]:
        run_ids = self._all_runs()
        listed = [self._listed_run(run_id) for run_id in run_ids[offset : offset + limit]]
        return {
            "training_runs": [run for run in listed if run is not None],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(run_ids)},
        }

    def checkpoints(self, training_run_id: str) -> dict[str, Any]:
        run_id = self._known_run(training_run_id)
        return {"checkpoints": [self.checkpoint_json(run_id, c) for c in self._run_checkpoints(run_id)]}

    def user_checkpoints(self, limit: int, offset: int) -> dict[str, Any]:
        every = [(run_id, c) for run_id in self._all_runs() for c in self._run_checkpoints(run_id)]
        every.sort(key=lambda item: item[1].time, reverse=True)
        return {
            "checkpoints": [self.checkpoint_json(run_id, c) for run_id, c in every[offset : offset + limit]],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(every)},
        }

    def checkpoint_address(self, training_run_id: str, checkpoint_id: str) -> CheckpointAddress:
        """The checkpoint `<weights|sampler_weights>/<name>` of a known run, checked (a name that could
        leave the run's folder is refused)."""
        run_id = self._known_run(training_run_id)
        try:
            return CheckpointAddress.parse(f"tinker://{run_id}/{checkpoint_id}")
        except CheckpointError as error:
            raise RequestError(str(error)) from None

    def checkpoint_folder(self, address: CheckpointAddress) -> Path:
        known = None if address.run_id in self.engine.model_ids() else self._stored_run(address.run_id)
        try:
            if known is not None:
                return checkpoint_store.require_checkpoint_folder(
                    checkpoint_store.kind_dir(known.model_dir, address.kind) / address.name
                )
            return self.engine.checkpoint_folder(address.tinker_path, address.kind)
        except CheckpointError as error:
            raise RequestError(str(error), 404) from None

    def _made_by_a_client(self, run_id: str) -> bool:
        """Whether a client session made the run (over HTTP), rather than this server's own session."""
        return run_id in self.models or run_id in self.client_runs

    async def delete_checkpoint(self, training_run_id: str, checkpoint_id: str) -> None:
        """Delete a checkpoint of a run a client session made. Every client holds the same key (one
        account, as a Tinker API key is), so any of them may delete what any client session made; the
        checkpoints of the serving session's own runs are read-only over HTTP (the notebook deletes
        them with `Session.delete_checkpoint`)."""
        address = self.checkpoint_address(training_run_id, checkpoint_id)
        self.checkpoint_folder(address)
        if not self._made_by_a_client(address.run_id):
            raise RequestError(
                f"{address.tinker_path} belongs to a run made by this server's own session, not by a "
                "client: its checkpoints cannot be deleted over HTTP",
                403,
            )
        if address.run_id not in self.engine.model_ids():  # no operation of the run is left to race
            stored = self._stored_run(address.run_id)
            if stored is not None:
                checkpoint_store.delete(stored.model_dir, address.name, address.kind)
            return
        removal = self.engine.delete_checkpoint(address.run_id, address.name, address.kind)
        await asyncio.wrap_future(removal.future())

    async def weights_info(self, request: schemas.WeightsInfoRequest) -> dict[str, Any]:
        try:
            address = CheckpointAddress.parse(request.tinker_path)
            if address.kind == "state":
                saved = await asyncio.to_thread(self.engine.read_state, request.tinker_path)
                lora: LoraConfig = saved.session_arguments["lora"]
                return {
                    "base_model": saved.session_arguments["base_model"],
                    "is_lora": True,
                    "lora_rank": lora.rank,
                    "train_unembed": lora.train_unembed,
                    "train_mlp": lora.train_mlp,
                    "train_attn": lora.train_attn,
                }
            folder = self.engine.checkpoint_folder(request.tinker_path, "sampler")
            adapter = json.loads((folder / "adapter_config.json").read_text())
        except (CheckpointError, ValueError, OSError) as error:
            raise RequestError(f"weights_info: {message_of(error)}", 404) from None
        return {"base_model": self.base_model, "is_lora": True, "lora_rank": adapter.get("r")}

    # ------------------------------------------------------------------------------------------ log

    def _log_finished(self, entry: PendingResult) -> None:
        seconds = (entry.finished_at or entry.submitted_at) - entry.submitted_at
        if entry.error is not None:
            log.info(
                "%-24s %-40s failed after %.2fs: %s",
                entry.op,
                entry.model_id,
                seconds,
                message_of(entry.error),
            )
            return
        detail = ""
        result = entry.result
        if isinstance(result, ForwardBackwardOutput) and "loss:sum" in result.metrics:
            detail = f"loss:sum={result.metrics['loss:sum']:.4g}"
        elif isinstance(result, SampleResult):
            tokens = sum(len(s.tokens) for s in result.response.sequences)
            detail = f"{len(result.response.sequences)} sequence(s), {tokens} tokens"
        elif isinstance(result, dict):
            detail = str(result.get("path") or result.get("sampling_session_id") or "")
        log.info("%-24s %-40s %.2fs %s", entry.op, entry.model_id, seconds, detail)


def _sequence_ids(request_id: str, num_samples: int) -> list[str]:
    """The ids of a sample request's sequences, known when it is taken (the SDK needs them then), unique
    in the engine (request ids are 96 random bits)."""
    return [f"{request_id}:{i}" for i in range(num_samples)]


def _same(result: Any) -> Any:
    return result
