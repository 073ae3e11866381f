"""One prompt's group of sampled replies, as an RL step saw it: the record the cockpit shows.

A `RolloutGroup` holds the prompt's tokens, the sampled sequences (tokens, sampler logprobs, stop
reason), the weights version that sampled them, each reply's reward and advantage, and, once known,
the logprobs the trainer gave the same tokens (from the `forward_backward` output) and the reference
model's logprobs. From it come the step's training data (`rollout_data`), its health signals
(`workbench.loops.health`) and the rollout explorer's views; it is written to the model folder as one JSON
object (`to_json` / `from_json`), so a finished run can be explored from its files.

Advantages default to GRPO's group baseline (`group_relative_advantages`, reward minus the group
mean). A reply whose advantage is 0 carries no policy-gradient signal: `rollout_data` leaves it out,
and `attach_trainer_logprobs` expects the `forward_backward` outputs of exactly those datums, in order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from workbench.loops.advantages import group_relative_advantages
from workbench.loops.rollouts import policy_datum
from workbench.sdk_conversion import to_model_input
from workbench.types import Datum, ForwardBackwardOutput, ModelInput, SampledSequence, SampleResponse


def _finite_list(name: str, values: Sequence[float], n: int) -> list[float]:
    numbers = [float(v) for v in values]
    if len(numbers) != n:
        raise ValueError(f"{name} has {len(numbers)} values for {n} sampled sequences")
    if not all(math.isfinite(v) for v in numbers):
        raise ValueError(f"{name} contains NaN or inf: {numbers}")
    return numbers


def _per_sequence_logprobs(
    name: str, values: Sequence[Sequence[float]] | None, sequences: Sequence[SampledSequence]
) -> list[list[float]] | None:
    if values is None:
        return None
    if len(values) != len(sequences):
        raise ValueError(f"{name} has {len(values)} entries for {len(sequences)} sampled sequences")
    out = []
    for i, (row, sequence) in enumerate(zip(values, sequences, strict=True)):
        numbers = [float(v) for v in row]
        if len(numbers) != len(sequence.tokens):
            raise ValueError(
                f"{name}[{i}] has {len(numbers)} values for {len(sequence.tokens)} sampled tokens"
            )
        out.append(numbers)
    return out


@dataclass(frozen=True)
class RolloutGroup:
    """The replies sampled for one prompt, with their rewards and advantages (see the module docstring).

    Build it with `RolloutGroup.of(...)`, which checks the lengths and fills in the defaults.
    `trainer_logprobs[i]` is None for a reply that was not trained on (advantage 0), and the whole list
    is None before `attach_trainer_logprobs`.
    """

    prompt_tokens: list[int]
    sequences: list[SampledSequence]
    rewards: list[float]
    advantages: list[float]
    weights_version: int | None = None
    reference_logprobs: list[list[float]] | None = None
    trainer_logprobs: list[list[float] | None] | None = None
    step: int | None = field(default=None, compare=False)
    """The optimizer step the weights that sampled the group had; set by `Session.record_rollouts`."""

    @classmethod
    def of(
        cls,
        prompt: ModelInput | Sequence[int],
        samples: SampleResponse | Sequence[SampledSequence],
        rewards: Sequence[float],
        advantages: Sequence[float] | None = None,
        *,
        reference_logprobs: Sequence[Sequence[float]] | None = None,
    ) -> RolloutGroup:
        """A group from a prompt and what `sample` returned for it (a `SampleResponse` also gives the
        weights version); `advantages` default to `group_relative_advantages(rewards)`, and
        `reference_logprobs` (one list per reply, one value per sampled token) give the KL to the
        reference. Raises ValueError on a count or length that does not match, or a non-finite number."""
        sequences = list(samples.sequences if isinstance(samples, SampleResponse) else samples)
        if not sequences:
            raise ValueError("a rollout group needs at least one sampled sequence")
        version = samples.weights_version if isinstance(samples, SampleResponse) else None
        n = len(sequences)
        reward_values = _finite_list("rewards", rewards, n)
        advantage_values = (
            group_relative_advantages(reward_values).tolist()
            if advantages is None
            else _finite_list("advantages", advantages, n)
        )
        return cls(
            prompt_tokens=to_model_input(prompt).to_ints(),
            sequences=sequences,
            rewards=reward_values,
            advantages=advantage_values,
            weights_version=version,
            reference_logprobs=_per_sequence_logprobs("reference_logprobs", reference_logprobs, sequences),
        )

    @property
    def trained(self) -> list[bool]:
        """Which replies `rollout_data` trains on: those with a non-zero advantage."""
        return [a != 0 for a in self.advantages]

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "prompt_tokens": self.prompt_tokens,
            "sequences": [
                {
                    "tokens": s.tokens,
                    "logprobs": s.logprobs,
                    "stop_reason": s.stop_reason,
                    "sequence_id": s.sequence_id,
                }
                for s in self.sequences
            ],
            "rewards": self.rewards,
            "advantages": self.advantages,
            "weights_version": self.weights_version,
            "reference_logprobs": self.reference_logprobs,
            "trainer_logprobs": self.trainer_logprobs,
        }

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> RolloutGroup:
        return cls(
            prompt_tokens=list(record["prompt_tokens"]),
            sequences=[
                SampledSequence(
                    tokens=s["tokens"],
                    logprobs=s["logprobs"],
                    stop_reason=s["stop_reason"],
                    sequence_id=s.get("sequence_id", ""),
                )
                for s in record["sequences"]
            ],
            rewards=list(record["rewards"]),
            advantages=list(record["advantages"]),
            weights_version=record.get("weights_version"),
            reference_logprobs=record.get("reference_logprobs"),
            trainer_logprobs=record.get("trainer_logprobs"),
            step=record.get("step"),
        )


def rollout_data(groups: Sequence[RolloutGroup]) -> list[Datum]:
    """The policy-loss datums of every reply with a non-zero advantage, group by group, in order."""
    return [
        policy_datum(ModelInput.from_ints(group.prompt_tokens), sequence, advantage)
        for group in groups
        for sequence, advantage, trained in zip(group.sequences, group.advantages, group.trained, strict=True)
        if trained
    ]


def attach_trainer_logprobs(
    groups: Sequence[RolloutGroup], trained: ForwardBackwardOutput
) -> list[RolloutGroup]:
    """The groups with the trainer's logprobs of each trained reply's sampled tokens, read from the
    `forward_backward` output of `rollout_data(groups)` (its `logprobs` at the completion positions).

    Raises ValueError when the output does not hold one entry per datum of `rollout_data(groups)`.
    """
    outputs = trained.loss_fn_outputs
    expected = sum(sum(group.trained) for group in groups)
    if len(outputs) != expected:
        raise ValueError(
            f"trained has {len(outputs)} outputs, but rollout_data(groups) gives {expected} datums: pass the "
            "forward_backward output of exactly rollout_data(groups)"
        )
    position = 0
    attached = []
    for group in groups:
        start = len(group.prompt_tokens) - 1
        per_sequence: list[list[float] | None] = []
        for sequence, is_trained in zip(group.sequences, group.trained, strict=True):
            if not is_trained:
                per_sequence.append(None)
                continue
            logprobs_T = outputs[position]["logprobs"].tolist()
            position += 1
            per_sequence.append([float(v) for v in logprobs_T[start : start + len(sequence.tokens)]])
        attached.append(replace(group, trainer_logprobs=per_sequence))
    return attached
