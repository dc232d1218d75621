"""Plain autoregressive decoding over the paged KV pool.

Each step every scheduled request computes a span of tokens: a prompt chunk
(prefill) or the one token sampled last step (decode). All spans go through a
single forward; requests whose span reaches their last known token sample the
next one. This is continuous batching (Orca, Yu et al., OSDI 2022): requests join
and leave between steps, and the batch shape never changes a request's tokens.

Sampling stays per request where it must (bias, penalties, grammar masks, and a
uniform keyed by the request's seed and the output position, so a seeded sample
does not depend on the batch) and batched where it can: plain greedy rows share
one argmax. A request that wants prompt logprobs (echo with logprobs) gets
logits over its prompt positions during prefill; it skips the prefix cache
until they are all computed, since cached positions would have none.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import torch

from .engine.blocks import BlockPool
from .engine.isolation import guard
from .engine.request import Request
from .engine.runner import ForwardItem, ModelRunner
from .engine.sampling import argmax, keyed_uniform, process_logits, sample_token, token_logprobs
from .engine.scheduler import Scheduled

# Logit rows computed at a time for prompt logprobs: bounds the (rows, vocab) fp32 buffer.
PROMPT_LOGPROB_ROWS = 128


def pending_tokens(req: Request, pool: BlockPool) -> int:
    """Tokens whose KV is not yet computed, counting a prefix-cache hit for a fresh table."""
    return req.num_tokens - pool.computed_tokens(req.table, req.all_ids, req.uses_prefix_cache)


def span_items(batch: Sequence[Scheduled], pool: BlockPool) -> list[ForwardItem]:
    items = []
    for s in batch:
        req, start = s.request, s.request.num_computed
        end = start + s.num_new_tokens
        items.append(ForwardItem(
            token_ids=req.all_ids[start:end], positions=range(start, end), context_len=start,
            block_table=req.table.blocks, slots=pool.slot_mapping(req.table, start, end)))
    return items


def sample_one(row: torch.Tensor, req: Request) -> int:
    """One token from one request's raw logits row (vocab,): bias, penalties, grammar, then sample."""
    penalties = req.penalty_state(row.shape[-1], row.device)
    processed = process_logits(row, req.prompt_ids, req.output_ids, req.params, penalties)
    if req.constraint is not None:
        processed = req.constraint.mask_logits(processed)
    tok = sample_token(processed, req.params, keyed_uniform(req.seed, len(req.output_ids)))
    if req.constraint is not None:
        req.constraint.consume(tok)
    return tok


def sample_and_emit(reqs: Sequence[Request], logits: torch.Tensor, emit) -> None:
    """Sample one token per request from its logits row (len(reqs), vocab) and commit it; a
    request whose sampling, grammar or commit raises is failed alone (``guard``)."""
    tokens: list[int | None] = [None] * len(reqs)
    # Plain greedy rows (the common case) share one argmax; argmax is exact, so this
    # gives the same tokens as row by row.
    plain = [i for i, r in enumerate(reqs)
             if r.params.greedy and not r.params.needs_processing and r.constraint is None]
    if plain:
        # All rows plain (a batch of greedy decodes) read the logits in place: a copy of 16 rows
        # of a 49k vocabulary costs about as much as their argmax.
        for i, tok in zip(plain, argmax(logits if len(plain) == len(reqs) else logits[plain])):
            tokens[i] = tok
    for i, req in enumerate(reqs):
        with guard(req, emit, "sampling"):
            tok = tokens[i] if tokens[i] is not None else sample_one(logits[i], req)
            lp = None
            if req.params.logprobs is not None:
                lp = token_logprobs(logits[i: i + 1], [tok], req.params.logprobs)
            emit(req, req.commit([tok], lp))


def fill_prompt_logprobs(runner: ModelRunner, req: Request, hidden: torch.Tensor, start: int) -> None:
    """Logprobs of the prompt tokens a prefill span predicts.

    hidden: (span, hidden) for positions start, start + 1, ...; position p predicts
    prompt token p + 1. Spans arrive in order from position 0 (the prefix cache is
    bypassed while these are missing), so entries up to ``start`` are already there.
    """
    prompt = req.prompt_ids
    end = min(start + hidden.shape[0], len(prompt) - 1)
    found = []
    for lo in range(start, end, PROMPT_LOGPROB_ROWS):
        hi = min(lo + PROMPT_LOGPROB_ROWS, end)
        logits = runner.logits(hidden[lo - start: hi - start])  # (rows, vocab)
        found += token_logprobs(logits, prompt[lo + 1: hi + 1], req.params.logprobs or 0)
    del req.prompt_logprobs[start + 1:]
    req.prompt_logprobs.extend(found)


class ARDecoder:
    """Plain autoregressive decoding (a ``Decoder``)."""

    name = "ar"
    shares_prompt_blocks = True
    supports_infill = False
    default_max_tokens = None
    draft_choices = ()

    def __init__(self, runner: ModelRunner, pool: BlockPool):
        self.runner = runner
        self.pool = pool

    @property
    def kv_owner(self) -> ModelRunner:
        return self.runner

    def plan(self, req: Request, budget: int) -> tuple[int, int]:
        return min(pending_tokens(req, self.pool), budget), 0

    def step(self, batch: Sequence[Scheduled], emit) -> None:
        batch = [s for s in batch if s.num_new_tokens > 0]
        if not batch:
            return
        hidden, _ = self.runner.forward(span_items(batch, self.pool))
        ends = list(itertools.accumulate(s.num_new_tokens for s in batch))  # each span's end row
        # Requests whose span reaches their last known token sample the next one. Their logits are
        # the step's last shared computation, made before any request's state changes: if it
        # raises, the engine retries the batch as it was (isolation.py).
        ready = [i for i, s in enumerate(batch)
                 if s.request.num_computed + s.num_new_tokens == s.request.num_tokens]
        logits = self.runner.logits(hidden[[ends[i] - 1 for i in ready]]) if ready else None  # (ready, vocab)
        for s, end in zip(batch, ends):
            req, n = s.request, s.num_new_tokens
            start = req.num_computed
            with guard(req, emit, "prefill"):
                if req.needs_prompt_logprobs:
                    fill_prompt_logprobs(self.runner, req, hidden[end - n: end], start)
                self.pool.mark_written(req.table, req.all_ids, start + n)
                req.num_forwards += 1
        live = [j for j, i in enumerate(ready) if not batch[i].request.finished]
        if live:
            sample_and_emit([batch[ready[j]].request for j in live],
                            logits if len(live) == len(ready) else logits[live], emit)
