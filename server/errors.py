"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

Handlers raise ``APIError``, whose ``ErrorKind`` fixes the HTTP status and OpenAI's error type;
the app's exception handlers turn it (and any validation or unexpected error) into that shape.
A request the engine fails carries a ``FailureKind``, mapped to an ``ErrorKind`` here.
No traceback reaches a client.
"""

from __future__ import annotations

import enum
import logging

from litestar import Request, Response
from litestar.exceptions import HTTPException

from dualserve.decoders.engine.request import FailureKind

from .protocol import ErrorBody, ErrorResponse, encoder

log = logging.getLogger("dualserve.server")


class ErrorKind(enum.Enum):
    """What went wrong, as (HTTP status, OpenAI error type)."""

    INVALID_REQUEST = (400, "invalid_request_error")
    UNAUTHENTICATED = (401, "invalid_request_error")  # as OpenAI answers a wrong key
    NOT_FOUND = (404, "invalid_request_error")
    OVERLOADED = (429, "rate_limit_error")            # the queue is full or too slow, or the wait ran out
    INTERNAL = (500, "server_error")                  # a decoder or engine step failed
    NO_CAPACITY = (503, "server_error")               # the prompt can never fit in the KV block pool
    TIMEOUT = (504, "timeout_error")

    @property
    def status(self) -> int:
        return self.value[0]

    @property
    def type(self) -> str:
        return self.value[1]


class APIError(Exception):
    def __init__(self, kind: ErrorKind, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def status(self) -> int:
        return self.kind.status

    @property
    def type(self) -> str:
        return self.kind.type


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(ErrorKind.INVALID_REQUEST, message, param, code)


# What a client is told when the engine fails its request, by the engine's kind of failure.
ENGINE_FAILURES = {FailureKind.CAPACITY: ErrorKind.NO_CAPACITY, FailureKind.BAD_REQUEST: ErrorKind.INVALID_REQUEST,
                   FailureKind.INTERNAL: ErrorKind.INTERNAL, FailureKind.OVERLOADED: ErrorKind.OVERLOADED}


def overloaded(message: str = "The server is overloaded; retry shortly.", retry_after: int = 1,
               code: str = "server_overloaded") -> APIError:
    """A 429 with ``Retry-After`` (seconds): the queue is full, its estimated wait too long, or a
    queued request's wait ran out (code ``queue_timeout``)."""
    return APIError(ErrorKind.OVERLOADED, message, None, code, headers={"Retry-After": str(retry_after)})


def engine_error(failure: FailureKind, message: str) -> APIError:
    """A request the engine finished with an error (``Delta.failure``, ``Delta.error``)."""
    if failure is FailureKind.OVERLOADED:
        return overloaded(message, code="queue_timeout")
    return APIError(ENGINE_FAILURES[failure], message, None, "engine_error")


def error_response(err: APIError) -> Response:
    return _response(err.status, err.type, err.message, err.param, err.code, err.headers)


def _response(status: int, type: str, message: str, param: str | None = None, code: str | None = None,
              headers: dict[str, str] | None = None) -> Response:
    body = ErrorResponse(error=ErrorBody(message=message, type=type, param=param, code=code))
    return Response(content=encoder.encode(body), status_code=status, media_type="application/json",
                    headers=headers or {})


def handle_api_error(_: Request, exc: APIError) -> Response:
    return error_response(exc)


def handle_http_exception(request: Request, exc: HTTPException) -> Response:
    """litestar's own refusals (unknown path, wrong method, body too large) in the same shape; an
    unknown path or method is named as OpenAI names it ("Invalid URL (POST /v1/embeddings)")."""
    status = exc.status_code
    kind = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
            413: "invalid_request_error", 429: "rate_limit_error"}.get(status, "invalid_request_error")
    if status >= 500:
        kind = "server_error"
    message = str(exc.detail)
    if status in (404, 405) and message in ("Not Found", "Method Not Allowed"):
        message, kind = f"Invalid URL ({request.method} {request.url.path})", "invalid_request_error"
    return _response(status, kind, message, headers=dict(exc.headers or {}))


def handle_unexpected(_: Request, exc: Exception) -> Response:
    log.exception("unhandled error")
    return error_response(APIError(ErrorKind.INTERNAL, "internal server error"))
