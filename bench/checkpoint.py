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

from contention import quiet_and_contended  # bench/contention.py, beside this script

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

    path = Path(sess.policy.save_state("bench", overwrite=True).result().folder)

    def measure() -> dict[str, float]:
        """Median seconds of each save and load."""
        return {
            "save_state": timed(
                lambda: sess.policy.save_state("bench", overwrite=True).result(), args.repeats
            ),
            "load_state (same session)": timed(lambda: sess.load_state(path), args.repeats),
            "  policy.load_state (weights only)": timed(
                lambda: sess.policy.load_state(path).result(), args.repeats
            ),
            "Session.from_checkpoint (new session)": timed(
                # its own folder: the checkpoint's is held by `sess`, which is still open
                lambda: wb.Session.from_checkpoint(
                    path, model_dir=model_dir.parent / "continued", wandb=False
                ).close(),
                args.repeats,
            ),
            "  of which Session(...) alone": timed(
                lambda: wb.Session(
                    args.model,
                    wb.LoraConfig(rank=args.rank),
                    model_dir=model_dir.parent / "plain",
                    wandb=False,
                ).close(),
                args.repeats,
            ),
        }

    both = quiet_and_contended(measure)
    files = {p.relative_to(path).as_posix(): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file()}
    total = sum(files.values())
    adapter = files["policy/adapter_model.safetensors"]
    budget = 3.5 * adapter + 2**20
    params = sum(p.numel() for p in sess.engine.inspect(sess.model_id, wb.Role.POLICY).parameters.values())
    sess.close()

    print(
        f"model={args.model} rank={args.rank} adapter parameters={params:,} (fp32), median of {args.repeats}"
    )
    print(f"{'measure':38s} {'quiet':>12s} {'contended':>12s} {'contended / quiet':>18s}")
    for name, quiet_s in both.quiet.items():
        busy_s = both.contended[name]
        print(f"{name:38s} {quiet_s:11.3f}s {busy_s:11.3f}s {busy_s / quiet_s:17.2f}x")
    print(f"{'adapter bytes':38s} {adapter:12,d}")
    print(f"{'checkpoint bytes':38s} {total:12,d}")
    for rel, size in files.items():
        print(f"{'  ' + rel:38s} {size:12,d}")
    print(f"ratio bytes / (3.5 x adapter + 1 MB) = {total / budget:.3f} (target <= 1)")
    print(both.describe())


if __name__ == "__main__":
    main()
