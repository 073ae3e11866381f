"""Sampling on the tiny model: SamplingParams in full, batching, versions, agreement with training.

The tests of what a sample promises run once per sampling engine (the `sampler` fixture: HF `generate`,
and vLLM where it is installed) on one session per engine for the module (`shared_sampled`: a vLLM
engine takes about 15 s to start and stop on a CPU): those that only sample use its policy, those that
train a model of their own on its engine (`own_policy`). Those about HF's own decoding loop, and about
what the engine does the same way for both (validation, seeding, batching, history rows, prompt types), run on HF alone.
"""

from __future__ import annotations

import gc
import importlib.util
from collections.abc import Iterator

import numpy as np
import pytest
import torch

import workbench as wb
from tests.datums import unweighted_datum
from workbench.engine.samplers.hf import HFSampler, draw_tokens

PROMPTS = ["User: Hello! How are you", "The quick brown fox", "17 + 25 ="]


@pytest.fixture(scope="module")
def shared_sampled(sampler: str, sampled_model: str) -> Iterator[wb.Session]:
    """One session per sampling engine for the module (no test trains its policy or closes it): the tiny model (rank 4, seed 0), so its weights are a fresh session's and a seeded request
    draws what it would draw on one; unseeded requests only advance the session's seed generator."""
    session = wb.Session(sampled_model, wb.LoraConfig(rank=4), seed=0, sampler=sampler)
    yield session
    session.close()


@pytest.fixture
def own_policy(shared_sampled: wb.Session) -> Iterator[wb.TrainingClient]:
    """A model of the test's own on the shared session's engine, made as the session made its policy
    (rank 4, seed 0): its weights are a fresh session's, and the test's training leaves the shared
    policy as it was. Removed after the test."""
    engine = shared_sampled.engine
    model_id = engine.create_model(wb.LoraConfig(rank=4), seed=0).result()
    yield wb.TrainingClient(engine, model_id)
    engine.delete_model(model_id).result()


def _ids(sess: wb.Session, text: str) -> list[int]:
    return sess.tokenizer(text).input_ids


def _forward_logprobs(sess: wb.Session, prompt: list[int], tokens: list[int]) -> list[float]:
    full = prompt + tokens
    out = sess.policy.forward([unweighted_datum(full)], "cross_entropy").result()
    return out.loss_fn_outputs[0]["logprobs"].tolist()[len(prompt) - 1 :]


def _logits_after(sess: wb.Session, tokens: list[int]) -> torch.Tensor:
    """The policy's next-token logits, from the module the engine runs, with the policy's adapter active."""
    model = sess.engine.torch_model
    model.set_adapter(sess.engine.model_status(sess.model_id).adapter)
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0, -1]


def _snapshot_bytes(policy: wb.Session | wb.TrainingClient) -> int:
    return policy.engine.model_status(policy.model_id).snapshot_bytes


def _live_versions(policy: wb.Session | wb.TrainingClient) -> list[int]:
    return policy.engine.model_status(policy.model_id).live_versions


def test_sampled_logprobs_equal_forward_logprobs_across_a_padded_batch(shared_sampled: wb.Session) -> None:
    """At temperature 1, whatever top-k and top-p truncate: the model's logprob, what forward computes."""
    sc = shared_sampled.sampling_client()
    params = wb.SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, stop=[])
    futures = [
        sc.sample(_ids(shared_sampled, p), 3, params) for p in PROMPTS
    ]  # different prompt lengths, one batch
    worst = 0.0
    for prompt, future in zip(PROMPTS, futures, strict=True):
        response = future.result()
        assert len(response.sequences) == 3
        for seq in response.sequences:
            assert len(seq.tokens) == len(seq.logprobs) == 12 and seq.stop_reason == "length"
            scored = _forward_logprobs(shared_sampled, _ids(shared_sampled, prompt), seq.tokens)
            worst = max(worst, max(abs(a - b) for a, b in zip(scored, seq.logprobs, strict=True)))
    assert worst <= 1e-4


def test_agreement_probe_reports(shared_sampled: wb.Session, capsys) -> None:
    report = wb.check_logprob_agreement(
        shared_sampled, [_ids(shared_sampled, p) for p in PROMPTS], num_samples=2
    )
    assert report.num_tokens > 0 and report.max_abs_diff <= 1e-4
    assert "max |Δ|" in capsys.readouterr().out


def test_same_seed_same_tokens_even_when_batched_with_others(shared_sampled: wb.Session) -> None:
    sc = shared_sampled.sampling_client()
    params = wb.SamplingParams(max_tokens=10, temperature=1.0, seed=1234)
    alone = sc.sample(_ids(shared_sampled, PROMPTS[0]), 4, params).result()
    again = sc.sample(_ids(shared_sampled, PROMPTS[0]), 4, params).result()
    other = sc.sample(
        _ids(shared_sampled, PROMPTS[1]), 5, wb.SamplingParams(max_tokens=20, temperature=0.7, seed=1)
    )
    batched = sc.sample(_ids(shared_sampled, PROMPTS[0]), 4, params)
    other.result()
    tokens = [s.tokens for s in alone.sequences]
    assert tokens == [s.tokens for s in again.sequences] == [s.tokens for s in batched.result().sequences]
    assert len({tuple(t) for t in tokens}) > 1  # the samples differ from each other
    different = sc.sample(
        _ids(shared_sampled, PROMPTS[0]), 4, wb.SamplingParams(max_tokens=10, temperature=1.0, seed=99)
    ).result()
    assert [s.tokens for s in different.sequences] != tokens


def test_unseeded_requests_are_reproducible_from_the_session_seed() -> None:
    results = []
    for _ in range(2):
        with wb.Session("tiny", wb.LoraConfig(rank=4), seed=5) as sess:
            sc = sess.sampling_client()
            results.append(
                [
                    s.tokens
                    for s in sc.sample(_ids(sess, "Hello"), 3, wb.SamplingParams(max_tokens=6))
                    .result()
                    .sequences
                ]
            )
            results[-1] += [
                s.tokens
                for s in sc.sample(_ids(sess, "Hello"), 3, wb.SamplingParams(max_tokens=6)).result().sequences
            ]
    assert results[0] == results[1]
    assert results[0][:3] != results[0][3:]  # consecutive unseeded calls draw different seeds


def test_temperature_zero_and_top_k_one_are_greedy(shared_sampled: wb.Session) -> None:
    prompt = _ids(shared_sampled, PROMPTS[2])
    sc = shared_sampled.sampling_client()
    greedy = sc.sample(prompt, 2, wb.SamplingParams(max_tokens=8, temperature=0.0)).result()
    top1 = sc.sample(prompt, 1, wb.SamplingParams(max_tokens=8, temperature=1.5, top_k=1)).result()
    tokens = greedy.sequences[0].tokens
    assert greedy.sequences[1].tokens == tokens == top1.sequences[0].tokens
    # HF samples from the logits computed here, exactly; vLLM computes them its own way, so on a random
    # model whose top logits can lie closer than float error, its choice is the argmax up to that error
    tolerance = 0.0 if shared_sampled.engine.config.sampler == "hf" else 1e-4
    context = list(prompt)
    for token in tokens:
        logits = _logits_after(shared_sampled, context)
        assert logits[token] >= logits.max() - tolerance
        context.append(token)


def _drawn(logits_1_V: torch.Tensor, **params: float) -> set[int]:
    """The tokens `draw_tokens` picks in 2,000 rows of the same distribution."""
    rows = logits_1_V.expand(2000, -1)
    generator = torch.Generator().manual_seed(0)
    picked = draw_tokens(rows, wb.SamplingParams(**params), [(slice(0, 2000), generator)])
    return set(picked.tolist())


def test_nucleus_filter_keeps_the_smallest_set_reaching_top_p() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert _drawn(logits, top_p=0.8) == {0, 1}
    assert _drawn(logits, top_p=0.81) == {0, 1, 2}
    assert _drawn(logits, top_k=1) == {0}
    assert _drawn(logits, top_k=3) == {0, 1, 2}
    assert _drawn(logits, top_p=1e-6) == {0}
    assert _drawn(logits) == {0, 1, 2, 3}


def test_draws_follow_the_distribution() -> None:
    """20,000 draws from a row's softmax (including a token with no probability mass after top-k): each
    token's frequency within 5 standard errors of its probability, and none of the filtered token."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 1e-9])
    rows = probs.log().expand(20_000, -1)
    generator = torch.Generator().manual_seed(0)
    picked = draw_tokens(rows, wb.SamplingParams(top_k=4), [(slice(0, 20_000), generator)])
    frequencies = torch.bincount(picked, minlength=5).double() / 20_000
    kept = probs[:4].double() / probs[:4].sum()
    standard_errors = (kept * (1 - kept) / 20_000).sqrt()
    assert ((frequencies[:4] - kept).abs() < 5 * standard_errors).all(), frequencies
    assert frequencies[4] == 0


def test_each_prompt_is_computed_once_for_all_its_samples(tiny: wb.Session) -> None:
    """The decoder embeds a request's prompt once, whatever its `num_samples`: P − 1 prompt tokens in the
    shared prefill, then each row's last prompt token and its new tokens, one per step."""
    prompt = _ids(tiny, PROMPTS[0])
    embedded: list[int] = []
    embeddings = tiny.engine.torch_model.get_input_embeddings()
    handle = embeddings.register_forward_hook(lambda module, args, out: embedded.append(args[0].numel()))
    try:
        response = (
            tiny.sampling_client()
            .sample(prompt, 8, wb.SamplingParams(max_tokens=5, temperature=1.0, seed=3, stop=[]))
            .result()
        )
    finally:
        handle.remove()
    assert all(len(seq.tokens) == 5 for seq in response.sequences)
    # prefill, then 5 decoding steps over the 8 rows (the last consumes the 4th new token)
    assert embedded == [len(prompt) - 1] + [8] * 5


def test_top_p_samples_only_from_the_nucleus(shared_sampled: wb.Session) -> None:
    prompt = _ids(shared_sampled, PROMPTS[0])
    response = (
        shared_sampled.sampling_client()
        .sample(prompt, 8, wb.SamplingParams(max_tokens=1, temperature=1.0, top_p=0.05, seed=0))
        .result()
    )
    probs = torch.softmax(_logits_after(shared_sampled, prompt), -1)
    ranked = probs.argsort(descending=True).tolist()
    nucleus = set()
    mass = 0.0
    for token in ranked:
        nucleus.add(token)
        mass += float(probs[token])
        if mass >= 0.05:
            break
    assert {s.tokens[0] for s in response.sequences} <= nucleus


def test_stop_token_ids_and_stop_strings(shared_sampled: wb.Session) -> None:
    prompt = _ids(shared_sampled, PROMPTS[0])
    sc = shared_sampled.sampling_client()
    free = sc.sample(prompt, 1, wb.SamplingParams(max_tokens=20, seed=7, stop=[])).result().sequences[0]
    stop_token = free.tokens[5]
    first = free.tokens.index(stop_token)
    stopped = (
        sc.sample(prompt, 1, wb.SamplingParams(max_tokens=20, seed=7, stop=[stop_token]))
        .result()
        .sequences[0]
    )
    assert stopped.stop_reason == "stop"
    assert stopped.tokens == free.tokens[: first + 1]  # the stop token is included
    assert stopped.logprobs == free.logprobs[: first + 1]

    text = shared_sampled.tokenizer.decode(free.tokens[3:5])
    by_string = (
        sc.sample(prompt, 1, wb.SamplingParams(max_tokens=20, seed=7, stop=[text])).result().sequences[0]
    )
    assert by_string.stop_reason == "stop"
    assert text in shared_sampled.tokenizer.decode(by_string.tokens)
    assert text not in shared_sampled.tokenizer.decode(by_string.tokens[:-1])
    assert by_string.tokens == free.tokens[: len(by_string.tokens)]


def test_eos_stops_by_default_and_not_with_an_empty_stop_list(shared_sampled: wb.Session) -> None:
    eos = shared_sampled.tokenizer.eos_token_id
    prompt = _ids(shared_sampled, "The answer is")
    sc = shared_sampled.sampling_client()
    params = {"max_tokens": 60, "temperature": 1.0, "seed": 3}
    free = sc.sample(prompt, 64, wb.SamplingParams(**params, stop=[])).result().sequences
    rows = [i for i, s in enumerate(free) if eos in s.tokens]
    assert rows, "no sample contains EOS: pick another seed"
    assert all(s.stop_reason == "length" and len(s.tokens) == 60 for s in free)
    default = sc.sample(prompt, 64, wb.SamplingParams(**params)).result().sequences
    for i in rows:
        cut = free[i].tokens.index(eos) + 1
        assert default[i].tokens == free[i].tokens[:cut] and default[i].stop_reason == "stop"


def test_prompt_logprobs_and_compute_logprobs(shared_sampled: wb.Session) -> None:
    prompt = _ids(shared_sampled, PROMPTS[0])
    sc = shared_sampled.sampling_client()
    response = sc.sample(prompt, 1, wb.SamplingParams(max_tokens=2), include_prompt_logprobs=True).result()
    assert response.prompt_logprobs[0] is None and len(response.prompt_logprobs) == len(prompt)
    expected = _forward_logprobs(shared_sampled, prompt[:1], prompt[1:])
    assert response.prompt_logprobs[1:] == pytest.approx(expected, abs=1e-5)
    assert sc.compute_logprobs(prompt).result() == response.prompt_logprobs
    assert sc.sample(prompt, 1, wb.SamplingParams(max_tokens=2)).result().prompt_logprobs is None
    assert sc.compute_logprobs(prompt[:1]).result() == [None]


def test_clients_sample_the_weights_they_were_created_from(
    shared_sampled: wb.Session, own_policy: wb.TrainingClient
) -> None:
    prompt = _ids(shared_sampled, PROMPTS[1])
    params = wb.SamplingParams(max_tokens=8, seed=11)
    v0 = own_policy.save_weights_and_get_sampling_client()
    before = v0.sample(prompt, 2, params).result()
    assert (
        before.weights_version == 0 and _snapshot_bytes(own_policy) == 0
    )  # the current version costs no copy
    data = [
        wb.Datum(
            model_input=prompt + before.sequences[0].tokens[:-1],
            loss_fn_inputs={"target_tokens": prompt[1:] + before.sequences[0].tokens},
        )
    ]
    for _ in range(3):
        own_policy.forward_backward(data, "cross_entropy").result()
        own_policy.optim_step(wb.AdamParams(learning_rate=5e-2)).result()
    assert own_policy.weights_version == 3
    after = v0.sample(prompt, 2, params).result()
    assert after.weights_version == 0
    assert [s.tokens for s in after.sequences] == [s.tokens for s in before.sequences]
    assert [s.logprobs for s in after.sequences] == [s.logprobs for s in before.sequences]
    v3 = wb.SamplingClient(own_policy.engine, own_policy.engine.pin_sampler(own_policy.model_id))
    newer = v3.sample(prompt, 2, params).result()
    assert newer.weights_version == 3
    assert [s.logprobs for s in newer.sequences] != [s.logprobs for s in before.sequences]
    assert _live_versions(own_policy) == [0, 3]
    assert _snapshot_bytes(own_policy) > 0
    # the live adapter is untouched by sampling the old version
    digest = shared_sampled.engine.state_digest(own_policy.model_id)
    v0.sample(prompt, 1, params).result()
    assert shared_sampled.engine.state_digest(own_policy.model_id) == digest
    del v0
    gc.collect()
    shared_sampled.engine.state_digest(
        own_policy.model_id
    )  # an operation after the release: the worker has processed it
    assert _live_versions(own_policy) == [3] and _snapshot_bytes(own_policy) == 0
    with pytest.raises(ValueError, match="weights version 0 is not held"):
        _ = wb.SamplingClient(
            shared_sampled.engine, shared_sampled.engine.pin_sampler(own_policy.model_id, 0)
        ).weights_version  # the pin fails, in order with the operations before it


def test_close_releases_the_pinned_weights_before_it_returns(tiny: wb.Session) -> None:
    prompt = _ids(tiny, PROMPTS[1])
    data = [unweighted_datum(prompt)]
    pinned = tiny.sampling_client()
    assert pinned.weights_version == 0
    tiny.policy.forward_backward(data, "cross_entropy").result()
    tiny.policy.optim_step(wb.AdamParams(learning_rate=1e-2)).result()
    assert tiny.live_versions() == [0, 1] and _snapshot_bytes(tiny) > 0
    pinned.close()
    assert tiny.live_versions() == [1] and _snapshot_bytes(tiny) == 0  # no barrier needed: close() waited
    pinned.close()  # a second close does nothing
    with pytest.raises(ValueError, match="weights version 0 is not held"):
        _ = tiny.sampling_client(version=0).weights_version


def test_base_client_samples_the_base_model(
    shared_sampled: wb.Session, own_policy: wb.TrainingClient
) -> None:
    prompt = _ids(shared_sampled, PROMPTS[0])
    data = [unweighted_datum(prompt)]
    own_policy.forward_backward(data, "cross_entropy").result()
    own_policy.optim_step(wb.AdamParams(learning_rate=5e-2)).result()
    base = shared_sampled.sampling_client(base=True)
    response = base.sample(prompt, 2, wb.SamplingParams(max_tokens=6, seed=2)).result()
    assert response.weights_version is None
    for seq in response.sequences:
        full = prompt + seq.tokens
        ref = (
            wb.TrainingClient(own_policy.engine, own_policy.model_id, wb.Role.REFERENCE)
            .forward([unweighted_datum(full)], "cross_entropy")
            .result()
        )
        assert ref.loss_fn_outputs[0]["logprobs"].tolist()[len(prompt) - 1 :] == pytest.approx(
            seq.logprobs, abs=1e-5
        )


@pytest.fixture
def generate_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many requests each of the HF sampler's generate calls served, in order."""
    calls: list[int] = []
    real = HFSampler._generate_chunk

    def counting(self, requests, weights):
        calls.append(len(requests))
        return real(self, requests, weights)

    monkeypatch.setattr(HFSampler, "_generate_chunk", counting)
    return calls


def test_concurrent_requests_share_one_generate_call(tiny: wb.Session, generate_calls: list[int]) -> None:
    sc = tiny.sampling_client()
    tokens = _ids(tiny, PROMPTS[0])
    # a training op keeps the worker busy while the sample calls queue up behind it
    tiny.policy.forward_backward(
        [unweighted_datum(tokens)] * 64,
        "cross_entropy",
    )
    futures = [sc.sample(_ids(tiny, p), 2, wb.SamplingParams(max_tokens=4)) for p in PROMPTS * 3]
    assert all(len(f.result().sequences) == 2 for f in futures)
    assert generate_calls == [9]
    rows = [row for row in tiny.history if row["op"] == "sample"]
    assert len(rows) == 9 and all(row["num_samples:sum"] == 2 for row in rows)


def test_sample_history_reports_versions_and_staleness(tiny: wb.Session) -> None:
    sc = tiny.sampling_client()
    tokens = _ids(tiny, PROMPTS[0])
    tiny.policy.forward_backward([unweighted_datum(tokens)], "cross_entropy").result()
    tiny.policy.optim_step().result()
    sc.sample(tokens, 1, wb.SamplingParams(max_tokens=3)).result()
    row = tiny.history.rows[-1]
    assert (
        row["op"] == "sample"
        and row["weights_version"] == 0
        and row["staleness"] == 1
        and row["num_tokens:sum"] == 3
    )


def test_tinker_sampling_params_are_accepted(tiny: wb.Session) -> None:
    tinker = pytest.importorskip("tinker")
    prompt = tinker.ModelInput.from_ints(_ids(tiny, PROMPTS[0]))
    response = (
        tiny.sampling_client()
        .sample(prompt, 1, tinker.SamplingParams(max_tokens=4, temperature=0.0))
        .result()
    )
    assert len(response.sequences[0].tokens) == 4


def test_chat_prompt_renders_the_template(tiny: wb.Session) -> None:
    prompt = wb.chat_prompt(tiny.tokenizer, [{"role": "user", "content": "hi"}])
    assert (
        tiny.tokenizer.decode(prompt.to_ints()) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    datum = wb.chat_datum(
        tiny.tokenizer, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    )
    weights = datum.loss_fn_inputs["weights"].tolist()
    trained = [t for t, w in zip(datum.loss_fn_inputs["target_tokens"].tolist(), weights, strict=True) if w]
    assert tiny.tokenizer.decode(trained) == "hello<|im_end|>"


def test_prompts_take_the_token_types_datums_take(tiny: wb.Session) -> None:
    """Numpy integers are token ids in a sampling prompt as in a datum (they used to be refused as
    "outside the vocabulary"); the same tokens sample the same greedy continuation whatever their type."""
    tokens = _ids(tiny, PROMPTS[1])
    greedy = wb.SamplingParams(max_tokens=4, temperature=0.0)
    client = tiny.sampling_client()
    expected = client.sample(tokens, 1, greedy).result().sequences[0].tokens
    for prompt in (np.array(tokens), [np.int64(t) for t in tokens], torch.tensor(tokens)):
        assert client.sample(prompt, 1, greedy).result().sequences[0].tokens == expected
    datum = wb.Datum(
        model_input=np.array(tokens[:-1]), loss_fn_inputs={"target_tokens": np.array(tokens[1:])}
    )
    tiny.policy.forward([datum], "cross_entropy").result()


def test_a_top_p_that_rounds_to_zero_keeps_the_most_likely_token(shared_sampled: wb.Session) -> None:
    tokens = _ids(shared_sampled, PROMPTS[2])
    client = shared_sampled.sampling_client()
    greedy = client.sample(tokens, 1, wb.SamplingParams(max_tokens=4, temperature=0.0)).result()
    tiny_nucleus = client.sample(tokens, 2, wb.SamplingParams(max_tokens=4, top_p=1e-300)).result()
    assert all(seq.tokens == greedy.sequences[0].tokens for seq in tiny_nucleus.sequences)


def _sequences_drawn(future: wb.APIFuture[wb.SampleResponse]) -> list[tuple[list[int], list[float], str]]:
    """What a sample response drew (every sequence has its own id, so ids are left out)."""
    return [(seq.tokens, seq.logprobs, seq.stop_reason) for seq in future.result().sequences]


def test_a_request_that_fails_on_the_worker_fails_alone(tiny: wb.Session, generate_calls: list[int]) -> None:
    """Requests queued together run as one generate call; when that call fails, each request runs again
    on its own, so only the one that fails by itself reports the failure. The failure is injected where
    a real one would arise, in the model's forward pass (a prompt holding the POISON token fails)."""
    poison = 777
    client = tiny.sampling_client()
    params = wb.SamplingParams(max_tokens=3, seed=11)
    prompts = [_ids(tiny, p) for p in PROMPTS]
    alone = [_sequences_drawn(client.sample(prompt, 2, params)) for prompt in prompts]

    def fail_on_poison(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is not None and bool((input_ids == poison).any()):
            raise RuntimeError("injected failure for the poisoned prompt")

    generate_calls.clear()  # count the calls from here on
    generating_model = tiny.engine.torch_model.get_base_model()  # what generate runs
    hook = generating_model.register_forward_pre_hook(fail_on_poison, with_kwargs=True)
    try:
        tokens = prompts[0]
        busy = tiny.policy.forward(  # keeps the worker busy while the requests queue up as one batch
            [unweighted_datum(tokens)] * 64,
            "cross_entropy",
        )
        futures = [client.sample(prompt, 2, params) for prompt in prompts[:2]]
        poisoned = client.sample([*prompts[2], poison], 2, params)
        futures.append(client.sample(prompts[2], 2, params))
        busy.result()
        with pytest.raises(RuntimeError, match="injected failure"):
            poisoned.result()
        assert [_sequences_drawn(future) for future in futures] == alone
        assert generate_calls == [4, 1, 1, 1, 1]  # one batch, then each request on its own
    finally:
        hook.remove()


BAD = [
    ("empty prompt", lambda s: ([], 1, {"max_tokens": 2}), "prompt is empty"),
    (
        "token out of range",
        lambda s: ([1, s.base_info.vocab_size], 1, {"max_tokens": 2}),
        "outside the vocabulary",
    ),
    ("max_tokens 0", lambda s: ([1, 2], 1, {"max_tokens": 0}), "max_tokens must be an integer >= 1"),
    ("beyond the context", lambda s: ([1, 2], 1, {"max_tokens": 511}), "exceeds the model's context of 512"),
    ("negative temperature", lambda s: ([1, 2], 1, {"temperature": -1.0}), "temperature"),
    ("top_p zero", lambda s: ([1, 2], 1, {"top_p": 0.0}), "top_p"),
    ("top_p above one", lambda s: ([1, 2], 1, {"top_p": 1.01}), "top_p"),
    ("no samples", lambda s: ([1, 2], 0, {"max_tokens": 2}), r"num_samples must be an integer in \[1, 4\]"),
    (
        "too many samples",
        lambda s: ([1, 2], 5, {"max_tokens": 2}),
        r"num_samples must be an integer in \[1, 4\]",
    ),
    ("stop id out of range", lambda s: ([1, 2], 1, {"max_tokens": 2, "stop": [100000]}), "stop token ids"),
    ("unknown field", lambda s: ([1, 2], 1, {"max_new_tokens": 2}), "unknown SamplingParams field"),
    (
        "seed beyond 64 bits",
        lambda s: ([1, 2], 1, {"max_tokens": 2, "seed": 2**64}),
        "seed must be None or an integer that fits in 64 bits",
    ),
    (
        "temperature too small for float32",
        lambda s: ([1, 2], 1, {"max_tokens": 2, "temperature": 1e-40}),
        r"temperature must be 0 \(greedy\) or a finite number >= 1e-06",
    ),
    (
        "stop neither a string nor a list",
        lambda s: ([1, 2], 1, {"max_tokens": 2, "stop": 2}),
        "stop must be a string, a list of strings or a list of token ids, got 2",
    ),
    (
        "float prompt tokens",
        lambda s: ([5.0, 6.0], 1, {"max_tokens": 2}),
        "prompt: token ids must be integers, got 5.0 at position 0",
    ),
    (
        "bool prompt token",
        lambda s: ([5, True], 1, {"max_tokens": 2}),
        "prompt: token ids must be integers, got True at position 1",
    ),
    (
        "malformed prompt chunk",
        lambda s: ({"chunks": [{}]}, 1, {"max_tokens": 2}),
        "prompt: chunk 0 must be a dict with 'tokens'",
    ),
]


@pytest.mark.parametrize(("case", "build", "message"), BAD, ids=[b[0] for b in BAD])
def test_bad_sampling_input_raises_and_changes_nothing(case, build, message) -> None:
    with wb.Session("tiny", wb.LoraConfig(rank=2), max_samples_per_request=4) as sess:
        sc = sess.sampling_client()
        digest = sess.state_digest()  # covers the sampling generator's state too
        prompt, num_samples, params = build(sess)
        with pytest.raises(ValueError, match=message):
            sc.sample(prompt, num_samples, params)
        assert sess.state_digest() == digest  # no seed was drawn
        assert len(sess.history) == 0
        sc.sample(
            [1, 2], 1, {"max_tokens": 1}
        ).result()  # a good unseeded request draws one: the digest sees it
        assert sess.state_digest() != digest


def test_sampler_choice_without_vllm() -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    with pytest.raises(
        ValueError, match="sampler='vllm' is not available: the vllm package is not installed"
    ):
        wb.Session("tiny", wb.LoraConfig(rank=2), sampler="vllm")
    with wb.Session("tiny", wb.LoraConfig(rank=2), sampler="auto") as sess:
        assert sess.engine.config.sampler == "hf"
    with pytest.raises(ValueError, match="sampler must be"):
        wb.Session("tiny", wb.LoraConfig(rank=2), sampler="sglang")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_auto_falls_back_to_hf_quietly_on_a_cpu_without_vllm_and_says_why_on_a_gpu(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without the vllm package, HF is what a CPU samples with: no notice. On a GPU the same fallback
    gives up vLLM's speed, so it says why (the sampler is chosen before any device is touched)."""
    from workbench.engine.samplers import factory

    monkeypatch.setattr(factory, "_fallback_noticed", set())
    assert factory.choose_sampler("auto", torch.device("cpu")) == "hf"
    assert capsys.readouterr().out == ""
    assert factory.choose_sampler("auto", torch.device("cuda")) == "hf"
    assert (
        "workbench: sampling with HF generate (the vllm package is not installed" in capsys.readouterr().out
    )
    with pytest.raises(
        ValueError, match="sampler='vllm' is not available: the vllm package is not installed"
    ):
        factory.choose_sampler("vllm", torch.device("cpu"))
