"""The ipywidgets panel over a Session: a status bar and one tab per kind of work, each a thin view.

- `panel.py`: `Panel`, and `TABS`, its table of tabs (title, how the part is built, when it is redrawn
  hidden) from which the tab bar, the parts and each refresh are made.
- `train_tab.py`, `sample_tab.py`, `checkpoints_tab.py`, `metrics_tab.py`, `rollouts_tab.py`, `runs_tab.py`,
  `sweep_tab.py`: the tabs (the rollouts' with the rollout explorer, `wb.RolloutExplorer`, also shown on
  its own; the sweep's with its overlaid curves, `sweep_chart.py`).
- `chat_box.py`: the Sample tab's chat, a conversation kept turn after turn.
- `status.py`, `progress_line.py`, `feedback.py`, `record.py`, `alert_banner.py`: the status bar, the
  run's progress line, the errors a control reports, the record saved with the notebook, and a trigger's
  alert in the page.
"""

from workbench.notebook.panel.panel import Panel

__all__ = ["Panel"]
