"""The remote engine's overhead: one SFT step (forward_backward + optim_step) and one sampling call from
a `Session.connect` session against the same calls made with the bare `tinker` SDK, on the same server.

The server runs in this process (`sess.serve()` of a local session), and both clients drive two models
made alike on it, called alternately: the bare SDK is the floor, the difference is what the remote
session adds (conversion to and from workbench's types, the worker that awaits results in order, the
history rows). Target: remote session / bare SDK <= 1.05 for both. Both are measured twice, on a quiet
machine and with a second process keeping one core busy (`bench/contention.py`: what a notebook always
has beside the engine), with the time contended / quiet.

    python bench/remote.py --model tiny
"""

from __future__ import annotations

import argparse
import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TINKER_API_KEY", "tml-local")

import tinker
from contention import MODES, quiet_and_contended  # bench/contention.py
from server import timed_pair  # bench/server.py, beside this script: the same alternating timer
from tinker import types

import workbench as wb

SETTINGS = {
    "tiny": {"batch": (32, 128), "samples": (8, 64), "calls": 30, "rank": 16},
    "smollm2-135m": {"batch": (8, 128), "samples": (4, 32), "calls": 8, "rank": 16},
}
ADAM = {"learning_rate": 1e-5}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", choices=sorted(SETTINGS))
    parser.add_argument("--calls", type=int, default=None, help="timed calls of each (median is reported)")
    args = parser.parse_args()
    settings = SETTINGS[args.model]
    calls = args.calls or settings["calls"]
    rng = random.Random(0)
    count, length = settings["batch"]
    token_lists = [[rng.randrange(5, 400) for _ in range(length)] for _ in range(count)]

    host = wb.Session(args.model, wb.LoraConfig(rank=settings["rank"]), seed=0, wandb=False)
    server = host.serve()
    remote = wb.Session.connect(
        server.url, base_model=args.model, lora=wb.LoraConfig(rank=settings["rank"]), wandb=False
    )
    service = tinker.ServiceClient(base_url=server.url)
    bare = service.create_lora_training_client(base_model=args.model, rank=settings["rank"], seed=0).result()

    ours = [
        wb.Datum(
            model_input=wb.ModelInput.from_ints(t[:-1]),
            loss_fn_inputs={"target_tokens": t[1:], "weights": [1.0] * (len(t) - 1)},
        )
        for t in token_lists
    ]
    sdk = [
        types.Datum(
            model_input=types.ModelInput.from_ints(t[:-1]),
            loss_fn_inputs={"target_tokens": t[1:], "weights": [1.0] * (len(t) - 1)},
        )
        for t in token_lists
    ]

    def remote_step() -> None:
        backward = remote.policy.forward_backward(ours, "cross_entropy")
        remote.policy.optim_step(ADAM).result()
        backward.result()

    def bare_step() -> None:
        backward = bare.forward_backward(sdk, "cross_entropy")
        bare.optim_step(types.AdamParams(**ADAM)).result()
        backward.result()

    num_samples, max_tokens = settings["samples"]
    remote_sampler = remote.sampling_client()
    bare_sampler = bare.save_weights_and_get_sampling_client().result()
    prompt = token_lists[0][:16]

    def remote_sample() -> None:
        remote_sampler.sample(prompt, num_samples, {"max_tokens": max_tokens, "seed": 1}).result()

    def bare_sample() -> None:
        bare_sampler.sample(
            types.ModelInput.from_ints(prompt),
            num_samples,
            types.SamplingParams(max_tokens=max_tokens, seed=1),
        ).result()

    def measure() -> list[tuple[float, float]]:
        """Remote-session and bare-SDK median seconds of an SFT step and of a sampling call."""
        return [timed_pair(remote_step, bare_step, calls), timed_pair(remote_sample, bare_sample, calls)]

    both = quiet_and_contended(measure)
    names = ("SFT step", "sample  ")
    print(f"model {args.model}, {calls} calls each, medians")
    for mode, rows in zip(MODES, (both.quiet, both.contended), strict=True):
        print(f"{mode}:")
        for name, (ours, bare_s) in zip(names, rows, strict=True):
            print(
                f"{name}  remote session {ours * 1e3:8.1f} ms   bare SDK {bare_s * 1e3:8.1f} ms   "
                f"ratio {ours / bare_s:.3f}"
            )
    print(both.describe())
    for name, (ours_quiet, bare_quiet), (ours_busy, bare_busy) in zip(
        names, both.quiet, both.contended, strict=True
    ):
        print(
            f"{name.strip()}: time contended / quiet: remote session {ours_busy / ours_quiet:.2f}x, "
            f"bare SDK {bare_busy / bare_quiet:.2f}x"
        )
    remote.close()
    service.close("success").result()
    host.close()


if __name__ == "__main__":
    main()
