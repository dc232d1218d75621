"""The scheduler: waiting and running queues over the one shared block pool.

Each step it decides which requests run and how many tokens each computes,
under two budgets: a token budget per step (so a long prompt is prefilled in
chunks while decodes keep flowing) and the block pool. Running requests go
first (those already generating before those still prefilling, each group
oldest first), then waiting ones in arrival order. While requests wait to be
admitted, prompts still prefilling leave a share of the token budget
(``admission_reserve``) for them, so a short request sent beside a long prefill
starts within one step instead of after the whole prompt. When the pool is
exhausted the youngest running request that has no work yet this step is preempted: its
blocks are freed and it goes back to the front of the waiting queue to be
recomputed later (vLLM's "recompute" preemption). Its emitted tokens are kept,
so nothing a client saw is lost or repeated; full blocks it had written stay in
the prefix cache, so the recompute often starts from a cache hit. No new request
is admitted in a step that preempted.

The engine may also hold a waiting request back while starting it would slow the
running ones past the finish times they were promised (``may_start``, the run
bound in ``admission.py``).

How many tokens a request wants is its decoder's business (``plan``): one for
an AR decode, the tree size for an EAGLE step, a canvas for diffusion.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from .blocks import BlockPool, NoFreeBlocks
from .request import Request, Status

# (request, token budget left) -> (new tokens to compute this step, lookahead slots to reserve)
Planner = Callable[[Request, int], tuple[int, int]]


class QueueFull(Exception):
    """The bounded waiting queue is full; the server answers 429 with Retry-After."""


@dataclass
class Scheduled:
    request: Request
    num_new_tokens: int
    num_lookahead: int = 0


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int = 64, max_batched_tokens: int = 512,
                 max_waiting: int = 256):
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.max_waiting = max_waiting
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request, bounded: bool = True) -> None:
        """Queue a request; ``bounded=False`` for one already counted against the bound (held n > 1 choices)."""
        if bounded and len(self.waiting) >= self.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests are already waiting")
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _try_allocate(self, item: Scheduled) -> bool:
        req = item.request
        try:
            self.pool.allocate(req.table, req.all_ids, item.num_new_tokens, item.num_lookahead,
                               use_prefix_cache=req.uses_prefix_cache)
            return True
        except NoFreeBlocks:
            return False

    def preempt(self, req: Request) -> None:
        self.pool.free(req.table)
        req.status = Status.WAITING
        req.num_preemptions += 1
        req.decoder_state = None
        self.num_preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)

    def _victim(self, scheduled: set[int]) -> Request | None:
        """The youngest running request not yet given work this step."""
        for req in reversed(self.running):
            if id(req) not in scheduled:
                return req
        return None

    @property
    def admission_reserve(self) -> int:
        """Tokens a step keeps from prefilling prompts for waiting requests: a quarter of the budget
        while any wait and there is room to admit them (vLLM caps long prefills the same way,
        ``long_prefill_token_threshold``)."""
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return 0
        return self.max_batched_tokens // 4

    def _plan_running(self, plan: Planner, req: Request, budget: int, reserve: int) -> tuple[int, int]:
        """A running request's work; one still prefilling leaves ``reserve`` tokens, unless its next
        piece cannot be split (a bidirectional diffusion span), which then takes the whole budget."""
        if req.output_ids or not reserve:
            return plan(req, budget)
        n, lookahead = plan(req, budget - reserve) if budget > reserve else (0, 0)
        if n <= 0 and lookahead <= 0 and budget >= self.max_batched_tokens:
            return plan(req, budget)
        return n, lookahead

    def _schedule_running(self, plan: Planner, out: list[Scheduled]) -> tuple[int, bool]:
        """Give running requests their work; returns (token budget left, whether any was preempted)."""
        budget = self.max_batched_tokens
        reserve = self.admission_reserve
        scheduled: set[int] = set()
        preempted = False
        # Requests already generating go first: their steps are small, and a long
        # prompt's prefill chunk must not hold back every decode queued behind it.
        order = [r for r in self.running if r.output_ids] + [r for r in self.running if not r.output_ids]
        for req in order:
            if req.status is not Status.RUNNING:
                continue  # preempted for an older request earlier in this step
            n, lookahead = self._plan_running(plan, req, budget, reserve)
            if n <= 0 and lookahead <= 0:
                continue
            item = Scheduled(req, n, lookahead)
            while not self._try_allocate(item):
                # Only requests without work this step may lose their blocks; req itself is one.
                victim = self._victim(scheduled)
                self.preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                out.append(item)
                scheduled.add(id(req))
                budget -= n
        return budget, preempted

    def schedule(self, plan: Planner, may_start: Callable[[Request], bool] | None = None) -> list[Scheduled]:
        """This step's work. ``may_start``: whether the head of the waiting queue may start beside
        the running requests (the engine's run bound, ``admission.py``); while it may not, nobody
        behind it starts either (arrival order), and it waits."""
        out: list[Scheduled] = []
        budget, preempted = self._schedule_running(plan, out)
        if preempted:
            # Memory is short: admitting now would only preempt again (as in vLLM
            # v1, vllm/v1/core/sched/scheduler.py, which skips waiting requests after a preemption).
            return out
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if may_start is not None and not may_start(req):
                break
            n, lookahead = plan(req, budget)
            if n <= 0:
                break
            item = Scheduled(req, n, lookahead)
            if not self._try_allocate(item):
                if not self.running and not out:
                    # Nothing else holds memory: the request can never fit. The engine fails it
                    # (FailureKind.CAPACITY) when it finds it finished in the step's list.
                    self.waiting.popleft()
                    req.finish_reason = "error"
                    req.status = Status.FINISHED
                    out.append(Scheduled(req, 0))
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            out.append(item)
            budget -= n
        return out

    def remove(self, req: Request) -> None:
        """Forget a finished or aborted request and return its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.pool.free(req.table)
        req.status = Status.FINISHED
