"""OpenAI's API on the Tinker server: `/chat/completions`, `/completions` and `/models` under `/oai/api/v1`.

As hosted Tinker serves it, so the unmodified `openai` client, lm-evaluation-harness (`local-completions`,
`local-chat-completions`), inspect-ai and agent harnesses use a policy while it trains:
`openai.OpenAI(base_url=f"{srv.url}/oai/api/v1", api_key=<the server's key or anything>)`. The `model`
field names the weights (`served_weights`); each request runs through the engine's ordered sample path
on them (`generation`).

Every parameter is supported, ignored or refused (`PARAMETERS` says which and why); a refusal comes in
OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with status 400 (bad value), 401 (no
key), 404 (unknown model or path) or 413 (body too large), before anything is queued. Beyond OpenAI's
fields, as vLLM's `return_token_ids` gives them: each choice carries `token_ids` (every token sampled,
the stop token included) and the prompt's ids (`prompt_token_ids`: once for a chat, per choice for text
completions), so an RL harness trains on exactly what was sampled; `top_k` is taken as vLLM takes it.

Streams (`stream: true`) are server-sent events, about one chunk per token, sent as the sampler (HF
or vLLM) draws the tokens (`generation.stream_generate`); their text joins to the unstreamed text. The choices come one after another
(a later choice's chunks wait for the earlier ones to finish). A choice's `logprobs` and `token_ids`
come in its last content chunk, so each content chunk is sent when the next token's text is in; with
`stream_options: {"include_usage": true}` a final chunk carries the usage. A chat that offers tools
sends its text when the reply is done: tool calls are read from the whole reply. A failure after the
stream has started comes as an `{"error": ...}` event, which the `openai` client raises.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from workbench.loops.chat import parse_reply, render_chat
from workbench.server.compat_http import CompatRoutes, error_status, event_stream, started
from workbench.server.errors import RequestError, message_of
from workbench.server.generation import (
    Completion,
    Generated,
    GenerationCall,
    ModelRoutes,
    SequenceDone,
    TextDelta,
    check_calls,
    generate,
    generation_call,
    stream_generate,
    text_ending,
    token_text,
)
from workbench.server.sampling_fields import (
    MAX_TOP_LOGPROBS,
    FieldError,
    SamplingFields,
    flag,
    integer,
    refuse_unless,
    sampling_fields,
)
from workbench.server.served_weights import ServedWeights, Weights
from workbench.server.service import TinkerService
from workbench.types import MIN_TEMPERATURE

PREFIX = "/oai/api/v1"

PARAMETERS: dict[str, str] = {
    # both endpoints
    "model": "supported: a base model, a tinker:// checkpoint path, '<base>;<path>' or a model id",
    "max_tokens": "supported (0 on /completions: the prompt's logprobs only)",
    "temperature": f"supported: 0 (greedy) or at least {MIN_TEMPERATURE:g} (SamplingParams' rule)",
    "top_p": "supported: in (0, 1]",
    "top_k": "supported (vLLM's extension): -1 or >= 1",
    "n": "supported: prompts x n at most the server's max_samples_per_request",
    "stop": "supported: a string or up to 16",
    "seed": "supported: the same seed gives the same tokens; -2**63 <= seed < 2**64",
    "stream": "supported: token by token as the sampler draws them (with tools: once the reply is sampled)",
    "stream_options": "supported: include_usage",
    "user": "ignored",
    "metadata": "ignored",
    "store": "ignored",
    "service_tier": "ignored",
    "return_token_ids": "ignored: token ids always come back",
    "presence_penalty": "refused unless 0",
    "frequency_penalty": "refused unless 0",
    "repetition_penalty": "refused unless 1",
    "logit_bias": "refused unless empty",
    "min_p": "refused unless 0",
    # chat
    "messages": "supported: system / developer / user / assistant / tool messages with text content",
    "max_completion_tokens": "supported (as max_tokens)",
    "logprobs": "supported (chat: true/false; completions: 0 to 20 alternatives)",
    "top_logprobs": "supported: 0 to 20",
    "tools": "supported where the chat template renders them in the Qwen / Hermes format, else refused",
    "tool_choice": "supported: 'auto' and 'none'; refused: 'required' or a named function",
    "parallel_tool_calls": "ignored",
    "response_format": "refused unless {'type': 'text'}",
    "functions": "refused (use tools)",
    "function_call": "refused (use tools)",
    "modalities": "refused unless ['text']",
    "audio": "refused",
    "prediction": "refused",
    "reasoning_effort": "refused",
    "web_search_options": "refused",
    # completions
    "prompt": "supported: a string, token ids, or a list of either",
    "echo": "supported: the prompt's text, tokens and logprobs (None first) come before the completion",
    "best_of": "refused unless equal to n",
    "suffix": "refused",
}
"""Each request field, and what this server does with it; a field not listed here is ignored."""

_REFUSED_UNLESS: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
    "min_p": (None, 0, 0.0),
    "response_format": (None, {"type": "text"}),
    "functions": (None,),
    "function_call": (None,),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "suffix": (None, ""),
}


SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed"}
"""The `SamplingParams` fields OpenAI's requests set, each by its own name."""


def _error_type(status: int) -> str:
    return {
        401: "authentication_error",
        404: "not_found_error",
        413: "invalid_request_error",
    }.get(status, "invalid_request_error" if status < 500 else "server_error")


def _error_body(service: TinkerService, error: BaseException) -> dict[str, Any]:
    """A failure in OpenAI's shape: a response's body, or a stream's error event."""
    status = error_status(error)
    param = error.param if isinstance(error, FieldError) else None
    message = service.client_message(message_of(error))
    return {"error": {"message": message, "type": _error_type(status), "param": param, "code": None}}


def _id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


@dataclass(frozen=True)
class Delivery:
    """How a reply is sent: as a stream (`stream`), with a last chunk of the usage (`include_usage`)."""

    stream: bool
    include_usage: bool


def _delivery(body: Mapping[str, Any]) -> Delivery:
    """The fields both endpoints share that are not sampling's: the refused ones checked, the stream's."""
    refuse_unless(body, _REFUSED_UNLESS, PARAMETERS)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, Mapping):
        raise FieldError("stream_options must be an object", param="stream_options")
    return Delivery(flag(body, "stream"), bool((options or {}).get("include_usage")))


@dataclass(frozen=True)
class ChatCall:
    """A chat request read: its call, whether tools are offered, whether logprobs are, how it is sent."""

    call: GenerationCall
    offered: bool
    logprobs: bool
    delivery: Delivery


@dataclass(frozen=True)
class CompletionCalls:
    """A text completions request read: a call per prompt and its text when given as text, the echo,
    the alternatives per token (`logprobs`, None: no logprobs), how it is sent."""

    calls: list[GenerationCall]
    texts: list[str | None]
    echo: bool
    logprobs: int | None
    delivery: Delivery


def _usage(results: list[Generated]) -> dict[str, int]:
    prompt = sum(len(r.prompt_ids) for r in results)
    completion = sum(len(c.token_ids) for r in results for c in r.completions)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class OpenAIRoutes(ModelRoutes):
    """The routes' work for one base model (`generation.ModelRoutes`)."""

    # ------------------------------------------------------------------------------------------ chat

    def chat_calls(self, body: Mapping[str, Any]) -> ChatCall:
        """The chat request as one generation call."""
        delivery = _delivery(body)
        offered, tools = self._offered_tools(body)
        try:
            prompt = render_chat(self.tokenizer, body.get("messages"), tools)
        except ValueError as error:
            raise FieldError(
                str(error), param="tools" if str(error).startswith("tools") else "messages"
            ) from None
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        fields = sampling_fields(
            body, SAMPLING_FIELDS, max_tokens=(name, body.get(name)), stop_field="stop", ending=self.ending
        )
        logprobs = flag(body, "logprobs")
        top = integer(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS) or 0
        if top and not logprobs:
            raise FieldError("top_logprobs needs logprobs: true", param="top_logprobs")
        call = generation_call(prompt, fields, n=self._n(body), top_logprobs=top)
        return ChatCall(call, offered, logprobs, delivery)

    @staticmethod
    def _offered_tools(body: Mapping[str, Any]) -> tuple[bool, list[Any] | None]:
        """Whether tools are offered, and the tools the chat template renders (None: none)."""
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise FieldError("tools must be a list of functions", param="tools")
        choice = body.get("tool_choice")
        if choice not in (None, "auto", "none"):
            raise FieldError(
                f"tool_choice {choice!r}: this server cannot force a tool call; use 'auto' or 'none'",
                param="tool_choice",
            )
        offered = bool(tools) and choice != "none"
        return offered, tools if offered else None

    @staticmethod
    def _n(body: Mapping[str, Any]) -> int:
        return integer(body, "n", 1, 1) or 1

    def _chat_logprobs(self, completion: Completion, wanted: bool) -> dict[str, Any] | None:
        if not wanted:
            return None
        content = []
        for position, (token, logprob) in enumerate(
            zip(completion.token_ids, completion.logprobs, strict=True)
        ):
            top = (completion.top_logprobs or [])[position] if completion.top_logprobs else None
            text = token_text(self.tokenizer, token)
            content.append(
                {
                    "token": text,
                    "logprob": logprob,
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {
                            "token": (t := token_text(self.tokenizer, i)),
                            "logprob": lp,
                            "bytes": list(t.encode()),
                        }
                        for i, lp in (top or [])
                    ],
                }
            )
        return {"content": content, "refusal": None}

    def chat_message(self, completion: Completion, offered: bool) -> tuple[dict[str, Any], str]:
        reply = parse_reply(completion.text, offered)
        message: dict[str, Any] = {"role": "assistant", "content": reply.content or None, "refusal": None}
        finish = "length" if completion.finish == "length" else "stop"
        if reply.tool_calls:
            message["tool_calls"] = [
                {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in reply.tool_calls
            ]
            finish = "tool_calls"
        elif message["content"] is None:
            message["content"] = ""
        return message, finish

    async def chat(self, body: Mapping[str, Any]) -> Response:
        chat = self.chat_calls(body)
        model, created, response_id = str(body["model"]), int(time.time()), _id("chatcmpl")
        head = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model}
        if chat.delivery.stream:
            events = await self._stream(body.get("model"), [chat.call])
            return event_stream(self._chat_chunks(events, chat, head), done_marker=True)
        results = await self._run(body.get("model"), [chat.call])
        result = results[0]
        choices = []
        for index, completion in enumerate(result.completions):
            message, finish = self.chat_message(completion, chat.offered)
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": self._chat_logprobs(completion, chat.logprobs),
                    "finish_reason": finish,
                    "stop_reason": completion.stop_string,
                    "token_ids": completion.token_ids,
                }
            )
        return JSONResponse(
            {
                "id": response_id,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": choices,
                "usage": _usage(results),
                "system_fingerprint": None,
                "prompt_token_ids": result.prompt_ids,
            }
        )

    async def _chat_chunks(
        self, events: AsyncIterator[TextDelta | SequenceDone], chat: ChatCall, head: dict[str, Any]
    ) -> AsyncIterator[tuple[None, dict[str, Any]]]:
        """Each choice's chunks: its role, its text as it is sampled, its end; then the usage. `head`:
        what every chunk begins with."""

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> tuple[None, dict[str, Any]]:
            return None, {**head, "choices": choices, "usage": None, **extra}

        opened = -1  # the choice whose chunks are being sent
        # the choice's text not sent yet: its newest piece (the last one goes with the logprobs), or
        # with tools offered all of it (the calls are parsed from the whole reply)
        pending: list[str] = []
        result: Generated | None = None
        try:
            async for event in events:
                index = event.sequence
                if index != opened:
                    opened = index
                    role = {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None,
                    }
                    yield chunk([role], prompt_token_ids=chat.call.prompt_ids if index == 0 else None)
                if isinstance(event, TextDelta):
                    pending.append(event.text)
                    while not chat.offered and len(pending) > 1:
                        yield chunk([self._chat_content(chat, index, pending.pop(0), None)])
                    continue
                result = event.generated
                for choices in self._chat_ending(chat, index, result.completions[index], pending):
                    yield chunk(choices)
                pending = []
        except Exception as error:  # the stream has started: the failure is its last event
            yield None, _error_body(self.service, error)
            return
        if chat.delivery.include_usage and result is not None:
            yield chunk([], usage=_usage([result]))

    def _chat_content(
        self, chat: ChatCall, index: int, piece: str, completion: Completion | None
    ) -> dict[str, Any]:
        """A content chunk's choice; the choice's last (`completion` given) carries its logprobs and ids."""
        last = completion is not None
        return {
            "index": index,
            "delta": {"content": piece},
            "logprobs": self._chat_logprobs(completion, chat.logprobs) if last else None,
            "finish_reason": None,
            **({"token_ids": completion.token_ids} if last else {}),
        }

    def _chat_ending(
        self, chat: ChatCall, index: int, completion: Completion, pending: list[str]
    ) -> list[list[dict[str, Any]]]:
        """A finished choice's last chunks' choices: the text not sent yet (with tools, the text the
        calls leave), the last carrying the logprobs, then the finish with the calls."""
        message, finish = self.chat_message(completion, chat.offered)
        if "tool_calls" in message:
            pending = [message["content"]] if message.get("content") else []
        chunks = [
            [self._chat_content(chat, index, piece, completion if number == len(pending) - 1 else None)]
            for number, piece in enumerate(pending)
        ]
        closing: dict[str, Any] = {"index": index, "delta": {}, "finish_reason": finish}
        if "tool_calls" in message:
            closing["delta"] = {
                "tool_calls": [{"index": i, **made} for i, made in enumerate(message["tool_calls"])]
            }
        if not pending:
            closing["logprobs"] = self._chat_logprobs(completion, chat.logprobs)
            closing["token_ids"] = completion.token_ids
        return [*chunks, [closing]]

    # ------------------------------------------------------------------------------------------ completions

    def _prompts(self, prompt: Any) -> list[tuple[list[int], str | None]]:
        """Each prompt's tokens, and its text when it was given as text."""
        if isinstance(prompt, str) or (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise FieldError(
                "prompt must be a string, a list of token ids, or a non-empty list of either", param="prompt"
            )
        prompts: list[tuple[list[int], str | None]] = []
        for index, item in enumerate(prompt):
            if isinstance(item, str):
                prompts.append((list(self.tokenizer.encode(item)), item))
            elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
                prompts.append((list(item), None))
            else:
                raise FieldError(f"prompt[{index}] must be a string or a list of token ids", param="prompt")
        return prompts

    def completion_calls(self, body: Mapping[str, Any]) -> CompletionCalls:
        delivery = _delivery(body)
        n = self._n(body)
        if body.get("best_of") is not None and body["best_of"] != n:
            raise FieldError("best_of is refused on this server unless it equals n", param="best_of")
        prompts = self._prompts(body.get("prompt"))
        echo = flag(body, "echo")
        logprobs = integer(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
        scores_only = body.get("max_tokens") == 0 and not isinstance(body.get("max_tokens"), bool)
        if scores_only and not echo:
            raise FieldError("max_tokens 0 asks for nothing unless echo is true", param="max_tokens")
        max_tokens = 1 if scores_only else (16 if body.get("max_tokens") is None else body["max_tokens"])
        fields: SamplingFields = sampling_fields(
            body,
            SAMPLING_FIELDS,
            max_tokens=("max_tokens", max_tokens),
            stop_field="stop",
            ending=text_ending(self.tokenizer),
        )
        prompt_top = None if not (echo and logprobs is not None) else logprobs
        calls = [
            generation_call(
                ids,
                fields,
                n=n,
                top_logprobs=logprobs or 0,
                prompt_top_logprobs=prompt_top,
                scores_only=scores_only,
            )
            for ids, _ in prompts
        ]
        return CompletionCalls(calls, [text for _, text in prompts], echo, logprobs, delivery)

    def _completion_logprobs(
        self, result: Generated, completion: Completion, echo: bool, k: int
    ) -> dict[str, Any]:
        tokens: list[int] = (result.prompt_ids if echo else []) + completion.token_ids
        logprobs: list[float | None] = (list(result.prompt_logprobs or []) if echo else []) + list(
            completion.logprobs
        )
        tops = (list(result.prompt_top_logprobs or [None] * len(result.prompt_ids)) if echo else []) + list(
            completion.top_logprobs or [None] * len(completion.token_ids)
        )
        texts = [token_text(self.tokenizer, t) for t in tokens]
        offsets, at = [], 0
        for text in texts:
            offsets.append(at)
            at += len(text)
        return {
            "tokens": texts,
            "token_logprobs": logprobs,
            "top_logprobs": [
                None if top is None or not k else {token_text(self.tokenizer, i): lp for i, lp in top}
                for top in tops
            ],
            "text_offset": offsets,
        }

    async def completions(self, body: Mapping[str, Any]) -> Response:
        asked = self.completion_calls(body)
        calls, texts, echo, k = asked.calls, asked.texts, asked.echo, asked.logprobs
        model, created, response_id = str(body["model"]), int(time.time()), _id("cmpl")
        # each prompt's text as an echo gives it
        prefixes = [
            (text if text is not None else self.tokenizer.decode(call.prompt_ids)) if echo else ""
            for call, text in zip(calls, texts, strict=True)
        ]
        if asked.delivery.stream:
            events = await self._stream(body.get("model"), calls)
            return event_stream(
                self._completion_chunks(
                    events,
                    calls,
                    prefixes,
                    echo,
                    k,
                    asked.delivery.include_usage,
                    response_id,
                    created,
                    model,
                ),
                done_marker=True,
            )
        results = await self._run(body.get("model"), calls)
        choices = []
        for number, (result, prefix) in enumerate(zip(results, prefixes, strict=True)):
            for j, completion in enumerate(result.completions):
                choices.append(
                    {
                        "index": number * calls[number].n + j,
                        "text": prefix + completion.text,
                        "logprobs": None
                        if k is None
                        else self._completion_logprobs(result, completion, echo, k),
                        "finish_reason": completion.finish,
                        "stop_reason": completion.stop_string,
                        "token_ids": completion.token_ids,
                        "prompt_token_ids": result.prompt_ids,
                    }
                )
        return JSONResponse(
            {
                "id": response_id,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": choices,
                "usage": _usage(results),
                "system_fingerprint": None,
            }
        )

    async def _completion_chunks(
        self,
        events: AsyncIterator[TextDelta | SequenceDone],
        calls: list[GenerationCall],
        prefixes: list[str],
        echo: bool,
        k: int | None,
        include_usage: bool,
        response_id: str,
        created: int,
        model: str,
    ) -> AsyncIterator[tuple[None, dict[str, Any]]]:
        """Each choice's chunks: the echoed prompt and its text as it is sampled, then its end; then the
        usage."""

        def chunk(
            choices: list[dict[str, Any]], usage: dict[str, int] | None = None
        ) -> tuple[None, dict[str, Any]]:
            head = {"id": response_id, "object": "text_completion", "created": created, "model": model}
            return None, {**head, "choices": choices, "usage": usage}

        def text(index: int, piece: str, last: dict[str, Any] | None) -> tuple[None, dict[str, Any]]:
            """A text chunk; the choice's last carries its logprobs and ids (`last`)."""
            return chunk(
                [
                    {
                        "index": index,
                        "text": piece,
                        "logprobs": None if last is None else last["logprobs"],
                        "finish_reason": None,
                        **(
                            {}
                            if last is None
                            else {
                                "token_ids": last["token_ids"],
                                "prompt_token_ids": last["prompt_token_ids"],
                            }
                        ),
                    }
                ]
            )

        opened: tuple[int, int] | None = None  # the choice whose chunks are being sent
        pending: list[str] = []  # its newest piece, sent with the logprobs when it is the last
        results: list[Generated] = []
        try:
            async for event in events:
                number, j = event.call, event.sequence
                index = number * calls[number].n + j
                if (number, j) != opened:
                    opened = (number, j)
                    pending = [prefixes[number]] if prefixes[number] else []
                if isinstance(event, TextDelta):
                    pending.append(event.text)
                    while len(pending) > 1:
                        yield text(index, pending.pop(0), None)
                    continue
                result = event.generated
                if j == 0:
                    results.append(result)
                completion = result.completions[j]
                last = {
                    "logprobs": None if k is None else self._completion_logprobs(result, completion, echo, k),
                    "token_ids": completion.token_ids,
                    "prompt_token_ids": result.prompt_ids,
                }
                for piece_number, piece in enumerate(pending):
                    yield text(index, piece, last if piece_number == len(pending) - 1 else None)
                yield chunk(
                    [{"index": index, "text": "", "logprobs": None, "finish_reason": completion.finish}]
                )
        except Exception as error:  # the stream has started: the failure is its last event
            yield None, _error_body(self.service, error)
            return
        if include_usage:
            yield chunk([], usage=_usage(results))

    # ------------------------------------------------------------------------------------------ shared

    async def _run(self, model: object, calls: list[GenerationCall]) -> list[Generated]:
        """Check every call, resolve the weights, then sample: a refusal comes before any work."""
        checked = check_calls(self.engine, calls)
        weights = await self._weights(model)
        try:
            return await generate(weights.engine, weights.pin, checked)
        finally:
            weights.done()

    async def _stream(
        self, model: object, calls: list[GenerationCall]
    ) -> AsyncIterator[TextDelta | SequenceDone]:
        """`_run` as a stream, started: a failure before its first event raises here."""
        checked = check_calls(self.engine, calls)
        weights = await self._weights(model)
        try:
            return await started(stream_generate(weights.engine, weights.pin, checked))
        finally:
            weights.done()  # queued after the calls' samples, which it leaves their weights

    async def _weights(self, model: object) -> Weights:
        """The weights `model` names, pinned."""
        try:
            return await self.weights.resolve(model)
        except RequestError as error:
            raise FieldError(error.message, error.status, "model") from None


def openai_router(service: TinkerService, weights: ServedWeights) -> APIRouter:
    """The routes under `PREFIX`; the app mounts them with `include_router(..., prefix=PREFIX)`."""
    api = CompatRoutes(service, weights, OpenAIRoutes, _error_body)
    router = APIRouter()

    api.post(router, "/chat/completions", OpenAIRoutes.chat)
    api.post(router, "/completions", OpenAIRoutes.completions)

    @router.get("/models")
    async def models(request: Request) -> Response:
        async def listing(_: Request) -> Response:
            return JSONResponse({"object": "list", "data": weights.listing()})

        return await api.answered(request, listing)

    @router.get("/models/{model:path}")
    async def model(request: Request, model: str) -> Response:
        async def one(_: Request) -> Response:
            for entry in weights.listing():
                if entry["id"] == model:
                    return JSONResponse(entry)
            raise FieldError(f"model {model!r} is not served here (GET /models lists them)", 404, "model")

        return await api.answered(request, one)

    api.refuse_other_paths(router, PREFIX, "/chat/completions, /completions and /models are served")
    return router
