"""``POST /v1/rerank`` (llama.cpp, Jina and Cohere shapes): a query and documents -> relevance scores.

Also served at ``/rerank`` and ``/v1/reranking``, llama.cpp's aliases. The body is what those
clients send: ``{model, query, documents: [str | {text}], top_n, return_documents}``; the answer
``{id, model, object: "list", results: [{index, relevance_score, document?}], usage}`` lists the
documents by score, highest first (ties in document order), cut to ``top_n``.

Scores are Qwen3-Reranker's: each (query, document) pair becomes one prompt and the score is
P(yes), a softmax over the "yes" and "no" logits at its last position, computed by the model's
``score`` pooling decoder (``decoders/pooling.py``) batched through the engine. A declared reranker
gets its model card's prompt (``models.pooling.reranker_ids``); any other chat model the same
question through its own chat template (``judge_ids``). An embedding model, or a model without a
chat template, cannot rerank: a 400.
"""

from __future__ import annotations

import asyncio
import uuid

import torch
from litestar import Request, Response, post
from litestar.datastructures import State

from dualserve.decoders.pooling import PoolingDecoder, pooling_decoder
from dualserve.models.pooling import judge_ids, reranker_ids, yes_probability

from .embeddings import MAX_INPUTS, check_context, pooled
from .endpoint import CLIENT_GONE, CLIENT_GONE_STATUS, decode, json_response, until_disconnect
from .errors import bad_request
from .protocol import EmbeddingUsage, RerankDocument, RerankRequest, RerankResponse, RerankResult, rerank_decoder
from .service import ServedModel, Service


def scorer_of(service: Service, model: ServedModel) -> PoolingDecoder:
    decoder = pooling_decoder(service.engine, model.name, "score")
    if decoder is None:
        raise bad_request(f"model {model.name!r} cannot rerank: it is neither a reranker nor a chat model whose "
                          "vocabulary spells \"yes\" and \"no\" as one token each", "model", "model_not_supported")
    return decoder


def document_texts(body: RerankRequest) -> list[str]:
    if not isinstance(body.query, str) or not body.query:
        raise bad_request("query must be a non-empty string", "query", "invalid_value")
    if not body.documents:
        raise bad_request("documents must be a non-empty list of strings or {text} objects", "documents",
                          "invalid_value")
    if len(body.documents) > MAX_INPUTS:
        raise bad_request(f"at most {MAX_INPUTS} documents per request", "documents", "array_above_max_length")
    if body.top_n is not None and body.top_n < 1:
        raise bad_request("top_n must be at least 1", "top_n", "invalid_value")
    return [d if isinstance(d, str) else d.text for d in body.documents]


def pair_ids(model: ServedModel, decoder: PoolingDecoder, query: str, docs: list[str],
             instruction: str | None) -> list[list[int]]:
    """One prompt per document: the reranker's own layout, else the model's chat template."""
    form = reranker_ids if decoder.profile.purpose == "rerank" else judge_ids
    prompts = [form(model.tokenizer, query, doc, instruction) for doc in docs]
    check_context(model, prompts, "documents")
    return prompts


def ranked(scores: list[float], docs: list[str], top_n: int | None, with_documents: bool) -> list[RerankResult]:
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:top_n]
    return [RerankResult(index=i, relevance_score=scores[i],
                         document=RerankDocument(text=docs[i]) if with_documents else None) for i in order]


@post(["/v1/rerank", "/rerank", "/v1/reranking", "/reranking"], status_code=200)  # llama.cpp serves all four
async def rerank(request: Request, state: State) -> Response:
    service: Service = state.app_state.service
    body = decode(await request.body(), rerank_decoder)
    model = await asyncio.to_thread(service.model, body.model)  # with several models, it may load first
    decoder = scorer_of(service, model)
    docs = document_texts(body)
    service.check_length(model, [body.query, *docs], "documents")
    prompts = await asyncio.to_thread(pair_ids, model, decoder, body.query, docs, body.instruction)
    logits = await until_disconnect(request, pooled(service, model, "score", prompts))
    if logits is CLIENT_GONE:
        return Response(content=b"", status_code=CLIENT_GONE_STATUS)
    scores = yes_probability(torch.stack(logits)).tolist()
    tokens = sum(map(len, prompts))
    return json_response(RerankResponse(id=uuid.uuid4().hex, model=model.name,
                                        results=ranked(scores, docs, body.top_n, body.return_documents),
                                        usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)), {})


ROUTES: list = [rerank]
