"""The rollout explorer, driven headless: batches, the reward histogram's click-through, the groups side
by side, and the token view of what was trained on; live from a session and from a run's files."""

from __future__ import annotations

import html
import json
import re

import ipywidgets
import pytest

import workbench as wb
from tests.notebook import BYTES_PER_STEP_BUDGET
from workbench.loops.rollout_groups import RolloutGroup, rollout_data
from workbench.notebook.panel.rollouts_tab import RolloutExplorer, in_bin, reward_bins, shared_prompt_start


def _plain(fragment: str) -> str:
    return " ".join(html.unescape(re.sub("<[^>]+>", " ", fragment)).split())


def _record_step(
    sess: wb.Session, rewards: list[list[float]], seed: int, max_tokens: int = 5
) -> list[RolloutGroup]:
    """Sample one group per reward list (one prompt each), train on them, record them."""
    sampler = sess.policy.save_weights_and_get_sampling_client()
    groups = []
    for g, group_rewards in enumerate(rewards):
        prompt = wb.ModelInput.from_ints(sess.tokenizer.encode(f"Question {g}:"))
        params = wb.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed + g)
        response = sampler.sample(prompt, len(group_rewards), params).result()
        groups.append(RolloutGroup.of(prompt, response, group_rewards))
    data = rollout_data(groups)
    out = sess.policy.forward_backward(data, "importance_sampling").result() if data else None
    sess.record_rollouts(groups, trained=out)  # before optim_step: at the step that sampled
    sess.policy.optim_step(wb.AdamParams(learning_rate=1e-3)).result()
    return groups


def test_reward_bins() -> None:
    assert reward_bins([0.0, 1.0, 1.0]) == [(0.0, 0.0), (1.0, 1.0)]
    bins = reward_bins([i / 20 for i in range(21)])
    assert len(bins) == 10 and bins[0][0] == 0.0 and bins[-1][1] == 1.0
    assert reward_bins([0.0, 0.5, 1.0, 1.0, 0.5, 0.0]) == [(0.0, 0.0), (0.5, 0.5), (1.0, 1.0)]  # graded
    # a grader's probabilities, each reply its own: binned, not a bar per reply
    scores = [0.12, 0.31, 0.33, 0.48, 0.52, 0.77, 0.81, 0.9]
    bins = reward_bins(scores)
    assert len(bins) == 10 and bins[0][0] == 0.12 and bins[-1][1] == 0.9
    assert sum(in_bin(s, bins, i) for s in scores for i in range(len(bins))) == len(scores)


def test_the_lines_all_prompts_start_with_are_said_once_above_the_cards() -> None:
    system = "system\nYou are a calculator.\nuser\nWhat is 2 + 2?\nassistant\n4\nuser\n"
    prompts = [system + "What is 1 + 9?\nassistant\n", system + "What is 12 + 3?\nassistant\n"]
    assert shared_prompt_start(prompts) == system  # whole lines: not "What is 1" of the questions
    assert shared_prompt_start(prompts[:1]) == ""  # one prompt: nothing to say once
    assert shared_prompt_start(["user\nHi\n", "user\nHo\n"]) == ""  # too short to be worth a line


def test_a_batchs_shared_prompt_start_is_shown_once(tiny: wb.Session) -> None:
    sampler = tiny.policy.save_weights_and_get_sampling_client()
    header = "You are a calculator. Reply with the number only, nothing else.\n"
    groups = []
    for g in range(3):
        prompt = wb.ModelInput.from_ints(tiny.tokenizer.encode(f"{header}Question {g}:"))
        response = sampler.sample(prompt, 2, wb.SamplingParams(max_tokens=3, seed=g)).result()
        groups.append(RolloutGroup.of(prompt, response, [1.0, 0.0]))
    tiny.record_rollouts(groups)
    explorer = tiny.rollout_explorer()
    shown = _plain(explorer.groups.value)
    assert shown.count("You are a calculator") == 1 and "every prompt starts with" in shown
    assert all(f"…Question {g}:" in shown for g in range(3))


def test_the_explorer_shows_a_batch_and_its_histogram_opens_the_replies(tiny: wb.Session) -> None:
    _record_step(tiny, [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]], seed=0)
    explorer = tiny.rollout_explorer()
    assert explorer.batch == 0
    summary = _plain(explorer.summary.value)
    assert "batch 0" in summary and "optimizer step 0" in summary and "weights v0" in summary
    assert "2 groups, 8 replies" in summary and "reward mean 0.25" in summary

    bars = [box.children[0] for box in explorer.histogram.children]
    assert [bar.description for bar in bars] == ["6", "2"]  # reward 0: six replies, reward 1: two
    assert (
        "zero variance" in explorer.groups.value
        and explorer.groups.value.count('class="wb-rollout-group"') == 2
    )
    assert len(explorer.reply.options) == 8

    bars[1].click()  # the reward-1 bar opens its two replies
    assert explorer.bin == 1 and explorer.replies() == [(0, 0), (0, 3)]
    assert [value for _, value in explorer.reply.options] == [(0, 0), (0, 3)]
    assert explorer.groups.value.count("background:#d9f0ff") == 2
    assert "group 0 · reply 0 · reward 1" in _plain(explorer.tokens.value)
    bars[1].click()  # clicking the open bar closes it
    assert explorer.bin is None and len(explorer.reply.options) == 8


def test_the_token_view_shows_what_was_trained_on(tiny: wb.Session) -> None:
    _record_step(tiny, [[1.0, 0.0], [0.5, 0.5]], seed=5)
    explorer = tiny.rollout_explorer()
    recorded = tiny.rollouts[0][0]
    assert recorded.trainer_logprobs is not None and recorded.trainer_logprobs[0] is not None

    explorer.show_reply(0, 0, "advantage")
    assert "advantage 0.5" in explorer.tokens.value  # reward 1 − group mean 0.5, on every reply token
    explorer.show_reply(0, 0, "mismatch")
    titles = re.findall(r'title="token \d+, mismatch ([^"]+)"', explorer.tokens.value)
    expected = [
        q - p for q, p in zip(recorded.sequences[0].logprobs, recorded.trainer_logprobs[0], strict=True)
    ]
    assert len(titles) == len(expected) and all(abs(float(t)) < 1e-3 for t in titles)
    explorer.show_reply(0, 1, "trainer logprob")
    assert "logprob" in explorer.tokens.value and "not trained" not in explorer.tokens.value
    explorer.show_reply(1, 0, "trainer logprob")  # an all-equal group: advantage 0, not trained on
    assert "not trained on (advantage 0)" in explorer.tokens.value
    explorer.show_reply(1, 0, "weight")
    assert "weight 0" in explorer.tokens.value
    with pytest.raises(ValueError, match="view must be one of"):
        explorer.show_reply(0, 0, "entropy")


def test_a_finished_run_is_explored_from_its_files_and_a_live_one_follows_new_batches(
    tiny: wb.Session,
) -> None:
    explorer = tiny.rollout_explorer()
    assert "No rollouts recorded yet" in explorer.summary.value and explorer.slider.disabled
    _record_step(tiny, [[1.0, 0.0]], seed=1)
    explorer.refresh()
    assert explorer.batch == 0
    _record_step(tiny, [[0.0, 0.0]], seed=2)
    explorer.refresh()  # on the newest batch: follows to the next
    assert explorer.batch == 1 and "optimizer step 1" in _plain(explorer.summary.value)
    explorer.select_batch(0)
    _record_step(tiny, [[1.0, 1.0]], seed=3)
    explorer.refresh()  # looking at an older batch: stays there
    assert explorer.batch == 0 and explorer.slider.max == 2

    from_files = RolloutExplorer.from_model_dir(tiny.model_dir, tiny.tokenizer)
    assert from_files.batch == 2 and from_files.groups.value == tiny.rollout_explorer().groups.value


def test_following_a_new_batch_keeps_the_open_bar_and_reply_until_follow_is_turned_off(
    tiny: wb.Session,
) -> None:
    explorer = tiny.rollout_explorer()
    _record_step(tiny, [[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0]], seed=0)
    explorer.refresh()
    assert explorer.follow.value and explorer.follow.description == "follow newest"
    explorer.open_bin(1)  # reward 1
    explorer.show_reply(0, 3, "advantage")
    _record_step(tiny, [[0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 0.0]], seed=1)
    explorer.refresh()  # follows to the new batch with the reward-1 bar still open, the reply kept
    assert explorer.batch == 1 and explorer.bin == 1
    assert explorer.replies() == [(0, 1), (0, 2), (1, 2)]
    bars = [box.children[0] for box in explorer.histogram.children]
    assert [bar.button_style for bar in bars] == ["", "info"]
    assert explorer.reply.value == (0, 1) and explorer.view.value == "advantage"
    explorer.show_reply(1, 2)
    _record_step(tiny, [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]], seed=2)
    explorer.refresh()
    assert explorer.batch == 2 and explorer.bin == 1 and explorer.reply.value == (1, 2)

    explorer.follow.value = False  # the toggle off: new batches wait
    _record_step(tiny, [[1.0, 1.0, 0.0, 0.0]], seed=3)
    explorer.refresh()
    assert explorer.batch == 2 and explorer.slider.max == 3
    explorer.follow.value = True  # and on again: the newest at once
    assert explorer.batch == 3 and explorer.bin == 1
    explorer.select_batch(0)  # an older batch chosen: following stops
    assert not explorer.follow.value


def test_the_panel_has_a_live_rollouts_tab(tiny: wb.Session) -> None:
    panel = tiny.panel()
    try:
        assert "Rollouts" in panel.tabs.titles
        _record_step(tiny, [[1.0, 0.0, 1.0]], seed=0)
        panel.refresh()
        assert panel.rollouts.batch is None  # a hidden tab is not redrawn
        panel.tabs.selected_index = panel.tab_index(
            "Rollouts"
        )  # opening it is (the timer's next refresh, here at once)
        panel.refresh()
        assert panel.rollouts.batch == 0 and [
            b.children[0].description for b in panel.rollouts.histogram.children
        ] == ["1", "2"]
        assert "trained on 3/3" in panel.rollouts.summary.value
        bars = panel.rollouts.histogram.children
        _record_step(tiny, [[0.0, 1.0, 1.0]], seed=1)
        panel.refresh()
        assert panel.rollouts.batch == 1 and panel.rollouts.histogram.children == bars  # bars reused
    finally:
        panel.close()


def test_a_rollouts_prompt_is_sampled_again_from_the_sample_tab(tiny: wb.Session) -> None:
    """The Sample tab reproduces a task's whole prompt (chat template, system message, examples)."""
    panel = tiny.panel()
    try:
        _record_step(tiny, [[1.0, 0.0]], seed=0)
        panel.tabs.selected_index = panel.tab_index("Rollouts")
        panel.refresh()
        panel.rollouts.sample_button.click()
        s = panel.sample
        assert panel.tabs.selected_index == panel.tab_index("Sample")
        assert s.exact_prompt == tiny.rollouts[0][0].prompt_tokens
        assert s.model_input().to_ints() == tiny.rollouts[0][0].prompt_tokens and s.chat.disabled
        s.max_tokens.value = 2
        s.sample_button.click()
        s.rendered.result(30)
        s.prompt.value = "something else"  # typing goes back to a typed prompt
        assert s.exact_prompt is None and s.exact_note.value == ""
    finally:
        panel.close()


def test_a_new_batch_reaches_the_page_within_the_step_budget(
    tiny: wb.Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the explorer sends the page when it follows a new batch (8 groups of 4 replies of 48 tokens,
    the size of an RL tutorial's step): the widgets' messages, counted as the kernel sends them, fit the
    panel's per-step budget (21.5 KB before the groups' and tokens' repeated styles were said once, 18.0
    KB before the tables left out their optional end tags), in few messages."""
    explorer = tiny.rollout_explorer()
    rewards = [[float((g + r) % 3 == 0) for r in range(4)] for g in range(8)]
    _record_step(tiny, rewards, seed=0, max_tokens=48)
    explorer.refresh()
    sent = []
    send = ipywidgets.Widget._send

    def counted(widget: ipywidgets.Widget, msg: dict, buffers: list | None = None) -> None:
        sent.append(len(json.dumps(msg)) + sum(len(b) for b in buffers or []))
        send(widget, msg, buffers)

    monkeypatch.setattr(ipywidgets.Widget, "_send", counted)
    _record_step(tiny, rewards, seed=100, max_tokens=48)
    explorer.refresh()
    assert explorer.batch == 1 and len(explorer.reply.options) == 32
    print(f"a new batch: {sum(sent)} bytes in {len(sent)} messages")
    assert 0 < sum(sent) <= BYTES_PER_STEP_BUDGET
    # each message also costs the page ~550 bytes of headers: a widget's changes go in one (7 before)
    assert len(sent) <= 5, len(sent)
