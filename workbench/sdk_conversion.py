"""Conversion between workbench's types (`workbench.types`) and the `tinker` SDK's objects, dicts and lists.

Into ours: objects built with the real SDK are accepted wherever ours are, and so are plain dicts and
lists: `to_datum`, `to_model_input`, `to_tensor_data`, `to_provenance_span`, `to_adam_params`,
`to_sampling_params` and `to_lora_config` turn any of them into ours. Every place that receives a value
from a caller (the clients, the engines, the server) converts it here; the types themselves coerce only
plain forms and know nothing of the SDK. The SDK is not imported for that:
when a caller holds an SDK object, the SDK is already in `sys.modules`, and that module's classes are what
we check against, so the local engine runs without loading the SDK.

Into the SDK's (`to_sdk_*`) and back from its results (`from_sdk_*`): what the remote engine
(`workbench.engine.remote`) sends through the SDK and reads from it. These import the SDK when first
called.

The server's wire format (the SDK's protobuf and JSON bodies) is read and written in
`workbench.server.wire`.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from workbench.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    LoraConfig,
    ModelInput,
    PromptAltTokens,
    PromptProvenanceSpan,
    ProvenanceSpan,
    SampledProvenanceSpan,
    SampledSequence,
    SamplingParams,
    TensorData,
    as_model_input,
    as_provenance_span,
    as_tensor_data,
)

if TYPE_CHECKING:
    from tinker import types as sdk


def _tinker_class(name: str) -> type | None:
    """The `tinker` SDK's class of that name if the SDK is loaded, else None."""
    module = sys.modules.get("tinker")
    return None if module is None else getattr(module, name)


# ---------------------------------------------------------------------------------------------- into ours


def to_model_input(value: Any) -> ModelInput:
    """Turn a `ModelInput` (ours or the SDK's), a list of token ids, or a dict with `chunks` into ours.

    Malformed input raises ValueError saying what is wrong (the caller names the field).
    """
    tinker_model_input = _tinker_class("ModelInput")
    if tinker_model_input is not None and isinstance(value, tinker_model_input):
        return ModelInput.from_ints(value.to_ints())
    return as_model_input(value)


def to_tensor_data(key: str, value: Any) -> TensorData:
    """Turn a `loss_fn_inputs` value (ours, the SDK's, torch, numpy or a list) into `TensorData`.

    Token ids (`target_tokens`) must be integers: a bool or a float raises ValueError naming the input.
    """
    tinker_tensor_data = _tinker_class("TensorData")
    if tinker_tensor_data is not None and isinstance(value, tinker_tensor_data):
        value = TensorData(value.to_numpy(), value.dtype)
    return as_tensor_data(key, value)


def to_provenance_span(value: Any) -> ProvenanceSpan:
    """Turn a provenance span (ours or the SDK's `PromptProvenanceSpan` / `SampledProvenanceSpan`) into ours."""
    for ours in (PromptProvenanceSpan, SampledProvenanceSpan):
        sdk_class = _tinker_class(ours.__name__)
        if sdk_class is not None and isinstance(value, sdk_class):
            return ours(sequence_id=value.sequence_id, offset=value.offset, length=value.length)
    return as_provenance_span(value)


def to_target_ids(value: Any) -> np.ndarray:
    """`target_prompt_logprobs` (ours or the SDK's `TensorData`, dense or the SDK's sparse CSR, a torch
    tensor, a numpy array or nested lists) as a numpy array: the SDK's unlisted cells are −1 (nothing
    asked), since 0 is a token id."""
    tinker_tensor_data = _tinker_class("TensorData")
    if tinker_tensor_data is not None and isinstance(value, tinker_tensor_data):
        if value.dtype != "int64":
            raise ValueError(f"target_prompt_logprobs must be int64 token ids, got {value.dtype}")
        return value.to_numpy(pad_value=-1)
    if isinstance(value, TensorData):
        return value.to_numpy()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _spans(spans: Any) -> tuple[ProvenanceSpan, ...] | None:
    return None if spans is None else tuple(to_provenance_span(span) for span in spans)


_DATUM_KEYS = ("model_input", "loss_fn_inputs", "model_input_spans", "loss_fn_input_spans")


def to_datum(value: Any) -> Datum:
    """Turn a `Datum` (ours or the SDK's, provenance spans included) or a dict with `model_input`,
    `loss_fn_inputs` and optionally the two span lists (each field ours, the SDK's or a plain form)
    into ours."""
    if isinstance(value, Datum):
        return value
    tinker_datum = _tinker_class("Datum")
    if tinker_datum is not None and isinstance(value, tinker_datum):
        fields = {name: getattr(value, name) for name in _DATUM_KEYS}
    elif isinstance(value, Mapping):
        unknown = set(value) - set(_DATUM_KEYS)
        if unknown or "model_input" not in value:
            raise ValueError(
                f"a datum dict has keys {list(_DATUM_KEYS)} (spans optional), got {sorted(value)}"
            )
        fields = {name: value.get(name) for name in _DATUM_KEYS}
    else:
        raise ValueError(f"a datum must be a Datum or a dict, got {type(value).__name__}")
    try:
        model_input = to_model_input(fields["model_input"])
    except ValueError as error:
        raise ValueError(f"model_input: {error}") from None
    return Datum(
        model_input=model_input,
        loss_fn_inputs={
            key: to_tensor_data(key, item) for key, item in dict(fields["loss_fn_inputs"] or {}).items()
        },
        model_input_spans=_spans(fields["model_input_spans"]),
        loss_fn_input_spans=_spans(fields["loss_fn_input_spans"]),
    )


def _dataclass_from(cls: type, value: Any, sdk_name: str, argument: str) -> Any:
    """Build our config dataclass `cls` from itself, the SDK's same-named object, or a dict."""
    if isinstance(value, cls):
        return value
    sdk_class = _tinker_class(sdk_name)
    if sdk_class is not None and isinstance(value, sdk_class):
        value = value.model_dump()
    if isinstance(value, Mapping):
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(value) - names
        if unknown:
            raise ValueError(f"unknown {cls.__name__} field(s) {sorted(unknown)}; known: {sorted(names)}")
        return cls(**value)  # a None is passed on: the dataclass refuses it where it means nothing
    raise ValueError(
        f"{argument} must be a {cls.__name__}, the SDK's {sdk_name} or a dict, got {type(value).__name__}"
    )


def to_adam_params(value: Any) -> AdamParams:
    return _dataclass_from(AdamParams, AdamParams() if value is None else value, "AdamParams", "adam_params")


def to_sampling_params(value: Any) -> SamplingParams:
    return _dataclass_from(SamplingParams, value, "SamplingParams", "sampling_params")


def to_lora_config(value: Any) -> LoraConfig:
    return _dataclass_from(LoraConfig, value, "LoraConfig", "lora")


# ---------------------------------------------------------------------------------------------- the SDK's


def _sdk() -> Any:
    """The SDK's types module (`tinker.types`), imported when a conversion to the SDK first needs it."""
    from tinker import types

    return types


def to_sdk_model_input(model_input: ModelInput) -> sdk.ModelInput:
    return _sdk().ModelInput.from_ints(model_input.to_ints())


def to_sdk_tensor_data(value: TensorData) -> sdk.TensorData:
    return _sdk().TensorData.from_numpy(value.array)


def to_sdk_provenance_span(span: ProvenanceSpan) -> Any:
    cls = (
        _sdk().PromptProvenanceSpan
        if isinstance(span, PromptProvenanceSpan)
        else _sdk().SampledProvenanceSpan
    )
    return cls(sequence_id=span.sequence_id, offset=span.offset, length=span.length)


def to_sdk_datum(datum: Datum) -> sdk.Datum:
    spans = datum.model_input_spans, datum.loss_fn_input_spans
    return _sdk().Datum(
        model_input=to_sdk_model_input(datum.model_input),
        loss_fn_inputs={key: to_sdk_tensor_data(value) for key, value in datum.loss_fn_inputs.items()},
        model_input_spans=None if spans[0] is None else [to_sdk_provenance_span(s) for s in spans[0]],
        loss_fn_input_spans=None if spans[1] is None else [to_sdk_provenance_span(s) for s in spans[1]],
    )


def to_sdk_sampling_params(params: SamplingParams) -> sdk.SamplingParams:
    return _sdk().SamplingParams(
        max_tokens=params.max_tokens,
        seed=params.seed,
        stop=params.stop,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
    )


def to_sdk_token_ids(value: Any) -> sdk.TensorData:
    """Token ids as the SDK's int64 `TensorData`, from its own, ours, a tensor, an array or nested lists."""
    if isinstance(value, _sdk().TensorData):
        return value
    array = value.to_numpy() if isinstance(value, TensorData) else torch.as_tensor(value).cpu().numpy()
    return _sdk().TensorData.from_numpy(array.astype(np.int64))


def to_sdk_adam_params(params: AdamParams) -> sdk.AdamParams:
    return _sdk().AdamParams(**dataclasses.asdict(params))


def from_sdk_forward_backward_output(output: sdk.ForwardBackwardOutput) -> ForwardBackwardOutput:
    return ForwardBackwardOutput(
        loss_fn_output_type=output.loss_fn_output_type,
        loss_fn_outputs=[
            {key: to_tensor_data(key, value) for key, value in item.items()}
            for item in output.loss_fn_outputs
        ],
        metrics={key: float(value) for key, value in output.metrics.items()},
    )


def from_sdk_sampled_sequence(sequence: sdk.SampledSequence) -> SampledSequence:
    return SampledSequence(
        tokens=list(sequence.tokens),
        logprobs=list(sequence.logprobs or []),
        stop_reason=sequence.stop_reason,
        sequence_id=sequence.sequence_id,
        topk_logprobs=sequence.topk_logprobs,
    )


def from_sdk_prompt_alt_tokens(alt: sdk.PromptAltTokens | None) -> PromptAltTokens | None:
    if alt is None:
        return None
    return PromptAltTokens(
        tokens=TensorData(alt.tokens.to_numpy(), "int64"),
        logprobs=TensorData(alt.logprobs.to_numpy(), "float32"),
    )
