"""EAGLE speculative decoding over the shared paged KV pool.

A step of an EAGLE request (Li et al., EAGLE-1/2/3; the tree rules live in
``tree.py``):

  1. **catch up**: the request's model source (``drafters.py``: an EAGLE head, or a
     DFlash block-diffusion drafter) consumes the target features of positions it
     has not seen (the prompt after prefill, then each step's accepted tokens),
     writing its own KV at those positions' slots;
  2. **draft**: from the last committed token (the "root"), the head grows an
     EAGLE-2 tree (or a chain) level by level, or the drafter proposes a block in
     one forward; draft nodes live in scratch tensors. Suffix
     lookup (``suffix.py``) drafts continuations of the prompt, the output so far
     and earlier outputs; both trees merge into one (shared prefixes once). How
     deep each source drafts, or whether to draft at all, is set per step from the
     host's measured verify cost and the request's running acceptance (``budget.py``);
     the head catches up only on steps it drafts;
  3. **verify**: ONE target forward over root + tree with a tree attention mask
     on top of the paged KV, writing into the request's lookahead slots (the
     scheduler reserved them from ``plan``), capturing the features EAGLE needs;
  4. **accept**: greedy longest match or lossless rejection sampling, plus the
     target's bonus token; the accepted nodes' KV moves into place
     (``ModelRunner.move_slots``), rejected slots go back to the pool
     (``BlockPool.truncate``), and tokens go out through ``Request.commit``,
     which alone applies EOS, stop strings and max_tokens.

Prefill is plain chunked target computation, as ``ar`` runs it; the last row of
the last chunk is the first root's verify step (a tree of the root alone), so
the first token comes out of the same forward as ``ar``'s, and every emitted
token comes out of a verify step: the output equals plain AR decoding token for
token at temperature 0, and in distribution otherwise.

The head's KV is a ``KVCache`` with the head's own layer count, indexed by the
SAME block tables as the target's: a request's blocks hold both. Positions whose
blocks came from the prefix cache have no head KV (another decoder may have
written them), so the head attends only from where this request started
computing; drafts get a shorter context there, results stay exact.

Sources per request: ``SamplingParams.draft`` ("auto" or "both": the preferred model
and suffix lookup; "head" or "block": that model alone; "suffix"). Without a model,
``eagle`` drafts from suffix lookup alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

import torch

from dualserve.models.assets import default_eagle_head
from dualserve.models.dflash import DFlashDrafter, is_dflash, load_dflash
from dualserve.models.eagle import EagleHead, load_eagle_head
from dualserve.models.loader import LoadedModel

from ..ar import fill_prompt_logprobs
from ..engine.blocks import BlockPool, slot_of
from ..engine.isolation import guard
from ..engine.request import DecoderCounters, DecoderState, Request
from ..engine.runner import ForwardItem, ModelRunner
from ..engine.sampling import DRAFT_CHOICES, process_logits, token_logprobs, truncated_probs
from ..engine.scheduler import Scheduled
from .drafters import BlockDrafter, HeadDrafter
from .budget import NO_DRAFT, PRIOR_RATE, Batch, Budget, CostCurve, Offer, Source, SourceRate, choose_budget
from .suffix import SuffixConfig, SuffixDraft, SuffixDrafter, TokenIndex
from .tree import DraftTree, TreeConfig, accept_greedy, accept_sampled, merge_trees, path_logits, source_outcome

# CPU: measured with the bundled SmolLM2 head (clients/bench_eagle.py). On an AVX2
# CPU a forward over 2..8 tokens costs about twice a 1-token forward (GEMM packs
# the weights, GEMV streams them), so small trees win until acceptance is high.
CPU_TREE = TreeConfig(depth=3, top_k=2, num_nodes=4)
# GPU: verify cost is flat in tree size at batch 1; upstream EAGLE-2's evaluation
# setting (depth 5, top-k 10, 60 tokens) scaled to a small target. Not yet measured.
GPU_TREE = TreeConfig(depth=5, top_k=8, num_nodes=48)
# Suffix drafts: the most nodes and the deepest path offered per step (the budget picks less).
SUFFIX_NODES = 16
# A model source the budget has left unused for this many of a request's steps drafts one level,
# so its acceptance keeps being measured: a source whose prior says it cannot pay would otherwise
# never be tried, however good it is. The probe costs one extra token in one step of this many.
EXPLORE_AFTER = 32
# Weight of one request-step's outcome in the decoder-wide rate that seeds new requests' rates.
LEARNED_EMA = 0.05
# Features waiting for the model source: past this many the source catches up even on a step it
# does not draft, so a request drafting from suffix alone does not hold features for its whole
# output; if the source has been idle for EXPLORE_AFTER steps they are dropped instead and its
# context restarts there (as after a prefix-cache hit: drafts see less, output stays exact), so a
# source that does not pay, as at a large batch, costs no catch-up forwards.
MAX_PENDING = 64
# Verification's output-head rows per level up to which each request also computes its likely next
# nodes ahead (``tree.path_logits``): below this the product is memory-bound on a CPU.
GUESS_ROWS = 4


@dataclass
class EagleState(DecoderState):
    """Per-request draft state (``Request.decoder_state``; reset to None on preemption)."""

    head_start: int              # first position with draft KV (earlier ones came from the prefix cache)
    head_len: int                # draft KV covers positions head_start <= j < head_len (the head: pairs
                                 # (feature j, token j+1); a DFlash drafter: feature j)
    pending: torch.Tensor        # (n, raw width) raw features of positions head_len .. head_len + n - 1
    model: Source | None = None  # the model source this request drafts from: "head", "block" or none
    model_idle: int = 0          # steps since the model source last drafted
    last_hidden: torch.Tensor | None = None  # head output at the newest pair: predicts the root's child
    index: TokenIndex = field(default_factory=TokenIndex)  # prompt + output, for suffix drafts
    # This step's budget and suffix draft, made by plan for the request at this many tokens.
    planned: tuple[int, Budget, SuffixDraft | None] | None = None


@dataclass
class EagleCounters(DecoderCounters):
    """Per-request EAGLE statistics (``Request.counters``)."""

    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted per verify step
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    plain_steps: int = 0         # verify steps that drafted nothing (the budget said drafting cannot pay)
    rates: dict[Source, SourceRate] = field(
        default_factory=lambda: {s: SourceRate(p) for s, p in PRIOR_RATE.items()})
    drafted: dict[Source, int] = field(default_factory=dict)   # steps each source drafted in
    accepted: dict[Source, int] = field(default_factory=dict)  # its drafted tokens accepted in all

    def report(self) -> dict:
        if not self.accept_lengths:
            return {}
        out = {"mean_accept_length": round(sum(self.accept_lengths) / len(self.accept_lengths), 3),
               "draft_seconds": round(self.draft_seconds, 4), "verify_seconds": round(self.verify_seconds, 4),
               "plain_steps": self.plain_steps}
        for source, steps in self.drafted.items():  # accepted drafted tokens per step that drafted from it
            out[f"{source}_accept_length"] = round(self.accepted.get(source, 0) / steps, 3)
            out[f"{source}_steps"] = steps
        return out


# Bit of each source in ``DraftTree.sources``: the order trees are merged in ("head": the request's
# model source, the EAGLE head or the DFlash drafter).
SOURCE_BITS: dict[Source, int] = {"head": 0, "suffix": 1}


class EagleDecoder:
    """Speculative decoding on the target's runner (a ``Decoder``): EAGLE head and suffix drafts."""

    name = "eagle"
    shares_prompt_blocks = True
    supports_infill = False
    default_max_tokens = None

    def __init__(self, runner: ModelRunner, pool: BlockPool, head: EagleHead | DFlashDrafter | None,
                 tree: TreeConfig | None = None, suffix: SuffixConfig | None = SuffixConfig(),
                 cost: CostCurve | None = None, block: DFlashDrafter | None = None, prefer: Source | None = None):
        """``head`` and ``block``: the model draft sources (``drafters.py``), an EAGLE head and a DFlash
        drafter, either or both (a DFlash drafter passed as ``head`` is the block source); none:
        suffix drafts alone. A request drafts from the one its ``draft`` field names, else from
        ``prefer`` (default: the head if loaded). ``suffix`` None: models alone. ``cost`` None: every
        step drafts the whole tree from each source; a ``CostCurve``: ``choose_budget`` sizes each
        step, down to no draft at all, and the curve learns from the verify forwards."""
        models = [m for m in (head, block) if m is not None]
        if not models and suffix is None:
            raise ValueError("eagle needs a draft model or suffix drafts")
        self.runner = runner
        self.pool = pool
        self.tree = tree or (GPU_TREE if runner.device.type == "cuda" else CPU_TREE)
        self.suffix = SuffixDrafter(suffix) if suffix is not None else None
        self.cost = cost
        self.drafters: dict[Source, HeadDrafter | BlockDrafter] = {}
        for m in models:
            if isinstance(m, DFlashDrafter):
                self.drafters["block"] = BlockDrafter(runner, pool, m)
            else:
                self.drafters["head"] = HeadDrafter(runner, pool, m, self.tree)
        if len(self.drafters) != len(models):
            raise ValueError("eagle takes one EAGLE head and one DFlash drafter at most")
        if prefer is not None and prefer not in self.drafters:
            raise ValueError(f"no {prefer!r} draft model is loaded")
        self.prefer: Source | None = prefer or next(iter(self.drafters), None)
        # The target features every model needs, computed once in each verify forward.
        self.aux_layers: tuple[int, ...] = tuple(sorted({i for d in self.drafters.values() for i in d.aux_layers}))
        # Each source's per-level acceptance over every request so far: a new request's rates start here.
        self.learned: dict[Source, SourceRate] = {s: SourceRate(p, weight=LEARNED_EMA) for s, p in PRIOR_RATE.items()}
        self._last = (0, 0, 0)  # the previous step: requests, forward tokens, tokens emitted

    @property
    def kv_owner(self) -> ModelRunner:
        return self.runner

    # ---- scheduling ------------------------------------------------------------

    def plan(self, req: Request, budget: int) -> tuple[int, int]:
        """Prefill chunks as ``ar`` plans them (the last one ends at the root); then one root + this
        step's draft budget."""
        pending = req.num_tokens - self.pool.computed_tokens(req.table, req.all_ids, req.uses_prefix_cache)
        if budget <= 0:
            return 0, 0
        if pending > 1:
            return min(pending, budget), 0
        # A verify of at most ``rows_max`` tokens computes each row as AR's decode would (lossless).
        cap = max(0, min(budget - 1, req.remaining - 1, self.runner.rows_max - 1))
        return 1, min(cap, self._budget(req, cap)[0].nodes)

    @property
    def draft_choices(self) -> tuple[str, ...]:
        """``draft`` values served: every choice but a model source that is not loaded."""
        return tuple(c for c in DRAFT_CHOICES if c not in ("head", "block") or c in self.drafters)

    def model_for(self, req: Request) -> Source | None:
        """The model source ``req`` drafts from, by its ``draft`` choice within what is loaded."""
        choice = req.params.draft
        if choice == "suffix":
            return None
        if choice in ("head", "block"):
            return choice if choice in self.drafters else None
        return self.prefer

    def sources(self, req: Request) -> tuple[bool, bool]:
        """(model, suffix): whether each drafts for ``req``, by its ``draft`` choice within what exists.
        A grammar constraint's state cannot branch, so constrained requests go token by token."""
        if req.constraint is not None:
            return False, False
        st: EagleState | None = req.decoder_state
        model = st.model if st is not None else self.model_for(req)
        return model is not None, self.suffix is not None and req.params.draft not in ("head", "block")

    def _budget(self, req: Request, cap: int) -> tuple[Budget, SuffixDraft | None]:
        """This step's budget and suffix draft for ``req`` (kept in its state for ``step``)."""
        st: EagleState | None = req.decoder_state
        if st is None or cap <= 0:  # a fresh state starts with a plain step
            return NO_DRAFT, None
        use_head, use_suffix = self.sources(req)
        # The model drafts once it has seen (or can catch up to) every feature before the root.
        d = self.drafters.get(st.model)
        use_head = use_head and d.ready(req, st)
        draft = None
        if use_suffix:
            st.index.sync(req.all_ids)
            draft = self.suffix.propose(st.index, req.all_ids, min(SUFFIX_NODES, cap), min(SUFFIX_NODES, cap))
            draft = draft if draft.num_nodes else None
        head_nodes = [n for n in (d.nodes(k) for k in range(1, d.max_depth + 1)) if n <= cap] if use_head else []
        suffix_nodes = [sum(1 for x in draft.tree.depths[1:] if x <= d) for d in range(1, max(draft.tree.depths) + 1)] \
            if draft is not None else []
        if self.cost is None:  # fixed sizes: everything on offer
            budget = Budget(len(head_nodes), head_nodes[-1] if head_nodes else 0,
                            len(suffix_nodes), suffix_nodes[-1] if suffix_nodes else 0)
        else:
            rates = req.counters_of(EagleCounters).rates
            head = Offer(tuple(head_nodes), rates[st.model].rate if use_head else 0.0,
                         tuple(d.seconds(k, self.cost(1)) for k in range(1, len(head_nodes) + 1)))
            suffix = Offer(tuple(suffix_nodes), rates["suffix"].rate)
            budget = choose_budget(self.cost, head if head_nodes else None, suffix if suffix_nodes else None,
                                   self._others(), cap)
            if head_nodes and not budget.head_depth and st.model_idle >= EXPLORE_AFTER \
                    and budget.nodes + head_nodes[0] <= cap:
                budget = replace(budget, head_depth=1, head_nodes=head_nodes[0])  # a probe (EXPLORE_AFTER)
        st.planned = (req.num_tokens, budget, draft)
        return budget, draft

    def _others(self) -> Batch:
        """The rest of the batch, as the previous step had it."""
        n, tokens, emitted = self._last
        if n <= 1:
            return Batch()
        share = (n - 1) / n
        return Batch(round(tokens * share), emitted * share)

    # ---- the step --------------------------------------------------------------

    def step(self, batch: Sequence[Scheduled], emit) -> None:
        batch = [s for s in batch if s.num_new_tokens > 0]
        if not batch:
            return
        for s in batch:
            if s.request.decoder_state is None:
                n, model = s.request.num_computed, self.model_for(s.request)
                s.request.decoder_state = EagleState(n, n, self._no_features(model), model)
                s.request.counters_of(EagleCounters).rates = {k: SourceRate(r.rate) for k, r in self.learned.items()}
        decode = [s for s in batch if s.request.num_computed == s.request.num_tokens - 1]
        started = time.perf_counter()
        planned: dict[int, tuple[Budget, SuffixDraft | None]] = {}
        for s in decode:
            with guard(s.request, emit, "drafting"):
                st: EagleState = s.request.decoder_state
                hit = st.planned is not None and st.planned[0] == s.request.num_tokens
                planned[id(s.request)] = st.planned[1:] if hit else self._budget(s.request, s.num_lookahead)
        decode = [s for s in decode if not s.request.finished]
        catch_up = []
        for s in decode:
            st = s.request.decoder_state
            if planned[id(s.request)][0].head_depth:
                catch_up.append(s.request)
            elif len(st.pending) >= MAX_PENDING:
                if st.model_idle >= EXPLORE_AFTER:
                    self._forget(st)
                else:
                    catch_up.append(s.request)
        for name, d in self.drafters.items():
            mine = [r for r in catch_up if r.decoder_state.model == name]
            if not mine:
                continue
            positions, caught = sum(len(r.decoder_state.pending) for r in mine), time.perf_counter()
            d.catch_up(mine)
            d.observe_catch_up((time.perf_counter() - caught) / len(mine), positions / len(mine))  # a share each
        trees, drafting = {}, time.perf_counter()
        for s in decode:
            with guard(s.request, emit, "drafting"):
                trees[id(s.request)] = self._draft(s, *planned[id(s.request)])
        for name, d in self.drafters.items():  # at batch 1 the step's drafting is that request's
            d.observe(time.perf_counter() - drafting, [planned[id(s.request)][0].head_depth for s in decode
                                                       if s.request.decoder_state.model == name])
        batch = [s for s in batch if not s.request.finished]  # a failed draft leaves the step
        if not batch:
            return
        draft_time = time.perf_counter() - started
        started = time.perf_counter()
        items = [self._item(s, trees.get(id(s.request))) for s in batch]
        final, aux = self.runner.forward(items, aux_layers=self.aux_layers)
        num_tokens = sum(len(it.token_ids) for it in items)
        if self.cost is not None and all(id(s.request) in trees for s in batch):  # decode steps only
            self.cost.observe(num_tokens, time.perf_counter() - started)
        known = self._path_logits(batch, items, trees, final)
        offset, emitted = 0, 0
        for s, item in zip(batch, items):
            n = len(item.token_ids)
            req = s.request
            req.num_forwards += 1
            rows = slice(offset, offset + n)
            offset += n
            tree = trees.get(id(req))
            with guard(req, emit, "verify"):
                if tree is None and req.num_computed + n < req.num_tokens:
                    self._prefilled(req, n, final[rows], [a[rows] for a in aux])
                    continue
                if tree is None:  # the last chunk: its last row verifies the root alone
                    self._prefilled(req, n - 1, final[rows][:-1], [a[rows][:-1] for a in aux])
                    tree, rows = DraftTree([req.all_ids[-1]], [-1]), slice(rows.stop - 1, rows.stop)
                counters = req.counters_of(EagleCounters)
                counters.draft_seconds += draft_time
                emitted += self._verify(req, tree, final[rows], [a[rows] for a in aux], emit, known.get(id(req)))
                counters.verify_seconds += time.perf_counter() - started
        self._last = (len(batch), num_tokens, emitted)

    def _path_logits(self, batch: Sequence[Scheduled], items: list[ForwardItem], trees: dict,
                     final: torch.Tensor) -> dict[int, dict[int, torch.Tensor]]:
        """Every verifying request's logits (fp32, by tree node) along the path verification will
        most likely walk, computed level by level for the whole batch (``tree.path_logits``)."""
        starts: dict[int, tuple[int, DraftTree]] = {}  # request -> (its first row, tree)
        offset = 0
        for s, item in zip(batch, items):
            n, req = len(item.token_ids), s.request
            if id(req) in trees:
                starts[id(req)] = (offset, trees[id(req)])  # the root is a tree's first node
            elif req.num_computed + n >= req.num_tokens:  # the last prefill chunk: its last row is the root
                starts[id(req)] = (offset + n - 1, DraftTree([req.all_ids[-1]], [-1]))
            offset += n
        return path_logits(starts, final, self.runner.logits, GUESS_ROWS)

    @staticmethod
    def _forget(st: EagleState) -> None:
        """Drop the features waiting for an idle model source: its context restarts after them."""
        st.head_len += len(st.pending)
        st.head_start, st.pending, st.last_hidden = st.head_len, st.pending[:0], None

    def _no_features(self, model: Source | None) -> torch.Tensor:
        width = self.drafters[model].raw_width if model is not None else 0
        return torch.zeros(0, width, device=self.runner.device)

    def _features(self, st: EagleState, final: torch.Tensor, aux: list[torch.Tensor]) -> None:
        """Queue the features of these target positions for the request's model source."""
        if st.model is not None:
            st.pending = torch.cat([st.pending, self.drafters[st.model].features(final, aux, self.aux_layers)])

    def _item(self, s: Scheduled, tree: DraftTree | None) -> ForwardItem:
        req = s.request
        start = req.num_computed
        table = req.table.blocks
        if tree is None or len(tree) == 1:  # a prefill chunk, or a plain step (just the root)
            end = start + (s.num_new_tokens if tree is None else 1)
            return ForwardItem(req.all_ids[start:end], range(start, end), start, table,
                               self.pool.slot_mapping(req.table, start, end))
        n = len(tree)
        positions = torch.tensor(tree.depths) + start  # (nodes,) root at its own position
        return ForwardItem(tree.tokens, positions, start, table, self.pool.slot_mapping(req.table, start, start + n),
                           mask=tree.mask())

    def _prefilled(self, req: Request, n: int, final: torch.Tensor, aux: list[torch.Tensor]) -> None:
        state: EagleState = req.decoder_state
        start = req.num_computed
        if req.needs_prompt_logprobs:
            fill_prompt_logprobs(self.runner, req, final, start)
        self._features(state, final, aux)
        self.pool.mark_written(req.table, req.all_ids, start + n)

    # ---- draft -----------------------------------------------------------------

    @torch.inference_mode()
    def _draft(self, s: Scheduled, budget: Budget, suffix: SuffixDraft | None) -> DraftTree:
        """The merged tree of this step's sources (head first, then suffix), within the reserved slots."""
        req = s.request
        st: EagleState = req.decoder_state
        root = req.all_ids[-1]
        plain = DraftTree([root], [-1])
        head = plain
        # The model must have seen every feature before the root (catch-up ran for it this step).
        if budget.head_depth and st.last_hidden is not None and st.head_len == req.num_tokens - 1:
            head = self.drafters[st.model].draft(req, st, budget.head_depth, budget.head_nodes)
        tail = plain
        if budget.suffix_depth and suffix is not None:
            tail = suffix.tree.cut(budget.suffix_nodes, budget.suffix_depth)
            self.suffix.used(suffix)
        if len(head) == 1 and len(tail) == 1:
            return plain
        return merge_trees([head, tail]).cut(s.num_lookahead)

    # ---- verify ----------------------------------------------------------------

    def _verify(self, req: Request, tree: DraftTree, final: torch.Tensor, aux: list[torch.Tensor], emit,
                known: dict[int, torch.Tensor] | None = None) -> int:
        """Accept, commit and keep the accepted path; returns the tokens committed. ``known``: logits
        of some of the tree's nodes, computed with the batch's (``_path_logits``)."""
        params = req.params
        cache: dict[int, torch.Tensor] = dict(known or {})

        def raw(node: int) -> torch.Tensor:
            if node not in cache:
                cache[node] = self.runner.logits(final[node: node + 1])[0]  # (vocab,) fp32
            return cache[node]

        def processed(node: int, accepted: list[int]) -> torch.Tensor:
            # Stateless penalties over the path so far: the request's running counts only
            # advance once tokens are committed.
            logits = process_logits(raw(node), req.prompt_ids, req.output_ids + accepted, params)
            return logits if req.constraint is None else req.constraint.mask_logits(logits)

        # A suffix draft is deterministic, like the head's top-k: both are point masses, which
        # is what accept_sampled's rule assumes, so the merged tree stays exact.
        if params.greedy:
            path, bonus = accept_greedy(tree, processed)
        else:
            path, bonus = accept_sampled(tree, lambda n, acc: truncated_probs(processed(n, acc), params),
                                         req.generator)
        tokens = [tree.tokens[n] for n in path] + [bonus]
        if req.constraint is not None:  # root-only tree: exactly one token
            req.constraint.consume(bonus)
        self._count(req, tree, path, len(tokens))
        logprobs = None
        if params.logprobs is not None:
            parents = [0] + path  # each emitted token was predicted at its parent node
            logprobs = [token_logprobs(raw(p)[None], [t], params.logprobs)[0] for p, t in zip(parents, tokens)]
        start = req.num_computed  # the root's position
        delta = req.commit(tokens, logprobs)
        if delta.finish_reason is None:
            self._keep_path(req, path, start, final, aux)
        elif self.suffix is not None:
            self.suffix.finished(req.output_ids)
        emit(req, delta)
        return len(delta.token_ids)

    def _count(self, req: Request, tree: DraftTree, path: list[int], emitted: int) -> None:
        """Acceptance statistics, and each source's running rate for the budget."""
        counters = req.counters_of(EagleCounters)
        counters.accept_lengths.append(emitted)
        if len(tree) == 1:
            counters.plain_steps += 1
        st: EagleState = req.decoder_state
        for source, bit in SOURCE_BITS.items():
            source = st.model if source == "head" else source  # bit 0: whichever model drafted
            if source is None:
                continue
            outcome = source_outcome(tree, path, bit) if tree.sources else None
            if source == st.model:
                st.model_idle = 0 if outcome is not None else st.model_idle + 1
            if outcome is None:
                counters.rates[source].idle()
                continue
            counters.rates[source].observe(*outcome)
            self.learned[source].observe(*outcome)
            counters.drafted[source] = counters.drafted.get(source, 0) + 1
            counters.accepted[source] = counters.accepted.get(source, 0) + outcome[0]

    def _keep_path(self, req: Request, path: list[int], start: int, final: torch.Tensor,
                   aux: list[torch.Tensor]) -> None:
        """Move the accepted nodes' KV next to the root, release the rest, queue their features."""
        bs, table = self.runner.block_size, req.table.blocks
        moves = [(slot_of(table, start + node, bs), slot_of(table, start + j + 1, bs))
                 for j, node in enumerate(path) if node != j + 1]
        if moves:
            self.runner.move_slots([m[0] for m in moves], [m[1] for m in moves])
        written = start + 1 + len(path)  # root + accepted nodes
        self.pool.mark_written(req.table, req.all_ids, written)
        self.pool.truncate(req.table, written)
        rows = torch.tensor([0] + path, device=final.device)
        self._features(req.decoder_state, final[rows], [a[rows] for a in aux])


def eagle_decoder(loaded: LoadedModel, runner: ModelRunner, pool: BlockPool, head_path: Path | str | None = None,
                  tree: TreeConfig | None = None, cost: CostCurve | None = None) -> EagleDecoder | None:
    """An EAGLE decoder for ``loaded``: from ``head_path`` (an EAGLE head or a DFlash drafter directory),
    else the bundled head for that model, else None."""
    path = Path(head_path) if head_path else default_eagle_head(loaded.name)
    if path is None:
        return None
    model = load_dflash(path, loaded.model) if is_dflash(path) else load_eagle_head(path, loaded.model)
    return EagleDecoder(runner, pool, model, tree, cost=cost)
