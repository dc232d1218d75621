"""The draft-model sources of ``eagle``: an EAGLE head growing a tree, a DFlash drafter proposing a block.

Both are ``DraftSource``s (``source.py``) that read the target's features of committed
positions and keep their own KV in a ``KVCache`` indexed by the target's block tables (a
request's blocks hold both), so the decoder drives them the same way each step:

  1. ``observe``: queue the verify forward's features of the positions just committed
     (``ModelState.pending``); the model's projection of them runs at catch-up, and
     never for positions whose features are dropped, so a step the source does not
     draft costs nothing;
  2. ``catch_up``: consume the queued features, writing KV at those positions' slots
     (``due`` says whether a request needs it this step: it drafts, or its queue grew long);
  3. ``propose``: from the last committed token (the root), a ``DraftTree`` of at most
     ``depth`` levels and ``nodes`` nodes.

* ``HeadSource`` (EAGLE-1/2/3): catch-up runs the head over (feature j, token j+1)
  pairs; drafting grows an EAGLE-2 tree level by level, one head forward a level
  (``tree.grow_tree``). Both run the one head graph of ``head_graph.py`` (a package where
  the target's steps are compiled). A deeper draft costs more: a drafting unit per level.
* ``BlockSource`` (DFlash, ``models/dflash.py``): catch-up projects each feature into
  every draft layer's key and value (no layer runs); drafting is ONE forward over
  [root, mask, ...] with the block attending to itself in both directions, and the
  argmax of each row is the chain's next token. Any depth up to ``block_size - 1``
  costs one drafting unit.

Positions whose blocks came from the prefix cache have no draft KV (another decoder may
have written them), so a model attends only from where this request started computing;
drafts get a shorter context there, results stay exact. The budget (``budget.py``) times
catch-ups and drafting units; a source only says how many units a depth costs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dualserve.models.dflash import DFlashDrafter
from dualserve.models.eagle import EagleHead

from ..engine.blocks import BlockPool
from ..engine.attention.paged_attention import AttentionMetadata, SeqAttention
from ..engine.request import Request
from ..engine.runner import ModelRunner
from .budget import NO_REACH, Reach, Source
from .head_graph import HeadGraph, draft_tree
from .tree import DraftTree, TreeConfig

# Features waiting for a model: past this many it catches up even on a step it does not draft,
# so a request drafting from suffix lookup alone does not hold features for its whole output;
# if the budget has left the model unused long (``SourceRate.stale``) they are dropped instead
# and its context restarts there (as after a prefix-cache hit: drafts see less, output stays
# exact), so a model that does not pay, as at a large batch, costs no catch-up forwards.
MAX_PENDING = 64


@dataclass
class ModelState:
    """A request's context in one draft model (``EagleState.drafts``)."""

    kv_start: int                # first position with draft KV (earlier ones came from the prefix cache)
    kv_end: int                  # draft KV covers kv_start <= j < kv_end (the head: pairs (feature j,
                                 # token j+1); a DFlash drafter: feature j)
    pending: torch.Tensor        # (n, raw width) raw features of positions kv_end .. kv_end + n - 1
    last_hidden: torch.Tensor | None = None  # head output at the newest pair: predicts the root's child
                                 # (a DFlash drafter: set once caught up; it drafts without it)
    last_logp: torch.Tensor | None = None    # the head's draft log-probabilities there (the root's children)
    slots: torch.Tensor | None = None        # the draft KV's slots from kv_start, as far as ``context`` read them


class ModelSource:
    """What both draft models share: the draft KV, the request's readable context, the features."""

    name: Source

    def __init__(self, runner: ModelRunner, pool: BlockPool, model: EagleHead | DFlashDrafter,
                 verify_layers: tuple[int, ...], spare: int = 0):
        """``verify_layers``: the target layers whose features the verify forward computes (this
        model's among them), in the order ``observe`` receives them; ``spare``: slots of the draft
        KV past the pool's blocks, owned by no request (``ModelRunner.head_kv``)."""
        self.runner, self.pool, self.model = runner, pool, model
        c = model.config.layer
        self.kv = runner.head_kv(model.config.num_layers, c.num_kv_heads, c.head_dim, spare)
        self.aux_layers: tuple[int, ...] = tuple(model.config.aux_layers)
        self._picks = [verify_layers.index(i) for i in self.aux_layers]
        self._raw_width = (len(self.aux_layers) or 1) * runner.config.hidden_size

    # ---- the DraftSource contract ------------------------------------------------------

    def start(self, req: Request) -> ModelState:
        n = req.num_computed
        return ModelState(n, n, torch.zeros(0, self._raw_width, device=self.runner.device))

    def offer(self, req: Request, st: ModelState, cap: int) -> Reach:
        """Node counts and units by depth, up to ``cap`` nodes, once the model has seen (or can catch
        up to) every feature before the root."""
        if not self.ready(req, st):
            return NO_REACH
        nodes = tuple(n for n in (self.nodes(k) for k in range(1, self.max_depth + 1)) if n <= cap)
        return Reach(nodes, tuple(self.units(k) for k in range(1, len(nodes) + 1)))

    def due(self, st: ModelState, drafting: bool, stale: bool) -> bool:
        """Whether ``st`` is caught up this step: it drafts, or its queue passed ``MAX_PENDING``
        (dropped instead when the model is stale)."""
        if drafting:
            return True
        if len(st.pending) < MAX_PENDING:
            return False
        if stale:
            st.kv_end += len(st.pending)
            st.kv_start, st.pending, st.last_hidden, st.last_logp = st.kv_end, st.pending[:0], None, None
            st.slots = None
            return False
        return True

    def observe(self, st: ModelState, final: torch.Tensor, aux: list[torch.Tensor]) -> None:
        """Queue the raw features of these target positions: this model's layers side by side (from
        the verify's ``aux``), or the final hidden states."""
        feats = torch.cat([aux[i] for i in self._picks], dim=-1) if self._picks else final
        st.pending = torch.cat([st.pending.to(feats.dtype), feats])  # the queue starts empty in fp32; a bf16 target's features set its dtype

    def release(self, req: Request, st: ModelState | None) -> None:
        """Nothing to keep: the draft KV goes back with the request's blocks."""

    # ---- shared by both models ---------------------------------------------------------

    def ready(self, req: Request, st: ModelState) -> bool:
        """Whether the model has seen, or can catch up to, every feature before the root."""
        return st.kv_end + len(st.pending) == req.num_tokens - 1 and (len(st.pending) > 0 or st.last_hidden is not None)

    def caught_up(self, req: Request, st: ModelState) -> bool:
        """Whether the model has seen every feature before the root (catch-up ran for it this step)."""
        return st.last_hidden is not None and st.kv_end == req.num_tokens - 1

    def context(self, req: Request, st: ModelState) -> torch.Tensor:
        """Flat slots of the draft KV this request may read: positions kv_start .. kv_end - 1. Kept
        and extended as the context grows (a committed position's slot never moves); restarted
        where the context restarts (``due``)."""
        if st.slots is None:
            st.slots = torch.zeros(0, dtype=torch.long, device=self.runner.device)
        have = st.kv_start + len(st.slots)
        if have < st.kv_end:
            more = torch.tensor(self.pool.slot_mapping(req.table, have, st.kv_end), dtype=torch.long)
            st.slots = torch.cat([st.slots, more.to(self.runner.device)])
        return st.slots[: st.kv_end - st.kv_start]

    @property
    def max_depth(self) -> int:
        raise NotImplementedError

    def nodes(self, depth: int) -> int:
        raise NotImplementedError

    def units(self, depth: int) -> int:
        raise NotImplementedError


class HeadSource(ModelSource):
    """An EAGLE head: catch-up over feature/token pairs, then an EAGLE-2 tree, both one graph."""

    name: Source = "head"
    SPARE = 64  # the head cache's spare slots: the fed nodes of a tree up to depth 9 at top-k 8

    def __init__(self, runner: ModelRunner, pool: BlockPool, head: EagleHead, tree: TreeConfig,
                 verify_layers: tuple[int, ...]):
        super().__init__(runner, pool, head, verify_layers, self.SPARE)
        self.tree = tree
        self.graph = HeadGraph(head, self.kv, runner.kv.num_blocks * runner.block_size, self.SPARE)

    def prewarm(self) -> None:
        """Where the target's steps are compiled, load or build the head's package (on the compile
        thread, after the target's graphs); it drafts eagerly until then."""
        compiled = self.runner.compiled
        if compiled is not None:
            self.graph.request(compiled.package_dir, compiled.worker)

    @property
    def max_depth(self) -> int:
        return self.tree.depth

    def nodes(self, depth: int) -> int:
        """Tree nodes drafted at ``depth``: the configured tree's share, as a tree can hold."""
        t = self.tree
        return min(t.num_nodes, TreeConfig(depth, t.top_k, 1).pool_size, max(depth, -(-t.num_nodes * depth // t.depth)))

    def units(self, depth: int) -> int:
        return depth  # the root's logits, then a head forward and its logits per level below

    @torch.inference_mode()
    def catch_up(self, reqs: list[Request], states: list[ModelState]) -> int:
        """One head forward over every request's unseen (feature, next token) pairs; returns the pairs."""
        todo = [(r, st) for r, st in zip(reqs, states) if len(st.pending)]
        if not todo:
            return 0
        self.prewarm()
        ids, pos, hidden, seqs, slots = [], [], [], [], []
        for r, st in todo:
            n = len(st.pending)
            ids.append(torch.tensor(r.all_ids[st.kv_end + 1: st.kv_end + 1 + n]))
            pos.append(torch.arange(st.kv_end, st.kv_end + n))
            hidden.append(st.pending)
            ctx = self.context(r, st)
            seqs.append(SeqAttention(len(ctx), n, r.table.blocks, "causal", ctx))
            slots.append(torch.tensor(self.pool.slot_mapping(r.table, st.kv_end, st.kv_end + n)))
        dev = self.runner.device
        rows, context, mask = self.graph.sequences(seqs)
        out, logp = self.graph(torch.cat(ids).to(dev), self.model.project(torch.cat(hidden)), torch.cat(pos).to(dev),
                               rows, context, mask, torch.cat(slots).to(dev))
        offset = 0
        for _, st in todo:
            n = len(st.pending)
            offset += n
            st.last_hidden, st.last_logp = out[offset - 1], logp[offset - 1]
            st.kv_end += n
            st.pending = st.pending[:0]
        return offset

    @torch.inference_mode()
    def propose(self, req: Request, st: ModelState, depth: int, nodes: int) -> DraftTree:
        root = req.all_ids[-1]
        if not self.caught_up(req, st):
            return DraftTree([root], [-1])
        if st.last_logp is None:
            st.last_logp = torch.log_softmax(self.model.logits(st.last_hidden[None])[0], -1)
        config = TreeConfig(depth, self.tree.top_k, nodes)
        return draft_tree(self.graph, root, st.last_logp, st.last_hidden, self.context(req, st), req.num_tokens - 1,
                          config, req.remaining - 1)


class BlockSource(ModelSource):
    """A DFlash drafter: features become KV at catch-up; one block forward drafts a chain."""

    name: Source = "block"

    @property
    def max_depth(self) -> int:
        return self.model.config.block_size - 1

    def nodes(self, depth: int) -> int:
        return depth  # a chain

    def units(self, depth: int) -> int:
        return 1  # one forward whatever the depth

    @torch.inference_mode()
    def catch_up(self, reqs: list[Request], states: list[ModelState]) -> int:
        """Write each unseen position's context key and value, in every draft layer; returns the positions."""
        todo = [(r, st) for r, st in zip(reqs, states) if len(st.pending)]
        if not todo:
            return 0
        dev = self.runner.device
        pos, feats, slots = [], [], []
        for r, st in todo:
            n = len(st.pending)
            pos.append(torch.arange(st.kv_end, st.kv_end + n))
            feats.append(st.pending)
            slots.append(torch.tensor(self.pool.slot_mapping(r.table, st.kv_end, st.kv_end + n)))
        k, v = self.model.context_kv(self.model.project(torch.cat(feats)), torch.cat(pos).to(dev))
        self.runner.store_head_kv(self.kv, torch.cat(slots).to(dev), k, v)
        positions = 0
        for _, st in todo:
            positions += len(st.pending)
            st.kv_end += len(st.pending)
            st.last_hidden = st.pending[-1]  # marks "caught up"; a block draft needs no hidden state
            st.pending = st.pending[:0]
        return positions

    @torch.inference_mode()
    def propose(self, req: Request, st: ModelState, depth: int, nodes: int) -> DraftTree:
        root, start = req.all_ids[-1], req.num_tokens - 1
        depth = min(depth, nodes, self.max_depth, req.remaining - 1)
        if depth < 1 or not self.caught_up(req, st):
            return DraftTree([root], [-1])
        dev = self.runner.device
        ctx = self.context(req, st)
        # The whole block, as trained: rows attend to the masks after them too, so a shorter block
        # would change every row. The chain is cut to ``depth`` after.
        size = self.model.config.block_size
        ids = torch.tensor(self.model.block_ids(root, size), device=dev)
        pos = torch.arange(start, start + size, device=dev)
        # The block's own keys are not stored (slot mapping None): they exist for this forward only.
        meta = AttentionMetadata([SeqAttention(len(ctx), size, req.table.blocks, "bidirectional", ctx)], None,
                                 self.runner.block_size)
        h = self.model(ids, pos, self.runner.attention(self.kv, meta))
        tokens = self.model.to_target(self.model.logits(h[1:depth + 1]).argmax(-1)).tolist()
        return DraftTree([root] + tokens, list(range(-1, depth)))
