"""`optim_step`: apply a model's accumulated gradient with AdamW, every `AdamParams` field honoured.

The parameters are validated in the caller's thread (`to_adam_params`); the step runs on the worker in
submission order, so it applies exactly the gradient of the `forward_backward` calls submitted before it.
Right before the weights change, sampling clients pinned to the policy's current version keep a copy of
it (`WeightSnapshots.before_change`). The step's arithmetic and its refusals (nothing accumulated, a
step that would leave non-finite weights or optimizer moments, undone) are `TrainableAdapter.optim_step`'s.
"""

from __future__ import annotations

from typing import Any

from workbench.engine.roles import Role
from workbench.engine.state import EngineState
from workbench.futures import APIFuture
from workbench.metrics import ROW_COLUMNS
from workbench.types import AdamParams, OptimStepResponse, to_adam_params


def submit(state: EngineState, model_id: str, role: Role, adam_params: Any) -> APIFuture[OptimStepResponse]:
    state.check_open()
    state.run(model_id).model(role)
    params = to_adam_params(adam_params)
    return state.submit(lambda: run(state, model_id, role, params))


def run(state: EngineState, model_id: str, role: Role, params: AdamParams) -> OptimStepResponse:
    training_run = state.run(model_id)
    model = training_run.model(role)
    if model.trainable.pending_backward_calls:
        state.before_weights_change(training_run, model)
    response = model.trainable.optim_step(params)
    # The response's `step` metric is this model's step count; the row's own `step` column is the
    # policy's, the x-axis every row shares, so the metric stays out of the row.
    row = {name: value for name, value in response.metrics.items() if name not in ROW_COLUMNS}
    state.record("optim_step", training_run, model.adapter, row)
    return response
