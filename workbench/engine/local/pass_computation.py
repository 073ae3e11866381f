"""What one pass of a built-in-loss call computes: the prediction, the loss, and when it trains, the gradient.

A pass is one planned micro-batch or stream chunk (`call_plan`). It is padded, run through the model (the
policy's or the reference's logprobs, or the critic's values; `predict`), through the loss, and, when
the pass trains, through `torch.autograd.grad` over the trainable parameters, so that each pass's
gradient is its own and the call adds them in pass order whatever stream finished first. A training
pass of one group over half the model's full-activation limit runs in parts
(`workbench.engine.model.prefix_parts`: the prefix once, then a few datums' suffixes at a time, each with
its loss and backward), so that it keeps less than a plain pass of its datums would.

What a pass gives back (`ChunkResult`) is detached: per-position outputs, cut back to each datum's length
in input order by `scatter_outputs`, and the sums that `MetricTotals` turns into `name:reduction`
metrics at the end of the call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from workbench.engine.local.call_plan import Pass, collate_pass, trained_positions
from workbench.engine.local.heap import release_freed_memory
from workbench.engine.local.lora_models import LoraModel
from workbench.engine.local.state import EngineState
from workbench.engine.model.batching import MicroBatch, PreparedDatum
from workbench.engine.model.prefix_parts import (
    add_gradients,
    checkpointed_prefix_layers,
    part_members,
    runs_in_parts,
)
from workbench.engine.model.shared_prefix import PrefixGroup, SharedPrefixMicroBatch, collate_shared
from workbench.engine.roles import Role
from workbench.losses import LossOutput, LossSpec
from workbench.types import TensorData


@dataclass
class MetricTotals:
    """Sums over the micro-batches of one call, turned into `name:reduction` metrics at the end."""

    loss: float = 0.0
    active_tokens: float = 0.0
    diagnostic_sums: dict[str, float] = field(default_factory=dict)

    def add(
        self, elementwise_loss_B_T: Tensor, active_B_T: Tensor, diagnostics: Mapping[str, Tensor]
    ) -> None:
        self.loss += float(elementwise_loss_B_T.detach().sum())
        active = active_B_T.float()
        self.active_tokens += float(active.sum())
        for name, values_B_T in diagnostics.items():
            total = float((values_B_T.detach().float() * active).sum())
            self.diagnostic_sums[name] = self.diagnostic_sums.get(name, 0.0) + total

    @classmethod
    def sum_of(cls, parts: Sequence[MetricTotals]) -> MetricTotals:
        """The totals of a call whose datums were split (over ranks): every sum added, so the means
        (sum over tokens / tokens) are the whole call's."""
        total = cls()
        for part in parts:
            total.loss += part.loss
            total.active_tokens += part.active_tokens
            for name, value in part.diagnostic_sums.items():
                total.diagnostic_sums[name] = total.diagnostic_sums.get(name, 0.0) + value
        return total

    def metrics(self, spec: LossSpec | None, with_loss: bool) -> dict[str, float]:
        metrics: dict[str, float] = {"num_tokens:sum": self.active_tokens}
        if with_loss:
            metrics["loss:sum"] = self.loss
        if self.active_tokens > 0:
            means = {name: total / self.active_tokens for name, total in self.diagnostic_sums.items()}
            if spec is not None and spec.summarize is not None and with_loss:
                means = spec.summarize(means)
            metrics.update(
                {f"{name}:mean": value for name, value in means.items() if not name.startswith("_")}
            )
        return metrics


def predict(
    state: EngineState,
    lora_model: LoraModel,
    role: Role,
    micro: MicroBatch,
    with_entropy: bool = False,
    trained_B_T: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The model's prediction for a micro-batch: the critic's values, or the targets' logprobs for the
    policy and the reference (and, when asked, the detached entropy of each next-token distribution),
    with autograd only at the positions `trained_B_T` marks (None: all; `trained_positions`)."""
    if role is Role.CRITIC:
        critic = lora_model.role_adapter(Role.CRITIC)
        assert critic.value_head is not None
        return state.model.values(critic.adapter, critic.value_head, micro), {}
    adapter = None if role is Role.REFERENCE else lora_model.policy.adapter
    logprobs_B_T, entropy_B_T = state.model.target_logprobs(adapter, micro, with_entropy, trained_B_T)
    return logprobs_B_T, {} if entropy_B_T is None else {"entropy": entropy_B_T}


@dataclass
class ChunkResult:
    """What one micro-batch (or stream chunk) of a built-in-loss pass gives back: its per-position
    outputs, what the metrics add up, and, when it trains, its gradient per trainable parameter."""

    micro: MicroBatch
    per_position: dict[str, Tensor]
    elementwise_loss_B_T: Tensor
    active_B_T: Tensor
    diagnostics: dict[str, Tensor]
    gradients: Sequence[Tensor | None] | None


def loss_result(
    micro: MicroBatch,
    spec: LossSpec,
    prediction_B_T: Tensor,
    extra: Mapping[str, Tensor],
    result: LossOutput,
    gradients: Sequence[Tensor | None] | None,
) -> ChunkResult:
    """A micro-batch's `ChunkResult` from its prediction and the loss's result (all detached)."""
    loss_B_T = result.elementwise_loss_B_T.detach()
    return ChunkResult(
        micro,
        {spec.head: prediction_B_T.detach(), "elementwise_loss": loss_B_T},
        loss_B_T,
        result.active_B_T,
        {name: values.detach() for name, values in {**extra, **result.diagnostics}.items()},
        gradients,
    )


def scatter_outputs(
    outputs: list[dict[str, TensorData]], micro: MicroBatch, per_position: Mapping[str, Tensor]
) -> None:
    """Cut each (B, T) or (B, T, K) tensor back into one (N_d,) or (N_d, K) `TensorData` per datum, in
    input order."""
    arrays = {name: tensor_B_T.detach().float().cpu().numpy() for name, tensor_B_T in per_position.items()}
    for row, index in enumerate(micro.indices):
        n = micro.lengths[row]
        for name, array_B_T in arrays.items():
            outputs[index][name] = TensorData(np.ascontiguousarray(array_B_T[row, :n]), "float32")


@dataclass(frozen=True)
class PassComputation:
    """What every pass of one built-in-loss call is computed with: the model under the role's adapter,
    the loss and its config, and the parameters a training pass differentiates (none for `forward`).
    Without `with_loss` (a critic `forward` given no returns), a pass gives only its predictions."""

    state: EngineState
    lora_model: LoraModel
    role: Role
    spec: LossSpec
    config: Mapping[str, float]
    with_loss: bool
    parameters: list[torch.nn.Parameter]
    kept: int  # `prefix_parts.kept_tokens`: a training pass of one group computing more runs in parts

    def run(self, batch: Sequence[PreparedDatum], unit: Pass, trains: bool) -> list[ChunkResult]:
        """One pass over the datums of `unit` (indices into `batch`): one result, or one per part."""
        spec = self.spec
        micro = collate_pass(self.state, batch, unit)
        if trains and isinstance(micro, SharedPrefixMicroBatch) and runs_in_parts(micro, self.kept):
            return self.run_in_parts(batch, micro)
        mask_B_T = micro.attention_mask_B_T.bool()
        with torch.set_grad_enabled(trains):
            trained_B_T = trained_positions(spec, micro) if trains else None
            prediction_B_T, extra = predict(
                self.state, self.lora_model, self.role, micro, spec.reports_entropy, trained_B_T
            )
            if not self.with_loss:
                return [
                    ChunkResult(
                        micro,
                        {spec.head: prediction_B_T},
                        torch.zeros_like(prediction_B_T),
                        mask_B_T,
                        extra,
                        None,
                    )
                ]
            result = spec.fn(prediction_B_T, micro.inputs, mask_B_T, self.config)
            gradients = (
                torch.autograd.grad(result.elementwise_loss_B_T.sum(), self.parameters, allow_unused=True)
                if trains
                else None
            )
        return [loss_result(micro, spec, prediction_B_T, extra, result, gradients)]

    def run_in_parts(
        self, batch: Sequence[PreparedDatum], micro: SharedPrefixMicroBatch
    ) -> list[ChunkResult]:
        """A shared pass of one group, trained in parts (`workbench.engine.model.prefix_parts`): the prefix
        once, each part's suffixes with their loss and backward, then the prefix's backward. One result per
        part; the last carries the whole pass's gradient."""
        state, spec, parameters, kept = self.state, self.spec, self.parameters, self.kept
        model = state.model
        critic = self.role is Role.CRITIC
        adapter = self.lora_model.role_adapter(self.role)
        head = adapter.value_head if critic else None
        group = micro.groups[0]
        suffix_length = micro.suffix_ids_R_S.shape[1]
        parts = part_members(len(group.indices), suffix_length, kept)
        part_tokens = len(parts[0]) * suffix_length
        prefix_tokens = micro.prefix_ids_P_L.numel()
        checkpointed = checkpointed_prefix_layers(prefix_tokens, part_tokens, kept, len(model.decoder_layers))
        with torch.enable_grad():
            with model.checkpointing_first(checkpointed):
                stage = model.prefix_stage(
                    adapter.adapter,
                    head,
                    micro,
                    spec.reports_entropy and not critic,
                    kept_positions=max(0, kept - part_tokens),
                    trained_B_T=None if critic else trained_positions(spec, micro),
                    in_parts=True,
                )
            release_freed_memory()  # what the prefix's pass freed
            totals: list[Tensor | None] = [None] * len(parameters)
            pieces = []
            for members in parts:
                indices = [group.indices[member] for member in members]
                sub = collate_shared(
                    batch,
                    [PrefixGroup(indices, group.prefix_length)],
                    state.tokenizer.pad_token_id,
                    state.device,
                )
                prediction_B_T, entropy_B_T = model.suffix_part(
                    adapter.adapter,
                    head,
                    stage,
                    sub,
                    members,
                    kept_positions=sub.suffix_ids_R_S.numel(),
                    trained_B_T=None if critic else trained_positions(spec, sub),
                )
                extra = {} if entropy_B_T is None else {"entropy": entropy_B_T}
                result = spec.fn(prediction_B_T, sub.inputs, sub.attention_mask_B_T.bool(), self.config)
                gradients = torch.autograd.grad(
                    result.elementwise_loss_B_T.sum(), [*parameters, *stage.leaves], allow_unused=True
                )
                add_gradients(totals, gradients[: len(parameters)])
                add_gradients(stage.leaf_gradients, gradients[len(parameters) :])
                pieces.append(loss_result(sub, spec, prediction_B_T, extra, result, None))
                del prediction_B_T, entropy_B_T, extra, result, gradients
                release_freed_memory()  # the part's activations, before the next part allocates its own
            add_gradients(totals, stage.backward(parameters))
        pieces[-1].gradients = totals
        return pieces
