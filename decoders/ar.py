"""Plain autoregressive decoding over the paged KV pool.

Each step every scheduled request computes a span of tokens: a prompt chunk
(prefill) or the one token sampled last step (decode). All spans go through a
single forward; requests whose span reaches their last known token sample the
next one. This is continuous batching (Orca, Yu et al., OSDI 2022): requests join
and leave between steps, and the batch shape never changes a request's tokens.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .block_manager import BlockPool
from .request import Request
from .runner import ForwardItem, ModelRunner
from .sampling import process_logits, sample_token, token_logprobs
from .scheduler import Scheduled


def pending_tokens(req: Request, pool: BlockPool) -> int:
    """Tokens whose KV is not yet computed, counting a prefix-cache hit for a fresh table."""
    computed = req.num_computed
    if not req.table.blocks:
        computed = pool.match_prefix(req.all_ids)[1]
    return req.num_tokens - computed


def span_items(batch: Sequence[Scheduled], pool: BlockPool) -> list[ForwardItem]:
    items = []
    for s in batch:
        req, start = s.request, s.request.num_computed
        end = start + s.num_new_tokens
        items.append(ForwardItem(
            token_ids=req.all_ids[start:end], positions=range(start, end), context_len=start,
            block_table=req.table.blocks, slots=pool.slot_mapping(req.table, start, end)))
    return items


def sample_next(runner: ModelRunner, reqs: Sequence[Request], hidden: torch.Tensor):
    """Sample one token per request from its last hidden state; returns [(token, logprob or None)]."""
    logits = runner.logits(hidden)  # (len(reqs), vocab)
    out = []
    for row, req in zip(logits, reqs):
        processed = process_logits(row, req.prompt_ids, req.output_ids, req.params)
        tok = sample_token(processed, req.params, req.generator)
        lp = None
        if req.params.logprobs is not None:
            lp = token_logprobs(row[None], [tok], req.params.logprobs)
        out.append((tok, lp))
    return out


class ARDecoder:
    name = "ar"

    def __init__(self, runner: ModelRunner, pool: BlockPool):
        self.runner = runner
        self.pool = pool

    def plan(self, req: Request, budget: int) -> tuple[int, int]:
        return min(pending_tokens(req, self.pool), budget), 0

    def step(self, batch: Sequence[Scheduled], emit) -> None:
        batch = [s for s in batch if s.num_new_tokens > 0]
        if not batch:
            return
        hidden, _ = self.runner.forward(span_items(batch, self.pool))
        last_rows, ready = [], []
        offset = 0
        for s in batch:
            req = s.request
            offset += s.num_new_tokens
            done = req.num_computed + s.num_new_tokens
            self.pool.commit(req.table, req.all_ids, done)
            req.num_forwards += 1
            if done == req.num_tokens:
                last_rows.append(offset - 1)
                ready.append(req)
        if not ready:
            return
        for req, (tok, lp) in zip(ready, sample_next(self.runner, ready, hidden[last_rows])):
            emit(req, req.commit([tok], lp))
