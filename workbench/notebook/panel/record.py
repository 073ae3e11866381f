"""The panel's saved record: what a notebook shows of the run once the kernel that drew the panel is gone.

A widget lives in its kernel: a notebook saved and reopened later (on GitHub, in nbviewer, in a
Jupyter whose kernel was restarted) has only the widget's id, and shows "model not found" where the
panel was. So the panel leaves a second output under itself, plain HTML: the status bar, the
progress line, the run's state and the Metrics tab's plots as a PNG, the way HF's progress table and
`sess.plot` leave theirs. While the live panel is on the page, a rule of its stylesheet hides the record
(`:has()`, so only the record of its own cell); without the panel the record is what shows.

Where the live panel was, a front end without its kernel shows "Error displaying widget: model not
found" (JupyterLab, Notebook 7) or the widget's text form (an HTML export, nbviewer, GitHub): the record's
stylesheet hides the first, the panel's text form is one short line. The record says which counter is
which (the optimizer's step, the run's step) and draws the plots unzoomed.

The record is updated through its display id when the run settles (pauses, ends, is stopped), and at
most every `RECORD_S` while it runs: a PNG of the plots is 50-90 KB, sent seldom enough to stay a small
part of the panel's traffic per step. A run's start does not rewrite it: the PNG takes ~80 ms of the
GIL that the starting run's thread needs, for a record that would say "running" only until it settles.
"""

from __future__ import annotations

import base64
import html
import re
import time
from collections.abc import Callable

from IPython.display import DisplayHandle, display

RECORD_S = 600.0
"""How often a running run's record is rewritten, at most. A rewrite's 50-90 KB is more than the panel's
budget for a step (20 KB) on its own, so it must be rare in steps, not only in seconds: every minute, a
run of 20-second steps paid up to 30 KB per step for it; every ten minutes, a run of 5-second steps
pays ~0.75 KB per step."""

HIDE_WHILE_LIVE = (
    "<style>"
    ".jp-OutputArea:has(.wb-panel) .wb-record{display:none}"
    ".wb-panel.jupyter-widgets-disconnected button,.wb-panel.jupyter-widgets-disconnected input,"
    ".wb-panel.jupyter-widgets-disconnected select,.wb-panel.jupyter-widgets-disconnected canvas"
    "{pointer-events:none;opacity:.45}"
    # nothing in a stale panel takes the keyboard either (Tab + Enter, typing): each would send a message
    # on a closed comm ("Cannot send"); `interactivity` is Chromium's (135+)
    ".wb-panel.jupyter-widgets-disconnected{interactivity:inert}"
    ".wb-stale-note{display:none}"
    ".wb-panel.jupyter-widgets-disconnected .wb-stale-note{display:block}"
    "</style>"
    '<div class="wb-stale-note" data-field="stale" style="color:#b00020;font-weight:bold">'
    "This panel is a picture: its kernel restarted or stopped, so its controls do nothing. "
    "Run the cells again for a live panel.</div>"
)
"""The live panel's stylesheet: the record under it hidden, and once the front end has lost the kernel
(ipywidgets marks every view `jupyter-widgets-disconnected`) its controls greyed out and inert, and a
note."""

PANEL_TEXT = "workbench panel (live only in the kernel that drew it; its record follows)"
"""The panel's `text/plain` form: what an HTML export (nbconvert, nbviewer, GitHub) shows of the widget
without its kernel, instead of ipywidgets' `Panel(children=(HTML(value='<style>…` repr."""

HIDE_MISSING_PANEL = (
    "<style>"
    ".jp-OutputArea-child:has(+ .jp-OutputArea-child .wb-record)"
    ':has(> .jp-OutputArea-output[data-mime-type="application/vnd.jupyter.widget-view+json"])'
    ":not(:has(.wb-panel)){display:none}"
    "</style>"
)
"""The record's stylesheet: the output just above it, the panel's, hidden while it holds no live panel
(a reopened notebook's "Error displaying widget: model not found")."""

COUNTER_LABELS = (
    ('<span data-field="step"><b>step</b>', '<span data-field="step"><b>optimizer step</b>'),
    ('<span data-field="run-step">step ', '<span data-field="run-step">run step '),
)
"""What the record calls the status bar's and the progress line's counters: side by side without the
live panel around them, "step 12" and "step 15/15" read as one counter that disagrees with itself."""


def record_body(status: str, progress: str, run_state: str) -> str:
    """The record's text: the status bar, the progress line and the run's state, each counter named."""
    body = status + progress + (f"<div>{run_state}</div>" if run_state else "")
    for live, recorded in COUNTER_LABELS:
        body = body.replace(live, recorded)
    return body


class PanelRecord:
    """The HTML output under a displayed panel, rewritten through its display id."""

    def __init__(self, snapshot: Callable[[], tuple[str, bytes | None]]) -> None:
        """`snapshot()` gives the record's HTML body and the plots' PNG (None: no plot)."""
        self.snapshot = snapshot
        self.handle: DisplayHandle | None = None
        self.written_at = 0.0
        self._settled: object = None
        self.writes = 0

    def display(self, settled: object) -> None:
        """Show the record under the panel (a cell displaying the panel calls this), as of `settled`
        (what `refresh` is given): the next refresh rewrites it only once that changes."""
        self.handle = display(self._bundle(), raw=True, display_id=True)
        self.written_at = time.monotonic()
        self._settled = settled

    def refresh(self, settled: object) -> None:
        """Rewrite the record if `settled` (what the run's state is, when it is not running) changed, or
        `RECORD_S` passed while it runs (`settled` None)."""
        if self.handle is None:
            return
        running_due = time.monotonic() - self.written_at >= RECORD_S
        due = running_due if settled is None else settled != self._settled
        if not due:
            return
        if settled is not None:
            self._settled = settled
        self.handle.update(self._bundle(), raw=True)
        self.written_at = time.monotonic()

    def _bundle(self) -> dict[str, str]:
        body, png = self.snapshot()
        image = (
            f'<img alt="metrics" src="data:image/png;base64,{base64.b64encode(png).decode()}">'
            if png is not None
            else ""
        )
        self.writes += 1
        return {
            "text/html": (
                f"{HIDE_MISSING_PANEL}"
                '<div class="wb-record" style="border:1px solid #ddd;border-radius:4px;padding:4px 8px">'
                '<div style="color:#666;font-size:smaller">workbench panel as last saved (the live panel '
                "needs the kernel that drew it: run the cells again for one)</div>"
                f"{body}{image}</div>"
            ),
            "text/plain": html.unescape(" ".join(re.sub(r"<[^>]+>", " ", body).split())),
        }
