"""The session's sampling operations, behind `SamplingClient.sample` and `.compute_logprobs`.

A request is validated in the caller's thread (`requests.prepare_request`: bad input raises and changes
nothing, the seed is fixed in submission order) and queued as a batchable operation keyed by its weight
version, so requests for the same weights that queue up together run as one engine call. On the worker
thread the engine samples under the right weights: the HF sampler uses the live model with the policy's
adapter at the pinned version (a snapshot swapped in if the policy has moved on) or with adapters off
for the base; vLLM gets the version as a LoRA adapter. Every request gets its own response and history
row (op "sample": tokens, logprob mean, weight version, staleness, and the engine's sync time).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.futures import APIFuture
from workbench.sampling.requests import RequestResult, SampleRequest, prepare_request
from workbench.sampling.vllm import VLLMSampler
from workbench.types import ModelInput, SampleResponse, SamplingParams, to_model_input

if TYPE_CHECKING:
    from workbench.session import Session

POLICY = "policy"
REFERENCE = "reference"


def submit_sample(
    sess: Session,
    version: int | None,
    prompt: ModelInput | Sequence[int],
    num_samples: int,
    sampling_params: SamplingParams | Mapping[str, Any],
    include_prompt_logprobs: bool,
) -> APIFuture[SampleResponse]:
    sess._check_open()
    request = prepare_request(
        prompt,
        num_samples,
        sampling_params,
        include_prompt_logprobs,
        tokenizer=sess.tokenizer,
        vocab_size=sess.base_info.vocab_size,
        max_length=sess.base_info.max_length,
        max_samples_per_request=sess.config.max_samples_per_request,
        generator=sess._sampling_generator,
    )
    return sess._worker.submit_batchable(("sample", version), request, lambda batch: run_sample_batch(sess, version, batch))


def submit_compute_logprobs(sess: Session, version: int | None, prompt: ModelInput | Sequence[int]) -> APIFuture[list[float | None]]:
    sess._check_open()
    tokens = tuple(to_model_input(prompt).to_ints())
    sess._prepare([{"model_input": list(tokens), "loss_fn_inputs": {}}], (), {})  # the checks training data gets

    def run() -> list[float | None]:
        with sampling_weights(sess, version):
            return sess._hf_sampler.prompt_logprobs([tokens])[0]

    return sess._worker.submit(run)


@contextlib.contextmanager
def sampling_weights(sess: Session, version: int | None) -> Iterator[None]:
    """The model in the state a sampling client asks for: the policy at `version`, or the base."""
    sess._activate(POLICY)
    if version is None:
        with sess._model.disable_adapter():
            yield
    else:
        with sess._snapshots.weights(version, sess.policy.weights_version):
            yield


def vllm_engine(sess: Session) -> VLLMSampler:
    """The session's vLLM engine, started on first use."""
    if sess._vllm_sampler is None:
        sess._vllm_sampler = VLLMSampler(
            sess.base_info.path, sess.base_info.path, sess.dtype, sess.config.lora.rank, sess.base_info.max_length, sess.config.seed
        )
    return sess._vllm_sampler


def write_policy_adapter(sess: Session, version: int, folder: Path) -> None:
    """The policy's adapter at `version`, in peft's format, for vLLM to load (worker thread)."""
    from workbench.session_state import peft_adapter_files

    with sampling_weights(sess, version):
        files = peft_adapter_files(sess._model, POLICY, sess.base_info.path)
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)


def run_sample_batch(sess: Session, version: int | None, requests: list[SampleRequest]) -> list[SampleResponse]:
    """One engine call for the queued requests of one weight version (worker thread)."""
    start = time.perf_counter()
    if sess.config.sampler == "vllm":
        results = vllm_engine(sess).generate(requests, version, lambda v, folder: write_policy_adapter(sess, v, folder))
    else:
        with sampling_weights(sess, version):
            results = sess._hf_sampler.generate(requests)
    seconds = time.perf_counter() - start
    generated = sum(len(s.tokens) for result in results for s in result.sequences)
    return [sample_response(sess, version, request, result, seconds, generated) for request, result in zip(requests, results, strict=True)]


def sample_response(
    sess: Session, version: int | None, request: SampleRequest, result: RequestResult, batch_seconds: float, batch_tokens: int
) -> SampleResponse:
    """The response to one request, and its history row."""
    sequences = result.sequences
    tokens = sum(len(s.tokens) for s in sequences)
    metrics = {
        "num_samples:sum": float(request.num_samples),
        "num_tokens:sum": float(tokens),
        "stop_fraction:mean": sum(s.stop_reason == "stop" for s in sequences) / len(sequences),
        "sample_seconds": batch_seconds,
        "tokens_per_second": batch_tokens / batch_seconds if batch_seconds > 0 else 0.0,
    }
    if tokens:
        metrics["logprob:mean"] = sum(sum(s.logprobs) for s in sequences) / tokens
    sync_ms = 0.0
    if version is not None:
        metrics["weights_version"] = float(version)
        metrics["staleness"] = float(sess.policy.weights_version - version)
        if sess._vllm_sampler is not None:
            sync_ms = sess._vllm_sampler.sync_ms(version)
            metrics["sync_ms"] = sync_ms
    sess._record("sample", POLICY if version is not None else REFERENCE, metrics)
    return SampleResponse(sequences=sequences, weights_version=version, prompt_logprobs=result.prompt_logprobs, sync_ms=sync_ms)
