"""llama.cpp's ``POST /infill`` (llama.vscode and similar plugins): prefix, suffix, extra files -> a plan.

The llama.cpp fields map onto OpenAI-style sampling fields, with llama.cpp's defaults for what a
request leaves out; the routed decoder decides how the suffix is placed (``Route.infill``, prompts
built in ``fim``), and the answer keeps llama.cpp's shape (``llamacpp``). ``n_predict: 0`` prefills
the prompt into the prefix cache and answers an empty completion, as llama.cpp does: llama.vscode
sends it with the extra context (``input_extra``) to warm the cache before the user's next request.
"""

from __future__ import annotations

from litestar import Request, Response, post
from litestar.datastructures import State
from litestar.response import Stream

from .errors import bad_request
from .fim import InfillPrompt
from .llamacpp import (DEFAULT_MIN_P, DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P, llama_seed, prefill_params,
                       prefill_route, requested_tokens, serve)
from .protocol import InfillRequest, SamplingFields, infill_decoder
from .router import RequestTraits
from .service import Plan, Service

DEFAULT_MAX_TOKENS = 64


def sampling_fields(body: InfillRequest) -> SamplingFields:
    """llama.cpp's /infill fields as OpenAI-style sampling fields, with llama.cpp's defaults."""
    return SamplingFields(model=body.model,
                          temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
                          top_k=DEFAULT_TOP_K if body.top_k is None else body.top_k,
                          top_p=DEFAULT_TOP_P if body.top_p is None else body.top_p, min_p=DEFAULT_MIN_P,
                          stop=body.stop, seed=llama_seed(body.seed), decoder=body.decoder)


class InfillHandler:
    def __init__(self, service: Service, body: InfillRequest, header_decoder: str | None):
        self.service = service
        self.body = body
        self.header_decoder = header_decoder
        self.stream = body.stream
        self.return_tokens = False
        self.several = False

    def plan(self) -> Plan:
        service, body = self.service, self.body
        model = service.model(body.model)
        if not (body.input_prefix or body.prompt or body.input_suffix or body.input_extra):
            raise bad_request("nothing to infill: input_prefix, prompt, input_suffix and input_extra are all "
                              "empty", "input_prefix", "missing_required_parameter")
        fields = sampling_fields(body)
        max_tokens = requested_tokens(body.n_predict, body.max_tokens, None)
        hint = fields.decoder or self.header_decoder
        request = RequestTraits.of(fields, hint, infill=True)
        route = prefill_route(service, model, request) if max_tokens == 0 else service.route(model, request)
        service.check_length(model, [body.input_prefix + body.prompt + body.input_suffix + "".join(
            str(e.get("filename", "")) + str(e.get("text", "")) for e in body.input_extra)], "input_prefix")
        prompt = route.infill(model.tokenizer, body.input_prefix + body.prompt, body.input_suffix,
                              body.input_extra)
        if not prompt.prefix_ids:
            # Filling at the very start of a file, with no fill-in-the-middle tokens to carry the
            # suffix: generation starts from the start of text, as for an empty completion prompt.
            prompt = InfillPrompt(service.start_of_text(model), prompt.suffix_ids)
        prompt_len = len(prompt.prefix_ids) + len(prompt.suffix_ids)
        params = service.sampling_params(fields, 1 if max_tokens == 0 else max_tokens, None, prompt_len, model,
                                         default_max=route.default_max_tokens(DEFAULT_MAX_TOKENS))
        if max_tokens == 0:
            params = prefill_params(params)
        return Plan(model, route, [prompt.prefix_ids], params, 1, prompt.suffix_ids)


@post("/infill", status_code=200)
async def infill(request: Request, state: State) -> Response | Stream:
    """llama.cpp-compatible infill (llama.vscode and similar plugins)."""
    return await serve(request, state, infill_decoder, InfillHandler)


ROUTES = [infill]
