"""Side by side with TRL: supervised fine-tuning tokens/s and one GRPO step, workbench against TRL's own
trainers, on the same model, LoRA, data and batch.

Both tasks run each side in a fresh process (neither pays for the other's threads or memory), with the
model loaded in fp32 on the CPU and a rank-16 LoRA (alpha 32, no dropout) on the same modules: every
linear layer of attention and MLP, as `workbench.LoraConfig(rank=16, train_unembed=False)` chooses them
(TRL refuses an adapter on the output layer, which workbench trains by default). Warm-up steps are run and not timed; a
step's time is from the end of the previous step to the end of this one (TRL: its `on_step_end`
callbacks, so the data loading and collation between steps count; workbench: the calls a notebook
makes, with the datums built from token lists inside the step).

  SFT: the built-in `pirate_sft` chats, tokenized once with the chat template; batches of 8 in the same
       order on both sides; the loss on every token (workbench `cross_entropy` with weight 1 everywhere,
       TRL `SFTTrainer` on pre-tokenized `input_ids`, no packing, padded to the batch's longest). Tokens/s
       counts real tokens. Target: workbench / TRL >= 1.0.
  GRPO: 8 addition prompts x 4 completions per step, at most 16 new tokens, temperature 1, reward 1
       when the reply's last number is the answer. Workbench: a sampling client from
       `save_weights_and_get_sampling_client`, group-relative advantages,
       `forward_backward(importance_sampling)` on all 32 completions, `optim_step`. TRL:
       `GRPOTrainer` generating with transformers (no vLLM), one optimizer step per generation batch.
       Seconds per step. Target: workbench / TRL <= 0.4. With `--vllm-python`, workbench samples with
       vLLM (its CPU build here, in that interpreter's environment: `make vllm-env`); TRL still generates
       with transformers: TRL 1.16 supports vLLM 0.22 to 0.31 only (the CPU build here is 0.32), and its
       colocate mode drives vLLM's workers directly through `torch.distributed`, written for GPUs.
  GRPO, long prompt (`grpo-long`): the same step with about 512 prompt tokens: worked examples before
       each question, as few-shot prompts are. Every completion of a step shares them, and each group
       its question too; workbench computes that shared prefix once per call (shared-prefix training,
       `workbench.engine.model.shared_prefix`), TRL once per completion. TRL runs with its default
       activation checkpointing here: without it, its one padded pass needs more than 24 GiB. Target:
       workbench / TRL <= 0.4.
Each task runs twice, on a quiet machine and with a second process keeping one core busy while both
sides' children run (`bench/contention.py`: what a notebook always has beside the engine), with each
side's median step time contended / quiet.

Settings that differ (each side's natural way of doing the same step):
  - loss scale: workbench sums token losses (Tinker's semantics); TRL averages them (SFT: over the
    batch's tokens; GRPO: `loss_type="dapo"`, over the batch's completion tokens). Same gradient
    direction, and the same work.
  - GRPO objective: workbench `importance_sampling` (ratio to the sampler's logprobs times the advantage,
    no clip); TRL its default clipped surrogate (epsilon 0.2), whose ratio is 1 here (one iteration per
    generation batch). Neither has a KL term (TRL `beta=0.0`, its default).
  - GRPO advantages: workbench r - mean(r) per group (Dr. GRPO); TRL `scale_rewards="none"` for the same.
  - GRPO old logprobs: workbench takes the sampler's (returned with every sample); TRL recomputes none
    with one iteration per generation batch.
  - optimizer: workbench `torch.optim.AdamW` (for-loop implementation); TRL the Trainer's default
    `adamw_torch_fused`. Both: lr 1e-5 constant, betas (0.9, 0.95), eps 1e-8, no weight decay, no
    gradient clipping.
  - micro-batches: workbench groups datums by length under its token budget (and checkpoints layers only
    past its full-activation limit, 1,024 padded tokens here); TRL runs the batch as one padded forward, with
    `activation_checkpointing=False` (TRL's default is True; off is the faster setting at these sizes;
    grpo-long keeps it on).
  - TRL also computes its logged metrics every step (entropy, token accuracy); workbench its own
    (`loss:sum`, `num_tokens:sum`).
  - Sampling: both draw at temperature 1 with no top-k/top-p and stop at the end-of-turn token; the
    draws differ (different generators), so completion lengths, and so the work, differ a little.

    python bench/peers.py
    python bench/peers.py --tasks sft --steps 6
    python bench/peers.py --tasks grpo --vllm-python .venv-vllm/bin/python
    python bench/peers.py --tasks grpo grpo-long --steps 5

Needs `trl` (`pip install -e .[peers]`); without it, says so and exits with code 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from contention import MODES, quiet_and_contended  # bench/contention.py, beside this script

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

MODEL = "smollm2-135m"
RANK = 16
ALPHA = 32.0
LEARNING_RATE = 1e-5
BETAS = (0.9, 0.95)
EPS = 1e-8
SFT_BATCH = 8
PROMPTS_PER_STEP, GROUP_SIZE, MAX_NEW_TOKENS = 8, 4, 16
LONG_PROMPT_TOKENS = 512  # grpo-long: the chat prompt's length, worked examples and question
TASKS = ("sft", "grpo", "grpo-long")
SIDES = ("trl", "workbench")


def sft_sequences(tokenizer: Any) -> list[list[int]]:
    """The pirate chats with the chat template, one token list each."""
    from workbench.loops.datasets import pirate_sft

    return [
        list(tokenizer.apply_chat_template(qa.messages(), tokenize=True, return_dict=True)["input_ids"])
        for qa in pirate_sft()
    ]


def sft_batches(sequences: list[list[int]], steps: int) -> list[list[list[int]]]:
    """`steps` batches of SFT_BATCH sequences, in order, cycling through the data."""
    flat = [sequences[i % len(sequences)] for i in range(steps * SFT_BATCH)]
    return [flat[i : i + SFT_BATCH] for i in range(0, len(flat), SFT_BATCH)]


def grpo_problems(steps: int) -> list[Any]:
    from workbench.loops.datasets import addition_problems

    return addition_problems(steps * PROMPTS_PER_STEP, seed=0)


def grpo_questions(task: str, problems: list[Any], tokenizer: Any) -> list[str]:
    """Each problem's user message: its question, and for `grpo-long` worked examples before it, as
    many as bring the chat prompt to LONG_PROMPT_TOKENS tokens (the same examples for every problem)."""
    from workbench.loops.datasets import addition_problems

    if task == "grpo":
        return [p.question for p in problems]

    def prompt_length(examples: str) -> int:
        messages = [{"role": "user", "content": examples + problems[0].question}]
        encoded = tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=True
        )
        return len(encoded["input_ids"])

    examples = ""
    for example in addition_problems(LONG_PROMPT_TOKENS, seed=1):
        longer = f"{examples}{example.question}\n{example.answer}\n\n"
        if prompt_length(longer) > LONG_PROMPT_TOKENS:
            break
        examples = longer
    return [examples + p.question for p in problems]


def reward(text: str, answer: str) -> float:
    """1.0 when the reply's last number is the answer, 0.0 otherwise: the final-answer rule of
    arithmetic RL (GSM8K's). SmolLM2-135M rarely replies with the number alone ("5 + 2 = 7"), so an
    exact match would give every reply 0 and both sides nothing to train on."""
    numbers = re.findall(r"-?\d+", text)
    return 1.0 if numbers and numbers[-1] == answer else 0.0


def workbench_lora() -> Any:
    import workbench as wb

    return wb.LoraConfig(rank=RANK, alpha=ALPHA, train_unembed=False)


def peft_lora_config() -> Any:
    """peft's LoraConfig on the modules workbench adapts for `LoraConfig(rank=RANK)`."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    from workbench.engine.model.base_model import (
        classify_linear_layers,
        lora_target_modules,
        resolve_model_path,
    )

    base = AutoModelForCausalLM.from_pretrained(resolve_model_path(MODEL), dtype=torch.float32)
    modules = lora_target_modules(classify_linear_layers(base), workbench_lora())
    return peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=modules, task_type="CAUSAL_LM"
    )


# ------------------------------------------------------------------------------------------------- TRL side


def trl_run(task: str, warmup: int, steps: int) -> dict[str, Any]:
    """Train with TRL's trainer for warmup + steps steps; the seconds of the timed steps."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from workbench.engine.model.base_model import resolve_model_path

    path = resolve_model_path(MODEL)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    step_ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            step_ends.append(time.perf_counter())

    common = {
        "output_dir": tempfile.mkdtemp(prefix="workbench-peers-trl-"),
        "max_steps": warmup + steps,
        "learning_rate": LEARNING_RATE,
        "lr_scheduler_type": "constant",
        "adam_beta1": BETAS[0],
        "adam_beta2": BETAS[1],
        "adam_epsilon": EPS,
        "weight_decay": 0.0,
        "max_grad_norm": 0.0,
        "bf16": False,
        # off is the faster setting at these sizes; grpo-long's one padded pass over 32 x ~530 tokens
        # runs out of 24 GiB without it, so that task keeps TRL's default (on)
        "activation_checkpointing": task == "grpo-long",
        "use_cpu": True,
        "dataloader_num_workers": 0,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "seed": 0,
    }
    trainer_inputs = {
        "model": model,
        "processing_class": tokenizer,
        "peft_config": peft_lora_config(),
        "callbacks": [StepClock()],
    }
    if task == "sft":
        from trl import SFTConfig, SFTTrainer

        batches = sft_batches(sft_sequences(tokenizer), warmup + steps)
        dataset = Dataset.from_dict({"input_ids": [seq for batch in batches for seq in batch]})
        config = SFTConfig(
            **common,
            per_device_train_batch_size=SFT_BATCH,
            train_sampling_strategy="sequential",
            packing=False,
            max_length=None,
        )
        trainer = SFTTrainer(args=config, train_dataset=dataset, **trainer_inputs)
        trainer.train()
        timed_tokens = sum(len(seq) - 1 for batch in batches[warmup:] for seq in batch)
    else:
        from trl import GRPOConfig, GRPOTrainer

        problems = grpo_problems(warmup + steps)
        dataset = Dataset.from_dict(
            {
                "prompt": [
                    [{"role": "user", "content": q}] for q in grpo_questions(task, problems, tokenizer)
                ],
                "answer": [p.answer for p in problems],
            }
        )

        def final_answer(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
            return [reward(c[0]["content"], a) for c, a in zip(completions, answer, strict=True)]

        config = GRPOConfig(
            **common,
            per_device_train_batch_size=PROMPTS_PER_STEP * GROUP_SIZE,
            num_generations=GROUP_SIZE,
            max_completion_length=MAX_NEW_TOKENS,
            steps_per_generation=1,
            shuffle_dataset=False,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            beta=0.0,
            scale_rewards="none",
            use_vllm=False,
        )
        trainer = GRPOTrainer(reward_funcs=final_answer, args=config, train_dataset=dataset, **trainer_inputs)
        trainer.train()
        timed_tokens = 0
    seconds = [b - a for a, b in zip(step_ends[warmup - 1 : -1], step_ends[warmup:], strict=True)]
    return {"seconds": seconds, "tokens": timed_tokens}


# ------------------------------------------------------------------------------------------- workbench side


def workbench_run(task: str, warmup: int, steps: int, sampler: str = "hf") -> dict[str, Any]:
    """The same steps with a workbench Session sampling with `sampler`; the seconds of the timed steps."""
    import torch

    import workbench as wb

    session = wb.Session(
        MODEL,
        workbench_lora(),
        seed=0,
        sampler=sampler,
        wandb=False,
        model_dir=tempfile.mkdtemp(prefix="workbench-peers-"),
    )
    adam = wb.AdamParams(learning_rate=LEARNING_RATE, beta1=BETAS[0], beta2=BETAS[1], eps=EPS)
    tokenizer = session.tokenizer
    step_ends = [time.perf_counter()]
    if task == "sft":
        batches = sft_batches(sft_sequences(tokenizer), warmup + steps)
        for batch in batches:
            data = [
                wb.Datum(
                    model_input=wb.ModelInput.from_ints(seq[:-1]),
                    loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * (len(seq) - 1)},
                )
                for seq in batch
            ]
            session.policy.forward_backward(data, "cross_entropy")
            session.policy.optim_step(adam).result()
            step_ends.append(time.perf_counter())
        timed_tokens = sum(len(seq) - 1 for batch in batches[warmup:] for seq in batch)
    else:
        problems = grpo_problems(warmup + steps)
        questions = grpo_questions(task, problems, tokenizer)
        sampling = wb.SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=1.0)
        eos = tokenizer.eos_token
        for step in range(warmup + steps):
            first = step * PROMPTS_PER_STEP
            chunk = problems[first : first + PROMPTS_PER_STEP]
            prompts = [
                wb.chat_prompt(tokenizer, [{"role": "user", "content": q}])
                for q in questions[first : first + PROMPTS_PER_STEP]
            ]
            sampler = session.policy.save_weights_and_get_sampling_client()
            futures = [sampler.sample(prompt, GROUP_SIZE, sampling) for prompt in prompts]
            data = []
            for problem, prompt, future in zip(chunk, prompts, futures, strict=True):
                group = future.result().sequences
                texts = [tokenizer.decode(s.tokens).removesuffix(eos) for s in group]
                rewards_G = torch.tensor([reward(text, problem.answer) for text in texts])
                advantages_G = wb.group_relative_advantages(rewards_G)
                data += [
                    wb.policy_datum(prompt, s, float(a)) for s, a in zip(group, advantages_G, strict=True)
                ]
            session.policy.forward_backward(data, "importance_sampling")
            session.policy.optim_step(adam).result()
            step_ends.append(time.perf_counter())
        timed_tokens = 0
    session.close()
    seconds = [b - a for a, b in zip(step_ends[warmup:-1], step_ends[warmup + 1 :], strict=True)]
    return {"seconds": seconds, "tokens": timed_tokens}


# ------------------------------------------------------------------------------------------------- driver


def run_child(
    side: str, task: str, warmup: int, steps: int, vllm_python: str | None = None
) -> dict[str, Any]:
    """One side's run in a fresh process; workbench's with vLLM sampling under `vllm_python`."""
    python = vllm_python if side == "workbench" and vllm_python else sys.executable
    sampler = ["--sampler", "vllm"] if python is vllm_python else []
    out = subprocess.run(
        [python, __file__, "--child", side, task, "--warmup", str(warmup), "--steps", str(steps), *sampler],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        sys.exit(f"{side} {task} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=3, help="timed steps")
    parser.add_argument(
        "--vllm-python",
        default=None,
        help="workbench samples GRPO's completions with vLLM, in this interpreter's environment "
        "(e.g. .venv-vllm/bin/python); TRL stays in this one, generating with transformers",
    )
    parser.add_argument("--child", nargs=2, metavar=("SIDE", "TASK"), help=argparse.SUPPRESS)
    parser.add_argument("--sampler", default="hf", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child and args.child[0] == "workbench":  # workbench's side needs no TRL
        print(json.dumps(workbench_run(args.child[1], args.warmup, args.steps, args.sampler)))
        return
    if importlib.util.find_spec("trl") is None:
        print("bench/peers.py compares against TRL, which is not installed: pip install -e '.[peers]'")
        return
    if args.warmup < 1 or args.steps < 1:
        sys.exit("--warmup and --steps must be >= 1")
    if args.child:
        print(json.dumps(trl_run(args.child[1], args.warmup, args.steps)))
        return
    import trl

    print(
        f"model={MODEL} fp32 cpu, LoRA rank {RANK} alpha {ALPHA:g} on attention and MLP, TRL {trl.__version__}; "
        f"{args.warmup} warm-up + {args.steps} timed steps per side, each side in a fresh process"
    )
    print(f"{'task':54s} {'TRL':>9s} {'workbench':>10s} {'ratio':>6s}  target")
    for task in args.tasks:
        both = quiet_and_contended(
            lambda task=task: {
                side: run_child(side, task, args.warmup, args.steps, args.vllm_python) for side in SIDES
            }
        )
        step_seconds = {}  # (mode, side): seconds per step, the figure the contended / quiet ratio compares
        for mode, figures in zip(MODES, (both.quiet, both.contended), strict=True):
            if task == "sft":
                trl_tps, ours_tps = (figures[s]["tokens"] / sum(figures[s]["seconds"]) for s in SIDES)
                label = f"SFT tokens/s (batch {SFT_BATCH}, no packing), {mode}"
                print(f"{label:54s} {trl_tps:9.1f} {ours_tps:10.1f} {ours_tps / trl_tps:6.2f}  >= 1.0")
            else:
                trl_s, ours_s = (statistics.median(figures[s]["seconds"]) for s in SIDES)
                prompt = f", prompt {LONG_PROMPT_TOKENS}" if task == "grpo-long" else ""
                label = (
                    f"GRPO s/step ({PROMPTS_PER_STEP}x{GROUP_SIZE}, <= {MAX_NEW_TOKENS} new{prompt}), {mode}"
                )
                print(f"{label:54s} {trl_s:9.2f} {ours_s:10.2f} {ours_s / trl_s:6.2f}  <= 0.4")
            for side in SIDES:
                step_seconds[mode, side] = statistics.median(figures[side]["seconds"])
        print(f"  {both.describe()}")
        print(
            f"  {task} step time contended / quiet: workbench "
            f"{step_seconds['contended', 'workbench'] / step_seconds['quiet', 'workbench']:.2f}x, "
            f"TRL {step_seconds['contended', 'trl'] / step_seconds['quiet', 'trl']:.2f}x"
        )


if __name__ == "__main__":
    main()
