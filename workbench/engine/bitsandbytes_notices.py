"""The two notices bitsandbytes logs that a workbench user can do nothing about, filtered out.

peft imports bitsandbytes when it is installed, so every session, quantized or not, would print the
first one; the filters are added when `workbench.engine` is imported, before any of its modules imports
peft. Each drops one message from one logger; everything else bitsandbytes logs still shows.
"""

from __future__ import annotations

import logging

QUIET_NOTICES = {
    # the hub's faster CPU kernels (the `kernels` package) are absent: bitsandbytes' own run instead
    "bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward",
    # on every int8 pass: its matmul casts the input to fp16 (what `QuantizationConfig` documents)
    "bitsandbytes.autograd._functions": "MatMul8bitLt: inputs will be cast",
}


def _keep(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(QUIET_NOTICES[record.name])


def quiet_bitsandbytes_notices() -> None:
    """Add the filters (adding one twice keeps it once)."""
    for name in QUIET_NOTICES:
        logging.getLogger(name).addFilter(_keep)
