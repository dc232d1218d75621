"""OpenAI's ``POST /v1/embeddings``: texts or token ids -> pooled vectors.

The request's shape is OpenAI's: ``input`` as a string, a list of strings, a token-id list or a
list of token-id lists (at most ``MAX_INPUTS``, each non-empty and within the context);
``encoding_format`` ``float`` or ``base64`` (the little-endian float32 bytes, which OpenAI's SDK
asks for by default and decodes with numpy); ``dimensions`` where the model allows it (a
Matryoshka cut: the first d values, renormalised, ``models.pooling``), else a 400.

Every input runs through the engine as one request of the model's ``embed`` pooling decoder
(``decoders/pooling.py``), batched with whatever else is running, and never touching the prefix
cache. Inputs go to the engine in waves the admission bound allows (``Service.admit``: one
request may take half the waiting queue), so a client that sends LangChain's 1000-input chunks is
served, a wave at a time. ``pooled`` is the path rerank shares.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
from typing import Any

import torch
from litestar import Request, Response, post
from litestar.datastructures import State

from dualserve.decoders.engine.sampling import SamplingParams
from dualserve.decoders.pooling import PoolingDecoder, Task, pooling_decoder, pooling_key
from dualserve.models.pooling import text_ids, truncate

from .endpoint import CLIENT_GONE, CLIENT_GONE_STATUS, decode, json_response, until_disconnect
from .errors import APIError, ErrorKind, bad_request
from .protocol import EmbeddingData, EmbeddingResponse, EmbeddingUsage, embedding_decoder
from .router import Route
from .service import Job, Plan, ServedModel, Service

# OpenAI's bound on inputs per request (its API reference, "input").
MAX_INPUTS = 2048
# Inputs submitted to the engine at once, at most: one step batches them all.
WAVE = 64
INPUT_SHAPES = "input must be a string, a list of strings, a list of token ids or a list of lists of token ids"


async def pooled(service: Service, model: ServedModel, task: Task, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Each prompt's ``Delta.pooled`` from ``model``'s ``task`` pooling decoder, in order."""
    served = dataclasses.replace(model, name=pooling_key(model.name))  # the engine's key of its pooling decoders
    route = Route(task, "pooling")
    params = SamplingParams(max_tokens=1, temperature=0.0)
    wave = max(1, min(WAVE, service.engine.config.max_waiting // 2))
    out: list[torch.Tensor] = []
    if service.manager is not None:  # the served model is in use until the last wave ends (never unloaded meanwhile)
        service.manager.begin(model.name)
    try:
        for lo in range(0, len(prompts), wave):
            job = service.start(Plan(model=served, route=route, prompts=prompts[lo: lo + wave], params=params))
            out += await wave_results(service, job)
    finally:
        if service.manager is not None:
            service.manager.end(model.name)
    return out


async def wave_results(service: Service, job: Job) -> list[torch.Tensor]:
    """One submitted wave's vectors, in order."""
    vectors: list[torch.Tensor | None] = [None] * job.num_choices
    async for index, delta in service.deltas(job):
        if delta.pooled is not None:
            vectors[index] = delta.pooled
    if any(v is None for v in vectors):  # ended without a result: the server is shutting down
        raise APIError(ErrorKind.NO_CAPACITY, "The server is shutting down; retry shortly.", None,
                       "server_shutting_down", headers={"Retry-After": "5"})
    return vectors


def embedder_of(service: Service, model: ServedModel) -> PoolingDecoder:
    decoder = pooling_decoder(service.engine, model.name, "embed")
    if decoder is None:
        hint = "; it is a reranker: use /v1/rerank" if pooling_decoder(service.engine, model.name, "score") else ""
        raise bad_request(f"model {model.name!r} does not serve embeddings{hint}", "model", "model_not_supported")
    return decoder


def output_size(requested: int | None, decoder: PoolingDecoder) -> int:
    """The vector length to answer with: the model's width, or ``dimensions`` where it allows."""
    width = decoder.width
    if requested is None or requested == width:
        return width
    if not 1 <= requested <= width:
        raise bad_request(f"dimensions must be between 1 and {width}, the model's embedding size", "dimensions",
                          "invalid_value")
    allowed = decoder.profile.dimensions
    if allowed is not None and requested not in allowed:
        sizes = f"it was trained for {', '.join(map(str, allowed))}" if allowed else "it is not a Matryoshka model"
        raise bad_request(f"this model cannot shorten its embeddings to {requested} dimensions: {sizes}",
                          "dimensions", "invalid_value")
    return requested


def input_ids(service: Service, model: ServedModel, raw: Any) -> list[list[int]]:
    """The token ids of each input, checked as OpenAI checks them (the module docstring)."""
    if raw is None:
        raise bad_request("you must provide an input", "input", "missing_required_parameter")
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not items:
        raise bad_request(f"{INPUT_SHAPES}, and must not be empty", "input", "invalid_type")
    if isinstance(raw, list) and all(type(t) is int for t in raw):
        items = [raw]  # one token-id list
    if len(items) > MAX_INPUTS:
        raise bad_request(f"at most {MAX_INPUTS} inputs per request", "input", "array_above_max_length")
    if all(isinstance(t, str) for t in items):
        if not all(items):
            raise bad_request("input must not contain an empty string", "input", "invalid_value")
        service.check_length(model, items, "input")
        ids = [text_ids(model.tokenizer, text) for text in items]
    elif all(isinstance(p, list) and p and all(type(t) is int for t in p) for p in items):
        vocab = model.tokenizer.vocab_size
        if any(not 0 <= t < vocab for p in items for t in p):
            raise bad_request(f"token ids must be in [0, {vocab})", "input", "invalid_value")
        ids = [list(p) for p in items]
    else:
        raise bad_request(f"{INPUT_SHAPES}, and must not be empty", "input", "invalid_type")
    if not all(ids):
        raise bad_request("an input has no tokens (only spaces?)", "input", "invalid_value")
    check_context(model, ids, "input")
    return ids


def check_context(model: ServedModel, prompts: list[list[int]], param: str) -> None:
    longest = max(len(p) for p in prompts)
    if longest > model.max_model_len:
        raise bad_request(f"This model's maximum context length is {model.max_model_len} tokens, however you "
                          f"requested {longest} tokens in the {param}. Please reduce your {param}.", param,
                          "context_length_exceeded")


def embedding_data(index: int, vector: torch.Tensor, size: int, fmt: str) -> EmbeddingData:
    vector = vector if size == vector.shape[-1] else truncate(vector, size)
    if fmt == "base64":
        raw = vector.to(torch.float32).numpy().astype("<f4").tobytes()
        return EmbeddingData(index=index, embedding=base64.b64encode(raw).decode("ascii"))
    return EmbeddingData(index=index, embedding=vector.tolist())


@post("/v1/embeddings", status_code=200)
async def embeddings(request: Request, state: State) -> Response:
    service: Service = state.app_state.service
    body = decode(await request.body(), embedding_decoder)
    model = await asyncio.to_thread(service.model, body.model)  # with several models, it may load first
    size = output_size(body.dimensions, embedder_of(service, model))
    prompts = await asyncio.to_thread(input_ids, service, model, body.input)  # tokenizing takes a thread
    vectors = await until_disconnect(request, pooled(service, model, "embed", prompts))
    if vectors is CLIENT_GONE:
        return Response(content=b"", status_code=CLIENT_GONE_STATUS)
    tokens = sum(map(len, prompts))
    data = [embedding_data(i, v, size, body.encoding_format) for i, v in enumerate(vectors)]
    return json_response(EmbeddingResponse(model=model.name, data=data,
                                           usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)), {})


ROUTES: list = [embeddings]
