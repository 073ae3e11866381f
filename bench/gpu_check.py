"""A one-command check for the day a GPU is at hand: numerics, throughput and memory on real sizes.

Nothing is downloaded: the bases are random-init twins of Qwen3-1.7B and Qwen3-8B, built from
transformers' `Qwen3Config` with their published dimensions (V = 151,936, GQA with 8 key-value heads,
head size 128; 1.7B ties its output layer to the embeddings, 8B does not) and the built-in tiny model's
tokenizer, saved once into the temporary directory and loaded by folder like any HF model. Every
figure goes through the public `Session` / Tinker API. For each base (bf16 on the GPU; the 8B twin a
second time in NF4, `Session(quantize="nf4")`), one session prints:

- SFT tokens/s over `forward_backward(cross_entropy)` + `optim_step` on equal-length random sequences,
  and the model FLOP/s 6·N·tokens/s, N the weights of the linear layers (output layer included; the
  embedding lookup and attention's score and value matmuls not counted), against a bf16 matmul's
  FLOP/s measured at the start of the same run: the ratio is an MFU. 6·N is the usual convention; a
  LoRA step computes no gradient for the frozen weights, so the work done is nearer 4·N·tokens;
- logprobs, sampler vs trainer, after the SFT steps: `check_logprob_agreement` on the HF sampler (and,
  when vLLM is importable, in a second session on vLLM, for the first base only: its start-up is the
  slowest part of the run);
- one GRPO step: sample the groups from the current weights, group-relative advantages of a stand-in
  reward (the share of a completion's tokens with an even id: the step's cost does not depend on
  the reward), `forward_backward(importance_sampling)`, `optim_step`, each part timed;
- the peak memory of the session's work, `torch.cuda.max_memory_allocated` (this process's device),
  and the base's own memory (`base_memory_bytes`, scales included when quantized).

`--model tiny` runs the same on the CPU in fp32 (and NF4) in seconds; CI runs it so the script keeps
working. `--devices N` passes `devices=N` to `wb.Session`. The default run is sized for under 8 minutes
on one H100/H200-class GPU: one SFT batch of 8 x 1024 tokens, 4 x 4 samples for the agreement, 4 groups
of 8 for the GRPO step, at most 128 new tokens each; the twins' folders (3.4 and 16.4 GB) are written
once and reused by later runs.

    python bench/gpu_check.py
    python bench/gpu_check.py --model qwen3-1.7b
    python bench/gpu_check.py --model tiny
    python bench/gpu_check.py --devices 2
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import io
import os
import random
import resource
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config

import workbench as wb
from workbench.engine.local.base_models import format_size
from workbench.engine.model.base_model import resolve_model_path
from workbench.engine.model.builtin_models import tiny_base_model_dir

GIB = 1024**3
TINY_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # the built-in tokenizer's ids

# Qwen3-1.7B's and Qwen3-8B's config.json, less what a random twin does not need
TWINS = {
    "qwen3-1.7b": Qwen3Config(
        vocab_size=151_936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40_960,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        **TINY_TOKENS,
    ),
    "qwen3-8b": Qwen3Config(
        vocab_size=151_936,
        hidden_size=4096,
        intermediate_size=12_288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40_960,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        **TINY_TOKENS,
    ),
}


@dataclass(frozen=True)
class Sizes:
    """How much work each check does on one base."""

    sft_batch: tuple[int, int]  # sequences x tokens per SFT step
    sft_steps: int  # timed, after one untimed step
    groups: int  # GRPO: prompts, each sampled `group_size` times
    group_size: int
    new_tokens: int  # at most, per completion
    prompt_tokens: int
    matmul_size: int  # n of the n x n x n matmul that gives the device's FLOP/s


GPU_SIZES = Sizes((8, 1024), 3, groups=4, group_size=8, new_tokens=128, prompt_tokens=64, matmul_size=8192)
CPU_SIZES = Sizes((4, 64), 2, groups=2, group_size=4, new_tokens=16, prompt_tokens=16, matmul_size=512)


@dataclass(frozen=True)
class Case:
    """One base to check, and how it is loaded."""

    model: str  # a key of TWINS, or "tiny"
    quantize: str | None = None
    vllm: bool = False  # also check vLLM's logprobs (when importable)

    def label(self, dtype: str) -> str:
        return f"[{self.model} {self.quantize or dtype}]"


RUNS = {
    "all": [Case("qwen3-1.7b", vllm=True), Case("qwen3-8b"), Case("qwen3-8b", quantize="nf4")],
    "qwen3-1.7b": [Case("qwen3-1.7b", vllm=True)],
    "qwen3-8b": [Case("qwen3-8b"), Case("qwen3-8b", quantize="nf4")],
    "tiny": [Case("tiny"), Case("tiny", quantize="nf4")],
}


def twin_folder(name: str, device: torch.device) -> str:
    """The random twin `name` as a model folder, written once (initialised on `device`, in bf16, so the
    8B twin takes seconds, not the minutes a CPU takes) under a temporary name and renamed when
    complete; "tiny" is the built-in model."""
    if name == "tiny":
        return resolve_model_path("tiny")
    folder = Path(tempfile.gettempdir()) / f"workbench-gpu-check-{name}"
    if (folder / "config.json").is_file():
        return str(folder)
    partial = Path(tempfile.mkdtemp(prefix=f"{folder.name}.", dir=folder.parent))
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(TWINS[name], dtype=torch.bfloat16)
        model.save_pretrained(partial)
    del model
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_base_model_dir() / file, partial / file)
    partial.rename(folder)
    return str(folder)


def linear_weights(folder: str) -> int:
    """N of 6·N·tokens: the weights of the base's linear layers, the output layer included (counted on
    the meta device)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_flops(device: torch.device, dtype: torch.dtype, n: int) -> float:
    """FLOP/s of an n x n by n x n matmul in `dtype` (2·n³ each), the best of 10 after 3 warm-up runs."""
    a_N_N = torch.randn(n, n, device=device, dtype=dtype)
    b_N_N = torch.randn(n, n, device=device, dtype=dtype)
    times = []
    for step in range(13):
        synchronize(device)
        start = time.perf_counter()
        a_N_N @ b_N_N
        synchronize(device)
        if step >= 3:
            times.append(time.perf_counter() - start)
    return 2 * n**3 / min(times)


def random_sequences(rng: random.Random, count: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def agreement_line(sess: wb.Session, sampler: str, sizes: Sizes, vocab: int) -> str:
    """The sampler's logprobs of its own samples against the trainer's `forward` on the same tokens."""
    rng = random.Random(1)
    prompts = [wb.ModelInput.from_ints(p) for p in random_sequences(rng, 4, sizes.prompt_tokens, vocab)]
    params = wb.SamplingParams(max_tokens=sizes.new_tokens, temperature=1.0, seed=0)
    with contextlib.redirect_stdout(io.StringIO()):  # the probe prints its report; ours says which sampler
        report = wb.check_logprob_agreement(sess, prompts, num_samples=4, sampling_params=params)
    return (
        f"logprobs, {sampler} sampler vs trainer: {report.num_tokens} tokens, "
        f"mean |Δ| {report.mean_abs_diff:.2e}, max |Δ| {report.max_abs_diff:.2e}"
    )


def train_once(sess: wb.Session, vocab: int) -> None:
    """One SFT step on a short random sequence."""
    (tokens,) = random_sequences(random.Random(4), 1, 17, vocab)
    datum = wb.Datum(
        model_input=wb.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]}
    )
    sess.policy.forward_backward([datum], "cross_entropy").result()
    sess.policy.optim_step(wb.AdamParams(learning_rate=1e-3)).result()


def sft_line(sess: wb.Session, sizes: Sizes, vocab: int, weights: int, device_flops: float) -> str:
    """SFT tokens/s and model FLOP/s against the matmul's."""
    count, length = sizes.sft_batch
    rng = random.Random(2)
    data = [
        wb.Datum(model_input=wb.ModelInput.from_ints(s[:-1]), loss_fn_inputs={"target_tokens": s[1:]})
        for s in random_sequences(rng, count, length + 1, vocab)
    ]
    adam = wb.AdamParams(learning_rate=1e-5)
    times = []
    for step in range(1 + sizes.sft_steps):  # the first step warms the kernels up, untimed
        start = time.perf_counter()
        sess.policy.forward_backward(data, "cross_entropy").result()
        sess.policy.optim_step(adam).result()
        if step > 0:
            times.append(time.perf_counter() - start)
    tokens_per_s = count * length / statistics.median(times)
    model_flops = 6 * weights * tokens_per_s
    return (
        f"SFT {count} × {length} tokens, median of {sizes.sft_steps} steps: {tokens_per_s:,.0f} tok/s; "
        f"model FLOP/s 6·N·tokens/s = {flops_text(model_flops)} (N = {weights:.3e} linear weights), "
        f"{model_flops / device_flops:.3f}× the matmul's"
    )


def grpo_line(sess: wb.Session, sizes: Sizes, vocab: int) -> str:
    """One GRPO step, its parts timed: sample, forward_backward(importance_sampling), optim_step."""
    rng = random.Random(3)
    prompts = random_sequences(rng, sizes.groups, sizes.prompt_tokens, vocab)
    params = wb.SamplingParams(max_tokens=sizes.new_tokens, temperature=1.0, seed=0)
    start = time.perf_counter()
    client = sess.sampling_client()
    futures = [client.sample(wb.ModelInput.from_ints(p), sizes.group_size, params) for p in prompts]
    groups = [future.result().sequences for future in futures]
    sampled = time.perf_counter()
    data = []
    for prompt, sequences in zip(prompts, groups, strict=True):
        kept = [s for s in sequences if s.tokens]
        rewards_G = [sum(t % 2 == 0 for t in s.tokens) / len(s.tokens) for s in kept]
        advantages_G = wb.group_relative_advantages(rewards_G).tolist() if kept else []
        data += [wb.policy_datum(prompt, s, a) for s, a in zip(kept, advantages_G, strict=True)]
    sess.policy.forward_backward(data, "importance_sampling").result()
    trained = time.perf_counter()
    sess.policy.optim_step(wb.AdamParams(learning_rate=1e-5)).result()
    end = time.perf_counter()
    new_tokens = sum(len(s.tokens) for sequences in groups for s in sequences)
    return (
        f"GRPO step, {sizes.groups} groups × {sizes.group_size}, ≤ {sizes.new_tokens} new tokens "
        f"({new_tokens} sampled): {end - start:.2f} s (sample {sampled - start:.2f} s, "
        f"forward_backward {trained - sampled:.2f} s, optim_step {end - trained:.2f} s)"
    )


def flops_text(flops: float) -> str:
    """FLOP/s to four significant figures (the ratios printed beside are computed before rounding)."""
    return f"{flops / 1e12:.4g} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.4g} GFLOP/s"


def memory_line(sess: wb.Session, device: torch.device) -> str:
    base = f"the base's tensors {format_size(sess.engine.base_memory_bytes)}"
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / GIB
        return f"peak memory (torch.cuda.max_memory_allocated): {peak:.2f} GiB; {base}"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # KiB on Linux
    return f"peak memory: no CUDA device; the process's peak RSS so far {rss:.2f} GiB; {base}"


def check(case: Case, device: torch.device, sizes: Sizes, device_flops: float, extra: dict) -> None:
    """Every line for one base: its load, logprob agreement, SFT, a GRPO step, memory."""
    folder = twin_folder(case.model, device)
    weights = linear_weights(folder)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    label = case.label({"bfloat16": "bf16", "float32": "fp32"}[dtype])
    settings = {"seed": 0, "wandb": False, "device": str(device), "dtype": dtype, **extra}
    with tempfile.TemporaryDirectory() as scratch:
        gc.collect()  # the last case's session is closed: its memory goes before the peak is reset
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        sess = wb.Session(
            folder,
            wb.LoraConfig(rank=16),
            sampler="hf",
            quantize=case.quantize,
            model_dir=Path(scratch) / "hf",
            **settings,
        )
        with sess:
            print(f"{label} loaded in {time.perf_counter() - start:.1f} s: {sess!r}", flush=True)
            vocab = min(len(sess.policy.get_tokenizer()), sess.base_info.vocab_size)
            # SFT first, so the adapter whose logprobs are compared is a trained one (B ≠ 0)
            print(f"{label} {sft_line(sess, sizes, vocab, weights, device_flops)}", flush=True)
            print(f"{label} {agreement_line(sess, 'hf', sizes, vocab)}", flush=True)
            print(f"{label} {grpo_line(sess, sizes, vocab)}", flush=True)
            print(f"{label} {memory_line(sess, device)}", flush=True)
        if not case.vllm:
            return
        if importlib.util.find_spec("vllm") is None:
            print(f"{label} logprobs, vllm sampler vs trainer: skipped, vLLM is not importable", flush=True)
            return
        vllm_dir = Path(scratch) / "vllm"
        with wb.Session(
            folder, wb.LoraConfig(rank=16), sampler="vllm", model_dir=vllm_dir, **settings
        ) as sess:
            train_once(sess, vocab)  # so the adapter vLLM serves is a trained one
            print(f"{label} {agreement_line(sess, 'vllm', sizes, vocab)}", flush=True)


def session_arguments(devices: str | None) -> dict:
    """`devices=` for `wb.Session` when asked for."""
    if devices is None:
        return {}
    return {"devices": int(devices) if devices.isdigit() else devices}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(RUNS), default="all")
    parser.add_argument("--devices", default=None, help="passed to wb.Session(devices=...): N or 'all'")
    args = parser.parse_args()
    extra = session_arguments(args.devices)
    if args.model == "tiny":
        device, sizes = torch.device("cpu"), CPU_SIZES
    elif torch.cuda.is_available():
        device, sizes = torch.device("cuda"), GPU_SIZES
    else:
        raise SystemExit(f"--model {args.model} needs a CUDA device; --model tiny runs on the CPU")
    start = time.perf_counter()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    device_flops = matmul_flops(device, dtype, sizes.matmul_size)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    n = sizes.matmul_size
    print(
        f"gpu_check: torch {torch.__version__} on {device.type} ({name}); "
        f"{str(dtype).removeprefix('torch.')} matmul {n}×{n}×{n}: {flops_text(device_flops)}",
        flush=True,
    )
    for case in RUNS[args.model]:
        check(case, device, sizes, device_flops, extra)
    print(f"gpu_check: {time.perf_counter() - start:.0f} s in all", flush=True)


if __name__ == "__main__":
    main()
