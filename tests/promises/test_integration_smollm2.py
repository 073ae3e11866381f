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


def test_two_nf4_steps_on_smollm2_follow_the_fp32_session(tmp_path) -> None:
    """SmolLM2-135M with an NF4 base (2 steps of one short datum: bitsandbytes' CPU fallback kernels are
    slow). NF4 costs this small model much: its first loss is 1.78x the fp32 session's (9.75 vs 5.49
    nats over 8 answer tokens, measured), and transformers + bitsandbytes alone compute the same, so
    the check is against that load to 0.1%, with the fp32 loss only bounding it (between 1x and 2x).
    The second step's loss falls; sampler and trainer agree to 1e-4 on the quantized weights; the
    merged export reports its quantization error. The NF4 base holds <= 0.35x the fp32 one's memory and
    an int8 base <= 0.55x (measured 0.31x and 0.41x: the tied embedding stays in fp32, as transformers
    leaves it)."""
    import math
    import warnings

    with wb.Session("smollm2-135m", wb.LoraConfig(rank=8), seed=0, wandb=False, sampler="hf") as full:
        datum = chat_datum(full.tokenizer, *EXAMPLES[2])
        fp32_loss = full.policy.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
        fp32_bytes = full.engine.base_memory_bytes
    with wb.Session(
        "smollm2-135m", wb.LoraConfig(rank=8), wandb=False, sampler="hf", quantize="int8"
    ) as int8:
        assert int8.engine.base_memory_bytes <= 0.55 * fp32_bytes, (int8.engine.base_memory_bytes, fp32_bytes)
    with wb.Session(
        "smollm2-135m", wb.LoraConfig(rank=8), seed=0, wandb=False, sampler="hf", quantize="nf4"
    ) as sess:
        assert sess.engine.base_memory_bytes <= 0.35 * fp32_bytes, (sess.engine.base_memory_bytes, fp32_bytes)
        losses = []
        for _ in range(2):
            losses.append(sess.policy.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"])
            sess.policy.optim_step(wb.AdamParams(learning_rate=1e-3)).result()
        assert all(math.isfinite(loss) for loss in losses), losses
        assert fp32_loss < losses[0] < 2 * fp32_loss and losses[1] < losses[0], (losses, fp32_loss)
        assert losses[0] == pytest.approx(_bitsandbytes_nf4_loss(datum), rel=1e-3)
        prompt = wb.ModelInput.from_ints(sess.tokenizer("The capital of France is").input_ids)
        report = wb.check_logprob_agreement(
            sess, [prompt], num_samples=1, sampling_params=wb.SamplingParams(max_tokens=4, temperature=1.0)
        )
        assert report.num_tokens > 0 and report.max_abs_diff <= 1e-4
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sess.export_merged(tmp_path / "merged")
        (message,) = [str(w.message) for w in caught if "quantization error" in str(w.message)]
        assert "largest relative weight error" in message


def _bitsandbytes_nf4_loss(datum: wb.Datum) -> float:
    """The datum's summed cross-entropy on SmolLM2-135M loaded in NF4 by transformers and bitsandbytes
    alone (double quantization, fp32 compute, one kernel for every pass, as the session loads it)."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from workbench.engine.model.base_model import resolve_model_path
    from workbench.engine.model.quantization import keep_one_cpu_kernel

    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    model = AutoModelForCausalLM.from_pretrained(
        resolve_model_path("smollm2-135m"),
        dtype=torch.float32,
        quantization_config=config,
        device_map={"": "cpu"},
    ).eval()
    keep_one_cpu_kernel(model)
    targets = datum.loss_fn_inputs["target_tokens"].to_torch()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([datum.model_input.to_ints()])).logits[0]
    logprobs = torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None])[:, 0]
    return float(-(logprobs * datum.loss_fn_inputs["weights"].to_torch()).sum())
