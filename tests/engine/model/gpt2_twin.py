"""A tiny random-init GPT-2 twin: its projections are `Conv1D` layers, not `nn.Linear`, the layout LoRA
placement and quantization each refuse by name."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from workbench.engine.model.builtin_models import tiny_base_model_dir


def save_gpt2_twin(folder: Path) -> str:
    """A 2-layer GPT-2 of hidden size 64 on the built-in tiny tokenizer, seeded, written to `folder`."""
    config = GPT2Config(
        vocab_size=934,
        n_positions=512,
        n_embd=64,
        n_layer=2,
        n_head=4,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        GPT2LMHeadModel(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_base_model_dir() / name, folder / name)
    return str(folder)
