"""The sampling fields both compatible APIs share, read from a request body with one rule each.

OpenAI's chat and text completions and Anthropic's messages name the same sampling settings (OpenAI's
`stop` is Anthropic's `stop_sequences`; Anthropic has no `n` or `seed`). Each is read here once, and
the settings `SamplingParams` holds (`max_tokens`, `temperature`, `top_p`, `top_k`, `seed`) are held to
its own rule: the reader builds the one `SamplingParams` the call samples with, and a value it refuses
is refused under the request's field name (OpenAI's `param`). Stricter than `SamplingParams` here, and
why: stop strings (at most `MAX_STOP_STRINGS`, each non-empty: a request's stop strings are searched in
every decoded text) and the widths OpenAI caps (`MAX_TOP_LOGPROBS`).

A JSON `null` is the field left out. The end of a turn stops a chat's sequence: without stop strings as
its tokens (`Ending.stop_ids`), with them as their text too (`Ending.texts`), since `SamplingParams`
stops on strings or on token ids, not both (the end-of-sequence token ends a sequence either way).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from workbench.server.errors import RequestError
from workbench.types import SamplingParams

MAX_STOP_STRINGS = 16
"""Stop strings one request may name (OpenAI allows 4; lm-eval's tasks may name a few more)."""

MAX_TOP_LOGPROBS = 20
"""The most alternatives reported per token (OpenAI's limit for chat, vLLM's for both APIs)."""


class FieldError(RequestError):
    """A refusal naming the request field it is about (OpenAI's `param`)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message, status)
        self.param = param


@dataclass(frozen=True)
class Ending:
    """What ends a sequence besides its stop strings: tokens, and their text where stop strings are
    given (the end of turn that is not the end-of-sequence token)."""

    stop_ids: frozenset[int]
    texts: tuple[str, ...] = ()


@dataclass(frozen=True)
class SamplingFields:
    """The shared fields of one request, read.

    Attributes:
        params: What the request samples with, stop strings and ending included.
        stop_strings: The stop strings the request named (a sequence's text is cut at the first).
        stop_ids: The tokens that end a sequence (its last token is not shown when it is one of them).
    """

    params: SamplingParams
    stop_strings: tuple[str, ...]
    stop_ids: frozenset[int]


def integer(
    body: Mapping[str, Any], name: str, default: int | None, low: int, high: int | None = None
) -> int | None:
    """An integer field in [low, high] (a bool is not one), `default` when it is left out."""
    value = body.get(name)
    if value is None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise FieldError(f"{name} must be an integer {bound}, got {value!r}", param=name)
    return value


def flag(body: Mapping[str, Any], name: str) -> bool:
    """A true/false field, false when it is left out."""
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise FieldError(f"{name} must be true or false, got {value!r}", param=name)
    return bool(value)


def stop_strings(body: Mapping[str, Any], name: str) -> tuple[str, ...]:
    """A stop field: one string, or a list of at most `MAX_STOP_STRINGS` non-empty strings."""
    stop = body.get(name)
    if stop is None:
        return ()
    strings = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(strings, list)
        or len(strings) > MAX_STOP_STRINGS
        or not all(isinstance(s, str) and s for s in strings)
    ):
        raise FieldError(
            f"{name} must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them", param=name
        )
    return tuple(strings)


def refuse_unless(
    body: Mapping[str, Any], allowed: Mapping[str, tuple[Any, ...]], why: Mapping[str, str]
) -> None:
    """Each field of `allowed` that the request sets to another value is refused, with `why` it is."""
    for name, values in allowed.items():
        if name in body and body[name] not in values:
            raise FieldError(f"{name}: {why[name]} on this server, got {body[name]!r}", param=name)


def sampling_fields(
    body: Mapping[str, Any],
    names: Mapping[str, str],
    *,
    max_tokens: tuple[str, object],
    stop_field: str,
    ending: Ending,
) -> SamplingFields:
    """The request's sampling fields read and its `SamplingParams` built (once).

    Args:
        body: The request.
        names: The `SamplingParams` fields the API has (`temperature`, `top_p`, `top_k`, `seed`), each
            with its name in the body.
        max_tokens: The field that gives `max_tokens` and its value (the API picks it and its default:
            OpenAI's chat has two names for it, Anthropic requires it); None: what the context leaves.
        stop_field: The name of the stop strings' field.
        ending: What else ends a sequence.
    """
    strings = stop_strings(body, stop_field)
    given: dict[str, tuple[str, object]] = {"max_tokens": max_tokens}
    for field, name in names.items():
        if body.get(name) is not None:
            given[field] = (name, body[name])
    stop: list[str] | list[int] = [*strings, *ending.texts] if strings else sorted(ending.stop_ids)
    try:
        params = SamplingParams(stop=stop, **{field: value for field, (_, value) in given.items()})
    except ValueError:
        raise _refusal(given) from None
    return SamplingFields(params, strings, ending.stop_ids)


def _refusal(given: Mapping[str, tuple[str, object]]) -> FieldError:
    """The refusal of the first field whose value `SamplingParams` refuses, named as the request names it."""
    for field, (name, value) in given.items():
        try:
            SamplingParams(**{field: value})
        except ValueError as error:
            return FieldError(f"{name}: {error}", param=name)
    raise AssertionError(f"SamplingParams refused {dict(given)} but no field alone")
