"""The OpenAI-compatible API's overhead, and streaming clients beside a training loop.

1. Per request: a chat completion through the unmodified `openai` client against the same sample through
   the `tinker` SDK's sampling client, on one server, same rendered prompt, same parameters (the end of
   turn as the stop token, a fixed seed: both sample the same tokens), called alternately; likewise a
   loglikelihood request (`/completions` with `echo`, `logprobs=1`, `max_tokens=1`, lm-eval's shape)
   against the SDK's `sample(..., include_prompt_logprobs=True)`. The SDK path is the floor.
   Target: openai / tinker <= 1.05.
2. Time to the first token: the first content chunk of the same chat request with `stream=True`,
   against the whole unstreamed request of 1. (the floor). Tokens are streamed as the HF sampler draws
   them, so the ratio is about one token's share of the reply, not 1.
3. Eight streaming chat clients (threads, `stream=True`) beside a training loop (SFT steps in-process):
   the training tokens/s and the sampled tokens/s of both together, against each alone.

Both are measured on a quiet machine and with a second process keeping one core busy
(`bench/contention.py`).

    python bench/openai_api.py --model tiny
    python bench/openai_api.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import threading
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TINKER_API_KEY", "tml-local")

import openai
import tinker
import torch
from contention import MODES, quiet_and_contended  # bench/contention.py, beside this script
from tinker import types

import workbench as wb

SETTINGS = {
    "tiny": {"max_tokens": 32, "calls": 30, "batch": (8, 128), "steps": 10, "stream_requests": 3},
    "smollm2-135m": {"max_tokens": 16, "calls": 8, "batch": (4, 64), "steps": 3, "stream_requests": 1},
}
CLIENTS = 8
MESSAGES = [{"role": "user", "content": "Write a short poem about the sea."}]


def timed_pair(first: Callable[[], object], second: Callable[[], object], calls: int) -> tuple[float, float]:
    """Median seconds per call of two functions, called alternately (which goes first alternates too)."""
    times: tuple[list[float], list[float]] = ([], [])
    first()
    second()
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

    session = wb.Session(args.model, wb.LoraConfig(rank=16), seed=0, wandb=False)
    server = session.serve()
    api = openai.OpenAI(base_url=f"{server.url}/oai/api/v1", api_key="tml-local", max_retries=0)
    sdk = tinker.ServiceClient(base_url=server.url)
    sdk_sampler = sdk.create_sampling_client(base_model=args.model).result()
    tokenizer = session.tokenizer
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    max_tokens = settings["max_tokens"]
    rng = random.Random(0)
    scored = [rng.randrange(session.base_info.vocab_size) for _ in range(64)]

    def openai_chat() -> None:
        reply = api.chat.completions.create(
            model=args.model, messages=MESSAGES, max_tokens=max_tokens, seed=1
        )
        assert reply.usage.completion_tokens >= 1

    def tinker_chat() -> None:
        sdk_sampler.sample(
            types.ModelInput.from_ints(prompt),
            1,
            types.SamplingParams(max_tokens=max_tokens, seed=1, stop=[tokenizer.eos_token_id]),
        ).result()

    def first_chunk_seconds() -> float:
        """Seconds from the streamed chat request to its first content chunk (the stream is read out)."""
        started, first = time.perf_counter(), None
        stream = api.chat.completions.create(
            model=args.model, messages=MESSAGES, max_tokens=max_tokens, seed=1, stream=True
        )
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - started
        assert first is not None, "the stream carried no text"
        return first

    def openai_loglikelihood() -> None:
        api.completions.create(
            model=args.model, prompt=[scored], max_tokens=1, echo=True, logprobs=1, temperature=0
        )

    def tinker_loglikelihood() -> None:
        sdk_sampler.sample(
            types.ModelInput.from_ints(scored),
            1,
            types.SamplingParams(max_tokens=1, temperature=0.0),
            include_prompt_logprobs=True,
            topk_prompt_logprobs=1,
        ).result()

    count, length = settings["batch"]
    sequences = [
        [rng.randrange(session.base_info.vocab_size) for _ in range(length + 1)] for _ in range(count)
    ]
    data = [
        wb.Datum(
            model_input=wb.ModelInput.from_ints(s[:-1]),
            loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * length},
        )
        for s in sequences
    ]

    def train(steps: int) -> float:
        """Training tokens/s over `steps` SFT steps."""
        start = time.perf_counter()
        for _ in range(steps):
            session.policy.forward_backward(data, "cross_entropy")
            session.policy.optim_step({"learning_rate": 1e-6}).result()
        return steps * count * length / (time.perf_counter() - start)

    def stream_clients(stop: threading.Event | None, requests_each: int) -> tuple[int, float]:
        """Eight streaming chat clients, each sending `requests_each` requests (or until `stop` is set):
        tokens received and the seconds they took."""
        received = [0] * CLIENTS

        def client(index: int) -> None:
            own = openai.OpenAI(base_url=f"{server.url}/oai/api/v1", api_key="tml-local", max_retries=0)
            done = 0
            while (stop is None and done < requests_each) or (stop is not None and not stop.is_set()):
                stream = own.chat.completions.create(
                    model=session.model_id,
                    messages=MESSAGES,
                    max_tokens=max_tokens,
                    seed=index * 1000 + done,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                for chunk in stream:
                    if chunk.usage is not None:
                        received[index] += chunk.usage.completion_tokens
                done += 1

        start = time.perf_counter()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return sum(received), time.perf_counter() - start

    def beside() -> tuple[float, float, float, float]:
        """Training tokens/s alone, streamed tokens/s alone, and both while they run together."""
        train_alone = train(settings["steps"])
        tokens, seconds = stream_clients(None, settings["stream_requests"])
        stream_alone = tokens / seconds
        stop = threading.Event()
        result: dict[str, tuple[int, float]] = {}
        streaming = threading.Thread(target=lambda: result.setdefault("s", stream_clients(stop, 0)))
        streaming.start()
        train_together = train(settings["steps"])
        stop.set()
        streaming.join()
        tokens, seconds = result["s"]
        return train_alone, stream_alone, train_together, tokens / seconds

    def measure() -> tuple[list[tuple[float, float]], float, tuple[float, float, float, float]]:
        pairs = [
            timed_pair(tinker_chat, openai_chat, calls),
            timed_pair(tinker_loglikelihood, openai_loglikelihood, calls),
        ]
        first_chunk = statistics.median(first_chunk_seconds() for _ in range(calls))
        return pairs, first_chunk, beside()

    print(
        f"model={args.model} device={session.device} dtype={session.config.dtype} threads={torch.get_num_threads()} "
        f"timed calls={calls} each, alternating (median); chat: {len(prompt)} prompt tokens, {max_tokens} sampled"
    )
    both = quiet_and_contended(measure)
    names = (f"chat ({max_tokens} tokens)", f"loglikelihood ({len(scored)} tokens, echo)")
    for mode, (pairs, first_chunk, (train_alone, stream_alone, train_together, stream_together)) in zip(
        MODES, (both.quiet, both.contended), strict=True
    ):
        print(f"{mode}:\n{'request':40s} {'tinker SDK s':>13s} {'openai s':>9s} {'ratio':>6s}  target")
        for name, (tinker_s, openai_s) in zip(names, pairs, strict=True):
            print(
                f"{name:40s} {tinker_s:13.4f} {openai_s:9.4f} {openai_s / tinker_s:6.3f}  openai/tinker <= 1.05"
            )
        unstreamed = pairs[0][1]
        print(
            f"streamed chat: first content chunk {first_chunk * 1000:.0f} ms vs the whole unstreamed reply "
            f"{unstreamed * 1000:.0f} ms ({first_chunk / unstreamed:.2f}x)"
        )
        print(
            f"{CLIENTS} streaming clients beside training ({count}x{length} tokens a step): "
            f"training {train_together:.0f} tok/s vs {train_alone:.0f} alone ({train_together / train_alone:.2f}x); "
            f"streamed {stream_together:.1f} tok/s vs {stream_alone:.1f} alone ({stream_together / stream_alone:.2f}x)"
        )
    print(both.describe())
    sdk.close("success").result()
    session.close()


if __name__ == "__main__":
    main()
