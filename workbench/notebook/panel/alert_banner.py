"""The alert a pause trigger raises in the page: a banner in the panel and a notification of the page.

A trigger (`pause_if`) pauses a run at the step where a metric crossed its line; a panel scrolled out of
view, or a notebook in a background tab, would not show it. So when the panel sees a trigger it had not
shown, it says so twice:

- a banner above the tabs (kept until the run is resumed or stepped), in the panel itself;
- a notification of the page, from a few lines of JavaScript that an `ipywidgets.Output` renders (the
  widget's output area is trusted, so JupyterLab and Notebook 7 run it, once per page and alert):
  JupyterLab's own notification (`apputils:notify`, a toast that stays until closed, also in its
  notification centre) where the page exposes the application (`window.jupyterapp`, which
  `--expose-app-in-browser` or `exposeAppInBrowser` turns on), else a toast of its own fixed to the
  window's top right corner, and a desktop notification where the user allowed the page to send them.

W&B's alert (`wandb.alert`) is sent by the run itself, also without a panel (`workbench.notebook.alerts`).
"""

from __future__ import annotations

import html
import json
import secrets

import ipywidgets

NOTIFY_JS = """(() => {
  const key = %(key)s, title = %(title)s, text = %(text)s;
  const seen = (window.__workbenchAlerts = window.__workbenchAlerts || new Set());
  if (seen.has(key)) return;
  seen.add(key);
  if (window.Notification && Notification.permission === "granted") new Notification(title, {body: text});
  const app = window.jupyterapp;
  if (app && app.commands.hasCommand("apputils:notify")) {
    app.commands.execute("apputils:notify", {
      message: title + ": " + text, type: "warning", options: {autoClose: false}
    });
    return;
  }
  const toast = document.createElement("div");
  toast.className = "wb-alert-toast";
  toast.setAttribute("role", "alert");
  toast.style.cssText = "position:fixed;top:12px;right:12px;z-index:10000;max-width:30em;padding:10px 14px;" +
    "background:#fff4e5;color:#222;border:1px solid #e65100;border-left:6px solid #e65100;border-radius:4px;" +
    "box-shadow:0 2px 8px rgba(0,0,0,.25);font:13px sans-serif;cursor:pointer";
  toast.textContent = title + ": " + text + " (click to close)";
  toast.onclick = () => toast.remove();
  document.body.appendChild(toast);
})();"""
"""The page's notification; `%(key)s`, `%(title)s`, `%(text)s` are JSON strings."""

BANNER_STYLE = (
    "background:#fff4e5;border:1px solid #e65100;border-left:6px solid #e65100;border-radius:4px;"
    "padding:6px 10px;margin:4px 0;color:#222"
)


class AlertBanner:
    """The panel's banner and page notification for the trigger that paused its session's run."""

    def __init__(self) -> None:
        self.banner = ipywidgets.HTML()
        self.banner.add_class("wb-alert")
        self.script = ipywidgets.Output()
        self.widget = ipywidgets.VBox([self.banner, self.script])
        self.shown: object = None
        """The trigger the banner shows (None: none)."""
        self.alerts = 0
        """How many alerts were raised in the page."""

    def show(self, trigger: object, title: str, text: str) -> None:
        """Show `trigger` (any object naming one alert; shown once) as a banner and a notification."""
        if trigger is self.shown:
            return
        self.shown = trigger
        self.banner.value = (
            f'<div style="{BANNER_STYLE}"><b>{html.escape(title)}</b>: {html.escape(text)}. '
            "Resume or Stop in the Train tab.</div>"
        )
        script = NOTIFY_JS % {
            "key": json.dumps(secrets.token_hex(8)),
            "title": json.dumps(title),
            "text": json.dumps(text),
        }
        self.script.outputs = (
            {
                "output_type": "display_data",
                "data": {"application/javascript": script, "text/plain": ""},
                "metadata": {},
            },
        )
        self.alerts += 1

    def clear(self) -> None:
        """No alert stands (the run resumed, or none paused): the banner goes, the script with it."""
        if self.shown is None:
            return
        self.shown = None
        self.banner.value = ""
        self.script.outputs = ()
