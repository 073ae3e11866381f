"""One trainable adapter (the policy's or the critic's): its parameters, its AdamW, its counters.

Gradients accumulate across `forward_backward` calls until `optim_step`, as in Tinker. Each call
computes its gradient apart from the ones already accumulated and adds it only when the whole call has
succeeded (`accumulating`), so a call that fails half-way leaves the accumulated gradient as it was.

`optim_step` applies every `AdamParams` field on every call (torch's AdamW with decoupled weight decay,
global-norm clipping when `grad_clip_norm > 0`). It refuses to step with no accumulated gradient, and
skips a step whose gradient is not finite: weights, optimizer state and counters stay as they were and
the bad gradient is dropped.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator

import torch
from torch import nn

from workbench.types import AdamParams, OptimStepResponse


class TrainableAdapter:
    """The trainable tensors of one adapter and the optimizer state that belongs to them."""

    def __init__(self, name: str, parameters: dict[str, nn.Parameter]):
        self.name = name
        self.parameters = parameters
        defaults = AdamParams()
        self.optimizer = torch.optim.AdamW(
            list(parameters.values()),
            lr=defaults.learning_rate,
            betas=(defaults.beta1, defaults.beta2),
            eps=defaults.eps,
            weight_decay=defaults.weight_decay,
            foreach=False,
        )
        self.step = 0  # optimizer steps applied
        self.weights_version = 0  # bumped by every change of the weights
        self.pending_backward_calls = 0  # forward_backward calls accumulated since the last step

    # ------------------------------------------------------------------------------------------ gradients

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Run one forward_backward call: its gradient is added to the accumulated one on success, and
        discarded (accumulated gradient restored) on any failure, KeyboardInterrupt included."""
        previous = [param.grad for param in self.parameters.values()]
        for param in self.parameters.values():
            param.grad = None
        try:
            yield
        except BaseException:
            for param, grad in zip(self.parameters.values(), previous, strict=True):
                param.grad = grad
            raise
        for param, grad in zip(self.parameters.values(), previous, strict=True):
            if grad is not None:
                param.grad = grad if param.grad is None else grad.add_(param.grad)
        self.pending_backward_calls += 1

    def clear_gradients(self) -> None:
        for param in self.parameters.values():
            param.grad = None
        self.pending_backward_calls = 0

    def update_digest(self, digest: hashlib._Hash) -> None:
        """Feed every bit of this adapter's trainable state into `digest`: weights, accumulated
        gradients, optimizer moments and step counts, and the counters."""
        digest.update(
            f"{self.name}:{self.step}:{self.weights_version}:{self.pending_backward_calls}".encode()
        )
        for index, (name, param) in enumerate(self.parameters.items()):
            digest.update(name.encode())
            digest.update(param.detach().cpu().contiguous().numpy().tobytes())
            grad = param.grad
            digest.update(b"no-grad" if grad is None else grad.detach().cpu().contiguous().numpy().tobytes())
            for key, value in sorted(self.optimizer.state.get(param, {}).items()):
                digest.update(f"{index}:{key}".encode())
                digest.update(value.detach().cpu().contiguous().numpy().tobytes())
        for group in self.optimizer.param_groups:
            digest.update(repr({k: v for k, v in group.items() if k != "params"}).encode())

    # ------------------------------------------------------------------------------------------ step

    def optim_step(self, params: AdamParams) -> OptimStepResponse:
        """Apply the accumulated gradient. The response's metrics hold the gradient norm (before
        clipping) when there was a gradient; `applied` and `skipped_reason` say whether the step ran."""
        if self.pending_backward_calls == 0:
            return OptimStepResponse(
                metrics={},
                applied=False,
                skipped_reason="no gradient accumulated: call forward_backward before optim_step",
            )
        grads = [param.grad for param in self.parameters.values() if param.grad is not None]
        grad_norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        if not math.isfinite(grad_norm):
            self.clear_gradients()
            return OptimStepResponse(
                metrics={"grad_norm": grad_norm},
                applied=False,
                skipped_reason=f"non-finite gradient norm ({grad_norm}); step skipped, weights and optimizer state unchanged",
            )
        if params.grad_clip_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(
                list(self.parameters.values()), params.grad_clip_norm, torch.tensor(grad_norm)
            )
        for group in self.optimizer.param_groups:
            group["lr"] = params.learning_rate
            group["betas"] = (params.beta1, params.beta2)
            group["eps"] = params.eps
            group["weight_decay"] = params.weight_decay
        self.optimizer.step()
        self.clear_gradients()
        self.step += 1
        self.weights_version += 1
        return OptimStepResponse(metrics={"grad_norm": grad_norm})
