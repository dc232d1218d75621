"""The model draft source of ``eagle``: an EAGLE head growing a tree, or a DFlash drafter proposing a block.

Both read the target's features of committed positions and keep their own KV in a
``KVCache`` indexed by the target's block tables (a request's blocks hold both), so
the decoder drives them the same way each step:

  1. ``catch_up``: consume the features of positions not yet seen
     (``EagleState.pending``), writing KV at those positions' slots;
  2. ``draft``: from the last committed token (the root), propose a ``DraftTree``
     of at most ``depth`` levels and ``nodes`` nodes.

* ``HeadDrafter`` (EAGLE-1/2/3): catch-up runs the head over (feature j, token j+1)
  pairs; drafting grows an EAGLE-2 tree level by level, one head forward a level
  (``tree.grow_tree``). A deeper draft costs more.
* ``BlockDrafter`` (DFlash, ``models/dflash.py``): catch-up projects each feature into
  every draft layer's key and value (no layer runs); drafting is ONE forward over
  [root, mask, ...] with the block attending to itself in both directions, and the
  argmax of each row is the chain's next token. Any depth up to ``block_size - 1``
  costs about the same.

Each times its own catch-up and drafting, so the budget (``budget.py``) can weigh them
against the verify cost: ``seconds(depth)`` is the drafting time expected at that depth.
"""

from __future__ import annotations

import torch

from dualserve.models.dflash import DFlashDrafter
from dualserve.models.eagle import EagleHead

from ..engine.blocks import BlockPool
from ..engine.paged_attention import AttentionMetadata, SeqAttention
from ..engine.request import Request
from ..engine.runner import ModelRunner
from .tree import DraftTree, DraftTreeAttention, TreeConfig, grow_tree

EMA = 0.3  # weight of the newest drafting-time observation
STEADY_POSITIONS = 8  # a catch-up over at most this many positions is a drafting request's steady one


class _Drafter:
    """What both sources share: the draft KV, the request's readable context, timing."""

    def __init__(self, runner: ModelRunner, pool: BlockPool, model: EagleHead | DFlashDrafter):
        self.runner, self.pool, self.model = runner, pool, model
        c = model.config.layer
        self.kv = runner.head_kv(model.config.num_layers, c.num_kv_heads, c.head_dim)
        self.aux_layers: tuple[int, ...] = tuple(model.config.aux_layers)
        self.unit_seconds: float | None = None  # EMA: seconds per drafting unit (see ``units``)
        self.catch_up_seconds: float | None = None  # EMA: seconds of a steady catch-up

    def context(self, req: Request, st) -> torch.Tensor:
        """Flat slots of the draft KV this request may read: positions head_start .. head_len - 1."""
        return torch.tensor(self.pool.slot_mapping(req.table, st.head_start, st.head_len), dtype=torch.long,
                            device=self.runner.device)

    def features(self, final: torch.Tensor, aux: list[torch.Tensor], layers: tuple[int, ...]) -> torch.Tensor:
        """What target positions contribute, raw: the verify's features of this model's layers side by
        side (from ``layers``, a superset), or the final hidden states. The model's projection of
        them (``project``) runs at catch-up, once over every pending position, and never for
        positions whose features are dropped: a step the source does not draft costs nothing."""
        picked = [aux[layers.index(i)] for i in self.aux_layers]
        return torch.cat(picked, dim=-1) if picked else final

    @property
    def raw_width(self) -> int:
        """The width of ``features``' rows."""
        return (len(self.aux_layers) or 1) * self.runner.config.hidden_size

    def ready(self, req: Request, st) -> bool:
        """Whether the source has seen, or can catch up to, every feature before the root."""
        return st.head_len + len(st.pending) == req.num_tokens - 1 and (
            len(st.pending) > 0 or st.last_hidden is not None)

    def observe_catch_up(self, seconds: float, positions: float) -> None:
        """A catch-up over ``positions`` unseen positions took ``seconds``. Only a drafting request's
        steady catch-up (the few positions its last step committed) trains the estimate: a backlog
        left by plain steps is paid once, when drafting resumes, not every step."""
        if 0 < positions <= STEADY_POSITIONS:
            self.catch_up_seconds = seconds if self.catch_up_seconds is None else \
                self.catch_up_seconds + EMA * (seconds - self.catch_up_seconds)

    def observe(self, seconds: float, depths: list[int]) -> None:
        """This step's drafts, of these depths, took ``seconds`` (catch-up not included)."""
        units = sum(self.units(d) for d in depths if d)
        if units:
            per = seconds / units
            self.unit_seconds = per if self.unit_seconds is None else self.unit_seconds + EMA * (per - self.unit_seconds)

    def seconds(self, depth: int, target_step: float) -> float:
        """Expected drafting seconds at ``depth``, a steady catch-up included; before any measurement,
        a guess from the target's one-token step: the catch-up and a unit each cost a quarter of it
        (one layer and the logits)."""
        unit = self.unit_seconds if self.unit_seconds is not None else 0.25 * target_step
        catch_up = self.catch_up_seconds if self.catch_up_seconds is not None else 0.25 * target_step
        return catch_up + unit * self.units(depth)

    def units(self, depth: int) -> int:
        raise NotImplementedError


class HeadDrafter(_Drafter):
    """An EAGLE head: catch-up over feature/token pairs, then an EAGLE-2 tree."""

    def __init__(self, runner: ModelRunner, pool: BlockPool, head: EagleHead, tree: TreeConfig):
        super().__init__(runner, pool, head)
        self.tree = tree

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
    def catch_up(self, reqs: list[Request]) -> None:
        """One head forward over every request's unseen (feature, next token) pairs."""
        reqs = [r for r in reqs if len(r.decoder_state.pending)]
        if not reqs:
            return
        ids, pos, hidden, seqs, slots = [], [], [], [], []
        for r in reqs:
            st = r.decoder_state
            n = len(st.pending)
            ids.append(torch.tensor(r.all_ids[st.head_len + 1: st.head_len + 1 + n]))
            pos.append(torch.arange(st.head_len, st.head_len + n))
            hidden.append(st.pending)
            ctx = self.context(r, st)
            seqs.append(SeqAttention(len(ctx), n, r.table.blocks, "causal", ctx))
            slots.append(torch.tensor(self.pool.slot_mapping(r.table, st.head_len, st.head_len + n)))
        dev = self.runner.device
        meta = AttentionMetadata(seqs, torch.cat(slots).to(dev), self.runner.block_size)
        out = self.model(torch.cat(ids).to(dev), self.model.project(torch.cat(hidden)), torch.cat(pos).to(dev),
                         self.runner.attention(self.kv, meta))
        offset = 0
        for r in reqs:
            st = r.decoder_state
            n = len(st.pending)
            offset += n
            st.last_hidden = out[offset - 1]
            st.head_len += n
            st.pending = st.pending[:0]

    @torch.inference_mode()
    def draft(self, req: Request, st, depth: int, nodes: int) -> DraftTree:
        root = req.all_ids[-1]
        attn = DraftTreeAttention(self.kv, self.context(req, st))
        config = TreeConfig(depth, self.tree.top_k, nodes)
        return grow_tree(self.model, attn, root, st.last_hidden, req.num_tokens - 1, config, req.remaining - 1)


class BlockDrafter(_Drafter):
    """A DFlash drafter: features become KV at catch-up; one block forward drafts a chain."""

    def __init__(self, runner: ModelRunner, pool: BlockPool, drafter: DFlashDrafter):
        super().__init__(runner, pool, drafter)

    @property
    def max_depth(self) -> int:
        return self.model.config.block_size - 1

    def nodes(self, depth: int) -> int:
        return depth  # a chain

    def units(self, depth: int) -> int:
        return 1  # one forward whatever the depth

    @torch.inference_mode()
    def catch_up(self, reqs: list[Request]) -> None:
        """Write each unseen position's context key and value, in every draft layer."""
        reqs = [r for r in reqs if len(r.decoder_state.pending)]
        if not reqs:
            return
        dev = self.runner.device
        pos, feats, slots = [], [], []
        for r in reqs:
            st = r.decoder_state
            n = len(st.pending)
            pos.append(torch.arange(st.head_len, st.head_len + n))
            feats.append(st.pending)
            slots.append(torch.tensor(self.pool.slot_mapping(r.table, st.head_len, st.head_len + n)))
        k, v = self.model.context_kv(self.model.project(torch.cat(feats)), torch.cat(pos).to(dev))
        self.runner.store_head_kv(self.kv, torch.cat(slots).to(dev), k, v)
        for r in reqs:
            st = r.decoder_state
            st.head_len += len(st.pending)
            st.last_hidden = st.pending[-1]  # marks "caught up"; a block draft needs no hidden state
            st.pending = st.pending[:0]

    @torch.inference_mode()
    def draft(self, req: Request, st, depth: int, nodes: int) -> DraftTree:
        root, start = req.all_ids[-1], req.num_tokens - 1
        depth = min(depth, nodes, self.max_depth, req.remaining - 1)
        if depth < 1:
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
