"""llama.cpp's ``POST /infill`` (llama.vscode and similar plugins): prefix, suffix, extra files -> a plan.

The llama.cpp fields map onto OpenAI-style sampling fields; the routed decoder decides how the
suffix is placed (``Route.infill``, prompts built in ``fim``), and the response keeps
llama.cpp's shape.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from .errors import bad_request
from .fim import InfillPrompt
from .protocol import InfillRequest, SamplingFields
from .bodies import infill_body, infill_stream
from .service import ChoiceResult, Job, Plan, Service
from .streaming import ended_cleanly

# llama.cpp's stream has no [DONE]: it ends with a chunk whose "stop" is true.
STREAM_END = b'data: {"content":"","stop":true}\n\n'

DEFAULT_MAX_TOKENS = 64


def infill_max_tokens(body: InfillRequest) -> int:
    """llama.cpp's ``n_predict`` (or ``max_tokens``): unset or negative (llama.cpp's "no limit") is this
    endpoint's default; 0 is refused like any ``max_tokens`` below 1 (it used to mean 64 silently)."""
    n = body.n_predict if body.n_predict is not None else body.max_tokens
    return DEFAULT_MAX_TOKENS if n is None or n < 0 else n


def sampling_fields(body: InfillRequest) -> SamplingFields:
    """llama.cpp's /infill fields as OpenAI-style sampling fields."""
    return SamplingFields(model=body.model, temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                          stop=body.stop, seed=body.seed, decoder=body.decoder)


class InfillHandler:
    def __init__(self, service: Service, body: InfillRequest, header_decoder: str | None):
        self.service = service
        self.body = body
        self.header_decoder = header_decoder

    def plan(self) -> Plan:
        service, body = self.service, self.body
        model = service.model(body.model)
        if not (body.input_prefix or body.prompt or body.input_suffix or body.input_extra):
            raise bad_request("nothing to infill: input_prefix, prompt, input_suffix and input_extra are all "
                              "empty", "input_prefix", "missing_required_parameter")
        fields = sampling_fields(body)
        route = service.route(model, fields, fields.decoder or self.header_decoder, infill=True)
        service.check_length(model, [body.input_prefix + body.prompt + body.input_suffix + "".join(
            str(e.get("filename", "")) + str(e.get("text", "")) for e in body.input_extra)], "input_prefix")
        prompt = route.infill(model.tokenizer, body.input_prefix + body.prompt, body.input_suffix,
                              body.input_extra)
        if not prompt.prefix_ids:
            # Filling at the very start of a file, with no fill-in-the-middle tokens to carry the
            # suffix: generation starts from the start of text, as for an empty completion prompt.
            prompt = InfillPrompt(service.start_of_text(model), prompt.suffix_ids)
        params = service.sampling_params(fields, infill_max_tokens(body), None,
                                         len(prompt.prefix_ids) + len(prompt.suffix_ids), model,
                                         default_max=route.default_max_tokens(DEFAULT_MAX_TOKENS))
        return Plan(model, route, [prompt.prefix_ids], params, 1, prompt.suffix_ids)

    def respond(self, job: Job, results: list[ChoiceResult]) -> dict[str, Any]:
        return infill_body(job, results[0])

    def stream(self, job: Job) -> AsyncIterator[bytes]:
        return ended_cleanly(infill_stream(self.service, job), STREAM_END)
