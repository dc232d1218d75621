"""The scheduler: waiting and running queues over the one shared block pool.

Each step it decides which requests run and how many tokens each computes,
under two budgets: a token budget per step (so a long prompt is prefilled in
chunks while decodes keep flowing) and the block pool. Running requests go
first, oldest first; when the pool is exhausted the youngest running request is
preempted: its blocks are freed and it goes back to the front of the waiting
queue to be recomputed later (vLLM's "recompute" preemption). Its emitted
tokens are kept, so nothing a client saw is lost or repeated.

How many tokens a request wants is its decoder's business (``plan``): one for
an AR decode, the tree size for an EAGLE step, a canvas for diffusion.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from .block_manager import BlockPool, NoFreeBlocks
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

    def add(self, req: Request) -> None:
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests are already waiting")
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _try_allocate(self, item: Scheduled) -> bool:
        req = item.request
        try:
            self.pool.allocate(req.table, req.all_ids, item.num_new_tokens, item.num_lookahead)
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

    def schedule(self, plan: Planner) -> list[Scheduled]:
        budget = self.max_batched_tokens
        out: list[Scheduled] = []
        for req in list(self.running):
            if req not in self.running:
                continue  # preempted below by an older request
            n, lookahead = plan(req, budget)
            if n <= 0 and lookahead <= 0:
                continue
            item = Scheduled(req, n, lookahead)
            while not self._try_allocate(item):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is req:
                    break
            else:
                out.append(item)
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n, lookahead = plan(req, budget)
            if n <= 0:
                break
            item = Scheduled(req, n, lookahead)
            if not self._try_allocate(item):
                if not self.running and not out:
                    # Nothing else holds memory: the request can never fit.
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
