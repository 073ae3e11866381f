"""The ipywidgets panel over a Session: a status bar and one tab per kind of work, each a thin view."""

from workbench.notebook.panel.panel import Panel

__all__ = ["Panel"]
