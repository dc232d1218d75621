"""``POST /v1/fim/completions`` (the FIM shape Mistral and DeepSeek serve): a completion with a suffix.

The body (``model``, ``prompt``, ``suffix``, ``max_tokens``, ``stop``, ``temperature``, ``top_p``,
``random_seed`` or ``seed``, ``stream``) becomes a /v1/completions request with ``suffix`` and is
planned by ``CompletionHandler``, so the suffix is placed exactly as there (``Route.with_suffix``) and
temperature 0 gives the same text on both endpoints. The answer has the shape of Mistral's FIM
endpoint, a chat completion: ``choices[].message.content``, and in a stream
``choices[].delta.content`` chunks ending with ``data: [DONE]``; Continue's
``@continuedev/openai-adapters`` (``OpenAIApi.fimStream``) passes those chunks on as chat chunks.
``min_tokens`` above 0 is refused: the engine has no minimum length.
"""

from __future__ import annotations

from typing import AsyncIterator

from litestar import Request, Response, post
from litestar.datastructures import State
from litestar.response import Stream

from .bodies import chat_body, chat_stream
from .completions import CompletionHandler
from .endpoint import generate
from .errors import bad_request
from .infill import DEFAULT_MAX_TOKENS
from .protocol import ChatCompletion, CompletionRequest, FimCompletionRequest, fim_completion_decoder
from .service import ChoiceResult, Job, Plan, Service
from .streaming import ended_cleanly


def completion_request(body: FimCompletionRequest) -> CompletionRequest:
    """The /v1/completions request this FIM request is; ``max_tokens`` left out is /infill's default."""
    return CompletionRequest(
        model=body.model, prompt=body.prompt, suffix=body.suffix,
        max_tokens=DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens,
        temperature=body.temperature, top_p=body.top_p, stop=body.stop,
        seed=body.random_seed if body.random_seed is not None else body.seed,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty, stream=body.stream,
        stream_options=body.stream_options, decoder=body.decoder)


class FimHandler:
    def __init__(self, service: Service, body: FimCompletionRequest, header_decoder: str | None):
        if body.prompt is None:
            raise bad_request("you must provide a prompt", "prompt", "missing_required_parameter")
        if body.min_tokens:
            raise bad_request("min_tokens is not supported: generation stops at EOS, a stop or max_tokens",
                              "min_tokens", "unsupported_parameter")
        self.service = service
        self.body = body
        self.completion = CompletionHandler(service, completion_request(body), header_decoder)

    def plan(self) -> Plan:
        return self.completion.plan()

    def respond(self, job: Job, results: list[ChoiceResult]) -> ChatCompletion:
        return chat_body(self.service, job, results, False, results[0].stats if results else None)

    def stream(self, job: Job) -> AsyncIterator[bytes]:
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        return ended_cleanly(chat_stream(self.service, job, False, include_usage))


@post("/v1/fim/completions", status_code=200)
async def fim_completions(request: Request, state: State) -> Response | Stream:
    return await generate(request, state, fim_completion_decoder, FimHandler)


ROUTES = [fim_completions]
