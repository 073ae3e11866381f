"""The vLLM sampler's own promises: the default LoRA (an adapter on the tied output embedding included)
through vLLM with `sampler="vllm"` and `"auto"`, an adapter cache that knows what vLLM holds, and engine
processes that end with the session.

Marked `vllm`: `make test-vllm` runs them in `.venv-vllm` (PyPI's CPU build of vLLM); skipped where vllm
is not installed. What every sample promises on both samplers is in test_sampling.py (parametrized).
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

import workbench as wb
from tests.conftest import build_tiny_twin
from workbench.engine.local.base_models import BaseModels, MemoryBudgetError, base_model_bytes
from workbench.engine.samplers.requests import SamplingInterrupted
from workbench.engine.samplers.sample_request import SampleRequest
from workbench.engine.samplers.vllm import CPU_KV_CACHE_BYTES, ENGINE_PROCESS_PREFIX, MAX_LORAS

pytestmark = pytest.mark.vllm

HOLD_LIMIT_S = 120.0  # how long a held sink waits for the test (a bound, never reached when it passes)


def _vllm_processes() -> set[int]:
    """This process's vLLM engine processes (EngineCore, Worker), alive or not yet reaped."""
    return {
        child.pid
        for child in psutil.Process().children(recursive=True)
        if child.name().startswith(ENGINE_PROCESS_PREFIX)
    }


def _running(pids: set[int]) -> set[int]:
    """The processes of `pids` still running (a zombie, ended but not reaped, counts as running)."""
    return {pid for pid in pids if psutil.pid_exists(pid)}


def _running_after(pids: set[int], timeout_s: float) -> set[int]:
    """The processes of `pids` still running once they are all gone, or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while _running(pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    return _running(pids)


def _train_one_step(policy: wb.TrainingClient, learning_rate: float = 1e-2) -> None:
    tokens = policy.engine.tokenizer("Red, orange, yellow, green, blue, indigo and violet").input_ids
    policy.forward_backward(
        [wb.Datum(model_input=tokens[:-1], loss_fn_inputs={"target_tokens": tokens[1:]})], "cross_entropy"
    ).result()
    assert policy.optim_step(wb.AdamParams(learning_rate=learning_rate)).result().applied


@pytest.fixture(scope="module")
def shared(tiny_for_vllm: str) -> Iterator[wb.Session]:
    """One vLLM session for the module's tests that neither stop its sampler nor start a second engine
    (vLLM takes most of a minute to start on a CPU); those keep their own. Its own policy is never
    sampled: each test samples a model of its own (`own_policy`), so what vLLM holds is that test's."""
    session = wb.Session(tiny_for_vllm, wb.LoraConfig(rank=4), seed=0, sampler="vllm")
    yield session
    session.close()


@pytest.fixture
def own_policy(shared: wb.Session) -> Iterator[wb.TrainingClient]:
    """A model of the test's own on the shared session's engine (rank 4, seed 0, as a fresh session's
    policy), removed after the test: the next sample drops its adapters from vLLM."""
    engine = shared.engine
    model_id = engine.create_model(wb.LoraConfig(rank=4), seed=0).result()
    yield wb.TrainingClient(engine, model_id)
    engine.delete_model(model_id).result()


def _client(policy: wb.TrainingClient) -> wb.SamplingClient:
    """A client of the policy's current weights (what `Session.sampling_client()` gives)."""
    return wb.SamplingClient(policy.engine, policy.engine.pin_sampler(policy.model_id))


def _tokens(response: wb.SampleResponse) -> list[list[int]]:
    return [s.tokens for s in response.sequences]


@pytest.mark.integration
def test_auto_samples_the_default_lora_with_vllm_and_its_processes_end_with_close() -> None:
    """SmolLM2's default LoRA trains the output embedding, which SmolLM2 ties to the input one: `"auto"`
    picks vLLM, which applies it, each weight version as a new adapter, with logprobs that agree with
    the trainer's."""
    before = _vllm_processes()
    sess = wb.Session("smollm2-135m", wandb=False)
    assert sess.engine.config.sampler == "vllm" and sess.config.lora.train_unembed
    prompt = wb.chat_prompt(sess.tokenizer, [{"role": "user", "content": "Name a colour."}])
    params = wb.SamplingParams(max_tokens=16, seed=0)
    v0 = sess.sampling_client()
    first = v0.sample(prompt, 4, params).result()
    assert first.weights_version == 0 and first.sync_ms > 0
    engine_processes = _vllm_processes() - before
    assert len(engine_processes) == 2  # an EngineCore and its Worker
    _train_one_step(sess.policy, learning_rate=5e-2)
    report = wb.check_logprob_agreement(
        sess, [prompt], num_samples=4, sampling_params=wb.SamplingParams(max_tokens=24)
    )
    # fp32 on both sides; an output-embedding adapter vLLM left out would be off by tenths of a nat
    assert report.max_abs_diff <= 1e-3
    v1 = sess.sampling_client()
    second = v1.sample(prompt, 4, params).result()
    assert second.weights_version == 1 and second.sync_ms > 0
    assert _tokens(second) != _tokens(first)
    assert _tokens(v0.sample(prompt, 4, params).result()) == _tokens(first)
    sess.close()
    assert _running(engine_processes) == set()


@pytest.mark.integration
def test_vllm_samples_the_default_lora_and_a_dropped_session_stops_it() -> None:
    before = _vllm_processes()
    sess = wb.Session("smollm2-135m", sampler="vllm", wandb=False)
    assert sess.engine.config.sampler == "vllm" and sess.config.lora.train_unembed
    prompt = wb.chat_prompt(sess.tokenizer, [{"role": "user", "content": "Hi!"}])
    response = sess.sampling_client().sample(prompt, 2, wb.SamplingParams(max_tokens=8, seed=1)).result()
    assert len(response.sequences) == 2 and response.sync_ms > 0
    engine_processes = _vllm_processes() - before
    assert len(engine_processes) == 2
    del sess, response
    gc.collect()  # the engine's finalizer stops vLLM on its worker thread, after the queued operations
    assert _running_after(engine_processes, timeout_s=180) == set()


def test_auto_falls_back_to_hf_for_a_model_vllm_cannot_run(capsys) -> None:
    """The tiny model's 16-dimension heads are below what vLLM's CPU kernels take: `"auto"` says so and
    samples with HF. (With `"vllm"`, the sample raises vLLM's error.)"""
    before = _vllm_processes()
    with wb.Session("tiny", wb.LoraConfig(rank=4), sampler="auto", device="cpu") as sess:
        assert sess.engine.config.sampler == "vllm"
        response = sess.sampling_client().sample([5, 17, 33], 2, wb.SamplingParams(max_tokens=4)).result()
        assert len(response.sequences) == 2
        assert sess.engine.config.sampler == "hf"
        assert "workbench: sampling with HF generate (vLLM could not sample" in capsys.readouterr().out
        assert _running(_vllm_processes() - before) == set()


def test_prefix_caching_never_serves_another_versions_keys(own_policy: wb.TrainingClient) -> None:
    """With vLLM's automatic prefix caching on, a long prompt sampled under one version fills the cache;
    after a large step the same prompt sampled under the next version gets that version's logprobs
    (what `forward` computes with the live weights), not those of the cached keys and values."""
    policy = own_policy
    prompt = [(7 * i) % 180 + 5 for i in range(96)]  # several of vLLM's 16-token blocks
    params = wb.SamplingParams(max_tokens=8, temperature=1.0, seed=3, stop=[])
    _train_one_step(policy, learning_rate=5e-2)
    before = _client(policy).sample(prompt, 2, params).result()
    assert policy.engine._state.sampler.started._llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    _train_one_step(policy, learning_rate=5e-2)
    after = _client(policy).sample(prompt, 2, params).result()
    assert after.weights_version == before.weights_version + 1 == policy.weights_version
    for seq in after.sequences:
        datum = wb.Datum(
            model_input=wb.ModelInput.from_ints(prompt + seq.tokens[:-1]),
            loss_fn_inputs={"target_tokens": prompt[1:] + seq.tokens},
        )
        scored = policy.forward([datum], "cross_entropy").result()
        forward = scored.loss_fn_outputs[0]["logprobs"].tolist()[len(prompt) - 1 :]
        assert max(abs(a - b) for a, b in zip(forward, seq.logprobs, strict=True)) <= 1e-3


class HeldSink:
    """A token sink that records each sequence's tokens and holds the sampler at its `at`-th token until
    the test lets go: what happens meanwhile happened before the sample ended, whatever the speed."""

    def __init__(self, at: int):
        self.at = at
        self.heard: dict[int, list[int]] = {}
        self.reached, self.let_go = threading.Event(), threading.Event()

    def __call__(self, sequence: int, token: int) -> None:
        self.heard.setdefault(sequence, []).append(token)
        if sum(map(len, self.heard.values())) == self.at:
            self.reached.set()
            self.let_go.wait(HOLD_LIMIT_S)


def test_a_token_sink_hears_each_sequence_as_vllm_draws_it(own_policy: wb.TrainingClient) -> None:
    """vLLM's engine is stepped by the sampler: a request's sink hears each sequence's tokens in order,
    before the sample ends (the sink is held at its 8th token while the sample is checked unfinished),
    and what it heard is the response's tokens; a greedy request's one row is each of its samples."""
    engine = own_policy.engine
    pin = engine.pin_sampler(own_policy.model_id)
    for temperature in (1.0, 0.0):
        sink = HeldSink(at=8)
        params = wb.SamplingParams(max_tokens=24, temperature=temperature, seed=3, stop=[])
        response = engine.sample(pin, SampleRequest([5, 17, 33, 48], 2, params), token_sink=sink)
        assert sink.reached.wait(HOLD_LIMIT_S)
        assert not response.done()  # eight tokens heard while the sample goes on
        sink.let_go.set()
        assert [sink.heard[0], sink.heard[1]] == _tokens(response.result())
    engine.release_sampler(pin)


def test_an_evicted_version_is_reloaded_and_its_time_counted(own_policy: wb.TrainingClient) -> None:
    """vLLM holds `MAX_LORAS` adapters: a third version evicts the least recently used one, which the
    sampler knows; sampling it again loads it again, with the same tokens, and the load time is added
    to its `sync_ms`. Weights no client can sample any more leave vLLM and their folders go (those of the
    models the module's earlier tests removed included)."""
    policy = own_policy
    prompt = [5, 17, 33, 48]
    params = wb.SamplingParams(max_tokens=8, seed=3)
    clients, first = [], []
    for version in range(MAX_LORAS + 1):
        clients.append(_client(policy))
        first.append(clients[-1].sample(prompt, 2, params).result())
        assert first[-1].weights_version == version
        _train_one_step(policy, learning_rate=5e-2)
    vllm = policy.engine._state.sampler.started
    keys = [(policy.model_id, version, None) for version in range(MAX_LORAS + 1)]
    assert vllm.resident == keys[1:]  # version 0, the least recently used, was evicted
    assert vllm.vllm_lora_ids() == {vllm._adapters[key].lora_id for key in keys[1:]}
    again = clients[0].sample(prompt, 2, params).result()
    assert _tokens(again) == _tokens(first[0])
    assert again.sync_ms > first[0].sync_ms  # the reload's time is added
    assert vllm.resident == [keys[2], keys[0]]
    assert vllm.vllm_lora_ids() == {vllm._adapters[key].lora_id for key in vllm.resident}
    # a client that is still resident samples without a new load
    assert clients[2].sample(prompt, 2, params).result().sync_ms == first[2].sync_ms
    # released clients' weights leave vLLM: a long run keeps the current version's adapter only
    clients.clear()
    for _ in range(6):
        _client(policy).sample(prompt, 1, params).result()
        _train_one_step(policy)
    _client(policy).sample(prompt, 1, params).result()
    assert vllm.resident == [(policy.model_id, policy.weights_version, None)]
    assert len(list(vllm._adapters_dir.iterdir())) == 1


def test_an_interrupt_aborts_vllm_generation_in_flight_and_every_later_sample(tiny_for_vllm: str) -> None:
    """`Engine.interrupt_sampling` (what `workbench serve` calls on SIGTERM) during a long vLLM
    generation: the request fails with `SamplingInterrupted` at the next step (held at its 8th token
    when the interrupt comes, it draws no more than one token per sequence after), vLLM is left with
    nothing in flight, a later sample fails at once, and training goes on."""
    with wb.Session(tiny_for_vllm, wb.LoraConfig(rank=4), seed=0, sampler="vllm") as sess:
        engine = sess.engine
        sink = HeldSink(at=8)
        params = wb.SamplingParams(max_tokens=400, temperature=1.0, seed=3, stop=[])
        pin = engine.pin_sampler(sess.model_id)
        long_sample = engine.sample(pin, SampleRequest([5, 17, 33, 48], 2, params), token_sink=sink)
        assert sink.reached.wait(HOLD_LIMIT_S)
        engine.interrupt_sampling()
        sink.let_go.set()
        with pytest.raises(SamplingInterrupted, match="interrupted"):
            long_sample.result()
        assert sum(map(len, sink.heard.values())) <= 8 + 2  # the step in progress ends; no other runs
        assert not engine._state.sampler.started._llm.llm_engine.has_unfinished_requests()
        with pytest.raises(SamplingInterrupted):
            engine.sample(pin, SampleRequest([5, 17], 1, params)).result()
        _train_one_step(sess.policy)


def test_each_base_model_gets_its_own_vllm_engine_within_a_budget_that_counts_them(
    tiny_for_vllm: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two base models sampling with vLLM in one process: each engine starts its own vLLM (its own
    engine processes) and samples its own weights. The memory budget counts each vLLM's copy of the
    weights and its KV cache: a budget with room for the second base on HF but not beside its vLLM
    refuses it, naming the vLLM share, and changes nothing; a budget with room for both loads it."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    twin = build_tiny_twin(tmp_path / "twin", layers=3, seed=1, head_dim=32)
    first = wb.Engine(tiny_for_vllm, sampler="vllm", seed=0)
    models = BaseModels(first)
    try:
        weights = {name: base_model_bytes(name, torch.float32) for name in (tiny_for_vllm, twin)}
        vllm_share = {name: size + CPU_KV_CACHE_BYTES for name, size in weights.items()}
        (held,) = models.holdings()
        assert held.sampler_bytes == vllm_share[tiny_for_vllm] and held.bytes > held.sampler_bytes
        models.memory_budget_bytes = held.bytes + 2 * weights[twin]  # the twin on HF would fit
        with pytest.raises(MemoryBudgetError, match="of it for its vLLM sampler") as refused:
            models.engine(twin)
        assert "of it vLLM's" in str(refused.value)  # what the first one holds, vLLM's share named
        assert len(models.engines()) == 1
        models.memory_budget_bytes = held.bytes + weights[twin] + vllm_share[twin]
        second = models.engine(twin)
        assert [h.sampler_bytes for h in models.holdings()] == [vllm_share[tiny_for_vllm], vllm_share[twin]]

        params = wb.SamplingParams(max_tokens=8, temperature=0.0, stop=[])
        tokens = []
        for engine in (first, second):
            pin = engine.pin_sampler(None)
            tokens.append(_tokens(engine.sample(pin, SampleRequest([5, 17, 33, 48], 1, params)).result()))
            engine.release_sampler(pin)
        assert tokens[0] != tokens[1]  # each base model's own weights
        processes = [engine._state.sampler.started.processes for engine in (first, second)]
        assert processes[0] and processes[1] and not processes[0] & processes[1]
    finally:
        models.close()
        first.close()
