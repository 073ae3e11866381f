"""A LoRA model: one Tinker model on the engine, its policy and optional critic, and its folder.

Tinker calls it a model (`model_id`) and a training run (`training_run_id`); they are the same id, and
here it is also the name of the model's folder, where its history, checkpoints (`checkpoints/`) and
sampler weights (`sampler_weights/`) live, so `tinker://<model_id>/weights/<name>` names
`<model_dir>/checkpoints/<name>`.

A model's policy and critic are trainable adapters on the engine's shared base: `RoleAdapter` pairs one peft
adapter with its optimizer and counters (`TrainableAdapter`) and, for a critic, its value head. The
policy's weight versions are what sampling clients pin (`WeightSnapshots`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from workbench.engine.model.trainable_adapter import TrainableAdapter
from workbench.engine.model.value_head import ValueHead
from workbench.engine.model.weight_versions import WeightSnapshots
from workbench.engine.roles import Role
from workbench.storage.run_description import RunSettings
from workbench.types import LoraConfig


def adapter_name(role: Role, model_number: int) -> str:
    """The peft adapter name of `role` in the engine's `model_number`-th model: `policy` and `critic` for
    the first model, `policy_2`, `critic_2`, ... for later ones. Also the history's `model` column."""
    return role.value if model_number == 1 else f"{role.value}_{model_number}"


@dataclass
class RoleAdapter:
    """The adapter that plays one role in a model, the policy or the critic, with its optimizer and
    counters (and the critic's value head)."""

    role: Role
    adapter: str  # the peft adapter's name; also the `model` column of the history rows
    lora: LoraConfig
    trainable: TrainableAdapter
    value_head: ValueHead | None = None  # the critic's

    @property
    def step(self) -> int:
        return self.trainable.step

    @property
    def weights_version(self) -> int:
        return self.trainable.weights_version


@dataclass
class LoraModel:
    """One Tinker model: a policy, maybe a critic, and the folder its files go to."""

    model_id: str
    number: int  # the engine's n-th model: names its adapters (`adapter_name`)
    model_dir: Path
    seed: int
    policy: RoleAdapter
    snapshots: WeightSnapshots
    critic: RoleAdapter | None = None
    # the policy version every inflight sampling client samples (Tinker's shared inflight target): set
    # by the last inflight save, pinned in `snapshots` once for all of them; None before the first
    inflight_version: int | None = None
    user_metadata: dict[str, str] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)
    settings: RunSettings = field(init=False)
    """The AdamParams and loss each role trains with, kept in the folder's `settings.json`."""

    def __post_init__(self) -> None:
        self.settings = RunSettings(self.model_dir)

    def role_adapter(self, role: Role) -> RoleAdapter:
        """The model's adapter for `role`; a clear error when the model has none."""
        if role is Role.POLICY:
            return self.policy
        if role is Role.CRITIC:
            if self.critic is None:
                raise ValueError(f"model {self.model_id!r} has no critic: create one with create_critic()")
            return self.critic
        raise ValueError(f"the {role} is not trainable")

    def role_adapters(self) -> list[RoleAdapter]:
        return [self.policy] if self.critic is None else [self.policy, self.critic]

    @property
    def step(self) -> int:
        """The policy's optimizer steps: the x-axis of the model's history."""
        return self.policy.step
