"""The panel's status bar: what the session is and where it stands, in one line.

It is rebuilt from the session on every refresh, so it is never out of date with what a cell did.
Each field is a `<span data-field=...>` so a browser test (or a stylesheet) can find it.
"""

from __future__ import annotations

import html
import math
import time
from typing import TYPE_CHECKING

import ipywidgets
import psutil
import torch

from workbench.engine.local.engine import Engine
from workbench.notebook.run_checkpoints import stopped_run_note

if TYPE_CHECKING:
    from workbench.notebook.session import Session


def memory_in_use(device: torch.device) -> int:
    """Bytes of memory the model lives in: CUDA memory allocated on a GPU, else this process's RSS."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return psutil.Process().memory_info().rss


def memory_field(session: Session) -> str:
    """The memory in use: one figure on one device; on several, each rank's device and its figure
    (`Engine.rank_memory_bytes`), rank 0 first."""
    engine = session.engine
    if not isinstance(engine, Engine) or len(engine.devices) < 2:
        return format_memory(memory_in_use(session.device))
    return devices_memory(engine.devices, engine.rank_memory_bytes())


def devices_memory(devices: list[str], used: list[int]) -> str:
    """ "cpu 640 MiB · cpu 610 MiB": each device's memory in use, in rank order."""
    return " · ".join(
        f"{html.escape(device)} {format_memory(size)}" for device, size in zip(devices, used, strict=True)
    )


def format_bytes(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


MEASURED_REFRESH_S = 10.0
"""How often the measured fields (memory in use, threads and the load beside them) are read again.
They move within every step (activations come and go: 1.4-2.9 GiB within one RL step on smollm2-135m),
and a bar rebuilt with them at each refresh reached the page twice a second, ~13 KB per step."""


def format_memory(size: float) -> str:
    """Memory to two significant digits ("640 MiB", "1.5 GiB"): a process's RSS moves by a few MiB at
    every step, and a status bar that changed at each refresh would be sent to the page at each."""
    unit = "B"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            break
        size /= 1024
    return f"{float(f'{size:.2g}'):g} {unit}"


def _field(name: str, label: str, value: str) -> str:
    return f'<span data-field="{name}"><b>{html.escape(label)}</b> {value}</span>'


def wandb_field(session: Session) -> str:
    """A link to the W&B run online, its local folder offline (with the command that uploads it), or off."""
    sink = session.wandb_run
    if sink is None:
        return "off"
    if sink.url is not None:
        return (
            f'<a href="{html.escape(sink.url)}" target="_blank" rel="noopener">{html.escape(sink.run_id)}</a>'
        )
    folder = html.escape(str(sink.directory))
    return f'<span title="upload with: wandb sync {folder}">offline {html.escape(sink.run_id)}</span>'


def sampler_versions(session: Session) -> str:
    """The version new samplers get (the current weights), and the older ones live clients still pin."""
    current = session.policy.weights_version
    pinned = [f"v{version}" for version in session.live_versions() if version != current]
    return f"v{current}" + (f" (pinned {', '.join(pinned)})" if pinned else "")


def models_field(session: Session) -> str:
    """The models on the session's engine: its own policy, and those that clients of its server made
    (adapter label, as the history's `model` column has it, and optimizer step; their ids on hover)."""
    engine = session.engine
    others = [
        engine.model_status(model_id) for model_id in engine.model_ids() if model_id != session.model_id
    ]
    own = html.escape(engine.model_status(session.model_id).adapter)
    if not others:
        return own
    ids = html.escape("\n".join(f"{run.adapter}: {run.model_id}" for run in others))
    listed = ", ".join(f"{html.escape(run.adapter)} (step {run.step})" for run in others)
    return f'<span title="{ids}">{own} (this session) + {listed}</span>'


def threads_field(session: Session) -> str:
    """The torch threads in force and the streams a batch runs on, e.g. "1/2, 2 streams" when
    another process keeps one of two cores busy (the streams stay: they wait at no barrier)."""
    use = session.threads
    if use is None:
        return ""
    streams = f", {use.streams} streams" if use.streams > 1 else ""
    return f'<span title="{html.escape(str(use))}">{use.threads}/{use.usable_cores}{streams}</span>'


def base_models_field(session: Session) -> str:
    """The other base models the session holds (a teacher, a grader: its service clients loaded them,
    its server serves them), each with what its weights take, and the budget; empty for none."""
    if session.base_models is None or len(session.base_models.engines()) < 2:
        return ""
    held = [
        f"{html.escape(h.base_model)} {format_bytes(h.bytes)}" for h in session.base_models.holdings()[1:]
    ]
    budget = session.base_models.memory_budget_bytes
    return ", ".join(held) + ("" if budget is None else f" (budget {format_bytes(budget)})")


def server_field(session: Session) -> str:
    """Where the session serves the Tinker API, or off."""
    running = [server for server in session.servers if server.running]
    return ", ".join(html.escape(server.url) for server in running) or "off"


class StatusBar:
    """Device, dtype and memory in use (a remote session: the engine's URL), the session's policy step and weight version, sampler version,
    critic, the models on the engine (clients' included), the server, run, W&B. Before the session's first
    run, the run field says where the folder's unfinished run stopped and how to resume it."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.widget = ipywidgets.HTML()
        self.widget.add_class("wb-status")
        self._measured: list[str] = []
        self._measured_at = -math.inf
        # read once: until the session starts a run of its own, its folder's unfinished run is the news
        self._stopped_run = (
            stopped_run_note(session.model_dir, session.resume_point)
            if session.engine.endpoint is None
            else None
        )

    def _measured_fields(self) -> list[str]:
        """Memory and threads, as read at most MEASURED_REFRESH_S ago."""
        now = time.monotonic()
        if now - self._measured_at >= MEASURED_REFRESH_S:
            self._measured = [
                _field("memory", "memory", memory_field(self.session)),
                _field("threads", "threads", threads_field(self.session)),
            ]
            self._measured_at = now
        return self._measured

    def show_freed(self) -> None:
        self.widget.value = _field("session", "session", "freed")

    def refresh(self) -> None:
        sess = self.session
        if sess.closed:
            self.widget.value = _field("session", "session", "closed")
            return
        run = sess.current_run
        state = None if run is None else ("stopping…" if run.stopping else run.state.value)
        run_text = html.escape(self._stopped_run or "none") if run is None else f"{state} {run.i}/{run.steps}"
        endpoint = sess.engine.endpoint
        where = (
            [
                _field(
                    "device", "device", f"{html.escape(sess.config.device)}/{html.escape(sess.config.dtype)}"
                ),
                *(
                    [_field("base", "base", html.escape(quantized))]
                    if (quantized := sess.quantized_base())
                    else []
                ),
                *self._measured_fields(),
            ]
            if endpoint is None
            else [_field("engine", "engine", html.escape(endpoint))]
        )
        fields = [
            _field("model", "model", html.escape(sess.config.base_model)),
            *where,
            _field("step", "step", str(sess.policy.step)),
            _field("weights", "weights", f"v{sess.policy.weights_version}"),
            _field("sampler", "sampler", sampler_versions(sess)),
            _field("critic", "critic", "yes" if sess.critic is not None else "no"),
            _field("models", "models", models_field(sess)),
            *([_field("bases", "also", base_models_field(sess))] if base_models_field(sess) else []),
            _field("server", "serving", server_field(sess)),
            _field("run", "run", run_text),
            _field("wandb", "W&B", wandb_field(sess)),
        ]
        self.widget.value = (
            # a field never wraps; a window too narrow for all of them on one line wraps between fields
            # (a bar that scrolled sideways hid its tail: the run and W&B fields)
            '<div style="display:flex;flex-wrap:wrap;gap:0 .9em;white-space:nowrap;font-size:.92em">'
            + "".join(fields)
            + "</div>"
        )
