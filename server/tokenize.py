"""llama.cpp's ``/tokenize``, ``/detokenize``, ``/apply-template`` and token counting.

Shapes from llama.cpp's tools/server/README.md:

- ``POST /tokenize``: ``content`` (+ ``add_special``, ``parse_special``, ``with_pieces``) ->
  ``{"tokens": [ids]}``, or ``{"tokens": [{"id", "piece"}]}`` where ``piece`` is the token's text, or
  its bytes as a list of integers when they are not valid UTF-8 on their own (a piece of a character);
- ``POST /detokenize``: ``tokens`` -> ``{"content"}``, special tokens spelled out;
- ``POST /apply-template``: a chat body -> ``{"prompt"}``, the text the chat path would tokenize;
- ``POST /v1/chat/completions/input_tokens``: a chat body -> ``{"input_tokens": N}``.

The last two render the conversation with ``ChatHandler.prompt_text``, the chat path's own code, so
tools, ``chat_template_kwargs`` and the generation prompt count exactly as a chat request's
``usage.prompt_tokens`` does. Every endpoint takes an optional ``model``. Tokenizing and templating
run on a worker thread, so the event loop keeps answering.
"""

from __future__ import annotations

import asyncio
import weakref

import tokenizers
from litestar import Request, Response, post
from litestar.datastructures import State

from .chat import ChatHandler
from .endpoint import decode, json_response
from .errors import bad_request
from .protocol import (ApplyTemplateResponse, DetokenizeRequest, DetokenizeResponse, InputTokensResponse, TokenPiece,
                       TokenizeRequest, TokenizeResponse, chat_decoder, detokenize_decoder, tokenize_decoder)
from .service import ServedModel, Service

# Per tokenizer, a copy that reads special-token text as plain text (``parse_special: false``): the
# setting belongs to the whole tokenizers object, so the served one is never switched.
_LITERAL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def literal_backend(tokenizer) -> tokenizers.Tokenizer:
    backend = _LITERAL.get(tokenizer)
    if backend is None:
        backend = tokenizers.Tokenizer.from_str(tokenizer.backend.to_str())
        backend.encode_special_tokens = True
        _LITERAL[tokenizer] = backend
    return backend


def encode(model: ServedModel, body: TokenizeRequest) -> list[int]:
    tok = model.tokenizer
    if body.parse_special:
        return tok.encode(body.content, add_special_tokens=body.add_special)
    ids = literal_backend(tok).encode_batch([body.content], add_special_tokens=False)[0].ids
    if body.add_special:  # the model's BOS / EOS, as Tokenizer.encode adds them
        ids = [tok.bos_token_id] * tok.add_bos_token + ids + [tok.eos_token_id] * tok.add_eos_token
    return ids


def pieces(service: Service, model: ServedModel, ids: list[int]) -> list[TokenPiece]:
    """Each token's text, or its raw bytes where they are not valid UTF-8 alone (llama.cpp's
    ``validate_utf8`` check). The bytes come from llguidance's index of the vocabulary, which the
    engine keeps per model for structured output."""
    tok = model.tokenizer
    try:
        raw = service.engine.grammar_compiler(model.name).tokenizer.decode_bytes
    except Exception:  # noqa: BLE001 - a vocabulary llguidance cannot index: its text is all there is
        raw = None
    out = []
    for i in ids:
        text = tok.decode([i], skip_special_tokens=False)
        if "\ufffd" in text and raw is not None:
            data = raw([i])
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                out.append(TokenPiece(id=i, piece=list(data)))
                continue
        out.append(TokenPiece(id=i, piece=text))
    return out


def tokenize_body(service: Service, body: TokenizeRequest) -> TokenizeResponse:
    model = service.model(body.model)
    service.check_length(model, [body.content], "content")
    ids = encode(model, body)
    return TokenizeResponse(tokens=pieces(service, model, ids) if body.with_pieces else ids)


def detokenize_body(service: Service, body: DetokenizeRequest) -> DetokenizeResponse:
    model = service.model(body.model)
    vocab = model.tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise bad_request(f"tokens must be token ids in [0, {vocab})", "tokens", "invalid_value")
    return DetokenizeResponse(content=model.tokenizer.decode(body.tokens, skip_special_tokens=False))


async def answer(request: Request, state: State, decoder, build) -> Response:
    service: Service = state.app_state.service
    body = decode(await request.body(), decoder)
    return json_response(await asyncio.to_thread(build, service, body), {})


@post("/tokenize", status_code=200)
async def tokenize(request: Request, state: State) -> Response:
    return await answer(request, state, tokenize_decoder, tokenize_body)


@post("/detokenize", status_code=200)
async def detokenize(request: Request, state: State) -> Response:
    return await answer(request, state, detokenize_decoder, detokenize_body)


@post("/apply-template", status_code=200)
async def apply_template(request: Request, state: State) -> Response:
    """The chat path's prompt for a conversation (messages, tools...), with the generation prompt."""
    return await answer(request, state, chat_decoder, lambda service, body: ApplyTemplateResponse(
        prompt=ChatHandler(service, body, None).prompt_text()))


@post("/v1/chat/completions/input_tokens", status_code=200)
async def input_tokens(request: Request, state: State) -> Response:
    """How many prompt tokens this chat request would have: its ``usage.prompt_tokens``."""
    return await answer(request, state, chat_decoder, lambda service, body: InputTokensResponse(
        input_tokens=len(ChatHandler(service, body, None).prompt_ids())))


ROUTES = [tokenize, detokenize, apply_template, input_tokens]
