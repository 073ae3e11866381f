"""Widget messages on a kernel subshell: a real ipykernel, driven by jupyter_client as a front end is.

The kernel runs a cell that blocks its main thread; the client sends the comm message a click on a
button sends. The button that `answer_while_busy` routed is handled at once, on the subshell's thread,
while the cell still blocks; one that was not routed waits for the cell.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import ipywidgets
import pytest
from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.manager import KernelManager, start_new_kernel

from workbench.notebook.widget_subshell import answer_while_busy, widget_subshell

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KERNEL_START_S = 120
REPLY_S = 60

SETUP = """
import threading, time
import ipywidgets
from workbench.notebook.widget_subshell import answer_while_busy

routed, unrouted = ipywidgets.Button(), ipywidgets.Button()
box = ipywidgets.VBox([ipywidgets.HBox([routed])])
answer_while_busy(box)  # the routed button is a grandchild: the whole tree is routed
clicks = []
release = threading.Event()
routed.on_click(lambda _b: (clicks.append(("routed", threading.current_thread().name)), release.set()))
unrouted.on_click(lambda _b: clicks.append(("unrouted", threading.current_thread().name)))
print("COMMS", routed.comm.comm_id, unrouted.comm.comm_id)
"""


@pytest.fixture
def kernel() -> Iterator[tuple[KernelManager, BlockingKernelClient]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    manager, client = start_new_kernel(kernel_name="python3", startup_timeout=KERNEL_START_S, env=env)
    try:
        yield manager, client
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def _click(client: BlockingKernelClient, comm_id: str) -> None:
    """What the page sends for a click on an ipywidgets Button."""
    data = {"method": "custom", "content": {"event": "click"}}
    client.shell_channel.send(client.session.msg("comm_msg", {"comm_id": comm_id, "data": data}))


def _output(client: BlockingKernelClient, code: str) -> str:
    lines: list[str] = []

    def keep(message: dict) -> None:
        if message["msg_type"] == "stream":
            lines.append(message["content"]["text"])

    reply = client.execute_interactive(code, timeout=REPLY_S, output_hook=keep)
    assert reply["content"]["status"] == "ok", reply["content"]
    return "".join(lines)


def _line_starting(client: BlockingKernelClient, marker: str) -> tuple[str, dict]:
    """The first printed line that starts with `marker`, and the last message of it. A print's parts
    may come in several stream messages (the kernel flushes its buffer on a timer), so the stream's
    text is joined until the line ends."""
    streamed = ""
    while True:
        message = client.get_iopub_msg(timeout=REPLY_S)
        if message["msg_type"] == "stream":
            streamed += message["content"]["text"]
            for line in streamed.splitlines(keepends=True):
                if line.startswith(marker) and line.endswith("\n"):
                    return line, message


def test_a_routed_widget_answers_while_the_main_thread_is_busy(
    kernel: tuple[KernelManager, BlockingKernelClient],
) -> None:
    _, client = kernel
    routed, unrouted = _output(client, SETUP).split("COMMS")[1].split()
    # the cell blocks until the routed button's handler releases it (or 60 s pass)
    blocked = client.execute("released = release.wait(60); print('released', released, clicks)")
    time.sleep(1)
    _click(client, unrouted)  # waits behind the busy cell
    _click(client, routed)  # answered now, on the subshell
    started = time.monotonic()
    text, message = _line_starting(client, "released")
    assert time.monotonic() - started < REPLY_S / 2  # not the 60 s the cell would wait unanswered
    assert "released True" in text
    assert "('routed', 'subshell-" in text and "unrouted" not in text
    while message["parent_header"].get("msg_id") != blocked or message["msg_type"] != "status":
        message = client.get_iopub_msg(timeout=REPLY_S)
    # the unrouted click was handled once the main thread was free again, on the main thread
    assert "('unrouted', 'MainThread')" in _output(client, "time.sleep(1); print(clicks)")


def test_outside_a_kernel_nothing_is_routed() -> None:
    button = ipywidgets.Button()
    assert widget_subshell() is None
    answer_while_busy(button)
    assert button.comm is None or "_reply_subshell_for" not in button.comm.__dict__


CANVAS_SETUP = """
import time
import ipywidgets
import matplotlib.figure
from ipympl.backend_nbagg import Canvas, FigureManager
from workbench.notebook.widget_subshell import answer_while_busy

canvas = Canvas(matplotlib.figure.Figure())
FigureManager(canvas, 0)
answer_while_busy(ipywidgets.VBox([canvas]))  # the toolbar is the canvas's `toolbar`, not a child
print("TOOLBAR", canvas.toolbar.comm.comm_id)
"""


def test_an_ipympl_toolbar_answers_while_the_main_thread_is_busy(
    kernel: tuple[KernelManager, BlockingKernelClient],
) -> None:
    """The Zoom button of a plot in a routed box switches the zoom tool on while a cell blocks: the
    toolbar is reached through the canvas's `toolbar` reference, not through `children`."""
    _, client = kernel
    toolbar = _output(client, CANVAS_SETUP).split("TOOLBAR")[1].split()[0]
    client.execute(
        "deadline = time.monotonic() + 60\n"
        "while canvas.toolbar.mode.name != 'ZOOM' and time.monotonic() < deadline: time.sleep(0.05)\n"
        "print('mode', canvas.toolbar.mode.name)"
    )
    time.sleep(1)
    started = time.monotonic()
    data = {"method": "custom", "content": {"type": "toolbar_button", "name": "zoom"}}
    client.shell_channel.send(client.session.msg("comm_msg", {"comm_id": toolbar, "data": data}))
    text, _ = _line_starting(client, "mode")
    assert "mode ZOOM" in text
    assert time.monotonic() - started < REPLY_S / 2  # not the 60 s the cell would wait unanswered
