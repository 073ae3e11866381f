"""A pass over several datums on independent single-threaded streams, on a CPU.

Why. torch runs one batch on an OpenMP team whose threads meet at a barrier after every kernel; when
another process takes one of the team's cores, every kernel waits for the thread that lost it
(`workbench.engine.threads`). The thread policy then falls back to one thread, which leaves the
contended core's fair share unused. Cutting the batch into chunks and giving them to one single-threaded
stream per core has no barrier at all: with three runnable threads on two cores the scheduler gives each
about two thirds of a core, moving them between cores, so both streams go on at the same pace. Measured
on SmolLM2-135M, fp32, rank-8 LoRA, 2 cores (AMD EPYC), `forward_backward` + `optim_step` over 8 × 128
tokens, seconds, quiet → one core kept busy by another process:

    one batch, 2 OpenMP threads                          3.46 → 11.66
    one batch, 1 thread                                  5.56 →  5.24
    2 streams, one chunk of 4 datums (512 tokens) each   3.32 →  4.62
    2 streams, two chunks each, of 256 tokens            3.47 →  5.08
    2 streams, four chunks each, of 128 tokens           3.57 →  5.32

The chunk size matters, quiet too; `forward_backward(importance_sampling)` over 32 datums of 34–46 tokens
(a GRPO step's batch), seconds, quiet, by padded tokens per chunk: 736 → 4.41, 368 → 3.95, 184 → 4.10,
92 → 4.94. Each pass has fixed costs (the collation, the output layer's chunked logprobs, one autograd
call), and a chunk well past 512 tokens is slower again (not profiled). So a pass is cut into chunks of
about `CHUNK_TOKENS` padded tokens, as many for each stream (the scheduler already shares the cores
evenly, so more chunks balance nothing), and smaller ones where the model's full-activation limit
requires. Sampling is not run this way: a decoding step reads every weight once for the whole
batch, so halving the batch nearly doubles the reads (32 sequences × 16 new tokens: 3.50 s on 2 threads,
3.84 s on 2 streams, quiet).

Each chunk's gradient is its own `torch.autograd.grad`, and the chunks' gradients are added in chunk
order whatever stream finished first, so a pass gives the same bits every time on one machine. The cut
depends only on the datums' lengths and the stream count, never on the load. Chunks stay within the
model's full-activation limit; the layers a chunk checkpoints (a long group's prefix, trained in parts:
`workbench.engine.model.prefix_parts`) are chosen for its own thread only, and the coordinating thread
activates the adapter before the streams start: the streams only read the model.
Passes that switch the model's state per micro-batch stay on the worker's threads: the reference
(adapters off for the pass) and `forward_backward_custom` (the user's loss sees the whole batch).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

R = TypeVar("R")
C = TypeVar("C")

# The padded tokens a chunk aims at (see the measurements above).
CHUNK_TOKENS = 512


def stream_chunks(
    plan: Sequence[Sequence[int]], lengths: Sequence[int], streams: int, token_limit: int | None
) -> list[list[int]] | None:
    """Cut a micro-batch plan (length-grouped datum indices, longest group first) into chunks for
    `streams` streams: k = ⌈padded tokens / (streams · CHUNK_TOKENS)⌉ chunks per stream, so each group
    into pieces of at most ⌈datums / (streams · k)⌉ datums, and of at most `token_limit` padded tokens.
    None where streams do not apply: one stream, or a datum alone over `token_limit`. A single chunk is
    given back too: a call runs on streams where its parts (the trained datums, the forward-only ones)
    make two chunks or more together."""
    if streams < 2:
        return None
    longest_of_group = [max(lengths[index] for index in group) for group in plan]
    datums = sum(len(group) for group in plan)
    padded = sum(len(group) * longest for group, longest in zip(plan, longest_of_group, strict=True))
    per_stream = max(1, math.ceil(padded / (streams * CHUNK_TOKENS)))
    most = math.ceil(datums / (streams * per_stream))
    chunks: list[list[int]] = []
    for group, longest in zip(plan, longest_of_group, strict=True):
        size = most
        if token_limit is not None:
            if longest > token_limit:
                return None
            size = min(size, token_limit // longest)
        chunks.extend(list(group[start : start + size]) for start in range(0, len(group), size))
    return chunks


class ChunkSkipped(Exception):
    """A chunk not started because another chunk of the same pass had failed."""


def run_on_streams(
    work: Callable[[C], R], chunks: Sequence[C], streams: int, take: Callable[[R], None]
) -> None:
    """`work(chunk)` for every chunk on `streams` single-threaded streams, and `take(result)` on the
    calling thread in chunk order, each as soon as it and those before it are done (so only results that
    finished early are held).

    Once a chunk fails, no stream starts another; the first failure in chunk order is raised, and only
    once no stream runs any more."""
    previous = torch.get_num_threads()
    failed = threading.Event()

    def single_threaded(chunk: C) -> R:
        if failed.is_set():
            raise ChunkSkipped
        torch.set_num_threads(1)
        try:
            return work(chunk)
        except BaseException:
            failed.set()
            raise

    try:
        with ThreadPoolExecutor(max_workers=streams, thread_name_prefix="workbench-stream") as pool:
            futures = [pool.submit(single_threaded, chunk) for chunk in chunks]
            try:
                for future in futures:
                    if future.exception() is not None:
                        break
                    take(future.result())
            except BaseException:
                failed.set()
                raise
        # every stream has stopped here
        for future in futures:
            error = future.exception()
            if error is not None and not isinstance(error, ChunkSkipped):
                raise error
    finally:
        torch.set_num_threads(previous)
