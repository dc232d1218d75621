"""The EAGLE head's forward as one graph of tensors, the same for catch-up and for every tree level.

Run eagerly op by op, a level of the head costs some 40 small ops (0.7 ms on the default
model's head, 2 cores) plus a gather of the prefix's keys per level, and a step drafts two or
three levels and one catch-up. Here the head's forward is the target step's ``rows`` form
(``engine.attention.padded``): padded rows, a context of KV slots per sequence and a mask over
[context | new rows], attention read straight from the head's paged cache, new keys and values
returned for the caller to store. The two uses differ only in their inputs:

  catch-up   every drafting request's unseen (feature, next token) pairs, causal among
             themselves, over the request's own draft context; stored at their real slots;
  a level    the k frontier nodes of a tree, each seeing the prefix, its fed ancestors
             and itself; the fed nodes' keys sit in ``spare`` slots of the head's cache,
             past the pool's blocks, so a level reads them as it reads the prefix.

So one graph serves both, and the output head with its log-softmax is inside it. Where the
target's steps are compiled (``ModelRunner.compile``), the graph is an AOTInductor package
built once per host and head on the same compile thread after the target's graphs; until then,
and without compiled steps, the very module runs eagerly. A draft only proposes: which tokens
come out is decided by the target's verify, so eager and packaged drafts may differ in their
last bits and the output stays the target's.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

import torch
from torch import nn

from dualserve.models import kernels

from ..engine.attention.padded import PaddedPagedAttention, StepShape
from ..engine.attention.paged_attention import AttentionMetadata, KVCache, SeqAttention, padded_rows
from ..engine.compile import aoti, cuda_shaped
from ..engine.compile.step_graph import PACKAGE_INDUCTOR
from .tree import DraftTree, TreeConfig, grow_tree

log = logging.getLogger("dualserve.compile")


class HeadForward(nn.Module):
    """The head over a padded rows step. Inputs: target token ids (T,), hidden (T, hidden),
    positions (T,), the padded attention's ``rows`` (S, Q), ``context`` (S, W), ``mask``
    (S, Q, W + Q) and the head's KV ``stacked`` view. Outputs: the head's output h (T, hidden),
    draft log-probabilities (T, draft vocab), new keys and values (layers, T, kv_heads, head_dim).

    The target's embedding (and an EAGLE-1 head's output head) are registered here too, by
    reference, so a package takes them as inputs like the head's own weights."""

    def __init__(self, head: nn.Module, attend_kernel: bool = True):
        super().__init__()
        self.head = head
        target = head.target[0]
        self.target_embedding = target.embed_tokens
        self.target_head = target.lm_head  # None when tied (then the embedding is the head)
        self.attend_kernel = attend_kernel

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor,
                context: torch.Tensor, mask: torch.Tensor, stacked: torch.Tensor) -> tuple[torch.Tensor, ...]:
        attn = PaddedPagedAttention(stacked, None, rows, context, mask, False, self.attend_kernel)
        h = self.head(ids, hidden, pos, attn)
        logp = torch.log_softmax(self.head.logits(h), dim=-1)
        return h, logp, torch.stack(attn.new_k), torch.stack(attn.new_v)


def dynamic_dims() -> tuple[dict[int, object], ...]:
    """HeadForward's varying dims for ``torch.export``: the rows step's, with ``hidden`` beside the ids."""
    ids, *rest = StepShape(False).dynamic_dims()
    return (ids, {0: torch.export.Dim.AUTO}, *rest)


class HeadGraph:
    """The head's forward (``HeadForward``) over its KV cache: eager until its package is ready.

    ``cache``: the head's KV, with at least ``spare`` slots past ``spare_start`` that no request
    owns (tree nodes while a tree grows, and the example steps a build traces)."""

    def __init__(self, head: nn.Module, cache: KVCache, spare_start: int, spare: int,
                 attend_kernel: bool = True):
        self.cache = cache
        self.spare_start, self.spare = spare_start, spare
        self.device = cache.stacked.device
        self.module = HeadForward(head, attend_kernel and kernels.available() and self.device.type == "cpu")
        self._graph: Callable[..., Sequence[torch.Tensor]] | None = None
        self._asked = False
        self._lock = threading.Lock()
        self.how: str | None = None  # built / loaded, once the package runs
        self.seconds = 0.0

    # ---- running ------------------------------------------------------------------------

    def __call__(self, ids: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor,
                 context: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward; stores the new keys and values at ``slots`` (T,); returns (h, log-probs)."""
        graph = self._graph
        inputs = (ids, hidden, pos, rows.to(self.device), context.to(self.device), mask.to(self.device),
                  self.cache.stacked)
        h, logp, k, v = graph(*inputs) if graph is not None else self.module(*inputs)
        self.cache.store(slots, k, v)
        return h, logp

    def sequences(self, seqs: list[SeqAttention]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows, context, mask) of a catch-up over these sequences (causal among their new rows)."""
        meta = AttentionMetadata(seqs, None, self.cache.block_size)
        return padded_rows(meta, range(len(seqs)))

    @staticmethod
    def level(prefix: torch.Tensor, fed: torch.Tensor, visible: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(rows, context, mask) of one tree level: k nodes over ``prefix`` slots (all seen), then the
        ``fed`` nodes' slots (``visible`` (k, fed): a node's ancestors), then themselves."""
        k = visible.shape[0]
        context = torch.cat([prefix.cpu(), fed.cpu()])
        seen = torch.cat([torch.ones(k, len(prefix), dtype=torch.bool), visible.cpu()], 1)
        if len(context) < 2:  # the rows form pads its context to at least 2 slots, unseen
            pad = 2 - len(context)
            context = torch.cat([context, torch.zeros(pad, dtype=torch.long)])
            seen = torch.cat([seen, torch.zeros(k, pad, dtype=torch.bool)], 1)
        mask = torch.cat([seen, torch.eye(k, dtype=torch.bool)], 1)
        return torch.arange(k)[None], context[None], mask[None]

    # ---- the package -----------------------------------------------------------------------

    def request(self, package_dir, worker) -> None:
        """Load or build the package: on ``worker``'s thread (eager until it is ready), or here."""
        if self._asked:  # asked every catch-up: no lock once it has been
            return
        with self._lock:
            if self._asked or not aoti.available(self.device) or cuda_shaped.active():  # CUDA drafts eagerly
                return
            self._asked = True
        job = lambda: self._package(package_dir, worker)  # noqa: E731
        if worker is None:
            job()
        else:
            worker.submit(job, name="eagle head")

    def _package(self, package_dir, worker) -> None:
        start = time.perf_counter()
        where = "" if worker is None else " (graph {} of {})".format(*worker.position())
        module = self.module
        sources = aoti.traced_sources(module, PaddedPagedAttention, HeadForward)
        digest = aoti.package_key(module, sources, self.cache.dtype, "head", sorted(PACKAGE_INDUCTOR.items()),
                                  module.attend_kernel, kernels.library_path().name if kernels.available() else None)
        try:
            # A draft only proposes, so the package need not be the eager module's bits (module docstring).
            graph, how = aoti.load_or_build(
                module, package_dir / f"head-{digest}.pt2", self._inputs, dynamic_dims(), PACKAGE_INDUCTOR,
                example=4, checks=(3, 5), tolerance=0.2,
                announce=lambda: log.info("building the EAGLE head's forward%s in a child process: once per host "
                                          "and head; it drafts eagerly until it is ready", where),
                progress=lambda s: log.info("building the EAGLE head's forward%s: %.0f s so far", where, s))
        except aoti.BuildCancelled:
            return
        except Exception:  # noqa: BLE001 - a compiler failure leaves the head eager
            log.warning("compiling the EAGLE head's forward failed; it drafts eagerly", exc_info=True)
            return
        self.seconds = time.perf_counter() - start
        self.how = how
        log.info("%s the EAGLE head's forward in %.1f s%s", how, self.seconds, where)
        self._graph = graph

    def _inputs(self, n: int) -> tuple[torch.Tensor, ...]:
        """Example inputs over spare slots only: two sequences of different context and query lengths."""
        spare = self.spare_start + torch.arange(self.spare)
        queries = [n, max(1, n - 2)]
        seqs = [SeqAttention(n + i, q, [], "causal", spare[: n + i]) for i, q in enumerate(queries)]
        rows, context, mask = self.sequences(seqs)
        total = sum(queries)
        head = self.module.head
        width = head.config.layer.hidden_size
        ids = torch.arange(total, device=self.device) % 7 + 3
        hidden = torch.randn(total, width, generator=torch.Generator().manual_seed(n)).to(self.device)
        pos = torch.cat([torch.arange(q) + n + i for i, q in enumerate(queries)]).to(self.device)
        return (ids, hidden, pos, rows.to(self.device), context.to(self.device), mask.to(self.device),
                self.cache.stacked)


def draft_tree(graph: HeadGraph, root: int, root_logp: torch.Tensor, root_hidden: torch.Tensor,
               prefix: torch.Tensor, position: int, config: TreeConfig, max_depth: int) -> DraftTree:
    """An EAGLE-2 tree (``tree.grow_tree``) from the root at ``position``, the head's levels run by
    ``graph`` over the ``prefix`` slots of its cache, the fed nodes in its spare slots."""
    head = graph.module.head
    dev = graph.device

    def expand(tokens: torch.Tensor, hidden: torch.Tensor, level: int,
               visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, fed = visible.shape
        if fed + k > graph.spare:
            raise ValueError(f"a tree of {fed + k} fed nodes needs more than the head's {graph.spare} spare slots")
        spare = graph.spare_start + torch.arange(fed + k)
        rows, context, mask = graph.level(prefix, spare[:fed], visible)
        pos = torch.full((k,), position + level - 1, device=dev)
        return graph(tokens.to(dev), hidden, pos, rows, context, mask, spare[fed:].to(dev))

    return grow_tree(expand, head.to_target, root, root_logp, root_hidden, config, max_depth)


def fed_nodes(config: TreeConfig) -> int:
    """The most nodes a tree of ``config`` feeds to the head: top_k a level below the root's."""
    return (config.depth - 1) * config.top_k
