"""The server's overhead: one SFT step and one sampling call through the Tinker REST server (the real
`tinker` SDK over HTTP on this machine) against the same calls in-process, on the same data.

Both sides run on one engine in one process, on two models made alike (same LoRA, same seed), called
alternately: the in-process side is the floor, the difference is what HTTP, protobuf, the future
table and the SDK's polling add. Target: through the server / in-process <= 1.05 for both. Both are
measured twice, on a quiet machine and with a second process keeping one core busy
(`bench/contention.py`: what a notebook always has beside the engine), with the time contended / quiet.
`bench/tinker_server.py` times the same client against any Tinker server by URL.

    python bench/server.py --model tiny
    python bench/server.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TINKER_API_KEY", "tml-local")

import tinker
import torch
from contention import MODES, quiet_and_contended  # bench/contention.py, beside this script
from tinker import types

import workbench as wb

SETTINGS = {
    "tiny": {"batch": (32, 128), "samples": (8, 64), "calls": 40, "rank": 16},
    "smollm2-135m": {"batch": (8, 128), "samples": (4, 32), "calls": 8, "rank": 16},
}
ADAM = {"learning_rate": 1e-5}


def timed_pair(first: Callable[[], object], second: Callable[[], object], calls: int) -> tuple[float, float]:
    """Median seconds per call of two functions, called alternately (which goes first alternates too), so
    both see the same load on a shared machine."""
    times: tuple[list[float], list[float]] = ([], [])
    first()
    second()  # warm both
    for index in range(calls):
        pair = ((first, times[0]), (second, times[1]))
        for fn, sink in pair if index % 2 == 0 else pair[::-1]:
            start = time.perf_counter()
            fn()
            sink.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", choices=sorted(SETTINGS))
    parser.add_argument("--calls", type=int, default=None, help="timed calls of each (median is reported)")
    args = parser.parse_args()
    settings = SETTINGS[args.model]
    calls = args.calls or settings["calls"]
    torch.manual_seed(0)

    session = wb.Session(args.model, wb.LoraConfig(rank=settings["rank"]), seed=0, wandb=False)
    server = session.serve()
    client = tinker.ServiceClient(base_url=server.url)
    remote = client.create_lora_training_client(base_model=args.model, rank=settings["rank"], seed=0).result()
    local = wb.TrainingClient(
        session.engine, session.engine.create_model(wb.LoraConfig(rank=settings["rank"], seed=0)).result()
    )

    count, length = settings["batch"]
    rng = random.Random(0)
    vocab = session.base_info.vocab_size
    sequences = [[rng.randrange(vocab) for _ in range(length + 1)] for _ in range(count)]
    ours = [
        wb.Datum(
            model_input=wb.ModelInput.from_ints(s[:-1]),
            loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * length},
        )
        for s in sequences
    ]
    theirs = [
        types.Datum(
            model_input=types.ModelInput.from_ints(s[:-1]),
            loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * length},
        )
        for s in sequences
    ]

    def remote_step() -> None:
        remote.forward_backward(theirs, "cross_entropy")
        remote.optim_step(types.AdamParams(**ADAM)).result()

    def local_step() -> None:
        local.forward_backward(ours, "cross_entropy")
        local.optim_step(ADAM).result()

    num_samples, max_tokens = settings["samples"]
    prompt = sequences[0][:32]
    remote_sampler = remote.save_weights_and_get_sampling_client().result()
    local_sampler = local.save_weights_and_get_sampling_client().result()
    # stop=[]: every sample runs to max_tokens, so both sides generate the same number of tokens
    params = {"max_tokens": max_tokens, "seed": 1, "stop": []}

    def remote_sample() -> None:
        remote_sampler.sample(
            types.ModelInput.from_ints(prompt), num_samples, types.SamplingParams(**params)
        ).result()

    def local_sample() -> None:
        local_sampler.sample(prompt, num_samples, params).result()

    print(
        f"model={args.model} rank={settings['rank']} device={session.device} dtype={session.config.dtype} "
        f"threads={torch.get_num_threads()} timed calls={calls} each, alternating (median)"
    )
    calls_by_name = (
        (f"SFT step ({count}x{length} tokens)", local_step, remote_step),
        (f"sample ({num_samples}x{max_tokens} tokens)", local_sample, remote_sample),
    )

    def measure() -> list[tuple[float, float]]:
        """In-process and through-the-server median seconds of each call."""
        return [timed_pair(local_fn, server_fn, calls) for _, local_fn, server_fn in calls_by_name]

    both = quiet_and_contended(measure)
    for mode, rows in zip(MODES, (both.quiet, both.contended), strict=True):
        print(f"{mode}:\n{'call':40s} {'in-process s':>13s} {'server s':>9s} {'ratio':>6s}  target")
        for (name, _, _), (local_s, server_s) in zip(calls_by_name, rows, strict=True):
            print(
                f"{name:40s} {local_s:13.4f} {server_s:9.4f} {server_s / local_s:6.3f}  server/in-process <= 1.05"
            )
    print(both.describe())
    for (name, _, _), (local_quiet, server_quiet), (local_busy, server_busy) in zip(
        calls_by_name, both.quiet, both.contended, strict=True
    ):
        print(
            f"{name}: time contended / quiet: through the server {server_busy / server_quiet:.2f}x, "
            f"in-process {local_busy / local_quiet:.2f}x"
        )
    client.close("success").result()
    session.close()


if __name__ == "__main__":
    main()
