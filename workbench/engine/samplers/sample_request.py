"""What one sample call asks: `SampleRequest`, checked as it is built.

The fields are the `tinker` SDK's (0.38 `SamplingClient.sample` and its wire `SampleRequest`): a prompt,
`num_samples` samples of it, the `SamplingParams`, and what else to report (prompt logprobs, top-k
logprobs, target ids' prompt logprobs, prompt draws), plus the two that a sampling client or the REST
server sets for its engine (`record_stability_info`, `sequence_ids`). Each place a call arrives builds
one: the SDK-shaped `SamplingClient.sample`, the REST route `/api/v1/asample`, the OpenAI- and
Anthropic-compatible APIs. The engines take it whole (`EngineInterface.sample`), so a new field of the
SDK's is declared and checked here once.

Everything that needs no model is checked here: the types, the prompt's shape, the fields that need
another (`prompt_logprobs_last_n` needs `include_prompt_logprobs`), the target ids' shape against the
prompt, one distinct sequence id per sample. A bad request raises a ValueError naming the field before
any engine sees it. What needs the model or the engine (token ids within the vocabulary, `max_tokens`
within the context, widths capped by the vocabulary, `num_samples` within the engine's
`max_samples_per_request`) is checked where they are known: the local engine's
`requests.prepare_request`, the service behind a remote engine.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Any

import numpy as np

from workbench.sdk_conversion import to_model_input, to_sampling_params, to_target_ids
from workbench.types import ModelInput, SamplingParams

TOKEN_WIDTH_FIELDS = ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k")
"""The fields that ask for a number of tokens at every position (0: none): capped by the vocabulary only,
since the scores are computed chunk by chunk, never as a whole (P, V) tensor."""


@dataclass(frozen=True, eq=False)
class SampleRequest:
    """One sample call: `num_samples` continuations of `prompt` under `sampling_params`, and what to
    report besides each sequence's tokens and logprobs.

    Built from ours or the SDK's objects: `prompt` may be a `ModelInput` (ours or the SDK's) or a list of
    token ids, `sampling_params` a `SamplingParams` (ours or the SDK's) or a dict of its fields, and
    `target_prompt_logprobs` ours or the SDK's `TensorData` (dense, or sparse CSR: unlisted cells ask for
    nothing), a torch tensor, a numpy array or nested lists. Each is held in one form, as annotated.

    Attributes:
        prompt: The prompt (at least one token).
        num_samples: Samples of the prompt, each drawn independently.
        sampling_params: How to sample (temperature, max_tokens, stop, seed, ...).
        include_prompt_logprobs: Report the logprob of every prompt token (the first is None).
        prompt_logprobs_last_n: Score only the prompt's last N tokens (earlier entries None); needs
            `include_prompt_logprobs`, N in [1, len(prompt) − 1]. None: the whole prompt.
        record_stability_info: Keep each sequence for `stable_reinforce` training data that names it.
        sequence_ids: The ids the sequences get, one per sample, distinct (None: the engine names them).
        topk_prompt_logprobs: The k most likely tokens at every prompt position (0: none).
        topk_sample_logprobs: The k most likely tokens at every generated position (0: none).
        target_prompt_logprobs: (len(prompt) − 1, K) int64 token ids to score at prompt positions 1..,
            −1 where nothing is asked; None: none.
        prompt_alt_tokens_k: Tokens drawn at the request's temperature at every prompt position after the
            first (0: none).
    """

    prompt: ModelInput
    num_samples: int
    sampling_params: SamplingParams
    include_prompt_logprobs: bool = False
    _: KW_ONLY
    prompt_logprobs_last_n: int | None = None
    record_stability_info: bool = False
    sequence_ids: tuple[str, ...] | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: np.ndarray | None = None
    prompt_alt_tokens_k: int = 0

    def __post_init__(self) -> None:
        """Check each field and hold it in one form, so that no engine or sampler checks it again."""
        prompt = _prompt(self.prompt)
        object.__setattr__(self, "prompt", prompt)
        object.__setattr__(self, "sampling_params", to_sampling_params(self.sampling_params))
        if isinstance(self.num_samples, bool) or not isinstance(self.num_samples, int):
            raise ValueError(f"num_samples must be an integer, got {self.num_samples!r}")
        for name in ("include_prompt_logprobs", "record_stability_info"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        check_prompt_logprobs_last_n(self.prompt_logprobs_last_n, self.include_prompt_logprobs, prompt.length)
        for name in TOKEN_WIDTH_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"{name} must be an integer (0: none), got {value!r}")
            object.__setattr__(self, name, int(value))
        if (self.topk_prompt_logprobs > 0 or self.prompt_alt_tokens_k > 0) and prompt.length < 2:
            raise ValueError(
                "topk_prompt_logprobs and prompt_alt_tokens_k score prompt positions after the first: "
                "the prompt needs at least 2 tokens"
            )
        if self.target_prompt_logprobs is not None:
            targets = target_ids_array(self.target_prompt_logprobs, prompt.length)
            object.__setattr__(self, "target_prompt_logprobs", targets)
        if self.sequence_ids is not None:
            object.__setattr__(self, "sequence_ids", tuple(self.sequence_ids))
            _check_sequence_ids(self.sequence_ids, self.num_samples)

    @property
    def scores_prompt(self) -> bool:
        """Whether the request asks for anything of the prompt beyond its plain logprobs."""
        return bool(
            self.topk_prompt_logprobs or self.target_prompt_logprobs is not None or self.prompt_alt_tokens_k
        )


def _prompt(value: Any) -> ModelInput:
    """The prompt as our `ModelInput`, of at least one token."""
    try:
        prompt = to_model_input(value)
    except ValueError as error:
        raise ValueError(f"prompt: {error}") from None
    if prompt.length == 0:
        raise ValueError("prompt is empty: sampling needs at least one prompt token")
    return prompt


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


def target_ids_array(value: Any, prompt_length: int) -> np.ndarray:
    """`target_prompt_logprobs` as a dense, read-only (P − 1, K) int64 array, −1 where nothing is asked.

    Row i is scored at prompt position i + 1. Whether the ids are within the vocabulary is for the
    engine, which knows it (`requests.prepare_request`)."""
    array = to_target_ids(value)
    if array.dtype.kind not in "iu":
        raise ValueError(f"target_prompt_logprobs must hold integer token ids, got {array.dtype} values")
    rows = prompt_length - 1
    if array.ndim != 2 or array.shape[0] != rows or array.shape[1] < 1:
        raise ValueError(
            f"target_prompt_logprobs must have shape [len(prompt) - 1, K] = [{rows}, K] with K >= 1, "
            f"got {list(array.shape)}"
        )
    if not (array >= 0).any():
        raise ValueError("target_prompt_logprobs names no token id (every cell is -1)")
    array = array.astype(np.int64)  # a copy: the caller's tensor may change after the call
    array.flags.writeable = False
    return array


def _check_sequence_ids(sequence_ids: tuple[str, ...], num_samples: int) -> None:
    if (
        len(sequence_ids) != num_samples
        or not all(isinstance(i, str) and i for i in sequence_ids)
        or len(set(sequence_ids)) != num_samples
    ):
        raise ValueError(
            f"sequence_ids must be {num_samples} distinct non-empty strings (one per sample), got {sequence_ids!r}"
        )
