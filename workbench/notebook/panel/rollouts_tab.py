"""The Rollouts tab and its rollout explorer: what an RL step sampled, how it was scored, and what was
trained on.

For any recorded batch (one `Session.record_rollouts` call, usually one RL step) the explorer shows:

- a summary line: the batch, the optimizer step and weights version that sampled it, its rewards;
- a reward histogram whose bars are buttons: a click opens the replies behind the bar (they are
  highlighted in the groups and listed in the reply picker, the first one shown token by token);
- the groups side by side, one card per prompt: the prompt, then each reply with its reward,
  advantage, length, stop reason and whether it was trained on (a zero advantage trains nothing);
- the token view of one reply, coloured by the sampler's logprob, the trainer's logprob, the
  advantage, the loss weight, or the sampler-vs-trainer mismatch (hover a token for its value).

It reads a `RolloutLog`: the live session's (`sess.rollout_explorer()`, which follows new batches as
they are recorded when `refresh()` is called, while its "follow newest" toggle is on) or a finished run's
folder
(`RolloutExplorer.from_model_dir(model_dir, tokenizer)`). The panel's tab (`RolloutsTab`) is the live
explorer, following a running run's batches at a pace the page can take.
"""

from __future__ import annotations

import html
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import ipywidgets
from transformers import PreTrainedTokenizerBase

from workbench.loops.rollout_groups import RolloutGroup
from workbench.notebook.rollout_log import RolloutLog
from workbench.notebook.token_view import STOP_REASONS, ValueKind, render_tokens
from workbench.notebook.widget_subshell import answer_while_busy

if TYPE_CHECKING:
    from workbench.notebook.run import Run, RunMark
    from workbench.notebook.session import Session

FOLLOW_S = 5.0
"""While a run runs, the Rollouts tab follows its new batches at most this often (and at once when it is
opened): a batch of an RL tutorial's 32 replies is about 10 KB for the page, and nobody reads 32 replies
in less."""
FOLLOW_STEPS = 2
"""... and at most every this many of its steps: a batch of tutorial 04's first, untrained steps (the
longest replies) is ~18 KB for the page, and a run whose steps take longer than FOLLOW_S sent one at
every step, 24 KB per step with the rest of the panel against a budget of 20 KB."""
MAX_DISTINCT_REWARDS = 8
"""Up to this many distinct rewards get a bar each (0/1 rewards: two bars) when the replies share them;
more, or values that no two replies share (a continuous score), are binned."""
NUM_BINS = 10
BAR_HEIGHT_PX = 90
REPLY_PREVIEW_CHARS = 60
PICKER_PREVIEW_CHARS = 20
"""Of each reply in the reply picker's labels (the cards show more): all of a batch's labels are sent
with it."""
PROMPT_PREVIEW_CHARS = 160
SHARED_PROMPT_MIN_CHARS = 40
"""A start of line(s) common to a batch's prompts at least this long is shown once above the cards."""
GROUPS_STYLE = (
    "<style>"
    ".wb-rollout-cards{display:flex;flex-wrap:wrap;gap:8px;padding-bottom:4px}"  # rows within the width
    ".wb-rollout-group{flex:0 0 auto;min-width:18em;max-width:30em;border:1px solid #ddd;"
    "border-radius:4px;padding:4px 6px;font-size:smaller}"
    ".wb-rollout-group>div:first-child{color:#444}"
    ".wb-rollout-group .wb-prompt{color:#666;white-space:pre-wrap}"
    ".wb-rollout-group pre{white-space:pre-wrap}"
    ".wb-rollout-group table{border-collapse:collapse}"
    ".wb-rollout-group td:first-child{white-space:pre-wrap;font-family:monospace}"
    "</style>"
)
"""The groups' style, said once per batch's HTML rather than on each card and cell."""

# The token view's colourings: (label, what is shown)
VIEWS = ("sampler logprob", "trainer logprob", "advantage", "weight", "mismatch")


def reward_bins(rewards: Sequence[float]) -> list[tuple[float, float]]:
    """`(low, high)` bins covering `rewards`: one per distinct value (low == high) for a discrete reward,
    whose few values the replies share (at most `MAX_DISTINCT_REWARDS` values, at most two or at most
    half as many as the replies), else `NUM_BINS` equal-width bins, the last one closed on the right: a
    continuous score (a grader's probability) gives every reply its own value, and a bar per value would
    be a list of bars of height 1."""
    distinct = sorted(set(rewards))
    discrete = len(distinct) <= 2 or 2 * len(distinct) <= len(rewards)
    if len(distinct) <= MAX_DISTINCT_REWARDS and discrete:
        return [(v, v) for v in distinct]
    low, high = distinct[0], distinct[-1]
    width = (high - low) / NUM_BINS
    return [(low + i * width, low + (i + 1) * width if i < NUM_BINS - 1 else high) for i in range(NUM_BINS)]


def in_bin(reward: float, bins: Sequence[tuple[float, float]], index: int) -> bool:
    low, high = bins[index]
    if low == high:
        return reward == low
    last = index == len(bins) - 1
    return low <= reward < high or (last and reward == high)


def matching_bin(bins: Sequence[tuple[float, float]], opened: tuple[float, float]) -> int | None:
    """The bar of `bins` that shows the rewards the `opened` bar of another batch did: the one with the
    same bounds, else the one holding its middle; None when no bar does. Following a new batch keeps
    the user's open bar this way (a 0/1 reward's bars are the same two every batch)."""
    if opened in bins:
        return list(bins).index(opened)
    middle = (opened[0] + opened[1]) / 2
    return next((i for i in range(len(bins)) if in_bin(middle, bins, i)), None)


def _bin_label(low: float, high: float) -> str:
    return f"{low:.3g}" if low == high else f"{low:.2g}–{high:.2g}"


def shared_prompt_start(prompts: Sequence[str]) -> str:
    """The whole lines every prompt of a batch starts with (a chat template's system message and
    worked examples), when there are two prompts or more and they share at least
    `SHARED_PROMPT_MIN_CHARS`: said once above the cards instead of on every card; else ""."""
    if len(prompts) < 2:
        return ""
    first, last = min(prompts), max(prompts)  # what these two share, all the prompts do
    length = next((i for i, (a, b) in enumerate(zip(first, last, strict=False)) if a != b), len(first))
    lines = first[: first.rfind("\n", 0, length) + 1]
    return lines if len(lines) >= SHARED_PROMPT_MIN_CHARS else ""


def _text(tokenizer: PreTrainedTokenizerBase, tokens: Sequence[int]) -> str:
    """The tokens as text without the chat template's special tokens (`<|im_start|>` ...): a chat prompt
    reads as its turns, each role on a line of its own before what it said."""
    return tokenizer.decode(list(tokens), skip_special_tokens=True)


class RolloutExplorer(ipywidgets.VBox):
    """Browse the recorded rollouts of a run (see the module docstring).

    `select_batch(k)`, `open_bin(i)` (a histogram bar's click), `show_reply(group, reply, view)`,
    `follow.value = ...` and `refresh()` do from code what the controls do.

    While `follow` ("follow newest") is on, `refresh()` shows each new batch as it is recorded, keeping
    what the user chose: the open bar (the same rewards'), the reply (the same group and reply, when
    the bar has it) and the colouring. Choosing an older batch turns following off, choosing the
    newest turns it on; the toggle shows which.
    """

    def __init__(
        self,
        rollouts: RolloutLog,
        tokenizer: PreTrainedTokenizerBase,
        *,
        sample_prompt: Callable[[list[int]], None] | None = None,
    ) -> None:
        """`sample_prompt(tokens)`, when given, is what the "Sample this prompt" button calls with the
        chosen reply's prompt tokens (the panel opens its Sample tab on them)."""
        self.rollouts = rollouts
        self.tokenizer = tokenizer
        self.batch: int | None = None
        self.bin: int | None = None
        self.bins: list[tuple[float, float]] = []
        self.slider = ipywidgets.IntSlider(
            value=0, min=0, max=0, description="batch", continuous_update=False, disabled=True
        )
        self.follow = ipywidgets.ToggleButton(
            value=True,
            description="follow newest",
            icon="forward",
            tooltip="show each new batch as it is recorded, keeping the open bar and reply",
            layout=ipywidgets.Layout(width="auto"),
        )
        self.follow.add_class("wb-rollouts-follow")
        self.summary = ipywidgets.HTML()
        self.histogram = ipywidgets.HBox(layout=ipywidgets.Layout(align_items="flex-end"))
        self.histogram.add_class("wb-reward-histogram")
        self._bars: list[tuple[ipywidgets.VBox, ipywidgets.Button, ipywidgets.HTML]] = []
        self.groups = ipywidgets.HTML()
        self.groups.add_class("wb-rollout-groups")
        self.reply = ipywidgets.Dropdown(description="reply", layout=ipywidgets.Layout(width="32em"))
        self.view = ipywidgets.ToggleButtons(options=VIEWS, value="sampler logprob")
        self.view.style.button_width = "10.5em"
        self.tokens = ipywidgets.HTML()
        self.tokens.add_class("wb-rollout-tokens")
        self.sample_button = ipywidgets.Button(
            description="Sample this prompt", icon="comment", tooltip="sample the chosen reply's prompt again"
        )
        self.sample_button.layout.display = None if sample_prompt is not None else "none"
        if sample_prompt is not None:
            self.sample_button.on_click(lambda _button: self._sample_selected(sample_prompt))
        self.slider.observe(lambda change: self.select_batch(change["new"]), names="value")
        self.follow.observe(lambda change: self._followed(change["new"]), names="value")
        self.reply.observe(lambda change: self._show_selected(), names="value")
        self.view.observe(lambda change: self._show_selected(), names="value")
        super().__init__(
            [
                ipywidgets.HBox([self.slider, self.follow]),
                self.summary,
                ipywidgets.HTML(
                    '<div style="color:#666;font-size:smaller">rewards (click a bar for its replies)</div>'
                ),
                self.histogram,
                self.groups,
                ipywidgets.HBox([self.reply, self.sample_button]),
                self.view,
                self.tokens,
            ]
        )
        self.add_class("wb-rollouts")
        self.refresh()
        answer_while_busy(self)  # its controls answer while a cell runs

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, tokenizer: PreTrainedTokenizerBase) -> RolloutExplorer:
        """An explorer over a finished run's `rollouts.jsonl` (decoded with the run's tokenizer)."""
        return cls(RolloutLog.load(model_dir), tokenizer)

    # ------------------------------------------------------------------------------------------ data

    def _groups(self) -> list[RolloutGroup]:
        return [] if self.batch is None else self.rollouts[self.batch]

    def replies(self) -> list[tuple[int, int]]:
        """The `(group, reply)` pairs of the batch the reply picker lists (those of the open bar)."""
        return [
            (g, r)
            for g, group in enumerate(self._groups())
            for r, reward in enumerate(group.rewards)
            if self.bin is None or in_bin(reward, self.bins, self.bin)
        ]

    # ------------------------------------------------------------------------------------------ controls

    def refresh(self) -> None:
        """Follow new batches: the newest is shown while the view was on the newest (or on none)."""
        count = len(self.rollouts)
        if count == 0:
            self.summary.value = (
                "<i>No rollouts recorded yet: an RL step records them with "
                "<code>sess.record_rollouts(groups, trained=out)</code>.</i>"
            )
            return
        following = self.batch is None or self.follow.value
        with self.slider.hold_sync():  # one message for the slider's changes (see BYTES_PER_STEP)
            self.slider.disabled = False
            self.slider.max = count - 1
            if following and self.batch != count - 1:
                self.slider.value = count - 1  # calls select_batch
        if following and self.batch != count - 1:
            self.select_batch(count - 1)

    def select_batch(self, batch: int) -> None:
        if not 0 <= batch < len(self.rollouts):
            raise ValueError(f"batch must be in [0, {len(self.rollouts) - 1}], got {batch}")
        opened = self.bins[self.bin] if self.bin is not None else None
        self.batch = batch
        if self.slider.value != batch:
            self.slider.value = batch
        self.follow.value = batch == len(self.rollouts) - 1
        groups = self._groups()
        rewards = [r for group in groups for r in group.rewards]
        self.bins = reward_bins(rewards)
        self.bin = None if opened is None else matching_bin(self.bins, opened)
        versions = sorted({g.weights_version for g in groups if g.weights_version is not None})
        step = groups[0].step
        replies = len(rewards)
        trained = sum(sum(group.trained) for group in groups)
        mean = sum(rewards) / replies
        self.summary.value = (
            f'<span data-field="batch">batch {batch}</span> · '
            f'<span data-field="batch-step">optimizer step {step}</span> · '
            f"weights {', '.join(f'v{v}' for v in versions) or 'base model'} · {len(groups)} groups, "
            f'{replies} replies · <span data-field="trained">trained on {trained}/{replies}</span> · '
            f"reward mean {mean:.3g}"
        )
        self._draw_histogram(rewards)
        self._update_replies()

    def _followed(self, on: bool) -> None:
        """The toggle turned on: show the newest batch now (turned off: stay where the view is)."""
        newest = len(self.rollouts) - 1
        if on and newest >= 0 and self.batch != newest:
            self.select_batch(newest)

    def open_bin(self, index: int | None) -> None:
        """Open histogram bar `index` (None: every reply): its replies are highlighted and listed."""
        if index is not None and not 0 <= index < len(self.bins):
            raise ValueError(f"bar must be in [0, {len(self.bins) - 1}], got {index}")
        self.bin = index
        for i, (_column, bar, _label) in enumerate(self._bars):
            bar.button_style = "info" if i == index else ""
        self._update_replies()

    def show_reply(self, group: int, reply: int, view: str | None = None) -> None:
        """Show reply `reply` of group `group` token by token, coloured by `view` (one of `VIEWS`)."""
        if view is not None:
            if view not in VIEWS:
                raise ValueError(f"view must be one of {VIEWS}, got {view!r}")
            self.view.value = view
        self.reply.value = (group, reply)
        self._show_selected()

    def _sample_selected(self, sample_prompt: Callable[[list[int]], None]) -> None:
        if self.reply.value is not None:
            g, _ = self.reply.value
            sample_prompt(self._groups()[g].prompt_tokens)

    # ------------------------------------------------------------------------------------------ drawing

    def _draw_histogram(self, rewards: Sequence[float]) -> None:
        """One button per bin, its height the bin's count. The bars of the last batch are reused (a new
        widget costs the page a message per part of it; a changed bar, one small update)."""
        counts = [sum(in_bin(r, self.bins, i) for r in rewards) for i in range(len(self.bins))]
        top = max(counts, default=1) or 1
        while len(self._bars) < len(self.bins):
            self._bars.append(self._new_bar(len(self._bars)))
        for i, ((low, high), count, (_column, bar, label)) in enumerate(
            zip(self.bins, counts, self._bars, strict=False)
        ):
            with bar.hold_sync():
                bar.description = str(count)
                bar.tooltip = f"the replies of reward {_bin_label(low, high)} (click to open them)"
                bar.button_style = "info" if i == self.bin else ""
            bar.layout.height = f"{max(round(BAR_HEIGHT_PX * count / top), 18)}px"
            label.value = f'<div style="text-align:center;font-size:smaller;width:4.5em">{html.escape(_bin_label(low, high))}</div>'
        shown = tuple(column for column, _bar, _label in self._bars[: len(self.bins)])
        if self.histogram.children != shown:
            self.histogram.children = shown
            answer_while_busy(self.histogram)

    def _new_bar(self, i: int) -> tuple[ipywidgets.VBox, ipywidgets.Button, ipywidgets.HTML]:
        bar = ipywidgets.Button(layout=ipywidgets.Layout(width="4.5em", padding="0"))
        bar.add_class("wb-reward-bar")
        bar.on_click(lambda _button: self.open_bin(None if self.bin == i else i))
        label = ipywidgets.HTML()
        column = ipywidgets.VBox([bar, label], layout=ipywidgets.Layout(align_items="center"))
        return column, bar, label

    def _update_replies(self) -> None:
        groups = self._groups()
        chosen = set(self.replies())
        kept = self.reply.value if self.reply.value in chosen else None  # the same group and reply
        options = []
        for g, r in self.replies():
            group = groups[g]
            text = _text(self.tokenizer, group.sequences[r].tokens).strip()
            preview = text if len(text) <= PICKER_PREVIEW_CHARS else text[: PICKER_PREVIEW_CHARS - 1] + "…"
            options.append(
                (
                    f"group {g} · reply {r} · reward {group.rewards[r]:.3g} · adv {group.advantages[r]:+.3g} · {preview!r}",
                    (g, r),
                )
            )
        with self.reply.hold_sync():
            self.reply.options = options
            self.reply.value = kept if kept is not None else options[0][1] if options else None
        self.groups.value = self._groups_html(groups, chosen)
        self._show_selected()

    def _groups_html(self, groups: Sequence[RolloutGroup], chosen: set[tuple[int, int]]) -> str:
        """The groups as cards side by side. This HTML is sent to the page at every batch, so what repeats
        is said once: each card's and cell's style in `GROUPS_STYLE`, the lines all prompts start with
        above the cards (`shared_prompt_start`); a prompt that fits its preview is not repeated in an
        expandable copy, and the tables leave out the end tags HTML lets them omit (`</td>`, `</th>`,
        `</tr>`: each cell ends where the next begins)."""
        prompts = [_text(self.tokenizer, group.prompt_tokens) for group in groups]
        shared = shared_prompt_start(prompts)
        cards = []
        for g, group in enumerate(groups):
            rewards = group.rewards
            mean = sum(rewards) / len(rewards)
            std = math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards))
            prompt = prompts[g][len(shared) :]
            if shared:
                prompt = "…" + prompt
            if len(prompt) <= PROMPT_PREVIEW_CHARS:
                shown_prompt = f'<div class="wb-prompt">{html.escape(prompt)}</div>'
            else:
                tail = "…" + prompt[-PROMPT_PREVIEW_CHARS:]
                shown_prompt = (
                    f'<details><summary class="wb-prompt">{html.escape(tail)}</summary>'
                    f"<pre>{html.escape(prompt)}</pre></details>"
                )
            rows = []
            for r, sequence in enumerate(group.sequences):
                text = _text(self.tokenizer, sequence.tokens)
                preview = text if len(text) <= REPLY_PREVIEW_CHARS else text[:REPLY_PREVIEW_CHARS] + "…"
                highlight = ' style="background:#d9f0ff"' if self.bin is not None and (g, r) in chosen else ""
                trained = "✓" if group.trained[r] else ""
                stop = "max_tokens" if sequence.stop_reason == "length" else "stop"
                rows.append(
                    f"<tr{highlight}><td>{html.escape(preview)}<td>{group.rewards[r]:.3g}"
                    f"<td>{group.advantages[r]:+.3g}<td>{len(sequence.tokens)}<td>{stop}<td>{trained}"
                )
            zero = " · <b>zero variance</b>" if std == 0 else ""
            version = "base" if group.weights_version is None else f"v{group.weights_version}"
            cards.append(
                f'<div class="wb-rollout-group" data-group="{g}">'
                f"<div><b>group {g}</b> · weights {version} · reward {mean:.3g} ± {std:.3g}{zero}</div>"
                f"{shown_prompt}<table><tr><th>reply<th>reward<th>adv<th>len<th>end<th>trained"
                + "".join(rows)
                + "</table></div>"
            )
        shared_html = (
            f'<details class="wb-shared-prompt"><summary class="wb-prompt">every prompt starts with these '
            f"{len(shared)} characters (… in the cards)</summary><pre>{html.escape(shared)}</pre></details>"
            if shared
            else ""
        )
        return GROUPS_STYLE + shared_html + '<div class="wb-rollout-cards">' + "".join(cards) + "</div>"

    def _show_selected(self) -> None:
        if self.reply.value is None or self.batch is None:
            self.tokens.value = ""
            return
        g, r = self.reply.value
        group = self._groups()[g]
        sequence = group.sequences[r]
        n = len(sequence.tokens)
        trainer = group.trainer_logprobs[r] if group.trainer_logprobs is not None else None
        view = self.view.value
        values: list[float | None]
        kind: ValueKind
        note = ""
        if view == "sampler logprob":
            values, kind = list(sequence.logprobs), "logprob"
        elif view == "trainer logprob":
            values, kind = (list(trainer) if trainer else [None] * n), "logprob"
        elif view == "advantage":
            values, kind = [group.advantages[r]] * n, "advantage"
        elif view == "weight":
            values, kind = [1.0 if group.trained[r] else 0.0] * n, "weight"
        else:
            values = (
                [q - p for q, p in zip(sequence.logprobs, trainer, strict=True)] if trainer else [None] * n
            )
            kind = "mismatch"
        if view in ("trainer logprob", "mismatch") and not trainer:
            note = (
                "<i>not trained on (advantage 0)</i>"
                if not group.trained[r]
                else "<i>no trainer logprobs recorded: pass <code>trained=</code> to record_rollouts</i>"
            )
        rendered = render_tokens(self.tokenizer, sequence.tokens, values, kind=kind)
        self.tokens.value = (
            f'<div style="font-size:smaller;color:#444">group {g} · reply {r} · reward {group.rewards[r]:.3g} · '
            f"advantage {group.advantages[r]:+.3g} · {n} tokens · "
            f"{html.escape(STOP_REASONS[sequence.stop_reason])} · {html.escape(view)}</div>"
            + note
            + rendered.html
        )


class RolloutsTab:
    """The panel's Rollouts tab: the session's live `explorer`, following a running run's new batches
    every `FOLLOW_S` and `FOLLOW_STEPS` at most, a run not running at every refresh."""

    def __init__(self, session: Session, sample_prompt: Callable[[list[int]], None]) -> None:
        """`sample_prompt(tokens)`: what "Sample this prompt" calls (the panel's Sample tab)."""
        self.session = session
        self.explorer = RolloutExplorer(session.rollouts, session.tokenizer, sample_prompt=sample_prompt)
        self.widget = self.explorer
        self._followed_at = -math.inf
        self._followed_mark: RunMark | None = None  # the run running then

    def opened(self) -> None:
        """Opened, the tab shows the newest batch at its next refresh."""
        self._followed_at = -math.inf
        self._followed_mark = None

    def refresh(self) -> None:
        run = self.session.current_run
        if run is not None and run.taking_steps and not self._due(run):
            return
        shown = self.explorer.batch
        self.explorer.refresh()
        if self.explorer.batch != shown:  # followed to a new batch (not: none yet, or one chosen)
            self._followed_at = time.monotonic()
            self._followed_mark = None if run is None else run.mark()

    def _due(self, run: Run) -> bool:
        """Whether the tab follows the running `run` now: FOLLOW_S and FOLLOW_STEPS after it last did."""
        if time.monotonic() - self._followed_at < FOLLOW_S:
            return False
        return run.steps_since(self._followed_mark) >= FOLLOW_STEPS
