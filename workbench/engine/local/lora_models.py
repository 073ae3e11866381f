"""A training run: one Tinker model on the engine, its policy and optional critic, and its folder.

Tinker calls it a model (`model_id`) and a training run (`training_run_id`); they are the same id, and
here it is also the name of the run's folder, where its history, checkpoints (`checkpoints/`) and
sampler weights (`sampler_weights/`) live, so `tinker://<model_id>/weights/<name>` names
`<run_dir>/checkpoints/<name>`.

A run's models are trainable adapters on the engine's shared base: `TrainedModel` pairs one peft
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
from workbench.types import LoraConfig


def adapter_name(role: Role, run_number: int) -> str:
    """The peft adapter name of `role` in the engine's `run_number`-th run: `policy` and `critic` for the
    first run, `policy_2`, `critic_2`, ... for later ones. Also the history's `model` column."""
    return role.value if run_number == 1 else f"{role.value}_{run_number}"


@dataclass
class TrainedModel:
    """One trainable adapter of a run: the policy's or the critic's."""

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
class TrainingRun:
    """One Tinker model: a policy, maybe a critic, and the folder its files go to."""

    model_id: str
    number: int  # the engine's n-th run: names its adapters (`adapter_name`)
    run_dir: Path
    seed: int
    policy: TrainedModel
    snapshots: WeightSnapshots
    critic: TrainedModel | None = None
    user_metadata: dict[str, str] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)

    def model(self, role: Role) -> TrainedModel:
        """The run's trainable model for `role`; a clear error when the run has none."""
        if role is Role.POLICY:
            return self.policy
        if role is Role.CRITIC:
            if self.critic is None:
                raise ValueError(f"run {self.model_id!r} has no critic: create one with create_critic()")
            return self.critic
        raise ValueError(f"the {role} is not trainable")

    def models(self) -> list[TrainedModel]:
        return [self.policy] if self.critic is None else [self.policy, self.critic]

    @property
    def step(self) -> int:
        """The policy's optimizer steps: the x-axis of the run's history."""
        return self.policy.step
