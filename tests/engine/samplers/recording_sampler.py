"""A third sampler backend, written outside `workbench/`: ancestral sampling with a full forward pass of
the training model per token (no key/value cache), recording the weights it has sampled.

It is the proof that a backend plugs in through the factory alone (`factory.SAMPLERS["recording"] =
BACKEND`) and what the sampler contract tests run beside HF and vLLM: small enough to read at once, and
independent of the HF sampler's batching, prefix cache and logits processor, so that where the two agree
the contract is what they share. It samples at temperature 1 or 0 (greedy), stopping at a stop token or
`max_tokens`; a request that asks for anything more (top-k or top-p, stop strings, top-k logprobs,
prompt logprobs or scores) is refused. Each token's logprob is log_softmax(logits)[token], the number
`forward` computes for it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

import psutil
import torch

from workbench.engine.samplers.hf import HFSampler
from workbench.engine.samplers.requests import PreparedRequest, RequestResult
from workbench.engine.samplers.sampler import PinnedWeights, SamplerBackend, SamplerStart
from workbench.types import SampledSequence


class RecordingSampler:
    """Decodes every row token by token, re-running the whole sequence each step."""

    def __init__(self, model_sampler: HFSampler):
        self.model_sampler = model_sampler  # for its model, vocabulary and prompt logprobs
        self.sampled: set[Hashable] = set()  # the weights sampled and not forgotten since
        self.closed = False

    def generate(self, requests: Sequence[PreparedRequest], weights: PinnedWeights) -> list[RequestResult]:
        if self.closed:
            raise RuntimeError("the recording sampler is closed")
        for request in requests:
            _check_supported(request)
        self.sampled.add(weights.key)
        with weights.applied(), torch.no_grad():
            return [RequestResult(self._sample(request), None) for request in requests]

    def _sample(self, request: PreparedRequest) -> list[SampledSequence]:
        assert request.seed is not None
        generator = torch.Generator().manual_seed(request.seed)
        module = self.model_sampler.adapted.module
        device = self.model_sampler.device
        rows = []
        for sequence in range(request.asked.num_samples):
            tokens: list[int] = []
            logprobs: list[float] = []
            stop_reason = "length"
            while len(tokens) < request.max_tokens:
                ids_1_T = torch.tensor([[*request.prompt_tokens, *tokens]], device=device)
                logits_V = module(input_ids=ids_1_T).logits[0, -1, : self.model_sampler.vocab_size].float()
                logprobs_V = torch.log_softmax(logits_V, dim=-1).cpu()
                if request.params.temperature == 0:
                    token = int(torch.argmax(logprobs_V))
                else:
                    token = int(torch.multinomial(logprobs_V.exp(), 1, generator=generator))
                tokens.append(token)
                logprobs.append(float(logprobs_V[token]))
                if request.token_sink is not None:
                    request.token_sink(sequence, token)
                if token in request.stop_token_ids:
                    stop_reason = "stop"
                    break
            rows.append(SampledSequence(tokens, logprobs, stop_reason))
        return rows

    def compute_logprobs(self, prompt: tuple[int, ...], weights: PinnedWeights) -> list[float | None]:
        return self.model_sampler.compute_logprobs(prompt, weights)

    def sync_ms(self, key: Hashable) -> float | None:
        return None  # it samples the training model itself

    def forget(self, key: Hashable) -> None:
        self.sampled.discard(key)

    def keep_only(self, live: Iterable[Hashable]) -> None:
        self.sampled &= set(live)

    @property
    def processes(self) -> frozenset[psutil.Process]:
        return frozenset()

    def close(self) -> None:
        self.closed = True


def _check_supported(request: PreparedRequest) -> None:
    params, asked = request.params, request.asked
    unsupported = {
        "a temperature other than 0 or 1": params.temperature not in (0.0, 1.0),
        "top_k or top_p": params.top_k > 0 or params.top_p < 1.0,
        "stop strings": bool(request.stop_strings),
        "top-k sample logprobs": bool(asked.topk_sample_logprobs),
        "prompt logprobs or scores": asked.include_prompt_logprobs or asked.scores_prompt,
    }
    asked_for = [name for name, asked_here in unsupported.items() if asked_here]
    if asked_for:
        raise ValueError(f"the recording sampler does not sample with {', '.join(asked_for)}")


def start(context: SamplerStart) -> RecordingSampler:
    return RecordingSampler(context.model_sampler)


BACKEND = SamplerBackend(title="the recording sampler", start=start)
