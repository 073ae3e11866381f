"""The worker's thread policy: one torch thread per usable core that other processes leave free, unless
the user fixes the count (`threads=`, `OMP_NUM_THREADS`)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

import workbench as wb
from workbench.engine import threads as threads_module
from workbench.engine.threads import (
    OthersBusyMeter,
    ThreadPolicy,
    cgroup_quota_cores,
    cgroup_usage_seconds,
    threads_for,
    usable_cpus,
)

USABLE = len(usable_cpus()[0])
DATUM = wb.Datum(model_input=wb.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3, 4]})


@pytest.fixture
def busy_core() -> Iterator[subprocess.Popen[bytes]]:
    """A second process keeping one core busy (it ends itself after 60 s whatever happens)."""
    code = "import time\nend = time.monotonic() + 60\nwhile time.monotonic() < end: pass"
    process = subprocess.Popen([sys.executable, "-c", code])
    yield process
    process.kill()
    process.wait()


def worker_threads(session: wb.Session) -> int:
    """torch's thread count inside an operation on the session's worker (a custom loss runs there)."""
    seen = []

    def loss_fn(data, logprobs_list):
        seen.append(torch.get_num_threads())
        return -logprobs_list[0].sum(), {}

    session.policy.forward_backward_custom([DATUM], loss_fn).result()
    return seen[0]


@pytest.mark.parametrize(
    ("usable", "others", "threads"),
    [(2, 0.0, 2), (2, 0.3, 2), (2, 0.67, 1), (2, 1.0, 1), (2, 2.0, 1), (8, 2.5, 5), (1, 5.0, 1)],
)
def test_one_thread_per_core_the_others_leave_free(usable: int, others: float, threads: int) -> None:
    assert threads_for(usable, others) == threads


def test_the_cgroup_quota_and_usage_are_read_from_cpu_max_and_cpu_stat(tmp_path: Path) -> None:
    assert cgroup_quota_cores(tmp_path) is None and cgroup_usage_seconds(tmp_path) is None
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_quota_cores(tmp_path) is None
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    (tmp_path / "cpu.stat").write_text("usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n")
    assert cgroup_quota_cores(tmp_path) == 1.5
    assert cgroup_usage_seconds(tmp_path) == 2.5


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/stat")
def test_the_meter_sees_a_busy_process_and_not_the_processes_counted_as_own(busy_core) -> None:
    """The two meters differ by exactly the busy process's CPU time, whatever else the machine runs (the
    busy process's share depends on the machine's load; what the meter does with it does not)."""
    plain, owning = OthersBusyMeter(), OthersBusyMeter()
    owning.own_processes = lambda: [psutil.Process(busy_core.pid)]
    busy = psutil.Process(busy_core.pid)
    time.sleep(0.3)  # past the interpreter's start
    plain.read(), owning.read()
    started, busy_before = time.monotonic(), sum(busy.cpu_times()[:2])
    time.sleep(1.5)
    others, others_without_it = plain.read(), owning.read()
    busy_share = (sum(busy.cpu_times()[:2]) - busy_before) / (time.monotonic() - started)
    assert busy_share > 0.05, busy_share  # it spun (a sleeping process would use ~0)
    # the busy process is among the others in one, counted as own in the other (margin: the readings'
    # few milliseconds apart, and CPU-time ticks of 10 ms over 1.5 s)
    assert others >= busy_share - 0.1, (others, busy_share)
    assert others - others_without_it == pytest.approx(busy_share, abs=0.1)


def test_a_fixed_count_is_used_and_shown() -> None:
    with wb.Session("tiny", wb.LoraConfig(rank=4), threads=1, wandb=False) as session:
        assert worker_threads(session) == 1
        use = session.threads
        assert (use.threads, use.chosen_by, use.usable_cores, use.streams) == (1, "threads=", USABLE, 1)
        assert "set by threads=" in str(use) and "streams" not in str(use)


def test_omp_num_threads_fixes_the_count_as_torch_users_expect(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    use = ThreadPolicy(None, on_cpu=True).in_force
    assert (use.threads, use.chosen_by) == (3, "OMP_NUM_THREADS")
    # the argument wins over the environment
    assert ThreadPolicy(2, on_cpu=True).in_force.chosen_by == "threads="


def test_a_batch_runs_on_one_stream_per_usable_core_or_per_set_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    # busy or not: a stream on a shared core takes fewer chunks
    assert ThreadPolicy(None, on_cpu=True).streams == USABLE
    fixed = ThreadPolicy(3, on_cpu=True)
    assert fixed.streams == fixed.in_force.streams == 3
    assert "batches on 3 streams" in str(fixed.in_force)
    assert ThreadPolicy(3, on_cpu=False).streams == 1  # on a GPU a batch stays on the worker
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert ThreadPolicy(None, on_cpu=True).streams == 1


@pytest.mark.parametrize("threads", [0, -1, True, 1.5, "2"])
def test_a_bad_count_is_refused_before_anything_loads(threads: object) -> None:
    with pytest.raises(ValueError, match="threads must be an integer >= 1"):
        wb.Session("tiny", threads=threads, wandb=False)


@pytest.mark.skipif(USABLE < 2, reason="needs two usable cores (one to step aside from)")
def test_adaptive_threads_step_aside_for_a_busy_process_and_come_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The policy's choice from what the meter reads: the reading is injected, so the test holds whatever
    the machine is doing (the meter itself is tested against a real busy process above)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    others_busy = {"cores": 1.0}
    monkeypatch.setattr(OthersBusyMeter, "read", lambda _meter: others_busy["cores"])
    monkeypatch.setattr(threads_module, "DECISION_INTERVAL_S", 0.0)  # decide before every operation
    with wb.Session("tiny", wb.LoraConfig(rank=4), wandb=False) as session:
        assert session.threads.chosen_by == "adaptive"
        assert worker_threads(session) == USABLE - 1
        assert session.threads.threads == USABLE - 1 and session.threads.others_busy_cores == 1.0
        panel = session.panel()
        panel.refresh()
        # the threads step aside; a batch's streams stay
        assert f"{USABLE - 1}/{USABLE}, {USABLE} streams" in panel.status.widget.value
        assert f"busy on 1.0; batches on {USABLE} streams" in str(session.threads)
        panel.close()
        others_busy["cores"] = 0.1  # below BUSY_CORE_THRESHOLD: nobody holds a core
        assert worker_threads(session) == USABLE
        assert session.threads.threads == USABLE and session.threads.others_busy_cores == 0.1
