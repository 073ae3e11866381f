"""An engine on the other end of the network: any service that speaks the Tinker API, through the SDK.

`RemoteEngine` has the local `Engine`'s public interface (`workbench.engine.interface`), so a `Session`
over it (`Session.connect`) gives the notebook what a local one does: the Tinker clients, the run
loop, the panel, the history with its JSONL file and W&B run, plots and token views. The model lives
on the service: `workbench serve` on a GPU machine, SkyRL's Tinker server on a Ray cluster, or hosted
Tinker. Every operation goes through the installed, unmodified `tinker` SDK (`tinker.ServiceClient`
and the training, sampling and REST clients it makes), so whatever speaks the protocol can serve it.

Ordering and history: each operation is handed to the SDK in the caller's thread, in submission order
(the SDK keeps that order on the wire), and its result is awaited on this engine's one worker thread,
also in submission order. A result is converted to workbench's types there and its history row is
recorded then, so the history lists the operations that happened, in order; one that failed or never
completed records nothing. The counters the service does not report (optimizer steps, weight versions,
pending backward calls) are counted here from the operations that completed, so samples still say
which weights version they came from.

What the service cannot do is refused before anything is sent, with a `RemoteUnsupportedError`: a
critic role (the SDK has no critic models), a loss the service does not list, a base model it does not
serve, local checkpoint folders (only `tinker://` paths name remote checkpoints). What needs the model
in this process (local tensors, a critic, a merged export, serving) is no method of this engine:
`Session` refuses it for a remote session with the same error. A service that stops answering fails each waiting
operation with `EngineUnreachableError` within `probe_interval_s` plus one health check, rather than
after the SDK's own minutes of retries; the session stays open for whatever can still work.

Services differ where the protocol does not say: the service is identified at connect
(`workbench.engine.remote.server_profiles`), and what it does differently is adapted here (sequence ids it
does not send, `workbench.engine.remote.sequence_id_relay`; metrics it leaves out,
`workbench.engine.remote.client_metrics`; its metric names) or refused before sending (losses and adapter
fields it does not honour). `load_state` continues the run on a new model loaded as its first
request, which every Tinker service accepts; closing frees the runs' models where the service has a way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import typing
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx
import tinker
from tinker import types as sdk
from transformers import PreTrainedTokenizerBase

from workbench.engine.config import EngineConfig, ModelConfig
from workbench.engine.interface import CheckedSample, CustomLossFn, ModelStatus, Restore, SamplerPin, asked
from workbench.engine.model.base_model import BaseModelInfo
from workbench.engine.remote.client_metrics import with_client_metrics
from workbench.engine.remote.sequence_id_relay import SequenceIdRelay
from workbench.engine.remote.server_profiles import identify_server
from workbench.engine.roles import Role
from workbench.engine.samplers.requests import TokenSink
from workbench.engine.samplers.sample_request import SampleRequest
from workbench.engine.worker import SessionClosedError, Worker
from workbench.futures import APIFuture
from workbench.metrics import MetricsHistory, metric_values
from workbench.sdk_conversion import (
    from_sdk_forward_backward_output,
    from_sdk_prompt_alt_tokens,
    from_sdk_sampled_sequence,
    to_adam_params,
    to_datum,
    to_model_input,
    to_sdk_adam_params,
    to_sdk_datum,
    to_sdk_model_input,
    to_sdk_sampling_params,
    to_sdk_token_ids,
)
from workbench.storage.checkpoint_store import CheckpointInfo, CheckpointKind
from workbench.storage.model_folders import models_root, new_model_id
from workbench.types import (
    ForwardBackwardOutput,
    LoadWeightsResponse,
    LoraConfig,
    ModelInput,
    OptimStepResponse,
    SampledSequence,
    SampleResponse,
    SaveWeightsExternalResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    TensorData,
)

T = TypeVar("T")

POLICY_LABEL = "policy"
"""The history's `model` column for the model's policy, as on a local engine."""

REFERENCE_LABEL = "reference"
"""The history's `model` column for the base model with adapters off, as on a local engine."""

SDK_LOSSES = tuple(name for name in typing.get_args(sdk.LossFnType) if name != "custom")
"""The losses the installed SDK can name on the wire (`custom` is `forward_backward_custom`)."""

DEFAULT_PROBE_INTERVAL_S = 5.0
HEALTH_TIMEOUT_S = 5.0

CLOSE_TIMEOUT_S = 60.0
"""How long `close` waits for a service that answers its health check to finish the SDK session (a
loaded machine can take seconds); the SDK's heartbeat stops once it has."""


class RemoteUnsupportedError(ValueError):
    """Raised before anything is sent, for what the remote engine cannot do."""


class EngineUnreachableError(ConnectionError):
    """The service did not answer: at connect, or while an operation waited for its result."""


class RemoteProtocolError(RuntimeError):
    """The SDK failed inside on what the service answered: the two speak different protocol versions."""


@dataclasses.dataclass
class _RemoteModel:
    """One LoRA model on the service, and the counters kept here from its completed operations."""

    model_id: str  # this session's id for it: its local folder's name, the W&B run id
    remote_id: str  # the service's model id
    client: tinker.TrainingClient
    lora: LoraConfig
    seed: int
    model_dir: Path
    user_metadata: dict[str, str]
    created_at: float
    step: int = 0
    weights_version: int = 0
    pending_backward_calls: int = 0
    saved_steps: dict[str, int] = dataclasses.field(default_factory=dict)  # tinker path -> step
    earlier_remote_ids: list[str] = dataclasses.field(default_factory=list)  # models left by load_state


@dataclasses.dataclass
class _Sampler:
    client: tinker.SamplingClient
    pin: SamplerPin


class RemoteEngine:
    """A Tinker-compatible service driven through the `tinker` SDK, with the local engine's interface.

    Args:
        url: The service's base URL (`http://gpu-box:8000`).
        base_model: The base model to train, as the service names it (its capabilities list them).
        api_key: The key the service expects; None lets the SDK read `TINKER_API_KEY`.
        seed: Seeds each new model's LoRA initialisation when its `LoraConfig` gives no seed.
        probe_interval_s: How long an operation waits for its result before checking that the service
            still answers; a service that does not fails the operation with `EngineUnreachableError`.
    """

    def __init__(
        self,
        url: str,
        base_model: str,
        *,
        api_key: str | None = None,
        seed: int = 0,
        probe_interval_s: float = DEFAULT_PROBE_INTERVAL_S,
    ):
        self._url = url.rstrip("/")
        self._api_key = api_key
        self._seed = seed
        self._probe_interval_s = probe_interval_s
        self._worker = Worker("workbench-remote")
        why = self._answers()
        if why is not None:
            raise EngineUnreachableError(f"no Tinker service answers at {self._url}: {why}")
        self._profile = identify_server(self._url)
        # the SDK talks to a service that sends no sequence ids through a relay that makes them up
        self._relay = None if self._profile.sends_sequence_ids else SequenceIdRelay(self._url)
        self._sdk_url = self._url if self._relay is None else self._relay.url
        self._service = tinker.ServiceClient(base_url=self._sdk_url, api_key=api_key)
        self._rest: tinker.RestClient | None = None
        capabilities = self._wait_here(
            "get_server_capabilities", self._rest_client().get_server_capabilities()
        )
        served = [model.model_name for model in capabilities.supported_models if model.model_name]
        if base_model not in served:
            if self._relay is not None:
                self._relay.close()
            raise RemoteUnsupportedError(f"the engine at {self._url} serves {served}, not {base_model!r}")
        listed = (capabilities.model_extra or {}).get("supported_loss_fns")
        if listed is None:
            listed = self._profile.losses or SDK_LOSSES
        self._losses = tuple(n for n in listed if n in SDK_LOSSES)
        model = next(m for m in capabilities.supported_models if m.model_name == base_model)
        self._max_length = model.max_context_length or 0
        self._config = EngineConfig(base_model=base_model, seed=seed, device=self._url, dtype="remote")
        self._history = MetricsHistory()
        self._submitting = threading.Lock()  # hands an op to the SDK and the worker as one step
        self._models: dict[str, _RemoteModel] = {}
        self._samplers: weakref.WeakKeyDictionary[Any, _Sampler] = weakref.WeakKeyDictionary()
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._info: sdk.GetInfoResponse | None = None

    # ------------------------------------------------------------------------------------------ identity

    @property
    def endpoint(self) -> str:
        return self._url

    @property
    def api_key(self) -> str | None:
        """The key given for the service (None: the SDK reads `TINKER_API_KEY`)."""
        return self._api_key

    @property
    def losses(self) -> tuple[str, ...]:
        """The losses the service accepts (those its capabilities list, else every one the SDK names)."""
        return self._losses

    @property
    def config(self) -> EngineConfig:
        """The base model and seed; `device` is the service's URL (the device is the service's business)."""
        return self._config

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The base model's tokenizer, as the SDK loads it (`TrainingClient.get_tokenizer`)."""
        if self._tokenizer is None:
            self._tokenizer = self._any_model().client.get_tokenizer()
        return self._tokenizer

    @property
    def base_info(self) -> BaseModelInfo:
        """What the service says of the base model (`get_info`); sizes it does not report are 0."""
        if self._info is None:
            self._info = self._any_model().client.get_info()
        data = self._info.model_data
        return BaseModelInfo(
            name=self._config.base_model,
            path=data.tokenizer_id or data.model_name or self._config.base_model,
            model_type=data.arch or "unknown",
            vocab_size=len(self.tokenizer),
            hidden_size=0,
            num_layers=0,
            max_length=self._max_length,
            logits_from_hidden_states=False,  # not reported; nothing here computes logits
        )

    @property
    def history(self) -> MetricsHistory:
        """Recorded in this process as the service's answers arrive."""
        return self._history

    @property
    def closed(self) -> bool:
        return self._worker.closed

    def check_open(self) -> None:
        if self._worker.closed:
            raise SessionClosedError("this remote engine is closed")

    # ------------------------------------------------------------------------------------------ plumbing

    def _answers(self) -> str | None:
        """None while the service answers the protocol's health check (`GET /api/v1/healthz`, one try,
        bounded), else why not."""
        try:
            httpx.get(f"{self._url}/api/v1/healthz", timeout=HEALTH_TIMEOUT_S).raise_for_status()
        except httpx.HTTPError as error:
            return str(error) or type(error).__name__
        return None

    def _wait(self, what: str, future: Any) -> Any:
        """The SDK future's result (on the worker); an SDK failure or a silent service fails clearly."""
        while True:
            try:
                return future.result(timeout=self._probe_interval_s)
            except TimeoutError:
                why = self._answers()
                if why is not None:
                    raise EngineUnreachableError(
                        f"{what}: the engine at {self._url} stopped answering ({why}); the operation did not "
                        "complete and is not in the history"
                    ) from None
            except (tinker.APIError, tinker.RequestFailedError) as error:
                raise RuntimeError(f"{what} failed on the engine at {self._url}: {error}") from error
            except (EngineUnreachableError, SessionClosedError):
                raise
            except Exception as error:  # the SDK's own checks of what the service answered
                if self._profile.has_no_free_slot(error):
                    raise RuntimeError(
                        f"{what}: {self._profile.name} at {self._url} has no free adapter slot ({error}); close "
                        "a session on it, or start it with room for more models"
                    ) from error
                raise RemoteProtocolError(
                    f"{what} failed inside the tinker SDK {tinker.__version__} on what {self._profile.name} "
                    f"at {self._url} answered ({type(error).__name__}: {error}): the service speaks another "
                    "version of the protocol. Run the service with a matching tinker version, or serve the "
                    "model with `workbench serve`; the operation is not in the history"
                ) from error

    def _submit(self, send: Callable[[], Any], finish: Callable[[Any], T]) -> APIFuture[T]:
        """Hand an operation to the SDK (`send`, in this thread) and await it on the worker, where
        `finish` converts the result and records it: both in submission order."""
        self.check_open()
        with self._submitting:
            sent = send()
            return self._worker.submit(lambda: finish(sent))

    def _model(self, model_id: str) -> _RemoteModel:
        lora_model = self._models.get(model_id)
        if lora_model is None:
            raise ValueError(f"no model {model_id!r} on this engine; it has {sorted(self._models)}")
        return lora_model

    def _any_model(self) -> _RemoteModel:
        if not self._models:
            raise RuntimeError("create a model first: the tokenizer and model info come from one")
        return next(iter(self._models.values()))

    def _policy(self, model_id: str, role: Role, what: str) -> _RemoteModel:
        lora_model = self._model(model_id)
        if role is Role.CRITIC:
            raise RemoteUnsupportedError(f"{what}: the engine at {self._url} has no critic for {model_id!r}")
        if role is Role.REFERENCE:
            raise RemoteUnsupportedError(
                f"{what}: the Tinker API has no reference model (adapters off); sample the base model instead"
            )
        return lora_model

    def _record(self, op: str, label: str, step: int, metrics: Mapping[str, float]) -> None:
        self._history.record(op, label, step, metrics)

    # ------------------------------------------------------------------------------------------ models

    def default_lora(self) -> LoraConfig:
        """The adapter a session that names none gets: `LoraConfig()` in the layout the service builds."""
        return self._profile.default_lora()

    def create_model(
        self,
        lora: LoraConfig,
        *,
        seed: int = 0,
        model_id: str | None = None,
        model_dir: str | Path | None = None,
        user_metadata: Mapping[str, str] | None = None,
    ) -> APIFuture[str]:
        """The model id is this engine's (`remote_model_id` gives the service's); a `LoraConfig` that the
        service would build otherwise is refused with `RemoteUnsupportedError`."""
        model_id = model_id or new_model_id(self._config.base_model)
        layout = self._profile.adapter_layout
        ignored = [] if layout is None else layout.differences(lora)
        if ignored:
            raise RemoteUnsupportedError(
                f"{self._profile.name} at {self._url} would not build the adapter asked for: "
                f"{', '.join(ignored)}; pass a LoraConfig with those values"
            )
        if model_id in self._models:
            raise ValueError(f"a model {model_id!r} already exists on this engine")
        folder = (Path(model_dir) if model_dir is not None else models_root() / model_id).absolute()
        metadata = {str(k): str(v) for k, v in (user_metadata or {}).items()}
        init_seed = lora.seed if lora.seed is not None else seed

        def send() -> Any:
            return self._create_client(lora, init_seed, metadata)

        def finish(created: Any) -> str:
            client = self._wait("create_model", created)
            folder.mkdir(parents=True, exist_ok=True)
            self._models[model_id] = _RemoteModel(
                model_id, client.model_id, client, lora, seed, folder, metadata, time.time()
            )
            return model_id

        return self._submit(send, finish)

    def _create_client(self, lora: LoraConfig, seed: int, metadata: Mapping[str, str]) -> Any:
        """The SDK's future of a new LoRA training client on the service."""
        return self._service.create_lora_training_client(
            base_model=self._config.base_model,
            rank=lora.rank,
            seed=seed,
            train_mlp=lora.train_mlp,
            train_attn=lora.train_attn,
            train_unembed=lora.train_unembed,
            user_metadata=dict(metadata) or None,
        )

    def model_ids(self) -> list[str]:
        return list(self._models)

    def model_status(self, model_id: str) -> ModelStatus:
        lora_model = self._model(model_id)
        pinned = {s.pin.version for s in list(self._samplers.values()) if s.pin.model_id == model_id}
        return ModelStatus(
            model_id=model_id,
            model_dir=lora_model.model_dir,
            lora=lora_model.lora,
            critic_lora=None,
            seed=lora_model.seed,
            step=lora_model.step,
            weights_version=lora_model.weights_version,
            pending_backward_calls=lora_model.pending_backward_calls,
            critic_step=None,
            critic_weights_version=None,
            live_versions=sorted({v for v in pinned if v is not None} | {lora_model.weights_version}),
            user_metadata=dict(lora_model.user_metadata),
            created_at=lora_model.created_at,
            adapter=POLICY_LABEL,
            critic_adapter=None,
            snapshot_bytes=0,
        )

    def model_config(self, model_id: str) -> ModelConfig:
        lora_model = self._model(model_id)
        return ModelConfig(
            base_model=self._config.base_model,
            lora=lora_model.lora,
            seed=lora_model.seed,
            device=self._url,
            dtype="remote",
            sampler="remote",
        )

    def remote_model_id(self, model_id: str) -> str:
        """The service's id for the model (what its `tinker://` paths start with)."""
        return self._model(model_id).remote_id

    # ------------------------------------------------------------------------------------------ training

    def _check_loss(self, loss_fn: str) -> None:
        if loss_fn not in self._losses:
            raise RemoteUnsupportedError(
                f"loss_fn {loss_fn!r}: the engine at {self._url} accepts {list(self._losses)}"
            )

    def _forward(
        self,
        op: str,
        model_id: str,
        role: Role,
        data: Sequence[Any],
        loss_fn: str,
        loss_fn_config: Mapping[str, float] | None,
    ) -> APIFuture[ForwardBackwardOutput]:
        lora_model = self._policy(model_id, role, op)
        self._check_loss(loss_fn)
        converted = [to_datum(d) for d in data]
        datums = [to_sdk_datum(d) for d in converted]
        if not datums:
            raise ValueError(f"{op} needs at least one datum")
        config = None if loss_fn_config is None else {k: float(v) for k, v in loss_fn_config.items()}
        method = lora_model.client.forward_backward if op == "forward_backward" else lora_model.client.forward

        def finish(sent: Any) -> ForwardBackwardOutput:
            output = from_sdk_forward_backward_output(self._wait(op, sent))
            metrics = self._profile.rename_metrics(output.metrics)
            output = dataclasses.replace(
                output, metrics=with_client_metrics(metrics, output.loss_fn_outputs, converted)
            )
            if op == "forward_backward":
                lora_model.pending_backward_calls += 1
            self._record(op, POLICY_LABEL, lora_model.step, output.metrics)
            return output

        return self._submit(lambda: method(datums, loss_fn, config), finish)

    def forward(
        self,
        model_id: str,
        role: Role,
        data: Sequence[Any],
        loss_fn: str,
        loss_fn_config: Mapping[str, float] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        return self._forward("forward", model_id, role, data, loss_fn, loss_fn_config)

    def forward_backward(
        self,
        model_id: str,
        role: Role,
        data: Sequence[Any],
        loss_fn: str,
        loss_fn_config: Mapping[str, float] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        return self._forward("forward_backward", model_id, role, data, loss_fn, loss_fn_config)

    def forward_backward_custom(
        self, model_id: str, role: Role, data: Sequence[Any], loss_fn: CustomLossFn
    ) -> APIFuture[ForwardBackwardOutput]:
        """As the SDK runs it: a forward pass on the service, the loss and its gradient with respect to
        the logprobs here, and a backward pass on the service with that gradient as weights."""
        lora_model = self._policy(model_id, role, "forward_backward_custom")
        datums = [to_sdk_datum(to_datum(d)) for d in data]

        def finish(sent: Any) -> ForwardBackwardOutput:
            output = from_sdk_forward_backward_output(self._wait("forward_backward_custom", sent))
            lora_model.pending_backward_calls += 1
            self._record("forward_backward_custom", POLICY_LABEL, lora_model.step, output.metrics)
            return output

        return self._submit(lambda: lora_model.client.forward_backward_custom(datums, loss_fn), finish)

    def optim_step(self, model_id: str, role: Role, adam_params: Any = None) -> APIFuture[OptimStepResponse]:
        """The step and the weights version are counted here, when the service's answer arrives."""
        lora_model = self._policy(model_id, role, "optim_step")
        params = to_adam_params(adam_params)
        sdk_params = to_sdk_adam_params(params)

        def finish(sent: Any) -> OptimStepResponse:
            response = self._wait("optim_step", sent)
            metrics = self._profile.rename_metrics(
                {key: float(value) for key, value in (response.metrics or {}).items()}
            )
            lora_model.step += 1
            lora_model.weights_version += 1
            lora_model.pending_backward_calls = 0
            self._record(
                "optim_step",
                POLICY_LABEL,
                lora_model.step,
                {**metrics, "learning_rate": params.learning_rate, "applied": 1.0},
            )
            return OptimStepResponse(metrics=metrics)

        return self._submit(lambda: lora_model.client.optim_step(sdk_params), finish)

    # ------------------------------------------------------------------------------------------ sampling

    def _pin(self, send: Callable[[], Any], make_pin: Callable[[], SamplerPin]) -> APIFuture[SamplerPin]:
        holder: list[Any] = []

        def finish(sent: Any) -> SamplerPin:
            client = self._wait("a sampling client", sent)
            pin = make_pin()
            self._samplers[holder[0]] = _Sampler(client, pin)
            return pin

        future = self._submit(send, finish)
        holder.append(future.future())
        return future

    def pin_sampler(
        self, model_id: str | None, version: int | None = None, *, inflight: bool = False
    ) -> APIFuture[SamplerPin]:
        """Past versions live on the service only as saved checkpoints: `version` must be None or the
        version the queued operations reach. An inflight client's responses report the version it was
        made with (the service does not say which newer one sampled)."""
        if inflight and (model_id is None or version is not None):
            raise ValueError("an inflight sampling client follows a training model's current weights")
        if model_id is None:
            if version is not None:
                raise ValueError("the base model has no version")
            return self._pin(
                lambda: self._service.create_sampling_client(base_model=self._config.base_model),
                SamplerPin,
            )
        lora_model = self._model(model_id)
        if version is not None and version != lora_model.weights_version:
            raise RemoteUnsupportedError(
                f"weights version {version}: the engine at {self._url} samples a model's current weights "
                f"(v{lora_model.weights_version}) or saved checkpoints (save_weights_for_sampler), not past versions"
            )
        kind = "inflight" if inflight else "snapshot"
        return self._pin(
            lambda: lora_model.client.save_weights_and_get_sampling_client(kind=kind),
            lambda: SamplerPin(model_id=model_id, version=lora_model.weights_version, inflight=inflight),
        )

    def pin_sampler_checkpoint(self, path: str | Path) -> APIFuture[SamplerPin]:
        tinker_path = self._tinker_path(path, "a sampling client")
        return self._pin(
            lambda: self._service.create_sampling_client(model_path=tinker_path),
            lambda: SamplerPin(adapter=tinker_path),
        )

    def release_sampler(self, pin: APIFuture[SamplerPin], wait: bool = False) -> None:
        """The sampling client is forgotten at once (the service frees it with the SDK client): nothing
        is queued, so there is nothing to `wait` for."""
        with contextlib.suppress(KeyError, TypeError):
            del self._samplers[pin.future()]

    def _sampler(self, pin: APIFuture[SamplerPin]) -> Callable[[], _Sampler]:
        def get() -> _Sampler:
            sampler = self._samplers.get(pin.future())
            if sampler is None:
                raise ValueError("this sampling client's weights were released or never pinned")
            return sampler

        return get

    def check_sample(self, request: SampleRequest) -> CheckedSample:
        """What this side can check; the service checks what needs the model when the request comes."""
        if request.record_stability_info or request.sequence_ids is not None:
            raise RemoteUnsupportedError(
                "stability records and caller-chosen sequence ids are kept by a local engine only"
            )
        if request.num_samples < 1:
            raise ValueError(f"num_samples must be a positive integer, got {request.num_samples!r}")
        return CheckedSample(request, None, self)

    def sample(
        self,
        pin: APIFuture[SamplerPin],
        request: SampleRequest | CheckedSample,
        token_sink: TokenSink | None = None,
    ) -> APIFuture[SampleResponse]:
        """Sample on the service, which checks what needs the model; the response reports the weights
        version its client pinned. The service answers a request whole: `token_sink` is told nothing, and
        its caller has the tokens with the response."""
        if not (isinstance(request, CheckedSample) and request.checked_by is self):
            request = self.check_sample(asked(request))
        request = request.request
        model_input = to_sdk_model_input(request.prompt)
        params = to_sdk_sampling_params(request.sampling_params)
        targets = request.target_prompt_logprobs
        sdk_targets = None if targets is None else to_sdk_token_ids(targets)
        sampler = self._sampler(pin)

        def send_with(held: _Sampler) -> tuple[_Sampler, Any, float]:
            sent = held.client.sample(
                model_input,
                request.num_samples,
                params,
                include_prompt_logprobs=request.include_prompt_logprobs,
                prompt_logprobs_last_n=request.prompt_logprobs_last_n,
                topk_prompt_logprobs=request.topk_prompt_logprobs,
                topk_sample_logprobs=request.topk_sample_logprobs,
                target_prompt_logprobs=sdk_targets,
                prompt_alt_tokens_k=request.prompt_alt_tokens_k,
            )
            return held, sent, time.perf_counter()

        def send() -> tuple[_Sampler, Any, float] | None:
            # a pinned client samples at once (concurrent requests overlap); one still being pinned
            # is sent from the worker, right after its pin
            return send_with(sampler()) if pin.done() else None

        def finish(early: tuple[_Sampler, Any, float] | None) -> SampleResponse:
            held, sent, started = early if early is not None else send_with(sampler())
            response = self._wait("sample", sent)
            seconds = time.perf_counter() - started
            sequences = [from_sdk_sampled_sequence(s) for s in response.sequences]
            self._record_sample(held.pin, sequences, seconds)
            return SampleResponse(
                sequences=sequences,
                weights_version=held.pin.version,
                prompt_logprobs=(
                    self._profile.aligned_prompt_logprobs(response.prompt_logprobs, model_input.length)
                    if request.include_prompt_logprobs
                    else None
                ),
                topk_prompt_logprobs=response.topk_prompt_logprobs,
                target_prompt_logprobs=None
                if response.target_prompt_logprobs is None
                else TensorData(response.target_prompt_logprobs.to_numpy(), "float32"),
                prompt_alt_tokens=from_sdk_prompt_alt_tokens(response.prompt_alt_tokens),
            )

        return self._submit(send, finish)

    def _record_sample(self, pin: SamplerPin, sequences: list[SampledSequence], seconds: float) -> None:
        tokens = sum(len(s.tokens) for s in sequences)
        metrics = {
            "num_samples:sum": float(len(sequences)),
            "num_tokens:sum": float(tokens),
            "stop_fraction:mean": sum(s.stop_reason == "stop" for s in sequences) / max(len(sequences), 1),
            "sample_seconds": seconds,
            "tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
        }
        if tokens:
            metrics["logprob:mean"] = sum(sum(s.logprobs) for s in sequences) / tokens
        lora_model = self._models.get(pin.model_id) if pin.model_id is not None else None
        label = REFERENCE_LABEL if pin.is_base else (pin.adapter or "")
        if lora_model is not None and pin.version is not None:
            label = POLICY_LABEL
            metrics["weights_version"] = float(pin.version)
            metrics["staleness"] = float(lora_model.weights_version - pin.version)
        self._record("sample", label, lora_model.step if lora_model is not None else 0, metrics)

    def compute_logprobs(
        self,
        pin: APIFuture[SamplerPin],
        prompt: ModelInput | Sequence[int],
        *,
        prompt_logprobs_last_n: int | None = None,
    ) -> APIFuture[list[float | None]]:
        model_input = to_sdk_model_input(to_model_input(prompt))
        sampler = self._sampler(pin)

        def finish(_: Any) -> list[float | None]:
            sent = sampler().client.compute_logprobs(
                model_input, prompt_logprobs_last_n=prompt_logprobs_last_n
            )
            return self._profile.aligned_prompt_logprobs(
                self._wait("compute_logprobs", sent), model_input.length
            )

        return self._submit(lambda: None, finish)

    # ------------------------------------------------------------------------------------------ checkpoints

    def _tinker_path(self, path: str | Path, what: str) -> str:
        if not isinstance(path, str) or not path.startswith("tinker://"):
            raise RemoteUnsupportedError(
                f"{what}: {str(path)!r} is not a tinker:// path; checkpoints of the engine at {self._url} live "
                "there and are named by their tinker:// paths (list_checkpoints gives them)"
            )
        return path

    def save_state(
        self,
        model_id: str,
        name: str,
        *,
        overwrite: bool = False,
        ttl_seconds: int | None = None,
        user_metadata: Mapping[str, str] | None = None,
    ) -> APIFuture[SaveWeightsResponse]:
        """Saved on the service, as much as it saves: `.path` only, no local folder."""
        lora_model = self._model(model_id)
        metadata = None if user_metadata is None else {str(k): str(v) for k, v in user_metadata.items()}

        def finish(sent: Any) -> SaveWeightsResponse:
            path = self._wait("save_state", sent).path
            lora_model.saved_steps[path] = lora_model.step
            self._record("save_state", POLICY_LABEL, lora_model.step, {})
            self._history.event(
                "checkpoint", {"name": name, "kind": "state", "path": path, "step": lora_model.step}
            )
            return SaveWeightsResponse(path=path)

        return self._submit(
            lambda: lora_model.client.save_state(
                name, ttl_seconds=ttl_seconds, overwrite=overwrite, user_metadata=metadata
            ),
            finish,
        )

    def save_weights_for_sampler(
        self,
        model_id: str,
        name: str,
        *,
        overwrite: bool = False,
        ttl_seconds: int | None = None,
        user_metadata: Mapping[str, str] | None = None,
    ) -> APIFuture[SaveWeightsForSamplerResponse]:
        """Saved on the service; the SDK has no `overwrite` here, so asking for one raises
        `RemoteUnsupportedError`."""
        lora_model = self._model(model_id)
        if overwrite:
            raise RemoteUnsupportedError("the tinker SDK's save_weights_for_sampler has no overwrite")
        metadata = None if user_metadata is None else {str(k): str(v) for k, v in user_metadata.items()}

        def finish(sent: Any) -> SaveWeightsForSamplerResponse:
            path = self._wait("save_weights_for_sampler", sent).path
            lora_model.saved_steps[path] = lora_model.step
            self._record("save_weights_for_sampler", POLICY_LABEL, lora_model.step, {})
            self._history.event(
                "checkpoint", {"name": name, "kind": "sampler", "path": path, "step": lora_model.step}
            )
            return SaveWeightsForSamplerResponse(path=path)

        return self._submit(
            lambda: lora_model.client.save_weights_for_sampler(
                name, ttl_seconds=ttl_seconds, user_metadata=metadata
            ),
            finish,
        )

    def save_weights_external(
        self,
        model_id: str,
        name: str,
        *,
        ttl_seconds: int | None = None,
        age_encryption_recipients: Sequence[str] | None = None,
    ) -> APIFuture[SaveWeightsExternalResponse]:
        """Saved on the service; `RestClient.get_external_weights_urls` signs its files' URLs there."""
        lora_model = self._model(model_id)
        recipients = None if age_encryption_recipients is None else list(age_encryption_recipients)

        def finish(sent: Any) -> SaveWeightsExternalResponse:
            path = self._wait("save_weights_external", sent).path
            self._record("save_weights_external", POLICY_LABEL, lora_model.step, {})
            self._history.event(
                "checkpoint", {"name": name, "kind": "external", "path": path, "step": lora_model.step}
            )
            return SaveWeightsExternalResponse(path=path)

        return self._submit(
            lambda: lora_model.client.save_weights_external(
                name, ttl_seconds=ttl_seconds, age_encryption_recipients=recipients
            ),
            finish,
        )

    def load_state(self, model_id: str, path: str | Path, restore: Restore) -> APIFuture[LoadWeightsResponse]:
        """The checkpoint loads into a new model on the service, which the model continues on;
        `Restore.EVERYTHING` restores what `Restore.WITH_OPTIMIZER` does (the SDK restores no RNG
        state). Tinker services accept a load only as a model's first request (SkyRL,
        hosted Tinker), so the new model is created and loaded here, in the caller's thread, before
        any later operation is sent; a failed load leaves the run on its model, unchanged. The model it
        was on is freed where the service offers a way, after the operations queued on it. The weights
        version moves on by one; the step becomes the saved one when this engine saved the checkpoint
        and the optimizer state is restored. The history's `load_state` event names both models."""
        lora_model = self._model(model_id)
        tinker_path = self._tinker_path(path, "load_state")
        with self._submitting:
            self.check_open()
            replaced = lora_model.remote_id
            try:
                client = self._wait(
                    "load_state",
                    self._create_client(lora_model.lora, lora_model.seed, lora_model.user_metadata),
                )
                freed_first = False
            except RuntimeError as error:
                if not self._profile.has_no_free_slot(error):
                    raise
                client, freed_first = self._create_in_the_replaced_slot(lora_model, tinker_path), True
            load = client.load_state if restore is Restore.WEIGHTS else client.load_state_with_optimizer
            try:
                with warnings.catch_warnings():  # SDK 0.38 would have a load create the model; SkyRL
                    warnings.simplefilter("ignore", FutureWarning)  # refuses that, and the two-step way works
                    sent = load(tinker_path)
                self._wait("load_state", sent)
            except Exception as error:
                self._profile.free_models(self._url, [client.model_id])
                if freed_first:
                    raise RuntimeError(
                        f"load_state: {tinker_path} did not load ({error}), and the model {replaced!r} was freed "
                        f"first to make room on the full service at {self._url}: load a checkpoint again to go on"
                    ) from error
                raise
            lora_model.client, lora_model.remote_id = client, client.model_id
            lora_model.earlier_remote_ids.append(replaced)

        def finish(_: Any) -> LoadWeightsResponse:
            lora_model.weights_version += 1
            lora_model.pending_backward_calls = 0
            if restore is not Restore.WEIGHTS:
                lora_model.step = lora_model.saved_steps.get(tinker_path, lora_model.step)
            self._record(
                "load_state",
                POLICY_LABEL,
                lora_model.step,
                {"new_server_model": 1.0, "optimizer_restored": float(restore is not Restore.WEIGHTS)},
            )
            self._history.event(
                "load_state",
                {
                    "path": tinker_path,
                    "restore": restore.value,
                    "model": lora_model.remote_id,
                    "replaced": replaced,
                },
            )
            if not freed_first:
                self._profile.free_models(self._url, [replaced])
            return LoadWeightsResponse(path=tinker_path)

        return self._submit(lambda: None, finish)

    def _create_in_the_replaced_slot(self, lora_model: _RemoteModel, tinker_path: str) -> Any:
        """The new model of a `load_state` on a service whose adapter slots are all taken (SkyRL's
        `max_lora_adapters`): the model it replaces is freed first, once the checkpoint is known to exist
        (so a wrong path still changes nothing) and the operations queued on that model have finished;
        then the new model takes its slot. Called holding `_submitting`, in the caller's thread."""
        self._wait("load_state", self._rest_client().get_weights_info_by_tinker_path(tinker_path))
        self._worker.submit(lambda: None).result()  # after everything queued on the replaced model
        self._profile.free_models(self._url, [lora_model.remote_id])
        return self._wait(
            "load_state", self._create_client(lora_model.lora, lora_model.seed, lora_model.user_metadata)
        )

    def _rest_client(self) -> tinker.RestClient:
        if self._rest is None:
            self._rest = tinker.RestClient(base_url=self._sdk_url, api_key=self._api_key)
        return self._rest

    def list_checkpoints(self, model_id: str) -> list[CheckpointInfo]:
        """The model's checkpoints on the service, those of the models it was on before a `load_state`
        included, oldest first (`tinker_path` names each; `path` is its checkpoint id, since there is
        no local folder)."""
        lora_model = self._model(model_id)
        listed = [
            checkpoint
            for remote_id in [*lora_model.earlier_remote_ids, lora_model.remote_id]
            for checkpoint in self._wait_here(
                "list_checkpoints", self._rest_client().list_checkpoints(training_run_id=remote_id)
            ).checkpoints
        ]
        infos = [
            CheckpointInfo(
                name=checkpoint.checkpoint_id.rsplit("/", 1)[-1],
                path=Path(checkpoint.checkpoint_id),
                kind="state" if checkpoint.checkpoint_type == "training" else "sampler",
                step=lora_model.saved_steps.get(checkpoint.tinker_path, 0),
                time=checkpoint.time.timestamp(),
                size_bytes=checkpoint.size_bytes or 0,
                expires_at=None if checkpoint.expires_at is None else checkpoint.expires_at.timestamp(),
                user_metadata=checkpoint.user_metadata,
                tinker_path=checkpoint.tinker_path,
            )
            for checkpoint in listed
        ]
        return sorted(infos, key=lambda info: info.time)

    def _wait_here(self, what: str, future: Any) -> Any:
        """Wait in the caller's thread for a request outside the operation order (REST listings)."""
        self.check_open()
        return self._wait(what, future)

    def delete_checkpoint(self, model_id: str, name: str, kind: CheckpointKind = "state") -> APIFuture[None]:
        """Delete one of the run's checkpoints on the service, after the operations queued before (on
        the model that saved it, when this engine saved it before a `load_state` moved the run)."""
        lora_model = self._model(model_id)
        checkpoint_id = f"{'weights' if kind == 'state' else 'sampler_weights'}/{name}"
        saved = [path for path in lora_model.saved_steps if path.endswith(f"/{checkpoint_id}")]
        owner = saved[-1].removeprefix("tinker://").split("/", 1)[0] if saved else lora_model.remote_id
        return self._submit(
            lambda: None,
            lambda _: self._wait(
                "delete_checkpoint", self._rest_client().delete_checkpoint(owner, checkpoint_id)
            ),
        )

    # ------------------------------------------------------------------------------------------ misc

    def record(self, op: str, label: str, step: int, metrics: Mapping[str, float]) -> APIFuture[None]:
        values = metric_values(metrics)
        return self._submit(lambda: None, lambda _: self._record(op, label, step, values))

    def close(self) -> None:
        """The models are freed where the service offers a way, then the SDK session ends (a service that
        frees its models with the session does so then)."""
        if self._worker.closed:
            return
        self._worker.close()
        self._profile.free_models(self._url, [lora_model.remote_id for lora_model in self._models.values()])
        for sink in list(self._history.sinks):
            sink.close()
        self._history.sinks.clear()
        self._samplers.clear()
        self._models.clear()
        finished = self._service.close("success")
        try:
            finished.result(timeout=CLOSE_TIMEOUT_S if self._answers() is None else HEALTH_TIMEOUT_S)
        except Exception:
            # A service that is gone has nothing left to free, and cannot be told the session finished:
            # the SDK would retry that call for minutes, its heartbeat running (and warning) until the
            # retries end. Cancelling the call stops the retries; the SDK's close then stops its loops.
            finished.future().cancel()
        if self._relay is not None:
            self._relay.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self._models)} model(s)"
        return f"RemoteEngine({self._config.base_model!r} at {self._url}, {state})"
