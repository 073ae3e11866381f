"""Builders for the datums the tests train on: every test builds its datums here."""

from __future__ import annotations

import random

from tinker import types

import workbench as wb


def sft_datum(tokenizer, prompt: str, completion: str) -> wb.Datum:
    """A Tinker SFT datum: prompt tokens weighted 0, completion tokens 1, shifted by one position."""
    prompt_ids = tokenizer(prompt).input_ids
    completion_ids = tokenizer(completion).input_ids
    tokens = prompt_ids + completion_ids
    weights = [0.0] * len(prompt_ids) + [1.0] * len(completion_ids)
    return wb.Datum(
        model_input=wb.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights[1:]},
    )


def random_tokens(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(length)]


def ce_inputs(tokens: list[int], **inputs: object) -> dict[str, object]:
    """A cross-entropy datum's loss inputs for `tokens`: the next token as target and weight 1 at every
    position, with `inputs` added or replacing those (a value of None leaves the input out)."""
    loss_fn_inputs = {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1), **inputs}
    return {key: value for key, value in loss_fn_inputs.items() if value is not None}


def ce_datum(tokens: list[int], **inputs: object) -> wb.Datum:
    """A cross-entropy datum that trains on every next token of `tokens` (see `ce_inputs`)."""
    return wb.Datum(
        model_input=wb.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=ce_inputs(tokens, **inputs)
    )


def unweighted_datum(tokens: list[int]) -> wb.Datum:
    """`tokens` with their next-token targets and no weights (cross_entropy then weighs every position 1)."""
    return ce_datum(tokens, weights=None)


def sdk_ce_datum(tokens: list[int], **inputs: object) -> types.Datum:
    """The same datum built with the `tinker` SDK's own types, as an SDK user sends it."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=ce_inputs(tokens, **inputs)
    )


def rl_datum(
    tokens: list[int], prompt_length: int, sampling_logprobs: list[float], advantage: float
) -> wb.Datum:
    """An RL datum: the completion positions carry the sampler's logprobs and the advantage."""
    n = len(tokens) - 1
    completion = [i >= prompt_length - 1 for i in range(n)]
    return wb.Datum(
        model_input=wb.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": [lp if c else 0.0 for lp, c in zip(sampling_logprobs, completion, strict=True)],
            "advantages": [advantage if c else 0.0 for c in completion],
        },
    )


def ragged_ce_batch(seed: int, count: int, min_len: int, max_len: int, vocab: int) -> list[wb.Datum]:
    rng = random.Random(seed)
    return [ce_datum(random_tokens(rng, rng.randint(min_len, max_len), vocab)) for _ in range(count)]
