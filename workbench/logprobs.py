"""Per-token log-probabilities from a language model's logits.

Shared by training (the loss inputs) and sampling (prompt logprobs), so that both compute the same
number the same way: log_softmax in fp32, then a gather of the target ids.
"""

from __future__ import annotations

import torch
from torch import Tensor


def target_logprobs(
    logits_B_T_V: Tensor, targets_B_T: Tensor, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """log p(target_t | prefix) for every position and, when asked, the entropy of each next-token
    distribution, H_t = −Σ_v p_v log p_v.

    The logprobs carry gradients; the entropy is a diagnostic and does not. It costs a pass over the
    (B, T, V) distribution (a few percent of a training step), so only the losses that report it ask.
    """
    logprobs_B_T_V = torch.log_softmax(logits_B_T_V.float(), dim=-1)
    logprobs_B_T = logprobs_B_T_V.gather(-1, targets_B_T.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logprobs_B_T, None
    with torch.no_grad():
        entropy_B_T = -torch.einsum("btv,btv->bt", logprobs_B_T_V.exp(), logprobs_B_T_V)
    return logprobs_B_T, entropy_B_T
