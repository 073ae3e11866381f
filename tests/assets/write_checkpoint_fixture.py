"""Writes the checkpoint fixture that `test_checkpoint_compat.py` loads with every later release.

    python tests/assets/write_checkpoint_fixture.py 0.1.0

A release that changes the checkpoint format adds a fixture (`checkpoint-<version>/`) and keeps the old
ones: each must still load and give the loss and counters recorded next to it (`expected.json`).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import workbench as wb

TEXT = "The quick brown fox jumps over the lazy dog. Two plus two is four."


def fixed_batch(tokenizer) -> list[wb.Datum]:
    """The batch every fixture records its loss on."""
    tokens = tokenizer(TEXT).input_ids
    return [
        wb.Datum(
            model_input=wb.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]}
        )
    ]


def write(version: str) -> Path:
    target = Path(__file__).parent / f"checkpoint-{version}"
    with (
        tempfile.TemporaryDirectory() as tmp,
        wb.Session(
            "tiny", wb.LoraConfig(rank=2), critic=True, seed=3, model_dir=Path(tmp) / "run", wandb=False
        ) as sess,
    ):
        batch = fixed_batch(sess.tokenizer)
        for _ in range(3):
            sess.policy.forward_backward(batch, "cross_entropy").result()
            sess.policy.optim_step(wb.AdamParams(learning_rate=1e-2)).result()
        saved = Path(sess.policy.save_state("fixture").result().path)
        expected = {
            "loss:sum": sess.policy.forward(batch, "cross_entropy").result().metrics["loss:sum"],
            "step": sess.policy.step,
            "weights_version": sess.policy.weights_version,
        }
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(saved, target)
    (target.parent / f"checkpoint-{version}.json").write_text(json.dumps(expected, indent=1) + "\n")
    return target


if __name__ == "__main__":
    print(write(sys.argv[1]))
