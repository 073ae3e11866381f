"""Giving the memory a training pass or a sampling call freed back to the operating system, on a CPU
under glibc.

A pass over a micro-batch frees its activations when it ends, and the next pass allocates the same
sizes again; a sampling call's key/value caches grow a step at a time and are freed at its end. On a
GPU torch's caching allocator reuses such buffers. On a CPU every tensor comes from the C
library's `malloc`, and glibc keeps freed buffers below its mmap threshold in its heaps. That threshold
rises to the largest buffer freed so far (up to 32 MB; `mallopt(3)`, "M_MMAP_THRESHOLD"), so from the
first pass on the 1–32 MB buffers of activations and logits stay in the heaps, and the heaps grow as
passes on two streams interleave their sizes: measured on SmolLM2-135M, one `forward_backward` of
8 × 576-token datums on 2 streams peaked 4.9 GB over the loaded model and kept 3.7 GB resident after
it, and 64 such datums (one group-RL batch with long prompts) were killed at 24 GB. `malloc_trim(0)`
after each micro-batch hands the freed pages back (glibc ≥ 2.8 releases whole free pages inside the
heaps too, not only at their top): 3.0 GB peak at 8 and 3.2 GB at 16 datums, 0.2 GB kept, at the same
speed. A shared-prefix pass trained in parts (`workbench.engine.model.prefix_parts`) releases after its
prefix and after each part as well: one long group peaked 1.19 GB instead of 1.75 GB. A fixed mmap
threshold of 1 MB bounded it as well, but mapping every buffer afresh cost 18% of
the step. A sampling call of 32 × 128 tokens kept 489 MB after it; released after each batch of sample
requests, 47 MB. Elsewhere (another C library, another system) nothing is done.
"""

from __future__ import annotations

import ctypes
import platform
import time

_LIBC: ctypes.CDLL | None = (
    ctypes.CDLL("libc.so.6") if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc" else None
)

RELEASE_INTERVAL_S = 0.25
"""The least time between two releases. One `malloc_trim` walks every heap (about 1–1.5 ms on this
2-core machine): after every micro-batch it took the tiny model's training from 44 to 38 steps/s,
where a step is a few milliseconds and frees a few megabytes. A quarter of a second holds one SmolLM2
micro-batch or less, so those are each released, and costs the tiny model under 1%."""

_last_release = 0.0


def release_freed_memory() -> None:
    """Return the heap pages glibc holds free to the operating system (`malloc_trim(0)`), unless that
    was done less than RELEASE_INTERVAL_S ago."""
    global _last_release
    now = time.monotonic()
    if _LIBC is not None and now - _last_release >= RELEASE_INTERVAL_S:
        _last_release = now
        _LIBC.malloc_trim(0)
