"""A sweep on a session of two devices (two CPU ranks over gloo): each member trains data-parallel over
both, and ends equal to the same sweep on one device within 1e-5 relative."""

from __future__ import annotations

from pathlib import Path

import torch

import workbench as wb
from tests.notebook.test_run_checkpoints import sft_step

WAIT_S = 120.0
STEPS = 2
RELATIVE = 1e-5
CONFIGS = [{"learning_rate": 1e-2, "seed": 0}, {"learning_rate": 3e-3, "seed": 1}]


def _swept(folder: Path, devices: int | None) -> list[tuple[dict[str, torch.Tensor], list[float]]]:
    """Each member's adapter tensors and its losses, after the sweep."""
    with wb.Session(
        "tiny", wb.LoraConfig(rank=4), seed=0, threads=1, model_dir=folder, wandb=False, devices=devices
    ) as sess:
        sweep = sess.sweep(sft_step, CONFIGS, STEPS)
        assert sweep.wait(WAIT_S) is wb.RunState.FINISHED, [m.traceback for m in sweep.members]
        assert all(m.i == STEPS and m.step == STEPS for m in sweep.members)
        return [
            (
                {name: t.clone() for name, t in sess.engine.inspect(m.model_id).parameters.items()},
                m.history.series("loss:sum")[1],
            )
            for m in sweep.members
        ]


def test_each_member_of_a_sweep_on_two_devices_equals_one_device(tmp_path: Path) -> None:
    two = _swept(tmp_path / "two", devices=2)
    one = _swept(tmp_path / "one", devices=None)
    for k, ((two_weights, two_losses), (one_weights, one_losses)) in enumerate(zip(two, one, strict=True)):
        assert two_weights.keys() == one_weights.keys() and len(one_losses) == STEPS
        for name, expected in one_weights.items():
            scale = max(float(expected.abs().max()), 1e-6)
            assert float((two_weights[name] - expected).abs().max()) <= RELATIVE * scale, (k, name)
        for mine, theirs in zip(two_losses, one_losses, strict=True):
            assert abs(mine - theirs) <= RELATIVE * max(abs(theirs), 1e-6), (k, mine, theirs)
    # the members differ from each other by far more than the tolerance: the comparison can fail
    first, second = (list(weights.values()) for weights, _ in one)
    assert max(float((a - b).abs().max()) for a, b in zip(first, second, strict=True)) > 1e-3
