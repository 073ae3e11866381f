"""Attention over grouped keys and values on a CPU, without a copy of them per query head.

With grouped-query attention (GQA: Ainslie et al. 2023, https://arxiv.org/abs/2305.13245) each key and
value head serves n = query heads / key-value heads query heads. transformers' "sdpa" attention copies
every key and value head n times (`repeat_kv`) whenever it is given a mask, because CUDA's fused kernels
take no mask with grouped heads; torch's `scaled_dot_product_attention` takes `enable_gqa=True` and reads
the grouped heads directly on a CPU, mask or not, with the same result. The copies are what autograd
keeps of a layer's keys and values, so they cost memory and time where keys are many per query: in a
shared-prefix pass (`workbench.engine.model.prefix_attention`) each suffix row attends to its group's
whole prefix. On SmolLM2-135M (9 query heads over 3 key-value heads), one group of 8 completions of 64
tokens after a 512-token prompt, fp32, one thread: the copies were 0.4 GB of the 2.5 GB autograd kept,
and the pass took 13.3 s with them and 11.3 s without (medians of 3, interleaved in one process). A
batch of padded datums without a shared prefix is as fast either way (within 3%).

"grouped_sdpa" is the "sdpa" implementation with that one change: a masked attention over grouped heads
on a CPU; everything else (no mask, a single query, a model without grouped heads, a tensor off the CPU,
a position bias, a paged cache or a soft cap) goes to "sdpa" as it is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

GROUPED_SDPA = "grouped_sdpa"
# What "sdpa" acts on besides the heads: a position bias added to the scores, a paged cache it updates,
# and a logit soft cap, which it refuses. A call with any of them goes to "sdpa" as it is.
SDPA_OPTIONS = ("position_bias", "cache", "softcap")


def grouped_sdpa_attention(
    module: nn.Module,
    query_B_Hq_T_D: Tensor,
    key_B_Hk_S_D: Tensor,
    value_B_Hk_S_D: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function signature: the output as (B, T, Hq, D) and no weights."""
    unchanged = (
        attention_mask is None  # "sdpa" groups the heads itself then
        or query_B_Hq_T_D.shape[1] == key_B_Hk_S_D.shape[1]
        or query_B_Hq_T_D.shape[2] == 1
        or query_B_Hq_T_D.device.type != "cpu"
        or any(kwargs.get(name) is not None for name in SDPA_OPTIONS)
    )
    if unchanged:
        return sdpa_attention_forward(
            module,
            query_B_Hq_T_D,
            key_B_Hk_S_D,
            value_B_Hk_S_D,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    output_B_Hq_T_D = torch.nn.functional.scaled_dot_product_attention(
        query_B_Hq_T_D,
        key_B_Hk_S_D,
        value_B_Hk_S_D,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=True,
    )
    return output_B_Hq_T_D.transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)


def use_grouped_attention(model: PreTrainedModel) -> None:
    """Run `model`'s attention through "grouped_sdpa" where it runs through "sdpa" (a model on "eager",
    such as one with attention sinks, keeps it)."""
    if model.config._attn_implementation == "sdpa":  # noqa: SLF001  (transformers' own record of it)
        model.set_attn_implementation(GROUPED_SDPA)
