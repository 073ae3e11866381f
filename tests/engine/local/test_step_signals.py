"""optim_step's signals over time: each adapter layer's gradient and update norms, and what the process
uses, in the step's history row (so in history.jsonl and W&B), checked against the tensors by hand."""

from __future__ import annotations

import math
from collections import defaultdict

import psutil
import pytest
import torch

import workbench as wb
from tests.datums import sft_datum


def _module(tensor_name: str) -> str:
    """peft's `base_model.model.model.layers.0.self_attn.q_proj.lora_A.policy.weight` -> `layers.0` (its
    decoder layer), spelled out again here as the test's own reading of the names."""
    parts = tensor_name.split(".")
    lora = next(i for i, part in enumerate(parts) if part.startswith("lora_"))
    parts = parts[:lora]
    if parts[:2] == ["base_model", "model"]:
        parts = parts[2:]
    if parts[:1] == ["model"]:
        parts = parts[1:]
    if parts[0] == "layers":
        parts = parts[:2]
    return ".".join(parts)


def _by_module(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    """sqrt(sum over a module's tensors of |t|²), by module."""
    squares: dict[str, float] = defaultdict(float)
    for name, tensor in tensors.items():
        squares[_module(name)] += float(tensor.double().pow(2).sum())
    return {module: math.sqrt(total) for module, total in squares.items()}


@pytest.mark.parametrize("clip", [0.0, 1e-3])
def test_each_adapter_layer_gets_its_gradient_and_update_norm(tiny: wb.Session, clip: float) -> None:
    data = [
        sft_datum(tiny.tokenizer, "User: Hello!", " Assistant: Hi there."),
        sft_datum(tiny.tokenizer, "The quick brown fox", " jumps over the lazy dog."),
    ]
    for step in range(2):  # the first step moves only B (A's gradient is 0 while B is 0); the second both
        tiny.policy.forward_backward(data, "cross_entropy").result()
        inspected = tiny.engine.inspect(tiny.model_id, wb.Role.POLICY)
        before = {name: p.detach().clone() for name, p in inspected.parameters.items()}
        gradients = {name: g.detach().clone() for name, g in inspected.gradients.items() if g is not None}
        response = tiny.policy.optim_step(wb.AdamParams(learning_rate=1e-2, grad_clip_norm=clip)).result()
        assert response.applied
        after = tiny.engine.inspect(tiny.model_id, wb.Role.POLICY).parameters
        row = tiny.history.rows[-1]
        assert (row["op"], row["step"]) == ("optim_step", step + 1)

        expected_grad = _by_module(gradients)
        expected_update = _by_module({name: after[name].detach() - before[name] for name in before})
        layers = tiny.engine.base_info.num_layers
        assert {m for m in expected_grad if m.startswith("layers.")} == {f"layers.{k}" for k in range(layers)}
        assert {k for k in row if k.startswith("grad_norm/")} == {f"grad_norm/{m}" for m in expected_grad}
        assert {k for k in row if k.startswith("update_norm/")} == {
            f"update_norm/{m}" for m in expected_update
        }
        for module, norm in expected_grad.items():
            assert row[f"grad_norm/{module}"] == pytest.approx(norm, rel=1e-5)  # before clipping
        for module, norm in expected_update.items():
            assert row[f"update_norm/{module}"] == pytest.approx(norm, rel=1e-5, abs=1e-12)
        # the modules' gradient norms make up the global one
        assert math.sqrt(sum(n**2 for n in expected_grad.values())) == pytest.approx(
            response.metrics["grad_norm"], rel=1e-5
        )
        assert max(expected_update.values()) > 0
        assert set(response.metrics) == {"grad_norm"}  # the SDK's response keeps Tinker's keys


def test_a_skipped_step_records_no_module_norms(tiny: wb.Session) -> None:
    tiny.policy.optim_step(wb.AdamParams(learning_rate=1e-2)).result()  # nothing accumulated
    row = tiny.history.rows[-1]
    assert row["applied"] == 0.0
    assert not any(k.startswith(("grad_norm/", "update_norm/")) for k in row)


def test_each_step_records_what_the_process_uses(tiny: wb.Session) -> None:
    data = [sft_datum(tiny.tokenizer, "User: Hello!", " Assistant: Hi there.")]
    rows = []
    for _ in range(3):
        tiny.policy.forward_backward(data, "cross_entropy").result()
        tiny.policy.optim_step(wb.AdamParams(learning_rate=1e-2)).result()
        rows.append(tiny.history.rows[-1])
    rss_mb = psutil.Process().memory_info().rss / 2**20
    cores = psutil.cpu_count() or 1
    for row in rows:
        # the kernel's own reading of this process's memory, within what a few steps allocate
        assert 0.5 * rss_mb < row["system/rss_mb"] < 2 * rss_mb
        # no more than every core's time (the kernel counts CPU time in ticks of 10 ms: a margin)
        assert 0.0 <= row["system/cpu_percent"] <= 100.0 * cores * 1.5
    assert sum(row["system/cpu_percent"] for row in rows) > 0  # the worker computed between the steps
    cuda = [k for k in rows[0] if k.startswith("system/cuda")]
    assert cuda == (
        ["system/cuda_allocated_mb", "system/cuda_reserved_mb", "system/cuda_peak_mb"]
        if tiny.engine.device.type == "cuda"
        else []
    )


def test_a_module_norm_that_overflows_float32_is_computed_in_float64() -> None:
    from workbench.engine.model.trainable_adapter import tensor_norms

    big = torch.full((2,), 3e38)  # each element finite in float32, the norm 4.2e38 is not
    assert not math.isfinite(float(torch.linalg.vector_norm(big)))
    assert tensor_norms([torch.ones(4), None, big]) == pytest.approx(
        [2.0, 0.0, math.sqrt(2) * 3e38], rel=1e-6
    )
