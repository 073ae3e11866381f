"""What a live panel costs a run: steps/s of the same SFT run with no panel, one, and two.

The run is `sess.run(wb.train_step(data), steps)` on one session; a panel (`sess.panel(...)`, its
Metrics tab open, plotting loss and grad norm) refreshes from its own timer thread while the run trains, as
it does in a notebook, so it takes GIL time from the run's thread. The floor is the same run with no
panel, timed alternately with the panelled runs in the same process (median of the rounds). Budget: one
panel costs at most 5% of steps/s on the tiny model, nothing measurable on SmolLM2-135M. Measured
quiet and with `bench/contention.py`'s busy process keeping one core busy.

A last row puts a real browser on the panel: JupyterLab (or Notebook 7) on 127.0.0.1 and headless
chromium driven by playwright, launched as `tests/notebook/test_browser.py` launches them. Its kernel
runs the same SFT run in rounds that alternate a panel displayed in the page (Metrics tab open, the
plot drawn in chromium) with none, so what a displayed panel costs is counted whole: the kernel's
comm messages (serialised and signed on the thread that changes a widget, sent by ipykernel's IOPub
thread), what the page sends back (ipympl's acknowledgements, read on the widget subshell), and the
CPU time the Jupyter server and chromium take on the same cores to relay and render it.

    python bench/panel.py --model tiny
    python bench/panel.py --model smollm2-135m --steps 6 --rounds 2
    python bench/panel.py --model tiny --browser notebook   # the browser row in Notebook 7
    python bench/panel.py --model tiny --browser-only --steps 200 --rounds 5

Each browser round prints its ratio (a loaded machine moves single rounds by ±30%: read the median of
the rounds' ratios with the CPU time each process took per step, printed beside it).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("MPLBACKEND", "Agg")

from contention import MODES, quiet_and_contended  # bench/contention.py, beside this script

import workbench as wb

if TYPE_CHECKING:
    from playwright.sync_api import Page

    from tests.notebook.test_browser import KernelTraffic

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
"""The browser row's browser (the browser tests' own; `make browser` installs it)."""
SETTINGS = {"tiny": {"steps": 300, "rounds": 3}, "smollm2-135m": {"steps": 8, "rounds": 2}}
PANELS = (0, 1, 2)
BROWSER_PROCESSES = ("chrom", "headless_shell", "node")
"""What the browser row counts as the browser's CPU time: chromium's processes and playwright's driver."""
BROWSER_ROUND_S = 600.0
"""The longest one round of the browser row may take (kernel start and first panel included)."""


def sft_data(sess: wb.Session) -> list[wb.Datum]:
    tok = sess.tokenizer
    data = []
    for prompt, completion in (("User: Hello!", " Assistant: Hi there."), ("The quick brown fox", " jumps.")):
        prompt_ids, completion_ids = tok(prompt).input_ids, tok(completion).input_ids
        tokens = prompt_ids + completion_ids
        weights = [0.0] * len(prompt_ids) + [1.0] * len(completion_ids)
        data.append(
            wb.Datum(
                model_input=wb.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights[1:]},
            )
        )
    return data


def steps_per_second(sess: wb.Session, data: list[wb.Datum], steps: int, panels: int) -> float:
    """One run of `steps` steps with `panels` live panels; the panels are closed after it."""
    shown = [sess.panel(train_data=data, metrics=("loss:sum", "grad_norm")) for _ in range(panels)]
    for panel in shown:
        panel.tabs.selected_index = panel.tab_index(
            "Metrics"
        )  # the costly view: its plot redrawn as the run trains
    try:
        started = time.perf_counter()
        run = sess.run(wb.train_step(data), steps, adam_params=wb.AdamParams(learning_rate=1e-4))
        run.wait()
        return steps / (time.perf_counter() - started)
    finally:
        for panel in shown:
            panel.close()
        gc.collect()


def measure(sess: wb.Session, data: list[wb.Datum], steps: int, rounds: int) -> dict[int, float]:
    """Median steps/s per panel count, the counts alternating within each round."""
    rates: dict[int, list[float]] = {n: [] for n in PANELS}
    steps_per_second(sess, data, max(steps // 10, 2), 1)  # warm: the first plot, the first step
    for _ in range(rounds):
        for panels in PANELS:
            rates[panels].append(steps_per_second(sess, data, steps, panels))
    return {n: statistics.median(r) for n, r in rates.items()}


# --------------------------------------------------------------------------------------------------
# With a real browser attached


KERNEL_SETUP = """import json, os, pathlib, time
import psutil
import threading
import workbench as wb
from IPython.display import clear_output, display

EXCHANGE = pathlib.Path({exchange!r})
sess = wb.Session({model!r}, wb.LoraConfig(rank=4), wandb=False)

{sft_data}

data = sft_data(sess)
"""
"""The browser row's first cell: the session and its data, as the headless rows make them."""

KERNEL_ROUNDS = """def thread_cpu_s():
    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    return {names.get(t.id, "other"): t.user_time + t.system_time for t in psutil.Process().threads()}


def serve_rounds():
    for k in range(10_000):
        command = EXCHANGE / f"command-{k}.json"
        while not command.exists():
            time.sleep(0.05)
        asked = json.loads(command.read_text())
        if asked["stop"]:
            return
        clear_output()  # the last round's outputs (JupyterLab shows a cell's first 50 only)
        panel = None
        if asked["panel"]:
            panel = sess.panel(train_data=data, metrics=("loss:sum", "grad_norm"))
            panel.tabs.selected_index = panel.tab_index("Metrics")
            panel.add_class(f"wb-bench-{k}")
            display(panel)
            while not (EXCHANGE / f"shown-{k}").exists():  # the page has drawn its plot
                time.sleep(0.05)
        before = thread_cpu_s()
        started = time.perf_counter()
        run = sess.run(wb.train_step(data), asked["steps"], adam_params=wb.AdamParams(learning_rate=1e-4))
        run.wait()
        took = time.perf_counter() - started
        after = thread_cpu_s()
        if panel is not None:
            panel.close()
        threads = {name: after[name] - before.get(name, 0.0) for name in after}
        result = {"steps_per_s": asked["steps"] / took, "seconds": took, "threads_cpu_s": threads,
                  "kernel_pid": os.getpid()}
        (EXCHANGE / f"result-{k}.tmp").write_text(json.dumps(result))
        (EXCHANGE / f"result-{k}.tmp").rename(EXCHANGE / f"result-{k}.json")


serve_rounds()
"""
"""The browser row's second cell: runs what the bench asks, a file per round (`command-k.json`), and
answers each with its steps/s (`result-k.json`); a round with a panel waits until the page shows it."""


@dataclass(frozen=True)
class BrowserRound:
    """One run of the browser row: its steps/s and the CPU seconds each process took meanwhile."""

    panel: bool
    steps_per_s: float
    kernel_cpu_s: float
    server_cpu_s: float
    browser_cpu_s: float
    page_bytes: int  # what the page received on its kernel websockets
    kernel_threads_cpu_s: dict[str, float]


class BrowserKernel:
    """The kernel of a notebook open in the page, asked to run rounds through files in `exchange`."""

    def __init__(self, exchange: Path, page: Page, server_pid: int, traffic: KernelTraffic) -> None:
        self.exchange = exchange
        self.page = page
        self.server_pid = server_pid
        self.traffic = traffic
        self.kernel_pid: int | None = None  # known from its first answer
        self.asked = 0

    def _cpu_s(self) -> dict[str, float]:
        """CPU seconds so far of the kernel, the Jupyter server, and chromium with playwright's driver
        (not the busy process of the contended measurement, also started here)."""
        spent = {"kernel": 0.0, "server": 0.0, "browser": 0.0}
        for process in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                key = {self.kernel_pid: "kernel", self.server_pid: "server"}.get(process.pid)
                if key is None and process.name().startswith(BROWSER_PROCESSES):
                    key = "browser"
                if key is not None:
                    times = process.cpu_times()
                    spent[key] += times.user + times.system
        return spent

    def _ask(self, command: dict[str, object]) -> int:
        k = self.asked
        self.asked += 1
        (self.exchange / f"command-{k}.tmp").write_text(json.dumps(command))
        (self.exchange / f"command-{k}.tmp").rename(self.exchange / f"command-{k}.json")
        return k

    def run(self, panel: bool, steps: int) -> BrowserRound:
        """One run of `steps` steps, with a panel displayed in the page or none."""
        k = self._ask({"stop": False, "panel": panel, "steps": steps})
        deadline = time.monotonic() + BROWSER_ROUND_S
        if panel:
            canvas = self.page.locator(f".wb-bench-{k} .wb-metrics-plot canvas").first
            canvas.wait_for(state="visible", timeout=BROWSER_ROUND_S * 1000)
            self.page.wait_for_timeout(1000)  # the first image drawn
        before, received = self._cpu_s(), self.traffic.received
        (self.exchange / f"shown-{k}").touch()  # the kernel starts the run
        result_file = self.exchange / f"result-{k}.json"
        while not result_file.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the kernel did not finish round {k} in {BROWSER_ROUND_S:.0f} s")
            self.page.wait_for_timeout(100)  # playwright's events (the websocket counts) run meanwhile
        result = json.loads(result_file.read_text())
        after = self._cpu_s()
        self.kernel_pid = result["kernel_pid"]
        return BrowserRound(
            panel,
            result["steps_per_s"],
            after["kernel"] - before["kernel"],
            after["server"] - before["server"],
            after["browser"] - before["browser"],
            self.traffic.received - received,
            result["threads_cpu_s"],
        )

    def stop(self) -> None:
        self._ask({"stop": True})


@contextlib.contextmanager
def browser_kernel(model: str, front_end: str) -> Iterator[BrowserKernel]:
    """JupyterLab or Notebook 7 and headless chromium, launched as the browser tests launch them, on a
    notebook whose kernel holds a `model` session; yields its kernel once it has run a first step."""
    sys.path.insert(0, str(REPO))  # tests/notebook/test_browser.py: imported here, it needs chromium
    from tests.notebook.test_browser import KernelTraffic, _browser_page, _open_in, _serve, _write_notebook

    with tempfile.TemporaryDirectory(prefix="bench-panel-") as tmp:
        tmp_path = Path(tmp)
        exchange = tmp_path / "exchange"
        exchange.mkdir()
        setup = KERNEL_SETUP.format(exchange=str(exchange), model=model, sft_data=inspect.getsource(sft_data))
        with _serve(tmp_path, front_end) as server, _browser_page(tmp_path, 1400, "bench-panel.png") as page:
            _write_notebook(tmp_path / "notebooks" / "bench_panel.ipynb", [setup, KERNEL_ROUNDS])
            traffic = KernelTraffic(page)
            _open_in(page, server, front_end, "bench_panel.ipynb")
            kernel = BrowserKernel(exchange, page, server.process.pid, traffic)
            kernel.run(False, 2)  # the kernel's start, its session and a first step
            try:
                yield kernel
            finally:
                kernel.stop()


def measure_in_browser(kernel: BrowserKernel, steps: int, rounds: int) -> list[BrowserRound]:
    """Rounds of a run with no panel and one with a displayed panel, in the same kernel, the two in
    turn first (a warm panel run before them)."""
    kernel.run(True, max(steps // 10, 2))  # warm: the first plot in the page
    orders = ((False, True), (True, False))
    return [kernel.run(panel, steps) for i in range(rounds) for panel in orders[i % 2]]


def describe_browser(rounds: list[BrowserRound], steps: int) -> str:
    """The displayed panel's steps/s against none's (medians, and each round's ratio), and where the
    CPU time went per step."""
    shown = [r for r in rounds if r.panel]
    none = [r for r in rounds if not r.panel]  # the i-th of each are one round's
    floor, with_panel = (
        statistics.median(r.steps_per_s for r in none),
        statistics.median(r.steps_per_s for r in shown),
    )
    paired = [p.steps_per_s / n.steps_per_s for p, n in zip(shown, none, strict=True)]
    ratios = ", ".join(f"{ratio:.3f}" for ratio in paired)

    def per_step_ms(selected: list[BrowserRound], field: str) -> float:
        return 1000 * statistics.median(getattr(r, field) for r in selected) / steps

    cpu = "; ".join(
        f"{name} {per_step_ms(none, field):.1f} → {per_step_ms(shown, field):.1f}"
        for name, field in (
            ("kernel", "kernel_cpu_s"),
            ("server", "server_cpu_s"),
            ("browser", "browser_cpu_s"),
        )
    )
    threads: dict[str, list[float]] = {}
    for r in shown:
        for name, spent in r.kernel_threads_cpu_s.items():
            threads.setdefault(name, []).append(spent)
    busiest = sorted(threads.items(), key=lambda item: -statistics.median(item[1]))[:6]
    thread_cells = ", ".join(f"{name} {1000 * statistics.median(s) / steps:.2f}" for name, s in busiest)
    page_kb = statistics.median(r.page_bytes for r in shown) / steps / 1000
    return (
        f"panel displayed {with_panel:.1f} steps/s, none {floor:.1f} ({with_panel / floor:.3f}×; "
        f"each round's ratio {ratios}, median {statistics.median(paired):.3f}×)\n"
        f"    CPU ms per step, none → panel: {cpu}\n"
        f"    with the panel, the kernel's threads (CPU ms per step): {thread_cells}\n"
        f"    the page received {page_kb:.2f} KB per step"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", choices=sorted(SETTINGS))
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument(
        "--browser",
        default="lab",
        choices=("lab", "notebook", "none"),
        help="the front end of the browser row (none: no browser row)",
    )
    parser.add_argument("--browser-only", action="store_true", help="only the browser row")
    args = parser.parse_args()
    steps = args.steps or SETTINGS[args.model]["steps"]
    rounds = args.rounds or SETTINGS[args.model]["rounds"]
    print(f"{args.model}: SFT run of {steps} steps, median of {rounds} rounds")
    if not args.browser_only:
        sess = wb.Session(args.model, wb.LoraConfig(rank=4), wandb=False)
        data = sft_data(sess)
        both = quiet_and_contended(lambda: measure(sess, data, steps, rounds))
        for mode, rates in zip(MODES, (both.quiet, both.contended), strict=True):
            floor = rates[0]
            cells = ", ".join(
                f"{n} panel{'s' if n != 1 else ''} {rates[n]:.1f} steps/s ({rates[n] / floor:.3f}×)"
                for n in PANELS
            )
            print(f"  {mode}: {cells}")
        print(f"  {both.describe()}")
        sess.close()
    if args.browser == "none":
        return
    if not CHROMIUM.exists():
        print(f"  browser: skipped, no chromium at {CHROMIUM} (`make browser` installs it)")
        return
    with browser_kernel(args.model, args.browser) as kernel:
        in_browser = quiet_and_contended(lambda: measure_in_browser(kernel, steps, rounds))
    for mode, measured in zip(MODES, (in_browser.quiet, in_browser.contended), strict=True):
        print(f"  {args.browser} in chromium, {mode}: {describe_browser(measured, steps)}")
    print(f"  {in_browser.describe()}")


if __name__ == "__main__":
    main()
