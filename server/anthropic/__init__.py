"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``), served through the chat path.

- ``protocol``: the wire types (request, content blocks, message, stream events);
- ``to_chat``: a Messages request as the chat request that serves it, and what is refused;
- ``output``: what the engine produced as Anthropic's blocks, stop reason and usage;
- ``handler``: the endpoint's handler and its routes;
- ``stream``: the typed SSE events of a streamed answer.

Errors in Anthropic's shape on these paths are made by ``server.errors``.
"""

from __future__ import annotations

from .handler import ROUTES

__all__ = ["ROUTES"]
