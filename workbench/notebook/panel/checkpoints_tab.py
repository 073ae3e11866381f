"""The Checkpoints tab: the run's checkpoints in a table, and buttons to save, load, delete and export.

Each button calls what a cell would: `sess.policy.save_state(name)`, `sess.load_state(path)`,
`sess.delete_checkpoint(name, kind)`, `sess.export_merged(path)`. The destructive ones (load replaces the
session's training state, delete removes files, a save under a taken name replaces that checkpoint)
first ask for confirmation in the tab. Long operations do not block the kernel: saves and loads
complete on the session's worker thread, and the export runs on a thread of its own, so the outcome
is shown when it arrives.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import html
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ipywidgets

from workbench.engine.interface import Restore
from workbench.engine.remote.engine import EngineUnreachableError
from workbench.notebook.panel.feedback import Feedback
from workbench.notebook.panel.status import format_bytes
from workbench.storage.checkpoint_store import CheckpointInfo

if TYPE_CHECKING:
    from workbench.notebook.session import Session

HIDDEN = ipywidgets.Layout(display="none")
CELL = 'style="padding:2px 12px 2px 0;text-align:left"'


def checkpoints_table(infos: list[CheckpointInfo]) -> str:
    """An HTML table of checkpoints: name, kind, step, saved time (local), size."""
    if not infos:
        return "<i>no checkpoints yet</i>"
    cells = [
        (
            html.escape(info.name),
            info.kind,
            str(info.step),
            datetime.datetime.fromtimestamp(info.time).strftime("%Y-%m-%d %H:%M:%S"),
            format_bytes(info.size_bytes),
        )
        for info in infos
    ]
    rows = "".join("<tr>" + "".join(f"<td {CELL}>{cell}</td>" for cell in row) + "</tr>" for row in cells)
    head = (
        "<tr>"
        + "".join(f"<th {CELL}>{name}</th>" for name in ("name", "kind", "step", "saved", "size"))
        + "</tr>"
    )
    return f'<table class="wb-checkpoints" style="border-collapse:collapse">{head}{rows}</table>'


class CheckpointsTab:
    """Table, checkpoint picker, Save (name) / Load / Delete / Export (path), and a confirmation row."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.feedback = Feedback()
        self.table = ipywidgets.HTML()
        self.choice = ipywidgets.Dropdown(description="checkpoint")
        self.name = ipywidgets.Text(placeholder="step-N", description="name")
        self.export_path = ipywidgets.Text(placeholder="folder for the merged model", description="export to")
        self.save_button = ipywidgets.Button(description="Save", icon="save")
        self.load_button = ipywidgets.Button(description="Load", icon="upload")
        # the two loads as the SDK names them (`TrainingClient.load_state*`)
        self.load_kind = ipywidgets.Dropdown(
            options=(
                ("load_state_with_optimizer", Restore.WITH_OPTIMIZER),
                ("load_state (weights only)", Restore.WEIGHTS),
            ),
            value=Restore.WITH_OPTIMIZER,
            description="load as",
        )
        self.delete_button = ipywidgets.Button(description="Delete", icon="trash", button_style="warning")
        self.export_button = ipywidgets.Button(description="Export merged", icon="file-export")
        self.confirm_text = ipywidgets.HTML()
        self.confirm_button = ipywidgets.Button(description="Confirm", button_style="danger")
        self.cancel_button = ipywidgets.Button(description="Cancel")
        self.confirm_row = ipywidgets.HBox(
            [self.confirm_text, self.confirm_button, self.cancel_button], layout=HIDDEN
        )
        self.pending: Callable[[], None] | None = None
        """The destructive action waiting for Confirm."""
        self.last_action: concurrent.futures.Future[Any] | None = None
        """Resolves once the last action's outcome is shown (or fails with its error)."""
        self._listed: list[CheckpointInfo] | None = None

        self.save_button.on_click(self.feedback.guard(self._on_save))
        self.load_button.on_click(self.feedback.guard(self._on_load))
        self.delete_button.on_click(self.feedback.guard(self._on_delete))
        self.export_button.on_click(self.feedback.guard(self._on_export))
        self.confirm_button.on_click(self.feedback.guard(self._on_confirm))
        self.cancel_button.on_click(self.feedback.guard(self._on_cancel))
        self.widget = ipywidgets.VBox(
            [
                self.table,
                ipywidgets.HBox([self.name, self.save_button]),
                ipywidgets.HBox([self.choice, self.load_kind, self.load_button, self.delete_button]),
                ipywidgets.HBox([self.export_path, self.export_button]),
                self.confirm_row,
                self.feedback.widget,
            ]
        )

    # ------------------------------------------------------------------------------------------ actions

    def _ask(self, question: str, action: Callable[[], None]) -> None:
        self.pending = action
        self.confirm_text.value = f"<b>{html.escape(question)}</b>"
        self.confirm_row.layout = ipywidgets.Layout(display="flex")

    def _on_confirm(self, _button: ipywidgets.Button) -> None:
        action, self.pending = self.pending, None
        self.confirm_row.layout = HIDDEN
        if action is not None:
            action()

    def _on_cancel(self, _button: ipywidgets.Button) -> None:
        self.pending = None
        self.confirm_row.layout = HIDDEN
        self.feedback.info("cancelled")

    def _track(self, future: concurrent.futures.Future[Any], done_message: Callable[[Any], str]) -> None:
        """Show the outcome of `future` when it completes; `last_action` resolves after that."""
        shown: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.last_action = shown

        def show(done: concurrent.futures.Future[Any]) -> None:
            try:
                result = done.result()
                self.feedback.info(done_message(result))
                self.refresh()
                shown.set_result(result)
            except Exception as error:
                self.feedback.error(error)
                shown.set_exception(error)

        future.add_done_callback(show)

    def _selected(self) -> CheckpointInfo:
        for info in self._listed or []:
            if str(info.path) == self.choice.value:
                return info
        raise ValueError("choose a checkpoint first")

    def _on_save(self, _button: ipywidgets.Button) -> None:
        name = self.name.value.strip() or f"step-{self.session.step}"

        def save(overwrite: bool) -> None:
            future = self.session.policy.save_state(name, overwrite=overwrite).future()
            self.feedback.info(f"saving {name} ...")
            self._track(future, lambda response: f"saved {name} to {response.path}")

        if any(info.name == name and info.kind == "state" for info in self.session.list_checkpoints()):
            self._ask(f"Replace checkpoint {name}?", lambda: save(True))
        else:
            save(False)

    def _on_load(self, _button: ipywidgets.Button) -> None:
        info = self._selected()
        if info.kind != "state":
            raise ValueError(f"{info.name} holds sampler weights only; load a state checkpoint")

        restore = self.load_kind.value
        with_optimizer = restore is Restore.WITH_OPTIMIZER

        def load() -> None:
            # what `sess.policy.load_state_with_optimizer(path)` / `load_state(path)` does, without
            # blocking the kernel
            future = self.session.engine.load_state(
                self.session.model_id, info.tinker_path or str(info.path), restore
            ).future()
            how = (
                "with its optimizer state" if with_optimizer else "weights only; the optimizer starts afresh"
            )
            self._track(future, lambda _response: f"loaded {info.name} (step {info.step}; {how})")

        replaced = (
            "weights, optimizer state and step counter are"
            if with_optimizer
            else "weights are (the optimizer starts afresh and a pending gradient is dropped)"
        )
        self._ask(f"Load {info.name}? The policy's {replaced} replaced by step {info.step}'s.", load)

    def _on_delete(self, _button: ipywidgets.Button) -> None:
        info = self._selected()

        def delete() -> None:
            self.session.delete_checkpoint(info.name, info.kind)
            self.feedback.info(f"deleted {info.name}")
            self.refresh()

        self._ask(
            f"Delete checkpoint {info.name} ({format_bytes(info.size_bytes)})? Its files are removed.", delete
        )

    def _on_export(self, _button: ipywidgets.Button) -> None:
        path = self.export_path.value.strip()
        if not path:
            raise ValueError("give the folder to export the merged model to")
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def export() -> None:
            try:
                future.set_result(self.session.export_merged(path))
            except BaseException as error:
                future.set_exception(error)

        self.feedback.info(f"exporting the merged policy to {path} ...")
        self._track(future, lambda target: f"exported the merged policy to {target}")
        threading.Thread(target=export, name="workbench-export", daemon=True).start()

    # ------------------------------------------------------------------------------------------ view

    def opened(self) -> None:
        """Nothing to catch up on: its next refresh draws what is new."""

    def refresh(self) -> None:
        try:
            infos = self.session.list_checkpoints()
        except EngineUnreachableError as error:  # the engine is gone: the rest of the panel still works
            self.feedback.error(error)
            return
        if infos == self._listed:
            return
        self._listed = infos
        self.table.value = checkpoints_table(infos)
        options = [
            (f"{info.name} ({info.kind}, step {info.step})", str(info.path)) for info in reversed(infos)
        ]
        chosen = self.choice.value
        with self.choice.hold_sync():
            self.choice.options = options
            self.choice.value = (
                chosen if chosen in {value for _, value in options} else (options[0][1] if options else None)
            )
