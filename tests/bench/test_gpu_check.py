"""bench/gpu_check.py: `--model tiny` prints every figure on the CPU; the twins have Qwen3's published
sizes; `--devices` is given to `wb.Session`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from gpu_check import (  # noqa: E402  (bench/ is not a package)
    CPU_SIZES,
    TINY_TOKENS,
    TWINS,
    Case,
    check,
    matmul_flops,
    session_arguments,
    twin_folder,
)

NUMBER = r"([\d,.]+(?:e[+-]?\d+)?)"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH / "gpu_check.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )


def _figures(pattern: str, stdout: str) -> list[float]:
    match = re.search(pattern, stdout)
    assert match, (pattern, stdout)
    return [float(group.replace(",", "")) for group in match.groups()]


def test_the_tiny_check_prints_every_figure_on_the_cpu() -> None:
    done = _run("--model", "tiny")
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    match = re.search(rf"float32 matmul 512×512×512: {NUMBER} ([GT])FLOP/s", out)
    assert match, out
    matmul = float(match[1]) * (1000 if match[2] == "T" else 1)  # past 100 GFLOP/s: printed in TFLOP/s
    assert matmul > 0
    for label in ("[tiny fp32]", "[tiny nf4]"):
        tag = re.escape(label)
        tokens_per_s, model_flops, weights, ratio = _figures(
            rf"{tag} SFT 4 × 64 tokens, median of 2 steps: {NUMBER} tok/s; model FLOP/s 6·N·tokens/s = "
            rf"{NUMBER} GFLOP/s \(N = {NUMBER} linear weights\), {NUMBER}× the matmul's",
            out,
        )
        assert tokens_per_s > 0 and weights > 0
        # the printed figures are rounded (tok/s to a unit, FLOP/s to four figures): a loaded machine's few
        # hundred tok/s carry up to 1% of rounding
        assert model_flops == pytest.approx(6 * weights * tokens_per_s / 1e9, rel=0.02, abs=0.006)
        assert ratio == pytest.approx(model_flops / matmul, rel=0.05, abs=1e-3)
        count, _, max_diff = _figures(
            rf"{tag} logprobs, hf sampler vs trainer: {NUMBER} tokens, mean \|Δ\| {NUMBER}, max \|Δ\| {NUMBER}",
            out,
        )
        assert count > 0 and max_diff <= 1e-4  # fp32 on the CPU, NF4 dequantized into fp32: rounding only
        step, sample, train, optim = _figures(
            rf"{tag} GRPO step, 2 groups × 4, ≤ 16 new tokens \(\d+ sampled\): {NUMBER} s \(sample {NUMBER} s, "
            rf"forward_backward {NUMBER} s, optim_step {NUMBER} s\)",
            out,
        )
        assert 0 < sample + train + optim <= step + 0.05
        assert re.search(rf"{tag} peak memory: no CUDA device; .* the base's tensors [\d.]+ [KMG]iB", out), (
            out
        )
    assert "base nf4+dq" in out  # the quantized session's repr says so
    assert "vllm" not in out  # vLLM is checked on the GPU's first base only
    assert re.search(r"gpu_check: \d+ s in all", out)


def test_the_twins_have_the_published_sizes() -> None:
    """Qwen3-1.7B: 1.7B parameters, 1.4B without the embeddings (tied to the output layer); Qwen3-8B:
    8.2B, and 6.95B without the embeddings and the output layer (their model cards), counted on the meta
    device."""
    published = {"qwen3-1.7b": (1.7e9, 1.4e9), "qwen3-8b": (8.2e9, 6.95e9)}
    for name, (total, non_embedding) in published.items():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(TWINS[name])
        parameters = sum(p.numel() for p in model.parameters())  # a tied output layer counted once
        embeddings = {id(p): p.numel() for p in (model.get_input_embeddings().weight, model.lm_head.weight)}
        assert parameters == pytest.approx(total, rel=0.02), name
        assert parameters - sum(embeddings.values()) == pytest.approx(non_embedding, rel=0.02), name


def test_a_twin_of_qwen3s_vocabulary_goes_through_every_check(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The GPU run's path on the CPU: a twin written by `twin_folder` (V = 151,936, tied, beside the
    built-in tokenizer's 934 tokens: the sampler draws ids the tokenizer has no text for), loaded by folder,
    through every line, then reused from its folder."""
    small = Qwen3Config(
        vocab_size=TWINS["qwen3-1.7b"].vocab_size,
        tie_word_embeddings=True,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        **TINY_TOKENS,
    )
    monkeypatch.setitem(TWINS, "qwen3-small", small)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    device = torch.device("cpu")
    flops = matmul_flops(device, torch.float32, CPU_SIZES.matmul_size)
    check(Case("qwen3-small"), device, CPU_SIZES, flops, {})
    out = capsys.readouterr().out
    for line in ("SFT 4 × 64 tokens", "logprobs, hf sampler vs trainer", "GRPO step", "peak memory"):
        assert f"[qwen3-small fp32] {line}" in out, out
    written = next(tmp_path.glob("workbench-gpu-check-qwen3-small*"))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("workbench-gpu-check")] == [written.name]
    assert AutoModelForCausalLM.from_pretrained(written).config.vocab_size == 151_936
    written_at = (written / "config.json").stat().st_mtime_ns
    assert twin_folder("qwen3-small", device) == str(written)  # reused, not written again
    assert (written / "config.json").stat().st_mtime_ns == written_at


def test_devices_is_given_to_the_session() -> None:
    """`--devices N` becomes `wb.Session(..., devices=N)` (a count, or a name such as `all`); without it,
    nothing is added."""
    assert session_arguments("2") == {"devices": 2}
    assert session_arguments("all") == {"devices": "all"}
    assert session_arguments(None) == {}
