"""A compatible API's request as the engine's sample calls, and their sequences as decoded completions.

OpenAI's chat and text completions and Anthropic's messages all come down to: some prompts (token ids),
`n` samples of each, the sampling parameters (read once, `sampling_fields`), stop strings or stop tokens,
and how many logprobs to report. `GenerationCall` holds one prompt's call: the `SampleRequest` the engine
samples, built once (`generation_call`), and how its sequences are read back. `check_calls` has the
engine check every call of a request (`EngineInterface.check_sample`: ids in the vocabulary, `max_tokens`
within what the context leaves) and counts its sequences against `max_samples_per_request`, in the
caller's thread before any of them is queued, so a refused request changes nothing and costs nothing
sized by it; the engine samples what it checked without checking it again. `generate` then submits them with `Engine.sample`: the engine's one ordered sample path,
pinned to the weights the request named, batched with whatever else queues on the same weights,
training included.

A sequence's text is decoded without special tokens and without the end-of-turn token it stopped on,
and cut before the first stop string it contains (both APIs leave the stop sequence out of the text);
its token ids and logprobs are every token the sampler drew, the stop token included, so a harness can
train on exactly what was sampled. `max_tokens=0` asks only for the prompt's logprobs (lm-eval's
loglikelihood shape): the engine samples one token, which is then left out.

`stream_generate` is the streams' counterpart of `generate`: the same calls, with a token sink
(`requests.TokenSink`) that hands each token the sampler draws from the engine's worker thread to
this event loop (`call_soon_threadsafe` into an unbounded queue: the worker never waits for a reader,
and a client gone mid-stream leaves it sampling on to the end, unhindered). The tokens are decoded as
they come into text deltas whose concatenation is the sequence's `Completion.text` exactly: a delta
waits for the tokens that complete its last character, for the token after an end-of-turn or
end-of-sequence token (which is not shown when it is the last), and for what follows a tail that could
still become a stop string; nothing after a stop string is sent. With vLLM (or a request the engine
retried alone after its batch failed) the tokens come with the result, and so do their deltas.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from transformers import PreTrainedTokenizerBase

from workbench.engine.interface import CheckedSample, EngineInterface, SamplerPin, TokenSink
from workbench.engine.local.engine import Engine
from workbench.engine.samplers.sample_request import SampleRequest
from workbench.futures import APIFuture
from workbench.loops.chat import end_of_turn_ids
from workbench.server.errors import RequestError
from workbench.server.sampling_fields import Ending, SamplingFields
from workbench.server.service import TinkerService
from workbench.types import ModelInput, SampleResponse, StopReason, TopkEntries

if TYPE_CHECKING:
    from workbench.server.served_weights import ServedWeights


@dataclass(frozen=True)
class GenerationCall:
    """One prompt's sample call: the engine's request, built once, and how its sequences are read back.

    Attributes:
        request: What the engine samples (prompt, `n`, `SamplingParams`, the logprobs to report).
        stop_strings: The stop strings the request named (a text is cut before the first it holds).
        stop_ids: Tokens that end a sequence and are not shown (the end of turn, the end of sequence).
        scores_only: `max_tokens=0`: the prompt's logprobs only (one token is sampled, then left out).
        checked: The request as the engine checked it (`check_calls`), which it samples unchecked.
    """

    request: SampleRequest
    stop_strings: tuple[str, ...] = ()
    stop_ids: frozenset[int] = frozenset()
    scores_only: bool = False
    checked: CheckedSample | None = None

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt.to_ints()

    @property
    def n(self) -> int:
        return self.request.num_samples

    @property
    def top_logprobs(self) -> int:
        return self.request.topk_sample_logprobs


def generation_call(
    prompt_ids: list[int],
    fields: SamplingFields,
    *,
    n: int = 1,
    top_logprobs: int = 0,
    prompt_top_logprobs: int | None = None,
    scores_only: bool = False,
) -> GenerationCall:
    """A prompt's call, its `SampleRequest` built here, once; `prompt_top_logprobs` (None: no prompt
    logprobs) asks for the prompt's logprobs with that many alternatives (`echo`). Raises RequestError
    naming what the request cannot be."""
    try:
        request = SampleRequest(
            ModelInput.from_ints(prompt_ids),
            n,
            fields.params,
            prompt_top_logprobs is not None,
            topk_prompt_logprobs=prompt_top_logprobs or 0,
            topk_sample_logprobs=top_logprobs,
        )
    except ValueError as error:
        raise RequestError(str(error)) from None
    return GenerationCall(request, fields.stop_strings, fields.stop_ids, scores_only)


@dataclass(frozen=True)
class Completion:
    """One sampled sequence, decoded."""

    text: str
    token_ids: list[int]  # every token drawn, the stop token included
    logprobs: list[float]
    top_logprobs: TopkEntries | None
    finish: StopReason  # "stop": a stop token or string; "length": max_tokens
    stop_string: str | None  # the stop string it ended on, if one


@dataclass(frozen=True)
class Generated:
    """One prompt's result: its tokens, their logprobs when asked (None first), its completions."""

    prompt_ids: list[int]
    prompt_logprobs: list[float | None] | None
    prompt_top_logprobs: TopkEntries | None
    completions: list[Completion]


class ModelRoutes:
    """A compatible API's work for the requests that name weights of one base model (its tokenizer
    renders and reads them), over the Tinker service and the weights it serves; a chat's reply ends with
    its turn (`ending`)."""

    def __init__(self, service: TinkerService, weights: ServedWeights, engine: Engine):
        self.service = service
        self.weights = weights
        self.engine = engine  # the base model's whose weights the requests name
        self.tokenizer = engine.tokenizer
        self.ending = chat_ending(self.tokenizer)


def chat_ending(tokenizer: PreTrainedTokenizerBase) -> Ending:
    """What ends a chat's reply: its turn's end (`loops.chat.end_of_turn_ids`), as tokens, and with
    stop strings as the text of those that are not the end-of-sequence token (which stops anyway)."""
    ids = end_of_turn_ids(tokenizer)
    return Ending(ids, tuple(token_text(tokenizer, t) for t in sorted(ids) if t != tokenizer.eos_token_id))


def text_ending(tokenizer: PreTrainedTokenizerBase) -> Ending:
    """What ends a text completion: the end-of-sequence token."""
    eos = tokenizer.eos_token_id
    return Ending(frozenset() if eos is None else frozenset({int(eos)}))


def check_calls(engine: EngineInterface, calls: Sequence[GenerationCall]) -> list[GenerationCall]:
    """Every call checked by the engine (`EngineInterface.check_sample`) and the request's sequences
    counted, before any is queued; raises RequestError naming the problem. The calls come back with what
    the engine checked, which `generate` and `stream_generate` sample without a second check."""
    limit = engine.config.max_samples_per_request
    total = sum(call.n for call in calls)
    if not calls or total > limit:
        raise RequestError(
            f"a request may ask for 1 to {limit} sequences in all (prompts x n, the server's "
            f"max_samples_per_request), this one asks for {total}"
        )
    checked = []
    for index, call in enumerate(calls):
        where = f"prompt {index}: " if len(calls) > 1 else ""
        try:
            checked.append(dataclasses.replace(call, checked=engine.check_sample(call.request)))
        except ValueError as error:
            raise RequestError(f"{where}{error}") from None
    return checked


def _submit(
    engine: Engine, pin: APIFuture[SamplerPin], call: GenerationCall, token_sink: TokenSink | None = None
) -> APIFuture[SampleResponse]:
    return engine.sample(pin, call.checked or call.request, token_sink)


async def generate(
    engine: Engine, pin: APIFuture[SamplerPin], calls: Sequence[GenerationCall]
) -> list[Generated]:
    """Run checked calls on the engine, in order, on the pinned weights; their results decoded."""
    futures = [_submit(engine, pin, call) for call in calls]
    responses: list[SampleResponse] = [await asyncio.wrap_future(future.future()) for future in futures]
    return [decode(engine.tokenizer, call, response) for call, response in zip(calls, responses, strict=True)]


def decode(tokenizer: PreTrainedTokenizerBase, call: GenerationCall, response: SampleResponse) -> Generated:
    """A sample response as completions of `call`."""
    completions = []
    for sequence in response.sequences:
        if call.scores_only:
            completions.append(Completion("", [], [], [] if call.top_logprobs else None, "length", None))
            continue
        tokens = list(sequence.tokens)
        shown = (
            tokens[:-1]
            if tokens and sequence.stop_reason == "stop" and tokens[-1] in _ends(tokenizer, call)
            else tokens
        )
        text = tokenizer.decode(shown, skip_special_tokens=True)
        stop_string = None
        found = [(text.find(s), s) for s in call.stop_strings if s in text]
        if found:
            cut, stop_string = min(found)
            text = text[:cut]
        finish: StopReason = "stop" if stop_string is not None else sequence.stop_reason
        completions.append(
            Completion(text, tokens, list(sequence.logprobs), sequence.topk_logprobs, finish, stop_string)
        )
    return Generated(
        prompt_ids=list(call.prompt_ids),
        prompt_logprobs=response.prompt_logprobs,
        prompt_top_logprobs=response.topk_prompt_logprobs,
        completions=completions,
    )


def _ends(tokenizer: PreTrainedTokenizerBase, call: GenerationCall) -> frozenset[int]:
    eos = frozenset() if tokenizer.eos_token_id is None else frozenset({int(tokenizer.eos_token_id)})
    return call.stop_ids | eos


@dataclass(frozen=True)
class TextDelta:
    """Text that sample `sequence` of call `call` adds to what its earlier deltas sent (never empty)."""

    call: int
    sequence: int
    text: str


@dataclass(frozen=True)
class SequenceDone:
    """Sample `sequence` of call `call` has ended, all its text sent; `generated` is its call's result
    (`generated.completions[sequence]` the sample's)."""

    call: int
    sequence: int
    generated: Generated


async def stream_generate(
    engine: Engine, pin: APIFuture[SamplerPin], calls: Sequence[GenerationCall]
) -> AsyncIterator[TextDelta | SequenceDone]:
    """`generate` as a stream: every sample's text deltas as its tokens are drawn, then its end.

    The samples come one after another, in the order of the calls and of their samples (a stream's
    choices are sent in that order): the first unfinished sample's deltas as they arrive, a later
    one's held until the samples before it are done. A call's samples end together, when its sample
    call returns; an engine error raises here when it does. The engine keeps sampling a stream that is
    closed early (it finishes the batch it is in); its tokens are dropped.
    """
    loop = asyncio.get_running_loop()
    arrived: asyncio.Queue[tuple[int, int, int] | int] = asyncio.Queue()  # a token, or a call that is done
    listening = True

    def hand_over(item: tuple[int, int, int] | int) -> None:
        """From the worker thread: never blocks (an unbounded queue), never raises."""
        if listening:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody reads the stream
                loop.call_soon_threadsafe(arrived.put_nowait, item)

    def sink_of(index: int) -> TokenSink:
        return lambda sequence, token: hand_over((index, sequence, token))

    futures = [
        _submit(engine, pin, call, None if call.scores_only else sink_of(index))  # its one token is left out
        for index, call in enumerate(calls)
    ]
    for index, future in enumerate(futures):
        # called on the worker after the call's last token was handed over: it arrives after them
        future.future().add_done_callback(lambda _, index=index: hand_over(index))
    texts = [[_TextStream(engine.tokenizer, call) for _ in range(call.n)] for call in calls]
    results: list[Generated | None] = [None] * len(calls)
    waiting: dict[tuple[int, int], list[str]] = {}  # deltas of samples after the one being sent
    order = [(index, sequence) for index, call in enumerate(calls) for sequence in range(call.n)]
    sending = 0
    try:
        while sending < len(order):
            item = await arrived.get()
            if isinstance(item, int):
                response = futures[item].future().result()  # the engine's error, if it failed
                done = results[item] = decode(engine.tokenizer, calls[item], response)
                for sequence, text in enumerate(texts[item]):
                    waiting.setdefault((item, sequence), []).extend(text.finish(done.completions[sequence]))
            else:
                index, sequence, token = item
                piece = texts[index][sequence].add(token)
                if piece:
                    waiting.setdefault((index, sequence), []).append(piece)
            while sending < len(order):
                index, sequence = order[sending]
                for piece in waiting.pop((index, sequence), []):
                    yield TextDelta(index, sequence, piece)
                generated = results[index]
                if generated is None:
                    break
                yield SequenceDone(index, sequence, generated)
                sending += 1
    finally:
        listening = False


class _TextStream:
    """One sample's shown text as its tokens arrive, by `decode`'s rules.

    Tokens are decoded in a window that starts at the previous delta's tokens (as vLLM's detokenizer
    does), so a token's text is read in context (a tokenizer may drop a word's leading space at the
    start of a text) and a long sample costs linear time. Held back: a text ending in an incomplete
    character (`\ufffd`), an end-of-turn or end-of-sequence token until another follows (as the last
    token it is not shown), and the text's longest tail that begins a stop string.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, call: GenerationCall):
        self.tokenizer = tokenizer
        self.ends = _ends(tokenizer, call)
        self.stop_strings = call.stop_strings
        self.tokens: list[int] = []
        self.window = 0  # the first token of the decoding window
        self.read = 0  # the tokens whose text is in `text`
        self.text = ""
        self.searched = 0  # `text[:searched]` holds no stop string
        self.sent = 0  # characters of `text` sent
        self.stopped = False  # a stop string was found: nothing after it is shown

    def add(self, token: int) -> str:
        """The text that can be sent now that `token` was drawn ('' for none)."""
        self.tokens.append(token)
        if self.stopped:
            return ""
        readable = len(self.tokens) - 1 if token in self.ends else len(self.tokens)
        if readable > self.read:
            before = self.tokenizer.decode(self.tokens[self.window : self.read], skip_special_tokens=True)
            after = self.tokenizer.decode(self.tokens[self.window : readable], skip_special_tokens=True)
            if len(after) > len(before) and not after.endswith("\ufffd"):
                self.text += after[len(before) :]
                self.window, self.read = self.read, readable
        return self._sendable()

    def _sendable(self) -> str:
        found = [
            (at, stop)
            for stop in self.stop_strings
            if (at := self.text.find(stop, max(0, self.searched - len(stop) + 1))) >= 0
        ]
        self.searched = len(self.text)
        if found:
            self.stopped = True
            end = min(found)[0]
        else:
            longest = max((len(stop) for stop in self.stop_strings), default=1)
            held = next(
                (
                    k
                    for k in range(min(longest - 1, len(self.text)), 0, -1)
                    if any(stop.startswith(self.text[-k:]) for stop in self.stop_strings)
                ),
                0,
            )
            end = len(self.text) - held
        piece = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece

    def finish(self, completion: Completion) -> list[str]:
        """The rest of the sample's text once it is done: the tokens that were not handed over (vLLM's,
        a retried request's) decoded as they would have been, then whatever the last tokens' text
        completes, so the deltas join to `completion.text`."""
        pieces = []
        if completion.token_ids[: len(self.tokens)] == self.tokens:
            for token in completion.token_ids[len(self.tokens) :]:
                if piece := self.add(token):
                    pieces.append(piece)
        sent = self.text[: self.sent]
        if completion.text.startswith(sent) and len(completion.text) > len(sent):
            pieces.append(completion.text[len(sent) :])
        return pieces


def token_text(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str:
    """One token as the logprobs fields name it: its decoded text (special tokens included)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)
