"""The HTTP surface: litestar routes over ``Service``, with authentication and errors.

Each API is a thin shape over one path. The OpenAI generation endpoints (``completions``, ``chat``,
``responses``, ``fim_completions``) and Anthropic's Messages API (``anthropic``, translated into a
chat request) go through ``endpoint.generate``: decode the body into a msgspec Struct, let the
endpoint's handler build a plan, submit it, and encode the result (JSON, or SSE from an async
generator). llama.cpp's native endpoints (``infill``, ``llamacpp_completion``) plan the same way and
answer in llama.cpp's shape; ``embeddings`` and ``rerank`` submit to the model's pooling decoders;
``tokenize`` and ``models_api`` answer without the engine. Every generation response names the
decoder that served it and why in ``x-dualserve-decoder`` / ``x-dualserve-route-reason``. A client
that disconnects aborts its engine requests, which frees their blocks within a step. Errors answer in
the shape of the API the path belongs to (``errors``).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

from litestar import Litestar, Request, Response, get, post, route
from litestar.datastructures import State
from litestar.exceptions import HTTPException
from litestar.response import Stream

from .chat import ChatHandler
from .completions import CompletionHandler
from . import anthropic, embeddings, fim_completions, infill, llamacpp_completion, models_api, rerank, tokenize
from .errors import APIError, ErrorKind, handle_api_error, handle_http_exception, handle_unexpected
from .metrics import Metrics
from .endpoint import generate, json_response
from .protocol import ModelCard, ModelList, chat_decoder, completion_decoder, responses_decoder
from .responses.handler import ResponsesHandler, delete_response, retrieve_response
from .responses.store import ResponseStore
from .service import Service
from .status import compile_status, render_page


@dataclass
class AppState:
    service: Service
    metrics: Metrics = field(default_factory=Metrics)
    api_key: str | None = None       # Bearer token required on everything but OPEN_PATHS when set
    on_shutdown: list[Callable[[], Any]] = field(default_factory=list)
    body_limit: int = 8 * 1024 * 1024
    draining: bool = False           # set by the shutdown drain (lifecycle.Drain): new requests get 503
    failure: str | None = None       # set when a tensor-parallel rank fails (server/tensor_parallel.py)
    response_store: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses with store=true
    compile_progress: Callable[[], Any] | None = None  # the compile worker's progress, set by cli.serving_state
    threads: Callable[[], dict] | None = None  # the thread governor's state (openmp.ThreadGovernor), set by cli


# The page at / is open (it holds no data, and asks for the key when /status.json wants one).
OPEN_PATHS = ("/health", "/v1/health", "/")


def check_request(request: Request) -> Response | None:
    """Refuse new work while draining (503, Retry-After; reads such as /metrics stay open), then
    authentication for everything but OPEN_PATHS: exactly "Bearer KEY", or the key alone in
    ``x-api-key`` (Anthropic's clients), compared in constant time."""
    app: AppState = request.app.state.app_state
    if app.draining and request.method == "POST":
        return handle_api_error(request, APIError(ErrorKind.NO_CAPACITY, "The server is shutting down; retry "
                                                  "shortly.", None, "server_shutting_down", headers={"Retry-After": "5"}))
    if not app.api_key or request.url.path in OPEN_PATHS:
        return None
    key = app.api_key.encode()
    bearer = request.headers.get("authorization", "").encode()
    api_key = request.headers.get("x-api-key", "").encode()
    if hmac.compare_digest(bearer, b"Bearer " + key) or hmac.compare_digest(api_key, key):
        return None
    # The error in the shape of the API the path belongs to (Anthropic's on /v1/messages).
    return handle_api_error(request, APIError(ErrorKind.UNAUTHENTICATED, "Incorrect or missing API key. Send it as "
                                              "'Authorization: Bearer KEY' or 'x-api-key: KEY'.", None,
                                              "invalid_api_key"))


@route(["/health", "/v1/health"], http_method=["GET", "HEAD"], sync_to_thread=False)
def health(state: State) -> Response:
    if state.app_state.failure is not None:  # a rank is gone: the server is about to exit non-zero
        return Response(content={"status": "failed", "error": state.app_state.failure}, status_code=503)
    if state.app_state.draining:  # load balancers stop sending work here
        return Response(content={"status": "draining"}, status_code=503, headers={"Retry-After": "5"})
    return Response(content={"status": "ok"})


def model_card(model) -> ModelCard:
    """A loaded model's card (``models_api.card``: with its state, as llama.cpp's router reports it)."""
    return models_api.card(model)


@get("/v1/models", sync_to_thread=False)
def list_models(state: State) -> Response:
    """Every model a request may name, loaded or not, with its ``status``."""
    return json_response(ModelList(data=models_api.model_cards(state.app_state.service)), {})


@get("/v1/models/{model_id:str}", sync_to_thread=False)
def retrieve_model(state: State, model_id: str) -> Response:
    service: Service = state.app_state.service
    found = next((c for c in models_api.model_cards(service) if c.id == model_id), None)
    if found is None:
        raise service.not_found(model_id)
    return json_response(found, {})


@post("/v1/completions", status_code=200)
async def completions(request: Request, state: State) -> Response | Stream:
    return await generate(request, state, completion_decoder, CompletionHandler)


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request, state: State) -> Response | Stream:
    return await generate(request, state, chat_decoder, ChatHandler)


@post("/v1/responses", status_code=200)
async def responses(request: Request, state: State) -> Response | Stream:
    """OpenAI's Responses API, served through the chat path (see ``responses.handler``)."""
    handler = partial(ResponsesHandler, store=state.app_state.response_store)
    return await generate(request, state, responses_decoder, handler)


@get("/metrics", sync_to_thread=False)
def metrics(state: State) -> Response:
    app: AppState = state.app_state
    # Prometheus' text format 0.0.4; litestar appends the charset.
    return Response(content=app.metrics.render(app.service.engine), media_type="text/plain; version=0.0.4")


@get("/", sync_to_thread=False)
def status_page(state: State) -> Response:
    app: AppState = state.app_state
    return Response(content=render_page(list(app.service.models), app.metrics.node_cost_per_hour),
                    media_type="text/html")


@get("/status.json", sync_to_thread=False)
def status_json(state: State) -> Response:
    app: AppState = state.app_state
    now = app.metrics.refresh(app.service.engine)
    compiling = compile_status(app.compile_progress() if app.compile_progress else None)
    threads = app.threads() if app.threads else None
    return json_response({"now": now, "history": list(app.metrics.history), "compile": compiling,
                          "threads": threads}, {})


def create_app(app_state: AppState) -> Litestar:
    async def shutdown() -> None:
        for fn in app_state.on_shutdown:
            fn()

    return Litestar(
        route_handlers=[health, list_models, retrieve_model, completions, chat_completions, responses, retrieve_response,
                        delete_response, metrics, status_page, status_json,
                        *anthropic.ROUTES, *embeddings.ROUTES, *fim_completions.ROUTES, *infill.ROUTES,
                        *llamacpp_completion.ROUTES, *models_api.ROUTES, *rerank.ROUTES, *tokenize.ROUTES],
        before_request=check_request,
        state=State({"app_state": app_state}),
        exception_handlers={APIError: handle_api_error, HTTPException: handle_http_exception,
                            Exception: handle_unexpected},
        on_shutdown=[shutdown],
        request_max_body_size=app_state.body_limit,
        debug=False,
    )
