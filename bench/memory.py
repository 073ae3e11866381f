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

`--quantize` measures instead what a quantized base holds (QLoRA, `Session(quantize=...)`): for fp32, NF4
and int8, a fresh process per base loads it and reports its tensors' bytes (`engine.base_memory_bytes`,
scales included) and the process's resident memory. On `tiny` and on a Llama twin of hidden size 256
(4 layers, V = 1,024: 3.2M linear weights beside 0.5M in the embeddings, so the quantized layers
dominate, as in a real model; tiny's embeddings are 40% of its weights). Targets: NF4 <= 0.35x and int8
<= 0.55x the fp32 base on the twin.

    python bench/memory.py
    python bench/memory.py --lengths 512 1024 2048 4096 --models smollm2-135m
    python bench/memory.py --quantize
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


LLAMA_TWIN = "llama-twin-h256"
QUANTIZATIONS = ("fp32", "nf4", "int8")


def llama_twin_folder() -> Path:
    """A Llama of 4 layers, hidden size 256, V = 1,024 (untied), randomly initialised (seeded), with
    tiny's tokenizer, saved once: the twin the quantization tests measure."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from workbench.engine.model.builtin_models import tiny_base_model_dir

    folder = Path(tempfile.gettempdir()) / f"workbench-bench-{LLAMA_TWIN}"
    if (folder / "config.json").is_file():
        return folder
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    partial = folder.with_name(folder.name + ".partial")
    AutoModelForCausalLM.from_config(config).save_pretrained(partial)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_base_model_dir() / name, partial / name)
    partial.rename(folder)
    return folder


def model_path(model: str) -> str:
    folders = {LARGE_VOCAB_MODEL: large_vocab_folder, LLAMA_TWIN: llama_twin_folder}
    return str(folders[model]()) if model in folders else model


def measure_base(model: str, quantization: str) -> dict[str, float]:
    """One fresh process: load a session on the base, fp32 or quantized, and report what it holds."""
    import workbench as wb

    quantize = None if quantization == "fp32" else quantization
    model_dir = tempfile.mkdtemp(prefix="workbench-bench-memory-")
    with wb.Session(
        model_path(model),
        wb.LoraConfig(rank=RANK),
        wandb=False,
        sampler="hf",
        quantize=quantize,
        model_dir=model_dir,
    ) as session:
        return {"base_mb": session.engine.base_memory_bytes / 2**20, "resident_mb": resident_mb()}


def quantized_bases(models: list[str]) -> None:
    """The `--quantize` table: each base in fp32, NF4 and int8, each in a fresh process."""
    print(f"{'model':18s} {'base':>5s} {'base MB':>8s} {'/ fp32':>7s} {'RSS MB':>7s}")
    for model in models:
        model_path(model)  # build the twin before the measured processes
        fp32_mb = None
        for quantization in QUANTIZATIONS:
            out = subprocess.run(
                [sys.executable, __file__, "--base-child", model, quantization],
                capture_output=True,
                text=True,
                check=False,
            )
            if out.returncode != 0:
                sys.exit(f"{model} {quantization} failed:\n{out.stderr[-3000:]}")
            figures = json.loads(out.stdout.strip().splitlines()[-1])
            fp32_mb = fp32_mb or figures["base_mb"]
            print(
                f"{model:18s} {quantization:>5s} {figures['base_mb']:8.2f} {figures['base_mb'] / fp32_mb:7.2f} "
                f"{figures['resident_mb']:7.0f}"
            )
    print(f"target on {LLAMA_TWIN}: nf4 / fp32 <= 0.35, int8 / fp32 <= 0.55")


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
    parser.add_argument("--quantize", action="store_true", help="what fp32, NF4 and int8 bases hold")
    parser.add_argument("--child", nargs=3, metavar=("MODEL", "SIDE", "T"), help=argparse.SUPPRESS)
    parser.add_argument("--base-child", nargs=2, metavar=("MODEL", "QUANTIZATION"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.base_child:
        print(json.dumps(measure_base(*args.base_child)))
        return
    if args.quantize:
        quantized_bases(["tiny", LLAMA_TWIN])
        return
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
