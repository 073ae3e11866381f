"""Step memory: what one `forward_backward(cross_entropy)` adds over the loaded model, workbench against
the raw transformers + peft loop.

For every sequence length T (batch 1) and each side, a fresh process loads the model with a rank-16
LoRA on every linear layer (attention, MLP, output layer), settles, resets the kernel's peak-RSS mark
(`/proc/self/clear_refs`, Linux), runs one forward + backward of the summed token cross-entropy, and
reports the peak resident memory minus the resident memory before the step (on a GPU: the peak CUDA
allocation minus the allocation before the step). Workbench runs with the session's defaults; the floor
is `bench/train.py`'s raw loop: logits for the whole sequence, fp32 `cross_entropy`, backward.

Two models: `smollm2-135m` (V = 49,152), and the same body with a randomly initialised V = 151,936
output layer (the vocabulary of the Qwen2/Qwen3 family), built once into a temporary folder.
Target: workbench <= 0.5 x the raw loop at T = 2048 on smollm2-135m.
Not measured contended (as the timing benchmarks are): a busy core changes time, not peak memory.

    python bench/memory.py
    python bench/memory.py --lengths 512 1024 2048 4096 --models smollm2-135m
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

LARGE_VOCAB = 151_936
LARGE_VOCAB_MODEL = f"smollm2-body-v{LARGE_VOCAB}"
SIDES = ("raw", "workbench")
RANK = 16


def large_vocab_folder() -> Path:
    """SmolLM2-135M's configuration with V = 151,936, randomly initialised, saved once (seeded)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from workbench.engine.model.base_model import resolve_model_path

    folder = Path(tempfile.gettempdir()) / f"workbench-bench-{LARGE_VOCAB_MODEL}"
    if (folder / "config.json").is_file():
        return folder
    source = resolve_model_path("smollm2-135m")
    config = AutoConfig.from_pretrained(source)
    config.vocab_size = LARGE_VOCAB
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    partial = folder.with_name(folder.name + ".partial")
    model.save_pretrained(partial)
    AutoTokenizer.from_pretrained(source).save_pretrained(partial)
    partial.rename(folder)
    return folder


def model_path(model: str) -> str:
    return str(large_vocab_folder()) if model == LARGE_VOCAB_MODEL else model


def resident_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def peak_resident_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak() -> None:
    """Set the kernel's peak-RSS mark (VmHWM) to the current RSS (Linux >= 4.0)."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")


def measure(model: str, side: str, length: int) -> dict[str, float]:
    """One fresh process: load, settle, reset the peak, one forward + backward, report the growth."""
    import random

    import torch

    import workbench as wb

    rng = random.Random(0)
    tokens = [rng.randrange(1000, 40_000) for _ in range(length + 1)]
    lora = wb.LoraConfig(rank=RANK)
    path = model_path(model)
    if side == "raw":
        from train import RawLoop

        raw = RawLoop(path, lora)

        def step() -> None:
            raw.forward_backward([tokens])
    else:
        model_dir = tempfile.mkdtemp(prefix="workbench-bench-memory-")
        session = wb.Session(path, lora, seed=0, wandb=False, model_dir=model_dir)
        datum = wb.Datum(
            model_input=wb.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]}
        )

        def step() -> None:
            session.policy.forward_backward([datum], "cross_entropy").result()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() / 2**20
    loaded = resident_mb()
    reset_peak()
    step()
    result = {"loaded_mb": loaded, "step_mb": peak_resident_mb() - loaded}
    if cuda:
        result["cuda_step_mb"] = torch.cuda.max_memory_allocated() / 2**20 - before
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", LARGE_VOCAB_MODEL])
    parser.add_argument("--child", nargs=3, metavar=("MODEL", "SIDE", "T"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model, side, length = args.child
        print(json.dumps(measure(model, side, int(length))))
        return
    for model in args.models:
        model_path(model)  # build the large-vocabulary folder before the measured processes
    key = "step_mb"
    rows = []
    for model in args.models:
        for length in args.lengths:
            figures = {}
            for side in SIDES:
                out = subprocess.run(
                    [sys.executable, __file__, "--child", model, side, str(length)],
                    capture_output=True,
                    text=True,
                    check=False,
                )
                if out.returncode != 0:
                    sys.exit(f"{model} {side} T={length} failed:\n{out.stderr[-3000:]}")
                figures[side] = json.loads(out.stdout.strip().splitlines()[-1])
            if "cuda_step_mb" in figures["raw"]:
                key = "cuda_step_mb"
            rows.append((model, length, figures))
    where = "peak CUDA allocation" if key == "cuda_step_mb" else "peak RSS"
    print(f"one forward_backward(cross_entropy), batch 1, LoRA rank {RANK}; step memory = {where} - before")
    print(f"{'model':28s} {'T':>5s} {'loaded MB':>10s} {'raw MB':>9s} {'workbench MB':>13s} {'ratio':>6s}")
    for model, length, figures in rows:
        raw_mb, ours_mb = figures["raw"][key], figures["workbench"][key]
        print(
            f"{model:28s} {length:5d} {figures['raw']['loaded_mb']:10.0f} {raw_mb:9.0f} "
            f"{ours_mb:13.0f} {ours_mb / raw_mb:6.2f}"
        )
    print("target: workbench / raw <= 0.5 at T = 2048 on smollm2-135m")


if __name__ == "__main__":
    main()
