"""A validated sampling request, and what a sampler engine returns for it.

Notation: P prompt tokens; R = num_samples rows per request.

A request may carry a `TokenSink`: the sampler (HF or vLLM) calls it from the engine's worker thread
after each decoding step with each of the request's live sequences' new token, so a caller can stream
the text as it is drawn (the compatible APIs' `stream: true`).

Validation happens in the caller's thread before anything is queued (`prepare_request`): a bad prompt or
bad parameters raise a `ValueError` and change nothing. A request without a seed draws one from the
engine's sampling generator when it runs (`seeded`), on the worker in submission order, so a run's
samples are reproducible from the engine seed and the generator's state saved with a checkpoint is the
one the operations before the save left.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from workbench.sdk_conversion import to_model_input, to_sampling_params
from workbench.types import (
    ModelInput,
    PromptAltTokens,
    SampledSequence,
    SamplingParams,
    TensorData,
    TopkEntries,
)

INTERRUPTED_MESSAGE = "sampling was interrupted: the engine is shutting down"


class SamplingInterrupted(RuntimeError):
    """A generation stopped between decoding steps because its engine is shutting down (both samplers
    check their engine's `interrupted` event there: `Engine.interrupt_sampling`)."""


TokenSink = Callable[[int, int], None]
"""`sink(sequence, token_id)`: sequence `sequence` of a request (0 to num_samples − 1) drew `token_id`,
its next token (the stop token included). Called on the engine's worker thread, in each sequence's
token order, between decoding steps: it must neither block nor raise (hand the token to another thread
and return)."""


@dataclass(frozen=True)
class SampleRequest:
    """One `sample` call: a prompt, R samples, and the parameters that apply to all of them."""

    prompt_tokens: tuple[int, ...]
    num_samples: int
    params: SamplingParams
    seed: int | None  # None until `seeded` draws one
    max_tokens: int  # params.max_tokens, or what is left of the context
    stop_token_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    include_prompt_logprobs: bool
    prompt_logprobs_last_n: int | None = None  # score only the prompt's last N tokens (others None)
    record_stability_info: bool = False  # keep the sampled sequences for stable_reinforce
    sequence_ids: tuple[str, ...] | None = None  # the ids the caller named for the sequences, in order
    topk_prompt_logprobs: int = 0  # k most likely tokens at every prompt position
    topk_sample_logprobs: int = 0  # k most likely tokens at every generated position
    # (P − 1, K) int64 ids to score at prompt positions 1.., −1 where nothing is asked
    target_prompt_ids: torch.Tensor | None = field(default=None, compare=False)
    prompt_alt_tokens_k: int = 0  # draws at every prompt position after the first
    token_sink: TokenSink | None = field(default=None, compare=False)  # told each token as it is drawn

    @property
    def prompt_length(self) -> int:
        return len(self.prompt_tokens)

    @property
    def scores_prompt(self) -> bool:
        """Whether the request asks for anything of the prompt beyond its plain logprobs."""
        return bool(
            self.topk_prompt_logprobs or self.target_prompt_ids is not None or self.prompt_alt_tokens_k
        )

    def seeded(self, generator: torch.Generator) -> SampleRequest:
        """The request with its seed fixed: its own, else the next draw from `generator`."""
        if self.seed is not None:
            return self
        return dataclasses.replace(self, seed=int(torch.randint(0, 2**62, (1,), generator=generator)))


@dataclass(frozen=True)
class PromptScores:
    """What a request asks of its prompt beyond the plain logprobs (each None unless asked)."""

    topk_prompt_logprobs: TopkEntries | None = None
    target_prompt_logprobs: TensorData | None = None
    prompt_alt_tokens: PromptAltTokens | None = None


@dataclass(frozen=True)
class RequestResult:
    """What an engine returns for one request: its sampled sequences (stop token included) and, when
    asked for, the prompt's logprobs and scores."""

    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None
    prompt_scores: PromptScores = PromptScores()
    # the prompt tokens before the last that were prefilled, and of those the ones a prompt cache gave
    # (HF: `workbench.engine.samplers.prefix_cache`; vLLM reports none)
    prefill_tokens: int = 0
    prefill_cached_tokens: int = 0


def stop_conditions(
    params: SamplingParams, tokenizer: PreTrainedTokenizerBase
) -> tuple[frozenset[int], tuple[str, ...]]:
    """The token ids and strings that end a sample.

    `stop=None`: the tokenizer's end-of-sequence token. `stop=[]`: nothing (samples run to max_tokens).
    Token ids: exactly those. Strings: those strings, and the end-of-sequence token as well, since a
    model that has emitted it has finished its answer.
    """
    eos = frozenset() if tokenizer.eos_token_id is None else frozenset({int(tokenizer.eos_token_id)})
    stop = params.stop
    if stop is None:
        return eos, ()
    if len(stop) == 0:
        return frozenset(), ()
    if isinstance(stop[0], str):
        return eos, tuple(str(s) for s in stop)
    return frozenset(int(s) for s in stop), ()


def check_num_samples(num_samples: object, max_samples_per_request: int) -> int:
    """`num_samples` checked before anything is sized by it."""
    if (
        isinstance(num_samples, bool)
        or not isinstance(num_samples, int)
        or not 1 <= num_samples <= max_samples_per_request
    ):
        raise ValueError(
            f"num_samples must be an integer in [1, {max_samples_per_request}] "
            f"(the session's max_samples_per_request), got {num_samples!r}"
        )
    return num_samples


def prepare_request(
    prompt: ModelInput,
    num_samples: int,
    sampling_params: SamplingParams,
    include_prompt_logprobs: bool,
    *,
    tokenizer: PreTrainedTokenizerBase,
    vocab_size: int,
    max_length: int,
    max_samples_per_request: int,
    prompt_logprobs_last_n: int | None = None,
    record_stability_info: bool = False,
    sequence_ids: Sequence[str] | None = None,
    topk_prompt_logprobs: int = 0,
    topk_sample_logprobs: int = 0,
    target_prompt_logprobs: Any = None,
    prompt_alt_tokens_k: int = 0,
    token_sink: TokenSink | None = None,
) -> SampleRequest:
    """Validate a sampling call against the model; raises ValueError naming the problem."""
    params = to_sampling_params(sampling_params)
    try:
        tokens = to_model_input(prompt).to_ints()
    except ValueError as error:
        raise ValueError(f"prompt: {error}") from None
    if not tokens:
        raise ValueError("prompt is empty: sampling needs at least one prompt token")
    for position, token in enumerate(tokens):
        if not 0 <= token < vocab_size:
            raise ValueError(
                f"prompt token {token} at position {position} is outside the vocabulary [0, {vocab_size})"
            )
    check_num_samples(num_samples, max_samples_per_request)
    for argument, value in (
        ("include_prompt_logprobs", include_prompt_logprobs),
        ("record_stability_info", record_stability_info),
    ):
        if not isinstance(value, bool):
            raise ValueError(f"{argument} must be True or False, got {value!r}")
    room = max_length - len(tokens)
    if room < 1:
        raise ValueError(
            f"prompt has {len(tokens)} tokens: no room left in the model's context of {max_length}"
        )
    max_tokens = room if params.max_tokens is None else params.max_tokens
    if max_tokens > room:
        raise ValueError(
            f"max_tokens={max_tokens} with a {len(tokens)}-token prompt exceeds the model's context of {max_length} "
            f"(at most {room} new tokens)"
        )
    if params.stop is not None and len(params.stop) and not isinstance(params.stop[0], str):
        bad = [s for s in params.stop if not 0 <= int(s) < vocab_size]
        if bad:
            raise ValueError(f"stop token ids {bad} are outside the vocabulary [0, {vocab_size})")
    check_prompt_logprobs_last_n(prompt_logprobs_last_n, include_prompt_logprobs, len(tokens))
    for name, value in (
        ("topk_prompt_logprobs", topk_prompt_logprobs),
        ("topk_sample_logprobs", topk_sample_logprobs),
        ("prompt_alt_tokens_k", prompt_alt_tokens_k),
    ):
        check_width(name, value, vocab_size)
    if (topk_prompt_logprobs or prompt_alt_tokens_k) and len(tokens) < 2:
        raise ValueError(
            "topk_prompt_logprobs and prompt_alt_tokens_k score prompt positions after the first: "
            "the prompt needs at least 2 tokens"
        )
    target_ids = (
        None
        if target_prompt_logprobs is None
        else to_target_ids(target_prompt_logprobs, len(tokens), vocab_size)
    )
    if sequence_ids is not None:
        sequence_ids = tuple(sequence_ids)
        if (
            len(sequence_ids) != num_samples
            or not all(isinstance(i, str) and i for i in sequence_ids)
            or len(set(sequence_ids)) != num_samples
        ):
            raise ValueError(
                f"sequence_ids must be {num_samples} distinct non-empty strings (one per sample), got {sequence_ids!r}"
            )
    stop_ids, stop_strings = stop_conditions(params, tokenizer)
    return SampleRequest(
        prompt_tokens=tuple(tokens),
        num_samples=num_samples,
        params=params,
        seed=params.seed,
        max_tokens=max_tokens,
        stop_token_ids=stop_ids,
        stop_strings=stop_strings,
        include_prompt_logprobs=bool(include_prompt_logprobs),
        prompt_logprobs_last_n=prompt_logprobs_last_n,
        record_stability_info=bool(record_stability_info),
        sequence_ids=sequence_ids,
        topk_prompt_logprobs=topk_prompt_logprobs,
        topk_sample_logprobs=topk_sample_logprobs,
        target_prompt_ids=target_ids,
        prompt_alt_tokens_k=prompt_alt_tokens_k,
        token_sink=token_sink,
    )


def check_width(name: str, value: Any, vocab_size: int) -> None:
    """A top-k width or a number of draws: an integer from 0 (off) to the vocabulary size (no other cap:
    the scores are computed chunk by chunk, never as a whole (P, V) tensor)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= vocab_size:
        raise ValueError(
            f"{name} must be an integer in [0, {vocab_size}] (the vocabulary size), got {value!r}"
        )


def to_target_ids(value: Any, prompt_length: int, vocab_size: int) -> torch.Tensor:
    """`target_prompt_logprobs` as a dense (P − 1, K) int64 tensor, −1 where nothing is asked.

    Takes ours or the SDK's `TensorData` (dense, or sparse CSR: unlisted cells ask for nothing), a torch
    tensor, a numpy array or a nested list. Row i is scored at prompt position i + 1."""
    sdk = sys.modules.get("tinker")
    if sdk is not None and isinstance(value, sdk.TensorData):
        if value.dtype != "int64":
            raise ValueError(f"target_prompt_logprobs must be int64 token ids, got {value.dtype}")
        array = value.to_numpy(pad_value=-1)
    elif isinstance(value, TensorData):
        array = value.to_numpy()
    elif isinstance(value, torch.Tensor):
        array = value.detach().cpu().numpy()
    else:
        array = np.asarray(value)
    if array.dtype.kind not in "iu":
        raise ValueError(f"target_prompt_logprobs must hold integer token ids, got {array.dtype} values")
    rows = prompt_length - 1
    if array.ndim != 2 or array.shape[0] != rows or array.shape[1] < 1:
        raise ValueError(
            f"target_prompt_logprobs must have shape [len(prompt) - 1, K] = [{rows}, K] with K >= 1, "
            f"got {list(array.shape)}"
        )
    bad = (array < -1) | (array >= vocab_size)
    if bad.any():
        row, column = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"target_prompt_logprobs[{row}][{column}] = {int(array[row, column])} is neither -1 (nothing) "
            f"nor a token id in [0, {vocab_size})"
        )
    if not (array >= 0).any():
        raise ValueError("target_prompt_logprobs names no token id (every cell is -1)")
    return torch.from_numpy(array.astype(np.int64))


def check_prompt_logprobs_last_n(
    last_n: int | None, include_prompt_logprobs: bool, prompt_length: int
) -> None:
    """`prompt_logprobs_last_n` asks for prompt logprobs, and at most every prompt token but the first."""
    if last_n is None:
        return
    if not include_prompt_logprobs:
        raise ValueError("prompt_logprobs_last_n needs include_prompt_logprobs=True")
    if isinstance(last_n, bool) or not isinstance(last_n, int) or not 1 <= last_n <= prompt_length - 1:
        raise ValueError(
            f"prompt_logprobs_last_n must be an integer in [1, {prompt_length - 1}] (len(prompt) - 1), got {last_n!r}"
        )


def keep_last_logprobs(logprobs: list[float | None], last_n: int | None) -> list[float | None]:
    """Prompt logprobs with every entry before the last `last_n` set to None (all of them when None)."""
    if last_n is None:
        return logprobs
    return [None] * (len(logprobs) - last_n) + logprobs[len(logprobs) - last_n :]
