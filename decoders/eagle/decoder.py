"""EAGLE speculative decoding over the shared paged KV pool.

A step of an EAGLE request (Li et al., EAGLE-1/2/3; the tree rules live in
``tree.py``):

  1. **catch up**: the draft head consumes the target features of positions it
     has not seen (the prompt after prefill, then each step's accepted tokens),
     writing its own one-layer KV at those positions' slots;
  2. **draft**: from the head's output at the last committed token (the "root"),
     grow an EAGLE-2 tree (or a chain); tree nodes live in scratch tensors;
  3. **verify**: ONE target forward over root + tree with a tree attention mask
     on top of the paged KV, writing into the request's lookahead slots (the
     scheduler reserved them from ``plan``), capturing the features EAGLE needs;
  4. **accept**: greedy longest match or lossless rejection sampling, plus the
     target's bonus token; the accepted nodes' KV moves into place
     (``ModelRunner.move_slots``), rejected slots go back to the pool
     (``BlockPool.truncate``), and tokens go out through ``Request.commit``,
     which alone applies EOS, stop strings and max_tokens.

Prefill is plain chunked target computation up to (not including) the last
prompt token, which becomes the first root; so every emitted token comes out
of a verify step and the output equals plain AR decoding token for token at
temperature 0, and in distribution otherwise.

The head's KV is a ``KVCache`` with the head's own layer count, indexed by the
SAME block tables as the target's: a request's blocks hold both. Positions whose
blocks came from the prefix cache have no head KV (another decoder may have
written them), so the head attends only from where this request started
computing; drafts get a shorter context there, results stay exact.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from dualserve.models.assets import default_eagle_head
from dualserve.models.eagle import EagleHead, load_eagle_head
from dualserve.models.loader import LoadedModel

from ..ar import fill_prompt_logprobs
from ..engine.blocks import BlockPool, slot_of
from ..engine.isolation import guard
from ..engine.paged_attention import AttentionMetadata, SeqAttention
from ..engine.request import DecoderCounters, DecoderState, Request
from ..engine.runner import ForwardItem, ModelRunner
from ..engine.sampling import process_logits, token_logprobs, truncated_probs
from ..engine.scheduler import Scheduled
from .tree import DraftTree, DraftTreeAttention, TreeConfig, accept_greedy, accept_sampled, grow_tree

# CPU: measured with the bundled SmolLM2 head (clients/bench_eagle.py). On an AVX2
# CPU a forward over 2..8 tokens costs about twice a 1-token forward (GEMM packs
# the weights, GEMV streams them), so small trees win until acceptance is high.
CPU_TREE = TreeConfig(depth=3, top_k=2, num_nodes=4)
# GPU: verify cost is flat in tree size at batch 1; upstream EAGLE-2's evaluation
# setting (depth 5, top-k 10, 60 tokens) scaled to a small target. Not yet measured.
GPU_TREE = TreeConfig(depth=5, top_k=8, num_nodes=48)


@dataclass
class EagleState(DecoderState):
    """Per-request draft state (``Request.decoder_state``; reset to None on preemption)."""

    head_start: int              # first position with head KV (earlier ones came from the prefix cache)
    head_len: int                # head KV holds pairs (feature j, token j+1) for head_start <= j < head_len
    pending: torch.Tensor        # (n, hidden) features of positions head_len .. head_len + n - 1
    last_hidden: torch.Tensor | None = None  # head output at the newest pair: predicts the root's child


@dataclass
class EagleCounters(DecoderCounters):
    """Per-request EAGLE statistics (``Request.counters``)."""

    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted per verify step
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    def report(self) -> dict:
        if not self.accept_lengths:
            return {}
        return {"mean_accept_length": round(sum(self.accept_lengths) / len(self.accept_lengths), 3),
                "draft_seconds": round(self.draft_seconds, 4), "verify_seconds": round(self.verify_seconds, 4)}


class EagleDecoder:
    """EAGLE speculative decoding on the target's runner (a ``Decoder``)."""

    name = "eagle"
    shares_prompt_blocks = True
    supports_infill = False
    default_max_tokens = None

    def __init__(self, runner: ModelRunner, pool: BlockPool, head: EagleHead, tree: TreeConfig | None = None):
        self.runner = runner
        self.pool = pool
        self.head = head
        self.tree = tree or (GPU_TREE if runner.device.type == "cuda" else CPU_TREE)
        c = head.config.layer
        self.kv = runner.head_kv(head.config.num_layers, c.num_kv_heads, c.head_dim)
        self.aux_layers = head.config.aux_layers

    @property
    def kv_owner(self) -> ModelRunner:
        return self.runner

    # ---- scheduling ------------------------------------------------------------

    def plan(self, req: Request, budget: int) -> tuple[int, int]:
        """Prefill chunks stop before the last known token; then one root + a tree of lookahead slots."""
        pending = req.num_tokens - 1 - self.pool.computed_tokens(req.table, req.all_ids, req.uses_prefix_cache)
        if budget <= 0:
            return 0, 0
        if pending > 0:
            return min(pending, budget), 0
        return 1, max(0, min(self.tree.num_nodes, budget - 1, req.remaining - 1))

    # ---- the step --------------------------------------------------------------

    def step(self, batch: Sequence[Scheduled], emit) -> None:
        batch = [s for s in batch if s.num_new_tokens > 0]
        if not batch:
            return
        for s in batch:
            if s.request.decoder_state is None:
                n = s.request.num_computed
                s.request.decoder_state = EagleState(n, n, torch.zeros(0, self.head.config.layer.hidden_size,
                                                                        device=self.runner.device))
        decode = [s for s in batch if s.request.num_computed == s.request.num_tokens - 1]
        started = time.perf_counter()
        self._catch_up([s.request for s in decode])
        trees = {}
        for s in decode:
            with guard(s.request, emit, "drafting"):
                trees[id(s.request)] = self._draft(s)
        batch = [s for s in batch if not s.request.finished]  # a failed draft leaves the step
        if not batch:
            return
        draft_time = time.perf_counter() - started
        started = time.perf_counter()
        items = [self._item(s, trees.get(id(s.request))) for s in batch]
        final, aux = self.runner.forward(items, aux_layers=self.aux_layers)
        offset = 0
        for s, item in zip(batch, items):
            n = len(item.token_ids)
            req = s.request
            req.num_forwards += 1
            rows = slice(offset, offset + n)
            offset += n
            tree = trees.get(id(req))
            with guard(req, emit, "verify"):
                if tree is None:
                    self._prefilled(req, n, final[rows], [a[rows] for a in aux])
                    continue
                counters = req.counters_of(EagleCounters)
                counters.draft_seconds += draft_time
                self._verify(req, tree, final[rows], [a[rows] for a in aux], emit)
                counters.verify_seconds += time.perf_counter() - started

    def _item(self, s: Scheduled, tree: DraftTree | None) -> ForwardItem:
        req = s.request
        start = req.num_computed
        table = req.table.blocks
        if tree is None:
            end = start + s.num_new_tokens
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
        state.pending = torch.cat([state.pending, self.head.features(final, aux)])
        self.pool.mark_written(req.table, req.all_ids, start + n)

    # ---- draft -----------------------------------------------------------------

    @torch.inference_mode()
    def _catch_up(self, reqs: list[Request]) -> None:
        """One head forward over every request's unseen (feature, next token) pairs."""
        reqs = [r for r in reqs if len(r.decoder_state.pending)]
        if not reqs:
            return
        ids, pos, hidden, seqs, slots = [], [], [], [], []
        for r in reqs:
            st: EagleState = r.decoder_state
            n = len(st.pending)
            ids.append(torch.tensor(r.all_ids[st.head_len + 1: st.head_len + 1 + n]))
            pos.append(torch.arange(st.head_len, st.head_len + n))
            hidden.append(st.pending)
            ctx = self._head_context(r, st)
            seqs.append(SeqAttention(len(ctx), n, r.table.blocks, "causal", ctx))
            slots.append(torch.tensor(self.pool.slot_mapping(r.table, st.head_len, st.head_len + n)))
        dev = self.runner.device
        meta = AttentionMetadata(seqs, torch.cat(slots).to(dev), self.runner.block_size)
        out = self.head(torch.cat(ids).to(dev), torch.cat(hidden), torch.cat(pos).to(dev),
                        self.runner.attention(self.kv, meta))
        offset = 0
        for r in reqs:
            st = r.decoder_state
            n = len(st.pending)
            offset += n
            st.last_hidden = out[offset - 1]
            st.head_len += n
            st.pending = st.pending[:0]

    def _head_context(self, req: Request, st: EagleState) -> torch.Tensor:
        """Flat slots of the head KV this request may read: positions head_start .. head_len - 1."""
        return torch.tensor(self.pool.slot_mapping(req.table, st.head_start, st.head_len), dtype=torch.long,
                            device=self.runner.device)

    @torch.inference_mode()
    def _draft(self, s: Scheduled) -> DraftTree:
        req = s.request
        st: EagleState = req.decoder_state
        root = req.all_ids[-1]
        # The head must have seen the pair ending at the root, and the slots must be reserved.
        # A grammar constraint's state cannot branch, so constrained requests go token by token.
        if (st.last_hidden is None or st.head_len != req.num_tokens - 1 or s.num_lookahead == 0
                or req.constraint is not None):
            return DraftTree([root], [-1])
        attn = DraftTreeAttention(self.kv, self._head_context(req, st))
        depth_cap = min(req.remaining - 1, s.num_lookahead)
        config = self.tree if s.num_lookahead >= self.tree.num_nodes else TreeConfig(
            self.tree.depth, self.tree.top_k, min(s.num_lookahead, self.tree.pool_size))
        return grow_tree(self.head, attn, root, st.last_hidden, req.num_tokens - 1, config, depth_cap)

    # ---- verify ----------------------------------------------------------------

    def _verify(self, req: Request, tree: DraftTree, final: torch.Tensor, aux: list[torch.Tensor], emit) -> None:
        params = req.params
        cache: dict[int, torch.Tensor] = {}

        def raw(node: int) -> torch.Tensor:
            if node not in cache:
                cache[node] = self.runner.logits(final[node: node + 1])[0]  # (vocab,) fp32
            return cache[node]

        def processed(node: int, accepted: list[int]) -> torch.Tensor:
            # Stateless penalties over the path so far: the request's running counts only
            # advance once tokens are committed.
            logits = process_logits(raw(node), req.prompt_ids, req.output_ids + accepted, params)
            return logits if req.constraint is None else req.constraint.mask_logits(logits)

        if params.greedy:
            path, bonus = accept_greedy(tree, processed)
        else:
            path, bonus = accept_sampled(tree, lambda n, acc: truncated_probs(processed(n, acc), params),
                                         req.generator)
        tokens = [tree.tokens[n] for n in path] + [bonus]
        if req.constraint is not None:  # root-only tree: exactly one token
            req.constraint.consume(bonus)
        req.counters_of(EagleCounters).accept_lengths.append(len(tokens))
        logprobs = None
        if params.logprobs is not None:
            parents = [0] + path  # each emitted token was predicted at its parent node
            logprobs = [token_logprobs(raw(p)[None], [t], params.logprobs)[0] for p, t in zip(parents, tokens)]
        start = req.num_computed  # the root's position
        delta = req.commit(tokens, logprobs)
        if delta.finish_reason is None:
            self._keep_path(req, path, start, final, aux)
        emit(req, delta)

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
        st: EagleState = req.decoder_state
        st.pending = torch.cat([st.pending, self.head.features(final[rows], [a[rows] for a in aux])])


def eagle_decoder(loaded: LoadedModel, runner: ModelRunner, pool: BlockPool, head_path: Path | str | None = None,
                  tree: TreeConfig | None = None) -> EagleDecoder | None:
    """An EAGLE decoder for ``loaded``: from ``head_path``, else the bundled head for that model, else None."""
    path = Path(head_path) if head_path else default_eagle_head(loaded.name)
    if path is None:
        return None
    return EagleDecoder(runner, pool, load_eagle_head(path, loaded.model), tree)
