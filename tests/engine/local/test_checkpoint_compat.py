"""Forward compatibility: every checkpoint fixture written by an earlier release (tests/assets) still
loads, with its critic, and gives the loss and counters recorded when it was written."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

import workbench as wb

ASSETS = Path(__file__).resolve().parents[2] / "assets"
sys.path.insert(0, str(ASSETS))
from write_checkpoint_fixture import fixed_batch  # noqa: E402

FIXTURES = sorted(p for p in ASSETS.glob("checkpoint-*") if p.is_dir())


def test_there_is_a_fixture() -> None:
    assert FIXTURES, "tests/assets holds no checkpoint fixture"


@pytest.mark.parametrize("fixture", FIXTURES, ids=lambda p: p.name)
def test_an_old_checkpoint_loads_and_reproduces_its_loss(fixture: Path, tmp_path: Path) -> None:
    expected = json.loads((ASSETS / f"{fixture.name}.json").read_text())
    copy = shutil.copytree(
        fixture, tmp_path / "run" / "checkpoints" / "fixture"
    )  # the session may write beside it
    with wb.Session.from_checkpoint(copy, wandb=False) as sess:
        assert sess.policy.step == expected["step"]
        assert sess.policy.weights_version == expected["weights_version"]
        assert sess.critic is not None
        batch = fixed_batch(sess.tokenizer)
        loss = sess.policy.forward(batch, "cross_entropy").result().metrics["loss:sum"]
        assert loss == pytest.approx(expected["loss:sum"], rel=1e-5)
        sess.policy.forward_backward(batch, "cross_entropy").result()
        assert sess.policy.optim_step(wb.AdamParams(learning_rate=1e-2)).result().applied
