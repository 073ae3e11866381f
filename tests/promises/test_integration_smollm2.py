"""The real model: SmolLM2-135M-Instruct, converted from the packaged GGUF (kept few: seconds each)."""

from __future__ import annotations

import pytest

import workbench as wb
from tests.datums import sft_datum

pytestmark = pytest.mark.integration

EXAMPLES = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Name a primary colour.", "Red is a primary colour."),
    ("What is 3 + 4?", "3 + 4 = 7."),
    ("Say hello in Spanish.", "Hola!"),
]


def chat_datum(tokenizer, question: str, answer: str) -> wb.Datum:
    """An SFT datum in SmolLM2's chat format: the templated question, then the answer and its end of turn."""
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return sft_datum(tokenizer, prompt, answer + "<|im_end|>")


def test_sft_loss_falls_on_smollm2() -> None:
    with wb.Session("smollm2-135m", wb.LoraConfig(rank=16), seed=0) as sess:
        assert sess.base_info.vocab_size == 49152 and sess.base_info.num_layers == 30
        data = [chat_datum(sess.tokenizer, q, a) for q, a in EXAMPLES]
        losses = []
        for _ in range(4):
            losses.append(sess.policy.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
            assert sess.policy.optim_step(wb.AdamParams(learning_rate=1e-3)).result().applied
        after = sess.policy.forward(data, "cross_entropy").result().metrics["loss:sum"]
        assert after < 0.8 * losses[0], (losses, after)
        assert sorted(losses, reverse=True) == losses


def test_sampler_and_trainer_logprobs_agree_on_smollm2() -> None:
    with wb.Session("smollm2-135m", wb.LoraConfig(rank=16), seed=0) as sess:
        data = [chat_datum(sess.tokenizer, q, a) for q, a in EXAMPLES[:2]]
        sess.policy.forward_backward(data, "cross_entropy").result()
        sess.policy.optim_step(wb.AdamParams(learning_rate=1e-3)).result()  # a non-zero adapter
        prompts = [wb.chat_prompt(sess.tokenizer, [{"role": "user", "content": q}]) for q, _ in EXAMPLES[:3]]
        report = wb.check_logprob_agreement(
            sess,
            prompts,
            num_samples=2,
            sampling_params=wb.SamplingParams(max_tokens=16, temperature=1.0, seed=0),
        )
        assert report.num_tokens >= 3 * 2 * 2
        assert report.max_abs_diff <= 1e-4, report
