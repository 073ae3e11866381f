"""Sampling on several ranks: a call's requests spread over the ranks, or run by every rank on a sharded base.

On an engine on several devices with the HF sampler, rank 0's worker takes a sample call (the requests
queued together for one set of weights, each already seeded from the engine's sampling generator,
`sample.run_sample_batch`) and gives each rank a share of its requests (`split_requests`: whole
requests, balanced by the rows and tokens they cost), sends each follower its share, generates its own
and gathers the results back in request order. A request draws its random numbers from its own
generator seeded by its own seed (`hf.draw_tokens`), so it samples the same tokens whichever rank
draws it and whatever else is in that rank's batch: a seeded sample is the same on one device and on
N. Token sinks of requests generated on a follower are told their tokens once the follower's share is
back (a follower's tokens cannot stream through its control pipe while it decodes).

A follower puts its own model in the state of the pinned weights (`RankWeights`): the base with
adapters off; a run's policy, whose current version every rank holds (the optimizer steps and loads are
mirrored), with a past version's tensors sent along by rank 0 (only rank 0 keeps pinned snapshots);
or a sampler checkpoint, which the follower loads from the folder rank 0 loaded it from and drops once
no client can sample it. Each message carries the weights still live, so a follower's prompt cache and
loaded checkpoints keep only those.

On a sharded base (`shard_base=True`) every pass is collective (FSDP all-gathers each layer as it
runs), so every rank runs the whole call in the same order, as a training call does
(`data_parallel`): the same requests, the same prefill passes (the sampler caches no prompts there,
`HFSampler.collective_passes`) and `generate(synced_gpus=True)`, which keeps every rank stepping until
every rank's rows have ended, once every rank has said it holds the pinned weights (`_agreed`); rank
0's result is the call's. `compute_logprobs` runs on every rank the same way. Such a call takes one
device's time; the base's memory is what it saves.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor

from workbench.engine.interface import SamplerPin
from workbench.engine.local.collectives import RankCallFailedError
from workbench.engine.local.ranks import FollowerRanks
from workbench.engine.local.state import EngineState, LoadedAdapter
from workbench.engine.model.sharded_base import resharding
from workbench.engine.samplers.requests import PreparedRequest, PromptScores, RequestResult, prepare_request
from workbench.engine.samplers.sample_request import SampleRequest
from workbench.engine.samplers.sampler import PinnedWeights
from workbench.types import ModelInput, PromptAltTokens, SampledSequence, SamplingParams

T = TypeVar("T")

WeightsKey = tuple[str | None, int | None, str | None]
"""`SamplerPin.weights_key`: a run, a version, a loaded adapter."""


@dataclass(frozen=True)
class RankWeights:
    """The weights a follower samples under, in the form it can put its own model in their state."""

    key: WeightsKey  # rank 0's key for them (the prompt cache's)
    model_id: str | None  # a run's policy; None: the base, or a sampler checkpoint
    tensors: dict[str, Tensor] | None  # the policy's tensors at a past version (None: the current one)
    folder: str | None  # a sampler checkpoint's folder, loaded as an inference adapter


@dataclass(frozen=True)
class RankRequest:
    """A prepared request as it crosses to a follower: what it asked, and the seed rank 0 fixed."""

    prompt_tokens: list[int]
    num_samples: int
    sampling_params: SamplingParams
    seed: int
    include_prompt_logprobs: bool
    prompt_logprobs_last_n: int | None
    topk_prompt_logprobs: int
    topk_sample_logprobs: int
    target_prompt_logprobs: Tensor | None
    prompt_alt_tokens_k: int

    @classmethod
    def of(cls, request: PreparedRequest) -> RankRequest:
        asked = request.asked
        assert request.seed is not None  # seeded on rank 0 before it is sent
        return cls(
            prompt_tokens=list(request.prompt_tokens),
            num_samples=asked.num_samples,
            sampling_params=asked.sampling_params,
            seed=request.seed,
            include_prompt_logprobs=asked.include_prompt_logprobs,
            prompt_logprobs_last_n=asked.prompt_logprobs_last_n,
            topk_prompt_logprobs=asked.topk_prompt_logprobs,
            topk_sample_logprobs=asked.topk_sample_logprobs,
            target_prompt_logprobs=None
            if asked.target_prompt_logprobs is None
            else torch.from_numpy(asked.target_prompt_logprobs.copy()),
            prompt_alt_tokens_k=asked.prompt_alt_tokens_k,
        )

    def prepared(self, state: EngineState) -> PreparedRequest:
        """The request prepared on the follower's model, as rank 0 prepared it (the same checks, seed)."""
        asked = SampleRequest(
            ModelInput.from_ints(self.prompt_tokens),
            self.num_samples,
            self.sampling_params,
            self.include_prompt_logprobs,
            prompt_logprobs_last_n=self.prompt_logprobs_last_n,
            topk_prompt_logprobs=self.topk_prompt_logprobs,
            topk_sample_logprobs=self.topk_sample_logprobs,
            target_prompt_logprobs=self.target_prompt_logprobs,
            prompt_alt_tokens_k=self.prompt_alt_tokens_k,
        )
        prepared = prepare_request(
            asked,
            tokenizer=state.tokenizer,
            base_info=state.base_info,
            max_samples_per_request=state.config.max_samples_per_request,
        )
        return dataclasses.replace(prepared, seed=self.seed)


@dataclass(frozen=True)
class SampleShard:
    """A follower's part of a sample call (all of it on a sharded base), and the weights still live."""

    weights: RankWeights
    requests: list[RankRequest]
    live: list[WeightsKey]  # every set of weights a client can still sample: the caches keep only these
    live_folders: list[str]  # the sampler checkpoints loaded for clients


@dataclass(frozen=True)
class LogprobsShard:
    """`compute_logprobs` on a follower of a sharded base (every rank runs the same pass)."""

    weights: RankWeights
    prompt: list[int]
    live: list[WeightsKey]
    live_folders: list[str]


REPLY_TYPES: dict[str, type] = {
    cls.__name__: cls for cls in (RequestResult, SampledSequence, PromptScores, PromptAltTokens)
}
"""What a follower's sampling replies are built of, besides plain data and tensors (`rank_messages`)."""
MESSAGE_TYPES: dict[str, type] = {
    cls.__name__: cls for cls in (SampleShard, LogprobsShard, RankWeights, RankRequest, SamplingParams)
}
"""What a sampling message to a follower is built of."""


def split_requests(requests: Sequence[PreparedRequest], ranks: int) -> list[list[int]]:
    """Each rank's request indices (in call order): whole requests, largest first, each to the rank with
    the least work so far, a request's work counted as its prompt's tokens (prefilled once) and its
    rows' new tokens (`num_samples` × `max_tokens`). Rank 0 takes ties, so a one-request call stays
    on rank 0."""
    work = [request.prompt_length + request.asked.num_samples * request.max_tokens for request in requests]
    order = sorted(range(len(requests)), key=lambda index: (-work[index], index))
    load = [0] * ranks
    shares: list[list[int]] = [[] for _ in range(ranks)]
    for index in order:
        rank = min(range(ranks), key=lambda r: (load[r], r))
        shares[rank].append(index)
        load[rank] += work[index]
    return [sorted(share) for share in shares]


def rank_weights(state: EngineState, held: SamplerPin) -> RankWeights:
    """What a follower needs to sample `held`'s weights (rank 0's worker): a past version's tensors are
    copied from rank 0's snapshot, since only rank 0 keeps them."""
    if held.model_id is None:
        return RankWeights(held.weights_key, None, None, None if held.folder is None else str(held.folder))
    lora_model = state.lora_model(held.model_id)
    current = lora_model.policy.weights_version
    tensors = None
    if held.version is not None and held.version != current:
        with lora_model.snapshots.weights(held.version, current):
            tensors = {
                name: param.detach().clone() for name, param in lora_model.policy.trainable.parameters.items()
            }
    return RankWeights(held.weights_key, held.model_id, tensors, None)


def _message(
    state: EngineState,
    weights: RankWeights,
    requests: Sequence[PreparedRequest],
    live: set[Hashable],
) -> SampleShard:
    return SampleShard(
        weights, [RankRequest.of(request) for request in requests], _keys(live), _folders(state)
    )


def _keys(live: set[Hashable]) -> list[WeightsKey]:
    return [key for key in live if isinstance(key, tuple)]


def _folders(state: EngineState) -> list[str]:
    return [str(folder) for folder in state.loaded_adapters]


def _gathered(
    followers: FollowerRanks, messages: dict[int, SampleShard | LogprobsShard], own: Callable[[], T]
) -> tuple[T, dict[int, Any]]:
    """Each follower of `messages` runs its message while rank 0 runs `own`: rank 0's result and each
    follower's reply. Every reply is taken before anything is raised (rank 0's error first, unless it
    only says a follower failed), so the pipes stay in step whatever fails."""
    for rank, message in messages.items():
        followers.request(rank, ("logprobs" if isinstance(message, LogprobsShard) else "sample", message))
    try:
        result = own()
    except BaseException as error:
        theirs: RuntimeError | None = None
        for rank in messages:
            try:
                followers.reply(rank)
            except RuntimeError as failure:
                theirs = theirs or failure
        if isinstance(error, RankCallFailedError) and theirs is not None:
            raise theirs from error  # rank 0 only heard that a follower failed: its own words say why
        raise
    replies: dict[int, Any] = {}
    error: RuntimeError | None = None
    for rank in messages:
        try:
            replies[rank] = followers.reply(rank)
        except RuntimeError as failure:
            error = error or failure
    if error is not None:
        raise error
    return result, replies


def generate(
    state: EngineState,
    followers: FollowerRanks,
    held: SamplerPin,
    requests: list[PreparedRequest],
    weights: PinnedWeights,
    live: set[Hashable],
) -> list[RequestResult]:
    """Rank 0's part of a sample call on several ranks (worker thread): see the module."""
    sampler = state.hf_sampler

    def own(share: list[PreparedRequest]) -> Callable[[], list[RequestResult]]:
        def run() -> list[RequestResult]:
            with resharding(state.sharded):
                _agreed(state, lambda: None)  # rank 0's weights are pinned: rank 0 is ready
                return sampler.generate(share, weights) if share else []

        return run

    with followers.during("sample"):
        if state.sharded is not None:  # every rank runs the whole call; rank 0's result is the call's
            message = _message(state, rank_weights(state, held), requests, live)
            return _gathered(followers, dict.fromkeys(followers.ranks, message), own(requests))[0]
        shares = split_requests(requests, len(followers.ranks) + 1)
        sent = [rank for rank in followers.ranks if shares[rank]]
        if not sent:
            return own(requests)()
        rank_held = rank_weights(state, held)
        messages = {
            rank: _message(state, rank_held, [requests[i] for i in shares[rank]], live) for rank in sent
        }
        mine, replies = _gathered(followers, messages, own([requests[i] for i in shares[0]]))
    results: list[RequestResult | None] = [None] * len(requests)
    for index, result in zip(shares[0], mine, strict=True):
        results[index] = result
    for rank, theirs in replies.items():
        for index, result in zip(shares[rank], theirs, strict=True):
            results[index] = result
            _tell_sink(requests[index], result)
    assert all(result is not None for result in results)
    return results  # type: ignore[return-value]


def _tell_sink(request: PreparedRequest, result: RequestResult) -> None:
    """A follower's request's token sink, told every token of each sequence at once."""
    if request.token_sink is None:
        return
    for sequence, sampled in enumerate(result.sequences):
        for token in sampled.tokens:
            request.token_sink(sequence, token)


def compute_logprobs(
    state: EngineState,
    followers: FollowerRanks,
    held: SamplerPin,
    prompt: tuple[int, ...],
    weights: PinnedWeights,
    live: set[Hashable],
) -> list[float | None]:
    """`compute_logprobs` on a sharded base: the same pass on every rank, rank 0's logprobs."""
    message = LogprobsShard(rank_weights(state, held), list(prompt), _keys(live), _folders(state))

    def own() -> list[float | None]:
        with resharding(state.sharded):
            _agreed(state, lambda: None)
            return state.hf_sampler.compute_logprobs(prompt, weights)

    with followers.during("compute_logprobs"):
        return _gathered(followers, dict.fromkeys(followers.ranks, message), own)[0]


# ---------------------------------------------------------------------------------------------- followers


def follower_sample(state: EngineState, shard: SampleShard) -> list[RequestResult] | None:
    """A follower's part of a sample call (its worker): its share's results, or None on a sharded base,
    where rank 0's results are the call's."""
    with resharding(state.sharded), contextlib.ExitStack() as stack:

        def prepare() -> list[PreparedRequest]:
            _keep_live(state, shard.live, shard.live_folders)
            requests = [request.prepared(state) for request in shard.requests]
            stack.enter_context(_applied(state, shard.weights))
            return requests

        results = state.hf_sampler.generate_as_is(_agreed(state, prepare), shard.weights.key)
    return None if state.sharded is not None else results


def follower_logprobs(state: EngineState, shard: LogprobsShard) -> None:
    """A follower's `compute_logprobs` pass on a sharded base (the result is rank 0's)."""
    with resharding(state.sharded), contextlib.ExitStack() as stack:

        def prepare() -> None:
            _keep_live(state, shard.live, shard.live_folders)
            stack.enter_context(_applied(state, shard.weights))

        _agreed(state, prepare)
        state.hf_sampler.prompt_logprobs([tuple(shard.prompt)])


def _agreed(state: EngineState, prepare: Callable[[], T]) -> T:
    """`prepare()`, then, on a sharded base, every rank's word that it is ready (one all_reduce of a
    failure flag) before the call's first collective pass: a rank that could not put its model in the
    pinned weights' state (a sampler checkpoint's folder gone) fails the call on every rank at once,
    where the others would wait at their first all-gather until the group's timeout."""
    if state.sharded is None or state.collectives is None:
        return prepare()
    try:
        value = prepare()
    except BaseException:
        with contextlib.suppress(RankCallFailedError):  # every rank learns of it; this one raises its own
            state.collectives.agree_on_call(True)
        raise
    state.collectives.agree_on_call(False)
    return value


def _keep_live(state: EngineState, live: list[WeightsKey], folders: list[str]) -> None:
    """Forget the prompts of weights no client samples, and unload the checkpoints no client holds."""
    state.hf_sampler.keep_only(live)
    kept = {Path(folder) for folder in folders}
    for folder in [folder for folder in state.loaded_adapters if folder not in kept]:
        state.model.delete_adapter(state.loaded_adapters.pop(folder).name)


@contextlib.contextmanager
def _applied(state: EngineState, weights: RankWeights) -> Iterator[None]:
    """The follower's model in the state of `weights` for the body; its own weights come back after."""
    if weights.folder is not None:
        with state.model.using(_loaded(state, Path(weights.folder))):
            yield
        return
    if weights.model_id is None:
        with state.model.using(None):
            yield
        return
    policy = state.lora_model(weights.model_id).policy
    with state.model.using(policy.adapter), _swapped(policy.trainable.parameters, weights.tensors):
        yield


def _loaded(state: EngineState, folder: Path) -> str:
    """The adapter name of the sampler checkpoint `folder` on this follower, loading it the first time."""
    loaded = state.loaded_adapters.get(folder)
    if loaded is None:
        state.sampler_adapters_made += 1
        loaded = LoadedAdapter(f"sampler_{state.sampler_adapters_made}", None)
        state.model.load_adapter(loaded.name, folder)
        state.loaded_adapters[folder] = loaded
    return loaded.name


@contextlib.contextmanager
def _swapped(parameters: dict[str, torch.nn.Parameter], tensors: dict[str, Tensor] | None) -> Iterator[None]:
    """`parameters` holding `tensors` for the body, their own values back after, bit for bit."""
    if tensors is None:
        yield
        return
    live = {name: param.detach().clone() for name, param in parameters.items()}
    try:
        with torch.no_grad():
            for name, param in parameters.items():
                param.copy_(tensors[name].to(param.device))
        yield
    finally:
        with torch.no_grad():
            for name, param in parameters.items():
                param.copy_(live[name])
