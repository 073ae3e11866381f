"""A compatible API's request as the engine's sample calls, and their sequences as decoded completions.

OpenAI's chat and text completions and Anthropic's messages all come down to: some prompts (token ids),
`n` samples of each, the sampling parameters, stop strings or stop tokens, and how many logprobs to
report. `GenerationCall` holds one prompt's call; `check_calls` validates every call of a request in the
caller's thread (ids in the vocabulary, `max_tokens` within what the context leaves, the number of
sequences within the engine's `max_samples_per_request`), before any of them is queued, so a refused
request changes nothing and costs nothing sized by it. `generate` then submits them with
`Engine.sample`: the engine's one ordered sample path, pinned to the weights the request named, batched
with whatever else queues on the same weights, training included.

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
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from workbench.engine.interface import SamplerPin
from workbench.engine.local.engine import Engine
from workbench.engine.samplers.requests import TokenSink, check_width, prepare_request
from workbench.engine.samplers.sample_request import SampleRequest
from workbench.futures import APIFuture
from workbench.types import ModelInput, SampleResponse, SamplingParams, StopReason, TopkEntries

MAX_STOP_STRINGS = 16
"""Stop strings one request may name (OpenAI allows 4; lm-eval's tasks may name a few more)."""

MAX_TOP_LOGPROBS = 20
"""The most alternatives reported per token (OpenAI's limit for chat, vLLM's for both APIs)."""


@dataclass(frozen=True)
class GenerationCall:
    """One prompt's sample call.

    Attributes:
        prompt_ids: The prompt's tokens.
        n: Samples of it.
        max_tokens: New tokens at most; None for what the context leaves; 0 to score the prompt only.
        temperature, top_p, top_k, seed: As `SamplingParams` has them.
        stop_strings: Strings that end a sequence (the end-of-sequence token does too).
        stop_ids: Tokens that end a sequence when no stop string is given (the end of turn).
        top_logprobs: Alternatives reported per sampled token (0: none).
        prompt_logprobs: Whether the prompt's logprobs are reported (`echo`).
        prompt_top_logprobs: Alternatives reported per prompt token.
    """

    prompt_ids: list[int]
    n: int = 1
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()
    stop_ids: frozenset[int] = frozenset()
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    prompt_top_logprobs: int = 0

    @property
    def scores_only(self) -> bool:
        return self.max_tokens == 0

    def sampling_params(self) -> SamplingParams:
        """The engine's parameters. Stop strings, when given, end a sequence together with the
        end-of-sequence token (the engine's rule); the end of turn is added to them as text when it is
        another token. Without strings, the end-of-turn tokens stop it."""
        stop: list[str] | list[int] = sorted(self.stop_ids)
        if self.stop_strings:
            stop = list(self.stop_strings)
        return SamplingParams(
            max_tokens=1 if self.scores_only else self.max_tokens,
            seed=self.seed,
            stop=stop,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
        )

    def sample_request(self) -> SampleRequest:
        """The engine's request for this call (raises ValueError naming a bad field)."""
        return SampleRequest(
            ModelInput.from_ints(self.prompt_ids),
            self.n,
            self.sampling_params(),
            self.prompt_logprobs,
            topk_prompt_logprobs=self.prompt_top_logprobs,
            topk_sample_logprobs=self.top_logprobs,
        )


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


def check_stop_strings(stop: object, where: str) -> tuple[str, ...]:
    """A stop field: None, one string, or a list of at most `MAX_STOP_STRINGS` non-empty strings."""
    if stop is None:
        return ()
    strings = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(strings, list)
        or len(strings) > MAX_STOP_STRINGS
        or not all(isinstance(s, str) and s for s in strings)
    ):
        raise ValueError(
            f"{where} must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them"
        )
    return tuple(strings)


def check_calls(engine: Engine, calls: Sequence[GenerationCall]) -> None:
    """Every call checked as `Engine.sample` checks it, and the request's sequences counted, before any
    is queued; raises ValueError naming the problem."""
    limit = engine.config.max_samples_per_request
    total = sum(call.n for call in calls)
    if not calls or total > limit:
        raise ValueError(
            f"a request may ask for 1 to {limit} sequences in all (prompts x n, the server's "
            f"max_samples_per_request), this one asks for {total}"
        )
    for index, call in enumerate(calls):
        where = f"prompt {index}: " if len(calls) > 1 else ""
        if call.max_tokens is not None and (
            isinstance(call.max_tokens, bool) or not isinstance(call.max_tokens, int) or call.max_tokens < 0
        ):
            raise ValueError(f"max_tokens must be a non-negative integer, got {call.max_tokens!r}")
        check_width("top_logprobs", call.top_logprobs, MAX_TOP_LOGPROBS)
        check_width("prompt top_logprobs", call.prompt_top_logprobs, MAX_TOP_LOGPROBS)
        try:
            prepare_request(
                call.sample_request(),
                tokenizer=engine.tokenizer,
                base_info=engine.base_info,
                max_samples_per_request=limit,
            )
        except ValueError as error:
            raise ValueError(f"{where}{error}") from None


def _submit(
    engine: Engine, pin: APIFuture[SamplerPin], call: GenerationCall, token_sink: TokenSink | None = None
) -> APIFuture[SampleResponse]:
    return engine.sample(pin, call.sample_request(), token_sink)


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
