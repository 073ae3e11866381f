"""What the checkpoint tests run in a fresh process, and the steps both sides of a resume take.

python checkpoint_child.py resume <checkpoint> <out_dir> <steps>   # from_checkpoint, then `continue_run`
python checkpoint_child.py killed-save <model_dir>           # save "a", then SIGKILL itself mid-save of "b"
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
from pathlib import Path

import numpy as np
import safetensors.torch
import torch

import workbench as wb

PROMPT = "The quick brown fox"


def train_step(sess: wb.Session) -> float:
    tokens = sess.tokenizer("The quick brown fox jumps over the lazy dog. Two plus two is four.").input_ids
    datum = wb.Datum(
        model_input=wb.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]}
    )
    loss = sess.policy.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
    sess.policy.optim_step(wb.AdamParams(learning_rate=1e-2)).result()
    return loss


def continue_run(sess: wb.Session, steps: int, out_dir: Path) -> None:
    """K training steps, then a temperature-1 sample and one draw from each global RNG; the losses,
    tokens and draws go to `out_dir/result.json`, the adapter tensors to `out_dir/adapter.safetensors`."""
    losses = [train_step(sess) for _ in range(steps)]
    sample = (
        sess.sampling_client()
        .sample(
            prompt=wb.ModelInput.from_ints(sess.tokenizer(PROMPT).input_ids),
            num_samples=4,
            sampling_params=wb.SamplingParams(max_tokens=8, temperature=1.0),
        )
        .result()
    )
    result = {
        "losses": losses,
        "tokens": [list(sequence.tokens) for sequence in sample.sequences],
        "draws": [random.random(), float(np.random.rand()), float(torch.rand(1))],
        "step": sess.step,
        "weights_version": sess.policy.weights_version,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "result.json").write_text(json.dumps(result))
    tensors = sess.engine.inspect(sess.model_id, wb.Role.POLICY).parameters
    safetensors.torch.save_file(tensors, out_dir / "adapter.safetensors")


def killed_save(model_dir: Path) -> None:
    from workbench.storage import checkpoint_store

    sess = wb.Session("tiny", wb.LoraConfig(rank=4), model_dir=model_dir, wandb=False)
    train_step(sess)
    sess.policy.save_state("a").result()
    train_step(sess)
    real_write = checkpoint_store.write_file
    writes: list[Path] = []

    def write_then_die(path: Path, data: bytes) -> None:
        writes.append(path)
        if len(writes) == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        real_write(path, data)

    checkpoint_store.write_file = write_then_die
    sess.policy.save_state("b").result()


if __name__ == "__main__":
    if sys.argv[1] == "resume":
        with wb.Session.from_checkpoint(sys.argv[2], wandb=False) as resumed:
            continue_run(resumed, int(sys.argv[4]), Path(sys.argv[3]))
    elif sys.argv[1] == "killed-save":
        killed_save(Path(sys.argv[2]))
