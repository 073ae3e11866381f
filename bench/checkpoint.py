"""Checkpoint cost: save and load time and bytes on disk for a LoRA policy with its AdamW state.

After one training step (so AdamW's moments exist), the session's state is saved with `save_state`,
loaded back into the same session with `Session.load_state` (everything: weights, optimizer state,
counters, RNGs) and with Tinker's `TrainingClient.load_state` (the weights only), and into a new one with
`Session.from_checkpoint` (which also builds the session: the time of a plain `Session(...)` is shown
beside it). Each time is the
median of `--repeats` runs. A checkpoint holds adapters only, never base weights, so its size must stay
within 3.5x the adapter's (weights + two Adam moments + small JSON/RNG files) plus 1 MB:
ratio = bytes / (3.5 x adapter bytes + 1 MB) <= 1.

    python bench/checkpoint.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import workbench as wb


def timed(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    model_dir = Path(tempfile.mkdtemp(prefix="bench-checkpoint-")) / "run"
    sess = wb.Session(args.model, wb.LoraConfig(rank=args.rank), model_dir=model_dir, wandb=False)
    tokens = list(range(10, 138))
    data = [wb.Datum(model_input=tokens[:-1], loss_fn_inputs={"target_tokens": tokens[1:]})] * 4
    sess.policy.forward_backward(data, "cross_entropy").result()
    sess.policy.optim_step(wb.AdamParams(learning_rate=1e-4)).result()

    save_s = timed(lambda: sess.policy.save_state("bench", overwrite=True).result(), args.repeats)
    path = Path(sess.policy.save_state("bench", overwrite=True).result().folder)
    load_same_s = timed(lambda: sess.load_state(path), args.repeats)
    load_weights_s = timed(lambda: sess.policy.load_state(path).result(), args.repeats)
    new_session_s = timed(
        lambda: wb.Session(
            args.model, wb.LoraConfig(rank=args.rank), model_dir=model_dir.parent / "plain", wandb=False
        ).close(),
        args.repeats,
    )
    load_fresh_s = timed(lambda: wb.Session.from_checkpoint(path, wandb=False).close(), args.repeats)

    files = {p.relative_to(path).as_posix(): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file()}
    total = sum(files.values())
    adapter = files["policy/adapter_model.safetensors"]
    budget = 3.5 * adapter + 2**20
    params = sum(p.numel() for p in sess.engine.inspect(sess.model_id, wb.Role.POLICY).parameters.values())
    sess.close()

    print(
        f"model={args.model} rank={args.rank} adapter parameters={params:,} (fp32), median of {args.repeats}"
    )
    print(f"{'measure':38s} {'value':>12s}")
    print(f"{'save_state':38s} {save_s:11.3f}s")
    print(f"{'load_state (same session)':38s} {load_same_s:11.3f}s")
    print(f"{'  policy.load_state (weights only)':38s} {load_weights_s:11.3f}s")
    print(f"{'Session.from_checkpoint (new session)':38s} {load_fresh_s:11.3f}s")
    print(f"{'  of which Session(...) alone':38s} {new_session_s:11.3f}s")
    print(f"{'adapter bytes':38s} {adapter:12,d}")
    print(f"{'checkpoint bytes':38s} {total:12,d}")
    for rel, size in files.items():
        print(f"{'  ' + rel:38s} {size:12,d}")
    print(f"ratio bytes / (3.5 x adapter + 1 MB) = {total / budget:.3f} (target <= 1)")


if __name__ == "__main__":
    main()
