"""Several models in one server: load on first use, unload the least recently used idle one.

``ModelManager`` owns which configured models are in memory. A request names its model
(``Service.model``); the manager hands back the model's ``ServedModel`` under a lease, loading
it first if it is not in memory. What unloads is decided by ``model_pool.ModelPool`` (plain
policy); this module does the waiting, the loading and the unloading, under one lock:

- **One load at a time.** Loads are serialized (memory is the constraint the budget guards);
  concurrent requests for a model being loaded wait for that one load and share its outcome,
  failure included, and a failed load leaves the model unloaded and the server serving.
- **Unload before load.** The victims are taken out of ``loaded`` under the lock (no request
  can lease them afterwards), then unloaded (``decoders.deployment.unload_deployment``: the
  engine drops their decoders and prefix-cache entries on its own thread, then their weights
  and KV tensors go), then the model loads into the same engine and block pool.
- **A busy model is never unloaded.** A model with requests in flight or leased to a request
  not yet started is waited for, ``wait_seconds`` at most, then the request gets a 429.
- **Blocking by design.** ``acquire`` and ``load`` block their caller's thread while a model
  loads; ``Service.ready`` runs the load on a worker thread, so the event loop keeps answering.

Loading and unloading themselves are given as functions (``cli.serving_state`` builds them),
so this module imports no torch and no model code.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from .errors import APIError, ErrorKind, overloaded
from .model_pool import ModelPool, ModelState
from .served import ServedModel

log = logging.getLogger("dualserve.server")


@dataclass
class Loaded:
    """One loaded catalog model: its deployment (opaque here) and the names it serves (a model
    with a ``--diffusion`` model beside it serves two)."""

    deployment: Any
    served: dict[str, ServedModel]
    cost: int                           # bytes of weights and KV tensors


@dataclass
class LoadAttempt:
    """A load in progress, which every request for that model waits on (set under the lock)."""

    done: bool = False
    error: str | None = None
    waiters: int = 0                    # requests waiting on it, each leased the model when it loads


class ModelManager:
    def __init__(self, pool: ModelPool, load: Callable[[str], Loaded], unload: Callable[[Any], None],
                 paths: dict[str, str] | None = None, wait_seconds: float = 30.0):
        self.pool = pool                # guarded by _cond
        self.paths = paths or {}        # catalog name -> what it loads from, for /models
        self._load, self._unload = load, unload
        self.wait_seconds = wait_seconds
        self._cond = threading.Condition()
        self._resident: dict[str, Loaded] = {}          # catalog name -> its deployment; guarded by _cond
        self._attempts: dict[str, LoadAttempt] = {}     # catalog name -> its load in progress
        self._loading: str | None = None                # the one model loading (or unloading to make room)
        self._cards: dict[str, ServedModel] = {}        # every served name -> its last ServedModel
        # Served name -> ServedModel of every loaded model: replaced, never changed in place, so
        # that readers on any thread (Service.models, the status page) see a whole map.
        self.loaded: dict[str, ServedModel] = {}
        self._owner: dict[str, str] = {}                # served name -> catalog name

    # ---- what the service asks ------------------------------------------------------

    def owner(self, name: str) -> str | None:
        """The catalog model that serves ``name``, if one does (a configured name, or a name a
        loaded model serves beside its own)."""
        return name if name in self.pool else self._owner.get(name)

    def acquire(self, name: str) -> ServedModel:
        """``name``'s ServedModel, leased to a request (``begin`` turns the lease into a request in
        flight); loads it first if it is not in memory. Blocks while it loads."""
        owner = self.owner(name)
        if owner is None:
            raise KeyError(name)
        self._ensure(owner, lease=True)
        with self._cond:
            if name not in self.loaded:  # a name its model no longer serves after a reload
                raise KeyError(name)
            return self.loaded[name]

    def begin(self, name: str) -> None:
        with self._cond:
            owner = self.owner(name)
            if owner is not None:
                self.pool.begin(owner)

    def end(self, name: str) -> None:
        with self._cond:
            owner = self.owner(name)
            if owner is not None:
                self.pool.end(owner)
            self._cond.notify_all()  # a loader waiting for an idle model may go on

    # ---- what /models/load and /models/unload ask -----------------------------------

    def load(self, name: str) -> None:
        """Load ``name`` (a catalog name) unless it is in memory; blocks until it is."""
        self._ensure(name, lease=False)

    def unload(self, name: str) -> bool:
        """Unload ``name`` once it is idle (``wait_seconds`` at most, else a 429); False if it
        was not in memory."""
        deadline = time.monotonic() + self.wait_seconds
        with self._cond:
            while True:
                entry = self.pool[name]
                if entry.state is ModelState.UNLOADED:
                    return False
                if entry.state is ModelState.LOADED and self._loading is None and not entry.busy(time.monotonic()):
                    self._loading = name
                    loaded = self._evict([name])
                    break
                self._wait(deadline, f"model {name!r} has requests in flight")
        try:
            self._unload_all(loaded)
        finally:
            with self._cond:
                self._loading = None
                self._cond.notify_all()
        return True

    def states(self) -> list[tuple[str, ModelState, str | None, list[ServedModel]]]:
        """Every catalog model: (name, state, why its last load failed, the ServedModels it
        serves now or served when last loaded)."""
        with self._cond:
            out = []
            for name, entry in self.pool.entries.items():
                served = [m for n, m in self._cards.items() if n == name or self._owner.get(n) == name]
                out.append((name, entry.state, entry.error, served))
            return out

    # ---- start-up ----------------------------------------------------------------------

    def add(self, name: str, loaded: Loaded) -> None:
        """A model loaded at start-up (``--preload``)."""
        with self._cond:
            self._install(name, loaded)

    # ---- loading and unloading -------------------------------------------------------

    def _ensure(self, name: str, lease: bool) -> None:
        deadline = time.monotonic() + self.wait_seconds
        with self._cond:
            while True:
                entry = self.pool[name]
                if entry.state is ModelState.LOADED:
                    if lease:
                        self.pool.lease(name)
                    return
                attempt = self._attempts.get(name)
                if attempt is not None:  # loading: share that load and its outcome (and a lease, when it loads)
                    attempt.waiters += lease
                    while not attempt.done:
                        self._cond.wait()
                    if attempt.error is not None:
                        raise load_failed(name, attempt.error)
                    return
                if self._loading is None:
                    victims = self.pool.victims(name)
                    if victims is not None:
                        break
                self._wait(deadline, "every loaded model is busy")
            self._loading = name
            attempt = self._attempts[name] = LoadAttempt()
            entry.state = ModelState.LOADING
            evicted = self._evict(victims)
        self._load_now(name, attempt, evicted, lease)
        if attempt.error is not None:
            raise load_failed(name, attempt.error)

    def _load_now(self, name: str, attempt: LoadAttempt, evicted: list[Loaded], lease: bool) -> None:
        """Unload the victims, load ``name`` (leased at once to each request waiting on it: no other
        load may take it for a victim before they start), then unload what its measured cost pushes
        over the memory budget; off the lock, on the caller's thread."""
        loaded, error, over = None, None, []
        try:
            self._unload_all(evicted)
            started = time.perf_counter()
            loaded = self._load(name)
            log.info("loaded %s on first use in %.2fs (%.0f MB)", name, time.perf_counter() - started,
                     loaded.cost / 2**20)
        except Exception as e:  # noqa: BLE001 - a model that cannot load fails its requests, not the server
            error = " ".join(str(e).split()) or type(e).__name__
            log.error("loading %s failed: %s", name, error)
            log.debug("loading %s failed", name, exc_info=True)
        with self._cond:
            entry = self.pool[name]
            if loaded is not None:
                self._install(name, loaded)
                for _ in range(attempt.waiters + lease):
                    self.pool.lease(name)
                over = self._evict(self.pool.over_budget(keep=name))
            else:
                entry.state, entry.error = ModelState.UNLOADED, error
            attempt.done, attempt.error = True, error
            del self._attempts[name]
            self._loading = None if not over else name
            self._cond.notify_all()
        if over:
            try:
                self._unload_all(over)
            finally:
                with self._cond:
                    self._loading = None
                    self._cond.notify_all()

    def _install(self, name: str, loaded: Loaded) -> None:
        entry = self.pool[name]
        entry.state, entry.error, entry.cost = ModelState.LOADED, None, loaded.cost
        entry.last_used = self.pool.clock()
        self._resident[name] = loaded
        for served in loaded.served:
            self._owner[served] = name
        self._cards.update(loaded.served)
        self.loaded = {**self.loaded, **loaded.served}

    def _evict(self, names: list[str]) -> list[Loaded]:
        """Take ``names`` out of service (under the lock): no request can lease them afterwards."""
        out = []
        for name in names:
            loaded = self._resident.pop(name)
            self.pool[name].state = ModelState.UNLOADED
            self.loaded = {n: m for n, m in self.loaded.items() if n not in loaded.served}
            out.append(loaded)
        return out

    def _unload_all(self, evicted: list[Loaded]) -> None:
        for loaded in evicted:
            names = ", ".join(loaded.served)
            self._unload(loaded.deployment)
            log.info("unloaded %s (%.0f MB)", names, loaded.cost / 2**20)

    def _wait(self, deadline: float, why: str) -> None:
        """Wait (under the lock) for a request to end or a lease to expire, until ``deadline``."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise overloaded(f"{why}; no model can be unloaded to make room now. Retry shortly.", 5,
                             "models_busy")
        self._cond.wait(timeout=min(left, 0.25))  # leases expire without a notification


def load_failed(name: str, error: str) -> APIError:
    return APIError(ErrorKind.NO_CAPACITY, f"The model '{name}' could not be loaded: {error}", "model",
                    "model_load_failed")
