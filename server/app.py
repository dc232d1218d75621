"""The HTTP surface: thin litestar handlers over ``Service``.

Each handler decodes the body into a msgspec Struct, asks the service to
validate, route and submit, and encodes the result (JSON, or SSE from an async
generator). Every generation response names the decoder that served it and
why in ``x-dualserve-decoder`` / ``x-dualserve-route-reason``. A client that
disconnects aborts its engine requests, which frees their blocks within a step.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import msgspec
from litestar import Litestar, Request, Response, get, post, route
from litestar.datastructures import State
from litestar.exceptions import HTTPException
from litestar.response import Stream

from .chat import ChatHandler
from .infill import build_infill
from .metrics import Metrics
from .status import render_page
from .errors import (APIError, bad_request, error_response, handle_api_error, handle_http_exception,
                     handle_unexpected)
from .protocol import ModelCard, ModelList, chat_decoder, completion_decoder, encoder, infill_decoder
from .responses import completion_body, completion_stream, infill_body, infill_stream
from .service import Service

DECODER_HEADER = "x-dualserve-decoder"


@dataclass
class AppState:
    service: Service
    metrics: Metrics = field(default_factory=Metrics)
    api_key: str | None = None       # Bearer token required on /v1/*, /infill and /metrics when set
    on_shutdown: list[Callable[[], Any]] = field(default_factory=list)
    body_limit: int = 8 * 1024 * 1024


def decode(raw: bytes, decoder: msgspec.json.Decoder) -> Any:
    if not raw:
        raise bad_request("request body is empty; expected a JSON object")
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as e:
        msg = str(e)
        param = msg.rsplit("at `$.", 1)[-1].rstrip("`").split("[")[0].split(".")[0] if "at `$." in msg else None
        raise bad_request(msg, param, "invalid_type") from None
    except msgspec.DecodeError as e:
        raise bad_request(f"could not parse the JSON body: {e}", None, "invalid_json") from None
    except RecursionError:
        raise bad_request("the JSON body is nested too deeply", None, "invalid_json") from None


def route_headers(route) -> dict[str, str]:
    return {DECODER_HEADER: route.decoder, "x-dualserve-route-reason": route.reason}


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run ``work``; if the client goes away first, cancel it (which aborts its engine requests)."""
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
        raise asyncio.CancelledError
    watcher.cancel()
    return task.result()


def json_response(body: Any, headers: dict[str, str]) -> Response:
    return Response(content=encoder.encode(body), media_type="application/json", headers=headers)


def sse_response(gen, headers: dict[str, str]) -> Stream:
    return Stream(gen, media_type="text/event-stream",
                  headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})


OPEN_PATHS = ("/health", "/", "/status.json")


def check_api_key(request: Request) -> Response | None:
    """Bearer authentication for everything but the health check and the status page."""
    key = request.app.state.app_state.api_key
    if not key or request.url.path in OPEN_PATHS:
        return None
    header = request.headers.get("authorization", "")
    if header.startswith("Bearer ") and header[7:].strip() == key:
        return None
    return error_response(APIError(401, "Incorrect or missing API key. Send it as 'Authorization: Bearer KEY'.",
                                   "invalid_request_error", None, "invalid_api_key"))


@route("/health", http_method=["GET", "HEAD"], sync_to_thread=False)
def health() -> dict[str, str]:
    return {"status": "ok"}


@get("/v1/models", sync_to_thread=False)
def list_models(state: State) -> Response:
    service: Service = state.app_state.service
    cards = [ModelCard(id=m.name, created=m.created, decoders=m.decoders, max_model_len=m.max_model_len)
             for m in service.models.values()]
    return json_response(ModelList(data=cards), {})


@post("/v1/completions", status_code=200)
async def completions(request: Request, state: State) -> Response | Stream:
    service: Service = state.app_state.service
    body = decode(await request.body(), completion_decoder)
    model = service.model(body.model)
    prompts = service.prompt_ids(model, body.prompt)
    suffix_ids = model.tokenizer.encode(body.suffix, add_special_tokens=False) if body.suffix else None
    if body.echo and body.logprobs is not None and (body.decoder or "auto") == "auto":
        body.decoder = "ar"  # prompt logprobs come from the AR path's prefill
    route = service.route(model, body, request.headers.get("x-dualserve-decoder"), infill=bool(body.suffix))
    if body.echo and body.logprobs is not None and route.decoder != "ar":
        raise bad_request("echo with logprobs is served by the 'ar' decoder", "echo", "unsupported_parameter")
    if suffix_ids and route.decoder != "diffusion":
        # AR decoders approximate infilling with fill-in-the-middle tokens, as llama.cpp does.
        prompts = [build_infill(model.tokenizer, model.tokenizer.decode(p), body.suffix, [], native=False).prefix_ids
                   for p in prompts]
        suffix_ids = None
    params = service.sampling_params(body, body.max_tokens, body.logprobs, max(len(p) for p in prompts), model,
                                     default_max=16)
    if body.echo and body.logprobs is not None:
        params = dataclasses.replace(params, prompt_logprobs=True)
    job = service.start(model, route, prompts, params, body.n, suffix_ids)
    echo = [model.tokenizer.decode(p) for p in prompts] if body.echo else []
    headers = route_headers(route)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse_response(completion_stream(service, job, echo, include_usage), headers)
    results = await until_disconnect(request, service.collect(job))
    return json_response(completion_body(service, job, results, echo, results[0].stats), headers)


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request, state: State) -> Response | Stream:
    service: Service = state.app_state.service
    body = decode(await request.body(), chat_decoder)
    handler = ChatHandler(service, body, request.headers.get("x-dualserve-decoder"))
    job = handler.start()
    headers = route_headers(job.route)
    if body.stream:
        return sse_response(handler.stream(job), headers)
    return json_response(await until_disconnect(request, handler.complete(job)), headers)


@get("/metrics", sync_to_thread=False)
def metrics(state: State) -> Response:
    app: AppState = state.app_state
    return Response(content=app.metrics.render(app.service.engine),
                    media_type="text/plain; version=0.0.4; charset=utf-8")


@get("/", sync_to_thread=False)
def status_page(state: State) -> Response:
    app: AppState = state.app_state
    return Response(content=render_page(list(app.service.models), app.metrics.node_cost_per_hour),
                    media_type="text/html")


@get("/status.json", sync_to_thread=False)
def status_json(state: State) -> Response:
    app: AppState = state.app_state
    now = app.metrics.refresh(app.service.engine)
    return json_response({"now": now, "history": list(app.metrics.history)}, {})


@post("/infill", status_code=200)
async def infill(request: Request, state: State) -> Response | Stream:
    """llama.cpp-compatible infill (llama.vscode and similar plugins)."""
    service: Service = state.app_state.service
    body = decode(await request.body(), infill_decoder)
    model = service.model(body.model)
    hints = service.infill_hints(body)
    route = service.route(model, hints, request.headers.get("x-dualserve-decoder"), infill=True)
    prompt = build_infill(model.tokenizer, body.input_prefix + body.prompt, body.input_suffix, body.input_extra,
                          native=route.decoder == "diffusion")
    params = service.sampling_params(hints, body.n_predict or body.max_tokens or 64, None,
                                     len(prompt.prefix_ids) + len(prompt.suffix_ids), model, default_max=64)
    job = service.start(model, route, [prompt.prefix_ids], params, 1, prompt.suffix_ids)
    headers = route_headers(route)
    if body.stream:
        return sse_response(infill_stream(service, job), headers)
    results = await until_disconnect(request, service.collect(job))
    return json_response(infill_body(job, results[0]), headers)


def create_app(app_state: AppState) -> Litestar:
    async def shutdown() -> None:
        for fn in app_state.on_shutdown:
            fn()

    return Litestar(
        route_handlers=[health, list_models, completions, chat_completions, infill, metrics, status_page,
                        status_json],
        before_request=check_api_key,
        state=State({"app_state": app_state}),
        exception_handlers={APIError: handle_api_error, HTTPException: handle_http_exception,
                            Exception: handle_unexpected},
        on_shutdown=[shutdown],
        request_max_body_size=app_state.body_limit,
        debug=False,
    )
