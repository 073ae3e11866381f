"""The critic: a value model that costs one LoRA adapter and a linear head, not a second model.

The critic reads the same frozen base weights as the policy, through its own peft adapter, and maps the
decoder's last hidden state at every position to a scalar: V_t, the value of the state after reading
`model_input[:t+1]`, aligned with the policy's logprobs (position t predicts `target_tokens[t]`). It
trains with the `ppo_critic` loss and its own AdamW. The policy's adapter is inactive while the critic
runs, so neither disturbs the other.

The value head starts at zero, so every value starts at 0: a neutral baseline, the same on every machine.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from workbench.types import LoraConfig


class ValueHead(nn.Module):
    """A linear map from the hidden size to one value, computed in fp32 whatever the model's dtype."""

    def __init__(self, hidden_size: int, device: torch.device):
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1, device=device, dtype=torch.float32)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden_B_T_H: Tensor) -> Tensor:
        return self.linear(hidden_B_T_H.float()).squeeze(-1)


def default_critic_lora(policy: LoraConfig) -> LoraConfig:
    """The critic's adapter when none is given: the policy's rank and alpha on attention and MLP layers
    (the output embedding is not part of the value computation)."""
    return LoraConfig(
        rank=policy.rank, alpha=policy.alpha, train_attn=True, train_mlp=True, train_unembed=False
    )
