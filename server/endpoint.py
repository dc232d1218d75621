"""What every endpoint module shares: decoding a body, JSON and SSE responses, the generation path.

Each endpoint lives in its own module (``completions``, ``chat``, ``infill``, ``anthropic``,
``embeddings`` ...) and registers its litestar handlers in ``app``; this module holds the plumbing
they all use, so none of them imports ``app``.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable

import msgspec
from litestar import Request, Response
from litestar.datastructures import State
from litestar.response import Stream

from .errors import bad_request
from .handler import HandlerType
from .protocol import DECODER_HEADER, ROUTE_REASON_HEADER, encoder
from .router import Route
from .service import Service


def decode(raw: bytes, decoder: msgspec.json.Decoder) -> Any:
    if not raw:
        raise bad_request("request body is empty; expected a JSON object")
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as e:
        msg = str(e)
        param = msg.rsplit("at `$.", 1)[-1].rstrip("`").split("[")[0].split(".")[0] if "at `$." in msg else None
        raise bad_request(msg, param, "array_above_max_length" if "of length <=" in msg else "invalid_type") from None
    except msgspec.DecodeError as e:
        raise bad_request(f"could not parse the JSON body: {e}", None, "invalid_json") from None
    except RecursionError:
        raise bad_request("the JSON body is nested too deeply", None, "invalid_json") from None


def route_headers(route: Route) -> dict[str, str]:
    return {DECODER_HEADER: route.decoder, ROUTE_REASON_HEADER: route.reason}


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run ``work``; if the client goes away first, cancel it (which aborts its engine requests) and
    return ``CLIENT_GONE``."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task not in done:
        task.cancel()
        return CLIENT_GONE
    watcher.cancel()
    return task.result()


CLIENT_GONE = object()
# nginx's "client closed request": never seen by the client, but not logged as a server error either.
CLIENT_GONE_STATUS = 499


def json_response(body: Any, headers: dict[str, str]) -> Response:
    return Response(content=encoder.encode(body), media_type="application/json", headers=headers)


def sse_response(gen, headers: dict[str, str]) -> Stream:
    return Stream(gen, media_type="text/event-stream",
                  headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})


async def generate(request: Request, state: State, body_decoder: msgspec.json.Decoder,
                   handler_type: HandlerType) -> Response | Stream:
    """The path every generation endpoint takes: decode, plan, submit, then stream or collect."""
    service: Service = state.app_state.service
    body = decode(await request.body(), body_decoder)
    await service.ready(getattr(body, "model", None))  # a model not in memory loads off the event loop
    handler = handler_type(service, body, request.headers.get(DECODER_HEADER))
    # Tokenizing, templating and compiling a grammar take a thread; the event loop keeps answering.
    plan = await asyncio.to_thread(lambda: service.prepare(handler.plan()))
    job = service.start(plan)
    headers = route_headers(job.route)
    if body.stream:
        return sse_response(handler.stream(job), headers)
    results = await until_disconnect(request, service.collect(job))
    if results is CLIENT_GONE:
        return Response(content=b"", status_code=CLIENT_GONE_STATUS)
    return json_response(handler.respond(job, results), headers)
