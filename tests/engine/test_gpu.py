"""GPU paths: CUDA training in bf16 and the HF sampler on CUDA.

Marked `gpu`; skipped on machines without a CUDA device. vLLM's tests, which run on a CPU too, are in
test_vllm.py and (for every sampling promise) test_sampling.py.
"""

from __future__ import annotations

import pytest
import torch

import workbench as wb
from tests.datums import unweighted_datum

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
