"""A validated sampling request, and what a sampler engine returns for it.

Notation: P prompt tokens; R = num_samples rows per request.

Validation happens in the caller's thread before anything is queued (`prepare_request`): a bad prompt or
bad parameters raise a `ValueError` and change nothing. A request without a seed draws one from the
engine's sampling generator when it runs (`seeded`), on the worker in submission order, so a run's
samples are reproducible from the engine seed and the generator's state saved with a checkpoint is the
one the operations before the save left.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from workbench.types import ModelInput, SampledSequence, SamplingParams, to_model_input, to_sampling_params


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

    @property
    def prompt_length(self) -> int:
        return len(self.prompt_tokens)

    def seeded(self, generator: torch.Generator) -> SampleRequest:
        """The request with its seed fixed: its own, else the next draw from `generator`."""
        if self.seed is not None:
            return self
        return dataclasses.replace(self, seed=int(torch.randint(0, 2**62, (1,), generator=generator)))


@dataclass(frozen=True)
class RequestResult:
    """What an engine returns for one request: its sampled sequences (stop token included) and, when
    asked for, the prompt's logprobs."""

    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None


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
    )


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
