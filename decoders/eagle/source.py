"""The ``DraftSource`` contract: what the speculative decoder asks of anything that drafts.

One ``eagle`` step (``decoder.py``), for each request, in this order:

  1. ``offer``: what each of the request's sources can draft now, as node counts and
     drafting units by depth (``budget.Reach``); the budget (``budget.py``) picks a
     depth for each, or none;
  2. ``due`` / ``catch_up``: a source that reads the target's features brings the
     requests it drafts for up to the root, all of them in one forward;
  3. ``propose``: each source's tree (or chain) from the root, within its depth and
     node count; the trees merge into one (``tree.merge_trees``) and the target
     verifies it in one forward;
  4. ``observe``: what the target computed at the positions it committed (its final
     hidden states and the features of ``aux_layers``), for sources that read them;
  5. ``release``: the request finished.

Implemented by ``HeadSource`` (an EAGLE head, ``drafters.py``), ``BlockSource`` (a DFlash
drafter, ``drafters.py``) and ``SuffixSource`` (suffix lookup, ``suffix.py``).

A source's state for one request is an object it makes (``start``); the decoder keeps it in
the request's ``EagleState`` and hands it back on every call, so it is dropped with the
request on preemption. Sources neither time themselves nor decide how much to draft: the
budget owns both, from the units a source declares and the outcomes the decoder reports.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ..engine.request import Request
from .budget import Reach, Source
from .tree import DraftTree


class DraftSource(Protocol):
    name: Source
    """"head" (an EAGLE head), "block" (a DFlash drafter) or "suffix" (suffix lookup): the request
    field ``draft`` names it, and its statistics and acceptance rates are kept under it."""

    def start(self, req: Request) -> Any:
        """A new request's state in this source (its context starts at ``req.num_computed``)."""
        ...

    def offer(self, req: Request, st: Any, cap: int) -> Reach:
        """What it can draft for ``req`` this step, within ``cap`` nodes; ``NO_REACH`` when nothing."""
        ...

    def due(self, st: Any, drafting: bool, stale: bool) -> bool:
        """Whether ``catch_up`` must run for this request this step: ``drafting`` from this source,
        or not (``stale``: the budget has left this source unused long, so what it holds may go)."""
        ...

    def catch_up(self, reqs: list[Request], states: list[Any]) -> int:
        """Read every position these requests committed since it last read, in one batch; returns
        the positions read (the budget times it)."""
        ...

    def propose(self, req: Request, st: Any, depth: int, nodes: int) -> DraftTree:
        """Its draft from the root (``req.all_ids[-1]``): at most ``depth`` levels and ``nodes`` nodes."""
        ...

    def observe(self, st: Any, final: torch.Tensor, aux: list[torch.Tensor]) -> None:
        """The target computed these positions, committed in order: (positions, hidden) final states
        and the features of the verify's layers, one tensor per layer."""
        ...

    def release(self, req: Request, st: Any | None) -> None:
        """``req`` finished; ``st`` is None when it did not draft from this source."""
        ...
