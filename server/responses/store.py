"""Stored responses, for ``previous_response_id`` and GET/DELETE ``/v1/responses/{id}``: bounded, in memory.

Eviction rule: the store holds at most ``max_responses`` responses and ``max_bytes`` of them
(measured as their JSON: the response body plus the conversation it continues). Storing one
more first drops the least recently used entries (stored or read, whichever was later) until
both bounds hold; a single response larger than ``max_bytes`` is not kept. A response made
with ``store: false`` is never held, and nothing survives a restart.

Each entry keeps the conversation as chat messages (every earlier turn, this turn's input and
its output), so a follow-up with ``previous_response_id`` is one list concatenation away from
a chat-template prompt. ``instructions`` are not part of it: OpenAI does not carry them over.
All access happens on the event loop's thread, so there is no lock.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ..errors import APIError, ErrorKind
from ..protocol import ResponseObject, encoder

DEFAULT_MAX_RESPONSES = 1024
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class StoredResponse:
    body: ResponseObject
    messages: list[dict[str, Any]]   # chat messages of the whole conversation, output included
    size: int                        # bytes counted against the store's budget


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES, max_bytes: int = DEFAULT_MAX_BYTES):
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, StoredResponse] = OrderedDict()  # least recently used first
        self.bytes = 0

    @classmethod
    def sized(cls, max_responses: int | None, max_mb: float | None) -> ResponseStore:
        """From the CLI's bounds; None keeps a default."""
        return cls(DEFAULT_MAX_RESPONSES if max_responses is None else max_responses,
                   DEFAULT_MAX_BYTES if max_mb is None else int(max_mb * 2**20))

    def __len__(self) -> int:
        return len(self.entries)

    def put(self, body: ResponseObject, messages: list[dict[str, Any]]) -> bool:
        """Keep ``body`` under its id; False when it alone is larger than the whole budget."""
        size = len(encoder.encode(body)) + len(json.dumps(messages, ensure_ascii=False))
        self.delete(body.id)
        if size > self.max_bytes or self.max_responses < 1:
            return False
        while self.entries and (len(self.entries) >= self.max_responses or self.bytes + size > self.max_bytes):
            _, evicted = self.entries.popitem(last=False)
            self.bytes -= evicted.size
        self.entries[body.id] = StoredResponse(body, messages, size)
        self.bytes += size
        return True

    def get(self, response_id: str, param: str = "response_id") -> StoredResponse:
        """The entry, now the most recently used; a 404 in OpenAI's shape if it is not held."""
        entry = self.entries.get(response_id)
        if entry is None:
            raise APIError(ErrorKind.NOT_FOUND, f"Response with id '{response_id}' not found. It was never "
                           "stored (store=false), was deleted, or was evicted from the server's bounded "
                           "in-memory store.", param, "response_not_found")
        self.entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self.entries.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True
