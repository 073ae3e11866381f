"""Tiny random-init twins of the mixture-of-experts families people train, and their dense equivalents.

Each twin (Qwen3-MoE, gpt-oss, DeepSeek-V3, Mixtral, Qwen2-MoE, GraniteMoE) has 2 decoder layers, the built-in tiny model's tokenizer and vocabulary, hidden size 64 and
4 routed experts of which the router picks 2 per token; each expert is an MLP of intermediate size 32.
Its dense twin has the same sizes with one MLP of that size where the MoE block has its experts (for
DeepSeek-V3 and Qwen2-MoE the same class with every layer dense; for the others the nearest dense
class), so LoRA counts can be compared layer for layer.

`save_twin(family, folder)` writes a model folder a session loads like any HF model. Run as a script,
this module prints, for every family, the modules a default `LoraConfig(rank=4)` adapts and the LoRA
parameters counted against the dense twin:

    PYTHONPATH=$PWD HF_HUB_OFFLINE=1 python -m tests.engine.model.moe_twins
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    GptOssConfig,
    GraniteConfig,
    GraniteMoeConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    PretrainedConfig,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from workbench.engine.model.builtin_models import tiny_base_model_dir

NUM_EXPERTS = 4
EXPERTS_PER_TOKEN = 2
EXPERT_SIZE = 32  # each expert's (and the dense twin's) intermediate size

_COMMON = {
    "vocab_size": 934,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}


def _qwen3_moe(head_dim: int) -> PretrainedConfig:
    return Qwen3MoeConfig(
        **_COMMON,
        head_dim=head_dim,
        intermediate_size=EXPERT_SIZE,
        moe_intermediate_size=EXPERT_SIZE,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=EXPERTS_PER_TOKEN,
        norm_topk_prob=True,
    )


def _qwen3_dense(head_dim: int) -> PretrainedConfig:
    return Qwen3Config(**_COMMON, head_dim=head_dim, intermediate_size=EXPERT_SIZE)


def _gpt_oss(head_dim: int) -> PretrainedConfig:
    return GptOssConfig(
        **_COMMON,
        head_dim=head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": 150000.0},  # YaRN needs a long context
        intermediate_size=EXPERT_SIZE,
        num_local_experts=NUM_EXPERTS,
        num_experts_per_tok=EXPERTS_PER_TOKEN,
    )


def _gpt_oss_dense(head_dim: int) -> PretrainedConfig:
    return LlamaConfig(**_COMMON, head_dim=head_dim, intermediate_size=EXPERT_SIZE, attention_bias=True)


def _deepseek_v3(head_dim: int, dense: bool = False) -> PretrainedConfig:
    """Layer 0 dense (`first_k_dense_replace`), layer 1 routed experts plus one shared expert; its
    router takes the top 2 of one group, with no auxiliary loss and no token dropped."""
    return DeepseekV3Config(
        **{**_COMMON, "num_key_value_heads": _COMMON["num_attention_heads"]},  # multi-head latent attention
        intermediate_size=EXPERT_SIZE,
        moe_intermediate_size=EXPERT_SIZE,
        n_routed_experts=NUM_EXPERTS,
        num_experts_per_tok=EXPERTS_PER_TOKEN,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=2 if dense else 1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=head_dim,
        qk_rope_head_dim=8,
        v_head_dim=head_dim,
        rope_scaling=None,
    )


def _mixtral(head_dim: int) -> PretrainedConfig:
    return MixtralConfig(
        **_COMMON,
        head_dim=head_dim,
        intermediate_size=EXPERT_SIZE,
        num_local_experts=NUM_EXPERTS,
        num_experts_per_tok=EXPERTS_PER_TOKEN,
    )


def _mistral_dense(head_dim: int) -> PretrainedConfig:
    return MistralConfig(**_COMMON, head_dim=head_dim, intermediate_size=EXPERT_SIZE)


def _qwen2_moe(head_dim: int, dense: bool = False) -> PretrainedConfig:
    return Qwen2MoeConfig(
        **_COMMON,
        head_dim=head_dim,
        intermediate_size=EXPERT_SIZE,
        moe_intermediate_size=EXPERT_SIZE,
        shared_expert_intermediate_size=EXPERT_SIZE,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=EXPERTS_PER_TOKEN,
        mlp_only_layers=[0, 1] if dense else [],
    )


def _granitemoe(head_dim: int) -> PretrainedConfig:
    """Experts under `block_sparse_moe`, not `mlp`."""
    return GraniteMoeConfig(
        **_COMMON,
        intermediate_size=EXPERT_SIZE,
        num_local_experts=NUM_EXPERTS,
        num_experts_per_tok=EXPERTS_PER_TOKEN,
    )


def _granite_dense(head_dim: int) -> PretrainedConfig:
    return GraniteConfig(**_COMMON, intermediate_size=EXPERT_SIZE)


# family -> (MoE twin's config, dense twin's config), each from the attention head size
FAMILIES: dict[str, tuple[Callable[[int], PretrainedConfig], Callable[[int], PretrainedConfig]]] = {
    "qwen3_moe": (_qwen3_moe, _qwen3_dense),
    "gpt_oss": (_gpt_oss, _gpt_oss_dense),
    "deepseek_v3": (_deepseek_v3, lambda head_dim: _deepseek_v3(head_dim, dense=True)),
    "mixtral": (_mixtral, _mistral_dense),
    "qwen2_moe": (_qwen2_moe, lambda head_dim: _qwen2_moe(head_dim, dense=True)),
    "granitemoe": (_granitemoe, _granite_dense),
}


def save_twin(
    family: str,
    folder: Path,
    dense: bool = False,
    head_dim: int = 16,
    seed: int = 0,
    sliding_window: int | None = None,
) -> str:
    """Write the `family` twin (or its dense twin) with seeded random weights and the tiny tokenizer to
    `folder`, and return the folder as a session's `base_model`. `sliding_window` sets the window of a
    family whose attention has one (gpt-oss's sliding layers, Mistral's) below the twin's context."""
    moe_config, dense_config = FAMILIES[family]
    config = (dense_config if dense else moe_config)(head_dim)
    if sliding_window is not None:
        config.sliding_window = sliding_window
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        # the routers start at zero in transformers: random ones pick different experts per token
        for name, param in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight")) and param.dim() == 2:
                torch.nn.init.normal_(param, std=0.5)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tiny = tiny_base_model_dir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(tiny) / name, folder / name)
    return str(folder)


def lora_counts(base_model: str, lora_rank: int = 4) -> dict[str, object]:
    """What a default `LoraConfig(rank=lora_rank)` adapts on `base_model`: the LoRA tensors, their
    parameters by kind (attn, mlp, unembed), and the adapted weights by leaf name with their count."""
    import workbench as wb

    lora = wb.LoraConfig(rank=lora_rank)
    with wb.Session(base_model, lora, seed=0, wandb=False) as sess:
        adapted = sess.base_info.adapted_weights(lora)
        kind_of_module = {name.rsplit(".", 1)[0]: kind for name, kind in adapted.items()}
        params = {
            name: p
            for name, p in sess.engine.torch_model.named_parameters()
            if "lora_" in name and ".policy." in name
        }
        by_kind: dict[str, int] = {}
        for name, param in params.items():
            module = name.split(".lora_")[0].removeprefix("base_model.model.").replace(".base_layer", "")
            kind = kind_of_module[module]
            by_kind[kind] = by_kind.get(kind, 0) + param.numel()
        leaves: dict[str, int] = {}
        for name in adapted:
            parts = name.removesuffix(".weight").split(".")
            leaf = (
                ".".join(parts[-2:])
                if len(parts) > 1 and parts[-2] in ("experts", "shared_experts", "shared_expert")
                else parts[-1]
            )
            leaves[leaf] = leaves.get(leaf, 0) + 1
        return {"tensors": len(params), "parameters": by_kind, "adapted": dict(sorted(leaves.items()))}


def _print_counts() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        for family in FAMILIES:
            print(f"{family}  (LoraConfig(rank=4), defaults: train_attn, train_mlp, train_unembed)")
            for dense in (False, True):
                folder = save_twin(
                    family, Path(scratch) / f"{family}-{'dense' if dense else 'moe'}", dense=dense
                )
                counts = lora_counts(folder)
                parameters = counts["parameters"]
                total = sum(parameters.values())
                print(
                    f"  {'dense twin' if dense else 'MoE twin  '}  {counts['tensors']:3d} LoRA tensors, "
                    f"{total:6d} parameters: {parameters}"
                )
                print(f"              adapted weights (count): {counts['adapted']}")


if __name__ == "__main__":
    _print_counts()
