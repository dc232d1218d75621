"""llama.cpp's native ``POST /completion`` (also ``/completions``): a prompt -> a plan, answered in
llama.cpp's shape (``llamacpp``).

``prompt`` takes llama.cpp's forms (tools/server/README.md): a string, token ids, token ids mixed
with strings (one prompt), or a list of those (several prompts, answered as a list). A string at the
start gets the model's BOS, as its metadata asks; later strings are tokenized as they are. Sampling
fields left out take llama.cpp's defaults; ``n_predict`` -1 is the rest of the context (bounded as
for ``/v1/completions`` without ``max_tokens``), 0 prefills the prompt into the prefix cache only.
"""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, post
from litestar.datastructures import State
from litestar.response import Stream

from .errors import bad_request
from .llamacpp import (DEFAULT_MIN_P, DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P, llama_seed, prefill_params,
                       prefill_route, requested_tokens, serve)
from .protocol import LlamaCompletionRequest, SamplingFields, llama_completion_decoder
from .router import RequestTraits
from .service import Plan, ServedModel, Service

PROMPT_FORMS = ("prompt must be a string, a list of token ids (strings may be mixed in), or a non-empty list of "
                "those")


def sampling_fields(body: LlamaCompletionRequest) -> SamplingFields:
    """llama.cpp's /completion fields as OpenAI-style sampling fields, with llama.cpp's defaults."""
    return SamplingFields(
        model=body.model, temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
        top_k=DEFAULT_TOP_K if body.top_k is None else body.top_k,
        top_p=DEFAULT_TOP_P if body.top_p is None else body.top_p,
        min_p=DEFAULT_MIN_P if body.min_p is None else body.min_p, stop=body.stop, seed=llama_seed(body.seed),
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repeat_penalty, ignore_eos=body.ignore_eos, decoder=body.decoder)


def is_one_prompt(prompt: list[Any]) -> bool:
    """llama.cpp's ``json_is_array_of_mixed_numbers_strings``: token ids, possibly mixed with strings."""
    return any(type(p) is int for p in prompt) and all(type(p) is int or isinstance(p, str) for p in prompt)


def prompt_ids(service: Service, model: ServedModel, prompt: str | list[Any]) -> list[int]:
    """One prompt's ids: a string, or token ids mixed with strings."""
    tok = model.tokenizer
    parts = [prompt] if isinstance(prompt, str) else prompt
    service.check_length(model, [p for p in parts if isinstance(p, str)], "prompt")
    ids: list[int] = []
    for i, part in enumerate(parts):
        if isinstance(part, str):
            ids += tok.encode(part, add_special_tokens=i == 0)
        elif type(part) is int and 0 <= part < tok.vocab_size:
            ids.append(part)
        else:
            raise bad_request(f"prompt token ids must be integers in [0, {tok.vocab_size})", "prompt",
                              "invalid_value")
    return ids or service.start_of_text(model)


def prompts_of(service: Service, model: ServedModel, prompt: Any) -> tuple[list[list[int]], bool]:
    """The prompts' ids, and whether there are several (the answer is then a list)."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and is_one_prompt(prompt)):
        return [prompt_ids(service, model, prompt)], False
    if not isinstance(prompt, list) or not prompt or not all(
            isinstance(p, str) or (isinstance(p, list) and p and is_one_prompt(p)) for p in prompt):
        raise bad_request(PROMPT_FORMS, "prompt", "invalid_type" if prompt is not None else
                          "missing_required_parameter")
    if len(prompt) > service.limits.max_prompts:
        raise bad_request(f"at most {service.limits.max_prompts} prompts per request", "prompt",
                          "array_above_max_length")
    return [prompt_ids(service, model, p) for p in prompt], True


class LlamaCompletionHandler:
    def __init__(self, service: Service, body: LlamaCompletionRequest, header_decoder: str | None):
        self.service = service
        self.body = body
        self.header_decoder = header_decoder
        self.stream = body.stream
        self.return_tokens = body.return_tokens
        self.several = False  # set by plan()

    def plan(self) -> Plan:
        service, body = self.service, self.body
        model = service.model(body.model)
        prompts, self.several = prompts_of(service, model, body.prompt)
        fields = sampling_fields(body)
        max_tokens = requested_tokens(body.n_predict, body.max_tokens, None)
        hint = fields.decoder or self.header_decoder
        request = RequestTraits.of(fields, hint)
        route = prefill_route(service, model, request) if max_tokens == 0 else service.route(model, request)
        params = service.sampling_params(fields, 1 if max_tokens == 0 else max_tokens, None,
                                         max(len(p) for p in prompts), model,
                                         default_max=route.default_max_tokens(None))
        if max_tokens == 0:
            params = prefill_params(params)
        return Plan(model, route, prompts, params, 1)


@post(["/completion", "/completions"], status_code=200)
async def completion(request: Request, state: State) -> Response | Stream:
    """llama.cpp's native completion endpoint."""
    return await serve(request, state, llama_completion_decoder, LlamaCompletionHandler)


ROUTES = [completion]
