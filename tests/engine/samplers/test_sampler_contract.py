"""What every sampler backend promises the engine (`workbench.engine.samplers.sampler.Sampler`), run once
per backend: HF `generate`, vLLM (marked `vllm`) and `recording_sampler.py`, a backend written outside
`workbench/` that plugs in through the factory's table alone.

Seeded samples are reproducible, a response reports the weights version its client pinned, logprobs
agree with the training model's `forward` (fp32), forgetting weights loses nothing a later sample of them
needs, and closing the engine closes its sampler and ends its processes.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from typing import Any

import psutil
import pytest

import workbench as wb
from tests.engine.samplers import recording_sampler
from workbench.engine.local import sample
from workbench.engine.samplers import factory
from workbench.engine.samplers.requests import prepare_request
from workbench.engine.samplers.sample_request import SampleRequest

PROMPT = [5, 17, 33, 48, 2, 9, 71, 30]
PARAMS = wb.SamplingParams(max_tokens=6, seed=3, stop=[])
# sampled and `compute_logprobs` numbers against `forward`'s, fp32 on both sides; vLLM's kernels are
# not torch's (its other tests on this model hold 1e-3)
TOLERANCE = {"hf": 1e-4, "recording": 1e-4, "vllm": 1e-3}
# what each backend keeps for a set of weights, by their key
HELD: dict[str, Callable[[Any], set[Hashable]]] = {
    "hf": lambda sampler: {weights for weights, _ in sampler.prefix_cache.entries},
    "vllm": lambda sampler: set(sampler.resident),
    "recording": lambda sampler: set(sampler.sampled),
}


@pytest.fixture(scope="module", params=["hf", pytest.param("vllm", marks=pytest.mark.vllm), "recording"])
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """A backend name the factory knows; the recording sampler's row is there for the module only."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(factory.SAMPLERS, "recording", recording_sampler.BACKEND)
        yield request.param


@pytest.fixture(scope="module")
def sess(backend: str, request: pytest.FixtureRequest) -> Iterator[wb.Session]:
    """One session per backend for the module (a vLLM engine takes tens of seconds to start): each test
    reads versions relative to where the previous one left the policy; the last test closes it."""
    base = request.getfixturevalue("tiny_for_vllm") if backend == "vllm" else "tiny"
    session = wb.Session(base, wb.LoraConfig(rank=4), seed=0, sampler=backend, wandb=False)
    assert session.engine.config.sampler == backend  # no fallback: the backend itself is tested
    yield session
    session.close()


def _train_one_step(sess: wb.Session) -> None:
    tokens = sess.tokenizer("Red, orange, yellow, green, blue, indigo and violet").input_ids
    datum = wb.Datum(model_input=tokens[:-1], loss_fn_inputs={"target_tokens": tokens[1:]})
    sess.policy.forward_backward([datum], "cross_entropy").result()
    assert sess.policy.optim_step(wb.AdamParams(learning_rate=5e-2)).result().applied


def _tokens(response: wb.SampleResponse) -> list[list[int]]:
    return [s.tokens for s in response.sequences]


def test_seeded_samples_are_reproducible_and_seeds_differ(sess: wb.Session) -> None:
    client = sess.sampling_client()
    first = client.sample(PROMPT, 3, PARAMS).result()
    assert _tokens(client.sample(PROMPT, 3, PARAMS).result()) == _tokens(first)
    assert _tokens(sess.sampling_client().sample(PROMPT, 3, PARAMS).result()) == _tokens(first)
    other = wb.SamplingParams(max_tokens=6, seed=4, stop=[])
    assert _tokens(client.sample(PROMPT, 3, other).result()) != _tokens(first)
    assert all(len(tokens) == 6 for tokens in _tokens(first))


def test_a_response_reports_the_pinned_version_and_samples_its_weights(sess: wb.Session) -> None:
    v0 = sess.sampling_client()
    before = v0.sample(PROMPT, 2, PARAMS).result()
    _train_one_step(sess)
    v1 = sess.sampling_client()
    after = v1.sample(PROMPT, 2, PARAMS).result()
    start = before.weights_version
    assert after.weights_version == start + 1
    again = v0.sample(PROMPT, 2, PARAMS).result()
    assert again.weights_version == start and _tokens(again) == _tokens(before)
    assert _tokens(after) != _tokens(before)  # a step at this rate moves the tiny model's draws


def test_logprobs_agree_with_the_training_models_forward(sess: wb.Session, backend: str) -> None:
    _train_one_step(sess)  # an adapter that is not zero: the pinned weights must be applied
    client = sess.sampling_client()
    response = client.sample(PROMPT, 2, wb.SamplingParams(max_tokens=8, seed=1, stop=[])).result()
    tolerance = TOLERANCE[backend]
    for sequence in response.sequences:
        full = PROMPT + sequence.tokens
        datum = wb.Datum(
            model_input=wb.ModelInput.from_ints(full[:-1]), loss_fn_inputs={"target_tokens": full[1:]}
        )
        forward = sess.policy.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
        forward_logprobs = forward.tolist()
        sampled_gap = max(
            abs(a - b) for a, b in zip(forward_logprobs[len(PROMPT) - 1 :], sequence.logprobs, strict=True)
        )
        assert sampled_gap <= tolerance
        computed = client.compute_logprobs(full).result()
        assert computed[0] is None
        computed_gap = max(abs(a - b) for a, b in zip(forward_logprobs, computed[1:], strict=True))
        assert computed_gap <= tolerance


def test_forgotten_weights_are_dropped_and_sample_the_same_again(sess: wb.Session, backend: str) -> None:
    """`forget` and `keep_only` drop what the sampler keeps for weights (its adapter, its cached
    prompts, its record), and a later sample of those weights gives the same tokens."""
    state = sess.engine._state
    pin = sess.engine.pin_sampler(sess.model_id)
    held = pin.result()
    weights = sample.pinned(state, held)
    request = prepare_request(
        SampleRequest(PROMPT, 2, PARAMS),
        tokenizer=state.tokenizer,
        base_info=state.base_info,
        max_samples_per_request=8,
    )

    def generate() -> list[list[int]]:
        def work() -> list[list[int]]:
            result = sample.active_sampler(state).generate([request], weights)[0]
            return [s.tokens for s in result.sequences]

        return state.submit(work).result()  # on the worker, like every engine operation

    first = generate()
    sampler = state.sampler.started
    assert sampler is not None
    assert held.weights_key in HELD[backend](sampler)
    state.submit(lambda: sampler.forget(held.weights_key)).result()
    assert held.weights_key not in HELD[backend](sampler)
    assert generate() == first
    state.submit(lambda: sampler.forget(("no such model", 0, None))).result()  # unknown: nothing happens
    assert held.weights_key in HELD[backend](sampler)
    state.submit(lambda: sampler.keep_only([])).result()
    assert HELD[backend](sampler) == set()
    assert generate() == first
    state.submit(lambda: sampler.keep_only([held.weights_key])).result()
    assert held.weights_key in HELD[backend](sampler)
    sess.engine.release_sampler(pin)


def test_closing_the_engine_closes_its_sampler_and_ends_its_processes(sess: wb.Session) -> None:
    """The module's last test: it closes the shared session (the fixture's close is then a no-op)."""
    session = sess
    session.sampling_client().sample(PROMPT, 1, PARAMS).result()
    sampler = session.engine._state.sampler.started
    assert sampler is not None
    processes = list(sampler.processes)
    assert all(process.is_running() for process in processes)
    session.close()
    assert session.engine._state.sampler.started is None
    assert not any(process.is_running() and process.status() != psutil.STATUS_ZOMBIE for process in processes)
    sampler.close()  # a second close is safe
