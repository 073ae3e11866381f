"""A script that ends without `close()` exits cleanly: every thread workbench started has ended before
the interpreter tears down.

A daemon thread still inside torch at teardown is killed when it next takes the GIL, by an unwind that
C++ frames cannot pass: the process aborts (status 134, "terminate called without an active
exception") after the script itself succeeded. Whether a given run hits that window is a matter of
timing, so the script runs in ten fresh processes.
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("script_without_close.py")
RUNS = 10


def _run_script(scratch: Path) -> subprocess.CompletedProcess[str]:
    scratch.mkdir()
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(scratch),
        "WORKBENCH_RUNS": str(scratch / "runs"),
    }
    return subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300, check=False
    )


def test_a_script_that_ends_while_its_session_is_busy_exits_with_status_0(tmp_path: Path) -> None:
    """A run training, operations queued, a panel polling, W&B offline, no `close()`: status 0 in each
    of ten processes (two at a time: the machine has two cores), and the script got to its end."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(_run_script, [tmp_path / f"process-{i}" for i in range(RUNS)]))
    failed = [
        (i, result.returncode, result.stderr[-2000:])
        for i, result in enumerate(results)
        if result.returncode != 0
        or "script ended" not in result.stdout
        or "terminate called" in result.stderr
    ]
    assert not failed, f"{len(failed)} of {RUNS} processes did not exit cleanly: {failed}"
