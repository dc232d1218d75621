"""The engine: one per process, on its own thread, owning the scheduler, the block pool and the runners.

The server submits requests from the event loop; the engine thread runs steps:
  1. take in new submissions and aborts (thread-safe inbox),
  2. ask the scheduler which requests run and how many tokens each computes,
  3. let each request's decoder run its part of the step,
  4. hand each request's ``Delta`` to its sink and free finished requests' blocks.

Decoders are keyed by (model name, decoder name), so one process can serve an
AR model with an EAGLE head and a diffusion model from the same block pool.
An aborted request leaves at the start of the next step, blocks and all.

Overload is refused at the door: ``submit`` raises ``QueueFull`` once the
bounded waiting queue (``max_waiting`` choices not yet running) is full, and the
server answers 429 with Retry-After; it also refuses a request whose estimated wait
for a place to run (``estimated_wait``, ``admission.py``) exceeds ``max_queue_wait``.
A choice that has still not started after ``max_queue_wait`` seconds is failed
(``FailureKind.OVERLOADED``, a 429 to the client) and leaves the queue. With ``max_run_time``
a choice starts only while the estimated finish of every running choice, its own included,
stays within the time each was promised (the run bound, ``admission.RunEstimator``, measured
from the steps this engine runs); else it waits, so running work is bounded too. Per-request
timeouts are the server's: it aborts what it stops waiting for. A request whose plan,
sampling, grammar, drafting or forward raises is failed alone and its neighbours go on
(``isolation.py``); only a scheduler failure that names no request fails every request.
The thread goes on.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Sequence

from .admission import Member, RunEstimator, StepSample, WaitEstimator
from .blocks import BlockPool
from .compile.tracing import TRACING
from .decoder import Decoder
from .detokenize import TextStream
from .grammar import Constraint, GrammarCompiler, GrammarCompilers
from .isolation import internal_error, run_isolated
from .request import Delta, FailureKind, Request, Status
from .sampling import SamplingParams
from .scheduler import QueueFull, Scheduled, Scheduler

log = logging.getLogger("dualserve.engine")


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int = 2048
    block_size: int = 16
    max_num_seqs: int = 64
    max_batched_tokens: int = 512
    max_waiting: int = 256
    enable_prefix_caching: bool = True
    # Seconds a request may wait to start: refused at admission when its estimated wait is longer,
    # failed when it has waited this long (None: no bound, for offline tools).
    max_queue_wait: float | None = None
    # Seconds a started choice is promised to finish in, at least (admission.RunEstimator); a long
    # one is promised max_tokens / min_token_rate. None: no run bound (admission by places only).
    max_run_time: float | None = None
    min_token_rate: float = 4.0


@dataclass
class EngineStats:
    steps: int = 0
    busy_seconds: float = 0.0           # read by the server's utilisation metric


@dataclass(frozen=True)
class EngineSnapshot:
    """The numbers the server's metrics read, taken at once (``Engine.snapshot``)."""

    running: int                        # choices running
    waiting: int                        # choices submitted and not yet running
    capacity: int                       # choices the engine lets run now
    pool_blocks: int                    # KV blocks in the pool
    pool_usage: float                   # share of them in use
    busy_seconds: float                 # seconds spent in steps since the engine started


@dataclass(frozen=True)
class Registered:
    """What the engine serves: each (model, decoder name)'s decoder and prefix-cache namespace, and
    each model's tokenizer and vocabulary size.

    Frozen: registering or removing a model makes a new value, swapped in by one assignment, so the
    engine thread and the server's threads always read one whole set, even while a model loads on
    first use."""

    decoders: Mapping[tuple[str, str], Decoder] = field(default_factory=dict)
    namespaces: Mapping[tuple[str, str], str] = field(default_factory=dict)
    tokenizers: Mapping[str, object] = field(default_factory=dict)
    vocab_sizes: Mapping[str, int] = field(default_factory=dict)  # for structured output alone

    def with_decoder(self, model: str, decoder: Decoder, tokenizer, vocab_size: int | None) -> Registered:
        key = (model, decoder.name)
        # Prefix-cache namespace: decoders that read the same KV tensors (ar and eagle on one
        # runner) share cached blocks; another model's blocks are never a hit.
        kv_owner = decoder.kv_owner
        namespace = f"{model}/{type(kv_owner).__name__}@{id(kv_owner):x}"
        # A minimal tokenizer (tests, offline tools) may lack a vocabulary size.
        vocab = vocab_size or getattr(tokenizer, "vocab_size", 0)
        return Registered({**self.decoders, key: decoder}, {**self.namespaces, key: namespace},
                          {**self.tokenizers, model: tokenizer}, {**self.vocab_sizes, model: vocab})

    def without(self, model: str) -> Registered:
        return Registered({k: d for k, d in self.decoders.items() if k[0] != model},
                          {k: n for k, n in self.namespaces.items() if k[0] != model},
                          {m: t for m, t in self.tokenizers.items() if m != model},
                          {m: v for m, v in self.vocab_sizes.items() if m != model})

    def namespaces_of(self, model: str) -> set[str]:
        return {n for k, n in self.namespaces.items() if k[0] == model}

    def decoders_for(self, model: str) -> list[str]:
        return [d for (m, d) in self.decoders if m == model]


@dataclass
class Door:
    """What the server's threads and the engine thread share, all of it guarded by ``lock``.

    Inward, the inbox: ("add" | "abort", a request) or ("call", work that must run on the engine
    thread: ``remove_model``), and ``stop``. Outward, the counts the server reads to refuse work at
    the door (``submit``, ``estimated_wait``, ``snapshot``), as of the last step plus what the inbox
    took in since, so no server thread reads the scheduler's queues."""

    lock: threading.Condition = field(default_factory=threading.Condition)  # the engine thread sleeps on it
    inbox: deque[tuple[str, Request | Callable[[], object]]] = field(default_factory=deque)
    stop: bool = False
    queued: int = 0                     # choices not yet running: waiting, in the inbox, or held
    running: int = 0
    capacity: int = 0                   # places the engine lets run now (``Engine.capacity``)
    admission: WaitEstimator = field(default_factory=WaitEstimator)  # the wait for a place (admission.py)
    freed: int = 0                      # running choices finished since the last busy step (engine thread)

    def post(self, *items: tuple[str, Request | Callable[[], object]]) -> None:
        """Hand ``items`` to the engine thread and wake it; the caller holds ``lock``."""
        self.inbox.extend(items)
        self.lock.notify()

    def take(self) -> list[tuple[str, Request | Callable[[], object]]]:
        with self.lock:
            items = list(self.inbox)
            self.inbox.clear()
        return items

    def adds_posted(self) -> int:
        return sum(1 for kind, _ in self.inbox if kind == "add")


@dataclass
class Choices:
    """Every request's choices by request id, and the n > 1 choices held back: choices 1..n-1 wait
    until choice 0 has its prompt in the prefix cache, then join and share those blocks instead of
    recomputing the prompt. ``submit`` adds to ``by_id`` under the door's lock; the rest belongs to
    the engine thread."""

    by_id: dict[str, list[Request]] = field(default_factory=dict)
    held: dict[str, list[Request]] = field(default_factory=dict)
    num_held: int = 0
    ids: Iterator[int] = field(default_factory=itertools.count)  # request ids made here

    def hold(self, req: Request) -> None:
        self.held.setdefault(req.request_id, []).append(req)
        self.num_held += 1

    def unhold(self, req: Request) -> None:
        held = self.held.get(req.request_id, [])
        if req in held:
            held.remove(req)
            self.num_held -= 1

    def release(self, request_id: str) -> list[Request]:
        """The held choices of ``request_id``, no longer held."""
        held = self.held.pop(request_id)
        self.num_held -= len(held)
        return held

    def release_all(self) -> list[Request]:
        held = [r for rs in self.held.values() for r in rs]
        self.held.clear()
        self.num_held = 0
        return held

    def held_of(self, model: str) -> list[Request]:
        return [r for rs in self.held.values() for r in rs if r.model == model]

    def drop_held_of(self, model: str) -> None:
        for rid in [rid for rid, rs in self.held.items() if rs and rs[0].model == model]:
            self.release(rid)

    def delivered(self, req: Request) -> None:
        """``req`` has finished: forget its request once every choice has."""
        if all(r.finished for r in self.by_id.get(req.request_id, [])):
            self.by_id.pop(req.request_id, None)


@dataclass
class StepNotes:
    """What the running step notes as it schedules (engine thread)."""

    serving: Request | None = None      # the request the scheduler serves: the culprit if it breaks
    unplanned: list[tuple[Request, str]] = field(default_factory=list)  # plans that raised, and why
    held_back: bool = False             # the run bound kept the queue's head waiting


class Engine:
    """The engine's state, in parts each with one owner:

      scheduler    the queues and the block pool (``pool``): engine thread
      registered   the decoders served, and each model's tokenizer (``Registered``): swapped whole
      grammars     each model's structured-output index (``GrammarCompilers``): any thread
      door         the inbox and the counts the server reads (``Door``): under its lock
      choices      requests by id and the choices held for prefix sharing (``Choices``): engine thread
      run_bound    the run bound's model of step times (``admission.RunEstimator``): engine thread
      notes        what the running step notes as it schedules (``StepNotes``): engine thread
      stats        steps run and seconds busy, for the server's metrics
    """

    def __init__(self, config: EngineConfig, pool: BlockPool | None = None):
        self.config = config
        pool = pool or BlockPool(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(pool, config.max_num_seqs, config.max_batched_tokens, config.max_waiting)
        self.registered = Registered()
        self.grammars = GrammarCompilers()  # warmed off-thread by start()
        self.door = Door(capacity=config.max_num_seqs)
        self.choices = Choices()
        self.run_bound = (RunEstimator(config.max_run_time, config.min_token_rate, config.max_batched_tokens)
                          if config.max_run_time else None)
        self.notes = StepNotes()
        self.stats = EngineStats()
        self._thread: threading.Thread | None = None
        self._before_step: Callable[[], None] = lambda: None  # on the stepping thread (pace_with)
        self._resumed: Callable[[], None] = lambda: None

    @property
    def pool(self) -> BlockPool:
        return self.scheduler.pool

    @property
    def decoders(self) -> Mapping[tuple[str, str], Decoder]:
        return self.registered.decoders

    # ---- registration and lifecycle ------------------------------------------

    def add_decoder(self, model: str, decoder: Decoder, tokenizer, vocab_size: int | None = None) -> None:
        """Register ``decoder`` for ``model``; safe while the engine thread runs (``Registered``)."""
        self.registered = self.registered.with_decoder(model, decoder, tokenizer, vocab_size)

    def remove_model(self, model: str) -> None:
        """Take ``model``'s decoders out of the engine and drop its prefix-cache entries, so that its
        runners (KV tensors, weights) can be freed. On the engine thread, through the inbox, when the
        thread runs; returns once done. Requests of the model still queued or running (the server
        unloads only idle models) end with finish_reason "abort"."""
        if self._thread is None or not self._thread.is_alive() or threading.current_thread() is self._thread:
            self._remove_model(model)
            return
        done = threading.Event()

        def work() -> None:
            try:
                self._remove_model(model)
            finally:
                done.set()

        with self.door.lock:
            self.door.post(("call", work))
        while not done.wait(timeout=1.0):
            if not self._thread.is_alive():  # it stopped without taking the work: no step runs any more
                self._remove_model(model)
                return

    def _remove_model(self, model: str) -> None:
        held = self.choices.held_of(model)
        for req in [r for r in list(self.scheduler.running) + list(self.scheduler.waiting) + held if r.model == model]:
            if not req.finished:
                self._finish(req, "abort")
        self.choices.drop_held_of(model)
        namespaces = self.registered.namespaces_of(model)
        self.registered = self.registered.without(model)
        self.grammars.drop(model)
        self.pool.drop_namespaces(namespaces)

    def grammar_compiler(self, model: str) -> GrammarCompiler:
        registered = self.registered
        return self.grammars.get(model, registered.tokenizers[model], registered.vocab_sizes[model])

    def _warm_grammars(self) -> None:
        """Index every model's vocabulary for structured output (about a second each) before the
        first structured request, off the server's event loop."""
        for model in list(self.registered.tokenizers):
            try:
                self.grammar_compiler(model)
            except Exception:  # noqa: BLE001 - a tokenizer llguidance cannot index: built (and refused) on use
                log.debug("no grammar index for %s", model, exc_info=True)

    def decoders_for(self, model: str) -> list[str]:
        return self.registered.decoders_for(model)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="dualserve-engine", daemon=True)
        self._thread.start()
        threading.Thread(target=self._warm_grammars, name="dualserve-grammars", daemon=True).start()

    def shutdown(self) -> None:
        with self.door.lock:
            self.door.stop = True
            self.door.lock.notify()
        if self._thread:
            self._thread.join(timeout=10)

    # ---- called from the server's thread -------------------------------------

    def submit(self, model: str, decoder: str, prompt_ids: list[int], params: SamplingParams,
               sink: Callable[[int, Delta], None], n: int = 1, suffix_ids: Sequence[int] = (),
               request_id: str | None = None, constraint: Constraint | None = None) -> str:
        """Queue a request (n choices); returns its id.

        ``constraint``: ``params.grammar`` already compiled (the server compiles it off its event
        loop); else it is compiled here. Either way once per request: each choice gets a copy.
        Raises QueueFull when overloaded (the bound counts every choice not yet
        running: waiting, in the inbox, or held back for prefix sharing) and
        ValueError for an empty prompt, a negative max_tokens or n < 1. max_tokens 0 prefills the
        prompt into the prefix cache and finishes with no output (llama.cpp's ``n_predict: 0``).
        """
        registered = self.registered
        if (model, decoder) not in registered.decoders:
            raise KeyError(f"model {model!r} has no decoder {decoder!r}")
        if not prompt_ids or params.max_tokens < 0 or n < 1:
            raise ValueError("a request needs a non-empty prompt, max_tokens >= 0 and n >= 1")
        if self.num_queued() + n > self.config.max_waiting:
            raise QueueFull("the waiting queue is full")
        if params.grammar and constraint is None:
            constraint = self.grammar_compiler(model).constraint(params.grammar)
        rid = request_id or f"req-{next(self.choices.ids)}"
        tok = registered.tokenizers[model]
        eos = frozenset(tok.eos_token_ids)
        reqs = []
        for i in range(n):
            stream = TextStream(tok, params.stop, skip_special_tokens=params.skip_special_tokens)
            reqs.append(Request(request_id=rid, prompt_ids=list(prompt_ids), params=params, decoder=decoder,
                                stream=stream, eos_token_ids=eos, sink=sink, model=model, index=i,
                                suffix_ids=list(suffix_ids),
                                constraint=constraint.copy() if constraint is not None and i else constraint))
            reqs[-1].table.namespace = registered.namespaces[(model, decoder)]
        with self.door.lock:
            if self.door.queued + n > self.config.max_waiting:  # rechecked: another thread may have queued
                raise QueueFull("the waiting queue is full")
            self.door.queued += n
            self.choices.by_id[rid] = reqs
            self.door.post(*(("add", r) for r in reqs))
        return rid

    def num_queued(self) -> int:
        """Choices submitted and not yet running (waiting, in the inbox, or held); safe from any thread."""
        with self.door.lock:
            return self.door.queued

    def capacity(self) -> int:
        """Choices the engine lets run now: ``max_num_seqs``, or the running count while the run
        bound holds the queue's head back; safe from any thread."""
        with self.door.lock:
            return self.door.capacity

    def snapshot(self) -> EngineSnapshot:
        """What the server's metrics read (``EngineSnapshot``); safe from any thread."""
        with self.door.lock:
            waiting, capacity = self.door.queued, self.door.capacity
        return EngineSnapshot(running=len(self.scheduler.running), waiting=waiting, capacity=capacity,
                              pool_blocks=self.pool.num_blocks, pool_usage=self.pool.usage(),
                              busy_seconds=self.stats.busy_seconds)

    def estimated_wait(self, n: int = 1) -> float:
        """Seconds until the last of ``n`` new choices would start (``admission.py``); any thread."""
        door = self.door
        with door.lock:
            return door.admission.estimate(door.queued, door.running, door.capacity, n)

    def abort(self, request_id: str) -> None:
        with self.door.lock:
            self.door.post(*(("abort", r) for r in self.choices.by_id.get(request_id, [])))

    # ---- the engine thread ---------------------------------------------------

    def _drain_inbox(self) -> None:
        for kind, req in self.door.take():
            if kind == "call":  # work that must run on the engine thread (remove_model)
                req()
            elif kind == "add" and req.index > 0 and self.pool.enable_prefix_caching:
                self.choices.hold(req)
            elif kind == "add":
                self.scheduler.add(req, bounded=False)  # submit already checked the bound
            elif not req.finished:
                self.choices.unhold(req)
                self._finish(req, "abort")
        self._release_held()

    def _release_held(self) -> None:
        """Let n > 1 choices join once choice 0 has computed (and so cached) its prompt."""
        for rid, held in list(self.choices.held.items()):
            first = self.choices.by_id.get(rid, [None])[0]
            # Decoders that never publish prompt blocks (bidirectional diffusion) gain nothing by waiting.
            shares = first is not None and self.decoders[(first.model, first.decoder)].shares_prompt_blocks
            if (first is None or first.finished or not shares or first.num_computed >= len(first.prompt_ids)
                    or not held):
                for r in self.choices.release(rid):
                    if first is not None and r.needs_prompt_logprobs and not first.needs_prompt_logprobs:
                        r.prompt_logprobs = list(first.prompt_logprobs or [None])  # same prompt, same values
                    self.scheduler.add(r, bounded=False)  # counted against the bound at submit

    def _finish(self, req: Request, reason: str) -> None:
        self.scheduler.remove(req)
        self._deliver(req, req.finish(reason))

    def _fail(self, req: Request, failure: FailureKind, error: str) -> None:
        """Finish ``req`` with finish_reason "error", saying what kind of failure and why."""
        self.scheduler.remove(req)
        self._deliver(req, req.fail(error, failure))

    def _deliver(self, req: Request, delta: Delta) -> None:
        if delta.finish_reason is not None:
            self.door.freed += req.admitted  # a running choice ends: its place is free (admission.py)
            req.status = Status.FINISHED
            delta.stats = req.decoder_stats()
            self.choices.delivered(req)
        try:
            req.sink(req.index, delta)
        except Exception:  # noqa: BLE001 - a broken sink must not stop the engine
            log.exception("output sink failed for %s", req.request_id)

    def emit(self, req: Request, delta: Delta) -> None:
        """Decoders call this with each request's committed tokens."""
        if delta.finish_reason is not None:
            self.scheduler.remove(req)
        self._deliver(req, delta)

    def _plan(self, req: Request, budget: int) -> tuple[int, int]:
        """The request's decoder's plan; one that raises gives no work, and the request is failed
        after scheduling (``StepNotes.unplanned``) while the others are scheduled as usual."""
        self.notes.serving = req
        try:
            return self.decoders[(req.model, req.decoder)].plan(req, budget)
        except Exception as e:  # noqa: BLE001 - fail this request alone
            log.exception("plan failed for request %s", req.request_id)
            self.notes.unplanned.append((req, internal_error(e)))
            return 0, 0

    def pace_with(self, before_step: Callable[[], None], resumed: Callable[[], None] = lambda: None) -> None:
        """Run ``before_step`` on the stepping thread before each step, and ``resumed`` before it when
        work arrives at an idle engine: the thread governor sizes the step's OpenMP team there
        (``openmp.ThreadGovernor.apply`` and ``resumed``)."""
        self._before_step, self._resumed = before_step, resumed

    def step(self) -> None:
        """One scheduling step; public so tests can drive the engine without its thread."""
        self._before_step()
        self._drain_inbox()
        self._expire_queued()
        started = time.perf_counter()
        self.notes.held_back = False
        scheduled = self.scheduler.schedule(self._plan, self._may_start if self.run_bound else None)
        self.notes.serving = None
        for req, error in self.notes.unplanned:
            if not req.finished:
                self._fail(req, FailureKind.INTERNAL, error)
        self.notes.unplanned.clear()
        groups: dict[tuple[str, str], list[Scheduled]] = {}
        for s in scheduled:
            req = s.request
            if req.finished:  # could never fit in the pool
                self._fail(req, FailureKind.CAPACITY, "the prompt does not fit in the KV block pool")
                continue
            if not req.admitted and s.num_new_tokens:
                req.admitted = True
                req.cached_prompt_tokens = req.table.num_cached_tokens
                if self.run_bound is not None:
                    req.deadline = time.monotonic() + self.run_bound.promise(req.params.max_tokens)
            groups.setdefault((req.model, req.decoder), []).append(s)
        sample, made = self._sample_start() if self.run_bound is not None else (None, [])
        with TRACING.step():  # no model code runs while a step graph is being traced (tracing.py)
            for key, batch in groups.items():
                began = time.perf_counter()
                # A request that raises fails alone; its neighbours finish the step (isolation.py).
                run_isolated(self.decoders[key].step, batch, self.emit, self._fail)
                if sample is not None:
                    sample.seconds[key] = time.perf_counter() - began
        elapsed = time.perf_counter() - started
        if sample is not None and scheduled:
            self._sample_end(sample, made, elapsed)
        self._count_queued(elapsed if scheduled else 0.0)
        if scheduled:
            self.stats.steps += 1
            self.stats.busy_seconds += elapsed

    # ---- the run bound (admission.RunEstimator) -----------------------------

    def _member(self, req: Request, now: float) -> Member:
        """The run bound's view of ``req``: steps left, and seconds to its promised finish (a choice
        not yet started is promised from now)."""
        bound = self.run_bound
        deadline = req.deadline if req.deadline is not None else now + bound.promise(req.params.max_tokens)
        prompt_left = max(0, req.num_tokens - req.num_computed - 1)  # to prefill (or recompute, if preempted)
        return bound.member((req.model, req.decoder), prompt_left, req.remaining, deadline - now)

    def _may_start(self, req: Request) -> bool:
        """The scheduler asks before ``req`` (the queue's head) starts beside the running ones."""
        now = time.monotonic()
        ok = self.run_bound.admits(self._member(req, now), [self._member(r, now) for r in self.scheduler.running])
        self.notes.held_back |= not ok
        return ok

    def _sample_start(self) -> tuple[StepSample, list[tuple[Request, int]]]:
        """The running batch by decoder, and each decoding choice's output length, before decoders step."""
        running = self.scheduler.running
        made = [(r, len(r.output_ids)) for r in running if r.output_ids or r.num_computed >= len(r.prompt_ids)]
        return StepSample(Counter((r.model, r.decoder) for r in running)), made

    def _sample_end(self, sample: StepSample, made: list[tuple[Request, int]], elapsed: float) -> None:
        for req, before in made:
            key = (req.model, req.decoder)
            sample.decoding[key] += 1
            sample.tokens[key] += len(req.output_ids) - before
        self.run_bound.observe(sample, elapsed)

    def _expire_queued(self) -> None:
        """Fail the choices that have waited ``max_queue_wait`` seconds without starting (a
        preempted one has started: its client has seen tokens, so it waits on)."""
        limit = self.config.max_queue_wait
        if limit is None:
            return
        cutoff = time.monotonic() - limit
        for req in [r for r in self.scheduler.waiting if not r.admitted and r.arrived < cutoff]:
            self._fail(req, FailureKind.OVERLOADED, f"the request waited {limit:g} s without a place to run; the "
                       "server is overloaded, retry shortly")

    def _count_queued(self, busy_seconds: float = 0.0) -> None:
        """Publish the queue counts and feed the step to the wait estimate."""
        door = self.door
        with door.lock:
            door.queued = len(self.scheduler.waiting) + self.choices.num_held + door.adds_posted()
            door.running = len(self.scheduler.running)
            door.capacity = door.running if self.notes.held_back else self.config.max_num_seqs
            if busy_seconds:  # a step without work (aborts only) keeps its finishes for the next
                door.admission.observe(busy_seconds, door.freed)
                door.freed = 0

    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self.door.inbox) or bool(self.choices.held)

    def _loop(self) -> None:
        while True:
            idle = False
            with self.door.lock:
                while not self.door.stop and not self.has_work():
                    idle = True
                    self.door.lock.wait()
                if self.door.stop:
                    break
            try:
                if idle:
                    self._resumed()
                self.step()
            except Exception as e:  # noqa: BLE001 - the server must keep answering
                log.exception("engine step failed")
                culprit, self.notes.serving = self.notes.serving, None
                if culprit is not None and not culprit.finished:
                    self._fail(culprit, FailureKind.INTERNAL, internal_error(e))  # the scheduler broke on it
                else:  # nothing names a culprit: the scheduler's state cannot be trusted
                    self._fail_all(internal_error(e))
        self._drain_inbox()  # submissions that raced the shutdown get their final delta too
        self._fail_all(None)

    def _fail_all(self, error: str | None) -> None:
        """Finish every queued, running and held request: failed with ``error`` when a step
        broke, aborted (``error`` None) at shutdown."""
        held = self.choices.release_all()
        for req in list(self.scheduler.running) + list(self.scheduler.waiting) + held:
            if req.finished:
                continue
            if error is None:
                self._finish(req, "abort")
            else:
                self._fail(req, FailureKind.INTERNAL, error)
        self._count_queued()

    def run_until_idle(self) -> None:
        """Drive steps on the caller's thread until nothing is queued (tests and offline use)."""
        while self.has_work():
            self.step()
