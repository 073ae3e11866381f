"""Training throughput: workbench's forward_backward + optim_step against a raw transformers + peft loop.

Same model, same LoRA, same data, same loss (weighted token-level cross-entropy sum), same AdamW, in the
same process, timed alternately. Two batches:
  (a) equal lengths: workbench / raw should be >= 0.95 (the API costs nothing);
  (b) ragged lengths spread over 16..256: workbench (length-bucketed micro-batches) against the raw loop
      padding the whole batch to its longest sequence; should be >= 1.5x.
Tokens/s counts real (non-padding) tokens. Both batches are timed twice, on a quiet machine and with a
second process keeping one core busy (`bench/contention.py`: what a notebook always has beside the
engine), with the step time contended / quiet of each side.

`--quantize` times instead workbench's step on fp32, NF4 and int8 bases (`Session(quantize=...)`), one
session after the other, on an equal batch of 8 x 64 tokens: on `tiny` and on `bench/memory.py`'s Llama
twin (hidden size 256, where the linear layers hold most weights). On a CPU, bitsandbytes' 4-bit layers
run its fallback kernels (the fast ones come from the `kernels` package, downloaded from a model hub at
run time); the figure that matters is a GPU's.

    python bench/train.py --model tiny
    python bench/train.py --model smollm2-135m
    python bench/train.py --quantize --steps 3
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import peft
import torch
import torch.nn.functional as F
from contention import MODES, quiet_and_contended  # bench/contention.py, beside this script
from transformers import AutoModelForCausalLM

import workbench as wb
from workbench.engine.model.base_model import classify_linear_layers, lora_target_modules, resolve_model_path

SETTINGS = {
    "tiny": {"equal": (32, 128), "ragged_count": 64, "steps": 10, "rank": 16},
    "smollm2-135m": {"equal": (8, 128), "ragged_count": 24, "steps": 1, "rank": 16},
}
ADAM = wb.AdamParams(learning_rate=1e-5)


def make_batch(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n + 1)] for n in lengths]


class RawLoop:
    """The floor: a hand-written transformers + peft training step, padding to the longest sequence."""

    def __init__(self, model_name: str, lora: wb.LoraConfig):
        base = AutoModelForCausalLM.from_pretrained(resolve_model_path(model_name), dtype=torch.float32)
        linear_layers = classify_linear_layers(base)
        config = peft.LoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=0.0,
            target_modules=lora_target_modules(linear_layers, lora),
            task_type="CAUSAL_LM",
        )
        torch.manual_seed(0)
        self.model = peft.get_peft_model(base, config)
        self.model.eval()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params,
            lr=ADAM.learning_rate,
            betas=(ADAM.beta1, ADAM.beta2),
            eps=ADAM.eps,
            weight_decay=ADAM.weight_decay,
            foreach=False,
        )

    def forward_backward(self, sequences: list[list[int]]) -> None:
        """Padded batch, logits, fp32 cross-entropy summed over real tokens, backward."""
        longest = max(len(s) - 1 for s in sequences)
        inputs = torch.zeros((len(sequences), longest), dtype=torch.long)
        targets = torch.zeros_like(inputs)
        mask = torch.zeros_like(inputs)
        for row, seq in enumerate(sequences):
            n = len(seq) - 1
            inputs[row, :n] = torch.tensor(seq[:-1])
            targets[row, :n] = torch.tensor(seq[1:])
            mask[row, :n] = 1
        logits = self.model(input_ids=inputs, attention_mask=mask, use_cache=False).logits
        nll = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
        loss = (nll * mask.flatten()).sum()
        loss.backward()

    def step(self, sequences: list[list[int]]) -> None:
        self.forward_backward(sequences)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def workbench_step(session: wb.Session, data: list[wb.Datum]) -> None:
    session.policy.forward_backward(data, "cross_entropy")
    session.policy.optim_step(ADAM).result()


def to_datums(sequences: list[list[int]]) -> list[wb.Datum]:
    return [
        wb.Datum(
            model_input=wb.ModelInput.from_ints(s[:-1]),
            loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)},
        )
        for s in sequences
    ]


def timed_pair(first, second, steps: int, rounds: int = 5) -> tuple[float, float]:
    """Median seconds per step of two step functions, timed in alternating blocks of `steps` steps.

    Blocks rather than single alternating steps: the raw loop runs on this thread and workbench on its
    worker thread, and each thread has its own OpenMP team, whose idle workers spin for a while after a
    parallel region; a short pause between blocks lets them sleep, so each side is timed in steady state.
    """
    times: tuple[list[float], list[float]] = ([], [])
    first()
    second()
    for _ in range(rounds):
        for fn, sink in ((first, times[0]), (second, times[1])):
            time.sleep(0.3)
            fn()  # warm the thread's team
            for _ in range(steps):
                start = time.perf_counter()
                fn()
                sink.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def quantized_throughput(steps: int) -> None:
    """The `--quantize` table: tokens/s of one forward_backward + optim_step, fp32 against NF4 and int8."""
    from memory import LLAMA_TWIN, QUANTIZATIONS, model_path  # bench/memory.py, beside this script

    sequences = make_batch([64] * 8, 900, seed=0)  # within tiny's and the twin's vocabularies
    tokens = sum(len(s) - 1 for s in sequences)
    print(f"batch 8 x 64 tokens, LoRA rank 16, threads={torch.get_num_threads()}, median of {steps} steps")
    print(f"{'model':18s} {'base':>5s} {'tok/s':>8s} {'/ fp32':>7s}")
    for model in ("tiny", LLAMA_TWIN):
        fp32_s = None
        for quantization in QUANTIZATIONS:
            quantize = None if quantization == "fp32" else quantization
            with wb.Session(
                model_path(model),
                wb.LoraConfig(rank=16),
                seed=0,
                wandb=False,
                sampler="hf",
                quantize=quantize,
            ) as session:
                datums = to_datums(sequences)
                workbench_step(session, datums)  # warm
                times = []
                for _ in range(steps):
                    start = time.perf_counter()
                    workbench_step(session, datums)
                    times.append(time.perf_counter() - start)
            step_s = statistics.median(times)
            fp32_s = fp32_s or step_s
            print(f"{model:18s} {quantization:>5s} {tokens / step_s:8.1f} {fp32_s / step_s:7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", choices=sorted(SETTINGS))
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps per configuration (median is reported)"
    )
    parser.add_argument("--quantize", action="store_true", help="fp32 against NF4 and int8 bases")
    args = parser.parse_args()
    if args.quantize:
        quantized_throughput(args.steps or 3)
        return
    settings = SETTINGS[args.model]
    steps = args.steps or settings["steps"]
    lora = wb.LoraConfig(rank=settings["rank"])
    torch.manual_seed(0)

    session = wb.Session(args.model, lora, seed=0)
    raw = RawLoop(args.model, lora)
    vocab = session.base_info.vocab_size

    count, length = settings["equal"]
    equal = make_batch([length] * count, vocab, seed=0)
    rng = random.Random(1)
    ragged = make_batch([rng.randint(16, 256) for _ in range(settings["ragged_count"])], vocab, seed=2)

    print(
        f"model={args.model} rank={lora.rank} device={session.device} dtype={session.config.dtype} "
        f"threads={torch.get_num_threads()} timed steps={steps}x5 blocks (median)"
    )
    batches = (("(a) equal lengths", equal), ("(b) ragged 16..256", ragged))

    def measure() -> list[tuple[str, int, float, float]]:
        """Per batch: its name, real tokens, raw and workbench seconds per step."""
        rows = []
        for name, sequences in batches:
            datums = to_datums(sequences)
            raw_s, ours_s = timed_pair(
                lambda s=sequences: raw.step(s), lambda d=datums: workbench_step(session, d), steps
            )
            rows.append((name, sum(len(s) - 1 for s in sequences), raw_s, ours_s))
        return rows

    both = quiet_and_contended(measure)
    targets = ("workbench/raw >= 0.95", "workbench/raw-padded >= 1.5")
    header = f"{'batch':22s} {'tokens':>7s} {'raw tok/s':>10s} {'workbench tok/s':>16s} {'ratio':>6s}  target"
    for mode, rows in zip(MODES, (both.quiet, both.contended), strict=True):
        print(f"{mode}:\n{header}")
        for (name, tokens, raw_s, ours_s), target in zip(rows, targets, strict=True):
            print(
                f"{name:22s} {tokens:7d} {tokens / raw_s:10.1f} {tokens / ours_s:16.1f} {raw_s / ours_s:6.2f}  {target}"
            )
    print(both.describe())
    for (name, _, raw_quiet, ours_quiet), (_, _, raw_busy, ours_busy) in zip(
        both.quiet, both.contended, strict=True
    ):
        print(
            f"{name}: step time contended / quiet: workbench {ours_busy / ours_quiet:.2f}x, "
            f"raw loop {raw_busy / raw_quiet:.2f}x"
        )
    session.close()


if __name__ == "__main__":
    main()
