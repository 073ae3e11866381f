"""The panel, driven headless: every control is clicked or edited from Python, and the session, its
run and its history must respond exactly as if a cell had made the same calls."""

from __future__ import annotations

import html
import math
import re
import threading
import time
from pathlib import Path

import ipywidgets
import pytest
import torch
from matplotlib.figure import Figure

import workbench as wb
from tests.datums import sft_datum
from tests.notebook.test_async_run import sample_groups, train_groups
from workbench.engine.model import shared_prefix
from workbench.notebook.panel.metrics_tab import ASYNC_METRICS
from workbench.notebook.run import RunState

WAIT_S = 30.0


def _data(sess: wb.Session) -> list[wb.Datum]:
    return [
        sft_datum(sess.tokenizer, "User: Hello!", " Assistant: Hi there."),
        sft_datum(sess.tokenizer, "The quick brown fox", " jumps over the lazy dog."),
    ]


@pytest.fixture
def panel(tiny: wb.Session):
    p = tiny.panel(train_data=_data(tiny))
    yield p
    p.close()


def _wait(sess: wb.Session) -> RunState:
    assert sess.current_run is not None
    return sess.current_run.wait(WAIT_S)


def test_the_status_bar_reads_memory_at_most_every_few_seconds_and_shows_two_digits(
    panel: wb.Panel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RSS moves within every step; a bar rebuilt with it at each refresh would be sent to the page at
    each (the memory read is injected)."""
    from workbench.notebook.panel import status

    monkeypatch.setattr(status, "memory_in_use", lambda device: 1_500_000_000)
    monkeypatch.setattr(status, "MEASURED_REFRESH_S", 0.0)
    panel.refresh()
    assert '"memory"><b>memory</b> 1.4 GiB<' in panel.status.widget.value
    shown = panel.status.widget.value
    monkeypatch.setattr(status, "MEASURED_REFRESH_S", 600.0)
    monkeypatch.setattr(status, "memory_in_use", lambda device: 2_900_000_000)
    panel.refresh()
    assert panel.status.widget.value == shown  # read again only after MEASURED_REFRESH_S
    monkeypatch.setattr(status, "MEASURED_REFRESH_S", 0.0)
    panel.refresh()
    assert '"memory"><b>memory</b> 2.7 GiB<' in panel.status.widget.value
    assert [status.format_memory(size) for size in (512, 671_088_640, 672_871_219)] == [
        "510 B",
        "640 MiB",
        "640 MiB",
    ]


def test_the_status_bar_shows_the_session(panel: wb.Panel, tiny: wb.Session) -> None:
    text = panel.status.widget.value
    for expected in (
        "tiny",
        "cpu/float32",
        '"step"><b>step</b> 0',
        "v0",
        '"critic"><b>critic</b> no',
        "W&amp;B</b> off",
        "none",
    ):
        assert expected in text
    assert re.search(r'"memory"><b>memory</b> \d+(\.\d+)? (MiB|GiB)<', text), (
        text
    )  # RSS: GiB once larger models ran
    tiny.policy.forward_backward(_data(tiny), "cross_entropy")
    tiny.policy.optim_step().result()  # a cell trains; the panel follows on its next refresh
    panel.refresh()
    assert (
        '"step"><b>step</b> 1' in panel.status.widget.value
        and '"weights"><b>weights</b> v1' in panel.status.widget.value
    )
    tiny.create_critic()
    panel.refresh()
    assert '"critic"><b>critic</b> yes' in panel.status.widget.value


def test_step_button_without_a_run_trains_one_step_with_the_tab_settings(
    panel: wb.Panel, tiny: wb.Session
) -> None:
    panel.train.adam["learning_rate"].value = 2e-3
    panel.train.adam["grad_clip_norm"].value = 1.0
    panel.train.step_button.click()
    assert _wait(tiny) is RunState.FINISHED
    assert tiny.step == 1
    assert [row["op"] for row in tiny.history] == ["forward_backward", "optim_step"]
    assert tiny.history.last("learning_rate") == 2e-3
    assert tiny.current_run is not None and tiny.current_run.adam_params == wb.AdamParams(
        learning_rate=2e-3, grad_clip_norm=1.0
    )
    panel.refresh()
    assert "finished · 1/1" in panel.train.progress_text.value
    assert panel.train.progress.value == panel.train.progress.max == 1
    assert '"step"><b>step</b> 1' in panel.status.widget.value


def test_run_button_runs_the_tab_step_count(panel: wb.Panel, tiny: wb.Session) -> None:
    panel.train.steps.value = 3
    panel.train.run_button.click()
    assert _wait(tiny) is RunState.FINISHED
    assert tiny.step == 3 and len(tiny.history.series("loss:sum", op="forward_backward")[1]) == 3


def test_the_loss_dropdown_picks_the_loss_and_a_failure_shows_its_traceback(
    panel: wb.Panel, tiny: wb.Session
) -> None:
    panel.train.loss.value = "importance_sampling"  # SFT datums lack its inputs: the run must fail visibly
    with pytest.warns(RuntimeWarning, match="step 0 raised"):
        panel.train.step_button.click()
        assert _wait(tiny) is RunState.PAUSED  # a raising step pauses the run
    panel.refresh()
    assert "Traceback" in panel.train.error.value and "advantages" in panel.train.error.value
    assert panel.train.progress.bar_style == "danger"
    assert tiny.step == 0
    panel.train.stop_button.click()
    assert _wait(tiny) is RunState.STOPPED
    panel.train.loss.value = "cross_entropy"
    panel.train.step_button.click()
    assert _wait(tiny) is RunState.FINISHED
    panel.refresh()
    assert panel.train.error.value == "" and tiny.step == 1


def test_buttons_control_a_run_started_from_a_cell(panel: wb.Panel, tiny: wb.Session) -> None:
    entered, release = threading.Event(), threading.Event()

    def step(sess: wb.Session, i: int) -> dict[str, float]:
        if i == 2:
            entered.set()
            assert release.wait(WAIT_S)
        return {"reward:mean": float(i)}

    run = tiny.run(step, steps=6, paused=True)
    panel.refresh()
    t = panel.train
    assert (t.run_button.description, t.run_button.disabled, t.pause_button.disabled) == (
        "Resume",
        False,
        True,
    )
    assert not t.step_button.disabled and not t.stop_button.disabled and t.loss.disabled

    t.step_button.click()
    assert run.wait(WAIT_S) is RunState.PAUSED and run.i == 1
    t.run_button.click()  # resume: step 2 blocks until released
    assert entered.wait(WAIT_S)
    panel.refresh()
    assert t.run_button.disabled and not t.pause_button.disabled and t.step_button.disabled
    t.pause_button.click()
    release.set()
    assert run.wait(WAIT_S) is RunState.PAUSED and run.i == 3
    t.stop_button.click()
    assert run.wait(WAIT_S) is RunState.STOPPED and run.i == 3
    panel.refresh()
    assert "stopped · 3/6" in t.progress_text.value
    assert not t.run_button.disabled and t.run_button.description == "Run" and t.stop_button.disabled
    assert tiny.history.series("reward:mean", op="run_step")[1] == [0.0, 1.0, 2.0]


def test_adam_fields_edit_the_active_run(panel: wb.Panel, tiny: wb.Session) -> None:
    run = tiny.run(wb.train_step(_data(tiny)), steps=3, adam_params={"learning_rate": 1e-3}, paused=True)
    panel.refresh()
    assert panel.train.adam["learning_rate"].value == 1e-3  # the fields show the run's settings
    panel.train.adam["learning_rate"].value = 4e-3
    assert run.adam_params.learning_rate == 4e-3
    assert "learning_rate = 0.004 applied from run step 0" in panel.train.settings_note.value

    panel.train.adam["beta2"].value = 1.5  # invalid: shown, and the run keeps its settings
    assert "beta2 must be in [0, 1)" in panel.train.feedback.text
    assert run.adam_params.beta2 == 0.95
    panel.refresh()
    assert panel.train.adam["beta2"].value == 0.95

    run.set(weight_decay=0.01)  # from a cell: the panel shows it
    panel.refresh()
    assert panel.train.adam["weight_decay"].value == 0.01

    panel.train.step_button.click()
    run.wait(WAIT_S)
    assert tiny.history.last("learning_rate") == 4e-3
    run.stop()
    run.wait(WAIT_S)


def test_an_edit_during_a_step_shows_as_requested_until_the_run_applies_it(
    panel: wb.Panel, tiny: wb.Session
) -> None:
    inside, release = threading.Event(), threading.Event()

    def slow_step(sess: wb.Session, i: int) -> None:
        inside.set()
        release.wait(WAIT_S)

    run = tiny.run(slow_step, steps=2, adam_params={"learning_rate": 3e-4})
    assert inside.wait(WAIT_S)
    panel.train.adam["learning_rate"].value = 1e-4
    note = panel.train.settings_note.value
    assert "learning_rate 0.0001 requested: the step in progress trains with 0.0003" in note
    assert "applied" not in note
    assert run.adam_params.learning_rate == 3e-4
    release.set()
    run.wait(WAIT_S)
    panel.refresh()
    assert run.adam_params.learning_rate == 1e-4
    assert "learning_rate = 0.0001 applied from run step 1" in panel.train.settings_note.value


def test_invalid_fields_without_a_run_block_starting_one(panel: wb.Panel, tiny: wb.Session) -> None:
    panel.train.adam["eps"].value = 0.0
    assert "eps must be > 0" in panel.train.feedback.text
    panel.train.step_button.click()
    assert "eps must be > 0" in panel.train.feedback.text
    assert tiny.current_run is None and tiny.step == 0


def test_without_training_data_the_buttons_only_control_runs(tiny: wb.Session) -> None:
    panel = tiny.panel()
    try:
        assert panel.train.step_button.disabled and panel.train.run_button.disabled
        panel.train.step_button.click()  # a programmatic click on a disabled button still reports why
        assert "no training data" in panel.train.feedback.text
        assert tiny.current_run is None
        run = tiny.run(wb.train_step(_data(tiny)), steps=2, paused=True)
        panel.refresh()
        assert not panel.train.step_button.disabled
        panel.train.step_button.click()
        assert run.wait(WAIT_S) is RunState.PAUSED and tiny.step == 1
        run.stop()
    finally:
        panel.close()


def test_the_metrics_tab_follows_the_history(panel: wb.Panel, tiny: wb.Session) -> None:
    m = panel.metrics
    assert m.select.value == ["loss:sum"] and m.plot is not None and m.plot.names == ["loss:sum"]
    assert m.figure.get_size_inches().tolist() == [3.4, 2.6]  # shown at its own size, not stretched
    panel.tabs.selected_index = 3  # a hidden plot is not redrawn
    renders = m.renders
    panel.refresh()
    assert m.renders == renders  # nothing new: nothing redrawn
    panel.train.step_button.click()
    _wait(tiny)
    panel.refresh()
    assert m.renders > renders
    assert m.plot.to_png().startswith(b"\x89PNG")
    panel.tabs.selected_index = 0  # hidden: new rows wait until the tab is opened
    renders = m.renders
    panel.train.step_button.click()
    _wait(tiny)
    panel.refresh()
    assert m.renders == renders
    panel.tabs.selected_index = 3
    panel.refresh()
    assert m.renders > renders
    assert {"grad_norm", "learning_rate", "loss:sum"} <= set(m.select.allowed_tags)
    assert m.select.value == ["loss:sum"]  # new options keep the selection

    assert "grad_norm" in m.add_metric.options
    m.add_metric.value = "grad_norm"  # picked in the box (Enter, in the page): added to the tags
    assert m.select.value == ["loss:sum", "grad_norm"] and m.add_metric.value == ""
    m.select.value = ["grad_norm", "loss:sum"]
    assert m.plot.names == ["grad_norm", "loss:sum"]
    assert m.figure.get_size_inches().tolist() == [6.8, 2.6]
    steps, values = m.plot.lines["grad_norm"]["policy/optim_step"].get_data()
    assert list(steps) == [1, 2] and len(values) == 2
    m.select.value = []
    assert m.plot is None


def test_the_metrics_tab_options_and_an_overlaid_run(
    panel: wb.Panel, tiny: wb.Session, tmp_path: Path
) -> None:
    m = panel.metrics
    other = wb.MetricsHistory()
    from workbench.metrics import JsonlSink

    other.sinks.append(JsonlSink(tmp_path / "baseline" / "history.jsonl"))
    other.record("forward_backward", "policy", 0, {"loss:sum": 99.0})
    panel.train.step_button.click()
    _wait(tiny)
    m.compare_path.value = str(tmp_path / "baseline")
    m.compare_button.click()
    assert "overlaid baseline" in m.feedback.text
    assert set(m.plot.lines["loss:sum"]) == {"policy/forward_backward", "baseline policy/forward_backward"}
    m.smoothing.value = 0.5
    assert m.plot.smoothing == 0.5 and m.plot.raw_lines["loss:sum"]
    m.log_scale.value = True
    assert m.plot.axes["loss:sum"].get_yscale() == "log"
    m.x_axis.value = "time"
    assert m.plot.axes["loss:sum"].get_xlabel() == "seconds"
    m.compare_path.value = str(tmp_path / "missing")
    m.compare_button.click()
    assert "no model folder or history file" in m.feedback.text


def test_the_panel_redraws_itself_until_closed(tiny: wb.Session) -> None:
    panel = tiny.panel(train_data=_data(tiny), metrics=("grad_norm",))
    assert panel.polling and panel.metrics.select.value == ["grad_norm"]
    tiny.run(wb.train_step(_data(tiny)), steps=2).wait(WAIT_S)
    deadline = threading.Event()
    for _ in range(100):  # the timer, not the test, refreshes
        if '"step"><b>step</b> 2' in panel.status.widget.value:
            break
        deadline.wait(0.1)
    assert '"step"><b>step</b> 2' in panel.status.widget.value
    assert "finished · 2/2" in panel.train.progress_text.value
    panel.close()
    assert not panel.polling


def test_closing_the_session_ends_the_panel_timer(tiny: wb.Session) -> None:
    panel = tiny.panel()
    tiny.close()
    panel._timer.join(WAIT_S)
    assert not panel.polling
    assert "closed" in panel.status.widget.value


def test_the_hidden_train_tab_is_redrawn_when_opened_or_when_the_run_ends(
    panel: wb.Panel, tiny: wb.Session
) -> None:
    """The Train tab's progress bar and text move at every step, as the progress line above the tabs does:
    hidden while a run runs, the tab sends the page nothing; opened, or once the run has ended, it shows
    the run as it is."""
    panel.stop_polling()  # the test refreshes
    entered, release = threading.Event(), threading.Event()

    def step(sess: wb.Session, i: int) -> None:
        if i == 1:
            entered.set()
            assert release.wait(WAIT_S)

    panel.tabs.selected_index = panel.tab_index("Metrics")
    run = tiny.run(step, steps=2)
    try:
        assert entered.wait(WAIT_S)
        panel.refresh()
        assert "step 1/2" in panel.progress.widget.value
        assert "1/2" not in panel.train.progress_text.value
        panel.tabs.selected_index = panel.tab_index("Train")
        panel.refresh()
        assert "running · 1/2 (step in progress)" in panel.train.progress_text.value
        panel.tabs.selected_index = panel.tab_index("Metrics")
    finally:
        release.set()
    assert run.wait(WAIT_S) is RunState.FINISHED
    panel.refresh()
    assert "finished · 2/2" in panel.train.progress_text.value


def test_a_run_that_ends_as_its_session_closes_is_shown_ended(tiny: wb.Session) -> None:
    """A notebook's last cells can end the run and close the session between two of the timer's
    refreshes; the panel's last refresh shows the run's end, not the step it last saw in progress."""
    panel = tiny.panel()
    panel.stop_polling()  # the test refreshes
    entered, release = threading.Event(), threading.Event()

    def step(sess: wb.Session, i: int) -> None:
        entered.set()
        assert release.wait(WAIT_S)

    run = tiny.run(step, steps=1)
    assert entered.wait(WAIT_S)
    panel.refresh()
    assert "running · 0/1 (step in progress)" in panel.train.progress_text.value
    release.set()
    assert run.wait(WAIT_S) is RunState.FINISHED
    tiny.close()
    panel.refresh()
    assert "finished · 1/1" in panel.train.progress_text.value
    assert "step 1/1" in panel.progress.widget.value
    assert "closed" in panel.status.widget.value


def test_sess_plot_draws_the_named_metrics(tiny: wb.Session) -> None:
    tiny.run(wb.train_step(_data(tiny)), steps=2).wait(WAIT_S)
    figure = tiny.plot("loss:sum", "grad_norm")
    assert isinstance(figure, Figure)
    assert [ax.get_title() for ax in figure.axes] == ["loss:sum", "grad_norm"]
    assert [ax.get_title() for ax in tiny.plot().axes] == tiny.history.names()


# ------------------------------------------------------------------------------------------------ Sample


def _sample(panel: wb.Panel) -> wb.SampleResponse:
    panel.sample.sample_button.click()
    assert panel.sample.rendered is not None, panel.sample.feedback.text
    return panel.sample.rendered.result(WAIT_S)


def test_the_sample_tab_samples_with_its_settings(panel: wb.Panel, tiny: wb.Session) -> None:
    s = panel.sample
    assert s.chat.value and not s.chat.disabled  # the tiny tokenizer has a chat template
    s.prompt.value = "Hello <there> & you"
    s.max_tokens.value = 4
    s.num_samples.value = 3
    s.seed.value = "7"
    response = _sample(panel)
    assert len(response.sequences) == 3 and response.weights_version == 0
    assert all(len(sequence.tokens) <= 4 for sequence in response.sequences)
    shown = s.output.value
    assert shown.count("sample ") == 3 and "weights v0" in shown and "probability exp(logprob)" in shown
    chat = wb.chat_prompt(tiny.tokenizer, [{"role": "user", "content": "Hello <there> & you"}])
    assert html.escape(tiny.tokenizer.decode(chat.to_ints())) in shown  # the chat-rendered prompt, escaped
    row = tiny.history.rows[-1]
    assert (row["op"], row["num_samples:sum"]) == ("sample", 3.0)
    again = _sample(panel)  # the seed makes it repeatable (each sequence has its own id)
    assert [(q.tokens, q.logprobs) for q in again.sequences] == [
        (q.tokens, q.logprobs) for q in response.sequences
    ]

    s.chat.value = False
    s.seed.value = ""
    s.temperature.value = 0.0  # greedy: every sample the same
    s.top_p.value = 0.5
    assert s.sampling_params() == wb.SamplingParams(max_tokens=4, temperature=0.0, top_p=0.5, seed=None)
    greedy = _sample(panel)
    assert len({tuple(sequence.tokens) for sequence in greedy.sequences}) == 1
    assert (
        html.escape(tiny.tokenizer.decode(tiny.tokenizer("Hello <there> & you").input_ids)) in s.output.value
    )


def test_the_version_picker_offers_the_live_snapshots_and_the_base(panel: wb.Panel, tiny: wb.Session) -> None:
    """The Sample tab's list of weights versions follows the session while the tab is shown; hidden, it
    is left as it was (a new version every RL step would cost the page a message per step)."""
    s = panel.sample
    assert s.version.options == (("current (v0)", "current"), ("base model", "base"))
    pinned = tiny.sampling_client()  # a cell holds a client on v0; then the policy trains
    tiny.run(wb.train_step(_data(tiny)), steps=1).wait(WAIT_S)
    panel.refresh()
    assert s.version.options == (("current (v0)", "current"), ("base model", "base"))  # hidden
    panel.tabs.selected_index = 1
    panel.refresh()
    assert s.version.options == (("current (v1)", "current"), ("v0", "0"), ("base model", "base"))
    assert "v1 (pinned v0)" in panel.status.widget.value
    s.prompt.value = "Hi"
    s.max_tokens.value = 2
    s.version.value = "0"
    assert _sample(panel).weights_version == 0
    s.version.value = "base"
    assert _sample(panel).weights_version is None and "base model" in s.output.value
    assert tiny.history.rows[-1]["model"] == "reference"
    s.version.value = "current"
    assert _sample(panel).weights_version == 1
    s.version.value = "0"
    pinned.close()
    panel.refresh()
    assert s.version.options == (("current (v1)", "current"), ("base model", "base"))
    assert s.version.value == "current"  # the chosen snapshot is gone: back to the current weights


def test_sample_tab_errors_are_shown(panel: wb.Panel, tiny: wb.Session) -> None:
    s = panel.sample
    s.sample_button.click()
    assert "write a prompt first" in s.feedback.text and s.rendered is None
    s.prompt.value = "Hi"
    s.seed.value = "seven"
    s.sample_button.click()
    assert "seed must be an integer" in s.feedback.text and s.rendered is None
    assert not [row for row in tiny.history if row["op"] == "sample"]


# ------------------------------------------------------------------------------------------------ Checkpoints


def _act(panel: wb.Panel, button: ipywidgets.Button) -> object:
    before = panel.checkpoints.last_action
    button.click()
    done = panel.checkpoints.last_action
    assert done is not None and done is not before, panel.checkpoints.feedback.text
    return done.result(WAIT_S)


def _names(sess: wb.Session) -> list[tuple[str, str, int]]:
    return [(info.name, info.kind, info.step) for info in sess.list_checkpoints()]


def test_save_and_overwrite_with_confirmation(panel: wb.Panel, tiny: wb.Session) -> None:
    c = panel.checkpoints
    assert "no checkpoints yet" in c.table.value and c.choice.options == ()
    c.name.value = "first"
    _act(panel, c.save_button)
    assert _names(tiny) == [("first", "state", 0)]
    assert "saved first" in c.feedback.text
    assert re.search(r"<td[^>]*>first</td><td[^>]*>state</td><td[^>]*>0</td>", c.table.value)
    assert "KiB" in c.table.value
    assert c.choice.value == str(tiny.list_checkpoints()[0].path)

    tiny.run(wb.train_step(_data(tiny)), steps=2).wait(WAIT_S)
    c.name.value = ""
    _act(panel, c.save_button)  # the default name is the step
    assert _names(tiny) == [("first", "state", 0), ("step-2", "state", 2)]

    c.name.value = "first"  # taken: replacing it asks first
    c.save_button.click()
    assert c.confirm_row.layout.display == "flex" and "Replace checkpoint first?" in c.confirm_text.value
    c.cancel_button.click()
    assert c.confirm_row.layout.display == "none" and c.pending is None
    assert ("first", "state", 0) in _names(tiny)
    c.save_button.click()
    before = c.last_action
    c.confirm_button.click()
    assert c.last_action is not before and c.last_action is not None
    c.last_action.result(WAIT_S)
    assert sorted(_names(tiny)) == [("first", "state", 2), ("step-2", "state", 2)]


def test_load_asks_then_restores_the_saved_state(panel: wb.Panel, tiny: wb.Session) -> None:
    """Both loads, as the SDK names them: `load_state_with_optimizer` (the default) puts the step counter
    back; `load_state` loads the weights alone and starts the optimizer afresh."""
    c = panel.checkpoints
    saved = tiny.engine.inspect(tiny.model_id, wb.Role.POLICY).parameters
    tiny.policy.save_state("start").result()  # saved from a cell: the tab lists it on refresh
    tiny.run(wb.train_step(_data(tiny)), steps=2).wait(WAIT_S)
    panel.refresh()
    assert c.choice.options == (("start (state, step 0)", str(tiny.list_checkpoints()[0].path)),)
    assert [label for label, _ in c.load_kind.options] == [
        "load_state_with_optimizer",
        "load_state (weights only)",
    ]
    c.load_button.click()
    assert "Load start?" in c.confirm_text.value and tiny.step == 2  # nothing happens before Confirm
    _act(panel, c.confirm_button)
    assert tiny.step == 0
    loaded = tiny.engine.inspect(tiny.model_id, wb.Role.POLICY).parameters
    assert loaded.keys() == saved.keys() and all(torch.equal(p, saved[name]) for name, p in loaded.items())
    assert "loaded start (step 0; with its optimizer state)" in c.feedback.text

    tiny.run(wb.train_step(_data(tiny)), steps=2).wait(WAIT_S)
    c.load_kind.value = wb.Restore.WEIGHTS
    c.load_button.click()
    assert "optimizer starts afresh" in c.confirm_text.value
    _act(panel, c.confirm_button)
    assert tiny.step == 2  # weights only: the counter counts on
    loaded = tiny.engine.inspect(tiny.model_id, wb.Role.POLICY).parameters
    assert all(torch.equal(p, saved[name]) for name, p in loaded.items())
    assert "weights only; the optimizer starts afresh" in c.feedback.text


def test_delete_asks_then_removes_the_checkpoint(panel: wb.Panel, tiny: wb.Session) -> None:
    c = panel.checkpoints
    tiny.policy.save_state("keep").result()
    tiny.policy.save_weights_for_sampler("adapter").result()
    panel.refresh()
    assert [label for label, _ in c.choice.options] == ["adapter (sampler, step 0)", "keep (state, step 0)"]
    c.choice.value = c.choice.options[0][1]
    c.load_button.click()
    assert "holds sampler weights only" in c.feedback.text and c.pending is None
    c.delete_button.click()
    assert "Delete checkpoint adapter" in c.confirm_text.value
    assert len(tiny.list_checkpoints()) == 2
    c.confirm_button.click()
    assert _names(tiny) == [("keep", "state", 0)] and "deleted adapter" in c.feedback.text
    assert [label for label, _ in c.choice.options] == ["keep (state, step 0)"]


def test_export_writes_the_merged_model(panel: wb.Panel, tiny: wb.Session, tmp_path: Path) -> None:
    c = panel.checkpoints
    c.export_button.click()
    assert "give the folder" in c.feedback.text
    c.export_path.value = str(tmp_path / "merged")
    target = _act(panel, c.export_button)
    assert Path(str(target)) == tmp_path / "merged" and (tmp_path / "merged" / "config.json").is_file()
    assert "exported the merged policy" in c.feedback.text
    before = c.last_action
    c.export_button.click()  # the folder exists now: the error is shown, not raised
    assert c.last_action is not None and c.last_action is not before
    with pytest.raises(Exception, match="already exists"):
        c.last_action.result(WAIT_S)
    assert "already exists" in c.feedback.text


def test_stop_shows_stopping_until_the_step_in_progress_ends(panel: wb.Panel, tiny: wb.Session) -> None:
    entered, release = threading.Event(), threading.Event()

    def step(sess: wb.Session, i: int) -> None:
        entered.set()
        assert release.wait(WAIT_S)

    run = tiny.run(step, steps=4)
    assert entered.wait(WAIT_S)
    panel.train.stop_button.click()
    assert "stopping… · 0/4 (step in progress)" in panel.train.progress_text.value
    panel.status.refresh()
    assert "stopping… 0/4" in panel.status.widget.value
    release.set()
    assert run.wait(WAIT_S) is RunState.STOPPED
    panel.refresh()
    assert "stopped · 1/4" in panel.train.progress_text.value


def test_a_learning_rate_edit_during_a_step_stays_in_the_field(panel: wb.Panel, tiny: wb.Session) -> None:
    entered, release = threading.Event(), threading.Event()

    def step(sess: wb.Session, i: int) -> None:
        entered.set()
        assert release.wait(WAIT_S)

    run = tiny.run(step, steps=2, adam_params={"learning_rate": 1e-3})
    assert entered.wait(WAIT_S)
    panel.train.adam["learning_rate"].value = 5e-4
    panel.refresh()  # the step still runs with 1e-3; the field keeps the edit for the next one
    assert run.adam_params.learning_rate == 1e-3 and run.next_adam_params.learning_rate == 5e-4
    assert panel.train.adam["learning_rate"].value == 5e-4
    release.set()
    assert run.wait(WAIT_S) is RunState.FINISHED and run.adam_params.learning_rate == 5e-4


def test_a_run_from_a_cell_is_described_as_it_is(panel: wb.Panel, tiny: wb.Session) -> None:
    def rl_step(sess: wb.Session, i: int) -> None:
        return None

    assert panel.train.adam["learning_rate"].value == 1e-3  # the tutorials' learning rate
    run = tiny.run(rl_step, steps=15, paused=True)
    panel.refresh()
    t = panel.train
    assert "rl_step" in t.run_description.value and "15 steps" in t.run_description.value
    assert t.steps.value == 15 and t.loss.layout.display == "none"  # the tab's loss is not this run's
    run.stop()
    run.wait(WAIT_S)
    t.step_button.click()  # the tab's own run shows the tab's loss again
    assert _wait(tiny) is RunState.FINISHED
    panel.refresh()
    assert t.run_description.value == "" and t.loss.layout.display is None


def test_the_progress_line_shows_speed_eta_loss_reward_and_a_trigger(
    panel: wb.Panel, tiny: wb.Session
) -> None:
    data = _data(tiny)

    def step(sess: wb.Session, i: int) -> dict[str, float]:
        wb.train_step(data)(sess, i)
        return {"reward:mean": [0.2, 0.9, 0.1, 0.1][i]}

    assert panel.progress.widget.value == ""
    run = tiny.run(step, steps=4, pause_if={"reward:mean": ("above", 0.5)})
    assert run.wait(WAIT_S) is RunState.PAUSED and run.i == 2
    panel.refresh()
    text = " ".join(html.unescape(re.sub("<[^>]+>", " ", panel.progress.widget.value)).split())
    assert "step 2/4" in text and "s/step" in text and "trained" in text and "tok/s" in text
    assert "paused" in text and "ETA" not in text  # no time left counts down while paused
    assert f"loss {tiny.history.last('loss:sum'):.4g}" in text and "reward 0.9" in text
    assert "paused by trigger: reward:mean = 0.9 (above 0.5) at run step 1" in text
    run.resume()
    assert run.wait(WAIT_S) is RunState.FINISHED
    panel.refresh()
    assert "paused by trigger" not in panel.progress.widget.value and "ETA" not in panel.progress.widget.value


def test_an_rl_runs_progress_line_shows_reward_kl_and_entropy_not_its_loss(
    panel: wb.Panel, tiny: wb.Session
) -> None:
    """A run that records rollouts is an RL run: its policy loss is a surrogate that says nothing to a
    reader, so the line shows the reward, the KL and the entropy instead."""
    prompt = wb.ModelInput.from_ints(tiny.tokenizer.encode("Hi"))

    def rl_step(sess: wb.Session, i: int) -> None:
        sampler = sess.policy.save_weights_and_get_sampling_client()
        response = sampler.sample(prompt, 4, wb.SamplingParams(max_tokens=3, seed=i)).result()
        group = wb.RolloutGroup.of(prompt, response, [1.0, 0.0, 0.0, 1.0])
        out = sess.policy.forward_backward(wb.rollout_data([group]), "importance_sampling").result()
        sess.policy.optim_step(sess.current_run.adam_params).result()
        sess.record_rollouts([group], trained=out)

    assert tiny.run(rl_step, steps=2).wait(WAIT_S) is RunState.FINISHED
    panel.refresh()
    text = " ".join(html.unescape(re.sub("<[^>]+>", " ", panel.progress.widget.value)).split())
    assert "reward 0.5" in text and "loss" not in text, text
    assert f"KL (sampler–trainer) {tiny.history.last('kl_sample_train_v1:mean'):.3g}" in text, text
    assert f"entropy {tiny.history.last('entropy:mean'):.3g}" in text, text


def test_an_asynchronous_run_plots_and_shows_its_staleness_and_waits(
    panel: wb.Panel, tiny: wb.Session
) -> None:
    """The async signals join the chosen plots when they first appear (once: a removed tag stays
    removed), and the progress line gives the staleness against its bound and both waits."""
    m = panel.metrics
    panel.tabs.selected_index = panel.tab_index("Metrics")
    assert m.select.value == ["loss:sum"]
    run = tiny.run_async(sample_groups, train_groups, 3, max_steps_off_policy=1)
    assert run.wait(WAIT_S) is RunState.FINISHED, run.traceback
    panel.refresh()
    assert m.select.value == ["loss:sum", *ASYNC_METRICS] and m.plot is not None
    assert m.plot.names == ["loss:sum", *ASYNC_METRICS]
    ((steps, values),) = (line.get_data() for line in m.plot.lines["async/staleness:max"].values())
    assert len(steps) == 3 and max(values) <= 1
    text = " ".join(html.unescape(re.sub("<[^>]+>", " ", panel.progress.widget.value)).split())
    staleness = tiny.history.last("async/staleness:max")
    assert f"staleness {staleness:.0f}/1" in text
    assert re.search(r"trainer waited \d+\.\d\d s/step", text), text
    assert re.search(r"samples waited \d+\.\d\d s/step", text), text
    m.select.value = ["loss:sum"]
    assert (
        tiny.run_async(sample_groups, train_groups, 1, max_steps_off_policy=1).wait(WAIT_S)
        is RunState.FINISHED
    )
    panel.refresh()
    assert m.select.value == ["loss:sum"]


def test_the_progress_line_shows_the_share_of_tokens_computed_where_prompts_are_shared(
    tiny: wb.Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four completions of one prompt, each prefix shared (a cost of 0 injected for the rule): the line
    gives the share computed, (prompt + 4 completions) / (4 × (prompt + completion)); without sharing
    it says nothing of it."""
    monkeypatch.setattr(shared_prefix, "PREFIX_PASS_OVERHEAD_TOKENS", 0.0)
    prompt = "Question: What is the capital of France? Answer in one word, please."
    data = [
        sft_datum(tiny.tokenizer, prompt, answer)
        for answer in (" Paris", " Paris.", " It is Paris", " paris")
    ]
    panel = tiny.panel(train_data=data)
    try:
        assert tiny.run(wb.train_step(data), steps=1).wait(WAIT_S) is RunState.FINISHED
        row = tiny.history.rows[-2]  # the forward_backward before the optim_step
        assert row["computed_tokens:sum"] < row["submitted_tokens:sum"]
        share = row["computed_tokens:sum"] / row["submitted_tokens:sum"]
        panel.refresh()
        assert f"computed {share:.0%} of tokens" in html.unescape(panel.progress.widget.value)
        monkeypatch.setattr(shared_prefix, "PREFIX_PASS_OVERHEAD_TOKENS", math.inf)
        assert tiny.run(wb.train_step(data), steps=1).wait(WAIT_S) is RunState.FINISHED
        panel.refresh()
        assert "computed" not in panel.progress.widget.value
    finally:
        panel.close()


def test_sampling_says_what_it_samples_and_why_each_sample_ended(panel: wb.Panel, tiny: wb.Session) -> None:
    s = panel.sample
    s.prompt.value = "Hello"
    s.max_tokens.value = 3
    s.sample_button.click()
    assert "sampling" in s.feedback.text and "SamplingClient" not in s.feedback.text
    s.rendered.result(WAIT_S)
    assert "stop: stop" not in s.output.value and "stop: length" not in s.output.value
    assert "cut off at max_tokens" in s.output.value or "ended with a stop token" in s.output.value


def test_the_metrics_tab_redraws_once_per_step_while_a_run_runs(
    panel: wb.Panel, tiny: wb.Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step's rows arrive over its duration: a row that arrives after the step was drawn waits for
    the next step (the time cap is injected: no refresh here waits on it; so is the byte allowance, which
    no render here exceeds)."""
    from workbench.notebook.panel import metrics_tab

    monkeypatch.setattr(metrics_tab, "MAX_RENDER_INTERVAL_S", 600.0)
    monkeypatch.setattr(metrics_tab, "PLOT_BYTES_PER_STEP", 10**9)
    monkeypatch.setattr(metrics_tab, "RUNNING_RENDER_S", 0.0)
    m = panel.metrics
    panel.tabs.selected_index = 3
    data = _data(tiny)
    first, second = [threading.Event(), threading.Event()], [threading.Event(), threading.Event()]
    after_first, after_second = [threading.Event(), threading.Event()], [threading.Event(), threading.Event()]

    def step(sess: wb.Session, i: int) -> None:
        assert sess.current_run is not None
        sess.policy.forward_backward(data, "cross_entropy").result()
        first[i].set()
        assert after_first[i].wait(WAIT_S)
        sess.policy.forward_backward(data, "cross_entropy").result()
        second[i].set()
        assert after_second[i].wait(WAIT_S)
        sess.policy.optim_step(sess.current_run.adam_params).result()

    run = tiny.run(step, steps=2)
    assert first[0].wait(WAIT_S)
    panel.refresh()  # the run's first loss: drawn
    renders = m.renders
    after_first[0].set()
    assert second[0].wait(WAIT_S)
    panel.refresh()  # another loss of the same step: it waits
    assert m.renders == renders
    after_second[0].set()
    assert first[1].wait(WAIT_S)
    panel.refresh()  # a step ended: drawn
    assert m.renders == renders + 1
    for event in (after_first[1], after_second[1]):
        event.set()
    assert run.wait(WAIT_S) is RunState.FINISHED
    panel.refresh()  # no run running: drawn at once
    assert m.renders == renders + 2


def test_a_costly_metrics_redraw_is_followed_by_steps_without_one(
    panel: wb.Panel, tiny: wb.Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A redraw that sent the page 2.5 times the plot's bytes per step (the allowance is injected from
    what the first redraw sent) is followed by three steps without one, so the plot's traffic averages
    the allowance whatever a redraw costs."""
    from workbench.notebook.panel import metrics_tab

    monkeypatch.setattr(metrics_tab, "MAX_RENDER_INTERVAL_S", 600.0)
    monkeypatch.setattr(metrics_tab, "RUNNING_RENDER_S", 0.0)
    m = panel.metrics
    panel.tabs.selected_index = 3
    data = _data(tiny)
    stepped = [threading.Event() for _ in range(5)]
    go_on = [threading.Event() for _ in range(5)]

    def step(sess: wb.Session, i: int) -> None:
        assert sess.current_run is not None
        sess.policy.forward_backward(data, "cross_entropy").result()
        sess.policy.optim_step(sess.current_run.adam_params).result()
        stepped[i].set()
        assert go_on[i].wait(WAIT_S)

    run = tiny.run(step, steps=5)
    assert stepped[0].wait(WAIT_S)
    panel.refresh()  # the run's first rows: drawn
    assert m.rendered_bytes > 0
    monkeypatch.setattr(metrics_tab, "PLOT_BYTES_PER_STEP", m.rendered_bytes / 2.5)
    renders = m.renders
    for i in (1, 2, 3):
        go_on[i - 1].set()
        assert stepped[i].wait(WAIT_S)  # step i's rows are in: the run's counter says i steps done
        panel.refresh()
        assert m.renders == renders + (i == 3), i
    run.stop()
    for event in go_on:
        event.set()
    assert run.wait(WAIT_S) is RunState.STOPPED


def test_a_running_runs_plot_redraws_at_a_fixed_rate_whatever_its_step_rate(
    panel: wb.Panel, tiny: wb.Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run of fast steps, the panel refreshed as fast as it goes for 3 s: the plot is redrawn at most
    once per RUNNING_RENDER_S (injected: 1 s), not at every refresh that sees a new step; the status
    bar and the progress line keep up meanwhile. A redraw holds the GIL the run's thread needs."""
    from workbench.notebook.panel import metrics_tab

    monkeypatch.setattr(metrics_tab, "RUNNING_RENDER_S", 1.0)
    monkeypatch.setattr(metrics_tab, "PLOT_BYTES_PER_STEP", 10**9)  # any step ends the wait for bytes
    m = panel.metrics
    panel.tabs.selected_index = panel.tab_index("Metrics")
    panel.stop_polling()  # only this test's refreshes
    run = tiny.run(wb.train_step(_data(tiny)), steps=100_000, adam_params=wb.AdamParams(learning_rate=1e-4))
    try:
        renders, refreshes, steps = m.renders, 0, run.i
        started = time.monotonic()
        while (elapsed := time.monotonic() - started) < 3.0:
            panel.refresh()
            refreshes += 1
            time.sleep(0.02)  # the run's thread gets the GIL between refreshes
        drawn = m.renders - renders
        stepped = run.i - steps
        assert stepped >= 8 and refreshes >= 8, (stepped, refreshes)  # a redraw per step was possible
        assert 1 <= drawn <= math.floor(elapsed / 1.0) + 1, (drawn, stepped, refreshes)
        shown = re.search(r"step (\d+)/100000", panel.progress.widget.value)
        assert shown is not None and int(shown[1]) > steps  # the progress line moved meanwhile
    finally:
        run.stop()
        run.wait(WAIT_S)


def test_the_metrics_plot_reaches_the_page_as_png_before_the_front_end_says_it_is_ready(
    panel: wb.Panel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ipympl sends a canvas's redraws as raw RGBA (829 KB here) until it has read the front end's
    `initialized` message, which a kernel busy with a cell may not read for a whole run; no front end
    has sent it here."""
    canvas = panel.metrics.canvas
    sent: list[bytes] = []
    monkeypatch.setattr(canvas, "send", lambda content, buffers=None: sent.extend(buffers or []))
    canvas.draw()
    assert sent, "the redraw sent no image"
    for image in sent:
        assert bytes(image[:8]) == b"\x89PNG\r\n\x1a\n" and len(image) < 100_000, len(image)


def test_the_plots_images_are_paletted_pngs_that_keep_every_pixels_transparency(panel: wb.Panel) -> None:
    """A diff image of the live canvas (alpha 0: a pixel left as it was) re-encoded with a palette: the
    same transparency at every pixel, the colours within 10/255, under 60% of the bytes."""
    import io

    import numpy as np
    from PIL import Image

    from workbench.notebook.panel.metrics_tab import paletted_png
    from workbench.notebook.plots import LivePlot

    history = wb.MetricsHistory()
    for step in range(8):
        history.record("forward_backward", "policy", step, {"loss:sum": 3.0 / (step + 1), "tokens": 8.0})
    plot = LivePlot(["loss:sum", "tokens"])
    plot.update(history)
    rgba = np.asarray(Image.open(io.BytesIO(plot.to_png())).convert("RGBA")).copy()
    rgba[:, : rgba.shape[1] // 2, :] = 0  # the left half left as it was
    original = io.BytesIO()
    Image.fromarray(rgba).save(original, format="png")
    paletted = paletted_png(original.getvalue())
    decoded = np.asarray(Image.open(io.BytesIO(paletted)).convert("RGBA")).astype(int)
    assert (decoded[..., 3] == rgba[..., 3]).all()
    shown = rgba[..., 3] > 0
    assert np.abs(decoded[shown][:, :3] - rgba[shown][:, :3].astype(int)).max() <= 10
    assert len(paletted) < 0.6 * len(original.getvalue()), (len(paletted), len(original.getvalue()))


def test_the_rollouts_tab_follows_a_running_run_at_most_every_few_seconds(
    panel: wb.Panel, tiny: wb.Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a run runs, the open Rollouts tab shows its new batches at most every FOLLOW_S (a
    batch is ~10 KB for the page); opened again, it shows the newest at once; a run that has ended, too."""
    from workbench.notebook.panel import rollouts_tab

    entered, release = threading.Event(), threading.Event()

    def step(sess: wb.Session, i: int) -> dict[str, float]:
        _record_batch(sess)
        if i == 1:
            entered.set()
            assert release.wait(WAIT_S)
        return {}

    panel.tabs.selected_index = panel.tab_index("Rollouts")
    monkeypatch.setattr(rollouts_tab, "FOLLOW_S", 3600.0)
    run = tiny.run(step, steps=2)
    try:
        assert entered.wait(WAIT_S)  # batches 0 and 1 recorded, the run running
        panel.refresh()
        shown = panel.rollouts.batch
        _record_batch(tiny)
        panel.refresh()
        assert panel.rollouts.batch == shown  # not followed again within the interval
        panel.tabs.selected_index = 0
        panel.tabs.selected_index = panel.tab_index("Rollouts")  # opened again: the newest
        panel.refresh()
        assert panel.rollouts.batch == len(tiny.rollouts) - 1
    finally:
        release.set()
    assert run.wait(WAIT_S) is RunState.FINISHED
    _record_batch(tiny)
    panel.refresh()
    assert panel.rollouts.batch == len(tiny.rollouts) - 1


def test_the_rollouts_tab_follows_a_run_of_slow_steps_every_other_step(
    panel: wb.Panel, tiny: wb.Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps slower than FOLLOW_S (injected: 0) are followed every FOLLOW_STEPS of them,
    not at each: an early RL batch is ~18 KB for the page."""
    from workbench.notebook.panel import rollouts_tab

    monkeypatch.setattr(rollouts_tab, "FOLLOW_S", 0.0)
    panel.stop_polling()  # the refreshes are the test's: a timer's between two steps would follow too
    recorded = [threading.Event() for _ in range(3)]
    go_on = [threading.Event() for _ in range(3)]

    def step(sess: wb.Session, i: int) -> dict[str, float]:
        _record_batch(sess)
        recorded[i].set()
        assert go_on[i].wait(WAIT_S)
        return {}

    panel.tabs.selected_index = panel.tab_index("Rollouts")
    run = tiny.run(step, steps=3)
    try:
        shown = []
        for i in range(3):
            assert recorded[i].wait(WAIT_S)  # batch i recorded, i steps done, the run running
            panel.refresh()
            shown.append(panel.rollouts.batch)
            go_on[i].set()
        assert shown == [0, 0, 2]
    finally:
        for event in go_on:
            event.set()
    assert run.wait(WAIT_S) is RunState.FINISHED


def _record_batch(sess: wb.Session) -> None:
    """One group of two replies, recorded as an RL step records its rollouts."""
    prompt = wb.ModelInput.from_ints(sess.tokenizer.encode("Question:"))
    sampler = sess.policy.save_weights_and_get_sampling_client()
    response = sampler.sample(prompt, 2, wb.SamplingParams(max_tokens=2, seed=0)).result()
    sess.record_rollouts([wb.RolloutGroup.of(prompt, response, [1.0, 0.0])])


def test_rows_the_saved_record_drew_while_the_tab_was_hidden_still_reach_the_page(
    panel: wb.Panel, tiny: wb.Session
) -> None:
    """The saved record draws the plot for its PNG while the Metrics tab is hidden; opening the tab
    must still send the page that drawing."""
    m = panel.metrics
    panel.tabs.selected_index = 0
    panel.train.step_button.click()
    _wait(tiny)
    assert m.png() is not None  # what the record does at a run's end: the new rows are drawn
    renders = m.renders
    panel.tabs.selected_index = panel.tab_index("Metrics")
    panel.refresh()
    assert m.renders == renders + 1


class _CountingTab:
    """A tab of the test's own: it counts its redraws and its openings."""

    def __init__(self) -> None:
        self.widget = ipywidgets.HTML("counting")
        self.refreshes = 0
        self.openings = 0

    def refresh(self) -> None:
        self.refreshes += 1

    def opened(self) -> None:
        self.openings += 1


def test_a_tab_added_as_one_row_shows_its_title_and_is_redrawn_hidden_as_its_row_says(
    tiny: wb.Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    from workbench.notebook.panel import panel as panel_module
    from workbench.notebook.panel.panel import TABS, HiddenRedraw, PanelTab

    built: dict[str, _CountingTab] = {}

    def row(title: str, hidden: HiddenRedraw) -> PanelTab:
        return PanelTab(title, lambda _given: built.setdefault(title, _CountingTab()), hidden)

    added = {
        "Every": HiddenRedraw.EVERY_REFRESH,
        "Opened": HiddenRedraw.WHEN_OPENED,
        "Idle": HiddenRedraw.BETWEEN_RUNS,
    }
    monkeypatch.setattr(
        panel_module, "TABS", (*TABS, *(row(title, hidden) for title, hidden in added.items()))
    )
    panel = tiny.panel()
    try:
        panel.stop_polling()  # the test refreshes
        assert panel.tabs.titles == (
            "Train",
            "Sample",
            "Checkpoints",
            "Metrics",
            "Runs",
            "Rollouts",
            "Sweep",
            *added,
        )
        assert panel.tabs.children[-3:] == tuple(built[title].widget for title in added)

        def redraws_in_one_refresh() -> dict[str, int]:
            before = {title: tab.refreshes for title, tab in built.items()}
            panel.refresh()
            return {title: tab.refreshes - before[title] for title, tab in built.items()}

        assert redraws_in_one_refresh() == {"Every": 1, "Opened": 0, "Idle": 1}  # no run: hidden
        entered, release = threading.Event(), threading.Event()

        def step(sess: wb.Session, i: int) -> None:
            entered.set()
            assert release.wait(WAIT_S)

        run = tiny.run(step, steps=1)
        try:
            assert entered.wait(WAIT_S)
            assert redraws_in_one_refresh() == {"Every": 1, "Opened": 0, "Idle": 0}  # a run: hidden
            panel.tabs.selected_index = panel.tab_index("Opened")
            assert built["Opened"].openings == 1 and built["Idle"].openings == 0
            assert redraws_in_one_refresh() == {"Every": 1, "Opened": 1, "Idle": 0}  # shown
            panel.tabs.selected_index = panel.tab_index("Idle")
            assert redraws_in_one_refresh() == {"Every": 1, "Opened": 0, "Idle": 1}
        finally:
            release.set()
        assert run.wait(WAIT_S) is RunState.FINISHED
    finally:
        panel.close()


def test_the_saved_record_names_each_counter_and_draws_the_plot_unzoomed(
    panel: wb.Panel, tiny: wb.Session
) -> None:
    """What a kernel-less front end shows of the panel: a one-line text form, not ipywidgets' repr of
    every child; a record whose optimizer and run counters say which is which; plots without a zoom
    the user left on the toolbar."""
    from workbench.notebook.panel.record import PANEL_TEXT

    assert panel._repr_mimebundle_()["text/plain"] == PANEL_TEXT
    panel.train.steps.value = 3
    panel.train.run_button.click()
    _wait(tiny)
    panel.refresh()
    body, png = panel._snapshot()
    text = " ".join(html.unescape(re.sub("<[^>]+>", " ", body)).split())
    assert "optimizer step 3" in text and "run step 3/3" in text, text
    ax = panel.metrics.plot.axes["loss:sum"]
    shown = ax.get_xlim(), ax.get_ylim()
    ax.set_xlim(1.2, 1.8)  # the toolbar's zoom sets limits so, turning autoscaling off
    ax.set_ylim(0.0, 1.0)
    zoomed = panel._snapshot()[1]
    assert zoomed == png and (ax.get_xlim(), ax.get_ylim()) == ((1.2, 1.8), (0.0, 1.0))
    assert not ax.get_autoscalex_on() and shown != (ax.get_xlim(), ax.get_ylim())
