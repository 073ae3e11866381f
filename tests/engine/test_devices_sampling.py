"""Sampling on several devices (`devices=2`: two CPU ranks here), against the one-device engine.

The two-rank session and its one-device twin are made once for the module and every test does the
same operations on both, so their models stay in step. A call's requests are queued together while
each worker is held in a `forward_backward_custom` whose loss waits until they are, so each session
samples them in one call whatever the machine's load: the two-rank session spreads that call over its
ranks. The session with a sharded base starts once the pair's two-rank one is closed (one multi-device
session per process), and is compared with fresh models on the one-device twin.
"""

from __future__ import annotations

import random
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

import workbench as wb
from tests.datums import ragged_ce_batch, random_tokens, unweighted_datum
from workbench.engine.local.rank_sampling import split_requests
from workbench.engine.samplers.requests import prepare_request

RELATIVE = 1e-5
VOCAB = 200


def _prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [random_tokens(rng, rng.randrange(3, 12), VOCAB) for _ in range(count)]


def _together(
    sess: wb.Session, client: wb.SamplingClient, prompts: list[list[int]], params: list[wb.SamplingParams]
) -> list[wb.SampleResponse]:
    """Every prompt sampled (3 samples each) in one engine call: queued while the worker is held."""
    queued = threading.Event()

    def wait_for_the_requests(data: list, logprobs: list) -> tuple:
        assert queued.wait(timeout=120)
        return logprobs[0].sum() * 0.0, {}

    try:
        held = sess.policy.forward_backward_custom([unweighted_datum([1, 2, 3, 4])], wait_for_the_requests)
        futures = [client.sample(p, 3, q) for p, q in zip(prompts, params, strict=True)]
        queued.set()
        held.result()
        return [future.result() for future in futures]
    finally:
        queued.set()


def _assert_same_samples(two: list[wb.SampleResponse], one: list[wb.SampleResponse]) -> None:
    """The same tokens and stop reasons; logprobs (and top-k) equal to `RELATIVE`."""
    assert len(two) == len(one)
    for mine, theirs in zip(two, one, strict=True):
        assert mine.weights_version == theirs.weights_version
        for a, b in zip(mine.sequences, theirs.sequences, strict=True):
            assert a.tokens == b.tokens and a.stop_reason == b.stop_reason
            torch.testing.assert_close(
                torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=RELATIVE, atol=RELATIVE
            )
            assert (a.topk_logprobs is None) == (b.topk_logprobs is None)
            if a.topk_logprobs is not None and b.topk_logprobs is not None:
                for row_a, row_b in zip(a.topk_logprobs, b.topk_logprobs, strict=True):
                    assert [token for token, _ in row_a] == [token for token, _ in row_b]


def _seeded(count: int, first_seed: int) -> list[wb.SamplingParams]:
    return [
        wb.SamplingParams(max_tokens=4 + k % 5, temperature=1.0, seed=first_seed + k, stop=[])
        for k in range(count)
    ]


def test_requests_are_split_whole_by_their_work_in_call_order(pair: tuple[wb.Session, wb.Session]) -> None:
    _, one = pair
    engine = one.engine

    def prepared(length: int, samples: int, max_tokens: int):  # type: ignore[no-untyped-def]
        request = wb.SampleRequest(list(range(1, length + 1)), samples, {"max_tokens": max_tokens})
        return prepare_request(
            request, tokenizer=engine.tokenizer, base_info=engine.base_info, max_samples_per_request=16
        )

    # work: 4 + 8·10 = 84, 10 + 1·10 = 20, 4 + 4·10 = 44, 4 + 4·10 = 44; largest first, each to the
    # rank with less: 84 → 0, 44 → 1, 44 → 1, 20 → 0 (84 < 88): 104 and 88
    requests = [prepared(4, 8, 10), prepared(10, 1, 10), prepared(4, 4, 10), prepared(4, 4, 10)]
    assert split_requests(requests, 2) == [[0, 1], [2, 3]]
    assert split_requests(requests[:1], 2) == [[0], []]  # a lone request stays on rank 0
    assert split_requests(requests, 1) == [[0, 1, 2, 3]]


def test_seeded_samples_equal_one_device_spread_over_the_ranks(pair: tuple[wb.Session, wb.Session]) -> None:
    """After a step on both: the current weights, a past version's (its snapshot sent to the follower)
    and the base's, each sampled in one call of 6 seeded requests, give the same tokens as on one
    device, logprobs to 1e-5, whichever rank drew them; rank 0 generated only its share."""
    two, one = pair
    pinned_before = [sess.sampling_client() for sess in (two, one)]
    data = ragged_ce_batch(3, 6, 4, 12, VOCAB)
    for sess in (two, one):
        sess.policy.forward_backward(data, "cross_entropy").result()
        sess.policy.optim_step(wb.AdamParams(learning_rate=5e-2)).result()
    prompts = _prompts(11, 6)
    drawn: dict[str, list[list[int]]] = {}
    for label, clients in (
        ("current", [sess.sampling_client() for sess in (two, one)]),
        ("past version", pinned_before),
        ("base", [sess.sampling_client(base=True) for sess in (two, one)]),
    ):
        params = _seeded(len(prompts), 100)
        before = [sess.engine.prompt_cache.stats.requests for sess in (two, one)]
        mine = _together(two, clients[0], prompts, params)
        theirs = _together(one, clients[1], prompts, params)
        on_rank_0, on_one = (
            sess.engine.prompt_cache.stats.requests - count
            for sess, count in zip((two, one), before, strict=True)
        )
        assert on_one == len(prompts), label
        assert 0 < on_rank_0 < len(prompts), label  # the follower drew the rest
        _assert_same_samples(mine, theirs)
        drawn[label] = [s.tokens for response in mine for s in response.sequences]
    # the step moved the adapter: the same seeds draw otherwise from the current weights than from the
    # past version's (which the base's equal: a fresh LoRA adds nothing)
    assert drawn["current"] != drawn["past version"]
    assert drawn["past version"] == drawn["base"]


def test_unseeded_samples_follow_the_engine_seed_on_every_rank(pair: tuple[wb.Session, wb.Session]) -> None:
    """Requests without a seed draw theirs from the engine's generator on rank 0, in order: the same
    tokens as the one-device session of the same seed, and samples that differ from each other."""
    two, one = pair
    prompts = _prompts(12, 5)
    params = [wb.SamplingParams(max_tokens=6, temperature=1.0, stop=[])] * len(prompts)
    mine = _together(two, two.sampling_client(), prompts, params)
    theirs = _together(one, one.sampling_client(), prompts, params)
    _assert_same_samples(mine, theirs)
    drawn = {tuple(s.tokens) for response in mine for s in response.sequences}
    assert len(drawn) > len(prompts)  # 15 samples of 6 tokens from 200: not a handful repeated


def test_sampled_logprobs_agree_with_the_trainer_on_two_ranks(pair: tuple[wb.Session, wb.Session]) -> None:
    """At temperature 1 the sampler's logprob of each token is what `forward` and `compute_logprobs`
    compute, as on one device, for the sequences rank 0 drew and those the follower drew; top-k rides
    along."""
    two, _ = pair
    prompts = _prompts(13, 4)
    client = two.sampling_client()
    queued = threading.Event()

    def wait_for_the_requests(data: list, logprobs: list) -> tuple:
        assert queued.wait(timeout=120)
        return logprobs[0].sum() * 0.0, {}

    held = two.policy.forward_backward_custom([unweighted_datum([1, 2, 3, 4])], wait_for_the_requests)
    futures = [
        client.sample(p, 2, wb.SamplingParams(max_tokens=8, seed=7 + i, stop=[]), topk_sample_logprobs=3)
        for i, p in enumerate(prompts)
    ]
    queued.set()
    held.result()
    worst = 0.0
    for prompt, future in zip(prompts, futures, strict=True):
        for sequence in future.result().sequences:
            assert sequence.topk_logprobs is not None and len(sequence.topk_logprobs) == 8
            full = prompt + sequence.tokens
            out = two.policy.forward([unweighted_datum(full)], "cross_entropy").result()
            scored = out.loss_fn_outputs[0]["logprobs"].tolist()[len(prompt) - 1 :]
            computed = client.compute_logprobs(full).result()[len(prompt) :]
            for forward_logprobs in (scored, computed):
                worst = max(
                    worst, max(abs(a - b) for a, b in zip(forward_logprobs, sequence.logprobs, strict=True))
                )
    assert worst <= 1e-4


def test_a_sampler_checkpoint_samples_alike_on_every_rank(
    pair: tuple[wb.Session, wb.Session], tmp_path: Path
) -> None:
    """A client of saved sampler weights (what a cookbook RL loop samples): the follower loads the same
    folder, and the seeded samples equal the one-device session's."""
    two, one = pair
    paths = [
        sess.policy.save_weights_for_sampler(f"ranks-{i}").result().path for i, sess in enumerate((two, one))
    ]
    clients = [
        sess.service_client().create_sampling_client(model_path=path)
        for sess, path in zip((two, one), paths, strict=True)
    ]
    prompts = _prompts(14, 4)
    params = _seeded(len(prompts), 300)
    before = two.engine.prompt_cache.stats.requests
    mine = _together(two, clients[0], prompts, params)
    assert 0 < two.engine.prompt_cache.stats.requests - before < len(prompts)  # the follower drew some
    _assert_same_samples(mine, _together(one, clients[1], prompts, params))


def test_a_sampler_that_cannot_sample_for_the_ranks_is_refused_before_any_rank_starts() -> None:
    """vLLM, not installed here or (where it is) on a base sharded over the ranks: refused, saying why,
    before any rank process starts."""
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match=r"sampler='vllm' (is not available|cannot sample for an engine)"):
        wb.Engine("tiny", devices=2, sampler="vllm", shard_base=True)
    assert {child.pid for child in psutil.Process().children(recursive=True)} <= before


@pytest.fixture(scope="module")
def sharded(pair: tuple[wb.Session, wb.Session]) -> Iterator[wb.Session]:
    """Two ranks with the base sharded across them (FSDP2), once the pair's two-rank session is closed."""
    two, _ = pair
    two.close()
    sess = wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, wandb=False, devices=2, shard_base=True)
    yield sess
    sess.close()


def test_a_sharded_base_samples_scores_and_exports_as_one_device(
    pair: tuple[wb.Session, wb.Session], sharded: wb.Session, tmp_path: Path
) -> None:
    """On a base sharded over two ranks (every rank runs every pass), after a step on a fresh model
    made alike on both: seeded samples (with prompt logprobs), `compute_logprobs`, samples of a saved
    sampler checkpoint and the merged export equal the one-device engine's."""
    _, one = pair
    lora = wb.LoraConfig(rank=4)
    mine = sharded.engine.create_model(lora, seed=7).result()
    theirs = one.engine.create_model(lora, seed=7).result()
    try:
        data = ragged_ce_batch(5, 4, 4, 12, VOCAB)
        for engine, model_id in ((sharded.engine, mine), (one.engine, theirs)):
            engine.forward_backward(model_id, wb.Role.POLICY, data, "cross_entropy").result()
            engine.optim_step(model_id, wb.Role.POLICY, wb.AdamParams(learning_rate=5e-2)).result()
        pins = [
            engine.pin_sampler(model_id)
            for engine, model_id in ((sharded.engine, mine), (one.engine, theirs))
        ]
        prompts = _prompts(15, 3)
        samples = []
        for engine, pin in zip((sharded.engine, one.engine), pins, strict=True):
            futures = [
                engine.sample(pin, wb.SampleRequest(p, 2, q, include_prompt_logprobs=True))
                for p, q in zip(prompts, _seeded(len(prompts), 500), strict=True)
            ]
            samples.append([future.result() for future in futures])
        _assert_same_samples(*samples)
        for engine_sample, other in zip(samples[0], samples[1], strict=True):
            torch.testing.assert_close(
                torch.tensor(engine_sample.prompt_logprobs[1:]),
                torch.tensor(other.prompt_logprobs[1:]),
                rtol=RELATIVE,
                atol=RELATIVE,
            )
        logprobs = [
            engine.compute_logprobs(pin, prompts[0]).result()
            for engine, pin in zip((sharded.engine, one.engine), pins, strict=True)
        ]
        torch.testing.assert_close(
            torch.tensor(logprobs[0][1:]), torch.tensor(logprobs[1][1:]), rtol=RELATIVE, atol=RELATIVE
        )
        saved = [
            engine.pin_sampler_checkpoint(engine.save_weights_for_sampler(model_id, "sharded").result().path)
            for engine, model_id in ((sharded.engine, mine), (one.engine, theirs))
        ]
        try:  # a sampler checkpoint, loaded on every rank of the sharded base
            _assert_same_samples(
                *[
                    [
                        engine.sample(pin, wb.SampleRequest(p, 2, q)).result()
                        for p, q in zip(prompts, _seeded(len(prompts), 600), strict=True)
                    ]
                    for engine, pin in zip((sharded.engine, one.engine), saved, strict=True)
                ]
            )
        finally:
            for engine, pin in zip((sharded.engine, one.engine), saved, strict=True):
                engine.release_sampler(pin, wait=True)
        exported = [
            engine.export_merged(model_id, tmp_path / name).result()
            for engine, model_id, name in ((sharded.engine, mine, "sharded"), (one.engine, theirs, "one"))
        ]
        weights = [load_file(folder / "model.safetensors") for folder in exported]
        assert weights[0].keys() == weights[1].keys()
        for name in weights[1]:
            torch.testing.assert_close(weights[0][name], weights[1][name], rtol=RELATIVE, atol=RELATIVE)
    finally:
        sharded.engine.delete_model(mine).result()
        one.engine.delete_model(theirs).result()


def test_a_rank_that_cannot_take_the_weights_fails_the_sharded_call_at_once(sharded: wb.Session) -> None:
    """A sampler checkpoint whose folder is gone before the follower loaded it: on a sharded base the
    call fails on every rank before any collective pass, naming the follower's error, instead of rank 0
    waiting at an all-gather until the group's timeout; the session samples on."""
    path = sharded.policy.save_weights_for_sampler("gone").result().path
    pin = sharded.engine.pin_sampler_checkpoint(
        path
    )  # loaded on rank 0 now; on the follower at its first call
    pin.result()
    shutil.rmtree(sharded.engine.checkpoint_folder(path, "sampler"))
    request = wb.SampleRequest([1, 2, 3], 1, wb.SamplingParams(max_tokens=2, seed=0))
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="rank 1"):
            sharded.engine.sample(pin, request).result()
        assert time.monotonic() - start < 60  # the group's timeout is 300 s
    finally:
        sharded.engine.release_sampler(pin, wait=True)
    assert sharded.sampling_client().sample([1, 2, 3], 1, {"max_tokens": 2, "seed": 0}).result().sequences
