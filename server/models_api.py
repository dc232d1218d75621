"""Several models in one server: ``/models``, ``/models/load``, ``/models/unload``, and the cards
``/v1/models`` lists.

In llama.cpp's router shapes (``tools/server/README.md``): ``GET /models`` lists every configured
model with ``status.value`` loaded / loading / unloaded; ``POST /models/load`` and
``POST /models/unload`` take ``{"model": NAME}`` and answer ``{"success": true}``. Loading
blocks its request until the model is in memory (it runs off the event loop); unloading waits
for the model's requests to end. With one model served, it is always loaded and cannot be
unloaded.
"""

from __future__ import annotations

import asyncio

from litestar import Request, Response, get, post
from litestar.datastructures import State

from .endpoint import decode, json_response
from .errors import bad_request
from .model_pool import ModelState
from .protocol import ModelActionResult, ModelList, ModelStatus, ServedModelCard, model_action_decoder
from .service import ServedModel, Service


def card(model: ServedModel, state: ModelState = ModelState.LOADED, path: str | None = None,
         error: str | None = None) -> ServedModelCard:
    status = ModelStatus(value=state.value, failed=error is not None, error=error)
    return ServedModelCard(id=model.name, created=model.created, decoders=model.decoders,
                           max_model_len=model.max_model_len, path=path, status=status)


def model_cards(service: Service) -> list[ServedModelCard]:
    """Every model a request may name, with its state; a model never loaded yet has no decoders
    or context length to show."""
    manager = service.manager
    if manager is None:
        return [card(m) for m in service.models.values()]
    cards = []
    for name, state, error, served in manager.states():
        path = manager.paths.get(name)
        if not served:
            status = ModelStatus(value=state.value, failed=error is not None, error=error)
            cards.append(ServedModelCard(id=name, created=0, path=path, status=status))
        cards += [card(m, state, path, error) for m in served]
    return cards


def named(service: Service, raw: bytes) -> str:
    """The configured model a load or unload body names, or a 404."""
    name = decode(raw, model_action_decoder).model
    manager = service.manager
    owner = manager.owner(name) if manager is not None else (name if name in service.models else None)
    if owner is None:
        raise service.not_found(name)
    return owner


@get("/models", sync_to_thread=False)
def list_router_models(state: State) -> Response:
    return json_response(ModelList(data=model_cards(state.app_state.service)), {})


@post("/models/load", status_code=200)
async def load_model(request: Request, state: State) -> Response:
    service: Service = state.app_state.service
    name = named(service, await request.body())
    if service.manager is not None:
        await asyncio.to_thread(service.manager.load, name)
    return json_response(ModelActionResult(), {})


@post("/models/unload", status_code=200)
async def unload_model(request: Request, state: State) -> Response:
    service: Service = state.app_state.service
    name = named(service, await request.body())
    if service.manager is None:
        raise bad_request(f"'{name}' is the only model served: it stays loaded", "model", "model_not_unloadable")
    if not await asyncio.to_thread(service.manager.unload, name):
        raise bad_request(f"The model '{name}' is not loaded", "model", "model_not_loaded")
    return json_response(ModelActionResult(), {})


ROUTES: list = [list_router_models, load_model, unload_model]
