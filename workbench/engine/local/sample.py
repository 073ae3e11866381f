"""Sampling: pinning the weights a sampling client samples, `sample`, and `compute_logprobs`.

**Pins are operations.** A sampling client's weights are fixed by a `pin` that runs on the worker in
submission order, like a training step: a client created right after queued `forward_backward` and
`optim_step` calls samples the weights those calls leave, never older ones, and its version is known
when the pin completes. A pin holds the policy's weights at that version (`WeightSnapshots`); it is
released on the worker too (`release`, safe from a finalizer), so nothing can drop weights a queued pin
was promised. A pin can also name the base model (adapters off) or a sampler checkpoint, loaded as an
inference-only adapter shared by the clients of the same folder.

**Inflight pins** (Tinker's `kind="inflight"`) follow a target instead: each run has one inflight
target, a version its last inflight save moved it to (pinned once, for all of its inflight clients),
and a request of an inflight client samples the target as it stands when the request runs on the
worker (`current_weights`). Since the save is itself an operation, every request queued after it
samples its weights or newer, and a generation runs whole on the weights it started with (the save
waits behind it); the HF prefix cache and vLLM's adapters are keyed by the resolved version, so no
cached keys and values of one version serve another.

**Requests are batched.** A `SampleRequest`, checked as it was built, is checked against the model in
the caller's thread (`requests.prepare_request`: bad input raises and changes nothing; once, where
`check_sample` checked it first) and queued as a
batchable operation, so requests that queue up together run as one engine call per set of weights. On
the worker each request without a seed draws one from the engine's sampling generator, in order; the
engine's sampler (`workbench.engine.samplers.sampler.Sampler`, started on first use) samples under the
pinned weights (`PinnedWeights`: the training model with the right adapter active and, for a past
version, its snapshot swapped in, or those weights written as an adapter). A group whose engine call
fails is retried one request at a time, so a request that fails on the worker fails alone. Every request
gets its own response and history row (op "sample": tokens, logprob mean, weight version, staleness,
and the engine's sync time). On several ranks an HF call is spread over them (`rank_sampling`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from workbench.engine.interface import CheckedSample, SamplerPin, asked
from workbench.engine.local import rank_sampling
from workbench.engine.local.heap import release_freed_memory
from workbench.engine.local.lora_models import LoraModel
from workbench.engine.local.stability_records import StabilityRecord
from workbench.engine.local.state import REFERENCE_LABEL, EngineState, LoadedAdapter
from workbench.engine.model.batching import prepare_batch
from workbench.engine.samplers.requests import (
    PreparedRequest,
    RequestResult,
    TokenSink,
    keep_last_logprobs,
    prepare_request,
)
from workbench.engine.samplers.sample_request import SampleRequest, check_prompt_logprobs_last_n
from workbench.engine.samplers.sampler import PinnedWeights, Sampler, SamplerStart
from workbench.futures import APIFuture
from workbench.sdk_conversion import to_model_input
from workbench.types import ModelInput, SampleResponse

SAMPLER_INFO = "sampler.json"


# ---------------------------------------------------------------------------------------------- pins


def pin(state: EngineState, model_id: str | None, version: int | None = None) -> APIFuture[SamplerPin]:
    """Pin the weights a new client samples: `model_id`'s policy at `version` (default: the version the
    operations queued before this one leave), or the base model (`model_id=None`)."""
    state.check_open()
    if model_id is not None:
        state.lora_model(model_id)
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
        raise ValueError(f"version must be an integer, got {version!r}")

    def work() -> SamplerPin:
        if model_id is None:
            return SamplerPin()
        lora_model = state.lora_model(model_id)
        current = lora_model.policy.weights_version
        pinned = current if version is None else version
        if not lora_model.snapshots.is_available(pinned, current):
            live = sorted({*lora_model.snapshots.pinned_versions(), current})
            raise ValueError(f"weights version {pinned} is not held; available: {live}")
        lora_model.snapshots.pin(pinned)
        return SamplerPin(model_id=model_id, version=pinned)

    return state.submit(work, beside_writes=True)


def pin_inflight(state: EngineState, model_id: str | None) -> APIFuture[SamplerPin]:
    """Tinker's inflight save: move `model_id`'s shared inflight target to the weights the operations
    queued before this one leave, and pin a client that follows the target. The pin completes once the
    target has moved, so every request queued after it (of this client or any earlier inflight one)
    samples these weights or newer: requests resolve the target when they run on the worker
    (`current_weights`). The target, not each client, holds its version in the snapshots."""
    state.check_open()
    if model_id is None:
        raise ValueError("an inflight sampling client follows a training model's weights; the base has none")
    state.lora_model(model_id)

    def work() -> SamplerPin:
        lora_model = state.lora_model(model_id)
        current = lora_model.policy.weights_version
        previous, lora_model.inflight_version = lora_model.inflight_version, current
        lora_model.snapshots.pin(current)
        if previous is not None:
            _drop_version(state, lora_model, previous)
        return SamplerPin(model_id=model_id, version=current, inflight=True)

    return state.submit(work, beside_writes=True)


def current_weights(state: EngineState, held: SamplerPin) -> SamplerPin:
    """The weights a request of this pin samples now (worker thread): an inflight pin's model's target
    as it stands, any other pin itself."""
    if not held.inflight:
        return held
    assert held.model_id is not None
    target = state.lora_model(held.model_id).inflight_version
    assert target is not None  # set by the inflight pin itself, and only ever moved
    return dataclasses.replace(held, version=target)


def _drop_version(state: EngineState, lora_model: LoraModel, version: int) -> None:
    """Let go of one pin of `version`; the sampler forgets those weights once nothing can sample them."""
    lora_model.snapshots.unpin(version)
    live = {*lora_model.snapshots.pinned_versions(), lora_model.policy.weights_version}
    if state.sampler.started is not None and version not in live:
        state.sampler.started.forget(SamplerPin(model_id=lora_model.model_id, version=version).weights_key)


def pin_checkpoint(state: EngineState, locate: Callable[[], Path]) -> APIFuture[SamplerPin]:
    """Pin the weights of a peft adapter folder (sampler weights, or a state checkpoint's policy),
    loading it as an inference-only adapter unless a live pin already did. `locate` finds the folder on
    the worker, after the operations queued before (a save of that checkpoint included)."""
    state.check_open()

    def work() -> SamplerPin:
        folder = locate().absolute()
        loaded = state.loaded_adapters.get(folder)
        if loaded is None:
            if not (folder / "adapter_config.json").is_file():
                raise ValueError(
                    f"{folder} holds no peft adapter (adapter_config.json); give a sampler checkpoint"
                )
            info = (
                json.loads((folder / SAMPLER_INFO).read_text()) if (folder / SAMPLER_INFO).is_file() else {}
            )
            _check_base(folder, info.get("base_model"), state.base_info.identity())
            state.sampler_adapters_made += 1
            name = f"sampler_{state.sampler_adapters_made}"
            state.model.load_adapter(name, folder)
            loaded = LoadedAdapter(name, info.get("weights_version"))
            state.loaded_adapters[folder] = loaded
        loaded.users += 1
        return SamplerPin(version=loaded.version, adapter=loaded.name, folder=folder)

    return state.submit(work)


def _check_base(folder: Path, saved: Mapping[str, Any] | None, current: Mapping[str, Any]) -> None:
    """A sampler checkpoint loads onto the architecture it was trained on (however the base is named)."""
    if saved is None:
        return
    differs = sorted(key for key in current if key != "name" and saved.get(key) != current[key])
    if differs:
        details = "; ".join(
            f"{key}: checkpoint {saved.get(key)!r}, engine {current[key]!r}" for key in differs
        )
        raise ValueError(f"{folder} was saved on a different base model ({details})")


def release(state: EngineState, pin_future: APIFuture[SamplerPin]) -> None:
    """Let go of a client's pin, on the worker, after everything the client queued. Takes no lock:
    safe to call from a garbage-collector finalizer."""
    state.worker.post(lambda: _unpin(state, pin_future))


def _unpin(state: EngineState, pin_future: APIFuture[SamplerPin]) -> None:
    if (
        not pin_future.done()
        or pin_future.future().cancelled()
        or pin_future.future().exception() is not None
    ):
        return
    held = pin_future.result()
    if held.inflight:  # the shared target holds its weights, for every inflight client
        return
    if held.model_id is not None:
        lora_model = state.lora_models.get(held.model_id)
        if lora_model is None:  # the run is gone, and its snapshots with it
            return
        assert held.version is not None
        _drop_version(state, lora_model, held.version)
    elif held.folder is not None:
        loaded = state.loaded_adapters[held.folder]
        loaded.users -= 1
        if loaded.users == 0:
            del state.loaded_adapters[held.folder]
            state.model.delete_adapter(loaded.name)
            if state.sampler.started is not None:
                state.sampler.started.forget(held.weights_key)


@contextlib.contextmanager
def pinned_weights(state: EngineState, held: SamplerPin) -> Iterator[None]:
    """The model in the state a pin names: a run's policy at its version, a loaded adapter, or the base."""
    if held.model_id is not None:
        lora_model = state.lora_model(held.model_id)
        assert held.version is not None
        with (
            state.model.using(lora_model.policy.adapter),
            lora_model.snapshots.weights(held.version, lora_model.policy.weights_version),
        ):
            yield
    else:
        with state.model.using(held.adapter):
            yield


# ---------------------------------------------------------------------------------------------- requests


def check_sample(state: EngineState, request: SampleRequest) -> CheckedSample:
    """Raise what `submit_sample` raises for `request` in the caller's thread, queueing nothing; what
    passes carries its prepared form, so `submit_sample` does not check it again."""
    state.check_open()
    return CheckedSample(request, _prepared(state, request), state)


def _prepared(state: EngineState, request: SampleRequest | CheckedSample) -> PreparedRequest:
    """`request` checked against the model (`requests.prepare_request`), unless this engine checked it."""
    if isinstance(request, CheckedSample) and request.checked_by is state and request.prepared is not None:
        return request.prepared
    return prepare_request(
        asked(request),
        tokenizer=state.tokenizer,
        base_info=state.base_info,
        max_samples_per_request=state.config.max_samples_per_request,
    )


def submit_sample(
    state: EngineState,
    pin_future: APIFuture[SamplerPin],
    request: SampleRequest | CheckedSample,
    token_sink: TokenSink | None = None,
) -> APIFuture[SampleResponse]:
    state.check_open()
    prepared = dataclasses.replace(_prepared(state, request), token_sink=token_sink)
    return state.submit_batchable(
        "sample", (pin_future, prepared), lambda items: run_sample_batch(state, items)
    )


def submit_compute_logprobs(
    state: EngineState,
    pin_future: APIFuture[SamplerPin],
    prompt: ModelInput | Sequence[int],
    prompt_logprobs_last_n: int | None = None,
) -> APIFuture[list[float | None]]:
    state.check_open()
    tokens = tuple(to_model_input(prompt).to_ints())
    info = state.base_info
    # the checks a training datum's tokens get (ids in the vocabulary, length within the context)
    prepare_batch(
        [{"model_input": list(tokens), "loss_fn_inputs": {}}],
        required=(),
        vocab_size=info.vocab_size,
        max_length=info.max_length,
    )
    check_prompt_logprobs_last_n(prompt_logprobs_last_n, True, len(tokens))

    def work() -> list[float | None]:
        held = current_weights(state, pin_future.result())
        sampler = active_sampler(state)
        if state.followers is not None and state.sharded is not None:  # every rank runs every pass
            logprobs = rank_sampling.compute_logprobs(
                state, state.followers, held, tokens, pinned(state, held), _sampled_weights(state)
            )
        else:
            logprobs = sampler.compute_logprobs(tokens, pinned(state, held))
        return keep_last_logprobs(logprobs, prompt_logprobs_last_n)

    return state.submit(work, beside_writes=True)


def active_sampler(state: EngineState) -> Sampler:
    """The engine's sampler, started on first use (`factory.EngineSampler.get`: under `sampler="auto"`
    a backend that cannot start falls back to HF, and the config says so), holding nothing for weights
    no client can sample any more."""
    sampler = state.sampler.get(lambda: _sampler_start(state))
    if state.config.sampler != state.sampler.name:
        state.config = dataclasses.replace(state.config, sampler=state.sampler.name)
    sampler.keep_only(_sampled_weights(state))
    return sampler


def _sampled_weights(state: EngineState) -> set[Hashable]:
    """The weights a client can sample now; the base always (a client may sample it at any time)."""
    return {*_live_weights(state), SamplerPin().weights_key}


def _sampler_start(state: EngineState) -> SamplerStart:
    info = state.base_info
    ranks = [lora_model.policy.lora.rank for lora_model in state.lora_models.values()] or [8]
    return SamplerStart(
        model_path=info.path,
        device=state.device,
        dtype=state.dtype,
        max_lora_rank=max(ranks),
        max_length=info.max_length,
        seed=state.config.seed,
        interrupted=state.sampling_interrupted,
        model_sampler=state.hf_sampler,
        devices=1 if state.collectives is None else state.collectives.world_size,
    )


def pinned(state: EngineState, held: SamplerPin) -> PinnedWeights:
    """A pin's weights as a sampler takes them (see `PinnedWeights`)."""

    def write_adapter(folder: Path) -> None:
        with pinned_weights(state, held):
            files = state.model.adapter_files(
                held.adapter or state.lora_model(held.model_id or "").policy.adapter
            )
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (folder / name).write_bytes(data)

    return PinnedWeights(
        key=held.weights_key,
        is_base=held.is_base,
        applied=lambda: pinned_weights(state, held),
        write_adapter=write_adapter,
    )


def _live_weights(state: EngineState) -> set[Hashable]:
    """The weights a client can still sample: each run's pinned versions and current one, and each
    loaded sampler checkpoint (as `SamplerPin.weights_key`s)."""
    live: set[Hashable] = set()
    for model_id, lora_model in state.lora_models.items():
        versions = {*lora_model.snapshots.pinned_versions(), lora_model.policy.weights_version}
        live.update((model_id, version, None) for version in versions)
    live.update((None, loaded.version, loaded.name) for loaded in state.loaded_adapters.values())
    return live


def _generate(state: EngineState, held: SamplerPin, requests: list[PreparedRequest]) -> list[RequestResult]:
    """One engine call: on several ranks with the HF sampler, spread over them (`rank_sampling`);
    another backend samples for every rank's device from rank 0 (tensor parallel)."""
    sampler = active_sampler(state)
    if state.followers is None or state.sampler.name != "hf":
        return sampler.generate(requests, pinned(state, held))
    return rank_sampling.generate(
        state, state.followers, held, requests, pinned(state, held), _sampled_weights(state)
    )


def run_sample_batch(
    state: EngineState, items: Sequence[tuple[APIFuture[SamplerPin], PreparedRequest]]
) -> list[SampleResponse | BaseException]:
    """The queued requests, one engine call per set of weights (worker thread)."""
    results: list[SampleResponse | BaseException | None] = [None] * len(items)
    groups: dict[tuple[str | None, int | None, str | None], tuple[SamplerPin, list[int]]] = {}
    requests: list[PreparedRequest | None] = [None] * len(items)
    for index, (pin_future, request) in enumerate(items):
        try:
            held = current_weights(state, pin_future.result())
        except BaseException as error:  # the pin failed: so does every request of its client
            results[index] = error
            continue
        requests[index] = request.seeded(state.sampling_generator)
        groups.setdefault(held.weights_key, (held, []))[1].append(index)
    for held, indices in groups.values():
        group = [requests[i] for i in indices]
        assert all(r is not None for r in group)
        for index, outcome in zip(indices, _sample_group(state, held, group), strict=True):  # type: ignore[arg-type]
            results[index] = outcome
    release_freed_memory()  # the key/value caches of the batch's decoding
    return results  # type: ignore[return-value]


def _sample_group(
    state: EngineState, held: SamplerPin, requests: list[PreparedRequest]
) -> list[SampleResponse | BaseException]:
    """One engine call for requests on the same weights; if it fails, each request again on its own.
    A retried request has told its token sink the tokens of the failed call already: the retry tells it
    nothing more, and its caller reads the rest from the response."""
    start = time.perf_counter()
    try:
        results = _generate(state, held, requests)
    except Exception as error:
        if len(requests) == 1:
            return [error]
        return [
            outcome
            for request in requests
            for outcome in _sample_group(state, held, [dataclasses.replace(request, token_sink=None)])
        ]
    seconds = time.perf_counter() - start
    generated = sum(len(s.tokens) for result in results for s in result.sequences)
    return [
        sample_response(state, held, request, result, seconds, generated)
        for request, result in zip(requests, results, strict=True)
    ]


def sample_response(
    state: EngineState,
    held: SamplerPin,
    request: PreparedRequest,
    result: RequestResult,
    batch_seconds: float,
    batch_tokens: int,
) -> SampleResponse:
    """The response to one request (each sequence given its id, and recorded when the request asks),
    and its history row."""
    ids = request.asked.sequence_ids or [state.next_sequence_id() for _ in result.sequences]
    sequences = [
        dataclasses.replace(sequence, sequence_id=sequence_id)
        for sequence, sequence_id in zip(result.sequences, ids, strict=True)
    ]
    if request.asked.record_stability_info:
        for sequence in sequences:
            state.stability_records.add(
                sequence.sequence_id,
                StabilityRecord(
                    prompt_tokens=request.prompt_tokens,
                    tokens=tuple(sequence.tokens),
                    logprobs=tuple(sequence.logprobs),
                    model_id=held.model_id,
                    weights_version=held.version,
                ),
            )
    tokens = sum(len(s.tokens) for s in sequences)
    metrics = {
        "num_samples:sum": float(request.asked.num_samples),
        "num_tokens:sum": float(tokens),
        "stop_fraction:mean": sum(s.stop_reason == "stop" for s in sequences) / len(sequences),
        "sample_seconds": batch_seconds,
        "tokens_per_second": batch_tokens / batch_seconds if batch_seconds > 0 else 0.0,
    }
    if tokens:
        metrics["logprob:mean"] = sum(sum(s.logprobs) for s in sequences) / tokens
    if result.prefill_tokens:
        metrics["prefill_tokens:sum"] = float(result.prefill_tokens)
        metrics["prefill_cached_tokens:sum"] = float(result.prefill_cached_tokens)
    lora_model: LoraModel | None = state.lora_models.get(held.model_id) if held.model_id is not None else None
    label = REFERENCE_LABEL if held.is_base else (held.adapter or "")
    if lora_model is not None:
        assert held.version is not None
        label = lora_model.policy.adapter
        metrics["weights_version"] = float(held.version)
        metrics["staleness"] = float(lora_model.policy.weights_version - held.version)
    synced = None
    if state.sampler.started is not None and not held.is_base:
        synced = state.sampler.started.sync_ms(held.weights_key)
    if synced is not None:
        metrics["sync_ms"] = synced
    state.record("sample", lora_model, label, metrics)
    return SampleResponse(
        sequences=sequences,
        weights_version=held.version,
        prompt_logprobs=None
        if result.prompt_logprobs is None
        else keep_last_logprobs(result.prompt_logprobs, request.asked.prompt_logprobs_last_n),
        sync_ms=synced or 0.0,
        topk_prompt_logprobs=result.prompt_scores.topk_prompt_logprobs,
        target_prompt_logprobs=result.prompt_scores.target_prompt_logprobs,
        prompt_alt_tokens=result.prompt_scores.prompt_alt_tokens,
    )
