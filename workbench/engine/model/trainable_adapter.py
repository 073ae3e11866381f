"""One trainable adapter (the policy's or the critic's): its parameters, its AdamW, its counters.

Gradients accumulate across `forward_backward` calls until `optim_step`, as in Tinker. Each call
computes its gradient apart from the ones already accumulated and adds it only when the whole call has
succeeded (`accumulating`), so a call that fails half-way leaves the accumulated gradient as it was. A
call whose gradient is not finite (NaN or inf), or whose finite gradient would make the sum overflow,
fails with `NonFiniteGradientError` naming the operation, and the gradient accumulated before it stays.

`optim_step` applies every `AdamParams` field on every call (torch's AdamW with decoupled weight decay,
global-norm clipping when `grad_clip_norm > 0`). The gradient norm never overflows for finite gradients
(`gradient_norm` switches to float64 when float32 could). The step refuses to run with no accumulated gradient, and is
undone (weights, optimizer state, counters and the accumulated gradient as they were) when it would
leave a non-finite weight or optimizer moment behind, e.g. a gradient near float32's maximum whose
square overflows Adam's second moment; its response says why. No step is reported applied that left a
non-finite number in the model's trainable state.

An applied step also measures the adapter layer by layer, `module_norms`: for each decoder layer (every
LoRA'd linear layer in it, A and B together; a module outside the layers, such as `lm_head`, on its own)
the L2 norm of its accumulated gradient before clipping, sqrt(Σ |grad|²) over its tensors, and of the
change the step made to its weights, sqrt(Σ |Δ|²). The whole adapter's `grad_norm` says that a step was
large; these say where (which layer's gradient vanished or exploded, which the step moved), in one value
per layer (smollm2-135m: 30 layers, not its 210 adapted modules). They cost one norm per tensor: the step
already keeps a copy of the weights it may undo.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from workbench.types import AdamParams, OptimStepResponse

# Below this largest element, float32 sums of squares stay below float32's maximum (3.4e38) for up to
# 1e14 elements, so the norm is computed in float32 like torch's; above it, in float64.
_FLOAT32_SAFE_NORM_ELEMENT = 1e12
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)

_ADAPTER_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?(?P<module>.+?)\.lora_[A-Za-z_]+\.")
"""peft's names of an adapter's tensors: `base_model.model.model.layers.0.self_attn.q_proj.lora_A.policy.
weight` is module `layers.0.self_attn.q_proj`'s."""


_LAYER = re.compile(r"^(?P<layer>(?:.+\.)?layers\.\d+)\.")
"""A module inside a decoder layer: `layers.0.self_attn.q_proj` is in layer `layers.0`."""


def adapter_module(tensor_name: str) -> str:
    """The part of the model an adapter tensor's norms are reported under: its decoder layer, named as in
    the base model without peft's wrapping (`layers.0`), or its module outside the layers (`lm_head`); a
    name of another form is its own part."""
    match = _ADAPTER_TENSOR.match(tensor_name)
    if not match:
        return tensor_name
    layer = _LAYER.match(match["module"] + ".")
    return layer["layer"] if layer else match["module"]


def modules_of(tensor_names: Sequence[str]) -> dict[str, list[int]]:
    """The positions in `tensor_names` of each module's tensors, modules in their first tensor's order."""
    modules: dict[str, list[int]] = {}
    for index, name in enumerate(tensor_names):
        modules.setdefault(adapter_module(name), []).append(index)
    return modules


def per_module_norms(norms: Sequence[float], modules: dict[str, list[int]]) -> dict[str, float]:
    """Each module's L2 norm from its tensors' norms: sqrt(sum of their squares)."""
    return {module: math.sqrt(sum(norms[i] ** 2 for i in indices)) for module, indices in modules.items()}


def tensor_norms(tensors: Sequence[Tensor | None]) -> list[float]:
    """The L2 norm of each tensor (0 for None), read back in one transfer: in float32, as torch computes
    norms, and again in float64 when a finite tensor's float32 norm overflowed (smollm2-135m's 420
    adapter tensors: 2.7 ms on one core in float32, 17 ms in float64)."""
    present = [t.detach() for t in tensors if t is not None]
    if not present:
        return [0.0] * len(tensors)
    norms = torch.stack([torch.linalg.vector_norm(t) for t in present]).tolist()
    if not all(math.isfinite(norm) for norm in norms):
        norms = torch.stack([torch.linalg.vector_norm(t, dtype=torch.float64) for t in present]).tolist()
    found = iter(norms)
    return [0.0 if t is None else next(found) for t in tensors]


class NonFiniteGradientError(FloatingPointError):
    """A `forward_backward` call's gradient is not finite (or overflows the accumulated gradient): the
    call's gradient was dropped and the gradient accumulated before it is unchanged."""


def all_finite(tensors: Sequence[Tensor]) -> bool:
    """True when no element of any tensor is NaN or infinite (one reduction over all of them)."""
    if not tensors:
        return True
    return bool(torch.isfinite(torch.nn.utils.get_total_norm(tensors, math.inf)))


def gradient_norm(gradients: Sequence[Tensor]) -> float:
    """The global L2 norm of the gradients, finite whenever every element is: in float32 as torch
    computes it, unless an element is so large that the float32 sum of squares could overflow, and then
    accumulated in float64 (whose range holds any sum of float32 squares)."""
    if not gradients:
        return 0.0
    largest = float(torch.nn.utils.get_total_norm(gradients, math.inf))
    if not math.isfinite(largest):
        return largest
    if largest < _FLOAT32_SAFE_NORM_ELEMENT:
        return float(torch.nn.utils.get_total_norm(gradients))
    norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in gradients])
    return float(torch.linalg.vector_norm(norms))


@dataclass
class _StepCheckpoint:
    """What `optim_step` puts back when it undoes a step."""

    weights: list[Tensor]
    optimizer_state: dict[Tensor, dict[str, Any]]
    settings: list[dict[str, Any]]
    gradients: list[Tensor | None] | None


class TrainableAdapter:
    """The trainable tensors of one adapter and the optimizer state that belongs to them."""

    def __init__(self, name: str, parameters: dict[str, nn.Parameter]):
        self.name = name
        self.parameters = parameters
        self.optimizer = self._fresh_optimizer()
        self.step = 0  # optimizer steps applied
        self.weights_version = 0  # bumped by every change of the weights
        self.pending_backward_calls = 0  # forward_backward calls accumulated since the last step
        self.modules = modules_of(list(parameters))
        """Each adapter module's tensors (their positions in `parameters`), for `module_norms`."""
        self.module_norms: dict[str, float] = {}
        """The last applied step's per-layer norms: `grad_norm/<layer>` (its accumulated gradient before
        clipping) and `update_norm/<layer>` (the change to its weights), see the module docstring."""

    def _fresh_optimizer(self) -> torch.optim.AdamW:
        """AdamW with no moments yet and `AdamParams`' defaults (every `optim_step` sets its own)."""
        defaults = AdamParams()
        return torch.optim.AdamW(
            list(self.parameters.values()),
            lr=defaults.learning_rate,
            betas=(defaults.beta1, defaults.beta2),
            eps=defaults.eps,
            weight_decay=defaults.weight_decay,
            foreach=False,
        )

    def reset_optimizer(self) -> None:
        """Start the optimizer afresh, as a new model's: no Adam moments (so the next step's bias
        correction is step 1's), default hyperparameters, and no accumulated gradient. What Tinker's
        weights-only `load_state` does to the client's optimizer ("weights only, optimizer resets").
        The step counter keeps counting the steps this adapter has applied."""
        self.optimizer = self._fresh_optimizer()
        self.clear_gradients()

    # ------------------------------------------------------------------------------------------ gradients

    @contextlib.contextmanager
    def accumulating(self, operation: str) -> Iterator[None]:
        """Run one forward_backward call (`operation` names it in errors): its gradient is added to the
        accumulated one on success, and discarded (accumulated gradient restored) on any failure,
        KeyboardInterrupt included, and when it is not finite or the sum would overflow
        (`NonFiniteGradientError`)."""
        previous = [param.grad for param in self.parameters.values()]
        for param in self.parameters.values():
            param.grad = None
        try:
            yield
            if not all_finite(self._gradients()):
                raise NonFiniteGradientError(
                    f"{operation} produced a non-finite gradient (NaN or inf): it was not added to the "
                    "accumulated gradient, which is as it was before this call"
                )
            for param, grad in zip(self.parameters.values(), previous, strict=True):
                if grad is not None:  # added into the call's own gradient: `previous` stays intact
                    param.grad = grad if param.grad is None else param.grad.add_(grad)
            if self.pending_backward_calls and not all_finite(self._gradients()):
                raise NonFiniteGradientError(
                    f"{operation} produced a finite gradient, but adding it to the accumulated one "
                    "overflows float32: it was not added, and the accumulated gradient is as it was before "
                    "this call (call optim_step first, or scale the loss down)"
                )
        except BaseException:
            for param, grad in zip(self.parameters.values(), previous, strict=True):
                param.grad = grad
            raise
        self.pending_backward_calls += 1

    def _gradients(self) -> list[Tensor]:
        return [param.grad for param in self.parameters.values() if param.grad is not None]

    def clear_gradients(self) -> None:
        for param in self.parameters.values():
            param.grad = None
        self.pending_backward_calls = 0

    def _checkpoint(self, with_gradients: bool) -> _StepCheckpoint:
        """Copies of what an optimizer step changes: weights, optimizer state and settings (and, when
        the step clips them in place, the gradients)."""
        with torch.no_grad():
            return _StepCheckpoint(
                weights=[param.detach().clone() for param in self.parameters.values()],
                optimizer_state={
                    param: {
                        key: value.clone() if isinstance(value, Tensor) else value
                        for key, value in state.items()
                    }
                    for param, state in self.optimizer.state.items()
                },
                settings=[
                    {key: value for key, value in group.items() if key != "params"}
                    for group in self.optimizer.param_groups
                ],
                gradients=[None if p.grad is None else p.grad.clone() for p in self.parameters.values()]
                if with_gradients
                else None,
            )

    def _restore(self, saved: _StepCheckpoint) -> None:
        with torch.no_grad():
            for param, weight in zip(self.parameters.values(), saved.weights, strict=True):
                param.copy_(weight)
        self.optimizer.state.clear()
        self.optimizer.state.update(saved.optimizer_state)
        for group, settings in zip(self.optimizer.param_groups, saved.settings, strict=True):
            group.update(settings)
        if saved.gradients is not None:
            for param, grad in zip(self.parameters.values(), saved.gradients, strict=True):
                param.grad = grad

    def _finite_state(self) -> bool:
        """No weight and no optimizer moment is NaN or infinite."""
        moments = [
            value
            for state in self.optimizer.state.values()
            for value in state.values()
            if isinstance(value, Tensor) and value.is_floating_point() and value.dim() > 0
        ]
        return all_finite([*self.parameters.values(), *moments])

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
        grad_norm = gradient_norm(self._gradients())
        if not math.isfinite(grad_norm):
            self.clear_gradients()
            return OptimStepResponse(
                metrics={"grad_norm": grad_norm},
                applied=False,
                skipped_reason=f"non-finite accumulated gradient (norm {grad_norm}); step skipped, weights and optimizer state unchanged",
            )
        clipping = params.grad_clip_norm > 0
        grad_norms = per_module_norms(
            tensor_norms([param.grad for param in self.parameters.values()]), self.modules
        )
        before = self._checkpoint(with_gradients=clipping)  # what an undone step puts back
        if clipping:
            # float32, as torch computes the norm, unless only float64 holds it
            norm_dtype = torch.float32 if grad_norm <= _FLOAT32_MAX else torch.float64
            torch.nn.utils.clip_grads_with_norm_(
                list(self.parameters.values()),
                params.grad_clip_norm,
                torch.tensor(grad_norm, dtype=norm_dtype),
            )
        for group in self.optimizer.param_groups:
            group["lr"] = params.learning_rate
            group["betas"] = (params.beta1, params.beta2)
            group["eps"] = params.eps
            group["weight_decay"] = params.weight_decay
        self.optimizer.step()
        if not self._finite_state():
            self._restore(before)
            return OptimStepResponse(
                metrics={"grad_norm": grad_norm},
                applied=False,
                skipped_reason=(
                    f"this step would leave non-finite weights or optimizer moments (gradient norm {grad_norm:.3g}, "
                    f"learning_rate {params.learning_rate:g}): it was undone, and the weights, optimizer state "
                    "and accumulated gradient are as they were. Clip the gradient (grad_clip_norm) or scale "
                    "the loss down, then step again"
                ),
            )
        with torch.no_grad():
            updates = tensor_norms(
                [
                    param - weight
                    for param, weight in zip(self.parameters.values(), before.weights, strict=True)
                ]
            )
        self.module_norms = {
            **{f"grad_norm/{module}": norm for module, norm in grad_norms.items()},
            **{
                f"update_norm/{module}": norm
                for module, norm in per_module_norms(updates, self.modules).items()
            },
        }
        self.clear_gradients()
        self.step += 1
        self.weights_version += 1
        return OptimStepResponse(metrics={"grad_norm": grad_norm})
