"""Widgets that answer while a cell runs: their messages are handled on a kernel subshell.

A Jupyter kernel handles the shell messages of its front end one at a time on its main thread, widget
messages included, so while a cell is busy (`run.wait()`, a long `sample`, the cells that Run All
queued) a click on a widget waits for the cell to end and is applied after it. ipykernel 7 implements
kernel subshells (JEP 91, https://jupyter.org/enhancement-proposals/91-kernel-subshells/kernel-subshells.html):
further shell threads, each with its own event loop, and a shell-channel thread that reads every
incoming message first and hands a comm message to the subshell its comm names
(`Comm._reply_subshell_for(data, default)`). `answer_while_busy(widget)` creates one subshell for the
kernel (at its first use) and names it for the comm of `widget` and of every widget it references (a
box's children, an ipympl canvas's toolbar), so their callbacks, the ipympl canvas's zoom and pan, and
the front end's state updates run on that thread
whether the main thread is busy or idle.

The callbacks then run beside the main thread: the panel's controls call the session's thread-safe
API (a run's controls take its lock; the session's operations are queued to its worker thread).

Outside an ipykernel kernel (a script, a test, another kernel) there is no subshell to serve on and
nothing changes: the widgets answer when the main thread is idle.
"""

from __future__ import annotations

import concurrent.futures
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import ipywidgets

if TYPE_CHECKING:
    from ipykernel.kernelbase import Kernel

SUBSHELL_START_S = 10.0
"""How long the kernel's shell-channel thread may take to start the subshell."""

_subshell_lock = threading.Lock()
_subshell: tuple[Kernel, str] | None = None
"""The kernel this process serves and the id of the subshell widget messages go to."""


def _kernel() -> Kernel | None:
    """The ipykernel kernel this process runs, if it runs one that has subshells."""
    kernelbase = sys.modules.get("ipykernel.kernelbase")  # imported by the kernel, if this is one
    if kernelbase is None or not kernelbase.Kernel.initialized():
        return None
    kernel = kernelbase.Kernel.instance()
    return kernel if kernel._supports_kernel_subshells else None  # noqa: SLF001  (the kernel's own switch)


def widget_subshell() -> str | None:
    """The id of the subshell that widget messages are handled on, created at the first call; None
    outside a kernel with subshells."""
    global _subshell  # one subshell per kernel, as the kernel is one per process
    kernel = _kernel()
    if kernel is None:
        return None
    with _subshell_lock:
        if _subshell is None or _subshell[0] is not kernel:
            _subshell = (kernel, _create_subshell(kernel))
        return _subshell[1]


def _create_subshell(kernel: Kernel) -> str:
    """Create a subshell as a front end's `create_subshell_request` does: on the shell-channel thread,
    which owns the subshells."""
    channel = kernel.shell_channel_thread
    manager = channel.manager
    created: concurrent.futures.Future[str] = concurrent.futures.Future()

    def create() -> None:
        try:
            created.set_result(manager._create_subshell())  # noqa: SLF001
        except BaseException as error:  # handed to the waiting thread
            created.set_exception(error)

    channel.io_loop.add_callback(create)
    return created.result(SUBSHELL_START_S)


def _on_subshell(subshell_id: str) -> Callable[[object, str | None], str]:
    def route(_data: object, _default: str | None) -> str:
        return subshell_id

    return route


def answer_while_busy(widget: ipywidgets.Widget) -> None:
    """Handle the messages of `widget` and of every widget it references (recursively) on the kernel's
    widget subshell: a box's `children`, an ipympl canvas's `toolbar` (its Zoom and Pan buttons), a
    widget's `layout` and `style`. Call it again after adding children: it is cheap and idempotent."""
    subshell_id = widget_subshell()
    if subshell_id is None:
        return
    route = _on_subshell(subshell_id)
    seen: set[int] = set()
    pending = [widget]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        comm = current.comm
        if comm is not None and comm.__dict__.get("_reply_subshell_for") is None:
            comm._reply_subshell_for = route  # noqa: SLF001  (the comm's routing hook, read per message)
        pending.extend(_referenced_widgets(current))


def _referenced_widgets(widget: ipywidgets.Widget) -> list[ipywidgets.Widget]:
    """The widgets that `widget`'s synced state names: the traits the front end resolves as
    `IPY_MODEL_` references (one widget or a sequence of them)."""
    found: list[ipywidgets.Widget] = []
    for name in widget.keys:
        value = getattr(widget, name)
        values = value if isinstance(value, (list, tuple)) else (value,)
        found.extend(item for item in values if isinstance(item, ipywidgets.Widget))
    return found
