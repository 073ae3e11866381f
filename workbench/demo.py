"""The demo (`make demo`, or `python -m workbench.demo`): a short supervised fine-tune of SmolLM2-135M.

Prepares the embedded model (once), trains a rank-16 LoRA for a few steps on the built-in pirate-style
answers, and prints the held-out loss and a greedy answer to a question it never saw, before and after.
"""

from __future__ import annotations

import argparse
import os
import time

import workbench as wb
from workbench.loops.datasets import pirate_sft

HELD_OUT = 4
PROBE = "What is the capital of Germany?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "offline")

    examples = pirate_sft()
    train, held_out = examples[HELD_OUT:], examples[:HELD_OUT]
    with wb.Session(args.model, wb.LoraConfig(rank=16), seed=0) as sess:
        tokenizer = sess.tokenizer
        train_data = [wb.chat_datum(tokenizer, qa.messages()) for qa in train]
        eval_data = [wb.chat_datum(tokenizer, qa.messages()) for qa in held_out]
        probe = wb.chat_prompt(tokenizer, [{"role": "user", "content": PROBE}])
        greedy = wb.SamplingParams(max_tokens=32, temperature=0.0)

        def evaluate() -> tuple[float, str]:
            out = sess.policy.forward(eval_data, "cross_entropy").result()
            loss = out.metrics["loss:sum"] / out.metrics["num_tokens:sum"]
            answer = sess.sampling_client().sample(probe, 1, greedy).result().sequences[0]
            return loss, tokenizer.decode(answer.tokens, skip_special_tokens=True).strip()

        print(
            f"workbench demo: {args.model}, LoRA rank 16, {len(train)} training conversations, model folder {sess.model_dir}"
        )
        loss_before, answer_before = evaluate()
        start = time.perf_counter()
        for step in range(args.steps):
            batch = train_data[(step * 8) % len(train_data) :][:8]
            out = sess.policy.forward_backward(batch, "cross_entropy").result()
            sess.policy.optim_step(wb.AdamParams(learning_rate=args.learning_rate)).result()
            print(
                f"  step {step + 1:2d}/{args.steps}  train loss/token {out.metrics['loss:sum'] / out.metrics['num_tokens:sum']:.3f}"
            )
        seconds = time.perf_counter() - start
        loss_after, answer_after = evaluate()
        print(
            f"\nheld-out loss per token: before {loss_before:.3f}  after {loss_after:.3f}   ({args.steps} steps in {seconds:.0f} s)"
        )
        print(f"Q: {PROBE}")
        print(f"  before: {answer_before}")
        print(f"  after:  {answer_after}")


if __name__ == "__main__":
    main()
