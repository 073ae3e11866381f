"""GPU paths: CUDA training in bf16, the HF sampler on CUDA, and vLLM with LoRA hot-swap.

Marked `gpu` / `vllm`; skipped on machines without a CUDA device or without vLLM.
"""

from __future__ import annotations

import pytest
import torch

import workbench as wb
from tests.datums import unweighted_datum
from workbench.engine.samplers import vllm_unavailable_reason

PROMPTS = ["The quick brown fox", "User: Hello! How are you", "17 + 25 ="]


def _train_one_step(sess: wb.Session) -> None:
    tokens = sess.tokenizer("Red, orange, yellow, green, blue, indigo and violet").input_ids
    sess.policy.forward_backward([unweighted_datum(tokens)], "cross_entropy").result()
    assert sess.policy.optim_step(wb.AdamParams(learning_rate=1e-2)).result().applied


@pytest.mark.gpu
def test_cuda_defaults_to_bf16_and_trains() -> None:
    with wb.Session("tiny", wb.LoraConfig(rank=4), sampler="hf") as sess:
        assert sess.device.type == "cuda" and sess.config.dtype == "bfloat16"
        _train_one_step(sess)
        assert sess.policy.weights_version == 1


@pytest.mark.gpu
def test_hf_sampler_agrees_with_the_trainer_in_fp32_on_cuda() -> None:
    with wb.Session("tiny", wb.LoraConfig(rank=4), sampler="hf", dtype="float32") as sess:
        _train_one_step(sess)
        prompts = [sess.tokenizer(p).input_ids for p in PROMPTS]
        report = wb.check_logprob_agreement(sess, prompts, num_samples=2)
        assert report.max_abs_diff <= 1e-3


@pytest.mark.gpu
def test_real_out_of_memory_leaves_the_session_usable() -> None:
    with wb.Session("tiny", wb.LoraConfig(rank=4), sampler="hf", max_tokens_per_microbatch=10**9) as sess:
        _train_one_step(sess)
        before = sess.state_digest()
        free, _ = torch.cuda.mem_get_info()
        # enough rows that the logits alone exceed the free memory
        rows = int(free / (511 * sess.base_info.vocab_size * 4)) + 1
        tokens = list(range(1, 512))
        data = [unweighted_datum(tokens)] * rows
        with pytest.raises(torch.OutOfMemoryError):
            sess.policy.forward_backward(data, "cross_entropy").result()
        assert sess.state_digest() == before
        _train_one_step(sess)


def _vllm_session(**kwargs: object) -> wb.Session:
    return wb.Session("smollm2-135m", wb.LoraConfig(rank=16, train_unembed=False), sampler="vllm", **kwargs)


@pytest.mark.vllm
def test_vllm_samples_each_version_as_a_new_adapter() -> None:
    assert vllm_unavailable_reason(torch.device("cuda")) is None
    with _vllm_session() as sess:
        prompt = wb.chat_prompt(sess.tokenizer, [{"role": "user", "content": "Name a colour."}])
        v0 = sess.sampling_client()
        first = v0.sample(prompt, 4, wb.SamplingParams(max_tokens=16, seed=0)).result()
        assert first.weights_version == 0 and first.sync_ms > 0
        _train_one_step(sess)
        v1 = sess.sampling_client()
        second = v1.sample(prompt, 4, wb.SamplingParams(max_tokens=16, seed=0)).result()
        assert second.weights_version == 1 and second.sync_ms > 0
        again = v0.sample(prompt, 4, wb.SamplingParams(max_tokens=16, seed=0)).result()
        assert [s.tokens for s in again.sequences] == [s.tokens for s in first.sequences]


@pytest.mark.vllm
def test_vllm_logprobs_agree_with_the_trainer() -> None:
    with _vllm_session() as sess:
        _train_one_step(sess)
        prompts = [
            wb.chat_prompt(sess.tokenizer, [{"role": "user", "content": q}]) for q in ("Hi!", "What is 2+2?")
        ]
        report = wb.check_logprob_agreement(
            sess, prompts, num_samples=4, sampling_params=wb.SamplingParams(max_tokens=24)
        )
        # bf16 sampler against a bf16 trainer: agreement to a few hundredths of a nat on average
        assert report.mean_abs_diff <= 0.05


@pytest.mark.vllm
def test_vllm_refuses_an_unembedding_adapter() -> None:
    with pytest.raises(ValueError, match="output embedding"):
        wb.Session("tiny", wb.LoraConfig(rank=4), sampler="vllm")
