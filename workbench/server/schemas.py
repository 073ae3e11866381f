"""The JSON bodies the server accepts, field by field, as the `tinker` SDK (0.25 to 0.38) sends them.

Every body is checked against its schema before anything happens: a wrong type or a field this server
does not know is refused with a message naming the field (`lora_config.rank: ...`), never ignored,
since a field the server silently dropped could change what the client gets. Fields the SDK sends that
the server does not implement are declared, and the operations refuse them when they are set to
anything but their default. The forward_backward body is protobuf and is read by `wire`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from workbench.engine.samplers.sample_request import SampleRequest
from workbench.server.errors import RequestError
from workbench.types import ModelInput, SamplingParams

Body = TypeVar("Body", bound="StrictBody")

Counter = Annotated[int, Field(ge=0, lt=2**63)]
"""A client's count (seq_id, model_seq_id, ...): what a 64-bit id holds, never a number that sizes
anything on the server."""


class StrictBody(BaseModel):
    """A request body: no unknown fields, no coercion between types."""

    model_config = ConfigDict(extra="forbid", strict=True, protected_namespaces=())


def _where(location: tuple[Any, ...]) -> str:
    return ".".join(str(part) for part in location) or "body"


def _check_strings(value: Any, location: tuple[Any, ...]) -> None:
    """Every string in a parsed body, keys included, is valid Unicode: JSON can carry a lone surrogate
    ("\\ud800"), which no response could then write out."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise RequestError(
                f"{_where(location)}: the string is not valid Unicode (it holds a lone surrogate)"
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_strings(key, (*location, "(key)"))
            _check_strings(item, (*location, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_strings(item, (*location, index))


def parse_body(schema: type[Body], raw: bytes) -> Body:
    """Parse a JSON body against its schema; a `RequestError` names every field that is wrong."""
    try:
        data = json.loads(raw or b"{}")
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RequestError(f"the request body is not valid JSON: {error}") from None
    except RecursionError:
        raise RequestError("the request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        _check_strings(data, ())
    except RecursionError:
        raise RequestError("the request body is nested too deeply") from None
    try:
        return schema.model_validate(data)
    except ValidationError as error:
        problems = [
            f"{_where(item['loc'])}: unknown field"
            if item["type"] == "extra_forbidden"
            else f"{_where(item['loc'])}: {item['msg']}"
            for item in error.errors()
        ]
        raise RequestError(f"invalid {schema.__name__} request: " + "; ".join(problems)) from None


# ---------------------------------------------------------------------------------------------- sessions


class ClientConfigRequest(StrictBody):
    sdk_version: str | None = None


class CreateSessionRequest(StrictBody):
    tags: list[str] = []
    user_metadata: dict[str, Any] | None = None
    sdk_version: str | None = None
    project_id: str | None = None
    display_name: str | None = None
    type: Literal["create_session"] = "create_session"


class SessionHeartbeatRequest(StrictBody):
    session_id: str
    type: Literal["session_heartbeat"] = "session_heartbeat"


class FinishSessionRequest(StrictBody):
    reason: dict[str, Any] | None = None
    detail: Any = None


class RetrieveFutureRequest(StrictBody):
    request_id: str
    allow_metadata_only: bool = False


# ---------------------------------------------------------------------------------------------- models


class LoraConfigBody(StrictBody):
    rank: int = 32
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfigBody(StrictBody):
    type: str = "adamw"
    version: int | None = None  # the Dimuon optimizer's; refused with it


class CreateModelRequest(StrictBody):
    session_id: str
    model_seq_id: Counter
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfigBody | None = None
    optimizer_config: OptimizerConfigBody | None = None
    # SkyRL's extension (its PPO example sends it as an extra body field): "critic" makes a value model.
    model_role: Literal["policy", "critic"] = "policy"
    type: Literal["create_model"] = "create_model"


class GetInfoRequest(StrictBody):
    model_id: str
    type: Literal["get_info"] | None = None


# ---------------------------------------------------------------------------------------------- training


class AdamParamsBody(StrictBody):
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0
    type: Literal["adam"] | None = None


class OptimStepRequest(StrictBody):
    model_id: str
    seq_id: Counter
    adam_params: AdamParamsBody | None = None
    optimizer_params: dict[str, Any] | None = None  # another optimizer's (Dimuon): refused
    type: Literal["optim_step"] = "optim_step"


class SaveWeightsRequest(StrictBody):
    model_id: str
    path: str | None = None
    seq_id: Counter
    ttl_seconds: int | None = None
    overwrite: bool = False
    user_metadata: dict[str, str] | None = None
    type: Literal["save_weights"] = "save_weights"


class SaveWeightsForSamplerRequest(StrictBody):
    model_id: str
    path: str | None = None  # None: an ephemeral sampler of the current weights
    sampling_session_seq_id: Counter | None = None
    kind: Literal["snapshot", "inflight"] = "snapshot"
    seq_id: Counter
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] | None = None
    type: Literal["save_weights_for_sampler"] = "save_weights_for_sampler"


class SaveWeightsExternalRequest(StrictBody):
    model_id: str
    path: str
    seq_id: Counter
    ttl_seconds: int | None = None
    age_encryption_recipients: list[str] | None = None
    type: Literal["save_weights_external"] = "save_weights_external"


class LoadWeightsRequest(StrictBody):
    """Either into an existing model (`model_id` + `seq_id`) or creating one (`session_id` +
    `model_seq_id`: SDK 0.38's `create_training_client_from_state*`)."""

    model_id: str | None = None
    seq_id: Counter | None = None
    session_id: str | None = None
    model_seq_id: Counter | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    path: str
    optimizer: bool
    optimizer_config: OptimizerConfigBody | None = None
    weights_access_token: str | None = None
    type: Literal["load_weights"] = "load_weights"


class WeightsInfoRequest(StrictBody):
    tinker_path: str


# ---------------------------------------------------------------------------------------------- sampling


class CreateSamplingSessionRequest(StrictBody):
    session_id: str
    sampling_session_seq_id: Counter
    base_model: str | None = None
    model_path: str | None = None
    type: Literal["create_sampling_session"] = "create_sampling_session"


class TextChunkBody(StrictBody):
    tokens: list[int]
    type: Literal["encoded_text"] = "encoded_text"


class ModelInputBody(StrictBody):
    chunks: list[dict[str, Any]]  # each checked by `text_tokens`, which names a chunk of another kind

    def text_tokens(self) -> list[int]:
        tokens: list[int] = []
        for index, chunk in enumerate(self.chunks):
            kind = chunk.get("type", "encoded_text")
            if kind != "encoded_text":
                raise RequestError(
                    f"prompt.chunks[{index}] is a {kind!r} chunk; this server reads text chunks only"
                )
            try:
                tokens.extend(TextChunkBody.model_validate(chunk).tokens)
            except ValidationError as error:
                item = error.errors()[0]
                raise RequestError(f"prompt.chunks[{index}].{_where(item['loc'])}: {item['msg']}") from None
        return tokens


class SamplingParamsBody(StrictBody):
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class SampleRequestBody(StrictBody):
    """The body of `/api/v1/asample`: the SDK's `SampleRequest` as JSON, with the sampling session and
    `seq_id` that place it among the session's requests."""

    num_samples: int = 1
    prompt: ModelInputBody
    sampling_params: SamplingParamsBody
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: Counter | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: dict[str, Any] | None = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    record_stability_info: bool | None = None
    type: Literal["sample"] = "sample"

    def sample_request(
        self, sequence_ids: Sequence[str] | None, target_prompt_ids: np.ndarray | None
    ) -> SampleRequest:
        """The engine's request: this body's fields, the sequence ids the server promised the client,
        and the target ids `wire.target_ids` read from `target_prompt_logprobs` (the SDK's JSON tensor,
        dense or sparse). Raises ValueError naming a bad field."""
        return SampleRequest(
            ModelInput.from_ints(self.prompt.text_tokens()),
            self.num_samples,
            SamplingParams(**self.sampling_params.model_dump()),
            bool(self.prompt_logprobs),
            prompt_logprobs_last_n=self.prompt_logprobs_last_n,
            record_stability_info=bool(self.record_stability_info),
            sequence_ids=None if sequence_ids is None else tuple(sequence_ids),
            topk_prompt_logprobs=self.topk_prompt_logprobs,
            topk_sample_logprobs=self.topk_sample_logprobs,
            target_prompt_logprobs=target_prompt_ids,
            prompt_alt_tokens_k=self.prompt_alt_tokens_k,
        )
