"""API errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the right status.

Handlers raise ``APIError``, whose ``ErrorKind`` fixes the HTTP status and OpenAI's error type;
the app's exception handlers turn it (and any validation or unexpected error) into that shape.
A request the engine fails carries a ``FailureKind``, mapped to an ``ErrorKind`` here.
No traceback reaches a client.

Anthropic's Messages API (``/v1/messages...``) answers in Anthropic's shape instead,
``{"type": "error", "error": {"type", "message"}}``, its type chosen by the status as Anthropic
chooses it (https://docs.anthropic.com/en/api/errors); the handlers pick the shape by path.
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


# Anthropic's error type by HTTP status; any other 4xx is an invalid request, any other 5xx an api_error.
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                   503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}
ANTHROPIC_PATH = "/v1/messages"


def speaks_anthropic(request: Request) -> bool:
    path = request.url.path
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def anthropic_error_body(status: int, message: str) -> dict[str, object]:
    kind = ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_response(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(content=encoder.encode(anthropic_error_body(status, message)), status_code=status,
                    media_type="application/json", headers=headers or {})


def handle_api_error(request: Request, exc: APIError) -> Response:
    if speaks_anthropic(request):
        return anthropic_response(exc.status, exc.message, exc.headers)
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
    if speaks_anthropic(request):
        return anthropic_response(status, message, dict(exc.headers or {}))
    return _response(status, kind, message, headers=dict(exc.headers or {}))


def handle_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error")
    return handle_api_error(request, APIError(ErrorKind.INTERNAL, "internal server error"))
