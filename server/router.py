"""The router: request hints plus what is loaded -> which decoder serves a request, and why.

Hints arrive as body fields (``decoder``, ``priority``, ``latency_budget_ms``)
or the ``X-Dualserve-Decoder`` header. An explicit decoder is honoured if the
model serves it and refused with a 400 that says why otherwise. ``auto`` applies
the deployment's policy: latency-bound, decode-heavy, lower-value work to
diffusion; high-value work to lossless speculative AR; batchable work (n > 1,
``priority: batch``) to the batching AR path. The decision and its reason go
back to the client in response headers.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .errors import bad_request

DECODERS = ("ar", "eagle", "diffusion")
HINTS = DECODERS + ("auto",)
Priority = Literal["interactive", "high_value", "batch"]
PRIORITIES = ("interactive", "high_value", "batch")


@dataclass(frozen=True)
class Route:
    decoder: str
    reason: str


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
    raw = json.loads(Path(path).read_text())
    known = {f.name for f in dataclasses.fields(RoutingPolicy)}
    unknown = set(raw) - known
    if unknown:
        raise ValueError(f"unknown routing policy keys {sorted(unknown)}; known: {sorted(known)}")
    policy = RoutingPolicy(**raw)
    for value in (policy.interactive, policy.high_value, policy.batch):
        if value not in DECODERS:
            raise ValueError(f"routing policy decoders must be one of {DECODERS}, got {value!r}")
    return policy


class Router:
    def __init__(self, policy: RoutingPolicy = RoutingPolicy()):
        self.policy = policy

    def route(self, model: str, available: list[str], hint: str | None, *, priority: str | None = None,
              latency_budget_ms: float | None = None, n: int = 1, infill: bool = False,
              structured: bool = False) -> Route:
        hint = (hint or self.policy.default_hint).lower()
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
        return self.auto(available, priority, latency_budget_ms, n, infill, structured)

    def auto(self, available: list[str], priority: str | None, latency_budget_ms: float | None, n: int,
             infill: bool, structured: bool) -> Route:
        p = self.policy

        def pick(first: str, why: str) -> Route:
            if first in available:
                return Route(first, why)
            for fallback in ("eagle", "ar", "diffusion"):
                if fallback in available:
                    return Route(fallback, f"{why}; {first} not loaded")
            raise bad_request("no decoder available", "decoder")

        if infill and "diffusion" in available:
            return Route("diffusion", "infill: diffusion fills between prefix and suffix natively")
        if n > 1:
            return pick(p.batch, "n>1: batching AR path shares the prompt")
        if priority == "batch":
            return pick(p.batch, "priority=batch")
        latency_bound = priority == "interactive" or (
            latency_budget_ms is not None and latency_budget_ms <= p.latency_budget_ms and priority != "high_value")
        if structured:
            # Every decoder enforces the grammar exactly. Diffusion places the forced skeleton
            # (keys, punctuation) without forwards; EAGLE cannot branch a grammar's state and
            # drafts nothing, so plain AR is the better lossless path.
            if latency_bound:
                return pick(p.interactive, "structured, latency-bound: skeleton forced, values decoded under the grammar")
            return pick("ar" if "ar" in available else p.high_value, "structured output: grammar-constrained AR")
        if latency_bound:
            return pick(p.interactive, "latency-bound interactive work")
        if priority == "high_value" or priority is None:
            return pick(p.high_value, f"priority={priority or p.default_priority}: lossless decoding")
        return pick("ar", "default")
