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
critic (the SDK has no critic models), a loss the service does not list, a base model it does not
serve, local tensors (`state_digest`, `inspect`, `torch_model`), local checkpoint folders (only
`tinker://` paths name remote checkpoints). A service that stops answering fails each waiting
operation with `EngineUnreachableError` within `probe_interval_s` plus one health check, rather than
after the SDK's own minutes of retries; the session stays open for whatever can still work.

Services differ where the protocol does not say: the service is identified at connect
(`workbench.engine.server_profiles`), and what it does differently is adapted here (sequence ids it
does not send, `workbench.engine.sequence_id_relay`; metrics it leaves out,
`workbench.engine.client_metrics`; its metric names) or refused before sending (losses and adapter
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
import torch
from tinker import types as sdk
from transformers import PreTrainedTokenizerBase

from workbench.engine.client_metrics import with_client_metrics
from workbench.engine.config import EngineConfig, SessionConfig
from workbench.engine.interface import CustomLossFn, Restore, RunStatus, SamplerPin
from workbench.engine.model.base_model import BaseModelInfo
from workbench.engine.roles import Role
from workbench.engine.sequence_id_relay import SequenceIdRelay
from workbench.engine.server_profiles import identify_server
from workbench.engine.worker import SessionClosedError, Worker
from workbench.futures import APIFuture
from workbench.metrics import MetricsHistory, metric_values
from workbench.storage.checkpoint_store import CheckpointInfo, CheckpointKind
from workbench.storage.run_folders import new_run_id, runs_root
from workbench.types import (
    Datum,
    ForwardBackwardOutput,
    LoadWeightsResponse,
    LoraConfig,
    ModelInput,
    OptimStepResponse,
    PromptProvenanceSpan,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    TensorData,
    to_adam_params,
    to_datum,
    to_model_input,
    to_sampling_params,
    to_tensor_data,
)

T = TypeVar("T")

POLICY_LABEL = "policy"
"""The history's `model` column for the run's policy, as on a local engine."""

REFERENCE_LABEL = "reference"
"""The history's `model` column for the base model with adapters off, as on a local engine."""

SDK_LOSSES = tuple(name for name in typing.get_args(sdk.LossFnType) if name != "custom")
"""The losses the installed SDK can name on the wire (`custom` is `forward_backward_custom`)."""

DEFAULT_PROBE_INTERVAL_S = 5.0
HEALTH_TIMEOUT_S = 5.0


class RemoteUnsupportedError(ValueError):
    """Raised before anything is sent, for what the remote engine cannot do."""


class EngineUnreachableError(ConnectionError):
    """The service did not answer: at connect, or while an operation waited for its result."""


class RemoteProtocolError(RuntimeError):
    """The SDK failed inside on what the service answered: the two speak different protocol versions."""


@dataclasses.dataclass
class _RemoteRun:
    """One training run on the service, and the counters kept here from its completed operations."""

    model_id: str  # this session's id for it: its local folder's name, the W&B run id
    remote_id: str  # the service's model id
    client: tinker.TrainingClient
    lora: LoraConfig
    seed: int
    run_dir: Path
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


def _to_sdk_tensor(value: TensorData) -> sdk.TensorData:
    return sdk.TensorData.from_numpy(value.array)


def _to_sdk_span(span: Any) -> Any:
    cls = sdk.PromptProvenanceSpan if isinstance(span, PromptProvenanceSpan) else sdk.SampledProvenanceSpan
    return cls(sequence_id=span.sequence_id, offset=span.offset, length=span.length)


def _to_sdk_datum(datum: Datum) -> sdk.Datum:
    spans = datum.model_input_spans, datum.loss_fn_input_spans
    return sdk.Datum(
        model_input=sdk.ModelInput.from_ints(datum.model_input.to_ints()),
        loss_fn_inputs={key: _to_sdk_tensor(value) for key, value in datum.loss_fn_inputs.items()},
        model_input_spans=None if spans[0] is None else [_to_sdk_span(s) for s in spans[0]],
        loss_fn_input_spans=None if spans[1] is None else [_to_sdk_span(s) for s in spans[1]],
    )


def _to_sdk_sampling_params(params: SamplingParams) -> sdk.SamplingParams:
    return sdk.SamplingParams(
        max_tokens=params.max_tokens,
        seed=params.seed,
        stop=params.stop,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
    )


def _from_sdk_output(output: sdk.ForwardBackwardOutput) -> ForwardBackwardOutput:
    return ForwardBackwardOutput(
        loss_fn_output_type=output.loss_fn_output_type,
        loss_fn_outputs=[
            {key: to_tensor_data(key, value) for key, value in item.items()}
            for item in output.loss_fn_outputs
        ],
        metrics={key: float(value) for key, value in output.metrics.items()},
    )


class RemoteEngine:
    """A Tinker-compatible service driven through the `tinker` SDK, with the local engine's interface.

    Args:
        url: The service's base URL (`http://gpu-box:8000`).
        base_model: The base model to train, as the service names it (its capabilities list them).
        api_key: The key the service expects; None lets the SDK read `TINKER_API_KEY`.
        seed: Seeds each new run's LoRA initialisation when its `LoraConfig` gives no seed.
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
        self._runs: dict[str, _RemoteRun] = {}
        self._samplers: weakref.WeakKeyDictionary[Any, _Sampler] = weakref.WeakKeyDictionary()
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._info: sdk.GetInfoResponse | None = None

    # ------------------------------------------------------------------------------------------ identity

    @property
    def endpoint(self) -> str:
        """The service's URL."""
        return self._url

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
            self._tokenizer = self._any_run().client.get_tokenizer()
        return self._tokenizer

    @property
    def base_info(self) -> BaseModelInfo:
        """What the service says of the base model (`get_info`); sizes it does not report are 0."""
        if self._info is None:
            self._info = self._any_run().client.get_info()
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
    def device(self) -> torch.device:
        raise RemoteUnsupportedError(f"the model lives on the engine at {self._url}: it has no local device")

    @property
    def dtype(self) -> torch.dtype:
        raise RemoteUnsupportedError(
            f"the model lives on the engine at {self._url}: its dtype is not reported"
        )

    @property
    def history(self) -> MetricsHistory:
        """Every completed operation's metrics, in submission order, recorded in this process."""
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

    def _run(self, model_id: str) -> _RemoteRun:
        run = self._runs.get(model_id)
        if run is None:
            raise ValueError(f"no model {model_id!r} on this engine; it has {sorted(self._runs)}")
        return run

    def _any_run(self) -> _RemoteRun:
        if not self._runs:
            raise RuntimeError("create a model first: the tokenizer and model info come from one")
        return next(iter(self._runs.values()))

    def _policy(self, model_id: str, role: Role, what: str) -> _RemoteRun:
        run = self._run(model_id)
        if role is Role.CRITIC:
            raise RemoteUnsupportedError(f"{what}: the engine at {self._url} has no critic for {model_id!r}")
        if role is Role.REFERENCE:
            raise RemoteUnsupportedError(
                f"{what}: the Tinker API has no reference model (adapters off); sample the base model instead"
            )
        return run

    def _record(self, op: str, label: str, step: int, metrics: Mapping[str, float]) -> None:
        self._history.record(op, label, step, metrics)

    # ------------------------------------------------------------------------------------------ models

    def create_model(
        self,
        lora: LoraConfig,
        *,
        seed: int = 0,
        model_id: str | None = None,
        run_dir: str | Path | None = None,
        user_metadata: Mapping[str, str] | None = None,
    ) -> APIFuture[str]:
        """Add a LoRA training run on the service; resolves to this engine's id for it (default: a fresh
        run id, whose local folder, for the history and W&B files, is `<runs root>/<model id>`)."""
        model_id = model_id or new_run_id(self._config.base_model)
        layout = self._profile.adapter_layout
        ignored = [] if layout is None else layout.differences(lora)
        if ignored:
            raise RemoteUnsupportedError(
                f"{self._profile.name} at {self._url} would not build the adapter asked for: "
                f"{', '.join(ignored)}; pass a LoraConfig with those values"
            )
        if model_id in self._runs:
            raise ValueError(f"a model {model_id!r} already exists on this engine")
        folder = (Path(run_dir) if run_dir is not None else runs_root() / model_id).absolute()
        metadata = {str(k): str(v) for k, v in (user_metadata or {}).items()}
        init_seed = lora.seed if lora.seed is not None else seed

        def send() -> Any:
            return self._create_client(lora, init_seed, metadata)

        def finish(created: Any) -> str:
            client = self._wait("create_model", created)
            folder.mkdir(parents=True, exist_ok=True)
            self._runs[model_id] = _RemoteRun(
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

    def create_critic(self, model_id: str, lora: LoraConfig | None = None) -> APIFuture[None]:
        raise RemoteUnsupportedError(
            f"the engine at {self._url} is driven through the tinker SDK, which has no critic models: "
            "a remote session trains its policy only"
        )

    def delete_critic(self, model_id: str) -> APIFuture[None]:
        raise RemoteUnsupportedError(f"{model_id!r} has no critic on the engine at {self._url}")

    def model_ids(self) -> list[str]:
        return list(self._runs)

    def run_status(self, model_id: str) -> RunStatus:
        run = self._run(model_id)
        pinned = {s.pin.version for s in list(self._samplers.values()) if s.pin.model_id == model_id}
        return RunStatus(
            model_id=model_id,
            run_dir=run.run_dir,
            lora=run.lora,
            critic_lora=None,
            seed=run.seed,
            step=run.step,
            weights_version=run.weights_version,
            pending_backward_calls=run.pending_backward_calls,
            critic_step=None,
            critic_weights_version=None,
            live_versions=sorted({v for v in pinned if v is not None} | {run.weights_version}),
            user_metadata=dict(run.user_metadata),
            created_at=run.created_at,
            adapter=POLICY_LABEL,
            critic_adapter=None,
            snapshot_bytes=0,
        )

    def session_config(self, model_id: str) -> SessionConfig:
        run = self._run(model_id)
        return SessionConfig(
            base_model=self._config.base_model,
            lora=run.lora,
            seed=run.seed,
            device=self._url,
            dtype="remote",
            sampler="remote",
        )

    def remote_model_id(self, model_id: str) -> str:
        """The service's id for the run (what its `tinker://` paths start with)."""
        return self._run(model_id).remote_id

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
        run = self._policy(model_id, role, op)
        self._check_loss(loss_fn)
        converted = [to_datum(d) for d in data]
        datums = [_to_sdk_datum(d) for d in converted]
        if not datums:
            raise ValueError(f"{op} needs at least one datum")
        config = None if loss_fn_config is None else {k: float(v) for k, v in loss_fn_config.items()}
        method = run.client.forward_backward if op == "forward_backward" else run.client.forward

        def finish(sent: Any) -> ForwardBackwardOutput:
            output = _from_sdk_output(self._wait(op, sent))
            metrics = self._profile.rename_metrics(output.metrics)
            output = dataclasses.replace(
                output, metrics=with_client_metrics(metrics, output.loss_fn_outputs, converted)
            )
            if op == "forward_backward":
                run.pending_backward_calls += 1
            self._record(op, POLICY_LABEL, run.step, output.metrics)
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
        """The loss and per-datum outputs, without touching gradients."""
        return self._forward("forward", model_id, role, data, loss_fn, loss_fn_config)

    def forward_backward(
        self,
        model_id: str,
        role: Role,
        data: Sequence[Any],
        loss_fn: str,
        loss_fn_config: Mapping[str, float] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """The loss and outputs; the service accumulates the gradient for `optim_step`."""
        return self._forward("forward_backward", model_id, role, data, loss_fn, loss_fn_config)

    def forward_backward_custom(
        self, model_id: str, role: Role, data: Sequence[Any], loss_fn: CustomLossFn
    ) -> APIFuture[ForwardBackwardOutput]:
        """The SDK's custom loss: a forward pass on the service, the loss and its gradient with respect
        to the logprobs here, and a backward pass on the service with that gradient as weights."""
        run = self._policy(model_id, role, "forward_backward_custom")
        datums = [_to_sdk_datum(to_datum(d)) for d in data]

        def finish(sent: Any) -> ForwardBackwardOutput:
            output = _from_sdk_output(self._wait("forward_backward_custom", sent))
            run.pending_backward_calls += 1
            self._record("forward_backward_custom", POLICY_LABEL, run.step, output.metrics)
            return output

        return self._submit(lambda: run.client.forward_backward_custom(datums, loss_fn), finish)

    def optim_step(self, model_id: str, role: Role, adam_params: Any = None) -> APIFuture[OptimStepResponse]:
        """Apply the accumulated gradient with AdamW on the service; the step and weights version are
        counted here when it completes."""
        run = self._policy(model_id, role, "optim_step")
        params = to_adam_params(adam_params)
        sdk_params = sdk.AdamParams(**dataclasses.asdict(params))

        def finish(sent: Any) -> OptimStepResponse:
            response = self._wait("optim_step", sent)
            metrics = self._profile.rename_metrics(
                {key: float(value) for key, value in (response.metrics or {}).items()}
            )
            run.step += 1
            run.weights_version += 1
            run.pending_backward_calls = 0
            self._record(
                "optim_step",
                POLICY_LABEL,
                run.step,
                {**metrics, "learning_rate": params.learning_rate, "applied": 1.0},
            )
            return OptimStepResponse(metrics=metrics)

        return self._submit(lambda: run.client.optim_step(sdk_params), finish)

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

    def pin_sampler(self, model_id: str | None, version: int | None = None) -> APIFuture[SamplerPin]:
        """A sampling client on the service for the run's current weights (as the operations queued
        before leave them), or the base model (`model_id=None`). Past versions live on the service only
        as saved checkpoints: `version` must be None or the version the queued operations reach."""
        if model_id is None:
            if version is not None:
                raise ValueError("the base model has no version")
            return self._pin(
                lambda: self._service.create_sampling_client(base_model=self._config.base_model),
                SamplerPin,
            )
        run = self._run(model_id)
        if version is not None and version != run.weights_version:
            raise RemoteUnsupportedError(
                f"weights version {version}: the engine at {self._url} samples a run's current weights "
                f"(v{run.weights_version}) or saved checkpoints (save_weights_for_sampler), not past versions"
            )
        return self._pin(
            run.client.save_weights_and_get_sampling_client,
            lambda: SamplerPin(model_id=model_id, version=run.weights_version),
        )

    def pin_sampler_checkpoint(self, path: str | Path) -> APIFuture[SamplerPin]:
        """A sampling client on the service for saved weights, named by their `tinker://` path."""
        tinker_path = self._tinker_path(path, "a sampling client")
        return self._pin(
            lambda: self._service.create_sampling_client(model_path=tinker_path),
            lambda: SamplerPin(adapter=tinker_path),
        )

    def release_sampler(self, pin: APIFuture[SamplerPin], wait: bool = False) -> None:
        """Forget the sampling client (the service frees it with the SDK client); takes no lock."""
        with contextlib.suppress(KeyError, TypeError):
            del self._samplers[pin.future()]

    def _sampler(self, pin: APIFuture[SamplerPin]) -> Callable[[], _Sampler]:
        def get() -> _Sampler:
            sampler = self._samplers.get(pin.future())
            if sampler is None:
                raise ValueError("this sampling client's weights were released or never pinned")
            return sampler

        return get

    def sample(
        self,
        pin: APIFuture[SamplerPin],
        prompt: ModelInput | Sequence[int],
        num_samples: int,
        sampling_params: SamplingParams | Mapping[str, Any],
        include_prompt_logprobs: bool = False,
        *,
        prompt_logprobs_last_n: int | None = None,
        record_stability_info: bool = False,
        sequence_ids: Sequence[str] | None = None,
    ) -> APIFuture[SampleResponse]:
        """Sample on the service; the response reports the weights version its client pinned."""
        if record_stability_info or sequence_ids is not None:
            raise RemoteUnsupportedError(
                "stability records and caller-chosen sequence ids are kept by a local engine only"
            )
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be a positive integer, got {num_samples!r}")
        model_input = sdk.ModelInput.from_ints(to_model_input(prompt).to_ints())
        params = _to_sdk_sampling_params(to_sampling_params(sampling_params))
        sampler = self._sampler(pin)

        def send_with(held: _Sampler) -> tuple[_Sampler, Any, float]:
            sent = held.client.sample(
                model_input,
                num_samples,
                params,
                include_prompt_logprobs=include_prompt_logprobs,
                prompt_logprobs_last_n=prompt_logprobs_last_n,
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
            sequences = [
                SampledSequence(
                    tokens=list(s.tokens),
                    logprobs=list(s.logprobs or []),
                    stop_reason=s.stop_reason,
                    sequence_id=s.sequence_id,
                )
                for s in response.sequences
            ]
            self._record_sample(held.pin, sequences, seconds)
            return SampleResponse(
                sequences=sequences,
                weights_version=held.pin.version,
                prompt_logprobs=(
                    self._profile.aligned_prompt_logprobs(response.prompt_logprobs, model_input.length)
                    if include_prompt_logprobs
                    else None
                ),
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
        run = self._runs.get(pin.model_id) if pin.model_id is not None else None
        label = REFERENCE_LABEL if pin.is_base else (pin.adapter or "")
        if run is not None and pin.version is not None:
            label = POLICY_LABEL
            metrics["weights_version"] = float(pin.version)
            metrics["staleness"] = float(run.weights_version - pin.version)
        self._record("sample", label, run.step if run is not None else 0, metrics)

    def compute_logprobs(
        self,
        pin: APIFuture[SamplerPin],
        prompt: ModelInput | Sequence[int],
        *,
        prompt_logprobs_last_n: int | None = None,
    ) -> APIFuture[list[float | None]]:
        """The logprob of every prompt token given the ones before it, computed on the service."""
        model_input = sdk.ModelInput.from_ints(to_model_input(prompt).to_ints())
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
        """Save the run's state on the service; `.path` is its `tinker://` path (no local folder)."""
        run = self._run(model_id)
        metadata = None if user_metadata is None else {str(k): str(v) for k, v in user_metadata.items()}

        def finish(sent: Any) -> SaveWeightsResponse:
            path = self._wait("save_state", sent).path
            run.saved_steps[path] = run.step
            self._record("save_state", POLICY_LABEL, run.step, {})
            self._history.event("checkpoint", {"name": name, "kind": "state", "path": path, "step": run.step})
            return SaveWeightsResponse(path=path)

        return self._submit(
            lambda: run.client.save_state(
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
        """Save the policy's adapter for sampling on the service; `.path` is its `tinker://` path."""
        run = self._run(model_id)
        if overwrite:
            raise RemoteUnsupportedError("the tinker SDK's save_weights_for_sampler has no overwrite")
        metadata = None if user_metadata is None else {str(k): str(v) for k, v in user_metadata.items()}

        def finish(sent: Any) -> SaveWeightsForSamplerResponse:
            path = self._wait("save_weights_for_sampler", sent).path
            run.saved_steps[path] = run.step
            self._record("save_weights_for_sampler", POLICY_LABEL, run.step, {})
            self._history.event(
                "checkpoint", {"name": name, "kind": "sampler", "path": path, "step": run.step}
            )
            return SaveWeightsForSamplerResponse(path=path)

        return self._submit(
            lambda: run.client.save_weights_for_sampler(
                name, ttl_seconds=ttl_seconds, user_metadata=metadata
            ),
            finish,
        )

    def load_state(self, model_id: str, path: str | Path, restore: Restore) -> APIFuture[LoadWeightsResponse]:
        """Load a `tinker://` state checkpoint into a new model on the service, which the run continues
        on: the weights (`Restore.WEIGHTS`, with a fresh optimizer state), or the weights and optimizer
        state (otherwise). Tinker services accept a load only as a model's first request (SkyRL,
        hosted Tinker), so the new model is created and loaded here, in the caller's thread, before
        any later operation is sent; a failed load leaves the run on its model, unchanged. The model it
        was on is freed where the service offers a way, after the operations queued on it. The weights
        version moves on by one; the step becomes the saved one when this engine saved the checkpoint
        and the optimizer state is restored. The history's `load_state` event names both models."""
        run = self._run(model_id)
        tinker_path = self._tinker_path(path, "load_state")
        with self._submitting:
            self.check_open()
            client = self._wait("load_state", self._create_client(run.lora, run.seed, run.user_metadata))
            load = client.load_state if restore is Restore.WEIGHTS else client.load_state_with_optimizer
            try:
                with warnings.catch_warnings():  # SDK 0.38 would have a load create the model; SkyRL
                    warnings.simplefilter("ignore", FutureWarning)  # refuses that, and the two-step way works
                    sent = load(tinker_path)
                self._wait("load_state", sent)
            except Exception:
                self._profile.free_models(self._url, [client.model_id])
                raise
            replaced, run.client, run.remote_id = run.remote_id, client, client.model_id
            run.earlier_remote_ids.append(replaced)

        def finish(_: Any) -> LoadWeightsResponse:
            run.weights_version += 1
            run.pending_backward_calls = 0
            if restore is not Restore.WEIGHTS:
                run.step = run.saved_steps.get(tinker_path, run.step)
            self._record(
                "load_state",
                POLICY_LABEL,
                run.step,
                {"new_server_model": 1.0, "optimizer_restored": float(restore is not Restore.WEIGHTS)},
            )
            self._history.event(
                "load_state",
                {"path": tinker_path, "restore": restore.value, "model": run.remote_id, "replaced": replaced},
            )
            self._profile.free_models(self._url, [replaced])
            return LoadWeightsResponse(path=tinker_path)

        return self._submit(lambda: None, finish)

    def _rest_client(self) -> tinker.RestClient:
        if self._rest is None:
            self._rest = tinker.RestClient(base_url=self._sdk_url, api_key=self._api_key)
        return self._rest

    def list_checkpoints(self, model_id: str) -> list[CheckpointInfo]:
        """The run's checkpoints on the service, those of the models it was on before a `load_state`
        included, oldest first (`tinker_path` names each; `path` is its checkpoint id, since there is
        no local folder)."""
        run = self._run(model_id)
        listed = [
            checkpoint
            for remote_id in [*run.earlier_remote_ids, run.remote_id]
            for checkpoint in self._wait_here(
                "list_checkpoints", self._rest_client().list_checkpoints(training_run_id=remote_id)
            ).checkpoints
        ]
        infos = [
            CheckpointInfo(
                name=checkpoint.checkpoint_id.rsplit("/", 1)[-1],
                path=Path(checkpoint.checkpoint_id),
                kind="state" if checkpoint.checkpoint_type == "training" else "sampler",
                step=run.saved_steps.get(checkpoint.tinker_path, 0),
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
        run = self._run(model_id)
        checkpoint_id = f"{'weights' if kind == 'state' else 'sampler_weights'}/{name}"
        saved = [path for path in run.saved_steps if path.endswith(f"/{checkpoint_id}")]
        owner = saved[-1].removeprefix("tinker://").split("/", 1)[0] if saved else run.remote_id
        return self._submit(
            lambda: None,
            lambda _: self._wait(
                "delete_checkpoint", self._rest_client().delete_checkpoint(owner, checkpoint_id)
            ),
        )

    def cleanup_checkpoints(self, model_id: str) -> APIFuture[list[Path]]:
        raise RemoteUnsupportedError(f"the engine at {self._url} keeps its own checkpoint folders tidy")

    def export_merged(self, model_id: str, path: str | Path) -> APIFuture[Path]:
        raise RemoteUnsupportedError(
            f"the weights live on the engine at {self._url}: export a merged model there, or download the "
            "sampler weights (RestClient.get_checkpoint_archive_url) and merge them with peft"
        )

    # ------------------------------------------------------------------------------------------ misc

    def record(self, op: str, label: str, step: int, metrics: Mapping[str, float]) -> APIFuture[None]:
        """Append a row to the history after everything queued before it (e.g. a run step's metrics)."""
        values = metric_values(metrics)
        return self._submit(lambda: None, lambda _: self._record(op, label, step, values))

    def state_digest(self, model_id: str | None = None, role: Role | None = None) -> str:
        raise RemoteUnsupportedError(
            f"state_digest hashes local tensors; the training state lives on the engine at {self._url}"
        )

    def inspect(self, model_id: str, role: Role = Role.POLICY) -> Any:
        raise RemoteUnsupportedError(
            f"inspect copies local tensors; the model lives on the engine at {self._url}"
        )

    @property
    def torch_model(self) -> torch.nn.Module:
        raise RemoteUnsupportedError(f"there is no local torch model: it lives on the engine at {self._url}")

    def close(self) -> None:
        """Finish the queued operations, free the runs' models where the service offers a way, then
        end the SDK session (a service that frees its models with the session does so then). Safe to
        call again."""
        if self._worker.closed:
            return
        self._worker.close()
        self._profile.free_models(self._url, [run.remote_id for run in self._runs.values()])
        for sink in list(self._history.sinks):
            sink.close()
        self._history.sinks.clear()
        self._samplers.clear()
        self._runs.clear()
        with contextlib.suppress(Exception):  # a service that is gone has nothing left to free
            self._service.close("success").result(timeout=HEALTH_TIMEOUT_S)
        if self._relay is not None:
            self._relay.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self._runs)} model(s)"
        return f"RemoteEngine({self._config.base_model!r} at {self._url}, {state})"
