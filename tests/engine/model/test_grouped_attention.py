"""grouped_attention.py: on a CPU, masked attention over grouped key-value heads gives what transformers'
"sdpa" gives, without a copy of the keys and values per query head among what autograd keeps."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import workbench as wb
from workbench.engine.model.builtin_models import tiny_base_model_dir
from workbench.engine.model.grouped_attention import (
    GROUPED_SDPA,
    grouped_sdpa_attention,
    use_grouped_attention,
)


def _saved_bytes_and_logits(model: torch.nn.Module, ids_B_T: torch.Tensor, mask_B_T: torch.Tensor):
    """The bytes autograd keeps for a forward pass (each storage once) and the logits."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logits_B_T_V = model(input_ids=ids_B_T, attention_mask=mask_B_T).logits
    return sum(storages.values()), logits_B_T_V


def test_masked_grouped_heads_give_sdpa_results_without_a_copy_per_query_head() -> None:
    """The tiny model: 4 query heads over 2 key-value heads; a padded batch, so the attention is masked."""
    model = AutoModelForCausalLM.from_pretrained(tiny_base_model_dir(), dtype=torch.float32)
    model.requires_grad_(True)
    generator = torch.Generator().manual_seed(0)
    ids_B_T = torch.randint(3, 200, (4, 96), generator=generator)
    mask_B_T = torch.ones_like(ids_B_T)
    mask_B_T[1, :40] = 0
    mask_B_T[3, :7] = 0
    assert model.config._attn_implementation == "sdpa"
    sdpa_bytes, sdpa_logits = _saved_bytes_and_logits(model, ids_B_T, mask_B_T)
    use_grouped_attention(model)
    assert model.config._attn_implementation == GROUPED_SDPA
    grouped_bytes, grouped_logits = _saved_bytes_and_logits(model, ids_B_T, mask_B_T)
    real = mask_B_T.bool()
    torch.testing.assert_close(grouped_logits[real], sdpa_logits[real], rtol=1e-5, atol=1e-5)
    # per layer "sdpa" keeps its keys and values as 4 heads, "grouped_sdpa" as the 2 they are
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    one_head_B_T_D = 4 * 96 * head_dim * 4  # bytes
    extra_heads = config.num_attention_heads - config.num_key_value_heads
    copies = 2 * extra_heads * one_head_B_T_D * config.num_hidden_layers
    assert sdpa_bytes - grouped_bytes >= 0.9 * copies, (sdpa_bytes, grouped_bytes, copies)


def test_the_engine_runs_grouped_attention_on_a_cpu() -> None:
    with wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, wandb=False) as sess:
        assert sess.engine._state.model.base.config._attn_implementation == GROUPED_SDPA


def test_a_soft_cap_goes_to_sdpa_as_it_is() -> None:
    """Grouped heads, a mask, on a CPU, and a soft cap: "sdpa" decides (transformers 5.23 refuses it, 5.19
    drops it), and the call gives what "sdpa" gives, its error or its output."""
    model = AutoModelForCausalLM.from_pretrained(tiny_base_model_dir(), dtype=torch.float32)
    attention = model.model.layers[0].self_attn
    generator = torch.Generator().manual_seed(0)
    query_B_Hq_T_D = torch.randn(1, 4, 5, 16, generator=generator)
    key_B_Hk_S_D = torch.randn(1, 2, 5, 16, generator=generator)
    mask = torch.ones(1, 1, 5, 5, dtype=torch.bool).tril()

    def outcome(function: Any) -> Any:
        try:
            return function(attention, query_B_Hq_T_D, key_B_Hk_S_D, key_B_Hk_S_D, mask, softcap=30.0)[0]
        except ValueError as error:
            return str(error)

    grouped, sdpa = outcome(grouped_sdpa_attention), outcome(sdpa_attention_forward)
    if isinstance(sdpa, str):
        assert grouped == sdpa
    else:
        torch.testing.assert_close(grouped, sdpa, rtol=0, atol=0)
