"""`optim_step`: apply a model's accumulated gradient with AdamW, every `AdamParams` field honoured.

The parameters are validated in the caller's thread (`to_adam_params`); the step runs on the worker in
submission order, so it applies exactly the gradient of the `forward_backward` calls submitted before it.
Right before the weights change, sampling clients pinned to the policy's current version keep a copy of
it (`WeightSnapshots.before_change`). The step's arithmetic and its refusals (nothing accumulated, a
non-finite gradient, a step that would leave non-finite weights or optimizer moments, undone) are
`TrainableAdapter.optim_step`'s.

The response's `metrics` carry only what the step measured (`grad_norm`), never keys a caller keeps
for itself (`step`, `learning_rate`): training loops merge them into their own metrics. The history
row also records the learning rate, whether the step was applied, each adapter module's gradient and
update norms when it was (`grad_norm/<layer>`, `update_norm/<layer>`: `TrainableAdapter.module_norms`)
and what the process uses (`system/...`: `workbench.engine.local.resource_use`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from workbench.engine.local.ranks import RankOp
from workbench.engine.local.state import EngineState
from workbench.engine.roles import Role
from workbench.futures import APIFuture
from workbench.sdk_conversion import to_adam_params
from workbench.types import AdamParams, OptimStepResponse


def submit(state: EngineState, model_id: str, role: Role, adam_params: Any) -> APIFuture[OptimStepResponse]:
    state.check_open()
    lora_model = state.lora_model(model_id)
    lora_model.role_adapter(role)
    params = to_adam_params(adam_params)
    lora_model.settings.note(role.value, "adam_params", dataclasses.asdict(params))
    return state.submit(
        lambda: run(state, model_id, role, params),
        mirror=lambda: RankOp("optim_step", (model_id, role, params)),
        beside_writes=True,
    )


def run(state: EngineState, model_id: str, role: Role, params: AdamParams) -> OptimStepResponse:
    lora_model = state.lora_model(model_id)
    model = lora_model.role_adapter(role)
    if model.trainable.pending_backward_calls:
        state.before_weights_change(lora_model, model)
    response = model.trainable.optim_step(params)
    history_metrics = {
        **response.metrics,
        "learning_rate": params.learning_rate,
        "applied": float(response.applied),
        **(model.trainable.module_norms if response.applied else {}),
        **state.resources.read(),
    }
    state.record("optim_step", lora_model, model.adapter, history_metrics)
    return response
