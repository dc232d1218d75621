"""llama.cpp's native answer, shared by ``/completion`` and ``/infill``: defaults, bookkeeping, stream.

Shapes follow llama.cpp's tools/server/README.md and server-task.cpp (``to_json_non_oaicompat`` of
the final and partial results, ``result_timings::to_json``):

- the answer carries ``content``, ``stop``, ``stop_type`` (``eos`` | ``word`` | ``limit``),
  ``stopping_word``, ``tokens_predicted``, ``tokens_evaluated``, ``tokens_cached``, ``truncated``,
  ``generation_settings`` (with ``n_ctx``: llama.vscode's status bar reads it unchecked) and
  ``timings``;
- a stream sends ``data: {partial}`` chunks (``stop: false``), then the whole answer with empty
  ``content`` and ``stop: true``; it has no ``[DONE]``.

Design choices:

- ``tokens_cached`` and ``timings.cache_n`` count the prompt tokens reused from the prefix cache (the
  README's "tokens from the prompt which could be re-used from previous completion"); ``truncated`` is
  always false, since a prompt that does not fit is refused, never shifted out of the context.
- Timings are measured here, from when the engine takes the request: the prompt phase ends with the
  first generated token (or the end, for ``n_predict: 0``), as llama.cpp's slot timings do.
- ``n_predict: 0`` (llama.vscode warms its cache with it) is a prefill-only request: the engine writes
  the prompt's KV into the prefix cache and finishes with no output. It is routed to ``ar``, whose KV
  (shared with ``eagle`` on the same runner) the next request of the same prefix hits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol

import msgspec
from litestar import Request, Response
from litestar.datastructures import State
from litestar.response import Stream

from dualserve.decoders.engine.request import Delta
from dualserve.decoders.engine.sampling import SamplingParams

from .endpoint import CLIENT_GONE, CLIENT_GONE_STATUS, decode, json_response, route_headers, sse_response, \
    until_disconnect
from .errors import bad_request
from .protocol import DECODER_HEADER, LLAMA_RANDOM_SEED, LlamaPartial, LlamaResult, LlamaTimings, encoder
from .router import RequestTraits, Route
from .service import ChoiceResult, Job, Plan, ServedModel, Service
from .streaming import ended_cleanly

# llama.cpp's server defaults for what a request leaves out (README, "POST /completion" options).
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_K = 40
DEFAULT_TOP_P = 0.95
DEFAULT_MIN_P = 0.05

# A llama.cpp stream has no [DONE]: after an error event it ends as a finished answer would.
STREAM_END = b'data: {"content":"","stop":true}\n\n'


def llama_seed(seed: int | None) -> int | None:
    """llama.cpp's seed: -1 (or LLAMA_DEFAULT_SEED) asks for a random one, as leaving it out does."""
    return None if seed is None or seed < 0 or seed == LLAMA_RANDOM_SEED else seed


def requested_tokens(n_predict: int | None, max_tokens: int | None, default: int | None) -> int | None:
    """llama.cpp's ``n_predict`` (else ``max_tokens``): unset or negative ("no limit") is ``default``;
    0 prefills the prompt only."""
    n = n_predict if n_predict is not None else max_tokens
    return default if n is None or n < 0 else n


def prefill_route(service: Service, model: ServedModel, request: RequestTraits) -> Route:
    """The route of an ``n_predict: 0`` request: ``ar``, whose plain prefill fills the prefix cache
    that ``ar`` and ``eagle`` share (a diffusion canvas has nothing to do without tokens to make)."""
    if "ar" not in model.decoders:
        raise bad_request(f"n_predict 0 (prefill only) is served by the 'ar' decoder, which model {model.name!r} "
                          "does not load", "n_predict", "unsupported_parameter")
    route = service.route(model, dataclasses.replace(request, decoder="ar"))
    return dataclasses.replace(route, reason="n_predict 0: the prompt prefilled into the prefix cache")


def prefill_params(params: SamplingParams) -> SamplingParams:
    """Sampling parameters validated for one token, turned into a prefill-only request (max_tokens 0)."""
    return dataclasses.replace(params, max_tokens=0)


@dataclass
class Choice:
    """One choice as it arrives: what it made, and when (monotonic seconds)."""

    result: ChoiceResult = field(default_factory=ChoiceResult)
    first: float | None = None   # the first generated token
    end: float | None = None

    def add(self, delta: Delta, now: float) -> None:
        r = self.result
        r.text += delta.text
        r.token_ids += delta.token_ids
        r.finish_reason = delta.finish_reason or r.finish_reason
        r.stats = delta.stats or r.stats
        if delta.token_ids and self.first is None:
            self.first = now
        if delta.finish_reason is not None:
            self.end = now


def timings(job: Job, index: int, choice: Choice, started: float) -> LlamaTimings:
    cached = int((choice.result.stats or {}).get("cached_prompt_tokens", 0))
    end = choice.end if choice.end is not None else time.monotonic()
    first = choice.first if choice.first is not None else end
    prompt_n, predicted_n = len(job.prompt_of(index)) - cached, len(choice.result.token_ids)
    prompt_ms, predicted_ms = (first - started) * 1e3, (end - first) * 1e3

    def per_token(ms: float, n: int) -> float:
        return ms / n if n else 0.0

    def per_second(ms: float, n: int) -> float:
        return n * 1e3 / ms if n and ms > 0 else 0.0

    return LlamaTimings(cache_n=cached, prompt_n=prompt_n, prompt_ms=prompt_ms,
                        prompt_per_token_ms=per_token(prompt_ms, prompt_n),
                        prompt_per_second=per_second(prompt_ms, prompt_n), predicted_n=predicted_n,
                        predicted_ms=predicted_ms, predicted_per_token_ms=per_token(predicted_ms, predicted_n),
                        predicted_per_second=per_second(predicted_ms, predicted_n))


def stop_kind(job: Job, result: ChoiceResult) -> tuple[str, str]:
    """llama.cpp's ``stop_type`` and ``stopping_word``: EOS (or a stop token id), a stop string, or
    the token limit. The engine drops a stop string from the text; it is found again in the tokens."""
    if result.finish_reason == "length":
        return "limit", ""
    if result.finish_reason != "stop":
        return "none", ""
    tok, params = job.model.tokenizer, job.params
    last = result.token_ids[-1] if result.token_ids else None
    if last is not None and (last in tok.eos_token_ids or last in params.stop_token_ids):
        return "eos", ""
    full = tok.decode(result.token_ids, skip_special_tokens=params.skip_special_tokens)
    found = [(at, s) for s in params.stop if (at := full.find(s, max(0, len(result.text) - len(s)))) >= 0]
    return ("word", min(found)[1]) if found else ("eos", "")


def generation_settings(job: Job, stream: bool) -> dict[str, Any]:
    """The settings the request ran with, in llama.cpp's names (``task_params::to_json``), plus its
    ``n_ctx`` and ``model``."""
    p = job.params
    # n_predict is the limit the request ran under: a -1 ("no limit") shows as the rest of the context.
    return {"n_ctx": job.model.max_model_len, "model": job.model.name, "n_predict": p.max_tokens,
            "max_tokens": p.max_tokens, "seed": LLAMA_RANDOM_SEED if p.seed is None else p.seed,
            "temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p,
            "repeat_penalty": p.repetition_penalty, "presence_penalty": p.presence_penalty,
            "frequency_penalty": p.frequency_penalty, "stop": list(p.stop), "ignore_eos": p.ignore_eos,
            "stream": stream}


def result_body(job: Job, index: int, choice: Choice, started: float, stream: bool) -> LlamaResult:
    """The final answer of one choice; in a stream its text and tokens have already gone out. Its
    ``tokens`` are filled only where the request asks (``return_tokens``, in ``serve``)."""
    r = choice.result
    kind, word = stop_kind(job, r)
    measured = timings(job, index, choice, started)
    prompt = job.prompt_of(index)
    return LlamaResult(
        index=index, content="" if stream else r.text, tokens=[],
        stop=True, model=job.model.name, tokens_predicted=len(r.token_ids), tokens_evaluated=len(prompt),
        generation_settings=generation_settings(job, stream),
        prompt=job.model.tokenizer.decode(prompt, skip_special_tokens=False), has_new_line="\n" in r.text,
        truncated=False, stop_type=kind, stopping_word=word, tokens_cached=measured.cache_n, timings=measured)


async def collect(service: Service, job: Job) -> list[Choice]:
    choices = [Choice() for _ in range(job.num_choices)]
    async for index, delta in service.deltas(job):
        choices[index].add(delta, time.monotonic())
    return choices


def sse(obj: Any) -> bytes:
    return b"data: " + encoder.encode(obj) + b"\n\n"


async def stream_events(service: Service, job: Job, started: float) -> AsyncIterator[bytes]:
    choices = [Choice() for _ in range(job.num_choices)]
    async for index, delta in service.deltas(job):
        choice = choices[index]
        choice.add(delta, time.monotonic())
        if delta.text or delta.token_ids:
            yield sse(LlamaPartial(index=index, content=delta.text, tokens=delta.token_ids, stop=False,
                                   tokens_predicted=len(choice.result.token_ids),
                                   tokens_evaluated=len(job.prompt_of(index))))
        if delta.finish_reason is not None:
            yield sse(result_body(job, index, choice, started, True))


class LlamaHandler(Protocol):
    """A llama.cpp endpoint's request: its plan, and how it wants the answer."""

    stream: bool
    return_tokens: bool
    several: bool  # several prompts: the answer is a list, as llama.cpp's

    def plan(self) -> Plan: ...


class LlamaHandlerType(Protocol):
    def __call__(self, service: Service, body: Any, header_decoder: str | None) -> LlamaHandler: ...


async def serve(request: Request, state: State, body_decoder: msgspec.json.Decoder,
                handler_type: LlamaHandlerType) -> Response | Stream:
    """``endpoint.generate``'s path for a llama.cpp endpoint, timing each choice as it arrives."""
    service: Service = state.app_state.service
    body = decode(await request.body(), body_decoder)
    handler = handler_type(service, body, request.headers.get(DECODER_HEADER))
    plan = await asyncio.to_thread(lambda: service.prepare(handler.plan()))
    started = time.monotonic()
    job = service.start(plan)
    headers = route_headers(job.route)
    if handler.stream:
        return sse_response(ended_cleanly(stream_events(service, job, started), STREAM_END), headers)
    choices = await until_disconnect(request, collect(service, job))
    if choices is CLIENT_GONE:
        return Response(content=b"", status_code=CLIENT_GONE_STATUS)
    bodies = [result_body(job, i, c, started, False) for i, c in enumerate(choices)]
    if handler.return_tokens:
        bodies = [msgspec.structs.replace(b, tokens=c.result.token_ids) for b, c in zip(bodies, choices)]
    return json_response(bodies if handler.several else bodies[0], headers)
