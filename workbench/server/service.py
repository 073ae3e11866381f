"""The Tinker service: what each endpoint does, on the engine, between the HTTP layer and the model.

Everything here runs on the server's event loop thread (the HTTP layer calls in; engine futures
resolve back through `FutureTable`), so the tables need no locks. The engine is driven only through
its public methods, the same op path the in-process clients use: an operation is validated in this
thread when it is handed over (bad input fails its future with category "user" and changes nothing),
then runs on the engine's worker in the order it was handed over, which `Sequencer` makes the
`seq_id` order of each model.

Base models: every base model the server holds has its engine (`BaseModels`, the one map from a base
model to its engine); a model or sampler records the engine it lives on, so each operation goes to its
base model's worker, in its model's order, and the ordering, limits and hostile-input checks hold per
model as with one base. A request naming a base model not yet loaded loads it, within the memory
budget, when the server allows it (`ServerConfig.allowed_base_models`) or, on a loopback address, when
it loads from this machine alone (a built-in, a model folder, the local HF cache); others are refused,
with the flags that would serve them.

Models: a client's `create_model` adds a model to its base model's engine (a LoRA policy sharing the base, up to the
engine's `max_models`), under the id the SDK itself derives for `create_training_client_from_state`,
`"<session id>:train:<model_seq_id>"`. With SkyRL's `model_role: "critic"` it becomes the critic of the
session's latest policy instead. A sampling session pins weights on the engine: the base model, a
sampler checkpoint, or (`save_weights_and_get_sampling_client`) a model's current weights; a model
keeps its `EPHEMERAL_SAMPLERS_KEPT` newest ephemeral samplers and releases older ones.

The models and checkpoints the REST endpoints list, describe and delete are `ModelListings`'
(`model_listings.py`), over this service's tables and the model folders.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from workbench.engine.interface import Restore
from workbench.engine.local.base_models import BaseModels, MemoryBudgetError
from workbench.engine.local.engine import Engine
from workbench.engine.model.base_model import loads_without_download, resolve_model_path
from workbench.engine.roles import Role
from workbench.futures import APIFuture
from workbench.losses import LOSSES
from workbench.server import schemas, wire
from workbench.server.config import ServerConfig, is_loopback
from workbench.server.errors import RequestError, message_of
from workbench.server.future_table import FutureTable, PendingResult
from workbench.server.ordering import Sequencer, digest_of
from workbench.server.sessions import ClientSession, ServedModel, ServedSampler, SessionTable
from workbench.server.wire import ForwardBackwardCall
from workbench.storage import checkpoint_store
from workbench.storage.checkpoint_store import CheckpointError
from workbench.storage.model_folders import (
    TINKER_SCHEME,
    models_root,
)
from workbench.types import ForwardBackwardOutput, LoraConfig, SampleResponse

RELEASED_SAMPLERS_KEPT = 10_000
"""Released sampler ids remembered (for a clearer error than 'no such sampler')."""

CLIENT_MODELS_KEPT = 10_000
"""Models remembered as made by a client (their checkpoints stay deletable over HTTP); older ones count
as the host's, so the table has a bound however many sessions come and go."""

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
        base_models: The base models served, each on its engine; the first is the serving session's.
        config: The server's settings.
        loop: The server's event loop (engine futures are resolved onto it).
    """

    def __init__(self, base_models: BaseModels, config: ServerConfig, loop: asyncio.AbstractEventLoop):
        self.base_models = base_models
        self.engine = base_models.engines()[0]
        """The first base model's engine (the serving session's): its settings are the server's."""
        self.config = config
        self.futures = FutureTable(loop)
        self.futures.on_finish = self._log_finished
        self.sequencer = Sequencer()
        self.sessions = SessionTable(self.engine.config.base_model)
        self.models: dict[str, ServedModel] = {}
        self.samplers: dict[str, ServedSampler] = {}
        self.released_samplers: dict[str, None] = {}  # newest last, at most RELEASED_SAMPLERS_KEPT
        # engine model id -> the client session that made it, newest last (at most CLIENT_MODELS_KEPT): what
        # a client may delete over HTTP (`ModelListings`). Models off the engines are described from their folders.
        self.client_models: dict[str, str] = {}
        self._creations: dict[str, tuple[str, PendingResult]] = {}  # model id -> (request digest, entry)

    # ------------------------------------------------------------------------------------------ identity

    def engines(self) -> list[Engine]:
        """The engines of the base models loaded now, the serving session's first."""
        return self.base_models.engines()

    def served_names(self) -> list[str]:
        """The base models clients may name: those loaded, then those allowed to load on first use."""
        loaded = [engine.config.base_model for engine in self.engines()]
        return loaded + [name for name in self.config.allowed_base_models if name not in loaded]

    async def engine_for(self, name: str, where: str) -> Engine:
        """The engine of the base model a request names (its alias, its folder or its hub id), loaded
        now (off the event loop) when `loads_on_first_use` says so; refused otherwise, naming what
        would serve it."""
        if not isinstance(name, str) or not name:
            raise RequestError(f"{where}: base_model must be a non-empty string")
        found = self.base_models.find(name)
        if found is None:
            found = next((e for e in self.engines() if name in (e.config.base_model, e.base_info.path)), None)
        if found is not None:
            return found
        if not self.loads_on_first_use(name):
            raise RequestError(f"{where}: {self._not_served(name)}")
        try:
            return await asyncio.to_thread(self.base_models.engine, name)
        except MemoryBudgetError as error:
            raise RequestError(
                f"{where}: {message_of(error)} (`workbench serve --memory-budget`; in a notebook "
                "`wb.Session(..., memory_budget_bytes=...)`)"
            ) from None
        except (ValueError, OSError) as error:
            raise RequestError(f"{where}: {message_of(error)}") from None

    def loads_on_first_use(self, name: str) -> bool:
        """Whether a client naming base model `name` has it loaded: one the server allows
        (`ServerConfig.allowed_base_models`), and on a loopback address any base that loads from this
        machine alone (`loads_without_download`: a built-in, a model folder, the local HF cache), as
        hosted Tinker serves every base it lists. Clients of a server other machines reach load only
        what it allows."""
        allowed = {resolve_model_path(n) for n in self.config.allowed_base_models}
        if name in self.config.allowed_base_models or resolve_model_path(name) in allowed:
            return True
        return is_loopback(self.config.host) and loads_without_download(name)

    def _not_served(self, name: str) -> str:
        """The refusal of a base model that does not load on first use: why, and what would serve it."""
        served = ", ".join(repr(served) for served in self.served_names())
        if is_loopback(self.config.host):
            why = (
                "it is not a built-in, a model folder on this machine nor in its HF cache, and a server "
                "downloads only the base models it was started with"
            )
        else:
            why = f"a server bound to {self.config.host} loads for its clients only the base models it allows"
        return (
            f"this server serves {served}, not {name!r}: {why}. Serve it with `workbench serve "
            f"--base-model {name}` (loaded at start; the first --base-model is the session's) or "
            f"`--allow-base-model {name}` (loaded when a client first names it); from a notebook, load it "
            "into the session first (`sess.service_client().create_sampling_client(base_model=...)`): "
            "`sess.serve()` serves the base models its session holds"
        )

    def engine_of_model(self, model_id: str) -> Engine | None:
        """The engine a model is live on, if any."""
        return next((e for e in self.engines() if model_id in e.model_ids()), None)

    def live_models(self) -> dict[str, Engine]:
        """Every model on an engine, with its engine."""
        return {model_id: engine for engine in self.engines() for model_id in engine.model_ids()}

    def client_message(self, text: str) -> str:
        """An error message as a client may read it: a checkpoint's folder named by its tinker:// path,
        a model's folder by its model id, and the models root, the base model's folder and the home
        folder by what they are, so that no answer tells a client where things are on this machine."""
        folders = {
            model_id: engine.model_status(model_id).model_dir
            for model_id, engine in self.live_models().items()
        }
        root = str(models_root())
        for kind, segment in (("state", "weights"), ("sampler", "sampler_weights")):
            folder = (
                re.escape(root)
                + r"/([A-Za-z0-9][A-Za-z0-9._:-]*)/"
                + checkpoint_store.kind_dir(Path(), kind).name
            )
            text = re.sub(folder + r"/([A-Za-z0-9._-]+)", rf"tinker://\1/{segment}/\2", text)
        text = re.sub(re.escape(root) + r"/([A-Za-z0-9][A-Za-z0-9._:-]*)", r"tinker://\1", text)
        for model_id, model_dir in sorted(folders.items(), key=lambda item: -len(str(item[1]))):
            for kind, segment in (("state", "weights"), ("sampler", "sampler_weights")):
                folder = re.escape(str(checkpoint_store.kind_dir(model_dir, kind)))
                text = re.sub(
                    folder + r"/([A-Za-z0-9._-]+)",
                    lambda found, segment=segment, model_id=model_id: (
                        f"tinker://{model_id}/{segment}/{found[1]}"
                    ),
                    text,
                )
            text = text.replace(str(model_dir), f"tinker://{model_id}")
        base_folders = [(e.base_info.path, e.config.base_model) for e in self.engines()]
        for folder, name in [(str(models_root()), "<runs folder>"), *base_folders, (str(Path.home()), "~")]:
            text = text.replace(folder, name)
        return text

    def client_config(self) -> dict[str, Any]:
        return {"pjwt_auth_enabled": False, "proto_compress_fwdbwd": self.config.compress_requests}

    def capabilities(self) -> dict[str, Any]:
        loaded = {
            engine.config.base_model: {
                "model_name": engine.config.base_model,
                "max_context_length": engine.base_info.max_length,
                "trainable": True,
                "sampleable": True,
                "loaded": True,  # beyond the SDK's fields: in memory now, or loaded on first use
            }
            for engine in self.engines()
        }
        on_first_use = {
            name: {"model_name": name, "trainable": True, "sampleable": True, "loaded": False}
            for name in self.served_names()
            if name not in loaded
        }
        return {
            "supported_models": [*loaded.values(), *on_first_use.values()],
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
        """Free what a session created: its samplers' pins, its critics, then its models. Returns the
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
        policies = {m.engine_model_id for m in served if m.role is Role.POLICY}
        removals = [
            m.engine.delete_critic(m.engine_model_id)
            for m in served
            if m.role is Role.CRITIC and m.engine_model_id not in policies
        ]
        removals += [m.engine.delete_model(m.engine_model_id) for m in served if m.role is Role.POLICY]
        log.info("session %s ended (%s): freeing %d model(s)", session.session_id, why, len(served))
        return removals

    async def finish_session(self, session_id: str, request: schemas.FinishSessionRequest) -> None:
        """The SDK's `ServiceClient.close()`: the session ends; returns once its models are freed. A
        session that already ended (it expired) has nothing left to free."""
        session = self.sessions.find(session_id)
        reason = (request.reason or {}).get("type", "finished")
        for removal in self.end_session(session, f"finished: {reason}"):
            with contextlib.suppress(ValueError):  # gone already (a critic with its policy)
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

    async def create_model(self, request: schemas.CreateModelRequest, payload: bytes) -> dict[str, Any]:
        session = self.sessions.get(request.session_id)
        model_id = f"{session.session_id}:train:{request.model_seq_id}"
        earlier = self._creations.get(model_id)
        if earlier is not None:
            if earlier[0] != digest_of(payload):
                raise RequestError(
                    f"model_seq_id {request.model_seq_id} was already used by another request", 409
                )
            return {"request_id": earlier[1].request_id, "model_id": model_id}
        _check_optimizer(request.optimizer_config, "create_model")
        metadata = _string_metadata(request.user_metadata, "create_model")
        body = request.lora_config or schemas.LoraConfigBody()
        engine = await self.engine_for(request.base_model, "create_model")
        earlier = self._creations.get(model_id)
        if earlier is not None:  # the same request again, answered while the base model loaded
            return {"request_id": earlier[1].request_id, "model_id": model_id}
        entry = self.futures.add("create_model", model_id)
        self._creations[model_id] = (digest_of(payload), entry)
        try:
            if request.model_role == "critic":
                engine_model_id, engine = self._policy_of(session)
                critic = LoraConfig(
                    rank=body.rank,
                    seed=body.seed,
                    train_unembed=False,
                    train_mlp=body.train_mlp,
                    train_attn=body.train_attn,
                )
                future: APIFuture[Any] = engine.create_critic(engine_model_id, critic)
                role = Role.CRITIC
            else:
                lora = LoraConfig(**body.model_dump())
                future = engine.create_model(
                    lora, seed=engine.config.seed, model_id=model_id, user_metadata=metadata
                )
                engine_model_id, role = model_id, Role.POLICY
        except (ValueError, TypeError) as error:
            self.futures.fail(entry, error)
            return {"request_id": entry.request_id, "model_id": model_id}

        def created(_: Any) -> dict[str, Any]:
            self._register(ServedModel(model_id, engine_model_id, role, session.session_id, engine), session)
            return {"type": "create_model", "model_id": model_id}

        self.futures.resolve_with(entry, future.future(), created)
        return {"request_id": entry.request_id, "model_id": model_id}

    def _policy_of(self, session: ClientSession) -> tuple[str, Engine]:
        """The engine model a critic created in `session` joins: the session's latest policy."""
        policies = [m for m in session.models if m in self.models and self.models[m].role is Role.POLICY]
        if not policies:
            raise ValueError(
                "a critic (model_role 'critic') shares a policy's run: create the policy with "
                "create_lora_training_client in this session first"
            )
        policy = self.models[policies[-1]]
        return policy.engine_model_id, policy.engine

    def _register(self, model: ServedModel, session: ClientSession) -> None:
        if session.ended is not None:  # the session ended while the model was being made
            (model.engine.delete_critic if model.role is Role.CRITIC else model.engine.delete_model)(
                model.engine_model_id
            )
            return
        self.models[model.model_id] = model
        session.models.append(model.model_id)
        if model.role is Role.POLICY:
            self.client_models[model.engine_model_id] = session.session_id
            for old in list(self.client_models)[:-CLIENT_MODELS_KEPT]:
                del self.client_models[old]

    def get_info(self, request: schemas.GetInfoRequest) -> dict[str, Any]:
        try:
            model = self.served(request.model_id)
        except ValueError as error:
            raise RequestError(str(error), 404) from None
        status = model.engine.model_status(model.engine_model_id)
        lora = status.critic_lora if model.role is Role.CRITIC else status.lora
        folder = model.engine.base_info.path  # what clients load a tokenizer from
        return {
            "type": "get_info",
            "model_id": model.model_id,
            "model_data": {
                "arch": model.engine.base_info.model_type,
                "model_name": folder,
                "tokenizer_id": folder,
            },
            "is_lora": True,
            "lora_rank": None if lora is None else lora.rank,
            "model_name": folder,
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
            operation = model.engine.forward if call.forward_only else model.engine.forward_backward
            return operation(
                model.engine_model_id, model.role, call.data(), call.loss_fn, call.loss_fn_config()
            ), _same

        op = "forward" if call.forward_only else "forward_backward"
        return self._ordered(op, call.model_id, call.seq_id, payload, submit)

    def optim_step(self, request: schemas.OptimStepRequest, payload: bytes) -> dict[str, Any]:
        def submit(model: ServedModel) -> tuple[APIFuture[Any], Callable[[Any], Any]]:
            if request.optimizer_params is not None:
                raise ValueError(
                    f"optimizer_params {request.optimizer_params.get('type')!r}: this server trains with AdamW (adam_params)"
                )
            params = (request.adam_params or schemas.AdamParamsBody()).model_dump(exclude={"type"})
            future = model.engine.optim_step(model.engine_model_id, model.role, params)
            return future, lambda response: {"type": "optim_step", "metrics": dict(response.metrics)}

        return self._ordered("optim_step", request.model_id, request.seq_id, payload, submit)

    def save_weights(self, request: schemas.SaveWeightsRequest, payload: bytes) -> dict[str, Any]:
        def submit(model: ServedModel) -> tuple[APIFuture[Any], Callable[[Any], Any]]:
            if request.path is None:
                raise ValueError("save_weights needs a checkpoint name (path)")
            future = model.engine.save_state(
                model.engine_model_id,
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
            if request.path is not None:
                future = model.engine.save_weights_for_sampler(
                    model.engine_model_id,
                    request.path,
                    ttl_seconds=request.ttl_seconds,
                    user_metadata=request.user_metadata,
                )
                return future, lambda response: {"type": "save_weights_for_sampler", "path": response.path}
            if request.sampling_session_seq_id is None:
                raise ValueError("save_weights_for_sampler needs a name (path) or a sampling_session_seq_id")
            sampler_id = f"{model.session_id}:sample:{request.sampling_session_seq_id}"
            pin = model.engine.pin_sampler(model.engine_model_id, inflight=request.kind == "inflight")
            self._add_sampler(
                ServedSampler(sampler_id, pin, model.session_id, None, model.model_id, model.engine)
            )
            return pin, lambda _: {
                "type": "save_weights_for_sampler",
                "path": None,
                "sampling_session_id": sampler_id,
            }

        return self._ordered("save_weights_for_sampler", request.model_id, request.seq_id, payload, submit)

    def save_weights_external(
        self, request: schemas.SaveWeightsExternalRequest, payload: bytes
    ) -> dict[str, Any]:
        def submit(model: ServedModel) -> tuple[APIFuture[Any], Callable[[Any], Any]]:
            if model.role is not Role.POLICY:
                raise ValueError(f"{model.model_id} is a critic: only a policy has weights to export")
            future = model.engine.save_weights_external(
                model.engine_model_id,
                request.path,
                ttl_seconds=request.ttl_seconds,
                age_encryption_recipients=request.age_encryption_recipients,
            )
            return future, lambda response: {
                "type": "save_weights_external",
                "path": response.path,
                "size_bytes": sum(f.stat().st_size for f in Path(response.folder).iterdir()),
            }

        return self._ordered("save_weights_external", request.model_id, request.seq_id, payload, submit)

    async def load_weights(self, request: schemas.LoadWeightsRequest, payload: bytes) -> dict[str, Any]:
        restore = Restore.WITH_OPTIMIZER if request.optimizer else Restore.WEIGHTS
        _checkpoint_path(request.path, "load_weights.path")
        if request.weights_access_token is not None:
            raise RequestError("weights_access_token: this server has no other accounts to read weights from")
        if request.model_id is None:
            return await self._create_from_state(request, restore, payload)
        if request.seq_id is None:
            raise RequestError("load_weights into a model needs its seq_id")

        def submit(model: ServedModel) -> tuple[APIFuture[Any], Callable[[Any], Any]]:
            future = model.engine.load_state(model.engine_model_id, request.path, restore)
            return future, lambda response: {"type": "load_weights", "path": response.path}

        return self._ordered("load_weights", request.model_id, request.seq_id, payload, submit)

    async def _create_from_state(
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
        _check_optimizer(request.optimizer_config, "load_weights")
        metadata = _string_metadata(request.user_metadata, "load_weights")
        engine = await self.engine_for_checkpoint(request.path, request.base_model, "load_weights")
        earlier = self._creations.get(model_id)
        if earlier is not None:  # the same request again, answered while the base model loaded
            return {"request_id": earlier[1].request_id, "model_id": model_id}
        entry = self.futures.add("load_weights", model_id)
        self._creations[model_id] = (digest_of(payload), entry)
        try:
            future = engine.create_model_from_state(
                request.path, restore=restore, model_id=model_id, user_metadata=metadata
            )
        except (ValueError, TypeError) as error:
            self.futures.fail(entry, error)
            return {"request_id": entry.request_id, "model_id": model_id}

        def created(_: Any) -> dict[str, Any]:
            self._register(ServedModel(model_id, model_id, Role.POLICY, session.session_id, engine), session)
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
            sampler.engine.release_sampler(sampler.pin)

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
            where = "create_sampling_session"
            if request.model_path is not None:
                _checkpoint_path(request.model_path, "create_sampling_session.model_path")
            if request.model_path is not None:
                engine = await self.engine_for_checkpoint(request.model_path, request.base_model, where)
            elif request.base_model is not None:
                engine = await self.engine_for(request.base_model, where)
            else:
                raise RequestError(f"{where}: give a base_model or a model_path")
            try:
                pin = (
                    engine.pin_sampler(None)
                    if request.model_path is None
                    else engine.pin_sampler_checkpoint(request.model_path)
                )
                await asyncio.wrap_future(pin.future())
            except (ValueError, TypeError) as error:
                raise RequestError(f"{where}: {message_of(error)}") from None
            self._add_sampler(
                ServedSampler(sampler_id, pin, session.session_id, request.model_path, None, engine)
            )
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    def get_sampler(self, sampler_id: str) -> dict[str, Any]:
        try:
            sampler = self.sampler(sampler_id)
        except ValueError as error:
            raise RequestError(str(error), 404) from None
        return {
            "sampler_id": sampler_id,
            "base_model": sampler.engine.base_info.path,
            "model_path": sampler.model_path,
        }

    def asample(self, request: schemas.SampleRequestBody, payload: bytes) -> dict[str, Any]:
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
                asked = request.sample_request(None, target_ids)
                sampler.engine.check_sample(asked)  # num_samples within the limit before ids are made
                ids = tuple(_sequence_ids(entry.request_id, request.num_samples))
                future = sampler.engine.sample(sampler.pin, dataclasses.replace(asked, sequence_ids=ids))
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
        known = self.samplers.get(request.sampling_session_id)
        limit = (self.engine if known is None else known.engine).config.max_samples_per_request
        counted = 1 <= request.num_samples <= limit
        return {
            "request_id": request_id,
            # a count out of range fails the request (above); no ids are made for it
            "sample_sequence_ids": _sequence_ids(request_id, request.num_samples) if counted else [],
        }

    # ------------------------------------------------------------------------------------------ checkpoints

    def saved_base_model(self, path: str) -> str | None:
        """The base model a checkpoint (`tinker://` path) was saved on, as its engine was made with it;
        None when it cannot be read (the operation that loads it then says why)."""
        known = {
            model_id: engine.model_status(model_id).model_dir
            for model_id, engine in self.live_models().items()
        }
        try:
            return Engine.checkpoint_base_model(path, known)
        except (CheckpointError, ValueError, OSError):
            return None

    async def engine_for_checkpoint(self, path: str, base_model: str | None, where: str) -> Engine:
        """The engine a checkpoint loads on: its base model's (which `base_model`, when given, must
        be); the serving session's when the checkpoint cannot be read, whose load then says why."""
        saved = self.saved_base_model(path)
        if (
            saved is not None
            and base_model is not None
            and resolve_model_path(saved) != resolve_model_path(base_model)
        ):
            raise RequestError(f"{where}: {path} was saved on base model {saved!r}, not {base_model!r}")
        name = saved or base_model
        return self.engine if name is None else await self.engine_for(name, where)

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
