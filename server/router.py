"""The router: request hints plus what is loaded -> which decoder serves a request, and why.

Hints arrive as body fields (``decoder``, ``priority``, ``latency_budget_ms``)
or the ``X-Dualserve-Decoder`` header. An explicit decoder is honoured if the
model serves it and refused with a 400 that says why otherwise. ``auto`` applies
the deployment's policy: latency-bound, decode-heavy, lower-value work to
diffusion; high-value work to lossless speculative AR; batchable work (n > 1,
``priority: batch``) to the batching AR path; an agent turn (tools offered, or tool
calls and results in the conversation) to lossless speculation, whose suffix drafts
verify the input an agent's answer copies in few forwards. The decision and its reason go
back to the client in response headers.

A handler builds one ``RequestTraits`` per request (its hints and what it asks: infill, a
grammar, an agent turn) and routing reads only that. The returned ``Route`` carries what the
chosen decoder changes about a request:
its default ``max_tokens`` and how a suffix is placed (right context for a
decoder that infills natively, fill-in-the-middle tokens otherwise).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Mapping

from dualserve.models.errors import InputError

from .errors import bad_request
from .fim import InfillPrompt, build_infill

if TYPE_CHECKING:
    from .protocol import SamplingFields

DECODERS = ("ar", "eagle", "diffusion")
HINTS = DECODERS + ("auto",)
Priority = Literal["interactive", "high_value", "batch"]
PRIORITIES = ("interactive", "high_value", "batch")
Infill = Literal["native", "fim", "none"]
# Decoders that extend the prompt token by token, so a fill-in-the-middle prompt lets them infill.
FIM_DECODERS = ("ar", "eagle")


@dataclass(frozen=True)
class DecoderTraits:
    """What routing and the handlers need to know of one served decoder (cli reads it from the decoder)."""

    # How it fills between a prefix and a suffix: "native" keeps the suffix as right context
    # (diffusion over bidirectional attention); "fim" rewrites the prompt with fill-in-the-middle
    # tokens (AR decoders, as llama.cpp does); "none" cannot (block-causal diffusion never sees it).
    infill: Infill = "fim"
    default_max_tokens: int | None = None  # for a request that sets none, where its endpoint has no default
    drafts: tuple[str, ...] = ()  # the ``draft`` values it serves; () where the field means nothing to it


@dataclass(frozen=True)
class Route:
    """The decoder that serves a request, why, and that decoder's traits."""

    decoder: str
    reason: str
    traits: DecoderTraits = DecoderTraits()

    def default_max_tokens(self, endpoint_default: int | None) -> int | None:
        """The endpoint's own default, else the decoder's (e.g. a diffusion canvas is sized by
        max_tokens, so chat must not default it to the whole context), else None: the rest of it."""
        return endpoint_default if endpoint_default is not None else self.traits.default_max_tokens

    def infill(self, tokenizer: Any, prefix: str, suffix: str, extra: list[dict[str, Any]]) -> InfillPrompt:
        """Prompt ids for filling between ``prefix`` and ``suffix`` on this decoder."""
        return build_infill(tokenizer, prefix, suffix, extra, native=self.traits.infill == "native")

    def with_suffix(self, tokenizer: Any, prompts: list[list[int]],
                    suffix: str) -> tuple[list[list[int]], list[int]]:
        """Completion prompts and suffix ids for a ``suffix``: kept apart for a native infiller;
        else each prompt is rewritten with fill-in-the-middle tokens, as llama.cpp does."""
        suffix_ids = tokenizer.encode(suffix, add_special_tokens=False)
        if self.traits.infill == "native" or not suffix_ids:
            return prompts, suffix_ids
        return [self.infill(tokenizer, tokenizer.decode(p), suffix, []).prefix_ids for p in prompts], []


@dataclass(frozen=True)
class RoutingPolicy:
    """Per-deployment knobs for ``auto`` (flags or a small JSON policy file)."""

    default_hint: str = "auto"
    interactive: str = "diffusion"       # latency-bound, lower value
    high_value: str = "eagle"            # lossless speculation
    batch: str = "ar"                    # continuous batching
    latency_budget_ms: float = 1000.0    # at or below this, prefer the fastest single-stream decoder
    default_priority: Priority = "high_value"


def load_policy(path: str | Path | None) -> RoutingPolicy:
    """Read a JSON policy file whose keys are RoutingPolicy fields; unknown keys are an error."""
    if path is None:
        return RoutingPolicy()
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise InputError(f"--router-policy {path}: {e.strerror or e}") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"--router-policy {path}: not a JSON file ({e})") from None
    if not isinstance(raw, dict):
        raise InputError(f"--router-policy {path}: a JSON object of policy fields is needed")
    known = {f.name for f in dataclasses.fields(RoutingPolicy)}
    unknown = set(raw) - known
    if unknown:
        raise InputError(f"unknown routing policy keys {sorted(unknown)}; known: {sorted(known)}")
    policy = RoutingPolicy(**raw)
    for value in (policy.interactive, policy.high_value, policy.batch):
        if value not in DECODERS:
            raise InputError(f"routing policy decoders must be one of {DECODERS}, got {value!r}")
    return policy


@dataclass(frozen=True)
class RequestTraits:
    """What one request asks of routing, built once by its handler and read by the router."""

    decoder: str | None = None             # the client's hint: body field, else header; None: the policy's default
    priority: str | None = None
    latency_budget_ms: float | None = None
    n: int = 1                             # choices per prompt
    draft: str | None = None               # eagle's draft source (checked against what is loaded)
    infill: bool = False                   # it fills up to a suffix
    structured: bool = False               # a grammar constrains its output
    agent: bool = False                    # a chat turn with tools offered, or tool calls and results in it

    @classmethod
    def of(cls, body: SamplingFields, decoder: str | None, *, infill: bool = False, structured: bool = False,
           agent: bool = False) -> RequestTraits:
        """The traits of a request whose body carries the sampling fields' hints and whose client
        asked for ``decoder``."""
        return cls(decoder, body.priority, body.latency_budget_ms, body.n, body.draft, infill, structured, agent)


def infills_natively(traits: Mapping[str, DecoderTraits]) -> bool:
    """Whether one of the loaded decoders fills between a prefix and a suffix itself."""
    return any(t.infill == "native" for t in traits.values())


class Router:
    """Picks the decoder that serves a request (``route``), under the deployment's policy."""

    def __init__(self, policy: RoutingPolicy = RoutingPolicy()):
        self.policy = policy

    def route(self, model: str, available: list[str], request: RequestTraits,
              traits: Mapping[str, DecoderTraits] | None = None) -> Route:
        """The decision for one request, carrying the chosen decoder's ``traits`` (defaults if absent).

        An infill request goes to a decoder that fills natively where ``auto`` may pick one; else it
        is served with FIM tokens, and an automatic decision's reason says it is infill either way."""
        traits = traits or {}
        route = self.decide(model, available, request, traits)
        if request.infill and route.reason != "requested" and not route.reason.startswith("infill"):
            route = dataclasses.replace(route, reason=f"infill with FIM tokens; {route.reason}")
        return dataclasses.replace(route, traits=traits.get(route.decoder, DecoderTraits()))

    def decide(self, model: str, available: list[str], request: RequestTraits,
               traits: Mapping[str, DecoderTraits]) -> Route:
        hint = (request.decoder or self.policy.default_hint).lower()
        priority = request.priority
        if hint not in HINTS:
            raise bad_request(f"unknown decoder {hint!r}; valid values are {', '.join(HINTS)}", "decoder",
                              "invalid_decoder")
        if priority is not None and priority not in PRIORITIES:
            raise bad_request(f"unknown priority {priority!r}; valid values are {', '.join(PRIORITIES)}",
                              "priority", "invalid_value")
        if hint != "auto":
            if hint not in available:
                raise bad_request(f"model {model!r} cannot be served by decoder {hint!r}; it supports "
                                  f"{', '.join(available)}", "decoder", "decoder_unavailable")
            return Route(hint, "requested")
        return self.auto(available, request, traits)

    def auto(self, available: list[str], request: RequestTraits, traits: Mapping[str, DecoderTraits]) -> Route:
        p, priority = self.policy, request.priority

        def pick(first: str, why: str) -> Route:
            if first in available:
                return Route(first, why)
            for fallback in ("eagle", "ar", "diffusion"):
                if fallback in available:
                    return Route(fallback, f"{why}; {first} not loaded")
            raise bad_request("no decoder available", "decoder")

        if request.infill and infills_natively(traits) and "diffusion" in available:
            return Route("diffusion", "infill: diffusion fills between prefix and suffix natively")
        if request.n > 1:
            return pick(p.batch, "n>1: batching AR path shares the prompt")
        if priority == "batch":
            return pick(p.batch, "priority=batch")
        budget = request.latency_budget_ms
        latency_bound = priority == "interactive" or (
            budget is not None and budget <= p.latency_budget_ms and priority != "high_value")
        if request.structured:
            # Every decoder enforces the grammar exactly. Diffusion places the forced skeleton
            # (keys, punctuation) without forwards; EAGLE cannot branch a grammar's state and
            # drafts nothing, so plain AR is the better lossless path.
            if latency_bound:
                return pick(p.interactive, "structured, latency-bound: skeleton forced, values decoded under the grammar")
            return pick("ar" if "ar" in available else p.high_value, "structured output: grammar-constrained AR")
        if request.agent and "eagle" in available:
            # An agent's answer copies what it was given (arguments, file contents, results): suffix
            # drafts verify it in few forwards, and where drafts do not pay eagle's budget takes
            # plain steps (docs/decoders.md, Measured: 1.5-2x ar on agent traffic).
            return Route("eagle", "agent turn: lossless speculation drafts the input it copies")
        if latency_bound:
            return pick(p.interactive, "latency-bound interactive work")
        if priority == "high_value" or priority is None:
            return pick(p.high_value, f"priority={priority or p.default_priority}: lossless decoding")
        return pick("ar", "default")
