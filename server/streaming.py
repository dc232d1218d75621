"""Every stream ends cleanly: an error after the first byte becomes an error event, then the end marker.

Once a 200 and the first chunk have gone out, an error (a request timeout, an engine failure,
a reader too slow to keep up) can no longer change the status. Cutting the connection would
leave the client with a truncated chunked body and nothing to report, so the stream instead
sends OpenAI's error shape as one more event, ``data: {"error": {...}}``, and then its usual
end (``data: [DONE]``). The openai SDK raises ``APIError`` with that message when it reads
such an event.
"""

from __future__ import annotations

import logging
from typing import AsyncIterator

from .errors import APIError, ErrorKind
from .protocol import ErrorBody, ErrorResponse, encoder

log = logging.getLogger("dualserve.server")

DONE = b"data: [DONE]\n\n"


def error_event(err: APIError) -> bytes:
    body = ErrorResponse(error=ErrorBody(message=err.message, type=err.type, param=err.param, code=err.code))
    return b"data: " + encoder.encode(body) + b"\n\n"


async def ended_cleanly(events: AsyncIterator[bytes], end: bytes = DONE) -> AsyncIterator[bytes]:
    """Yield ``events``; if they raise, yield an error event and ``end`` instead of breaking off.

    Cancellation (the client went away) is not caught: there is nobody left to tell.
    """
    try:
        async for event in events:
            yield event
    except APIError as e:
        yield error_event(e)
        yield end
    except Exception:  # noqa: BLE001 - whatever broke, the client gets an ending
        log.exception("stream failed")
        yield error_event(APIError(ErrorKind.INTERNAL, "internal server error", None, "internal_error"))
        yield end
