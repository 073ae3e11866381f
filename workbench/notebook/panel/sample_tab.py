"""The Sample tab: sample the policy (at any live weight version) or the base model, and read the
outputs token by token, coloured by the sampler's logprob of each token.

The tab calls what a cell would: `sess.sampling_client(version)` and `client.sample(prompt, n,
SamplingParams(...))`, with the prompt rendered by `wb.chat_prompt` when the chat-template box is
ticked. Sampling runs on the session's worker thread; the button returns at once and the outputs are
drawn when the samples arrive, so the kernel is never blocked waiting for them.
"""

from __future__ import annotations

import concurrent.futures
import html
from typing import TYPE_CHECKING

import ipywidgets

from workbench.loops.chat import chat_prompt
from workbench.notebook.panel.chat_box import ChatBox
from workbench.notebook.panel.feedback import Feedback
from workbench.notebook.token_view import STOP_REASONS, render_sample
from workbench.tinker_api.clients import SamplingClient
from workbench.types import ModelInput, SampleResponse, SamplingParams

if TYPE_CHECKING:
    from workbench.notebook.session import Session

BASE = "base"
"""The version picker's value for the base model (adapters off)."""

CURRENT = "current"
"""The version picker's value for the policy's current weights, whatever their version."""


class SampleTab:
    """Prompt, chat-template toggle, sampling parameters, version picker, Sample button, outputs."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.feedback = Feedback()
        has_template = session.tokenizer.chat_template is not None
        self.prompt = ipywidgets.Textarea(
            placeholder="prompt", layout=ipywidgets.Layout(width="100%", height="5em")
        )
        self.chat = ipywidgets.Checkbox(
            value=has_template,
            disabled=not has_template,
            description="chat template",
            tooltip="render the prompt as a user message with the tokenizer's chat template",
        )
        self.temperature = ipywidgets.FloatSlider(
            value=1.0,
            min=0.0,
            max=2.0,
            step=0.05,
            description="temperature",
            style={"description_width": "initial"},
        )
        self.top_p = ipywidgets.FloatSlider(value=1.0, min=0.05, max=1.0, step=0.05, description="top_p")
        self.max_tokens = ipywidgets.BoundedIntText(value=64, min=1, max=32768, description="max_tokens")
        self.num_samples = ipywidgets.BoundedIntText(value=2, min=1, max=64, description="samples")
        self.seed = ipywidgets.Text(value="", placeholder="random", description="seed")
        self.version = ipywidgets.Dropdown(description="weights")
        self.sample_button = ipywidgets.Button(description="Sample", icon="comment", button_style="primary")
        self.sample_button.add_class("wb-sample")
        self.output = ipywidgets.HTML()
        self.output.add_class("wb-sample-output")
        self.rendered: concurrent.futures.Future[SampleResponse] | None = None
        """Resolves once the last Sample click's outputs are drawn (or fails with its error)."""
        self.sample_button.on_click(self.feedback.guard(self._on_sample))
        self.exact_prompt: list[int] | None = None
        """Tokens to sample from as they are (a rollout's whole prompt: system message and examples
        included), set by `use_prompt`; editing the prompt's text goes back to a typed prompt."""
        self.exact_note = ipywidgets.HTML()
        self._setting_prompt = False
        self.prompt.observe(lambda _change: self._on_prompt_edit(), names="value")
        self.widget = ipywidgets.VBox(
            [
                self.prompt,
                self.exact_note,
                ipywidgets.HBox([self.chat, self.version]),
                ipywidgets.HBox([self.temperature, self.top_p]),
                ipywidgets.HBox([self.max_tokens, self.num_samples, self.seed]),
                self.sample_button,
                self.feedback.widget,
                self.output,
            ]
        )
        self.chat_box = ChatBox(session)
        """A conversation with the live policy, the base model or a checkpoint (below the outputs)."""
        self.widget.children = (*self.widget.children, self.chat_box.widget)
        self.refresh()  # the weights versions of now; the panel refreshes them while the tab is shown

    # ------------------------------------------------------------------------------------------ settings

    def sampling_params(self) -> SamplingParams:
        seed_text = self.seed.value.strip()
        if seed_text and not seed_text.lstrip("-").isdigit():
            raise ValueError(f"seed must be an integer or empty (random), got {seed_text!r}")
        return SamplingParams(
            max_tokens=self.max_tokens.value,
            temperature=self.temperature.value,
            top_p=self.top_p.value,
            seed=int(seed_text) if seed_text else None,
        )

    def use_prompt(self, tokens: list[int]) -> None:
        """Sample from exactly these prompt tokens (the rollout explorer's "Sample this prompt")."""
        self.exact_prompt = list(tokens)
        self._setting_prompt = True
        try:
            self.prompt.value = self.session.tokenizer.decode(self.exact_prompt)
        finally:
            self._setting_prompt = False
        self.chat.disabled = True
        self.exact_note.value = (
            f"<i>the exact {len(self.exact_prompt)} prompt tokens of a rollout (chat template, system "
            "message and examples included); edit the text to type a prompt of your own</i>"
        )

    def _on_prompt_edit(self) -> None:
        if self._setting_prompt or self.exact_prompt is None:
            return
        self.exact_prompt = None
        self.exact_note.value = ""
        self.chat.disabled = self.session.tokenizer.chat_template is None

    def model_input(self) -> ModelInput:
        if self.exact_prompt is not None:
            return ModelInput.from_ints(self.exact_prompt)
        text = self.prompt.value
        if not text:
            raise ValueError("write a prompt first")
        if self.chat.value:
            return chat_prompt(self.session.tokenizer, [{"role": "user", "content": text}])
        return ModelInput.from_ints(self.session.tokenizer(text).input_ids)

    def client(self) -> SamplingClient:
        choice = self.version.value
        if choice == BASE:
            return self.session.sampling_client(base=True)
        return self.session.sampling_client(None if choice == CURRENT else int(choice))

    # ------------------------------------------------------------------------------------------ sampling

    def _on_sample(self, _button: ipywidgets.Button) -> None:
        prompt = self.model_input()
        params = self.sampling_params()
        client = self.client()
        future = client.sample(prompt, self.num_samples.value, params)
        rendered: concurrent.futures.Future[SampleResponse] = concurrent.futures.Future()
        self.rendered = rendered
        source = dict((value, label) for label, value in self.version.options)[self.version.value]
        self.feedback.info(
            f"sampling {self.num_samples.value} from {source}"
            + ("" if params.max_tokens is None else f", up to {params.max_tokens} tokens each")
            + " …"
        )

        def show(done: concurrent.futures.Future[SampleResponse]) -> None:
            client.close()  # the client pinned its weights until its samples were drawn
            try:
                response = done.result()
                self.output.value = self._render(prompt, response)
                self.feedback.clear()
                rendered.set_result(response)
            except Exception as error:
                self.feedback.error(error)
                rendered.set_exception(error)

        future.future().add_done_callback(show)

    def _render(self, prompt: ModelInput, response: SampleResponse) -> str:
        tokenizer = self.session.tokenizer
        parts = [
            '<div style="color:#666;font-size:smaller">prompt</div>',
            f'<pre style="white-space:pre-wrap;margin:0 0 .5em 0">{html.escape(tokenizer.decode(prompt.to_ints()))}</pre>',
        ]
        weights = "base model" if response.weights_version is None else f"weights v{response.weights_version}"
        for index, sequence in enumerate(response.sequences):
            parts.append(
                f'<div style="color:#666;font-size:smaller;margin-top:.5em">sample {index} · {weights} · '
                f"{len(sequence.tokens)} tokens · {html.escape(STOP_REASONS[sequence.stop_reason])}</div>"
            )
            parts.append(render_sample(tokenizer, sequence).html)
        return "".join(parts)

    # ------------------------------------------------------------------------------------------ view

    def opened(self) -> None:
        """Nothing to catch up on: its next refresh draws what is new."""

    def refresh(self) -> None:
        current = self.session.policy.weights_version
        options = [(f"current (v{current})", CURRENT)]
        options += [
            (f"v{version}", str(version)) for version in self.session.live_versions() if version != current
        ]
        options.append(("base model", BASE))
        if list(self.version.options) != options:
            chosen = self.version.value
            with self.version.hold_sync():  # a new version every RL step: one message, not three
                self.version.options = options
                self.version.value = chosen if chosen in {value for _, value in options} else CURRENT
