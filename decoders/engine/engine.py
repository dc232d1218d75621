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
from dataclasses import dataclass
from typing import Callable, Sequence

from .admission import Member, RunEstimator, StepSample, WaitEstimator
from .blocks import BlockPool
from .compile.tracing import TRACING
from .decoder import Decoder
from .detokenize import TextStream
from .grammar import Constraint, GrammarCompiler
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


class Engine:
    def __init__(self, config: EngineConfig, pool: BlockPool | None = None):
        self.config = config
        self.pool = pool or BlockPool(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, config.max_batched_tokens, config.max_waiting)
        self.decoders: dict[tuple[str, str], Decoder] = {}
        self.tokenizers: dict[str, object] = {}
        self.vocab_sizes: dict[str, int] = {}
        self.kv_namespaces: dict[tuple[str, str], str] = {}
        self._grammars: dict[str, GrammarCompiler] = {}  # per model; warmed off-thread by start()
        self._grammar_lock = threading.Lock()
        self.stats = EngineStats()
        # ("add" | "abort", a request) or ("call", work for the engine thread: ``remove_model``)
        self._inbox: deque[tuple[str, Request | Callable[[], object]]] = deque()
        self._wake = threading.Condition()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._requests: dict[str, list[Request]] = {}
        # n > 1: choices 1..n-1 wait until choice 0 has its prompt in the prefix cache,
        # then join and share those blocks instead of recomputing the prompt.
        self._held: dict[str, list[Request]] = {}
        self._num_held = 0
        self._unplanned: list[tuple[Request, str]] = []  # requests whose plan raised this step
        self._current: Request | None = None  # the request the scheduler is serving, while it schedules
        # Choices not yet running (waiting or held), as of the last step plus what the inbox took
        # in since; guarded by ``_wake``, so the server's thread never reads the scheduler's queues.
        self._num_queued = 0
        self._num_running = 0       # published with _num_queued, for estimated_wait
        self._freed = 0             # running choices finished this step (each freed a place)
        self.admission = WaitEstimator()  # guarded by ``_wake``
        self.run_bound = (RunEstimator(config.max_run_time, config.min_token_rate, config.max_batched_tokens)
                          if config.max_run_time else None)  # engine thread only
        self._held_back = False     # the run bound kept the queue's head waiting this step
        self._capacity = config.max_num_seqs  # places the engine lets run, for estimated_wait

    # ---- registration and lifecycle ------------------------------------------

    def add_decoder(self, model: str, decoder: Decoder, tokenizer, vocab_size: int | None = None) -> None:
        """Register ``decoder`` for ``model``; safe while the engine thread runs (a model loaded on
        first use): each map is replaced by a new one, never changed in place, so the engine thread
        and the server's threads always read a whole map."""
        # Prefix-cache namespace: decoders that read the same KV tensors (ar and eagle on one
        # runner) share cached blocks; another model's blocks are never a hit.
        kv_owner = decoder.kv_owner
        namespace = f"{model}/{type(kv_owner).__name__}@{id(kv_owner):x}"
        self.kv_namespaces = {**self.kv_namespaces, (model, decoder.name): namespace}
        self.tokenizers = {**self.tokenizers, model: tokenizer}
        # Only structured output needs it; a minimal tokenizer (tests, offline tools) may lack it.
        self.vocab_sizes = {**self.vocab_sizes, model: vocab_size or getattr(tokenizer, "vocab_size", 0)}
        self.decoders = {**self.decoders, (model, decoder.name): decoder}  # last: submit checks it first

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

        with self._wake:
            self._inbox.append(("call", work))
            self._wake.notify()
        while not done.wait(timeout=1.0):
            if not self._thread.is_alive():  # it stopped without taking the work: no step runs any more
                self._remove_model(model)
                return

    def _remove_model(self, model: str) -> None:
        held = [r for rs in self._held.values() for r in rs if r.model == model]
        for req in [r for r in list(self.scheduler.running) + list(self.scheduler.waiting) + held if r.model == model]:
            if not req.finished:
                self._finish(req, "abort")
        for rid in [rid for rid, rs in self._held.items() if rs and rs[0].model == model]:
            self._num_held -= len(self._held.pop(rid))
        keys = [key for key in self.decoders if key[0] == model]
        namespaces = {self.kv_namespaces[key] for key in keys}
        self.decoders = {k: d for k, d in self.decoders.items() if k[0] != model}
        self.kv_namespaces = {k: n for k, n in self.kv_namespaces.items() if k[0] != model}
        self.tokenizers = {m: t for m, t in self.tokenizers.items() if m != model}
        self.vocab_sizes = {m: v for m, v in self.vocab_sizes.items() if m != model}
        with self._grammar_lock:
            self._grammars.pop(model, None)
        self.pool.drop_namespaces(namespaces)

    def grammar_compiler(self, model: str) -> GrammarCompiler:
        with self._grammar_lock:
            if model not in self._grammars:
                self._grammars[model] = GrammarCompiler(self.tokenizers[model], self.vocab_sizes[model])
            return self._grammars[model]

    def _warm_grammars(self) -> None:
        """Index every model's vocabulary for structured output (about a second each) before the
        first structured request, off the server's event loop."""
        for model in list(self.tokenizers):
            try:
                self.grammar_compiler(model)
            except Exception:  # noqa: BLE001 - a tokenizer llguidance cannot index: built (and refused) on use
                log.debug("no grammar index for %s", model, exc_info=True)

    def decoders_for(self, model: str) -> list[str]:
        return [d for (m, d) in self.decoders if m == model]

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="dualserve-engine", daemon=True)
        self._thread.start()
        threading.Thread(target=self._warm_grammars, name="dualserve-grammars", daemon=True).start()

    def shutdown(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
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
        if (model, decoder) not in self.decoders:
            raise KeyError(f"model {model!r} has no decoder {decoder!r}")
        if not prompt_ids or params.max_tokens < 0 or n < 1:
            raise ValueError("a request needs a non-empty prompt, max_tokens >= 0 and n >= 1")
        if self.num_queued() + n > self.config.max_waiting:
            raise QueueFull("the waiting queue is full")
        if params.grammar and constraint is None:
            constraint = self.grammar_compiler(model).constraint(params.grammar)
        rid = request_id or f"req-{next(self._ids)}"
        tok = self.tokenizers[model]
        eos = frozenset(tok.eos_token_ids)
        reqs = []
        for i in range(n):
            stream = TextStream(tok, params.stop, skip_special_tokens=params.skip_special_tokens)
            reqs.append(Request(request_id=rid, prompt_ids=list(prompt_ids), params=params, decoder=decoder,
                                stream=stream, eos_token_ids=eos, sink=sink, model=model, index=i,
                                suffix_ids=list(suffix_ids),
                                constraint=constraint.copy() if constraint is not None and i else constraint))
            reqs[-1].table.namespace = self.kv_namespaces[(model, decoder)]
        with self._wake:
            if self._num_queued + n > self.config.max_waiting:  # rechecked: another thread may have queued
                raise QueueFull("the waiting queue is full")
            self._num_queued += n
            self._requests[rid] = reqs
            for r in reqs:
                self._inbox.append(("add", r))
            self._wake.notify()
        return rid

    def num_queued(self) -> int:
        """Choices submitted and not yet running (waiting, in the inbox, or held); safe from any thread."""
        with self._wake:
            return self._num_queued

    def capacity(self) -> int:
        """Choices the engine lets run now: ``max_num_seqs``, or the running count while the run
        bound holds the queue's head back; safe from any thread."""
        with self._wake:
            return self._capacity

    def snapshot(self) -> EngineSnapshot:
        """What the server's metrics read (``EngineSnapshot``); safe from any thread."""
        with self._wake:
            waiting, capacity = self._num_queued, self._capacity
        return EngineSnapshot(running=len(self.scheduler.running), waiting=waiting, capacity=capacity,
                              pool_blocks=self.pool.num_blocks, pool_usage=self.pool.usage(),
                              busy_seconds=self.stats.busy_seconds)

    def estimated_wait(self, n: int = 1) -> float:
        """Seconds until the last of ``n`` new choices would start (``admission.py``); any thread."""
        with self._wake:
            return self.admission.estimate(self._num_queued, self._num_running, self._capacity, n)

    def abort(self, request_id: str) -> None:
        with self._wake:
            for r in self._requests.get(request_id, []):
                self._inbox.append(("abort", r))
            self._wake.notify()

    # ---- the engine thread ---------------------------------------------------

    def _drain_inbox(self) -> None:
        with self._wake:
            items = list(self._inbox)
            self._inbox.clear()
        for kind, req in items:
            if kind == "call":  # work that must run on the engine thread (remove_model)
                req()
            elif kind == "add" and req.index > 0 and self.pool.enable_prefix_caching:
                self._held.setdefault(req.request_id, []).append(req)
                self._num_held += 1
            elif kind == "add":
                self.scheduler.add(req, bounded=False)  # submit already checked the bound
            elif not req.finished:
                held = self._held.get(req.request_id, [])
                if req in held:
                    held.remove(req)
                    self._num_held -= 1
                self._finish(req, "abort")
        self._release_held()

    def _release_held(self) -> None:
        """Let n > 1 choices join once choice 0 has computed (and so cached) its prompt."""
        for rid, held in list(self._held.items()):
            first = self._requests.get(rid, [None])[0]
            # Decoders that never publish prompt blocks (bidirectional diffusion) gain nothing by waiting.
            shares = first is not None and self.decoders[(first.model, first.decoder)].shares_prompt_blocks
            if (first is None or first.finished or not shares or first.num_computed >= len(first.prompt_ids)
                    or not held):
                for r in held:
                    if first is not None and r.needs_prompt_logprobs and not first.needs_prompt_logprobs:
                        r.prompt_logprobs = list(first.prompt_logprobs or [None])  # same prompt, same values
                    self.scheduler.add(r, bounded=False)  # counted against the bound at submit
                self._num_held -= len(held)
                del self._held[rid]

    def _finish(self, req: Request, reason: str) -> None:
        self.scheduler.remove(req)
        self._deliver(req, req.finish(reason))

    def _fail(self, req: Request, failure: FailureKind, error: str) -> None:
        """Finish ``req`` with finish_reason "error", saying what kind of failure and why."""
        self.scheduler.remove(req)
        self._deliver(req, req.fail(error, failure))

    def _deliver(self, req: Request, delta: Delta) -> None:
        if delta.finish_reason is not None:
            self._freed += req.admitted  # a running choice ends: its place is free (admission.py)
            req.status = Status.FINISHED
            delta.stats = req.decoder_stats()
            siblings = self._requests.get(req.request_id, [])
            if all(r.finished for r in siblings):
                self._requests.pop(req.request_id, None)
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
        after scheduling (``_unplanned``) while the others are scheduled as usual."""
        self._current = req  # named as the culprit if the scheduler breaks while serving it
        try:
            return self.decoders[(req.model, req.decoder)].plan(req, budget)
        except Exception as e:  # noqa: BLE001 - fail this request alone
            log.exception("plan failed for request %s", req.request_id)
            self._unplanned.append((req, internal_error(e)))
            return 0, 0

    def step(self) -> None:
        """One scheduling step; public so tests can drive the engine without its thread."""
        self._drain_inbox()
        self._expire_queued()
        started = time.perf_counter()
        self._held_back = False
        scheduled = self.scheduler.schedule(self._plan, self._may_start if self.run_bound else None)
        self._current = None
        for req, error in self._unplanned:
            if not req.finished:
                self._fail(req, FailureKind.INTERNAL, error)
        self._unplanned.clear()
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
        self._held_back |= not ok
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
        with self._wake:
            self._num_queued = len(self.scheduler.waiting) + self._num_held + sum(
                1 for kind, _ in self._inbox if kind == "add")
            self._num_running = len(self.scheduler.running)
            self._capacity = self._num_running if self._held_back else self.config.max_num_seqs
            if busy_seconds:  # a step without work (aborts only) keeps its finishes for the next
                self.admission.observe(busy_seconds, self._freed)
                self._freed = 0

    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._inbox) or bool(self._held)

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stop and not self._inbox and not self.scheduler.has_work and not self._held:
                    self._wake.wait()
                if self._stop:
                    break
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - the server must keep answering
                log.exception("engine step failed")
                culprit, self._current = self._current, None
                if culprit is not None and not culprit.finished:
                    self._fail(culprit, FailureKind.INTERNAL, internal_error(e))  # the scheduler broke on it
                else:  # nothing names a culprit: the scheduler's state cannot be trusted
                    self._fail_all(internal_error(e))
        self._drain_inbox()  # submissions that raced the shutdown get their final delta too
        self._fail_all(None)

    def _fail_all(self, error: str | None) -> None:
        """Finish every queued, running and held request: failed with ``error`` when a step
        broke, aborted (``error`` None) at shutdown."""
        held = [r for rs in self._held.values() for r in rs]
        self._held.clear()
        self._num_held = 0
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
