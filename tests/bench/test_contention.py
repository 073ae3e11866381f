"""bench/contention.py: the busy process keeps a core busy while the context is open and never outlives
it, its time bound or its parent."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from contention import busy_core, quiet_and_contended  # noqa: E402  (bench/ is not a package)


def gone(pid: int, within_s: float) -> bool:
    """Whether process `pid` has ended (and been reaped, or is a zombie) within `within_s` seconds."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def test_the_busy_process_spins_while_open_and_is_stopped_on_exit() -> None:
    with busy_core(60.0) as busy:
        time.sleep(0.5)
        assert busy.process.poll() is None
    assert busy.process.returncode is not None
    # it used CPU the whole time, not a sleep (a sleeping process would use ~0; a loaded machine may leave
    # it a small share)
    assert busy.core_share is not None and 0.05 < busy.core_share <= 1.1


def test_the_busy_process_ends_at_its_bound_and_the_context_says_so() -> None:
    with pytest.raises(RuntimeError, match="reached its 0 s bound"), busy_core(0.3) as busy:
        assert gone(busy.process.pid, within_s=10.0)
    assert busy.process.returncode is not None


def test_the_busy_process_ends_when_its_parent_is_killed() -> None:
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            f"sys.path.insert(0, {str(BENCH)!r})\n"
            "from contention import busy_core\n"
            "with busy_core(60.0) as busy:\n"
            "    print(busy.process.pid, flush=True)\n"
            "    time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None
    busy_pid = int(parent.stdout.readline())
    assert not gone(busy_pid, within_s=0.2)
    parent.kill()  # no context exit: the busy process must notice on its own
    parent.wait()
    parent.stdout.close()
    assert gone(busy_pid, within_s=10.0)


def test_quiet_and_contended_runs_the_measurement_once_each_way() -> None:
    calls = []

    def measure() -> int:
        calls.append(time.monotonic())
        if len(calls) == 2:
            time.sleep(0.3)  # long enough for the busy process's share to mean something
        return len(calls)

    both = quiet_and_contended(measure)
    assert (both.quiet, both.contended) == (1, 2)
    # its share counts the spinning alone (not the interpreter's start): a number, at most one core
    assert 0.0 < both.busy_core_share <= 1.1, both.busy_core_share
