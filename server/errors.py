"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

Handlers raise ``APIError``; the app's exception handlers turn it (and any
validation or unexpected error) into that shape. No traceback reaches a client.
"""

from __future__ import annotations

import logging

from litestar import Request, Response
from litestar.exceptions import HTTPException

from .protocol import ErrorBody, ErrorResponse, encoder

log = logging.getLogger("dualserve.server")


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def error_response(err: APIError) -> Response:
    body = ErrorResponse(error=ErrorBody(message=err.message, type=err.type, param=err.param, code=err.code))
    return Response(content=encoder.encode(body), status_code=err.status, media_type="application/json",
                    headers=err.headers)


def handle_api_error(_: Request, exc: APIError) -> Response:
    return error_response(exc)


def handle_http_exception(_: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    kind = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
            413: "invalid_request_error", 429: "rate_limit_error"}.get(status, "invalid_request_error")
    if status >= 500:
        kind = "server_error"
    return error_response(APIError(status, str(exc.detail), kind, headers=dict(exc.headers or {})))


def handle_unexpected(_: Request, exc: Exception) -> Response:
    log.exception("unhandled error")
    return error_response(APIError(500, "internal server error", "server_error"))
