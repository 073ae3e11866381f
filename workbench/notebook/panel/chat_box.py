"""The chat box of the Sample tab: a conversation with the live policy, the base model or a sampler
checkpoint, kept turn after turn.

Each turn renders the whole conversation with the model's chat template, as the OpenAI- and
Anthropic-compatible endpoints render a chat (`workbench.loops.chat`), and samples the reply
through the session's sampling clients (`sess.sampling_client()`, `sampling_client(base=True)`,
`policy.create_sampling_client(model_path=...)`), stopping at the template's end of turn: what a chat
client of `sess.openai_client()` would get, without a server. Sampling runs on the worker; Send returns
at once and the reply is drawn when it arrives.
"""

from __future__ import annotations

import concurrent.futures
import html
from typing import TYPE_CHECKING

import ipywidgets

from workbench.loops.chat import end_of_turn_ids, render_chat
from workbench.notebook.panel.feedback import Feedback
from workbench.tinker_api.clients import SamplingClient
from workbench.types import ModelInput, SampleResponse, SamplingParams

if TYPE_CHECKING:
    from workbench.notebook.session import Session

LIVE = "live"
"""The weights picker's value for the policy's current weights."""

BASE = "base"
"""The weights picker's value for the base model."""


class ChatBox:
    """A transcript, a message box, Send and New chat, the weights to talk to, max_tokens, temperature."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.feedback = Feedback()
        self.messages: list[dict[str, str]] = []
        """The conversation so far: {"role", "content"} dicts, as the chat template reads them."""
        self.weights = ipywidgets.Dropdown(description="chat with")
        self.message = ipywidgets.Textarea(
            placeholder="message", layout=ipywidgets.Layout(width="100%", height="3em")
        )
        self.max_tokens = ipywidgets.BoundedIntText(value=128, min=1, max=32768, description="max_tokens")
        self.temperature = ipywidgets.FloatSlider(
            value=0.7, min=0.0, max=2.0, step=0.05, description="temperature"
        )
        self.send_button = ipywidgets.Button(description="Send", icon="paper-plane", button_style="primary")
        self.send_button.add_class("wb-chat-send")
        self.new_button = ipywidgets.Button(description="New chat", icon="eraser")
        self.refresh_button = ipywidgets.Button(icon="refresh", tooltip="list the checkpoints again")
        self.transcript = ipywidgets.HTML()
        self.transcript.add_class("wb-chat-transcript")
        self.replied: concurrent.futures.Future[str] | None = None
        """Resolves with the last reply once it is drawn (or fails with its error)."""
        self.send_button.on_click(self.feedback.guard(lambda _: self.send()))
        self.new_button.on_click(self.feedback.guard(lambda _: self.new_chat()))
        self.refresh_button.on_click(self.feedback.guard(lambda _: self.refresh()))
        self.widget = ipywidgets.VBox(
            [
                ipywidgets.HTML("<b>Chat</b>"),
                self.transcript,
                self.message,
                ipywidgets.HBox([self.weights, self.refresh_button, self.max_tokens, self.temperature]),
                ipywidgets.HBox([self.send_button, self.new_button]),
                self.feedback.widget,
            ]
        )
        # an engine that stopped answering leaves the picker at the live policy and the base, and says so
        self.feedback.guard(self.refresh)()

    def refresh(self) -> None:
        """The weights picker's choices: the live policy, the base model, every sampler checkpoint (listed
        when the box is made and when its refresh button is pressed, not on every panel refresh: a
        remote session lists them over HTTP)."""
        options = [("live policy", LIVE), ("base model", BASE)]
        options += [
            (f"checkpoint {info.name}", info.tinker_path or str(info.path))
            for info in self.session.list_checkpoints()
            if info.kind == "sampler"
        ]
        if list(self.weights.options) != options:
            chosen = self.weights.value
            self.weights.options = options
            self.weights.value = chosen if chosen in {value for _, value in options} else LIVE

    def client(self) -> SamplingClient:
        chosen = self.weights.value
        if chosen == BASE:
            return self.session.sampling_client(base=True)
        if chosen == LIVE:
            return self.session.sampling_client()
        return self.session.policy.create_sampling_client(model_path=chosen).result()

    def new_chat(self) -> None:
        self.messages = []
        self.transcript.value = ""
        self.feedback.clear()

    def send(self, text: str | None = None) -> concurrent.futures.Future[str]:
        """Add a user message (the box's text, or `text`) and sample the reply."""
        text = self.message.value if text is None else text
        if not text.strip():
            raise ValueError("write a message first")
        tokenizer = self.session.tokenizer
        conversation = [*self.messages, {"role": "user", "content": text}]
        prompt = render_chat(tokenizer, conversation)
        params = SamplingParams(
            max_tokens=self.max_tokens.value,
            temperature=self.temperature.value,
            stop=sorted(end_of_turn_ids(tokenizer)),
        )
        client = self.client()
        future = client.sample(ModelInput.from_ints(prompt), 1, params)
        self.messages = conversation
        self.message.value = ""
        self._draw(pending=True)
        replied: concurrent.futures.Future[str] = concurrent.futures.Future()
        self.replied = replied
        ends = end_of_turn_ids(tokenizer)

        def show(done: concurrent.futures.Future[SampleResponse]) -> None:
            client.close()
            try:
                tokens = list(done.result().sequences[0].tokens)
                if tokens and tokens[-1] in ends:
                    tokens = tokens[:-1]
                reply = tokenizer.decode(tokens, skip_special_tokens=True)
                self.messages = [*self.messages, {"role": "assistant", "content": reply}]
                self._draw(pending=False)
                self.feedback.clear()
                replied.set_result(reply)
            except Exception as error:
                self.feedback.error(error)
                self._draw(pending=False)
                replied.set_exception(error)

        future.future().add_done_callback(show)
        return replied

    def _draw(self, pending: bool) -> None:
        rows = []
        for message in self.messages:
            who = "you" if message["role"] == "user" else "model"
            colour = "#eef" if message["role"] == "user" else "#efe"
            rows.append(
                f'<div style="background:{colour};padding:.3em;margin:.2em 0;white-space:pre-wrap">'
                f"<b>{who}</b>: {html.escape(message['content'])}</div>"
            )
        if pending:
            rows.append('<div style="color:#666">…</div>')
        self.transcript.value = "".join(rows)
