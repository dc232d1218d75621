"""The diffusion decoder: masked-diffusion LMs served over the shared paged KV pool.

One algorithm serves LLaDA (bidirectional, no logit shift), Dream (bidirectional, shifted
logits), block-diffusion models (block-causal attention: Fast-dLLM v2) and the AR twins
(block-causal, shifted). A request is one sequence ``[prefix | canvas | suffix]``:

- the **canvas** is ``max_tokens`` [MASK] positions after the prompt (the canvas budget);
- it is denoised **unit by unit**, left to right: LLaDA's semi-autoregressive blocks
  (``block_length``), or the sub-blocks of a block-causal model's attention blocks (Fast-dLLM
  v2's ``small_block_size``); ``block_length=None`` makes the canvas one unit (Dream);
- each step is ONE forward; for every masked position of the unit the decoder proposes a
  token, scores it, and the unmasking policy commits some (``policies.py``);
- which positions the forward computes and which cached keys/values it reads is the cache
  strategy's choice (``cache.py``);
- the **suffix** (``Request.suffix_ids``) is fixed right context: native infilling, for
  bidirectional models only.

Unmasked tokens are never remasked, so the left prefix of the canvas up to the first mask is
final: it goes out through ``Request.commit`` as soon as it grows, which applies EOS, stop
strings, max_tokens and logprobs exactly as for the AR decoder. A request stops the moment
``commit`` says it is finished (e.g. the first committed EOS), however much canvas is left.

Structured output (a grammar on the request): the canvas is decided left to right, so the
grammar's state is always the decided prefix. Tokens the grammar forces (a JSON schema's keys
and punctuation, the EOS after a finished document) are written into the canvas with no forward
(``_place_forced``); the model, which sees that skeleton within its attention block, denoises
the values: each step commits the first open position under the grammar's mask, then each next
adjacent one the unmasking policy picks while the grammar accepts it.

Shifted logits (Dream ``generation_utils.py``; Fast-dLLM v2 ``generate``): the token at
position p is read from the logits of row p - 1. In a block-causal model the first position of
an attention block is then predicted from the last row of the previous, finished block, which
sees only final tokens: an exact autoregressive prediction. Fast-dLLM v2's ``generate``
commits it at once (the token it appends after each block), and so does this decoder.

Batching: every scheduled request contributes its forward (ragged lengths, its own attention
mask and context) to one ``ModelRunner.forward`` per engine step, whatever phase it is in. A
request's samples come from its own generator, so the batch never changes its tokens.

Pool: every position of the sequence has its slot in the request's block table. A bidirectional
request reserves them all when it is admitted (each step may touch any); a block-causal one
reserves block by block. Keys/values that are exact (finished blocks of a block-causal model)
are published to the pool's prefix cache (under the runner's namespace), so later requests with
the same prefix start from them; they are never written again. Approximate ones (bidirectional
prefix/dual caches) are never published, so a bidirectional request never has a cache hit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from dualserve.models.attention import block_causal_mask
from dualserve.models.config import ModelConfig
from dualserve.models.loader import LoadedModel

from ..engine.blocks import BlockPool, BlockTable
from .cache import (CacheState, CacheStrategy, DualCache, ExactCache, Frame, NoCache, Work, advance,
                              prefill_chunk)
from .policies import Confidence, LinearSchedule, Policy, Schedule, Threshold, confidence, propose
from ..engine.grammar import Constraint
from ..engine.isolation import guard
from ..engine.request import DecoderCounters, DecoderState, Request
from ..engine.runner import ForwardItem, ModelRunner
from ..engine.sampling import TokenLogprob, process_logits, token_logprobs
from ..engine.scheduler import Scheduled


@dataclass(frozen=True)
class DiffusionConfig:
    """How a diffusion model is decoded: unit size x policy x schedule x cache strategy."""

    block_length: int | None = 32        # denoising unit; None: the whole canvas is one unit
    policy: Policy = Threshold(0.9)
    schedule: Schedule = LinearSchedule()
    cache: CacheStrategy = DualCache()
    confidence: Confidence = "prob"
    cfg_scale: float = 0.0               # classifier-free guidance (LLaDA generate.py); NoCache only

    def __post_init__(self) -> None:
        if self.block_length is not None and self.block_length <= 0:
            raise ValueError("block_length must be positive")
        if self.cfg_scale > 0 and not isinstance(self.cache, NoCache):
            raise ValueError("classifier-free guidance runs an unconditional copy; it needs cache=NoCache()")


def default_config(model: ModelConfig) -> DiffusionConfig:
    """Fast-dLLM's recommended settings: threshold 0.9 (or the one measured best for this
    checkpoint, when its config records one), dual cache / exact block cache."""
    policy = Threshold(model.diffusion_threshold or 0.9)
    if model.diffusion_block_size:
        return DiffusionConfig(block_length=min(8, model.diffusion_block_size), policy=policy, cache=ExactCache())
    return DiffusionConfig(block_length=32, policy=policy, cache=DualCache())


def unit_spans(start: int, end: int, block_length: int | None, attn_block: int | None) -> list[tuple[int, int]]:
    """Denoising units covering canvas positions [start, end).

    Bidirectional models: consecutive ``block_length`` spans from the canvas start (LLaDA).
    Block-causal models: attention blocks sit at multiples of ``attn_block``; each is cut into
    sub-blocks of ``block_length`` from its own start (Fast-dLLM v2), then clipped to the canvas.
    """
    if attn_block is None:
        step = block_length or max(end - start, 1)
        cuts = set(range(start, end, step))
    else:
        sub = min(block_length or attn_block, attn_block)
        first = start // attn_block * attn_block
        cuts = {p for b in range(first, end, attn_block) for p in range(b, b + attn_block, sub)}
    cuts = sorted({start, end} | {p for p in cuts if start < p < end})
    return list(zip(cuts[:-1], cuts[1:]))


@dataclass
class DiffusionCounters(DecoderCounters):
    """Per-request diffusion statistics (``Request.counters``)."""

    steps_per_block: list[int] = field(default_factory=list)  # forwards spent on each denoising unit

    def report(self) -> dict:
        return {"steps_per_block": self.steps_per_block} if self.steps_per_block else {}


@dataclass
class DiffusionState(DecoderState):
    """One request's decoding state (``Request.decoder_state``; dropped on preemption)."""

    start: int                      # first canvas position (= tokens known at admission)
    canvas_end: int
    tokens: torch.Tensor            # (prefix + canvas + suffix,) int64 on the CPU; masks where undecided
    units: list[tuple[int, int]]
    committed: int                  # positions before this went through Request.commit
    cache: CacheState = field(default_factory=CacheState)
    unit: int = 0                   # index of the unit being denoised
    unit_step: int = 0              # forwards spent on it
    counts: list[int] | None = None  # the schedule's per-step counts for it
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict)
    error: str | None = None

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])


# A canvas is sized by max_tokens, so a request that sets none must not get the whole context.
DEFAULT_MAX_TOKENS = 256


class DiffusionDecoder:
    """Block diffusion over the paged KV pool (a ``Decoder``)."""

    name = "diffusion"
    default_max_tokens = DEFAULT_MAX_TOKENS
    draft_choices = ()

    def __init__(self, runner: ModelRunner, pool: BlockPool, config: DiffusionConfig | None = None,
                 max_batched_tokens: int = 512, publish_blocks: bool = True):
        cfg = runner.config
        if cfg.mask_token_id is None:
            raise ValueError("a diffusion model needs a mask token id")
        self.runner = runner
        self.pool = pool
        self.config = config or default_config(cfg)
        self.max_batched_tokens = max_batched_tokens
        self.mask_id = cfg.mask_token_id
        self.shift = int(cfg.shift_logits)
        # A block-causal model declares its attention block; the others attend bidirectionally.
        self.attn_block = cfg.diffusion_block_size
        # Exact block keys/values may enter the prefix cache only if every pool block ends on an
        # attention-block boundary: a pool block's keys/values then depend on its own tokens only.
        self.publish = bool(publish_blocks and self.attn_block and pool.enable_prefix_caching
                            and pool.block_size % self.attn_block == 0)

    @property
    def kv_owner(self) -> ModelRunner:
        return self.runner

    @property
    def shares_prompt_blocks(self) -> bool:
        """Whether a request's prompt blocks reach the prefix cache (so n > 1 choices can share them)."""
        return self.publish

    @property
    def supports_infill(self) -> bool:
        """A suffix is visible to the canvas only under bidirectional attention."""
        return self.attn_block is None

    # ---- scheduling ------------------------------------------------------------

    def plan(self, req: Request, budget: int) -> tuple[int, int]:
        """Tokens the next forward computes, and slots to reserve for the rest of the sequence.

        Pure: a request without state yet is planned on the state ``step`` will make for it
        (with a copy of its grammar state), and ``step`` derives the same work again from the
        state and the granted token count."""
        if budget <= 0:
            return 0, 0
        st = req.decoder_state
        if st is None:
            st = self._new_state(req, req.constraint.copy() if req.constraint is not None else None)
        if st.error is not None or st.unit >= len(st.units):
            return 1, 0
        work = self._next_work(st, budget)
        if work is None:
            return 0, 0
        n = self._cost(work)
        # The pool reserves table.num_tokens (a prefix hit for an empty table) + n + lookahead
        # slots: ask for what the step touches. A bidirectional step touches the whole sequence;
        # a block-causal one nothing past its attention block, so long canvases grow block by
        # block. (Guidance over-reserves its copy.)
        extent = st.length if self.attn_block is None else max(b for _, b in (work.query, *work.context))
        base = self.pool.computed_tokens(req.table, req.all_ids, req.uses_prefix_cache)
        return n, max(0, extent - base - n)

    def _new_state(self, req: Request, constraint: Constraint | None) -> DiffusionState:
        """A request's state at admission; forced grammar tokens are placed by ``constraint``
        (the request's own in ``step``, a copy in ``plan``)."""
        prefix = req.all_ids
        start, size = len(prefix), max(req.remaining, 0)
        suffix = list(req.suffix_ids)
        tokens = torch.tensor(prefix + [self.mask_id] * size + suffix, dtype=torch.long)
        st = DiffusionState(start=start, canvas_end=start + size, tokens=tokens, committed=start,
                            units=unit_spans(start, start + size, self.config.block_length, self.attn_block))
        if suffix and not self.supports_infill:
            st.error = "infilling (suffix) needs a bidirectional diffusion model; this one is block-causal"
        elif req.needs_prompt_logprobs:
            st.error = "prompt logprobs need an autoregressive decoder"
        elif constraint is not None:
            # After preemption the grammar may have consumed canvas tokens never committed.
            uncommitted = constraint.consumed - len(req.output_ids)
            if uncommitted > 0:
                constraint.rollback(uncommitted)
            self._place_forced(req, st, constraint)
            self._skip_filled(st)
        if self.publish:
            # Prefix-cache hits hold exact keys/values of whole attention blocks (see __init__).
            st.cache.exact_upto = self.pool.computed_tokens(req.table, req.all_ids, req.uses_prefix_cache)
        return st

    def _frame(self, st: DiffusionState) -> Frame:
        us, ue = st.units[st.unit]
        # Row us - 1 is needed only while position us is masked (shifted logits).
        first_row = max(us - self.shift, 0) if int(st.tokens[us]) == self.mask_id else us
        if self.attn_block is None:
            return Frame((us, ue), st.length, 0, first_row)
        block_start = us // self.attn_block * self.attn_block
        return Frame((us, ue), min(block_start + self.attn_block, st.canvas_end), block_start, first_row)

    def _next_work(self, st: DiffusionState, budget: int) -> Work | None:
        frame = self._frame(st)
        work = self.config.cache.work(frame, st.cache, st.unit)
        if self._cost(work) <= budget:
            return work
        if self.attn_block:
            chunk = prefill_chunk(work, frame, st.cache, budget, self.attn_block)
            if chunk is not None:
                return chunk
        # A bidirectional span cannot be split: run it alone in a step with the whole budget.
        return work if budget >= self.max_batched_tokens else None

    def _cfg(self, work: Work) -> bool:
        return self.config.cfg_scale > 0 and not work.prefill_only

    def _cost(self, work: Work) -> int:
        """Tokens the forward computes for ``work`` (twice under guidance)."""
        return work.num_tokens * (2 if self._cfg(work) else 1)

    # ---- the step --------------------------------------------------------------

    def step(self, batch: Sequence[Scheduled], emit) -> None:
        live: list[tuple[Request, Work]] = []
        for s in batch:
            req = s.request
            if s.num_new_tokens <= 0:
                continue
            with guard(req, emit, "diffusion plan"):
                if req.decoder_state is None:
                    req.decoder_state = self._new_state(req, req.constraint)
                st: DiffusionState = req.decoder_state
                if st.error is not None or st.unit >= len(st.units):
                    delta = req.finish("error" if st.error else "length")
                    delta.error = st.error
                    emit(req, delta)
                    continue
                live.append((req, self._planned_work(st, s.num_new_tokens)))
        if not live:
            return
        items = [self._items(req, work) for req, work in live]
        hidden, _ = self.runner.forward([it for group in items for it in group])
        offset = 0
        for (req, work), group in zip(live, items):
            rows = []
            for it in group:
                rows.append(hidden[offset: offset + len(it.token_ids)])
                offset += len(it.token_ids)
            with guard(req, emit, "denoising"):
                self._after_forward(req, work, rows, emit)

    def _planned_work(self, st: DiffusionState, granted: int) -> Work:
        """The work ``plan`` sized: the same state within the granted tokens gives the same work
        (a whole span fits; a prefill chunk is whole attention blocks, so it is cut the same)."""
        work = self._next_work(st, granted)
        if work is None or self._cost(work) != granted:
            raise RuntimeError(f"diffusion step differs from its plan ({granted} tokens granted)")
        return work

    def _items(self, req: Request, work: Work) -> list[ForwardItem]:
        """The request's forward: its query span, plus the unconditional copy under guidance."""
        st: DiffusionState = req.decoder_state
        item = work_item(work, st.tokens, req.table, self.pool, self.attn_block, st.cache.exact_upto, self.runner)
        if not self._cfg(work):
            return [item]
        # LLaDA's unconditional input: every position that is not canvas becomes [MASK].
        a, b = work.query
        uncond = st.tokens[a:b].clone()
        pos = torch.arange(a, b)
        uncond[(pos < st.start) | (pos >= st.canvas_end)] = self.mask_id
        return [item, ForwardItem(uncond, range(a, b), 0, item.block_table, None, item.mask)]

    def _after_forward(self, req: Request, work: Work, rows: list[torch.Tensor], emit) -> None:
        st: DiffusionState = req.decoder_state
        frame = self._frame(st)
        req.num_forwards += 1
        advance(st.cache, work, frame, st.unit)
        if not work.prefill_only:
            self._denoise(req, st, rows, work.query[0])
            if self._commit(req, st, emit):
                return
        self._publish(req, st)

    @torch.inference_mode()
    def _denoise(self, req: Request, st: DiffusionState, rows: list[torch.Tensor], query_start: int) -> None:
        """One unmasking step of the current unit from this forward's hidden states."""
        us, ue = st.units[st.unit]
        masked = us + torch.nonzero(st.tokens[us:ue] == self.mask_id)[:, 0]  # (m,) positions
        if len(masked) == 0:  # filled by forced tokens since this forward was planned
            self._next_unit(req, st)
            return
        if st.counts is None:
            st.counts = self.config.schedule.counts(len(masked))
        idx = (masked - self.shift).clamp(min=0) - query_start  # rows predicting those positions
        raw = self.runner.logits(rows[0][idx.to(rows[0].device)])  # (m, vocab) fp32
        if len(rows) > 1:  # guidance: uncond + (s + 1) * (cond - uncond), LLaDA generate.py
            uncond = self.runner.logits(rows[1][idx.to(rows[1].device)])
            raw = uncond + (self.config.cfg_scale + 1) * (raw - uncond)
        chosen, tokens = self._choose(req, st, masked, raw)
        st.tokens[masked[chosen.cpu()]] = tokens[chosen].cpu()
        if req.params.logprobs is not None:
            lps = token_logprobs(raw[chosen], tokens[chosen].tolist(), req.params.logprobs)
            st.logprobs.update(zip(masked[chosen.cpu()].tolist(), lps))
        st.unit_step += 1
        if req.constraint is not None:
            self._place_forced(req, st, req.constraint)
        if not bool((st.tokens[us:ue] == self.mask_id).any()):
            self._next_unit(req, st)

    def _next_unit(self, req: Request, st: DiffusionState) -> None:
        req.counters_of(DiffusionCounters).steps_per_block.append(st.unit_step)
        st.unit, st.unit_step, st.counts = st.unit + 1, 0, None
        self._skip_filled(st)

    def _skip_filled(self, st: DiffusionState) -> None:
        """Units that forced tokens filled need no forward of their own: the next forward
        computes their keys/values with its span (``cache._exact_span``)."""
        while st.unit < len(st.units):
            us, ue = st.units[st.unit]
            if bool((st.tokens[us:ue] == self.mask_id).any()):
                return
            st.unit, st.unit_step, st.counts = st.unit + 1, 0, None

    # ---- structured output: a grammar's skeleton, values denoised ---------------

    def _place_forced(self, req: Request, st: DiffusionState, constraint: Constraint) -> None:
        """Write the tokens the grammar forces after the decided prefix straight into the canvas.

        Under a grammar the canvas is decided left to right, so the decided prefix is exactly
        what the grammar has consumed. For a JSON schema the forced tokens are the keys and
        punctuation between values: the skeleton, placed with no forward; the model denoises
        only the values (``_choose_constrained``), seeing the skeleton ahead of them within
        its attention block."""
        holes = torch.nonzero(st.tokens[st.start:st.canvas_end] == self.mask_id)
        pos = st.start + int(holes[0, 0]) if len(holes) else st.canvas_end
        # Every position from the first hole on is still masked (decisions go left to right).
        while pos < st.canvas_end and (forced := constraint.forced()):
            forced = forced[: st.canvas_end - pos]
            constraint.consume_prefix(forced)
            st.tokens[pos:pos + len(forced)] = torch.tensor(forced)
            if req.params.logprobs is not None:
                # No forward saw these tokens; under the grammar they had probability 1.
                st.logprobs.update((pos + i, TokenLogprob(t, 0.0, [(t, 0.0)])) for i, t in enumerate(forced))
            pos += len(forced)

    def _choose(self, req: Request, st: DiffusionState, masked: torch.Tensor,
                raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices into ``masked`` to commit, proposed token per masked position)."""
        params = req.params
        logits = raw.clone()
        logits[:, self.mask_id] = float("-inf")  # [MASK] is never an answer
        if params.needs_processing:
            # Penalties count committed tokens only: the canvas is not output yet.
            penalties = req.penalty_state(logits.shape[-1], logits.device)
            logits = torch.stack([process_logits(row, req.prompt_ids, req.output_ids, params, penalties)
                                  for row in logits])
        if req.constraint is not None:
            logits[0] = req.constraint.mask_logits(logits[0])
        tokens = propose(logits, params, req.generator)
        conf = confidence(self.config.confidence, torch.softmax(logits, -1), tokens, req.generator)
        k = st.counts[st.unit_step] if st.unit_step < len(st.counts) else len(masked)
        chosen = self.config.policy.select(conf, k)
        if req.constraint is not None:
            return self._choose_constrained(req, masked, chosen, tokens), tokens
        if self._anchored(int(masked[0])):
            chosen = torch.unique(torch.cat([chosen, chosen.new_zeros(1)]))
        return chosen, tokens

    @staticmethod
    def _choose_constrained(req: Request, masked: torch.Tensor, chosen: torch.Tensor,
                            tokens: torch.Tensor) -> torch.Tensor:
        """Under a grammar: the first hole always (its logits were masked by the grammar), then
        each next adjacent hole while the policy chose it and the grammar accepts its token.

        Committing a left-to-right run keeps the grammar's state a plain prefix, and every
        committed token is one the grammar allows, so the output always parses."""
        picked = set(chosen.tolist())
        run = 1
        while run < len(masked) and int(masked[run]) == int(masked[run - 1]) + 1 and run in picked:
            run += 1
        taken = req.constraint.consume_prefix(tokens[:run].tolist())
        return torch.arange(max(taken, 1))

    def _anchored(self, pos: int) -> bool:
        """Whether ``pos`` is predicted from a finished block's last row (an exact AR prediction)."""
        return bool(self.shift and self.attn_block and pos % self.attn_block == 0 and pos > 0)

    def _commit(self, req: Request, st: DiffusionState, emit) -> bool:
        """Stream the newly final left prefix of the canvas; True when the request finished."""
        canvas = st.tokens[st.committed:st.canvas_end]
        holes = torch.nonzero(canvas == self.mask_id)
        end = st.committed + (int(holes[0, 0]) if len(holes) else len(canvas))
        if end == st.committed:
            return False
        tokens = st.tokens[st.committed:end].tolist()
        lps = [st.logprobs.pop(p) for p in range(st.committed, end)] if req.params.logprobs is not None else None
        st.committed = end
        delta = req.commit(tokens, lps)
        emit(req, delta)
        return delta.finish_reason is not None

    def _publish(self, req: Request, st: DiffusionState) -> None:
        """Offer exact finished-block keys/values to the prefix cache (see ``__init__``)."""
        if not self.publish:
            return
        n = min(st.cache.exact_upto, len(req.all_ids))
        if n > req.table.num_tokens:
            self.pool.mark_written(req.table, req.all_ids, n)


def work_item(work: Work, tokens: torch.Tensor, table: BlockTable, pool: BlockPool, attn_block: int | None,
              exact_upto: int = 0, runner: ModelRunner | None = None) -> ForwardItem:
    """The ``ForwardItem`` that carries out ``work`` for a sequence of ``tokens`` (all positions).

    Queries attend to each other fully (bidirectional models) or block-causally, with blocks
    aligned to absolute positions; every context position is visible to every query. Queries
    before ``exact_upto`` (a shifted row recomputed for its logits) are not stored: those slots
    hold exact keys/values already, possibly in blocks other requests share: their keys/values
    go to the ``runner``'s scratch slots.
    """
    a, b = work.query
    context_slots = None
    if work.context and work.context != ((0, work.context_len),):
        # Not a plain prefix (dual cache): name the slots; a prefix is read through the block table.
        slots = [s for lo, hi in work.context for s in pool.slot_mapping(table, lo, hi)]
        context_slots = torch.tensor(slots, dtype=torch.long)
    mask = "bidirectional" if attn_block is None else block_causal_mask(b - a, attn_block, offset=a)
    store = None
    if work.store:
        keep = min(max(exact_upto - a, 0), b - a)
        scratch = runner.scratch_slots(keep).tolist() if keep else []
        store = scratch + pool.slot_mapping(table, a + keep, b)
    return ForwardItem(tokens[a:b], range(a, b), work.context_len, table.blocks, store, mask, context_slots)


def register_diffusion(engine, model_name: str, runner: ModelRunner, loaded: LoadedModel,
                       config: DiffusionConfig | None = None, publish_blocks: bool = True) -> DiffusionDecoder:
    """Add the ``diffusion`` decoder for ``model_name`` (a diffusion-family model or an AR twin)."""
    decoder = DiffusionDecoder(runner, engine.pool, config or default_config(loaded.config),
                               max_batched_tokens=engine.config.max_batched_tokens, publish_blocks=publish_blocks)
    engine.add_decoder(model_name, decoder, loaded.tokenizer, loaded.config.vocab_size)
    return decoder
