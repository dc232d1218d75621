"""A thin helper over the OpenAI SDK for dualserve's request hints.

dualserve reads its hints from extra body fields (what the SDK sends through
``extra_body``) or the ``X-Dualserve-Decoder`` header, and reports its routing
decision in the ``x-dualserve-decoder`` / ``x-dualserve-route-reason`` response
headers. This module spells those out so callers need not remember the names.

    from openai import OpenAI
    from dualserve.clients.hints import Hints, routed

    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    hints = Hints(priority="interactive", latency_budget_ms=300)
    raw = client.chat.completions.with_raw_response.create(
        model="SmolLM2-135M-Instruct", messages=[...], **hints.kwargs())
    reply, route = routed(raw)      # route.decoder, route.reason
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Decoder = Literal["ar", "eagle", "diffusion", "auto"]
Priority = Literal["interactive", "high_value", "batch"]


@dataclass(frozen=True)
class Hints:
    decoder: Decoder | None = None
    priority: Priority | None = None
    latency_budget_ms: float | None = None

    def body(self) -> dict[str, Any]:
        return {k: v for k, v in (("decoder", self.decoder), ("priority", self.priority),
                                  ("latency_budget_ms", self.latency_budget_ms)) if v is not None}

    def kwargs(self, extra_body: dict[str, Any] | None = None) -> dict[str, Any]:
        """Keyword arguments for any ``client.*.create`` call."""
        return {"extra_body": {**(extra_body or {}), **self.body()}}


@dataclass(frozen=True)
class Route:
    decoder: str | None
    reason: str | None


def routed(raw_response) -> tuple[Any, Route]:
    """(parsed response, routing decision) from a ``with_raw_response`` call."""
    headers = raw_response.headers
    return raw_response.parse(), Route(headers.get("x-dualserve-decoder"), headers.get("x-dualserve-route-reason"))


INTERACTIVE = Hints(priority="interactive", latency_budget_ms=500)
HIGH_VALUE = Hints(priority="high_value")
BATCH = Hints(priority="batch")
