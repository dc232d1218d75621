"""EAGLE speculative decoding over the shared paged KV pool: draft from sources, verify, accept.

A step of an EAGLE request (Li et al., EAGLE-1/2/3; the tree rules live in ``tree.py``):

  1. **budget**: each of the request's draft sources (``source.py``: the EAGLE head or a
     DFlash drafter, and suffix lookup) says what it can draft; the budget (``budget.py``)
     picks how deep each drafts, or no draft at all, from the host's measured verify cost
     and the request's running acceptance per source;
  2. **draft**: the sources that read the target's features catch up on the positions the
     last step committed (one forward per model over the batch), then each source proposes
     a tree from the last committed token (the "root"); the trees merge into one (shared
     prefixes once), whose nodes live in scratch tensors;
  3. **verify**: ONE target forward over root + tree with a tree attention mask on top of
     the paged KV, writing into the request's lookahead slots (the scheduler reserved them
     from ``plan``), capturing the features the draft models read;
  4. **accept**: the longest path of drafts equal to the target's own token at each position
     (its argmax, or its sample under the request's keyed noise), plus that token where the
     path stops (the bonus); the accepted nodes' KV moves into place (``ModelRunner.move_slots``),
     rejected slots go back to the pool (``BlockPool.truncate``), tokens go out through
     ``Request.commit``, which alone applies EOS, stop strings and max_tokens; the sources
     observe the committed positions and the budget records what each earned.

``EagleDecoder.step`` states the step in one function. A request's part in a step is one ``Turn``
(its budget, consulted once; its merged tree; its rows of the verify forward; the logits computed
for it with the batch's); what lasts from step to step is its ``EagleState``.

Prefill is plain chunked target computation, as ``ar`` runs it; the last row of the last
chunk is the first root's verify step (a tree of the root alone), so the first token comes
out of the same forward as ``ar``'s, and every emitted token comes out of a verify step:
the output equals plain AR decoding token for token, at temperature 0 and, for the same
seed, above it (a verify row computes the same bits as a decode row: docs/numerics.md).

Sources per request: ``SamplingParams.draft`` ("auto" or "both": the preferred model and
suffix lookup; "head" or "block": that model alone; "suffix"). A request under a grammar
constraint drafts nothing (its state cannot branch). Without a model, ``eagle`` drafts from
suffix lookup alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from dualserve.models.dflash import DFlashDrafter
from dualserve.models.eagle import EagleHead

from ..ar import fill_prompt_logprobs
from ..engine.blocks import BlockPool, slot_of
from ..engine.isolation import guard
from ..engine.request import DecoderCounters, DecoderState, Request
from ..engine.runner import ForwardItem, ModelRunner
from ..engine.sampling import DRAFT_CHOICES, keyed_uniform, process_logits, token_logprobs, truncated_probs
from ..engine.scheduler import Scheduled
from .budget import NO_DRAFT, Budget, CostCurve, DraftBudget, Source, SourceRate
from .datastore import Datastore
from .drafters import BlockSource, HeadSource
from .source import DraftSource
from .suffix import SuffixConfig, SuffixSource
from .tree import DraftTree, TreeConfig, accept_greedy, accept_sampled, merge_trees, path_logits, source_outcome

# CPU: measured with the bundled SmolLM2 head (clients/bench_eagle.py). On an AVX2
# CPU a forward over 2..8 tokens costs about twice a 1-token forward (GEMM packs
# the weights, GEMV streams them), so small trees win until acceptance is high.
CPU_TREE = TreeConfig(depth=3, top_k=2, num_nodes=4)
# GPU: verify cost is flat in tree size at batch 1; upstream EAGLE-2's evaluation
# setting (depth 5, top-k 10, 60 tokens) scaled to a small target. Not yet measured.
GPU_TREE = TreeConfig(depth=5, top_k=8, num_nodes=48)
# The output-head product's cost at one row and at eight before any is measured (``tree.path_logits``
# weighs it): each row beyond the first adds a fifth of a product, as on the default model on a
# 2-core CPU (a tenth to a fifth, measured in served steps).
PRODUCT_PRIOR = (1.0, 1.0 + 7 * 0.2)


@dataclass
class EagleState(DecoderState):
    """Per-request draft state (``Request.decoder_state``; reset to None on preemption)."""

    sources: tuple[DraftSource, ...]  # what this request drafts from, in merge order (a model first)
    drafts: list[Any]                 # each source's own state for it (``DraftSource.start``)
    rates: dict[Source, SourceRate]   # the budget's running acceptance per source (``DraftBudget``)
    # This step's budget, made by plan for the request at this many tokens.
    planned: tuple[int, Budget] | None = None


@dataclass
class EagleCounters(DecoderCounters):
    """Per-request EAGLE statistics (``Request.counters``)."""

    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted per verify step
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    plain_steps: int = 0         # verify steps that drafted nothing (the budget said drafting cannot pay)
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


@dataclass(eq=False)  # hashed by identity: ``tree.path_logits`` keys its rows by turn
class Turn:
    """One request's part in one step (``EagleDecoder.step`` makes it; its helpers fill it in)."""

    scheduled: Scheduled
    decoding: bool                   # its root is its last token: it drafts and verifies (else it prefills)
    budget: Budget = NO_DRAFT        # what it drafts this step: the budget's decision, taken once
    tree: DraftTree | None = None    # the merged draft, root first (set by drafting; None: a prefill chunk)
    rows: slice = field(default_factory=lambda: slice(0, 0))  # of the verify forward's output (``_lay_out``)
    known: dict[int, torch.Tensor] | None = None  # logits by tree node, computed with the batch's
    argmaxes: dict[int, int] | None = None        # ... and their argmaxes (``_path_logits``)

    @property
    def request(self) -> Request:
        return self.scheduled.request

    @property
    def ends_prefill(self) -> bool:
        """A prefill chunk that reaches the root: its last row is the first verify of the root alone."""
        req = self.request
        return not self.decoding and req.num_computed + (self.rows.stop - self.rows.start) >= req.num_tokens


class EagleDecoder:
    """Speculative decoding on the target's runner (a ``Decoder``): orchestration of draft sources,
    one verify forward, acceptance. What each source drafts is the budget's call."""

    name = "eagle"
    shares_prompt_blocks = True
    supports_infill = False
    default_max_tokens = None

    def __init__(self, runner: ModelRunner, pool: BlockPool, head: EagleHead | None = None,
                 tree: TreeConfig | None = None, suffix: SuffixConfig | None = SuffixConfig(),
                 cost: CostCurve | None = None, block: DFlashDrafter | None = None, prefer: Source | None = None,
                 datastore: Datastore | None = None):
        """The one way ``eagle`` is built (the server's ``deployment.register_eagle`` and the tests).

        ``head``: an EAGLE head, grown into trees shaped by ``tree``; ``block``: a DFlash drafter;
        either, both or neither (suffix drafts alone). A request drafts from the model its
        ``draft`` field names, else from ``prefer`` (default: the head if loaded). ``suffix`` None:
        models alone; ``datastore``: answers to other prompts that suffix lookup also drafts from.
        ``cost`` None: every step drafts everything each source offers; a
        ``CostCurve``: the budget sizes each step, down to no draft at all, and the curve learns
        from the verify forwards."""
        if head is not None and not isinstance(head, EagleHead):
            raise TypeError(f"head must be an EAGLE head, not {type(head).__name__} (a DFlash drafter is block=)")
        if head is None and block is None and suffix is None:
            raise ValueError("eagle needs a draft model or suffix drafts")
        self.runner = runner
        self.pool = pool
        self._tree = tree or (GPU_TREE if runner.device.type == "cuda" else CPU_TREE)
        # The target features every model reads, computed once in each verify forward.
        models = [m for m in (head, block) if m is not None]
        self.aux_layers: tuple[int, ...] = tuple(sorted({i for m in models for i in m.config.aux_layers}))
        self.sources: dict[Source, DraftSource] = {}  # in merge order: models first, then suffix lookup
        if head is not None:
            self.sources["head"] = HeadSource(runner, pool, head, self._tree, self.aux_layers)
        if block is not None:
            self.sources["block"] = BlockSource(runner, pool, block, self.aux_layers)
        if suffix is not None:
            self.sources["suffix"] = SuffixSource(suffix, datastore)
        if prefer is not None and (prefer not in ("head", "block") or prefer not in self.sources):
            raise ValueError(f"no {prefer!r} draft model is loaded")
        self.prefer: Source | None = prefer or next((m for m in ("head", "block") if m in self.sources), None)
        self.budget = DraftBudget(cost)
        # Seconds of an output-head product by its rows, measured on a CPU (a GPU's is flat at these sizes).
        cpu = runner.device.type == "cpu"
        self.product_cost = CostCurve(*PRODUCT_PRIOR) if cpu else CostCurve.flat()
        self._time_products = cpu

    def prewarm(self) -> None:
        """Load or build the draft models' compiled graphs now (where the target's steps are compiled)."""
        head = self.sources.get("head")
        if head is not None:
            head.prewarm()

    @property
    def kv_owner(self) -> ModelRunner:
        return self.runner

    @property
    def cost(self) -> CostCurve | None:
        """The budget's verify cost curve; None: fixed drafts (everything each source offers)."""
        return self.budget.curve

    @cost.setter
    def cost(self, curve: CostCurve | None) -> None:
        self.budget.curve = curve

    @property
    def tree(self) -> TreeConfig:
        """The EAGLE head's tree: its deepest level and most nodes."""
        return self._tree

    @tree.setter
    def tree(self, tree: TreeConfig) -> None:
        self._tree = tree
        if "head" in self.sources:
            self.sources["head"].tree = tree

    @property
    def suffix(self) -> SuffixSource | None:
        return self.sources.get("suffix")

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
        return 1, min(cap, self._budget(req, cap).num_nodes)

    @property
    def draft_choices(self) -> tuple[str, ...]:
        """``draft`` values served: every choice but a model source that is not loaded."""
        return tuple(c for c in DRAFT_CHOICES if c not in ("head", "block") or c in self.sources)

    def sources_for(self, req: Request) -> tuple[DraftSource, ...]:
        """What ``req`` drafts from, by its ``draft`` choice within what is loaded, in merge order. A
        grammar constraint's state cannot branch, so constrained requests go token by token."""
        if req.constraint is not None:
            return ()
        choice = req.params.draft
        model = choice if choice in ("head", "block") else None if choice == "suffix" else self.prefer
        out = [self.sources[model]] if model in self.sources else []
        if "suffix" in self.sources and choice not in ("head", "block"):
            out.append(self.sources["suffix"])
        return tuple(out)

    def _start(self, req: Request) -> EagleState:
        sources = self.sources_for(req)
        return EagleState(sources, [src.start(req) for src in sources], self.budget.rates())

    def _budget(self, req: Request, cap: int) -> Budget:
        """This step's budget for ``req`` (kept in its state for ``step``)."""
        st: EagleState | None = req.decoder_state
        if st is None or cap <= 0 or not st.sources:  # a fresh state starts with a plain step
            return NO_DRAFT
        reaches = [src.offer(req, d, cap) for src, d in zip(st.sources, st.drafts)]
        budget = self.budget.choose([src.name for src in st.sources], reaches, st.rates, cap)
        st.planned = (req.num_tokens, budget)
        return budget

    # ---- the step --------------------------------------------------------------

    def step(self, batch: Sequence[Scheduled], emit) -> None:
        """One speculative step over ``batch``: draft, verify in one forward, accept.

        Acceptance (``tree.accept_greedy`` / ``accept_sampled``): walk down the tree from the root
        while a child holds the token the target itself emits at that node, then append the
        target's token where the walk stops (the bonus). The target's token is its argmax at
        temperature 0, else its inverse-CDF sample under the uniform keyed by (request seed, output
        position) (``sampling.keyed_uniform``), so the tokens are exactly those ``ar`` emits, for any
        tree and batch. A request still prefilling computes a chunk; its last chunk's last row
        verifies the root alone. The budget is consulted once per request, when its turn is made."""
        turns = self._turns(batch, emit)
        if not turns:
            return
        # Draft: the sources catch up on what the last step committed, then propose; trees merge.
        started = time.perf_counter()
        drafting = [t for t in turns if t.decoding and not t.request.finished]
        self._catch_up(drafting)
        self._draft_trees(drafting, emit)
        turns = [t for t in turns if not t.request.finished]  # a failed draft leaves the step
        if not turns:
            return
        draft_time = time.perf_counter() - started
        # Verify: ONE target forward over every turn's rows (prefill chunks, roots and their trees),
        # then the output head along the paths acceptance will most likely walk, for the batch at once.
        started = time.perf_counter()
        items = self._lay_out(turns)
        final, aux = self.runner.forward(items, aux_layers=self.aux_layers)
        num_tokens = sum(len(it.token_ids) for it in items)
        self._path_logits(turns, final)
        # A verify's cost is its forward and the output head over the rows it will likely accept
        # (a plain step's, like ``ar``'s, is one row): a bigger tree pays for both.
        if all(t.decoding for t in turns):  # decode steps only
            self.budget.verified(num_tokens, time.perf_counter() - started)
        # Accept: each request keeps its longest matching path plus the bonus, and commits it.
        emitted = 0
        for turn in turns:
            turn.request.num_forwards += 1
            with guard(turn.request, emit, "verify"):
                emitted += self._settle(turn, final, aux, emit, draft_time, started)
        self.budget.stepped(len(turns), num_tokens, emitted)

    def _turns(self, batch: Sequence[Scheduled], emit) -> list[Turn]:
        """This step's turns (requests with tokens to compute), each decoding one with its budget:
        the one ``plan`` made for it at this length, else a fresh one."""
        turns = [Turn(s, s.request.num_computed == s.request.num_tokens - 1) for s in batch if s.num_new_tokens > 0]
        for t in turns:
            if t.request.decoder_state is None:
                t.request.decoder_state = self._start(t.request)
        for t in turns:
            if t.decoding:
                with guard(t.request, emit, "drafting"):
                    planned = t.request.decoder_state.planned
                    hit = planned is not None and planned[0] == t.request.num_tokens
                    t.budget = planned[1] if hit else self._budget(t.request, t.scheduled.num_lookahead)
        return turns

    def _catch_up(self, drafting: list[Turn]) -> None:
        """Bring each source up to the root for the requests it drafts for now, or whose backlog it
        must read (``DraftSource.due``): one batch per source, timed for the budget."""
        due: dict[Source, tuple[list[Request], list[Any]]] = {}
        for t in drafting:
            st: EagleState = t.request.decoder_state
            for i, (src, d) in enumerate(zip(st.sources, st.drafts)):
                if src.due(d, t.budget.depth(i) > 0, st.rates[src.name].stale):
                    reqs, states = due.setdefault(src.name, ([], []))
                    reqs.append(t.request)
                    states.append(d)
        for name, (reqs, states) in due.items():
            caught = time.perf_counter()
            positions = self.sources[name].catch_up(reqs, states)
            self.budget.caught_up(name, time.perf_counter() - caught, positions, len(reqs))

    def _draft_trees(self, drafting: list[Turn], emit) -> None:
        """Each drafting request's merged tree (a request whose drafting raises fails alone), the
        drafting timed for the budget by the units the budgets spent."""
        started = time.perf_counter()
        for t in drafting:
            with guard(t.request, emit, "drafting"):
                t.tree = self._draft(t.scheduled, t.budget)
        self.budget.drafted(time.perf_counter() - started, self._units(drafting))

    @staticmethod
    def _units(drafting: list[Turn]) -> dict[Source, int]:
        """Drafting units the step's budgets spent, per source."""
        units: dict[Source, int] = {}
        for t in drafting:
            for src, n in zip(t.request.decoder_state.sources, t.budget.units):
                if n:
                    units[src.name] = units.get(src.name, 0) + n
        return units

    def _lay_out(self, turns: list[Turn]) -> list[ForwardItem]:
        """The verify forward's items, one per turn, each turn told its rows of the output."""
        items, offset = [], 0
        for t in turns:
            items.append(self._item(t.scheduled, t.tree))
            n = len(items[-1].token_ids)
            t.rows, offset = slice(offset, offset + n), offset + n
        return items

    def _settle(self, turn: Turn, final: torch.Tensor, aux: list[torch.Tensor], emit, draft_time: float,
                started: float) -> int:
        """A turn's rows of the verify forward: a prefill chunk's KV and features kept; a root (after
        a tree or as a last chunk's last row) accepted and committed. Returns the tokens committed."""
        req, rows = turn.request, turn.rows
        tree = turn.tree
        if tree is None and not turn.ends_prefill:
            self._prefilled(req, rows.stop - rows.start, final[rows], [a[rows] for a in aux])
            return 0
        if tree is None:  # the last chunk: its last row verifies the root alone
            last = rows.stop - 1
            self._prefilled(req, last - rows.start, final[rows.start:last], [a[rows.start:last] for a in aux])
            tree, rows = DraftTree([req.all_ids[-1]], [-1]), slice(last, rows.stop)
        counters = req.counters_of(EagleCounters)
        counters.draft_seconds += draft_time
        emitted = self._verify(turn, tree, final[rows], [a[rows] for a in aux], emit)
        counters.verify_seconds += time.perf_counter() - started
        return emitted

    def _path_logits(self, turns: list[Turn], final: torch.Tensor) -> None:
        """Every verifying turn's logits (fp32, by tree node) along the path verification will most
        likely walk, computed level by level for the whole batch, and their argmaxes
        (``tree.path_logits``), each product timed for the next step's."""
        starts: dict[Turn, tuple[int, DraftTree, tuple[float, ...] | None]] = {}  # turn -> (first row, tree, reach)
        for t in turns:
            if t.decoding:  # the root is a tree's first node; a fixed draft's reach is not weighed
                starts[t] = (t.rows.start, t.tree, t.budget.reach or None)
            elif t.ends_prefill:  # the last prefill chunk: its last row is the root
                starts[t] = (t.rows.stop - 1, DraftTree([t.request.all_ids[-1]], [-1]), None)
        known, argmaxes = path_logits(starts, final, self._product, self.product_cost)
        for t in starts:
            t.known, t.argmaxes = known[t], argmaxes[t]

    def _product(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head over these rows, timed (on a CPU) into ``product_cost``."""
        started = time.perf_counter()
        logits = self.runner.logits(hidden)
        if self._time_products:
            self.product_cost.observe(len(hidden), time.perf_counter() - started)
        return logits

    @staticmethod
    def _observe(st: EagleState, final: torch.Tensor, aux: list[torch.Tensor]) -> None:
        """The request's sources see the target's outputs at these newly computed positions."""
        for src, d in zip(st.sources, st.drafts):
            src.observe(d, final, aux)

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
        start = req.num_computed
        if req.needs_prompt_logprobs:
            fill_prompt_logprobs(self.runner, req, final, start)
        self._observe(req.decoder_state, final, aux)
        self.pool.mark_written(req.table, req.all_ids, start + n)

    # ---- draft -----------------------------------------------------------------

    @torch.inference_mode()
    def _draft(self, s: Scheduled, budget: Budget) -> DraftTree:
        """The merged tree of this step's sources (in the request's order), within the reserved slots."""
        req = s.request
        st: EagleState = req.decoder_state
        plain = DraftTree([req.all_ids[-1]], [-1])
        trees = [src.propose(req, d, budget.depths[i], budget.nodes[i]) if budget.depth(i) else plain
                 for i, (src, d) in enumerate(zip(st.sources, st.drafts))]
        if all(len(t) == 1 for t in trees):
            return plain
        return merge_trees(trees).cut(s.num_lookahead)

    # ---- verify ----------------------------------------------------------------

    def _verify(self, turn: Turn, tree: DraftTree, final: torch.Tensor, aux: list[torch.Tensor], emit) -> int:
        """Accept ``tree`` (``final``/``aux``: its rows), commit, and keep the accepted path; returns
        the tokens committed. The turn brings what the step drafted (its budget: ``NO_DRAFT`` after
        a prefill) and the logits of some of the tree's nodes, computed with the batch's."""
        req, params = turn.request, turn.request.params
        cache: dict[int, torch.Tensor] = dict(turn.known or {})

        def raw(node: int) -> torch.Tensor:
            if node not in cache:
                cache[node] = self.runner.logits(final[node: node + 1])[0]  # (vocab,) fp32
            return cache[node]

        def processed(node: int, accepted: list[int]) -> torch.Tensor:
            # Stateless penalties over the path so far: the request's running counts only
            # advance once tokens are committed.
            logits = process_logits(raw(node), req.prompt_ids, req.output_ids + accepted, params)
            return logits if req.constraint is None else req.constraint.mask_logits(logits)

        # Every source's draft is deterministic (the head's top-k, a block's argmax, a suffix
        # lookup), so the merged tree is a set of candidate tokens per position; acceptance keeps
        # those equal to the target's own token there (its argmax, or its sample under the uniform
        # keyed by the request's seed and the output position: exactly what ``ar`` samples).
        if params.greedy:
            # The raw logits' argmaxes stand for the processed ones' where nothing processes them.
            plain = not params.needs_processing and req.constraint is None
            path, bonus = accept_greedy(tree, processed, turn.argmaxes if plain else None)
        else:
            at = len(req.output_ids)  # the root's output position
            uniforms = [keyed_uniform(req.seed, at + d) for d in range(max(tree.depths) + 1)]
            path, bonus = accept_sampled(tree, lambda n, acc: truncated_probs(processed(n, acc), params), uniforms)
        tokens = [tree.tokens[n] for n in path] + [bonus]
        if req.constraint is not None:  # root-only tree: exactly one token
            req.constraint.consume(bonus)
        self._count(req, tree, path, len(tokens), turn.budget)
        logprobs = None
        if params.logprobs is not None:
            parents = [0] + path  # each emitted token was predicted at its parent node
            logprobs = [token_logprobs(raw(p)[None], [t], params.logprobs)[0] for p, t in zip(parents, tokens)]
        start = req.num_computed  # the root's position
        delta = req.commit(tokens, logprobs)
        if delta.finish_reason is None:
            self._keep_path(req, path, start, final, aux)
        else:
            self._release(req)
        emit(req, delta)
        return len(delta.token_ids)

    def _count(self, req: Request, tree: DraftTree, path: list[int], emitted: int, budget: Budget) -> None:
        """Acceptance statistics, and what each source earned, for the budget."""
        counters = req.counters_of(EagleCounters)
        counters.accept_lengths.append(emitted)
        if len(tree) == 1:
            counters.plain_steps += 1
        st: EagleState = req.decoder_state
        for i, src in enumerate(st.sources):  # source i proposed the nodes with bit i (merge order)
            outcome = source_outcome(tree, path, i) if tree.sources else None
            match = budget.matches[i] if i < len(budget.matches) else 0
            lookup = budget.lookups[i] if i < len(budget.lookups) else None
            self.budget.record(src.name, st.rates[src.name], outcome, match, lookup)
            if outcome is not None:  # a datastore's drafts are counted apart from suffix lookup's
                name = lookup or src.name
                counters.drafted[name] = counters.drafted.get(name, 0) + 1
                counters.accepted[name] = counters.accepted.get(name, 0) + outcome[0]

    def _release(self, req: Request) -> None:
        """A finished request: every source lets it go (suffix lookup keeps its output)."""
        st: EagleState = req.decoder_state
        for src in self.sources.values():
            i = next((i for i, mine in enumerate(st.sources) if mine is src), None)
            src.release(req, st.drafts[i] if i is not None else None)

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
        self._observe(req.decoder_state, final[rows], [a[rows] for a in aux])
