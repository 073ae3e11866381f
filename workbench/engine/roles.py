"""What a training client speaks for: a run's policy, its critic, or the reference (the base model with
adapters off, forward only)."""

from __future__ import annotations

import enum


class Role(enum.StrEnum):
    POLICY = "policy"
    """The run's LoRA policy: predicts the logprobs of `target_tokens`; trains with the policy losses."""

    CRITIC = "critic"
    """The run's value model: its own LoRA adapter and a value head on the same frozen base."""

    REFERENCE = "reference"
    """The base model with every adapter off: the free reference policy for KL penalties."""
