"""Base models and their LoRA adapters.

`load_base_model` resolves a name (a built-in alias, a local folder or an HF id), loads the tokenizer and
the frozen base weights on the chosen device and dtype. `attach_lora` wraps the base in a peft model with
one named adapter; `add_lora_adapter` adds another (the critic's) on the same base weights, so a second
adapter costs its own parameters only.

Which layers get adapters follows Tinker's `LoraConfig`: attention projections (`train_attn`), MLP
projections (`train_mlp`) and the output embedding (`train_unembed`). Layers are classified by where
they sit in the module tree (under an attention or an MLP block), so any HF decoder works.

`train_mlp` covers every MLP weight: dense MLPs, shared experts and the routed experts of a mixture of
experts. transformers keeps routed experts as fused 3-D parameters, (experts, ·, ·) stacks such as
`mlp.experts.gate_up_proj` and `mlp.experts.down_proj`, not as `nn.Linear` layers; they are adapted
with peft's own support for parameters (`target_parameters`, `peft.tuners.lora.ParamWrapper`), which
gives every expert its own pair: A of shape (experts·r, in) and B of shape (out, experts·r), read as
A_e (r, in) and B_e (out, r), so expert e's weight becomes W_e + (alpha/r)·B_e·A_e. An expert the
router does not pick for any token contributes nothing to the output, so its A_e and B_e get a zero
gradient. The router itself is not adapted (it picks experts; it is not one of the token's
projections). Hosted Tinker shares the factor on the hidden-size side across experts ("shared-outer
LoRA", `tinker_cookbook.hyperparam_utils.get_lora_param_count`) and gives gate and up their own
adapters; per-expert pairs on the fused weights hold that form as a special case, with more
parameters (docs/models.md counts them).

With a `QuantizationConfig` the frozen base's linear layers are quantized at load
(`workbench.engine.model.quantization`); adapters attach to bitsandbytes' layers through peft's own LoRA
layers for them, and stay in the dtype they have on an unquantized base.

A `LoraConfig` that asks for a kind of layer the model has none of, or whose chosen blocks hold a
weight LoRA cannot adapt (a quantized expert stack, a GPT-2 style `Conv1D`), is refused with the
names; nothing is silently left out.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import huggingface_hub
import peft
import torch
import transformers
from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from workbench.engine.config import QuantizationConfig
from workbench.engine.model.builtin_models import BUILTIN_MODELS
from workbench.engine.model.quantization import (
    bitsandbytes_config,
    check_quantizable,
    check_quantizable_layers,
    keep_one_cpu_kernel,
)
from workbench.types import LoraConfig

_ATTENTION_MARKERS = ("attn", "attention")
_MLP_MARKERS = ("mlp", "feed_forward", "ffn", "moe")  # `moe`: GraniteMoE's `block_sparse_moe`


@dataclass(frozen=True)
class BaseModelInfo:
    """What identifies a base model: checkpoints refuse to load onto a different one."""

    name: str  # as the user gave it: alias, HF id or folder
    path: str  # the folder or HF id transformers loaded
    model_type: str
    vocab_size: int  # rows of the input embedding: valid token ids are [0, vocab_size)
    hidden_size: int
    num_layers: int
    max_length: int  # the longest sequence the model accepts (max_position_embeddings)
    logits_from_hidden_states: bool  # the logits are the output layer's result on the final hidden states
    linear_layers: Mapping[str, str] = field(
        default_factory=dict, repr=False
    )  # name -> attn | mlp | unembed | other
    expert_weights: Mapping[str, str] = field(
        default_factory=dict, repr=False
    )  # parameter name of a 3-D (experts, ·, ·) stack -> attn | mlp
    unadaptable_weights: Mapping[str, str] = field(
        default_factory=dict, repr=False
    )  # parameter name -> attn | mlp: a weight in such a block that LoRA cannot adapt
    quantization: QuantizationConfig | None = None  # how the frozen linear layers are stored

    def adapted_weights(self, lora: LoraConfig) -> dict[str, str]:
        """The weights `lora` adapts on this model, by kind: `<linear layer>.weight` and expert stacks."""
        wanted = _wanted_kinds(lora)
        linear = {f"{name}.weight": kind for name, kind in self.linear_layers.items() if wanted[kind]}
        return linear | {name: kind for name, kind in self.expert_weights.items() if wanted[kind]}

    def identity(self) -> dict[str, object]:
        """What a checkpoint must agree with; a quantized base adds its quantization (adapters trained
        on it fit its weights, which differ from the full-precision ones by the quantization error)."""
        identity: dict[str, object] = {
            "name": self.name,
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
        }
        if self.quantization is not None:
            identity["quantization"] = self.quantization.describe()
        return identity


def resolve_device_and_dtype(
    device: str | torch.device | None, dtype: str | torch.dtype | None
) -> tuple[torch.device, torch.dtype]:
    """Auto: CUDA in bf16 when available, else CPU in fp32 (where sampler and trainer logprobs agree)."""
    resolved_device = (
        torch.device(device)
        if device is not None
        else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    )
    if dtype is None:
        return resolved_device, torch.bfloat16 if resolved_device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        names = {
            "float32": torch.float32,
            "fp32": torch.float32,
            "bfloat16": torch.bfloat16,
            "bf16": torch.bfloat16,
            "float16": torch.float16,
            "fp16": torch.float16,
        }
        if dtype not in names:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(names)}")
        return resolved_device, names[dtype]
    return resolved_device, dtype


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Hide transformers' per-load progress bars (ours say what is happening) and the deprecation
    notice peft's wrapping triggers inside transformers, which users can do nothing about."""
    was_enabled = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            # An unembedding adapter on a model with tied embeddings adapts the output layer only, as
            # Tinker's `train_unembed` means; merged exports untie the two (checkpoints.export_merged).
            warnings.filterwarnings("ignore", message=".*tie_word_embeddings=True.*", category=UserWarning)
            yield
    finally:
        if was_enabled:
            transformers.utils.logging.enable_progress_bar()


def resolve_model_path(name: str) -> str:
    """A built-in alias becomes its prepared folder; a folder or an HF id is used as given."""
    if name in BUILTIN_MODELS:
        return str(BUILTIN_MODELS[name]())
    return name


def loads_without_download(name: str) -> bool:
    """Whether base model `name` loads from this machine alone: a built-in alias (prepared from the
    installed packages), a folder holding an HF model's `config.json`, or an HF id whose files are in
    this machine's HF cache (`HF_HUB_CACHE`)."""
    if name in BUILTIN_MODELS:
        return True
    if (Path(name).expanduser() / "config.json").is_file():
        return True
    try:
        return isinstance(huggingface_hub.try_to_load_from_cache(name, "config.json"), str)
    except ValueError:  # not an HF id either (huggingface_hub's HFValidationError)
        return False


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    with _quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(name))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _notice_unquantized_experts(
    skeleton: PreTrainedModel, path: str, dtype: torch.dtype, quantization: QuantizationConfig
) -> None:
    """Say, before loading, how much of a mixture of experts (`skeleton`, on the meta device) stays
    unquantized: its fused expert stacks are 3-D parameters, which bitsandbytes does not quantize."""
    stacks = classify_expert_weights(skeleton)
    if not stacks:
        return
    parameters = dict(skeleton.named_parameters())
    size = sum(parameters[name].numel() for name in stacks) * dtype.itemsize
    warnings.warn(
        f"quantize={quantization.method!r}: {len(stacks)} fused expert stacks of {path} "
        f"({size / 2**20:.1f} MiB) stay in {str(dtype).removeprefix('torch.')}: bitsandbytes quantizes "
        "linear layers only",
        UserWarning,
        stacklevel=2,
    )


def load_base_model(
    name: str, device: torch.device, dtype: torch.dtype, quantization: QuantizationConfig | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, BaseModelInfo]:
    """Load the frozen base model, its tokenizer and its identity; quantized at load when asked (checked
    first, so a refused load reads no weights)."""
    path = resolve_model_path(name)
    local = Path(name).expanduser()
    # an HF id is "name" or "org/name"; anything else that is not a folder here is a mistyped one
    looks_local = local.is_absolute() or name.startswith((".", "~")) or name.count("/") > 1
    if looks_local and not local.exists() and name not in BUILTIN_MODELS:
        raise ValueError(
            f"base_model {name!r}: no such model folder, and not a known model; give an HF model "
            f"folder, an HF id, or one of {sorted(BUILTIN_MODELS)}"
        )
    if local.exists() and not (local / "config.json").is_file():
        raise ValueError(
            f"base_model {name!r} is not a model folder (no config.json); give an HF model folder, "
            f"an HF id, or one of {sorted(BUILTIN_MODELS)}"
        )
    if quantization is not None:
        check_quantizable(path, device, quantization)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        check_quantizable_layers(skeleton, path, quantization)
        _notice_unquantized_experts(skeleton, path, dtype, quantization)
    tokenizer = load_tokenizer(name)
    with _quiet_transformers():
        if quantization is None:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
            model.to(device)
        else:  # quantized as each layer is placed on the device (bitsandbytes' layers do not move)
            model = AutoModelForCausalLM.from_pretrained(
                path,
                dtype=dtype,
                quantization_config=bitsandbytes_config(quantization, dtype),
                device_map={"": device},
            )
            keep_one_cpu_kernel(model)
    model.eval()  # no dropout: the trainer's logprobs must equal the sampler's
    model.requires_grad_(False)
    config = model.config
    info = BaseModelInfo(
        name=name,
        path=path,
        model_type=config.model_type,
        vocab_size=model.get_input_embeddings().num_embeddings,
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        max_length=config.max_position_embeddings,
        logits_from_hidden_states=logits_from_hidden_states(model),
        linear_layers=classify_linear_layers(model),
        expert_weights=classify_expert_weights(model),
        unadaptable_weights=classify_unadaptable_weights(model),
        quantization=quantization,
    )
    return model, tokenizer, info


def logits_from_hidden_states(model: PreTrainedModel) -> bool:
    """Whether the model's logits are its output layer applied to its decoder's final hidden states.

    True for most decoders; False for those that change the logits after the output layer (Gemma 2's
    soft cap, Cohere's scale, ...). Where it holds, logprobs are computed from the hidden states chunk by
    chunk (`workbench.engine.model.logprobs`); checked once here on a few tokens, by comparing the two.
    """
    input_ids_1_T = (
        torch.arange(1, 9, device=model.device)[None] % model.get_input_embeddings().num_embeddings
    )
    with torch.no_grad():
        logits_1_T_V = model(input_ids=input_ids_1_T, use_cache=False).logits
        hidden_1_T_H = model.get_decoder()(input_ids=input_ids_1_T, use_cache=False).last_hidden_state
        from_hidden_1_T_V = model.get_output_embeddings()(hidden_1_T_H)
    return torch.equal(logits_1_T_V, from_hidden_1_T_V)


def classify_linear_layers(model: nn.Module) -> dict[str, str]:
    """Every linear layer of a (not yet adapted) model by kind: `attn`, `mlp`, `unembed` or `other`.

    Computed once on the clean base model: after peft wraps layers, its own sub-layers are linear too.
    """
    unembed = model.get_output_embeddings()
    kinds: dict[str, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if module is unembed:
            kinds[name] = "unembed"
        else:
            kinds[name] = "other" if _is_router(module) else _block_kind(name) or "other"
    return kinds


def _block_kind(name: str) -> str | None:
    """`attn` or `mlp` for a name under an attention or an MLP block, else None."""
    parts = name.split(".")
    if any(marker in part for part in parts for marker in _ATTENTION_MARKERS):
        return "attn"
    if any(marker in part for part in parts for marker in _MLP_MARKERS):
        return "mlp"
    return None


def _is_expert_stack(module: nn.Module, param: nn.Parameter) -> bool:
    """A fused stack of per-expert weight matrices, (experts, ·, ·), as transformers 5 stores routed
    experts: what peft's `ParamWrapper` adapts."""
    return not isinstance(module, nn.Linear) and param.dim() == 3 and param.is_floating_point()


def _is_router(module: nn.Module) -> bool:
    """A mixture of experts' router (`Qwen3MoeTopKRouter`, `GptOssTopKRouter`, Llama 4's `nn.Linear`
    `Llama4Router`, ...): not adapted."""
    return "router" in type(module).__name__.lower()


def classify_expert_weights(model: nn.Module) -> dict[str, str]:
    """Every fused expert stack of a model by kind (`mlp` for routed experts), by parameter name."""
    kinds: dict[str, str] = {}
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}"
            kind = _block_kind(name)
            if kind is not None and _is_expert_stack(module, param):
                kinds[name] = kind
    return kinds


def classify_unadaptable_weights(model: nn.Module) -> dict[str, str]:
    """The weight matrices inside attention and MLP blocks that LoRA cannot adapt, by kind: neither an
    `nn.Linear`'s weight, nor a floating-point expert stack, nor a router's (quantized blocks, GPT-2's
    `Conv1D`, ...). Biases and norms (1-D, or an expert stack's (experts, out) biases) are not weights."""
    kinds: dict[str, str] = {}
    for module_name, module in model.named_modules():
        if _is_router(module):
            continue
        for param_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}"
            kind = _block_kind(name)
            if kind is None or param.dim() < 2 or _is_expert_stack(module, param):
                continue
            if isinstance(module, nn.Linear) and param_name == "weight":
                continue
            if param.dim() == 2 and param_name.endswith("bias"):
                continue
            kinds[name] = kind
    return kinds


def _wanted_kinds(lora: LoraConfig) -> dict[str, bool]:
    return {"attn": lora.train_attn, "mlp": lora.train_mlp, "unembed": lora.train_unembed, "other": False}


_KIND_FLAGS = {"attn": "train_attn", "mlp": "train_mlp", "unembed": "train_unembed"}
_KIND_NAMES = {"attn": "attention projection", "mlp": "MLP weight", "unembed": "output embedding"}


def check_lora_fits(info: BaseModelInfo, lora: LoraConfig) -> None:
    """Refuse a `lora` that asks for what the model cannot provide: a kind of layer it has none of, or a
    chosen block holding a weight LoRA cannot adapt. Nothing is left out silently."""
    adapted = info.adapted_weights(lora)
    for kind, flag in _KIND_FLAGS.items():
        if not getattr(lora, flag):
            continue
        blocked = sorted(name for name, other in info.unadaptable_weights.items() if other == kind)
        if blocked:
            shown = ", ".join(blocked[:3]) + (f" and {len(blocked) - 3} more" if len(blocked) > 3 else "")
            raise ValueError(
                f"LoraConfig({flag}=True) asks for adapters on every {_KIND_NAMES[kind]}, and this "
                f"{info.model_type} model ({info.name}) has some LoRA cannot adapt (neither a linear layer "
                f"nor a floating-point expert stack): {shown}; set {flag}=False"
            )
        if kind not in adapted.values():
            raise ValueError(
                f"LoraConfig({flag}=True) asks for adapters on every {_KIND_NAMES[kind]}, and this "
                f"{info.model_type} model ({info.name}) has none LoRA can adapt; set {flag}=False"
            )


def lora_target_parameters(expert_weights: Mapping[str, str], lora: LoraConfig) -> list[str]:
    """The expert stacks `lora` asks to adapt, as peft `target_parameters` (full parameter names)."""
    wanted = _wanted_kinds(lora)
    return sorted(name for name, kind in expert_weights.items() if wanted[kind])


def lora_target_modules(linear_layers: Mapping[str, str], lora: LoraConfig) -> list[str]:
    """Names of the linear layers that `lora` asks to adapt, as peft `target_modules`.

    Leaf names (`q_proj`, ...) are used when they pick out exactly the chosen layers, which keeps the
    adapter config short and readable by vLLM; otherwise the full module paths are used.
    """
    wanted_kinds = _wanted_kinds(lora)
    chosen = [name for name, kind in linear_layers.items() if wanted_kinds[kind]]
    others = [name for name, kind in linear_layers.items() if not wanted_kinds[kind]]
    if not chosen:
        return []
    leaves = {name.split(".")[-1] for name in chosen}
    if not any(name.split(".")[-1] in leaves for name in others):
        return sorted(leaves)
    return chosen


def _lora_targets(model: nn.Module, info: BaseModelInfo, lora: LoraConfig) -> tuple[list[str], list[str]]:
    """What `lora` adapts on `model` (the base model, or the peft model holding it), as peft's
    `target_modules` and `target_parameters`.

    peft rewrites the config of mixture-of-experts models whose layout changed in transformers 5
    (`convert_peft_config_for_transformers`, so that adapters trained on the old per-expert layout
    still load): a target module named like an old expert projection (`gate_proj`, `up_proj`,
    `down_proj`, `w1`...) is taken to mean the fused expert stack and dropped, even where it is a real
    linear layer (DeepSeek-V3's dense first layers and shared experts, GLM-4-MoE's, ...). Those layers
    are targeted through their weight parameter instead (`<layer>.weight`, peft's `ParamWrapper` on a
    2-D parameter: the same `W + (alpha/r)·B·A`, the same file keys), which the rewrite leaves alone.
    """
    modules = lora_target_modules(info.linear_layers, lora)
    parameters = lora_target_parameters(info.expert_weights, lora)
    rewritten = _peft_config(lora, modules, parameters)
    convert_peft_config_for_transformers(rewritten, model=model, conversions=None)
    dropped = set(modules) - set(rewritten.target_modules or ())
    if dropped:
        chosen = info.adapted_weights(lora)
        parameters = sorted(
            {*parameters}
            | {
                f"{name}.weight"
                for name in info.linear_layers
                if f"{name}.weight" in chosen and (name in dropped or name.split(".")[-1] in dropped)
            }
        )
        modules = [name for name in modules if name not in dropped]
    return modules, parameters


def _peft_config(lora: LoraConfig, modules: list[str], parameters: list[str]) -> peft.LoraConfig:
    return peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=0.0,
        target_modules=modules or None,
        target_parameters=parameters or None,
        bias="none",
        task_type="CAUSAL_LM",
    )


def _lora_peft_config(model: nn.Module, info: BaseModelInfo, lora: LoraConfig) -> peft.LoraConfig:
    """peft's config for `lora` on `model` (the base model, or the peft model holding it)."""
    check_lora_fits(info, lora)
    return _peft_config(lora, *_lora_targets(model, info, lora))


def adapts_by_parametrization(model: nn.Module, info: BaseModelInfo) -> bool:
    """Whether an adapter on `model` can adapt a weight through peft's `ParamWrapper` (an expert stack,
    or a linear layer targeted through its weight, see `_lora_targets`). Such an adapter registers a
    parametrization on its layer for the length of each forward call and removes it after (the layer's
    class changes both times), so a forward pass changes the model while it runs: two threads running it
    at once fail in backward, or one reads the weight without its adapter."""
    return bool(_lora_targets(model, info, LoraConfig())[1])  # every kind of layer a config can ask for


def attach_lora(
    model: PreTrainedModel, info: BaseModelInfo, lora: LoraConfig, adapter_name: str, seed: int
) -> peft.PeftModel:
    """Wrap the base model in peft with one adapter. A-matrices are drawn from a generator seeded with
    `seed`; B-matrices start at zero, so the adapted model starts equal to the base."""
    with torch.random.fork_rng(devices=[]), _quiet_transformers():
        torch.manual_seed(seed)
        peft_model = peft.get_peft_model(
            model, _lora_peft_config(model, info, lora), adapter_name=adapter_name
        )
    peft_model.eval()
    return peft_model


def add_lora_adapter(
    peft_model: peft.PeftModel, info: BaseModelInfo, lora: LoraConfig, adapter_name: str, seed: int
) -> None:
    """Add another adapter on the same frozen base weights."""
    with torch.random.fork_rng(devices=[]), _quiet_transformers():
        torch.manual_seed(seed)
        peft_model.add_adapter(adapter_name, _lora_peft_config(peft_model, info, lora))
    peft_model.eval()


def adapter_parameters(peft_model: peft.PeftModel, adapter_name: str) -> dict[str, nn.Parameter]:
    """The trainable tensors of one adapter, by qualified name, in a stable order."""
    marker = f".{adapter_name}."
    params = {
        name: param for name, param in peft_model.named_parameters() if "lora_" in name and marker in name
    }
    if not params:
        raise ValueError(f"no LoRA parameters found for adapter {adapter_name!r}")
    return params
