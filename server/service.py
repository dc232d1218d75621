"""Between HTTP and the engine: validate, tokenize, route, submit, and collect results.

Handlers stay thin: they decode a body and call ``Service``. This module owns
the OpenAI semantics that do not belong to any decoder: defaults, limits,
prompt forms, chat templates, choice indexing for n and multiple prompts,
usage accounting and the logprob formats. It talks to the engine through
``submit``/``abort`` only and never imports model internals.

With several models served, ``model(name)`` asks the ``ModelManager`` (``model_manager.py``),
which loads a model on first use; the service tells it when each request starts and ends, so
that a model with requests in flight is never unloaded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from dualserve.decoders.engine.engine import Engine
from dualserve.decoders.engine.grammar import Constraint, GrammarError
from dualserve.decoders.engine.request import Delta, FailureKind
from dualserve.decoders.engine.sampling import DRAFT_CHOICES, SamplingParams, TokenLogprob
from dualserve.decoders.engine.scheduler import QueueFull

from .errors import APIError, ErrorKind, bad_request, engine_error, overloaded
from .model_manager import ModelManager
from .protocol import SamplingFields
from .router import RequestTraits, Route, Router
from .served import ServedModel


# repetition_penalty divides positive logits and multiplies negative ones (CTRL): far outside
# [0.01, 10] it only turns the distribution into a one-hot on whatever was (or was not) seen.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 10.0
# Retry-After (seconds) when the estimated wait is too long: the excess over the bound, at most this.
MAX_RETRY_AFTER = 30


@dataclass(frozen=True)
class ServiceLimits:
    max_n: int = 16
    max_prompts: int = 64
    max_stop: int = 16
    max_stop_token_ids: int = 64
    max_logprobs: int = 20
    request_timeout: float | None = 600.0
    max_buffered_deltas: int = 512  # per choice, for a reader slower than generation
    # max_tokens when a request sets none and its endpoint and decoder have no default of their
    # own: OpenAI's "the rest of the context", capped so that a model that never stops ends.
    default_max_tokens: int = 4096


@dataclass(frozen=True)
class Plan:
    """One request, decided and validated: what the service submits to the engine."""

    model: ServedModel
    route: Route
    prompts: list[list[int]]
    params: SamplingParams
    n: int = 1
    suffix_ids: list[int] | None = None  # fixed right context, for a decoder that infills natively
    constraint: Constraint | None = None  # params.grammar compiled, set by Service.prepare off the event loop


@dataclass(eq=False)  # hashed by identity: the service keeps a set of live jobs
class Job:
    """One API request: its engine submissions, their outputs, and the decision that routed it."""

    id: str
    model: ServedModel
    route: Route
    prompts: list[list[int]]
    n: int
    params: SamplingParams
    queue: asyncio.Queue
    engine_ids: list[str] = field(default_factory=list)
    created: int = field(default_factory=lambda: int(time.time()))
    unfinished: int = 0       # choices whose final delta has not arrived; set by Service.start
    overflowed: bool = False  # the reader fell more than the buffer bound behind

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def prompt_of(self, choice: int) -> list[int]:
        return self.prompts[choice // self.n]


@dataclass
class ChoiceResult:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stats: dict[str, Any] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # echo with logprobs


# Queue items that are not deltas, put by the service itself.
CLOSED = (-1, None)    # end every unfinished choice now (shutdown drain)
OVERFLOW = (-2, None)  # the reader is too slow; its engine requests were aborted
EXPIRED = (-3, None)   # the request's time is up (its one deadline timer)


class Service:
    def __init__(self, engine: Engine, models: dict[str, ServedModel], router: Router,
                 limits: ServiceLimits = ServiceLimits(), metrics=None, manager: ModelManager | None = None):
        self.metrics = metrics  # server.metrics.Metrics, or None
        self.engine = engine
        self.manager = manager  # several models: loads on first use; None: ``models`` is all there is
        self._models = models
        self.router = router
        self.limits = limits
        self.default_model = next(iter(manager.pool.entries)) if manager is not None else next(iter(models))
        self.live: set[Job] = set()  # started and not yet ended; the shutdown drain waits on them
        for model in models.values():
            _ = model.max_prompt_chars  # reads the whole vocabulary (GIL held): at start-up, not on a request

    @property
    def models(self) -> dict[str, ServedModel]:
        """The models in memory now, by served name."""
        return self.manager.loaded if self.manager is not None else self._models

    def names(self) -> list[str]:
        """Every model a request may name: the configured ones, loaded or not."""
        if self.manager is None:
            return list(self._models)
        return list(dict.fromkeys([*self.manager.pool.entries, *self.manager.loaded]))

    # ---- validation ----------------------------------------------------------

    def model(self, name: str | None) -> ServedModel:
        """The model a request names (none: the default one); with several models, loaded first if
        it is not in memory (this blocks its thread: ``ready`` loads it off the event loop first)
        and leased to the request until it starts (``start``)."""
        name = self.requested(name)
        if self.manager is None:
            return self.served(name)
        try:
            return self.manager.acquire(name)
        except KeyError:
            raise self.not_found(name) from None

    def requested(self, name: str | None) -> str:
        """The served name a request's ``model`` field means: none is the default model, and with
        one model served, so are "default" and "dualserve"."""
        if name is None or name == "" or (name not in self.names() and len(self.names()) == 1
                                           and name in ("default", "dualserve")):
            return self.default_model
        return name

    async def ready(self, name: str | None) -> None:
        """Load the model a request names, if it is not in memory, off the event loop: a handler
        that then resolves it with ``model`` on the loop finds it loaded. An unknown name is left
        to ``model``'s 404."""
        if self.manager is None:
            return
        name = self.requested(name)
        owner = self.manager.owner(name)
        if owner is not None and name not in self.manager.loaded:
            await asyncio.to_thread(self.manager.load, owner)

    def served(self, name: str) -> ServedModel:
        """The model in memory under exactly ``name``, or a 404 naming the served ones."""
        if name not in self.models:
            raise self.not_found(name)
        return self.models[name]

    def not_found(self, name: str) -> APIError:
        return APIError(ErrorKind.NOT_FOUND, f"The model '{name}' does not exist. Available: "
                        f"{', '.join(self.names())}", "model", "model_not_found")

    def prompt_ids(self, model: ServedModel, prompt: Any) -> list[list[int]]:
        """Accept a string, a list of strings, a token-id list or a list of token-id lists."""
        tok = model.tokenizer
        if prompt is None:
            raise bad_request("you must provide a prompt", "prompt", "missing_required_parameter")
        if isinstance(prompt, str):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompts = prompt
        elif isinstance(prompt, list) and prompt and all(type(p) is int for p in prompt):
            return [self._check_ids(model, prompt)]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, list) and p for p in prompt):
            if len(prompt) > self.limits.max_prompts:
                raise bad_request(f"at most {self.limits.max_prompts} prompts per request", "prompt",
                                  "array_above_max_length")
            if not all(type(t) is int for p in prompt for t in p):
                raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of "
                                  "lists of token ids, and must not be empty", "prompt", "invalid_type")
            return [self._check_ids(model, p) for p in prompt]
        else:
            raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of "
                              "lists of token ids, and must not be empty", "prompt", "invalid_type")
        if len(prompts) > self.limits.max_prompts:
            raise bad_request(f"at most {self.limits.max_prompts} prompts per request", "prompt",
                              "array_above_max_length")
        self.check_length(model, prompts, "prompt")
        return [tok.encode(text, add_special_tokens=True) or self.start_of_text(model) for text in prompts]

    def start_of_text(self, model: ServedModel) -> list[int]:
        """The prompt of an empty text: the beginning-of-text token (else end-of-text), so that a
        decoder always has a token to start from."""
        tok = model.tokenizer
        return [tok.bos_token_id] if tok.bos_token_id is not None else [tok.eos_token_id]

    def check_length(self, model: ServedModel, texts: list[str], param: str) -> None:
        """Refuse, before tokenizing, a text that cannot fit the context whatever its tokens."""
        if any(len(t) > model.max_prompt_chars for t in texts):
            raise bad_request(f"This model's maximum context length is {model.max_model_len} tokens, and the "
                              f"{param} is far longer ({max(map(len, texts))} characters).", param,
                              "context_length_exceeded")

    def _check_ids(self, model: ServedModel, ids: list[int]) -> list[int]:
        if len(ids) >= model.max_model_len:
            raise bad_request(f"This model's maximum context length is {model.max_model_len} tokens, and the "
                              f"prompt has {len(ids)}.", "prompt", "context_length_exceeded")
        vocab = model.tokenizer.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise bad_request(f"token ids must be in [0, {vocab})", "prompt", "invalid_value")
        return list(ids)

    def sampling_params(self, body: SamplingFields, max_tokens: int | None, logprobs: int | None,
                        prompt_len: int, model: ServedModel, default_max: int | None) -> SamplingParams:
        room = model.max_model_len - prompt_len
        if room <= 0:
            raise bad_request(f"This model's maximum context length is {model.max_model_len} tokens, but the "
                              f"prompt has {prompt_len} tokens.", "messages" if default_max is None else "prompt",
                              "context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(default_max if default_max is not None else self.limits.default_max_tokens, room)
        if max_tokens < 1:
            raise bad_request("max_tokens must be at least 1", "max_tokens", "invalid_value")
        if prompt_len + max_tokens > model.max_model_len:
            raise bad_request(f"This model's maximum context length is {model.max_model_len} tokens. You requested "
                              f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
                              "completion). Please reduce the prompt or max_tokens.", "max_tokens",
                              "context_length_exceeded")
        temp = 1.0 if body.temperature is None else body.temperature
        checks = [(0 <= temp <= 2, "temperature", "between 0 and 2"),
                  (body.top_p is None or 0 < body.top_p <= 1, "top_p", "in (0, 1]"),
                  (body.top_k is None or body.top_k >= -1, "top_k", "-1, 0 or positive"),
                  (body.min_p is None or 0 <= body.min_p <= 1, "min_p", "in [0, 1]"),
                  (-2 <= body.presence_penalty <= 2, "presence_penalty", "between -2 and 2"),
                  (-2 <= body.frequency_penalty <= 2, "frequency_penalty", "between -2 and 2"),
                  # vLLM asks only > 0; a bound keeps penalised logits in range (1e-300 was a 500).
                  (body.repetition_penalty is None or MIN_REPETITION_PENALTY <= body.repetition_penalty
                   <= MAX_REPETITION_PENALTY, "repetition_penalty",
                   f"between {MIN_REPETITION_PENALTY} and {MAX_REPETITION_PENALTY}"),
                  (1 <= body.n <= self.limits.max_n, "n", f"between 1 and {self.limits.max_n}"),
                  (logprobs is None or 0 <= logprobs <= self.limits.max_logprobs, "logprobs",
                   f"between 0 and {self.limits.max_logprobs}"),
                  (body.draft is None or body.draft in DRAFT_CHOICES, "draft", "one of " + ", ".join(DRAFT_CHOICES))]
        for ok, param, what in checks:
            if not ok:
                raise bad_request(f"{param} must be {what}", param, "invalid_value")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > self.limits.max_stop or any(not s for s in stop):
            raise bad_request(f"stop must be up to {self.limits.max_stop} non-empty strings", "stop")
        stop_ids = body.stop_token_ids or []
        if len(stop_ids) > self.limits.max_stop_token_ids or any(
                not 0 <= t < model.tokenizer.vocab_size for t in stop_ids):
            raise bad_request(f"stop_token_ids must be up to {self.limits.max_stop_token_ids} token ids in "
                              f"[0, {model.tokenizer.vocab_size})", "stop_token_ids", "invalid_value")
        bias: dict[int, float] = {}
        for key, value in (body.logit_bias or {}).items():
            try:
                tid = int(key)
            except ValueError:
                raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
            if not 0 <= tid < model.tokenizer.vocab_size or not -100 <= value <= 100:
                raise bad_request("logit_bias maps token ids in the vocabulary to values in [-100, 100]",
                                  "logit_bias")
            bias[tid] = float(value)
        return SamplingParams(
            max_tokens=max_tokens, temperature=temp, top_p=1.0 if body.top_p is None else body.top_p,
            top_k=max(body.top_k or 0, 0), min_p=body.min_p or 0.0, seed=body.seed,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty or 1.0, logit_bias=bias, logprobs=logprobs,
            stop=tuple(stop), stop_token_ids=tuple(stop_ids), ignore_eos=body.ignore_eos, draft=body.draft or "auto")

    # ---- submission ------------------------------------------------------------

    def start(self, plan: Plan) -> Job:
        model, route, prompts, params, n = plan.model, plan.route, plan.prompts, plan.params, plan.n
        if not prompts or any(not p for p in prompts):  # every endpoint's plan must leave a token to start from
            raise bad_request("the prompt is empty after tokenization", "prompt", "invalid_value")
        self.admit(len(prompts) * n)
        plan = self.prepare(plan)
        # One compiled grammar per request: each prompt gets a pristine copy (the engine copies it per choice).
        constraints = [plan.constraint] + [plan.constraint.copy() if plan.constraint else None
                                           for _ in prompts[1:]]
        loop = asyncio.get_running_loop()
        job = Job(id=uuid.uuid4().hex[:24], model=model, route=route, prompts=prompts, n=n, params=params,
                  queue=asyncio.Queue(), unfinished=len(prompts) * n)
        limit = self.limits.max_buffered_deltas * job.num_choices

        def offer(item: tuple[int, Delta]) -> None:  # on the event loop
            if item[1].finish_reason is not None:
                job.unfinished -= 1
                if not job.unfinished:
                    self.retire(job)
            if job.overflowed:
                return
            if job.queue.qsize() >= limit:  # a slow reader: stop buffering for it
                job.overflowed = True
                job.queue.put_nowait(OVERFLOW)
                self.cancel(job)
                return
            job.queue.put_nowait(item)

        for p_idx, ids in enumerate(prompts):
            base = p_idx * n

            def sink(index: int, delta: Delta, base: int = base) -> None:
                loop.call_soon_threadsafe(offer, (base + index, delta))

            try:
                job.engine_ids.append(self.engine.submit(model.name, route.decoder, ids, params, sink, n=n,
                                                         suffix_ids=plan.suffix_ids or (),
                                                         constraint=constraints[p_idx]))
            except QueueFull:
                self.cancel(job)
                self._rejected("queue_full")
                raise overloaded() from None
            except Exception:
                self.cancel(job)
                raise
        self.live.add(job)
        if self.manager is not None:
            self.manager.begin(model.name)
        return job

    def retire(self, job: Job) -> None:
        """The job has ended (every choice finished, or its reader left): it no longer holds its model."""
        if job in self.live:
            self.live.discard(job)
            if self.manager is not None:
                self.manager.end(job.model.name)

    def admit(self, choices: int) -> None:
        """Admission, fair between requests: one request may ask for at most half the waiting queue,
        and one of several choices only while a quarter of the queue stays free, kept for requests
        of one choice, so that one client's prompts x n never takes every place. Bounded in time
        too: a request whose estimated wait to start exceeds ``max_queue_wait`` is refused (429,
        with Retry-After the excess), rather than queued to time out."""
        config = self.engine.config
        bound = config.max_waiting
        most = max(1, bound // 2)
        if choices > most:
            raise bad_request(f"this request asks for {choices} completions (prompts x n); at most {most} "
                              "per request", "n", "invalid_value")
        kept = 0 if choices == 1 else bound // 4
        if self.engine.num_queued() + choices > bound - kept:
            self._rejected("queue_full")
            raise overloaded()
        if config.max_queue_wait is None:
            return
        wait = self.engine.estimated_wait(choices)
        if wait > config.max_queue_wait:
            self._rejected("queue_wait")
            excess = wait - config.max_queue_wait
            retry = MAX_RETRY_AFTER if math.isinf(excess) else min(MAX_RETRY_AFTER, max(1, math.ceil(excess)))
            said = "more than a minute" if wait > 60 else f"about {wait:.0f} s"
            raise overloaded(f"The server is overloaded: this request would wait {said} to start (the bound is "
                             f"{config.max_queue_wait:g} s); retry after {retry} s.", retry)

    def _rejected(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.rejected.labels(reason).inc()

    def prepare(self, plan: Plan) -> Plan:
        """Compile the plan's grammar once for the request; the app calls it off the event loop."""
        if plan.params.grammar is None or plan.constraint is not None:
            return plan
        try:
            constraint = self.engine.grammar_compiler(plan.model.name).constraint(plan.params.grammar)
        except GrammarError as e:
            raise bad_request(f"invalid grammar or schema: {e}", "response_format", "invalid_schema") from None
        return dataclasses.replace(plan, constraint=constraint)

    def close(self, job: Job) -> None:
        """End a job now (shutdown): abort its engine requests; its stream ends each unfinished
        choice with finish_reason "abort" even if the engine never answers."""
        self.cancel(job)
        job.queue.put_nowait(CLOSED)

    def cancel(self, job: Job) -> None:
        """Abort the job's engine requests (each then delivers a final "abort" delta)."""
        for rid in job.engine_ids:
            self.engine.abort(rid)

    async def deltas(self, job: Job) -> AsyncIterator[tuple[int, Delta]]:
        """Yield (choice index, delta) until every choice has finished; abort on cancel or timeout."""
        remaining = job.num_choices
        started = time.monotonic()
        first: dict[int, float] = {}
        produced: dict[int, int] = {}
        done: set[int] = set()
        ended = "abort"  # the metrics status of choices that never finish: client gone, unless set below
        # One timer for the whole request, not a wait_for (a task and a timer) per delta: the event
        # loop shares the cores with the decode step's threads, and a stream makes a delta a token.
        timer = None if self.limits.request_timeout is None else asyncio.get_running_loop().call_later(
            self.limits.request_timeout, job.queue.put_nowait, EXPIRED)
        try:
            while remaining:
                index, delta = await job.queue.get()
                if (index, delta) == EXPIRED:
                    ended = "timeout"
                    raise APIError(ErrorKind.TIMEOUT, "the request timed out", None, "timeout")
                if (index, delta) == OVERFLOW:
                    raise APIError(ErrorKind.OVERLOADED, "the client read the stream too slowly; the request was "
                                   "ended", None, "slow_reader")
                if (index, delta) == CLOSED:
                    for i in sorted(set(range(job.num_choices)) - done):
                        yield i, Delta("", [], None, "abort")
                    return
                if delta.error and delta.finish_reason == "error":
                    ended = "queue_timeout" if delta.failure is FailureKind.OVERLOADED else "error"
                    raise engine_error(delta.failure, delta.error)
                if delta.token_ids and index not in first:
                    first[index] = time.monotonic() - started
                produced[index] = produced.get(index, 0) + len(delta.token_ids)
                if delta.finish_reason is not None:
                    remaining -= 1
                    done.add(index)
                    self._observe(job, index, delta, first.get(index), produced[index], started)
                yield index, delta
        finally:
            if timer is not None:
                timer.cancel()
            self.retire(job)
            if remaining:
                self.cancel(job)
                if self.metrics is not None:
                    for index in range(job.num_choices):
                        if index not in done:
                            self.metrics.observe_request(job.route.decoder, ended, 0, produced.get(index, 0),
                                                         first.get(index), time.monotonic() - started, None)

    def _observe(self, job: Job, index: int, delta: Delta, ttft: float | None, tokens: int,
                 started: float) -> None:
        if self.metrics is None:
            return
        prompt = len(job.prompt_of(index)) if index % job.n == 0 else 0
        self.metrics.observe_request(job.route.decoder, delta.finish_reason or "unknown", prompt, tokens, ttft,
                                     time.monotonic() - started, delta.stats)

    async def collect(self, job: Job) -> list[ChoiceResult]:
        results = [ChoiceResult() for _ in range(job.num_choices)]
        async for index, delta in self.deltas(job):
            r = results[index]
            r.text += delta.text
            r.token_ids += delta.token_ids
            r.logprobs += delta.logprobs or []
            r.finish_reason = delta.finish_reason or r.finish_reason
            r.stats = delta.stats or r.stats
            r.prompt_logprobs = delta.prompt_logprobs or r.prompt_logprobs
        return results

    def route(self, model: ServedModel, request: RequestTraits) -> Route:
        """Route a request by its traits (``RequestTraits``, built by its handler) over what ``model``
        loads; a draft source it does not load, or an infill its decoder cannot serve, is a 400."""
        route = self.router.route(model.name, model.decoders, request, model.traits)
        if request.draft and route.traits.drafts and request.draft not in route.traits.drafts:
            raise bad_request(f"draft {request.draft!r} names a draft model that {model.name!r} does not load; its "
                              f"{route.decoder} decoder drafts with: {', '.join(route.traits.drafts)}", "draft",
                              "invalid_value")
        if request.infill and route.traits.infill == "none":
            raise bad_request(f"model {model.name!r} cannot infill with its diffusion decoder (block-causal "
                              "attention never sees the suffix); use decoder 'ar' or 'auto'", "suffix",
                              "unsupported_parameter")
        return route

    def token_text(self, model: ServedModel, token_id: int) -> str:
        return model.tokenizer.decode([token_id], skip_special_tokens=False)
