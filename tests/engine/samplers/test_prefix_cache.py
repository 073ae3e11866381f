"""prefix_cache.py and the HF sampler's use of it: a conversation's next turn prefills only its new
tokens, samples what it samples without the cache, and no entry outlives the weights it was computed
with."""

from __future__ import annotations

import dataclasses
import gc
import random
import threading

import pytest
import torch

import workbench as wb
from tests.datums import random_tokens
from tests.engine.model.moe_twins import FAMILIES, save_twin
from workbench.engine.samplers.hf import shared_header_length
from workbench.engine.samplers.prefix_cache import PromptPrefixCache

VOCAB = 200


def _keys_values(length: int, fill: float = 0.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full((2, length, 4), fill), torch.full((2, length, 4), fill)) for _ in range(3)]


def test_the_longest_common_prefix_of_the_same_weights_is_found() -> None:
    cache = PromptPrefixCache()
    cache.put("v1", (1, 2, 3, 4), _keys_values(4, 1.0))
    cache.put("v1", (1, 2, 9), _keys_values(3, 2.0))
    cache.put("v2", (1, 2, 3, 4, 5), _keys_values(5, 3.0))
    cached, keys_values = cache.longest("v1", (1, 2, 3, 7, 7))
    assert cached == 3 and keys_values is not None
    assert keys_values[0][0].shape == (2, 3, 4) and float(keys_values[0][0][0, 0, 0]) == 1.0
    assert cache.longest("v1", (5, 1)) == (0, None)
    assert cache.longest("v3", (1, 2, 3)) == (0, None)


def test_the_cache_stays_within_its_bytes_least_recently_used_out() -> None:
    entry_bytes = sum(k.nbytes + v.nbytes for k, v in _keys_values(4))
    cache = PromptPrefixCache(max_bytes=2 * entry_bytes)
    cache.put("v", (1, 1, 1, 1), _keys_values(4))
    cache.put("v", (2, 2, 2, 2), _keys_values(4))
    cache.longest("v", (1, 1))  # (1, …) is now the more recent
    cache.put("v", (3, 3, 3, 3), _keys_values(4))
    assert [tokens for _, tokens in cache.entries] == [(1, 1, 1, 1), (3, 3, 3, 3)]
    assert cache.bytes == 2 * entry_bytes
    cache.keep_only({"w"})
    assert not cache.entries and cache.bytes == 0


def _conversation(sess: wb.Session, turns: int = 5) -> tuple[list[list[tuple]], int]:
    """A 5-turn rollout: each turn samples 2 replies to the conversation so far, then the first reply
    and a new user message of 6 tokens extend it. Returns each turn's (tokens, logprobs) and how many
    tokens the decoder embedded in all (prefill and decoding)."""
    rng = random.Random(0)
    prompt = random_tokens(rng, 60, VOCAB)
    client = sess.sampling_client()
    embedded: list[int] = []
    embeddings = sess.engine.torch_model.get_input_embeddings()
    handle = embeddings.register_forward_hook(lambda module, args, out: embedded.append(args[0].numel()))
    turns_out = []
    try:
        for turn in range(turns):
            params = wb.SamplingParams(max_tokens=8, temperature=1.0, seed=turn, stop=[])
            response = client.sample(prompt, 2, params).result()
            turns_out.append([(tuple(s.tokens), tuple(s.logprobs)) for s in response.sequences])
            prompt = prompt + list(response.sequences[0].tokens) + random_tokens(rng, 6, VOCAB)
    finally:
        handle.remove()
    return turns_out, sum(embedded)


def test_a_multi_turn_rollout_prefills_only_its_new_tokens_and_samples_the_same() -> None:
    with wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, wandb=False) as sess:
        cache = sess.engine.prompt_cache
        cache.max_bytes = 0  # keeps nothing: every turn prefills its whole prompt
        without, embedded_without = _conversation(sess)
        assert cache.stats.computed_tokens == cache.stats.prompt_tokens
        submitted = cache.stats.prompt_tokens
        cache.max_bytes = 2**30
        rows_before = len(sess.history.rows)
        with_cache, embedded_with = _conversation(sess)
        stats = cache.stats
        rows = [row for row in sess.history.rows[rows_before:] if row["op"] == "sample"]
    computed = stats.computed_tokens - submitted
    assert stats.prompt_tokens - submitted == submitted
    assert embedded_without - embedded_with == submitted - computed  # what the decoder did not embed
    assert computed <= 0.3 * submitted
    assert stats.hits == 4  # every turn after the first
    assert stats.cached_tokens == stats.prompt_tokens - stats.computed_tokens
    # each turn's history row says how much of its prefill the cache gave
    assert sum(row["prefill_tokens:sum"] for row in rows) == submitted
    assert sum(row["prefill_cached_tokens:sum"] for row in rows) == submitted - computed
    for turn, (plain, cached) in enumerate(zip(without, with_cache, strict=True)):
        for (tokens, logprobs), (cached_tokens, cached_logprobs) in zip(plain, cached, strict=True):
            assert cached_tokens == tokens, turn
            assert cached_logprobs == pytest.approx(logprobs, abs=1e-5), turn


def test_no_entry_outlives_its_weights_and_a_new_version_samples_as_without_the_cache() -> None:
    rng = random.Random(1)
    prompt = random_tokens(rng, 40, VOCAB)
    params = wb.SamplingParams(max_tokens=6, temperature=1.0, seed=5, stop=[])
    data = [
        wb.Datum(
            model_input=wb.ModelInput.from_ints(prompt[:-1]),
            loss_fn_inputs={"target_tokens": prompt[1:]},
        )
    ]
    with wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, wandb=False) as sess:
        cache = sess.engine.prompt_cache
        sess.sampling_client().sample(prompt, 2, params).result()
        assert {key[0][1] for key in cache.entries} == {0}
        sess.policy.forward_backward(data, "cross_entropy").result()
        sess.policy.optim_step(wb.AdamParams(learning_rate=1e-2)).result()
        gc.collect()  # the version-0 client is gone, and its pin with it
        cached = sess.sampling_client().sample(prompt, 2, params).result()
        assert {key[0][1] for key in cache.entries} == {1}  # no stale entry, and the new version's
        cache.max_bytes = 0
        cache.entries.clear()
        plain = sess.sampling_client().sample(prompt, 2, params).result()
    for a, b in zip(cached.sequences, plain.sequences, strict=True):
        assert a.tokens == b.tokens
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_a_header_is_shared_where_it_saves_more_than_a_model_call() -> None:
    header = list(range(100))
    assert shared_header_length([[*header, 1, 2], [*header, 3]]) == 0  # saves 100 < 128 tokens' worth
    assert shared_header_length([[*header, 1, 2], [*header, 3], [*header, 4, 5]]) == 100
    assert shared_header_length([[*header, 1], [*header, 1], [*header, 1]]) == 100  # each keeps a token
    assert shared_header_length([[7, *header], header, header]) == 0  # nothing in common
    assert shared_header_length([[*header, 1]]) == 0


def _params(count: int) -> list[wb.SamplingParams]:
    """Each prompt's sampling: 6 tokens, its own seed."""
    return [wb.SamplingParams(max_tokens=6, temperature=1.0, seed=10 + k, stop=[]) for k in range(count)]


def _sample_alone(sess: wb.Session, prompts: list[list[int]]) -> list[wb.SampleResponse]:
    """Each prompt sampled (2 samples) in its own call."""
    client = sess.sampling_client()
    return [client.sample(p, 2, q).result() for p, q in zip(prompts, _params(len(prompts)), strict=True)]


def _sample_together(sess: wb.Session, prompts: list[list[int]]) -> tuple[list[wb.SampleResponse], int]:
    """All prompts sampled (2 samples each) in one call: they are queued while the worker is held in a
    `forward_backward_custom` whose loss waits until they are, so they queue together whatever the
    machine's load. Also the tokens the decoder embedded during the call, less the held pass's."""
    held_tokens = list(range(1, 9))
    queued = threading.Event()

    def wait_for_the_requests(data: list, logprobs: list) -> tuple:
        assert queued.wait(timeout=60)
        return logprobs[0].sum() * 0.0, {}

    client = sess.sampling_client()
    embedded: list[int] = []
    embeddings = sess.engine.torch_model.get_input_embeddings()
    handle = embeddings.register_forward_hook(lambda module, args, out: embedded.append(args[0].numel()))
    try:
        held = sess.policy.forward_backward_custom(
            [
                wb.Datum(
                    model_input=wb.ModelInput.from_ints(held_tokens),
                    loss_fn_inputs={"target_tokens": held_tokens},
                )
            ],
            wait_for_the_requests,
        )
        futures = [client.sample(p, 2, q) for p, q in zip(prompts, _params(len(prompts)), strict=True)]
        queued.set()
        held.result()
        together = [future.result() for future in futures]
    finally:
        queued.set()
        handle.remove()
    return together, sum(embedded) - len(held_tokens)


def _alone_and_together(
    sess: wb.Session, prompts: list[list[int]]
) -> tuple[list[wb.SampleResponse], list[wb.SampleResponse], int]:
    """`_sample_alone`, then `_sample_together`, with the prompt cache keeping nothing across calls."""
    sess.engine.prompt_cache.max_bytes = 0  # what a call computes is its own
    alone = _sample_alone(sess, prompts)
    return (alone, *_sample_together(sess, prompts))


def _assert_same_samples(alone: list[wb.SampleResponse], together: list[wb.SampleResponse]) -> None:
    for single, batched in zip(alone, together, strict=True):
        for a, b in zip(single.sequences, batched.sequences, strict=True):
            assert a.tokens == b.tokens
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_prompts_sharing_a_header_prefill_it_once_and_sample_as_alone() -> None:
    """A group RL call: 4 prompts that start with the same 60-token header (a system prompt, worked
    examples). Sampled in one call, the header is prefilled once and then each prompt's rest; each
    prompt samples the tokens and logprobs it samples alone."""
    rng = random.Random(2)
    header = random_tokens(rng, 60, VOCAB)
    prompts = [header + random_tokens(rng, length, VOCAB) for length in (8, 5, 12, 3)]
    prefilled = sum(len(prompt) - 1 for prompt in prompts)  # each prompt but its last token
    rests = [len(prompt) - 1 - 60 for prompt in prompts]  # 7, 4, 11, 2: right-padded to 11 in one pass
    with wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, wandb=False) as sess:
        alone, together, embedded = _alone_and_together(sess, prompts)
        stats = sess.engine.prompt_cache.stats
    assert stats.prompt_tokens == 2 * prefilled
    assert stats.computed_tokens - prefilled == 60 + sum(rests)  # the header once, then each prompt's rest
    assert stats.cached_tokens == stats.hits == 0  # shared within the call: nothing came from the cache
    # what the decoder embedded: the header, the padded rests, then 6 decoding steps of 8 rows
    assert embedded == 60 + 4 * max(rests) + 6 * 8
    _assert_same_samples(alone, together)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_shared_header_samples_as_alone_on_every_family(family: str, tmp_path) -> None:
    """GQA, MLA (DeepSeek-V3: values narrower than keys), attention sinks and sliding windows (gpt-oss,
    whose sliding layers keep no per-prompt entries: its prompts are prefilled whole), on the MoE
    twins."""
    rng = random.Random(4)
    header = random_tokens(rng, 70, VOCAB)
    prompts = [header + random_tokens(rng, length, VOCAB) for length in (6, 3, 9)]
    folder = save_twin(family, tmp_path / family)
    with wb.Session(folder, wb.LoraConfig(rank=4), seed=0, wandb=False) as sess:
        alone, together, _ = _alone_and_together(sess, prompts)
        stats = sess.engine.prompt_cache.stats
    computed_in_call = stats.computed_tokens - stats.prompt_tokens // 2
    sliding = family == "gpt_oss"
    assert computed_in_call == (stats.prompt_tokens // 2 if sliding else 70 + 5 + 2 + 8)
    _assert_same_samples(alone, together)


def test_the_next_turns_of_two_conversations_prefill_their_new_tokens_in_one_pass() -> None:
    """Two conversations (50 and 30 tokens so far) are sampled, then each is extended (by 9 and 4
    tokens) and both are sampled in one call: it finds each one's history in the cache and prefills
    both rests in one pass (the histories left-padded, the rests right-padded after them), and samples
    what each samples with nothing cached."""
    rng = random.Random(5)
    histories = [random_tokens(rng, 50, VOCAB), random_tokens(rng, 30, VOCAB)]
    prompts = [histories[0] + random_tokens(rng, 9, VOCAB), histories[1] + random_tokens(rng, 4, VOCAB)]
    with wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, wandb=False) as sess:
        cache = sess.engine.prompt_cache
        cache.max_bytes = 0
        alone = _sample_alone(sess, prompts)  # nothing cached: the reference
        cache.max_bytes = 2**30
        _sample_alone(sess, histories)  # caches each history but its last token
        before = dataclasses.replace(cache.stats)
        together, embedded = _sample_together(sess, prompts)
        stats = cache.stats
    assert stats.hits - before.hits == 2
    assert stats.cached_tokens - before.cached_tokens == 49 + 29  # each history but its last token
    # from each history's last token to the prompt's last but one: 9 and 4
    assert stats.computed_tokens - before.computed_tokens == 9 + 4
    assert embedded == 2 * 9 + 6 * 4  # both rests in one pass, padded to 9; then 6 decoding steps
    _assert_same_samples(alone, together)
