"""A sample request prepared for a sampler, and what a sampler engine returns for it.

Notation: P prompt tokens; R = num_samples rows per request.

`prepare_request` checks a `SampleRequest` (checked as it was built of everything that needs no model)
against the model and the engine, in the caller's thread before anything is queued: prompt and stop
token ids within the vocabulary, `max_tokens` within what the context leaves, the top-k widths and
target ids within the vocabulary, `num_samples` within the engine's `max_samples_per_request`. A bad
request raises a `ValueError` and changes nothing. What it returns, a `PreparedRequest`, is what the
samplers read: the prompt's token ids, the stop conditions, the target ids as a tensor, and the request
as asked.

A request may carry a `TokenSink`: the sampler (HF or vLLM) calls it from the engine's worker thread
after each decoding step with each of the request's live sequences' new token, so a caller can stream
the text as it is drawn (the compatible APIs' `stream: true`).

A request without a seed draws one from the engine's sampling generator when it runs (`seeded`), on the
worker in submission order, so a run's samples are reproducible from the engine seed and the generator's
state saved with a checkpoint is the one the operations before the save left.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from workbench.engine.model.base_model import BaseModelInfo
from workbench.engine.samplers.sample_request import TOKEN_WIDTH_FIELDS, SampleRequest
from workbench.types import PromptAltTokens, SampledSequence, SamplingParams, TensorData, TopkEntries

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
class PreparedRequest:
    """A `SampleRequest` checked against the model, in the form the samplers read."""

    asked: SampleRequest  # the request as its caller built it
    prompt_tokens: tuple[int, ...]
    seed: int | None  # None until `seeded` draws one
    max_tokens: int  # sampling_params.max_tokens, or what is left of the context
    stop_token_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    # (P − 1, K) int64 ids to score at prompt positions 1.., −1 where nothing is asked
    target_prompt_ids: torch.Tensor | None = field(default=None, compare=False)
    token_sink: TokenSink | None = field(default=None, compare=False)  # told each token as it is drawn

    @property
    def prompt_length(self) -> int:
        return len(self.prompt_tokens)

    @property
    def params(self) -> SamplingParams:
        """How to sample (`asked.sampling_params`)."""
        return self.asked.sampling_params

    def seeded(self, generator: torch.Generator) -> PreparedRequest:
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
    request: SampleRequest,
    *,
    tokenizer: PreTrainedTokenizerBase,
    base_info: BaseModelInfo,
    max_samples_per_request: int,
) -> PreparedRequest:
    """Check `request` against the model and the engine; raises ValueError naming the problem."""
    tokens = request.prompt.to_ints()
    vocab_size = base_info.vocab_size
    for position, token in enumerate(tokens):
        if not 0 <= token < vocab_size:
            raise ValueError(
                f"prompt token {token} at position {position} is outside the vocabulary [0, {vocab_size})"
            )
    check_num_samples(request.num_samples, max_samples_per_request)
    params = request.sampling_params
    max_tokens = _max_tokens(params, len(tokens), base_info.max_length)
    if params.stop is not None and len(params.stop) and not isinstance(params.stop[0], str):
        bad = [s for s in params.stop if not 0 <= int(s) < vocab_size]
        if bad:
            raise ValueError(f"stop token ids {bad} are outside the vocabulary [0, {vocab_size})")
    for name in TOKEN_WIDTH_FIELDS:
        check_width(name, getattr(request, name), vocab_size)
    targets = request.target_prompt_logprobs
    if targets is not None:
        _check_target_ids(targets, vocab_size)
    stop_ids, stop_strings = stop_conditions(params, tokenizer)
    return PreparedRequest(
        asked=request,
        prompt_tokens=tuple(tokens),
        seed=params.seed,
        max_tokens=max_tokens,
        stop_token_ids=stop_ids,
        stop_strings=stop_strings,
        target_prompt_ids=None if targets is None else torch.from_numpy(targets.copy()),
    )


def _max_tokens(params: SamplingParams, prompt_length: int, max_length: int) -> int:
    """The new tokens a request may draw: `max_tokens`, which the context must hold, else what it leaves."""
    room = max_length - prompt_length
    if room < 1:
        raise ValueError(
            f"prompt has {prompt_length} tokens: no room left in the model's context of {max_length}"
        )
    max_tokens = room if params.max_tokens is None else params.max_tokens
    if max_tokens > room:
        raise ValueError(
            f"max_tokens={max_tokens} with a {prompt_length}-token prompt exceeds the model's context of {max_length} "
            f"(at most {room} new tokens)"
        )
    return max_tokens


def check_width(name: str, value: Any, vocab_size: int) -> None:
    """A top-k width or a number of draws: an integer from 0 (off) to the vocabulary size (no other cap:
    the scores are computed chunk by chunk, never as a whole (P, V) tensor)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= vocab_size:
        raise ValueError(
            f"{name} must be an integer in [0, {vocab_size}] (the vocabulary size), got {value!r}"
        )


def _check_target_ids(array: np.ndarray, vocab_size: int) -> None:
    """Every cell of `target_prompt_logprobs` is −1 (nothing) or a token id of the vocabulary."""
    bad = (array < -1) | (array >= vocab_size)
    if bad.any():
        row, column = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"target_prompt_logprobs[{row}][{column}] = {int(array[row, column])} is neither -1 (nothing) "
            f"nor a token id in [0, {vocab_size})"
        )


def keep_last_logprobs(logprobs: list[float | None], last_n: int | None) -> list[float | None]:
    """Prompt logprobs with every entry before the last `last_n` set to None (all of them when None)."""
    if last_n is None:
        return logprobs
    return [None] * (len(logprobs) - last_n) + logprobs[len(logprobs) - last_n :]
