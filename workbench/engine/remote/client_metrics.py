"""The metrics of a forward pass computed here when the service leaves them out.

The Tinker protocol's `forward`/`forward_backward` results carry `metrics`, but what is in them is the
service's choice: SkyRL's Tinker server sends none. Everything workbench plots and logs needs
`loss:sum` and `num_tokens:sum`, so a remote engine fills them in from what every service returns,
with the local engine's definitions (`workbench.losses`):

    loss:sum       = Σ_datum Σ_t elementwise_loss[t]        (the per-token losses already weighted)
    num_tokens:sum = Σ_datum #{t : w_t ≠ 0}                  (w: `weights`, else `advantages`)

A metric the service did report is kept as it sent it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from workbench.types import Datum, TensorData

TOKEN_WEIGHT_KEYS = ("weights", "advantages")
"""The loss input whose non-zero entries mark the tokens a loss counts: `weights` for cross-entropy,
`advantages` for the policy-gradient losses."""


def counted_tokens(datum: Datum) -> int:
    """The tokens the datum's loss counts (its non-zero weights or advantages; else every target)."""
    for key in TOKEN_WEIGHT_KEYS:
        if key in datum.loss_fn_inputs:
            return int(np.count_nonzero(datum.loss_fn_inputs[key].array))
    return int(datum.loss_fn_inputs["target_tokens"].array.size)


def with_client_metrics(
    metrics: Mapping[str, float], outputs: Sequence[Mapping[str, TensorData]], data: Sequence[Datum]
) -> dict[str, float]:
    """`metrics`, plus `loss:sum` (from the outputs' `elementwise_loss`) and `num_tokens:sum` (from the
    data) where the service left them out."""
    completed = dict(metrics)
    if "loss:sum" not in completed and all("elementwise_loss" in output for output in outputs):
        completed["loss:sum"] = float(
            sum(output["elementwise_loss"].array.sum(dtype=np.float64) for output in outputs)
        )
    if "num_tokens:sum" not in completed:
        completed["num_tokens:sum"] = float(sum(counted_tokens(datum) for datum in data))
    return completed
