"""The one shape of a generation endpoint: body -> ``Plan`` -> the service runs it -> body or SSE.

Each OpenAI-shaped generation endpoint (``completions``, ``chat``, ``responses``, ``fim_completions``)
has a handler class built per request from the service, the decoded body and the decoder the client
asked for in the ``x-dualserve-decoder`` header. ``endpoint.generate`` then does the same for all:
submit the plan, and either stream the handler's SSE or collect the results and encode the
handler's body. llama.cpp's native endpoints (``/infill``, ``/completion``) plan the same way and
answer through ``llamacpp.serve``, which also times each phase.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Protocol

from .service import ChoiceResult, Job, Plan, Service


class Handler(Protocol):
    """One request to one generation endpoint."""

    def plan(self) -> Plan:
        """Validate, tokenize and route: everything decided before the engine sees the request."""
        ...

    def respond(self, job: Job, results: list[ChoiceResult]) -> Any:
        """The response body once every choice has finished."""
        ...

    def stream(self, job: Job) -> AsyncIterator[bytes]:
        """The SSE events, as results arrive."""
        ...


class HandlerType(Protocol):
    def __call__(self, service: Service, body: Any, header_decoder: str | None) -> Handler: ...

