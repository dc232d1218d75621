"""/v1/completions: prompts (text or token ids, with an optional suffix) -> a plan, results -> bodies.

``echo`` with ``logprobs`` needs prompt logprobs, which only the AR path's prefill computes, so
such a request goes to ``ar`` unless it names a decoder. A ``suffix`` is placed the way the
routed decoder infills (see ``Route.with_suffix``).
"""

from __future__ import annotations

import dataclasses
from typing import AsyncIterator

from .errors import bad_request
from .protocol import Completion, CompletionRequest
from .router import RequestTraits
from .bodies import completion_body, completion_stream
from .service import ChoiceResult, Job, Plan, Service
from .streaming import ended_cleanly

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint


class CompletionHandler:
    def __init__(self, service: Service, body: CompletionRequest, header_decoder: str | None):
        self.service = service
        self.body = body
        self.header_decoder = header_decoder
        self.echo: list[str] = []  # the prompts as text, when echoed; set by plan()

    def plan(self) -> Plan:
        service, body = self.service, self.body
        model = service.model(body.model)
        prompts = service.prompt_ids(model, body.prompt)
        prompt_logprobs = body.echo and body.logprobs is not None
        decoder = body.decoder or self.header_decoder
        if prompt_logprobs and (body.decoder or "auto") == "auto":
            decoder = "ar"  # prompt logprobs come from the AR path's prefill
        route = service.route(model, RequestTraits.of(body, decoder, infill=bool(body.suffix)))
        if prompt_logprobs and route.decoder != "ar":
            raise bad_request("echo with logprobs is served by the 'ar' decoder", "echo", "unsupported_parameter")
        suffix_ids = None
        if body.suffix:
            prompts, suffix_ids = route.with_suffix(model.tokenizer, prompts, body.suffix)
        params = service.sampling_params(body, body.max_tokens, body.logprobs, max(len(p) for p in prompts), model,
                                         default_max=route.default_max_tokens(DEFAULT_MAX_TOKENS))
        if prompt_logprobs:
            params = dataclasses.replace(params, prompt_logprobs=True)
        self.echo = [model.tokenizer.decode(p) for p in prompts] if body.echo else []
        return Plan(model, route, prompts, params, body.n, suffix_ids)

    def respond(self, job: Job, results: list[ChoiceResult]) -> Completion:
        return completion_body(self.service, job, results, self.echo, results[0].stats)

    def stream(self, job: Job) -> AsyncIterator[bytes]:
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        return ended_cleanly(completion_stream(self.service, job, self.echo, include_usage))
