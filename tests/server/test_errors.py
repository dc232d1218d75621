"""Errors: each kind fixes the HTTP status and OpenAI's error type; engine failures get a kind."""

from __future__ import annotations

from dualserve.decoders.engine.request import FailureKind
from dualserve.server.errors import APIError, ErrorKind, engine_error, error_response


def test_api_errors_take_status_and_type_from_their_kind():
    assert [(k.status, k.type) for k in ErrorKind] == [
        (400, "invalid_request_error"), (401, "invalid_request_error"), (404, "invalid_request_error"),
        (429, "rate_limit_error"), (500, "server_error"), (503, "server_error"), (504, "timeout_error")]
    err = APIError(ErrorKind.OVERLOADED, "busy", None, "server_overloaded", headers={"Retry-After": "1"})
    response = error_response(err)
    assert response.status_code == 429 and response.headers["Retry-After"] == "1"
    assert (err.status, err.type, err.code) == (429, "rate_limit_error", "server_overloaded")


def test_engine_failures_are_503_when_the_pool_is_too_small_else_500():
    full = engine_error(FailureKind.CAPACITY, "the prompt does not fit in the KV block pool")
    assert (full.kind, full.code) == (ErrorKind.NO_CAPACITY, "engine_error")
    assert engine_error(FailureKind.INTERNAL, "internal error: RuntimeError").kind is ErrorKind.INTERNAL
    assert engine_error(FailureKind.BAD_REQUEST, "prompt logprobs need an autoregressive decoder").status == 400
    # The kind, not the text, fixes the status.
    assert engine_error(FailureKind.INTERNAL, "the KV block pool broke").kind is ErrorKind.INTERNAL
