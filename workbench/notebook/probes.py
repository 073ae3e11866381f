"""Correctness probes a researcher runs on their own setup.

`check_logprob_agreement`: do the sampler's logprobs equal the trainer's on the same tokens? Off-policy
corrections (importance sampling, PPO's ratio) assume they do; a bf16 sampler, a different attention
kernel or a stale adapter in vLLM breaks that silently. On CPU in fp32 the two agree to ~1e-6; on GPU in
bf16 expect ~1e-2 and compare against your own threshold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from workbench.notebook.session import Session
from workbench.tinker_api.clients import SamplingClient
from workbench.types import Datum, ModelInput, SamplingParams


@dataclass(frozen=True)
class AgreementReport:
    """|sampler logprob − trainer logprob| over every sampled token."""

    num_tokens: int
    mean_abs_diff: float
    max_abs_diff: float

    def __str__(self) -> str:
        return (
            f"sampler vs trainer logprobs over {self.num_tokens} tokens: "
            f"mean |Δ| = {self.mean_abs_diff:.2e}, max |Δ| = {self.max_abs_diff:.2e}"
        )


def check_logprob_agreement(
    session: Session,
    prompts: Sequence[ModelInput | Sequence[int]],
    *,
    num_samples: int = 4,
    sampling_params: SamplingParams | None = None,
    sampling_client: SamplingClient | None = None,
) -> AgreementReport:
    """Sample from each prompt, score the same tokens with the policy's `forward`, and compare.

    `sampling_client` defaults to one for the policy's current weights (it must be for the current
    weights: `forward` scores with those). Prints the report and returns it. The sampling temperature
    must be 1 (or 0, greedy): at another τ a sampled token's logprob is under the tempered distribution
    it was drawn from (the temperature rule of `SampledSequence`), which `forward` does not compute.
    """
    client = sampling_client or session.sampling_client()
    if client.weights_version != session.policy.weights_version:
        raise ValueError(
            "the sampling client must be for the policy's current weights, which forward scores with"
        )
    params = sampling_params or SamplingParams(max_tokens=32, temperature=1.0)
    if params.temperature not in (0.0, 1.0):
        raise ValueError(
            f"sample at temperature 1 (or 0) to compare with forward, got {params.temperature}: at another "
            "temperature sampled logprobs are those of the tempered distribution, log_softmax(logits / τ)"
        )
    futures = [client.sample(prompt, num_samples, params) for prompt in prompts]
    data: list[Datum] = []
    sampled: list[list[float]] = []
    prompt_lengths: list[int] = []
    for prompt, future in zip(prompts, futures, strict=True):
        prompt_tokens = prompt.to_ints() if isinstance(prompt, ModelInput) else list(prompt)
        for sequence in future.result().sequences:
            if not sequence.tokens:
                continue
            full = prompt_tokens + sequence.tokens
            data.append(
                Datum(model_input=ModelInput.from_ints(full[:-1]), loss_fn_inputs={"target_tokens": full[1:]})
            )
            sampled.append(sequence.logprobs)
            prompt_lengths.append(len(prompt_tokens))
    trainer = session.policy.forward(data, "cross_entropy").result()
    diffs = []
    for output, logprobs, prompt_length in zip(trainer.loss_fn_outputs, sampled, prompt_lengths, strict=True):
        scored = output["logprobs"].tolist()[prompt_length - 1 :]
        diffs.extend(abs(a - b) for a, b in zip(scored, logprobs, strict=True))
    report = AgreementReport(
        num_tokens=len(diffs), mean_abs_diff=sum(diffs) / len(diffs), max_abs_diff=max(diffs)
    )
    print(report)
    return report
