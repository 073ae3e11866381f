"""Alerts: a trigger that pauses a run is told to W&B, and to the page (the panel's `alert_banner`).

A run that paused itself (`pause_if`, `workbench.notebook.triggers`) waits for its user; one who is not
looking at the notebook learns of it from W&B's alert (`wandb.Run.alert`: an e-mail or a Slack message,
as the user's W&B settings say), sent from the run's thread as it pauses, when the session has a W&B run.
An offline W&B run keeps the alert in its run file, and `wandb sync` sends it with the rest. A failed
alert is a warning: it never breaks the run.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workbench.metrics import WandbSink
    from workbench.notebook.triggers import Trigger

ALERT_TITLE = "workbench: a trigger paused the run"


def alert_text(model_id: str, trigger: Trigger) -> str:
    """What the alert says: which run, which metric crossed which line, at which step."""
    return f"{model_id}: {trigger}"


def alert_wandb(sink: WandbSink | None, model_id: str, trigger: Trigger) -> None:
    """Send the W&B alert of `trigger` (nothing when W&B is off)."""
    if sink is None:
        return
    try:
        sink.alert(ALERT_TITLE, alert_text(model_id, trigger))
    except Exception as error:  # an alert is a message: the paused run must stay paused, not fail
        warnings.warn(f"the W&B alert was not sent: {error!r}", RuntimeWarning, stacklevel=2)
