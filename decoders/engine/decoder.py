"""The ``Decoder`` contract: everything the engine and the server ask of a decoding algorithm.

A decoder (``ar``, ``eagle``, ``diffusion``) owns its algorithm and nothing else. The engine
asks it, for each scheduled request, how much work the next step holds (``plan``), then hands
it the step's batch (``step``); the server reads its declared properties. Nothing probes a
decoder for optional attributes: what is not declared here is not asked.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

from .request import Delta, Request
from .scheduler import Scheduled

Emit = Callable[[Request, Delta], None]


class Decoder(Protocol):
    name: str
    """The served decoder name: ``"ar"``, ``"eagle"`` or ``"diffusion"``."""

    kv_owner: object
    """Whose KV tensors this decoder's blocks hold (its runner). Decoders with the same owner
    (ar and eagle on one runner) share prefix-cache hits; the engine namespaces the rest."""

    shares_prompt_blocks: bool
    """Whether a request's prompt blocks reach the prefix cache, so the engine holds the other
    choices of an n > 1 request back until choice 0 has computed them."""

    supports_infill: bool
    """Whether it fills between the prompt and a fixed suffix (``Request.suffix_ids``)."""

    default_max_tokens: int | None
    """max_tokens when the client sets none; None: whatever room the context leaves."""

    draft_choices: tuple[str, ...]
    """The request field ``draft`` values it serves (eagle: its loaded draft sources); () where
    ``draft`` means nothing to it."""

    def plan(self, req: Request, budget: int) -> tuple[int, int]:
        """(tokens the next step computes, lookahead slots to reserve) for ``req`` within
        ``budget`` tokens. Pure: the scheduler may call it and then not run the request."""
        ...

    def step(self, batch: Sequence[Scheduled], emit: Emit) -> None:
        """Run one step for the scheduled requests; ``emit`` each request's committed tokens."""
        ...
