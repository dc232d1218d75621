"""Which served models are in memory: states, use, and who unloads when another loads.

Plain Python over names and byte counts, with no torch and no threads (``model_manager`` holds
the lock and does the loading): a ``ModelPool`` keeps one ``PoolEntry`` per configured model and
answers the one policy question, which idle models to unload, least recently used first, so that
another fits within ``max_loaded`` models and ``memory_bytes`` of weights and KV tensors.

Design choices, after Ollama's scheduler and llama.cpp's router (``--models-max``):

- A model with requests in flight, or handed to a request that has not started yet (a *lease*,
  ``lease_seconds`` at most, for a request that is still tokenizing), is never a victim. When
  only busy models could make room, the answer is "wait", never "unload a busy one".
- A model's cost is what it measured the last time it was loaded; one never loaded yet costs 0
  until its load measures it, and the budget is checked again then (``over_budget``).
- A model larger than the budget by itself is still served, alone: refusing it would make the
  budget a way to break a configured model.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable


class ModelState(enum.Enum):
    """As llama.cpp's router reports a model's ``status.value``."""

    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"


@dataclass
class PoolEntry:
    """One configured model. Owned by its ``ModelPool``; changed under ``model_manager``'s lock."""

    name: str
    state: ModelState = ModelState.UNLOADED
    cost: int = 0                       # bytes of weights and KV tensors, measured at its last load
    last_used: float = 0.0              # monotonic seconds of its last lease or finished request
    in_flight: int = 0                  # requests started on it and not yet ended
    leases: list[float] = field(default_factory=list)  # expiry of each lease not yet turned into a request
    error: str | None = None            # why its last load failed, until it loads

    def busy(self, now: float) -> bool:
        return self.in_flight > 0 or any(t > now for t in self.leases)

    @property
    def resident(self) -> bool:
        """In memory, or about to be: what the budget counts."""
        return self.state is not ModelState.UNLOADED


class ModelPool:
    """The configured models and the unloading policy (the module docstring)."""

    def __init__(self, names: list[str], max_loaded: int | None = None, memory_bytes: int | None = None,
                 lease_seconds: float = 10.0, clock: Callable[[], float] = time.monotonic):
        if max_loaded is not None and max_loaded < 1:
            raise ValueError("max_loaded must be at least 1")
        self.entries = {name: PoolEntry(name) for name in names}
        self.max_loaded = max_loaded
        self.memory_bytes = memory_bytes
        self.lease_seconds = lease_seconds
        self.clock = clock

    def __getitem__(self, name: str) -> PoolEntry:
        return self.entries[name]

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    # ---- use -------------------------------------------------------------------------

    def lease(self, name: str) -> None:
        """``name`` is handed to a request that will start soon (or expire)."""
        entry, now = self.entries[name], self.clock()
        entry.leases = [t for t in entry.leases if t > now] + [now + self.lease_seconds]
        entry.last_used = now

    def begin(self, name: str) -> None:
        """A request started on ``name``: its lease becomes a request in flight."""
        entry = self.entries[name]
        if entry.leases:
            entry.leases.pop(0)
        entry.in_flight += 1

    def end(self, name: str) -> None:
        entry = self.entries[name]
        entry.in_flight = max(0, entry.in_flight - 1)
        entry.last_used = self.clock()

    # ---- the policy ------------------------------------------------------------------

    def victims(self, incoming: str) -> list[str] | None:
        """The idle resident models to unload, least recently used first, so that ``incoming``
        fits; None when only busy models could make room (wait for one to finish)."""
        now = self.clock()
        others = [e for e in self.entries.values() if e.resident and e.name != incoming]
        excess_count = len(others) + 1 - self.max_loaded if self.max_loaded is not None else 0
        cost = self.entries[incoming].cost
        excess_bytes = sum(e.cost for e in others) + cost - self.memory_bytes if self.memory_bytes is not None else 0
        idle = sorted((e for e in others if e.state is ModelState.LOADED and not e.busy(now)),
                      key=lambda e: e.last_used)
        chosen = []
        for entry in idle:
            if excess_count <= 0 and excess_bytes <= 0:
                break
            chosen.append(entry.name)
            excess_count -= 1
            excess_bytes -= entry.cost
        if excess_count > 0:
            return None
        if excess_bytes > 0 and len(chosen) < len(others):  # busy ones hold the memory: wait for them
            return None
        return chosen

    def over_budget(self, keep: str) -> list[str]:
        """After ``keep`` has loaded and measured its cost: the idle models to unload, least recently
        used first, until the resident ones fit the memory budget (busy ones stay; the budget is
        checked again when a request ends)."""
        if self.memory_bytes is None:
            return []
        now = self.clock()
        resident = [e for e in self.entries.values() if e.resident]
        excess = sum(e.cost for e in resident) - self.memory_bytes
        chosen = []
        for entry in sorted(resident, key=lambda e: e.last_used):
            if excess <= 0:
                break
            if entry.name != keep and entry.state is ModelState.LOADED and not entry.busy(now):
                chosen.append(entry.name)
                excess -= entry.cost
        return chosen
