"""Tinker's `ServiceClient` in-process: training and sampling clients on local engines.

`wb.ServiceClient` can stand in for `tinker.ServiceClient` in code written for the SDK (tinker-cookbook's
training loops run against it unchanged): the same constructor and methods, returning futures of
clients (awaitable, `.result()`, forwarding attribute access to the client), the `*_async` twins, the
context manager that closes it. Behind it is one engine per base model (`BaseModels`), shared by every
client made for that model (one copy of the base in memory), started on first use; a base model is named
as the engine knows it or by its folder (`"tiny"` and the built-in model's folder are the same engine).

A `ServiceClient` can also be given a session's base models (`Session.service_client()`): its runs then
share that session's history and panel, the base models it loads stay with the session (its servers
serve them too), and closing the client leaves them running.

Nothing here opens a W&B run: a `Session` does, a `ServiceClient` never (a cookbook run logs its own).
"""

from __future__ import annotations

import concurrent.futures
import warnings
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from workbench.engine.interface import Restore
from workbench.engine.local.base_models import BaseModels
from workbench.engine.local.engine import Engine
from workbench.engine.model.base_model import resolve_model_path
from workbench.futures import APIFuture
from workbench.tinker_api.clients import (
    ClientFuture,
    SamplingClient,
    TrainingClient,
    client_future,
    console_url,
)
from workbench.tinker_api.rest_client import GetServerCapabilitiesResponse, RestClient, server_capabilities
from workbench.types import LoraConfig


def _check_optimizer(optimizer: Any) -> None:
    """AdamW is the only optimizer family here (Tinker's `AdamOptimizerConfig`, the default)."""
    if optimizer is None:
        return
    kind = optimizer.get("type") if isinstance(optimizer, Mapping) else getattr(optimizer, "type", None)
    if kind != "adamw":
        raise ValueError(
            f"optimizer={optimizer!r}: only AdamW (AdamOptimizerConfig, type 'adamw') is available locally"
        )


class ServiceClient:
    """Tinker's entry point: creates training and sampling clients on local engines.

    Args:
        user_metadata: Tinker's session metadata; kept on the client (`.user_metadata`): there is no
            server-side session to attach it to. A run's own metadata is `create_*`'s `user_metadata`.
        project_id, display_name, base_url, api_key, default_headers_overrides: Tinker's connection
            and session arguments; nothing is connected to, so they change nothing.
        base_models: The base models to create clients on (a session's: see
            `Session.service_client`); this client never closes them. None: its own, closed with it.
        **kwargs: Unknown arguments are ignored with a `FutureWarning`, as the SDK does.
    """

    def __init__(
        self,
        user_metadata: dict[str, str] | None = None,
        project_id: str | None = None,
        *,
        display_name: str | None = None,
        base_url: str | None = None,
        api_key: str | None = None,
        default_headers_overrides: Mapping[str, str] | None = None,
        base_models: BaseModels | None = None,
        **kwargs: Any,
    ):
        if kwargs:
            warnings.warn(
                f"ServiceClient ignores unsupported arguments: {', '.join(sorted(kwargs))}",
                FutureWarning,
                stacklevel=2,
            )
        self.user_metadata = dict(user_metadata or {})
        self._owns_base_models = base_models is None
        self.base_models = BaseModels(sampler="hf") if base_models is None else base_models
        self._closed = False

    # ------------------------------------------------------------------------------------------ engines

    def engine(self, base_model: str) -> Engine:
        """The engine for `base_model` (an alias, a folder or an HF id), started on first use."""
        self._check_open()
        return self.base_models.engine(base_model)

    def engines(self) -> list[Engine]:
        """The engines of the base models loaded (this client's, or its session's)."""
        return self.base_models.engines()

    def _known_models(self) -> dict[str, Path]:
        return {
            model_id: engine.model_status(model_id).model_dir
            for engine in self.engines()
            for model_id in engine.model_ids()
        }

    def _engine_for_checkpoint(self, path: str | Path, base_model: str | None) -> Engine:
        """The engine a checkpoint loads on: the one for its base model, which `base_model` (when
        given) must name as well."""
        saved = Engine.checkpoint_base_model(path, self._known_models())
        if base_model is not None and resolve_model_path(base_model) != resolve_model_path(saved):
            raise ValueError(f"{path} was saved on base model {saved!r}, not {base_model!r}")
        return self.engine(saved)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("ServiceClient is closed")

    # ------------------------------------------------------------------------------------------ training

    def create_lora_training_client(
        self,
        base_model: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        user_metadata: dict[str, str] | None = None,
        optimizer: Any = None,
    ) -> ClientFuture[TrainingClient]:
        """A new training run: a LoRA policy on `base_model`. `seed` fixes the adapter's initialisation
        (None: the engine's seed, as `workbench serve` does, so a notebook or script that seeds its
        session is repeatable end to end). `user_metadata` is stored with the run (`run.json`) and
        returned by `RestClient.get_training_run`. `optimizer`: AdamW only (None or
        `AdamOptimizerConfig`); another family raises a `ValueError`."""
        _check_optimizer(optimizer)
        lora = LoraConfig(
            rank=rank, seed=seed, train_mlp=train_mlp, train_attn=train_attn, train_unembed=train_unembed
        )
        engine = self.engine(base_model)
        run_seed = engine.config.seed if seed is None else seed
        model_id = engine.create_model(lora, seed=run_seed, user_metadata=user_metadata)
        return client_future(model_id.then(lambda created: TrainingClient(engine, created)))

    async def create_lora_training_client_async(
        self,
        base_model: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        user_metadata: dict[str, str] | None = None,
        optimizer: Any = None,
    ) -> TrainingClient:
        """The SDK's deprecated twin: the training client itself."""
        return await self.create_lora_training_client(
            base_model, rank, seed, train_mlp, train_attn, train_unembed, user_metadata, optimizer
        )

    def create_training_client_from_state(
        self,
        path: str,
        base_model: str | None = None,
        user_metadata: dict[str, str] | None = None,
        weights_access_token: str | None = None,
        optimizer: Any = None,
    ) -> ClientFuture[TrainingClient]:
        """A new training run (its own id and folder) starting from a `save_state` checkpoint's weights,
        with a fresh optimizer. The checkpoint's run is untouched, so the new run may save under names
        the old one used. `base_model` must be the checkpoint's (it picks nothing else here);
        `weights_access_token` has no local meaning; `optimizer` as for `create_lora_training_client`."""
        _check_optimizer(optimizer)
        return self._from_state(path, base_model, user_metadata, Restore.WEIGHTS)

    async def create_training_client_from_state_async(
        self,
        path: str,
        base_model: str | None = None,
        user_metadata: dict[str, str] | None = None,
        weights_access_token: str | None = None,
        optimizer: Any = None,
    ) -> TrainingClient:
        """The SDK's deprecated twin: the training client itself."""
        return await self.create_training_client_from_state(
            path, base_model, user_metadata, weights_access_token, optimizer
        )

    def create_training_client_from_state_with_optimizer(
        self,
        path: str,
        base_model: str | None = None,
        user_metadata: dict[str, str] | None = None,
        weights_access_token: str | None = None,
    ) -> ClientFuture[TrainingClient]:
        """Like `create_training_client_from_state`, with the optimizer state, step counters and
        pending gradients as saved: the new run continues where the saved one stood."""
        return self._from_state(path, base_model, user_metadata, Restore.WITH_OPTIMIZER)

    async def create_training_client_from_state_with_optimizer_async(
        self,
        path: str,
        base_model: str | None = None,
        user_metadata: dict[str, str] | None = None,
        weights_access_token: str | None = None,
    ) -> TrainingClient:
        """The SDK's deprecated twin: the training client itself."""
        return await self.create_training_client_from_state_with_optimizer(
            path, base_model, user_metadata, weights_access_token
        )

    def _from_state(
        self, path: str, base_model: str | None, user_metadata: Mapping[str, str] | None, restore: Restore
    ) -> ClientFuture[TrainingClient]:
        engine = self._engine_for_checkpoint(path, base_model)
        model_id = engine.create_model_from_state(path, restore=restore, user_metadata=user_metadata or {})
        return client_future(model_id.then(lambda created: TrainingClient(engine, created)))

    # ------------------------------------------------------------------------------------------ sampling

    def create_sampling_client(
        self,
        model_path: str | None = None,
        base_model: str | None = None,
        retry_config: Any = None,
        record_stability_info: bool = False,
    ) -> ClientFuture[SamplingClient]:
        """A sampling client of saved weights (`model_path`: sampler weights or a state checkpoint) or
        of a base model (`base_model`, adapters off). With `record_stability_info`, every sample is
        recorded for `stable_reinforce`. `retry_config` has no local meaning (nothing to retry)."""
        if model_path is None and base_model is None:
            raise ValueError("Either model_path or base_model must be provided")
        if model_path is not None:
            if not isinstance(model_path, (str, Path)) or not model_path:
                raise ValueError(f"model_path must be a tinker:// path or a folder, got {model_path!r}")
            engine = self._engine_for_checkpoint(model_path, base_model)
            pin = engine.pin_sampler_checkpoint(model_path)
        else:
            assert base_model is not None
            engine = self.engine(base_model)
            pin = engine.pin_sampler(None)
        client = SamplingClient(engine, pin, record_stability_info=record_stability_info)
        return client_future(client.pinned().then(lambda _: client))

    async def create_sampling_client_async(
        self,
        model_path: str | None = None,
        base_model: str | None = None,
        retry_config: Any = None,
        record_stability_info: bool = False,
    ) -> SamplingClient:
        """The SDK's deprecated twin: the sampling client itself."""
        return await self.create_sampling_client(model_path, base_model, retry_config, record_stability_info)

    # ------------------------------------------------------------------------------------------ the rest

    def create_rest_client(self) -> RestClient:
        """A `RestClient` that sees this client's live models as well as the model folders on disk."""
        self._check_open()
        return RestClient(base_models=self.base_models)

    def get_server_capabilities(self) -> GetServerCapabilitiesResponse:
        """The base models on offer (see `RestClient.get_server_capabilities`)."""
        return server_capabilities(self.engines())

    async def get_server_capabilities_async(self) -> GetServerCapabilitiesResponse:
        """The SDK's deprecated twin of `get_server_capabilities`."""
        return self.get_server_capabilities()

    def get_console_url(self) -> str:
        """The models root, where the Tinker Console would be."""
        return console_url()

    def get_telemetry(self) -> None:
        """No telemetry is collected locally."""
        return None

    def close(
        self, status: Literal["success", "errored", "interrupted"], detail: str | None = None
    ) -> APIFuture[None]:
        """Finish queued work and free the engines this client started (one it was given stays open);
        later calls raise. `status` and `detail` say how the session ended; there is no server to tell.
        Returns a resolved future, as the SDK returns one."""
        if not self._closed:
            self._closed = True
            if self._owns_base_models:
                self.base_models.close()
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        done.set_result(None)
        return APIFuture(done)

    def __enter__(self) -> ServiceClient:
        self._check_open()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc_type is None:
            status: Literal["success", "errored", "interrupted"] = "success"
        elif issubclass(exc_type, Exception):
            status = "errored"
        else:
            status = "interrupted"
        self.close(status).result()
