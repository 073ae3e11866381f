"""Tinker-shaped data types.

The names, fields and defaults follow the `tinker` SDK (0.38) so that code written against Tinker reads
the same here: a `Datum` is a `ModelInput` plus a dict of per-position `loss_fn_inputs`; results are
`ForwardBackwardOutput`, `OptimStepResponse`, `SampleResponse`. Objects built with the real SDK are
accepted wherever ours are, converted where they come in: `workbench.sdk_conversion` turns an SDK
object into ours (and ours into the SDK's), and the engines, clients and server call it on what they
receive. These classes know nothing of the SDK: a `Datum` coerces its fields from plain forms only
(`as_model_input`, `as_tensor_data`, `as_provenance_span`: ours, dicts, lists, numpy arrays, torch tensors).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

import numpy as np
import torch

TensorDtype = Literal["int64", "float32"]
StopReason = Literal["stop", "length"]

# The dtype a raw list gets for each known `loss_fn_inputs` key (the SDK uses the same table).
INPUT_DTYPES: dict[str, TensorDtype] = {
    "target_tokens": "int64",
    "weights": "float32",
    "advantages": "float32",
    "logprobs": "float32",
    "values": "float32",
    "returns": "float32",
    "clip_low_threshold": "float32",
    "clip_high_threshold": "float32",
    "sequence_ratio_mask": "float32",
}


FLOAT32_TINY = float(np.finfo(np.float32).tiny)
"""The smallest positive normal float32: a smaller optimizer `eps` rounds to zero in float32 weights."""

MIN_TEMPERATURE = 1e-6
"""The smallest positive sampling temperature: a smaller one samples as greedily as 0 does, and far
smaller ones (1e-40) overflow float32 logits / temperature."""

MAX_LEARNING_RATE = 1.0
"""The largest learning rate: an AdamW step moves each weight by up to about the learning rate, and
beyond 1 that dwarfs the weights themselves (1e30 turns the model's outputs to NaN in one step)."""

MAX_LORA_RANK = 1024
"""The largest LoRA rank: far above what post-training uses (Tinker's models take up to 128 or so), and
low enough that a mistyped rank is refused instead of allocating matrices the size of the machine."""


def check_text(text: str, where: str) -> str:
    """A string that can be written out: valid Unicode, which a lone surrogate ("\\ud800", which JSON can
    carry) is not; stored, it would break every listing that shows it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{where} is not valid Unicode (it holds a lone surrogate): {text!r}") from None
    return text


# ---------------------------------------------------------------------------------------------- inputs


def to_token_ids(values: Any) -> tuple[int, ...]:
    """Token ids as Python ints, from a sequence of integers (Python's or numpy's).

    A bool or a float is not a token id, not even `True` or `6.0`: raises ValueError naming the first
    one and its position.
    """
    if isinstance(values, (np.ndarray, torch.Tensor)):
        values = values.tolist()
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Sequence):
        raise ValueError(f"token ids must be a list of integers, got {type(values).__name__} {values!r}")
    if all(type(token) is int for token in values):  # the common case, checked fast
        return tuple(values)
    for position, token in enumerate(values):
        if isinstance(token, (bool, np.bool_)) or not isinstance(token, (int, np.integer)):
            raise ValueError(f"token ids must be integers, got {token!r} at position {position}")
    return tuple(int(token) for token in values)


@dataclass(frozen=True)
class EncodedTextChunk:
    """A run of token ids inside a `ModelInput`."""

    tokens: tuple[int, ...]
    type: Literal["encoded_text"] = "encoded_text"

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", to_token_ids(self.tokens))

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class ModelInput:
    """The tokens a model reads, as a list of chunks (Tinker's `ModelInput`; text chunks only)."""

    chunks: tuple[EncodedTextChunk, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "chunks", tuple(self.chunks))

    @classmethod
    def from_ints(cls, tokens: Sequence[int]) -> ModelInput:
        return cls(chunks=(EncodedTextChunk(tokens=to_token_ids(tokens)),))

    @classmethod
    def empty(cls) -> ModelInput:
        return cls(chunks=())

    def to_ints(self) -> list[int]:
        return [token for chunk in self.chunks for token in chunk.tokens]

    @property
    def length(self) -> int:
        return sum(chunk.length for chunk in self.chunks)

    def append(self, chunk: EncodedTextChunk) -> ModelInput:
        return ModelInput(chunks=(*self.chunks, chunk))

    def append_int(self, token: int) -> ModelInput:
        return self.append(EncodedTextChunk(tokens=(token,)))


@dataclass(frozen=True, eq=False)
class TensorData:
    """A dense tensor as Tinker ships it: flat data, a dtype (`int64` or `float32`) and a shape.

    Backed by a numpy array; `.data` gives the flat list, `.tolist()` the nested list.
    """

    array: np.ndarray = field(repr=False)
    dtype: TensorDtype = "float32"

    def __init__(self, data: Any = None, dtype: TensorDtype = "float32", shape: Sequence[int] | None = None):
        if dtype not in ("int64", "float32"):
            raise ValueError(f"TensorData dtype must be 'int64' or 'float32', got {dtype!r}")
        array = np.asarray([] if data is None else data, dtype=np.int64 if dtype == "int64" else np.float32)
        if shape is not None:
            array = array.reshape(tuple(shape))
        object.__setattr__(self, "array", array)
        object.__setattr__(self, "dtype", dtype)

    @property
    def shape(self) -> list[int]:
        return list(self.array.shape)

    @property
    def data(self) -> list[Any]:
        return self.array.reshape(-1).tolist()

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> TensorData:
        if array.dtype.kind in "iub":
            return cls(array, "int64")
        if array.dtype.kind == "f":
            return cls(array, "float32")
        raise ValueError(f"TensorData holds integers or floats, got numpy dtype {array.dtype}")

    @classmethod
    def from_torch(cls, tensor: torch.Tensor) -> TensorData:
        tensor = tensor.detach().cpu()
        if tensor.dtype.is_floating_point:
            tensor = tensor.float()
        return cls.from_numpy(tensor.numpy())

    def to_numpy(self) -> np.ndarray:
        return self.array

    def to_torch(self) -> torch.Tensor:
        return torch.from_numpy(self.array.copy())

    def tolist(self) -> list[Any]:
        return self.array.tolist()

    def __len__(self) -> int:
        return len(self.array)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, TensorData)
            and self.dtype == other.dtype
            and np.array_equal(self.array, other.array)
        )

    def __repr__(self) -> str:
        return f"TensorData(dtype={self.dtype!r}, shape={self.shape}, data={self.array.tolist()!r})"


@dataclass(frozen=True, kw_only=True)
class PromptProvenanceSpan:
    """A run of a datum's positions that were part of a sampling request's prompt: positions
    `[offset, offset + length)` of the prompt of the request that sampled sequence `sequence_id`."""

    sequence_id: str
    offset: int = 0
    length: int

    def __post_init__(self) -> None:
        _check_span(self)


@dataclass(frozen=True, kw_only=True)
class SampledProvenanceSpan:
    """A run of a datum's positions that reproduce sampled tokens: positions `[offset, offset + length)`
    of the tokens of sequence `sequence_id` (`SampledSequence.sequence_id`)."""

    sequence_id: str
    offset: int = 0
    length: int

    def __post_init__(self) -> None:
        _check_span(self)


ProvenanceSpan = PromptProvenanceSpan | SampledProvenanceSpan


def _check_span(span: PromptProvenanceSpan | SampledProvenanceSpan) -> None:
    name = type(span).__name__
    if not isinstance(span.sequence_id, str) or not span.sequence_id:
        raise ValueError(f"{name}.sequence_id must be a non-empty string, got {span.sequence_id!r}")
    for field_name in ("offset", "length"):
        value = getattr(span, field_name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}.{field_name} must be an integer >= 0, got {value!r}")


# ---------------------------------------------------------------------------------------------- conversions


def as_model_input(value: Any) -> ModelInput:
    """A `ModelInput` from itself, a list (array, tensor) of token ids, or a dict with `chunks`.

    Malformed input raises ValueError saying what is wrong (the caller names the field).
    """
    if isinstance(value, ModelInput):
        return value
    if isinstance(value, Mapping):
        given = value.get("chunks", ())
        if isinstance(given, (str, bytes, Mapping)) or not isinstance(given, Sequence):
            raise ValueError(f"'chunks' must be a list of chunks, got {given!r}")
        chunks = []
        for index, chunk in enumerate(given):
            if not isinstance(chunk, Mapping) or "tokens" not in chunk:
                raise ValueError(
                    f"chunk {index} must be a dict with 'tokens' (a list of token ids), got {chunk!r}"
                )
            kind = chunk.get("type", "encoded_text")
            if kind != "encoded_text":
                raise ValueError(f"only text chunks are supported, got a {kind!r} chunk")
            try:
                chunks.append(EncodedTextChunk(tokens=chunk["tokens"]))
            except ValueError as error:
                raise ValueError(f"chunk {index}: {error}") from None
        return ModelInput(chunks=tuple(chunks))
    if isinstance(value, (list, tuple, np.ndarray, torch.Tensor)):
        return ModelInput.from_ints(value)
    raise ValueError(f"model_input must be a ModelInput or a list of token ids, got {_described(value)}")


def as_tensor_data(key: str, value: Any) -> TensorData:
    """A `loss_fn_inputs` value (`TensorData`, torch, numpy or a list) as `TensorData`.

    Token ids (`target_tokens`) must be integers: a bool or a float raises ValueError naming the input.
    """
    if INPUT_DTYPES.get(key) == "int64":
        return _token_tensor_data(key, value)
    if isinstance(value, TensorData):
        return value
    if isinstance(value, torch.Tensor):
        return TensorData.from_torch(value)
    if isinstance(value, np.ndarray):
        return TensorData.from_numpy(value)
    if isinstance(value, (list, tuple)):
        array = np.asarray(value)
        if array.dtype == object or array.dtype.kind not in "iubf":
            raise ValueError(f"loss_fn_inputs[{key!r}] must be a rectangular list of numbers")
        return TensorData(array, INPUT_DTYPES.get(key, "float32"))
    raise ValueError(
        f"loss_fn_inputs[{key!r}] must be TensorData, a tensor, an array or a list, got {_described(value)}"
    )


def _token_tensor_data(key: str, value: Any) -> TensorData:
    """Token ids as int64 `TensorData`, from any form `as_tensor_data` takes; never from bools or floats."""
    if isinstance(value, TensorData):
        array = value.to_numpy()
    elif isinstance(value, torch.Tensor):
        array = value.detach().cpu().numpy()
    elif isinstance(value, np.ndarray):
        array = value
    elif isinstance(value, (list, tuple)):
        try:
            return TensorData(np.asarray(to_token_ids(value), dtype=np.int64), "int64")
        except ValueError as error:
            raise ValueError(f"loss_fn_inputs[{key!r}]: {error}") from None
    else:
        raise ValueError(
            f"loss_fn_inputs[{key!r}] must be TensorData, a tensor, an array or a list, got {_described(value)}"
        )
    if array.dtype.kind not in "iu":
        try:
            to_token_ids(array.tolist())  # names the first value that is not an integer
        except ValueError as error:
            raise ValueError(f"loss_fn_inputs[{key!r}]: {error}") from None
        raise ValueError(f"loss_fn_inputs[{key!r}]: token ids must be integers, got {array.dtype} values")
    return TensorData(array, "int64")


def as_provenance_span(value: Any) -> ProvenanceSpan:
    """A provenance span, checked to be one of ours."""
    if isinstance(value, (PromptProvenanceSpan, SampledProvenanceSpan)):
        return value
    raise ValueError(
        f"a provenance span must be a PromptProvenanceSpan or a SampledProvenanceSpan, got {_described(value)}"
    )


def _described(value: Any) -> str:
    """A value's type for an error, by its full name: another library's class may share ours."""
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


# ---------------------------------------------------------------------------------------------- datums


@dataclass(frozen=True)
class Datum:
    """One training example: the tokens read (`model_input`) and per-position loss inputs.

    `loss_fn_inputs[k]` has one entry per position of `model_input`: position i predicts
    `target_tokens[i]`. Values may be `TensorData`, lists, numpy arrays or torch tensors; they are
    converted to `TensorData` with the dtype of `INPUT_DTYPES` (float32 for keys not listed there).

    Provenance (Tinker's `Datum.with_provenance`): `model_input_spans` tile `model_input` and
    `loss_fn_input_spans` tile `target_tokens` with runs naming the sampled sequences the tokens came
    from; `stable_reinforce` trains on what the engine recorded for them. Both or neither.
    """

    model_input: ModelInput
    loss_fn_inputs: Mapping[str, TensorData] = field(default_factory=dict)
    model_input_spans: tuple[ProvenanceSpan, ...] | None = None
    loss_fn_input_spans: tuple[ProvenanceSpan, ...] | None = None

    def __post_init__(self) -> None:
        try:
            model_input = as_model_input(self.model_input)
        except ValueError as error:
            raise ValueError(f"model_input: {error}") from None
        object.__setattr__(self, "model_input", model_input)
        converted = {key: as_tensor_data(key, value) for key, value in dict(self.loss_fn_inputs).items()}
        object.__setattr__(self, "loss_fn_inputs", converted)
        if (self.model_input_spans is None) != (self.loss_fn_input_spans is None):
            raise ValueError(
                "provenance comes as a pair: set both model_input_spans and loss_fn_input_spans, or neither"
            )
        for name in ("model_input_spans", "loss_fn_input_spans"):
            spans = getattr(self, name)
            if spans is not None:
                object.__setattr__(self, name, tuple(as_provenance_span(span) for span in spans))

    def with_provenance(
        self, model_input: Sequence[ProvenanceSpan], loss_fn_inputs: Sequence[ProvenanceSpan]
    ) -> Datum:
        """A copy naming where each token came from: `model_input` runs tile the input tokens,
        `loss_fn_inputs` runs tile `target_tokens` (checked here)."""
        for what, spans, expected in (
            ("model_input", model_input, self.model_input.length),
            ("loss_fn_inputs", loss_fn_inputs, len(self.loss_fn_inputs.get("target_tokens", ()))),
        ):
            covered = sum(as_provenance_span(span).length for span in spans)
            if covered != expected:
                raise ValueError(
                    f"with_provenance {what} spans cover {covered} positions but the field has {expected}; "
                    "the runs must tile it exactly"
                )
        return dataclasses.replace(
            self, model_input_spans=tuple(model_input), loss_fn_input_spans=tuple(loss_fn_inputs)
        )


# ---------------------------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class AdamParams:
    """Per-step AdamW hyper-parameters (Tinker's defaults). Every field applies on every `optim_step`.

    `weight_decay` is decoupled (AdamW); `grad_clip_norm` clips the global L2 norm, 0 means no clipping.
    """

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    def __post_init__(self) -> None:
        for name in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"AdamParams.{name} must be a finite number, got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.learning_rate < 0:
            raise ValueError(f"AdamParams.learning_rate must be >= 0, got {self.learning_rate}")
        if self.learning_rate > MAX_LEARNING_RATE:
            raise ValueError(
                f"AdamParams.learning_rate must be <= {MAX_LEARNING_RATE:g} (an AdamW step moves each weight by "
                f"up to about the learning rate), got {self.learning_rate}"
            )
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"AdamParams.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.eps <= 0:
            raise ValueError(f"AdamParams.eps must be > 0, got {self.eps}")
        if self.eps < FLOAT32_TINY:
            raise ValueError(
                f"AdamParams.eps must be at least {FLOAT32_TINY:.3g} (smaller rounds to 0 in float32, and "
                f"0/0 turns untouched weights to NaN), got {self.eps}"
            )
        if self.weight_decay < 0:
            raise ValueError(f"AdamParams.weight_decay must be >= 0, got {self.weight_decay}")
        if self.learning_rate * self.weight_decay > 1:
            raise ValueError(
                "AdamParams.learning_rate × weight_decay must be <= 1 (AdamW multiplies every weight by "
                f"1 − lr·weight_decay each step), got {self.learning_rate} × {self.weight_decay}"
            )
        if self.grad_clip_norm < 0:
            raise ValueError(f"AdamParams.grad_clip_norm must be >= 0 (0 = off), got {self.grad_clip_norm}")


@dataclass(frozen=True)
class LoraConfig:
    """Which layers get LoRA adapters, and how big (Tinker's `LoraConfig` plus `alpha`).

    The adapter output is scaled by `alpha / rank` (Hu et al. 2021, https://arxiv.org/abs/2106.09685).
    `seed` fixes the adapters' initialisation; None takes the session seed.
    """

    rank: int = 32
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True
    alpha: float = 32.0

    def __post_init__(self) -> None:
        if (
            isinstance(self.rank, bool)
            or not isinstance(self.rank, int)
            or not 1 <= self.rank <= MAX_LORA_RANK
        ):
            raise ValueError(
                f"LoraConfig.rank must be a positive integer up to {MAX_LORA_RANK}, got {self.rank!r}"
            )
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63
        ):
            raise ValueError(f"LoraConfig.seed must be None or an integer in [0, 2**63), got {self.seed!r}")
        for name in ("train_unembed", "train_mlp", "train_attn"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LoraConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if not (self.train_unembed or self.train_mlp or self.train_attn):
            raise ValueError(
                "LoraConfig trains nothing: set at least one of train_attn, train_mlp, train_unembed"
            )
        if (
            isinstance(self.alpha, bool)
            or not isinstance(self.alpha, (int, float))
            or not math.isfinite(self.alpha)
            or self.alpha <= 0
        ):
            raise ValueError(f"LoraConfig.alpha must be a finite number > 0, got {self.alpha!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample (Tinker's `SamplingParams`).

    `temperature=0` is greedy; `top_k=-1` and `top_p=1` switch those filters off. `stop` is a string,
    a list of strings or a list of token ids; None stops at the tokenizer's EOS, `[]` never stops early.
    `max_tokens=None` samples up to the model's context length.
    """

    max_tokens: int | None = None
    seed: int | None = None
    stop: str | Sequence[str] | Sequence[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.max_tokens is not None and (
            isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise ValueError(f"SamplingParams.max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        temperature = self.temperature
        if (
            isinstance(temperature, bool)
            or not (isinstance(temperature, (int, float)) and math.isfinite(temperature))
            or temperature < 0
            or 0 < temperature < MIN_TEMPERATURE
        ):
            raise ValueError(
                f"SamplingParams.temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g} "
                f"(a smaller one samples as greedily as 0, and can overflow float32 logits), got {temperature!r}"
            )
        if isinstance(self.top_p, bool) or not (
            isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0
        ):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if (
            isinstance(self.top_k, bool)
            or not isinstance(self.top_k, int)
            or (self.top_k < 1 and self.top_k != -1)
        ):
            raise ValueError(f"SamplingParams.top_k must be -1 (off) or >= 1, got {self.top_k!r}")
        if self.seed is not None:
            if (
                isinstance(self.seed, (bool, np.bool_))
                or not isinstance(self.seed, (int, np.integer))
                or not -(2**63) <= self.seed < 2**64
            ):
                raise ValueError(
                    "SamplingParams.seed must be None or an integer that fits in 64 bits "
                    f"(-2**63 <= seed < 2**64, what torch.Generator takes), got {self.seed!r}"
                )
            object.__setattr__(self, "seed", int(self.seed))
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if stop is not None:
            if isinstance(stop, (bytes, Mapping)) or not isinstance(stop, (Sequence, np.ndarray)):
                raise ValueError(
                    f"SamplingParams.stop must be a string, a list of strings or a list of token ids, got {self.stop!r}"
                )
            stop = tuple(int(s) if isinstance(s, np.integer) else s for s in stop)
            if not (
                all(isinstance(s, str) for s in stop)
                or all(isinstance(s, int) and not isinstance(s, bool) for s in stop)
            ):
                raise ValueError(
                    f"SamplingParams.stop must be strings or token ids, not a mix: {self.stop!r}"
                )
            if any(isinstance(s, str) and not s for s in stop):
                raise ValueError("SamplingParams.stop strings must not be empty")
        object.__setattr__(self, "stop", stop)


# ---------------------------------------------------------------------------------------------- outputs


@dataclass(frozen=True)
class ForwardBackwardOutput:
    """Result of `forward` / `forward_backward`: one dict of `TensorData` per datum, plus metrics.

    Metric keys are `name:reduction` (`loss:sum`, `ratio:mean`, ...), as the SDK merges them.
    """

    loss_fn_output_type: str
    loss_fn_outputs: list[dict[str, TensorData]]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class OptimStepResponse:
    """Result of `optim_step`. `applied` is False when the step was skipped, and `skipped_reason` says why."""

    metrics: dict[str, float]
    applied: bool = True
    skipped_reason: str | None = None


TopkEntries = list[list[tuple[int, float]] | None]
"""Top-k logprobs per position, as the SDK's lists: up to k (token id, logprob) pairs, most likely first,
or None where nothing was computed."""


@dataclass(frozen=True)
class SampledSequence:
    """One sampled continuation: its tokens (the stop token included), the logprob of each, why it
    ended, and `sequence_id`, unique within the engine, which training data names in its provenance.

    Temperature rule: `logprobs` and `topk_logprobs` are log-probabilities under the distribution the
    tokens were drawn from, log_softmax(logits / τ) at the request's temperature τ (before top-k and
    top-p truncation), the rule hosted Tinker's samples follow; at τ = 1 that is the model's own
    logprob, what `forward` and `compute_logprobs` report. At τ = 0 (greedy) they are the model's (τ = 1)
    logprobs. `topk_logprobs` (with `topk_sample_logprobs=k`) has the k most likely tokens at each
    generated position."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: StopReason
    sequence_id: str = ""
    topk_logprobs: TopkEntries | None = None


@dataclass(frozen=True)
class PromptAltTokens:
    """`prompt_alt_tokens_k` draws at every prompt position after the first: (P − 1, k) `tokens` (int64)
    drawn with replacement from the next-token distribution at the request's temperature, and their
    `logprobs` (float32) under that distribution (the sampled-token rule of `SampledSequence`); row i is
    for prompt position i + 1."""

    tokens: TensorData
    logprobs: TensorData


@dataclass(frozen=True)
class SampleResponse:
    """Sampled sequences, the prompt's logprobs when asked for (first entry None), the policy weight
    version that produced them (None: the base model), and the milliseconds it took to push that
    version to the sampler engine (0 when the engine samples the live weights in place).
    `prompt_cache_hit_tokens` is always 0: nothing is billed, and no prompt is served from a cache.

    What the prompt scores is the model's own distribution (τ = 1, as `forward`): `prompt_logprobs`,
    `topk_prompt_logprobs` (the k most likely tokens at every prompt position; None at the first and,
    with `prompt_logprobs_last_n`, before the last N) and `target_prompt_logprobs` ((P − 1, K) float32,
    the logprob of each requested id, 0.0 where the request had −1). `prompt_alt_tokens` are draws at
    the request's temperature (see `PromptAltTokens`)."""

    sequences: list[SampledSequence]
    weights_version: int | None
    prompt_logprobs: list[float | None] | None = None
    sync_ms: float = 0.0
    prompt_cache_hit_tokens: int = 0
    topk_prompt_logprobs: TopkEntries | None = None
    target_prompt_logprobs: TensorData | None = None
    prompt_alt_tokens: PromptAltTokens | None = None


@dataclass(frozen=True)
class SaveWeightsResponse:
    """Where `save_state` put the checkpoint: its `tinker://<run>/weights/<name>` path (what every load
    accepts) and its local folder."""

    path: str
    folder: str = ""


@dataclass(frozen=True)
class SaveWeightsForSamplerResponse:
    """Where `save_weights_for_sampler` put the adapter: its `tinker://<run>/sampler_weights/<name>`
    path and its local folder, a peft adapter folder that `PeftModel.from_pretrained` loads."""

    path: str
    folder: str = ""


@dataclass(frozen=True)
class SaveWeightsExternalResponse:
    """Where `save_weights_external` put the adapter's files: `tinker://<run>/external_weights/<name>`
    (`RestClient.get_external_weights_urls` signs a URL per file) and its local folder."""

    path: str
    folder: str = ""


@dataclass(frozen=True)
class ExternalWeightsUrlsResponse:
    """Tinker's `ExternalWeightsUrlsResponse`: a URL per file (relative path -> URL), valid until
    `expires`."""

    urls: dict[str, str]
    expires: datetime


@dataclass(frozen=True)
class LoadWeightsResponse:
    path: str


@dataclass(frozen=True)
class ModelData:
    """The base model a training client's model is built on (Tinker's `ModelData`): its architecture,
    its name as the engine was created with it, and the local folder (or HF id) of its tokenizer."""

    arch: str | None = None
    model_name: str | None = None
    tokenizer_id: str | None = None


@dataclass(frozen=True)
class AdamOptimizerConfig:
    """The optimizer family of a model (Tinker's `AdamOptimizerConfig`): AdamW, the only one here."""

    type: Literal["adamw"] = "adamw"


@dataclass(frozen=True)
class GetInfoResponse:
    """What `TrainingClient.get_info()` reports, in the shape of Tinker's `GetInfoResponse`."""

    model_data: ModelData
    model_id: str
    optimizer_config: AdamOptimizerConfig = field(default_factory=AdamOptimizerConfig)
    is_lora: bool | None = None
    lora_rank: int | None = None
    model_name: str | None = None
    type: Literal["get_info"] = "get_info"
