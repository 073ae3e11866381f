"""A tab's message line: where the outcome of a button press, or the error it raised, is shown.

ipywidgets swallows exceptions raised in callbacks (they only reach the kernel's log), so a panel
control that fails would look like it did nothing. Every control's handler is wrapped by `guard`,
which shows the error in the tab instead, and a handler's success message replaces the last one.
"""

from __future__ import annotations

import functools
import html
from collections.abc import Callable
from typing import Any

import ipywidgets

FREED = "the session of this panel was freed (nothing else referenced it): make a new session and panel"


class Feedback:
    """One line of HTML under a tab's controls: the latest message or error."""

    def __init__(self) -> None:
        self.widget = ipywidgets.HTML()
        self.text = ""  # the message shown, as plain text

    def _show(self, text: str, colour: str) -> None:
        self.text = text
        self.widget.value = f'<span style="color:{colour}">{html.escape(text)}</span>' if text else ""

    def info(self, message: str) -> None:
        self._show(message, "#333")

    def error(self, error: BaseException) -> None:
        if isinstance(error, ReferenceError):  # what the panel's weak reference to its session raises
            self._show(FREED, "#b00020")
            return
        self._show(f"{type(error).__name__}: {error}", "#b00020")

    def clear(self) -> None:
        self._show("", "#333")

    def guard(self, handler: Callable[..., Any]) -> Callable[..., None]:
        """Wrap a widget callback so an exception is shown here instead of vanishing."""

        @functools.wraps(handler)
        def guarded(*args: Any) -> None:
            try:
                handler(*args)
            except Exception as error:
                self.error(error)

        return guarded
