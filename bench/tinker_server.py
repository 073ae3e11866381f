"""The same client against any Tinker server: seconds per SFT step and per sampling call, by URL.

One client script, the `tinker` SDK as any user runs it, times whichever server `--url` names
(SkyRL's Tinker server, hosted Tinker, another `workbench serve`); without `--url` it starts
`workbench serve --base-model M` in a subprocess on this machine and times that. The client:
  - `create_lora_training_client(base_model=--base-model, rank=--rank)`;
  - one chat datum (the first `pirate_sft` conversation with the chat template, weight 1 on the
    answer's tokens), tokenized here with the base model's tokenizer when it is a built-in alias or a
    folder on this machine, else with SmolLM2-135M-Instruct's (the server's vocabulary must hold it);
  - `--warmup` untimed steps, then `--steps` timed steps of `forward_backward(cross_entropy)` +
    `optim_step` (both submitted, then both awaited);
  - one sampling client (`save_weights_and_get_sampling_client`), then `--steps` timed calls of
    4 samples x 32 tokens of the prompt (no stop sequences, so every server generates the same tokens).
Printed: seconds per step and per sampling call (median and each), on a quiet machine and with a second
process keeping one core busy (`bench/contention.py`: what a notebook always has beside the engine; it
matters for a server on this machine), and the median step time contended / quiet. No floor: the
figure to compare is the same command's output against another server.

    python bench/tinker_server.py --base-model smollm2-135m
    python bench/tinker_server.py --url http://127.0.0.1:8000 --base-model /path/to/SmolLM2-135M-Instruct
    python bench/tinker_server.py --url https://... --api-key $TINKER_API_KEY --base-model Qwen/Qwen3-8B
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import tinker
from contention import MODES, quiet_and_contended  # bench/contention.py, beside this script
from tinker import types

from workbench.engine.model.base_model import BUILTIN_MODELS, load_tokenizer
from workbench.loops.chat import chat_datum, chat_prompt
from workbench.loops.datasets import pirate_sft
from workbench.sdk_conversion import to_sdk_datum, to_sdk_model_input

ADAM = types.AdamParams(learning_rate=1e-5)
SAMPLES, SAMPLE_TOKENS = 4, 32
SERVE_START_TIMEOUT_S = 300.0


@contextlib.contextmanager
def workbench_serve(base_model: str) -> Iterator[str]:
    """`workbench serve --base-model base_model` on a free port in a subprocess; yields its URL, and
    stops it (SIGINT, then SIGKILL after 60 s) on exit. Its output goes to a log file (a pipe nobody
    reads would fill and block it), shown if it fails to start."""
    folder = Path(tempfile.mkdtemp(prefix="bench-tinker-server-"))
    log_path = folder / "serve.log"
    command = [sys.executable, "-m", "workbench.cli", "serve", "--base-model", base_model, "--port", "0"]
    command += ["--model-dir", str(folder / "session"), "--no-wandb", "--quiet"]
    with log_path.open("w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + SERVE_START_TIMEOUT_S
        url = None
        while url is None:
            lines = [
                line for line in log_path.read_text().splitlines() if "serving the Tinker API at" in line
            ]
            if lines:
                url = lines[0].split(" at ")[-1].strip()
            elif server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"workbench serve did not start:\n{log_path.read_text()[-3000:]}")
            else:
                time.sleep(0.2)
        yield url
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def tokenizer_name(base_model: str) -> str:
    """The base model's own tokenizer when it is here (a built-in alias or a folder), else SmolLM2's."""
    return base_model if base_model in BUILTIN_MODELS or Path(base_model).is_dir() else "smollm2-135m"


def timed(fn: Callable[[], object], warmup: int, steps: int) -> list[float]:
    """Seconds of each of `steps` calls of `fn`, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return seconds


def run(url: str, args: argparse.Namespace, where: str) -> None:
    tokenizer = load_tokenizer(tokenizer_name(args.base_model))
    messages = pirate_sft()[0].messages()
    datum = to_sdk_datum(chat_datum(tokenizer, messages))
    prompt = to_sdk_model_input(chat_prompt(tokenizer, messages[:-1]))
    client = tinker.ServiceClient(base_url=url, api_key=args.api_key)
    training = client.create_lora_training_client(base_model=args.base_model, rank=args.rank, seed=0).result()
    sampling_params = types.SamplingParams(max_tokens=SAMPLE_TOKENS, temperature=1.0, seed=1, stop=[])

    def step() -> None:
        backward = training.forward_backward([datum], "cross_entropy")
        optim = training.optim_step(ADAM)
        backward.result()
        optim.result()

    def measure() -> tuple[list[float], list[float]]:
        """Seconds of each timed step, then of each timed sampling call (a sampler of the trained weights)."""
        steps = timed(step, args.warmup, args.steps)
        sampler = training.save_weights_and_get_sampling_client().result()
        calls = timed(lambda: sampler.sample(prompt, SAMPLES, sampling_params).result(), 1, args.steps)
        return steps, calls

    print(
        f"server: {where}; base model {args.base_model}, LoRA rank {args.rank}; one chat datum of "
        f"{len(datum.model_input.to_ints())} tokens; {args.warmup} warm-up + {args.steps} timed steps; "
        f"sampling {SAMPLES} x {SAMPLE_TOKENS} tokens, 1 warm-up + {args.steps} timed calls"
    )
    both = quiet_and_contended(measure)
    for mode, (steps, calls) in zip(MODES, (both.quiet, both.contended), strict=True):
        print(f"{mode}:")
        for name, seconds in (("SFT step (forward_backward + optim_step)", steps), ("sampling call", calls)):
            each = " ".join(f"{s:.3f}" for s in seconds)
            print(f"  {name:42s} median {statistics.median(seconds):8.3f} s   each: {each}")
    print(both.describe())
    (quiet_steps, quiet_calls), (busy_steps, busy_calls) = both.quiet, both.contended
    print(
        f"step time contended / quiet: {statistics.median(busy_steps) / statistics.median(quiet_steps):.2f}x; "
        f"sampling call {statistics.median(busy_calls) / statistics.median(quiet_calls):.2f}x"
    )
    client.close("success").result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--url", default=None, help="the Tinker server (default: start `workbench serve` here)"
    )
    parser.add_argument(
        "--api-key", default=os.environ.get("TINKER_API_KEY", "tml-local"), help="default: $TINKER_API_KEY"
    )
    parser.add_argument("--base-model", default="smollm2-135m", help="the base model's name on that server")
    parser.add_argument(
        "--rank", type=int, default=8, help="LoRA rank (SkyRL's server caps it: max_lora_rank)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (and timed sampling calls)")
    args = parser.parse_args()
    if args.warmup < 1 or args.steps < 1:
        sys.exit("--warmup and --steps must be >= 1")
    if args.url is not None:
        run(args.url, args, args.url)
        return
    with workbench_serve(args.base_model) as url:
        run(url, args, f"workbench serve (started by this script) at {url}")


if __name__ == "__main__":
    main()
