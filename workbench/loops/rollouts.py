"""From sampled sequences to training datums for the policy losses and the critic.

A sample is a prompt of P tokens followed by n sampled tokens. As a Tinker datum, `model_input` is every
token but the last and position i predicts token i + 1, so the sampled tokens are predicted at positions
P−1 … P+n−2: `completion_positions(P, n)`. The policy losses read the sampler's logprobs and the
advantages there (0 on the prompt, which carries no loss); the critic's values and returns live at the
same positions, so GAE over a completion lines up with the policy's tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from workbench.sdk_conversion import to_model_input
from workbench.types import Datum, ModelInput, SampledSequence


def completion_positions(prompt_length: int, completion_length: int) -> slice:
    """The datum positions that predict the sampled tokens."""
    return slice(prompt_length - 1, prompt_length - 1 + completion_length)


def _per_token(name: str, value: float | Sequence[float], n: int) -> list[float]:
    values = [float(value)] * n if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} values for {n} sampled tokens")
    return values


def _layout(prompt: ModelInput | Sequence[int], sequence: SampledSequence) -> tuple[list[int], int, int]:
    prompt_tokens = to_model_input(prompt).to_ints()
    if not prompt_tokens or not sequence.tokens:
        raise ValueError("a training datum needs a non-empty prompt and at least one sampled token")
    return prompt_tokens + list(sequence.tokens), len(prompt_tokens), len(sequence.tokens)


def _on_completion(values: list[float], prompt_length: int) -> list[float]:
    """Per-token values placed on the completion positions (the sampled tokens end the datum)."""
    return [0.0] * (prompt_length - 1) + values


def policy_datum(
    prompt: ModelInput | Sequence[int], sequence: SampledSequence, advantages: float | Sequence[float]
) -> Datum:
    """A datum for `importance_sampling`, `ppo`, `cispo` or `dro`: the sampler's logprobs and the
    advantages (one number for the whole sample, or one per sampled token) on the sampled tokens."""
    tokens, p, n = _layout(prompt, sequence)
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": _on_completion(_per_token("logprobs", sequence.logprobs, n), p),
            "advantages": _on_completion(_per_token("advantages", advantages, n), p),
        },
    )


def critic_datum(
    prompt: ModelInput | Sequence[int],
    sequence: SampledSequence,
    values: Sequence[float],
    returns: Sequence[float],
) -> Datum:
    """A datum for `ppo_critic`: the values the critic gave when the data was collected and the returns,
    one per sampled token; weight 1 on the sampled tokens, 0 on the prompt."""
    tokens, p, n = _layout(prompt, sequence)
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "values": _on_completion(_per_token("values", values, n), p),
            "returns": _on_completion(_per_token("returns", returns, n), p),
            "weights": _on_completion([1.0] * n, p),
        },
    )


def sequence_datum(prompt: ModelInput | Sequence[int], sequence: SampledSequence) -> Datum:
    """The prompt and sample as a datum with targets only: for `forward` (a critic's values, the
    reference's logprobs) on the same positions."""
    tokens, _, _ = _layout(prompt, sequence)
    return Datum(model_input=ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]})
