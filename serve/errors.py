"""API errors as OpenAI clients parse them: `{"error": {"message", "type", "param", "code"}}` with the
HTTP status equal to `code` (openai-python maps the status to its exception class and reads
`error.message`). Inside an already-started SSE stream the same object is sent as one event.
"""
from __future__ import annotations

import logging

import msgspec


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: int


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


class APIError(Exception):
    status = 500
    kind = "InternalServerError"

    def __init__(self, message: str, *, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.param, self.headers = message, param, headers or {}

    def body(self) -> bytes:
        return msgspec.json.encode(ErrorBody(ErrorDetail(self.message, self.kind, self.param, self.status)))


class BadRequest(APIError):
    status, kind = 400, "BadRequestError"


class Unauthorized(APIError):
    status, kind = 401, "AuthenticationError"


class NotFound(APIError):
    status, kind = 404, "NotFoundError"


class PayloadTooLarge(APIError):
    status, kind = 413, "RequestTooLargeError"


class Overloaded(APIError):
    """Back-pressure: the client (openai-python retries 503) should come back after Retry-After."""
    status, kind = 503, "ServiceUnavailableError"


class EngineDead(APIError):
    status, kind = 503, "ServiceUnavailableError"


class ShuttingDown(APIError):
    """The server got SIGINT / SIGTERM: open requests end with this, new ones are refused."""
    status, kind = 503, "ServiceUnavailableError"


def stream_error(err: Exception) -> bytes:
    """An error inside an SSE stream whose 200 status is already sent: one `data: {"error": ...}` event
    (openai-python raises APIError on it); the caller then ends the stream with [DONE]."""
    if not isinstance(err, APIError):
        logging.getLogger("dsv4gen.serve").error("error inside a stream", exc_info=err)
        err = APIError(f"internal error: {type(err).__name__}: {err}")
    return b"data: " + err.body() + b"\n\n"
