"""How the server refuses a request, and how a failed operation is reported to the client.

Two kinds of failure reach a client:

* A request the server cannot take at all (a body that is not valid JSON or protobuf, too large, a
  missing API key, a seq_id reused with other content) is answered at once with an HTTP error status
  and a JSON body `{"error": <message>, "category": "user"}`. The SDK raises it on the spot, with our
  message in its text (a 400 with an empty body would instead be retried as a proxy hiccup). When
  the refused request names a served model and a seq_id, that seq_id is taken all the same (by an
  operation that fails with the same error), since the SDK counted it.
* An operation that was taken (it holds a `seq_id`, so later operations of the same model can run after
  it) and then fails, in validation or on the engine's worker, resolves its future with
  `{"error": <message>, "category": "user" | "server"}`: the SDK raises `RequestFailedError` with our
  message and category at its first poll, without retrying.

The category says whose fault it is: bad input (a `ValueError`, `TypeError` or `KeyError`, which is
what every validation in workbench raises, a `CheckpointError` included) is the user's; anything else
(an engine that was closed, out of memory, a bug) is the server's.
"""

from __future__ import annotations

from typing import Literal

ErrorCategory = Literal["user", "server"]


class RequestError(Exception):
    """A request the server refuses before it becomes an operation.

    Args:
        message: What is wrong, naming the field or value.
        status: The HTTP status to answer with (400 bad input, 401 no key, 404 unknown id, 409 a
            retried seq_id with different content, 410 a finished session, 413 too large).
    """

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.message = message
        self.status = status


def category_of(error: BaseException) -> ErrorCategory:
    """Whose fault a failed operation is: bad input is the user's, anything else the server's."""
    return "user" if isinstance(error, (ValueError, TypeError, KeyError, RequestError)) else "server"


def message_of(error: BaseException) -> str:
    """The text a client sees for a failure: the message alone for bad input (it names the problem),
    the exception's type too for anything else."""
    if isinstance(error, RequestError):
        return error.message
    text = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    if category_of(error) == "user":
        return text or type(error).__name__
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def error_body(error: BaseException) -> dict[str, str]:
    """The JSON a failed request or operation is reported with."""
    return {"error": message_of(error), "category": category_of(error)}


ENVELOPE_BYTES = 64 * 1024
"""How much of a body over the size limit is kept, for the model and seq_id it names."""


class BodyTooLarge(RequestError):
    """A body over the size limit, refused with 413; `head` is its beginning (`ENVELOPE_BYTES`)."""

    def __init__(self, message: str, head: bytes):
        super().__init__(message, 413)
        self.head = head[:ENVELOPE_BYTES]
