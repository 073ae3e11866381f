"""vLLM on an engine on several devices: tensor parallel over them, in rank 0's process, while training
stays data parallel on the ranks (`samplers/vllm.py`, "Several devices"). On a CPU machine `devices=2` is
two CPU ranks, and vLLM's CPU build runs a worker per rank's device, each bound to its share of the cores.

Marked `vllm`: `make test-vllm` runs it in `.venv-vllm` (PyPI's CPU build of vLLM); skipped where vllm
is not installed.
"""

from __future__ import annotations

import os

import psutil
import pytest

import workbench as wb
from workbench.engine.samplers.vllm import ENGINE_PROCESS_PREFIX
from workbench.engine.threads import usable_cpus

pytestmark = pytest.mark.vllm

TOLERANCE = 1e-3  # fp32 on both sides, as the one-device vLLM tests (test_sampler_contract.py)
PROMPT = [5, 17, 33, 48, 60]
SHUTDOWN_S = 180.0  # how long vLLM's processes get to end after close (a bound, never reached when it passes)


def _vllm_processes() -> set[psutil.Process]:
    return {
        child
        for child in psutil.Process().children(recursive=True)
        if child.name().startswith(ENGINE_PROCESS_PREFIX)
    }


def _forward_logprobs(sess: wb.Session, tokens: list[int]) -> list[float]:
    """The trainer's logprobs of `tokens` after `PROMPT` (a `forward` pass, data parallel)."""
    full = PROMPT + tokens
    datum = wb.Datum(
        model_input=wb.ModelInput.from_ints(full[:-1]), loss_fn_inputs={"target_tokens": full[1:]}
    )
    scored = sess.policy.forward([datum], "cross_entropy").result()
    return scored.loss_fn_outputs[0]["logprobs"].tolist()[len(PROMPT) - 1 :]


def _gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _trained_session(model: str, **devices: int) -> wb.Session:
    """A session on `model` after one step (data parallel on several devices), its policy sampled."""
    sess = wb.Session(model, wb.LoraConfig(rank=4), seed=0, sampler="auto", wandb=False, **devices)
    tokens = list(range(5, 40))
    sess.policy.forward_backward(
        [wb.Datum(model_input=tokens[:-1], loss_fn_inputs={"target_tokens": tokens[1:]})], "cross_entropy"
    ).result()
    assert sess.policy.optim_step(wb.AdamParams(learning_rate=5e-2)).result().applied
    return sess


@pytest.mark.skipif(
    len(usable_cpus()[0]) < 2, reason="vLLM's CPU workers take a core each: two devices need two cores"
)
def test_vllm_samples_tensor_parallel_over_two_devices_as_on_one(tiny_for_vllm: str) -> None:
    """`devices=2` with `"auto"`, which takes vLLM where it is installed: one vLLM engine with a worker
    per device (tensor_parallel_size=2);
    after a data-parallel step, its greedy tokens are the trainer's most likely ones and its sampled
    logprobs (greedy and seeded) are `forward`'s, and its greedy and seeded samples are a one-device
    vLLM engine's after the same step; its processes end on close and the core binding it set for its
    start is not left in the environment."""
    before = _vllm_processes()
    bind_before = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    greedy_params = wb.SamplingParams(max_tokens=12, temperature=0.0)
    seeded_params = wb.SamplingParams(max_tokens=12, temperature=1.0, seed=3)
    with _trained_session(tiny_for_vllm, devices=2) as sess:
        client = sess.sampling_client()
        greedy = client.sample(PROMPT, 1, greedy_params).result()
        started = sess.engine._state.sampler.started
        assert sess.engine.config.sampler == "vllm"
        assert started._llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size == 2
        engine_processes = _vllm_processes() - before
        assert len(engine_processes) == 3  # an EngineCore and a Worker per device
        assert os.environ.get("VLLM_CPU_OMP_THREADS_BIND") == bind_before

        drawn = greedy.sequences[0].tokens
        assert _gap(_forward_logprobs(sess, drawn), greedy.sequences[0].logprobs) <= TOLERANCE
        # the trainer's top-1 at each drawn position (HF on rank 0's model): greedy took it, up to a tie
        scored = client.sample(
            PROMPT + drawn, 1, wb.SamplingParams(max_tokens=1), True, topk_prompt_logprobs=1
        )
        top1 = scored.result().topk_prompt_logprobs[len(PROMPT) :]
        ours = _forward_logprobs(sess, drawn)
        assert (
            max(max(lp for _, lp in best) - mine for best, mine in zip(top1, ours, strict=True)) <= TOLERANCE
        )

        seeded = client.sample(PROMPT, 2, seeded_params).result()
        for sequence in seeded.sequences:
            assert _gap(_forward_logprobs(sess, sequence.tokens), sequence.logprobs) <= TOLERANCE
    _, alive = psutil.wait_procs(engine_processes, timeout=SHUTDOWN_S)
    assert alive == []
    with _trained_session(tiny_for_vllm) as one:
        assert one.engine.config.sampler == "vllm"
        client = one.sampling_client()
        assert client.sample(PROMPT, 1, greedy_params).result().sequences[0].tokens == drawn
        again = client.sample(PROMPT, 2, seeded_params).result()
        assert [s.tokens for s in again.sequences] == [s.tokens for s in seeded.sequences]


def test_vllm_refuses_a_base_sharded_over_the_ranks_before_any_rank_starts() -> None:
    """vLLM scores what it does not report with rank 0's training model, which a sharded base runs
    only with every rank: refused when the engine is made."""
    with pytest.raises(ValueError, match=r"sampler='vllm' cannot sample for an engine on 2 devices: .*shard"):
        wb.Engine("tiny", devices=2, sampler="vllm", shard_base=True)
