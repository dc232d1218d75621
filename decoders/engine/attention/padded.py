"""Paged attention over a padded step: every step in one tensor-only form, so that it traces
into one graph (``compile/compiled.py``) with no Python per layer.

``PaddedPagedAttention`` expresses every step (decode batches, EAGLE trees, diffusion canvases,
prefill chunks) in one form: the S sequences of a step are padded to Q query rows and W cached
slots,

  rows      (S, Q)        row of each query in the flattened batch; padding -> a dummy row T
  context   (S, W)        flat KV slot of each cached token; padding -> slot 0, masked out
  mask      (S, Q, W + Q) what each query sees: valid cached slots, then its own new tokens

and each layer attends in one of the two forms below; the graph returns every layer's
new keys/values, stored at ``slot_mapping`` after it runs (``KVCache.store``). No
Python runs per layer, so there is nothing to gather per sequence.

Attention takes one of two forms, and a step one of two graphs (``StepShape``):

  rows     every sequence brings at most ``ROWS_MAX`` new tokens (decode batches, EAGLE trees,
           diffusion canvases, short prompts). Each query position reduces over its [cached | new]
           keys in one pass, in position order, by the same generated loops whatever the step
           holds: a token's keys, values and hidden state are bit for bit the same whether it is
           decoded alone, verified in a tree, or computed beside other sequences. That is what
           keeps speculation lossless and batching invisible in greedy output.
  chunks   prefill chunks. Where the project's kernels build, attention is the same
           ``attend_rows`` as the rows form's, so a prompt's rows get the bits a decode would
           (docs/numerics.md); elsewhere two batched matmuls, whose cost grows with query rows
           times context far slower than inductor's loops' (a chunk of hundreds of rows).

A step with both kinds of sequences runs each part through its graph (``split``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dualserve.models.kernels import ops as kernel_ops
from .paged_attention import AttentionMetadata, KVCache, as_stored, padded_rows

# New tokens per sequence up to which a step runs the rows form (see the module docstring): CPU
# verify trees (at most 21 tokens) and diffusion canvases. Above it the matmuls are cheaper (on
# the default model, 128 cached tokens: 16 rows cost 35.9 ms as rows and 29.7 ms as matmuls).
ROWS_MAX = 24
# The rows form's products (query rows x positions x heads x head_dim) that an eager run materialises
# at once; above it the sums run a few rows at a time (``PaddedPagedAttention._rows``). Graphs fuse
# them into loops and never materialise them.
EAGER_ROWS_ELEMENTS = 2**25


class PaddedPagedAttention:
    """Paged attention over a padded step; tensors only, so it traces into one graph."""

    def __init__(self, stacked: torch.Tensor, slot_mapping: torch.Tensor | None, rows: torch.Tensor,
                 context: torch.Tensor, mask: torch.Tensor, chunks: bool, attend_kernel: bool = True):
        self.chunks = chunks                       # the form: matmuls (prefill chunks) or rows
        self.attend_kernel = attend_kernel         # attend_rows where the kernels are built
        self.stacked = stacked                     # (2 * layers, slots, kv_heads, head_dim): keys, then values
        self.layers = stacked.shape[0] // 2
        self.slot_mapping = slot_mapping           # (T,); None inside the graph (the caller stores)
        self.rows = rows                           # (S, Q)
        self.context = context                     # (S, W)
        self.mask = mask                           # (S, Q, W + Q) bool
        # Each layer's new keys and values, as stored (cache dtype), in layer order. The graph
        # returns them and the caller writes the cache (``KVCache.store``) after the forward: a
        # cache write inside the graph is a mutation of a graph input, which inductor may turn into
        # a copy of the whole layer's cache on every step.
        self.new_k: list[torch.Tensor] = []
        self.new_v: list[torch.Tensor] = []

    @classmethod
    def build(cls, cache: KVCache, meta: AttentionMetadata, device, chunks: bool | None = None,
              sizes: "PaddedSizes | None" = None) -> "PaddedPagedAttention":
        """The padded form of ``meta``; ``chunks``: which attention form (default: the one
        ``StepShape.of`` picks for these sequences); ``sizes``: pad to these (S, Q, W, T), at
        least the step's own (a CUDA graph's bucket; the step's tokens then come first in T)."""
        padded = None if sizes is None else (sizes.sequences, sizes.queries, sizes.context, sizes.tokens)
        rows, context, mask = padded_rows(meta, range(len(meta.seqs)), padded)
        slots = meta.slot_mapping
        chunks = StepShape.of(meta).chunks if chunks is None else chunks
        return cls(cache.stacked, slots.to(device), rows.to(device), context.to(device), mask.to(device), chunks)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kc, vc = self.stacked[layer_idx], self.stacked[self.layers + layer_idx]  # (slots, kv_heads, head_dim)
        self.new_k.append(k.to(kc.dtype))
        self.new_v.append(v.to(vc.dtype))
        k, v = as_stored(k, kc), as_stored(v, vc)
        if self.attend_kernel and kernel_ops.attend_eligible(q):
            # the same sums as ``_rows`` (each row over its visible keys alone), vectorised in C++, in
            # both forms: a prompt's rows then get the bits an eager step or a decode would give them
            return kernel_ops.attend_rows(q, k, v, kc, vc, self.rows, self.context, self.mask, q.shape[-1] ** -0.5)
        S, Q = self.rows.shape
        T, heads, d = q.shape
        kv_heads = k.shape[1]
        pad = q.new_zeros(1, heads, d)
        qx = torch.cat([q, pad])[self.rows].view(S, Q, kv_heads, heads // kv_heads, d)  # (S, Q, kv, group, d)
        kx = torch.cat([k, pad[:, :kv_heads]])[self.rows]                                # (S, Q, kv, d)
        vx = torch.cat([v, pad[:, :kv_heads]])[self.rows]
        kg, vg = kc[self.context].to(q.dtype), vc[self.context].to(q.dtype)              # (S, W, kv, d)
        out = self._matmuls(qx, kx, vx, kg, vg) if self.chunks else self._rows(qx, kx, vx, kg, vg)
        return q.new_zeros(T + 1, heads, d).index_copy_(0, self.rows.reshape(-1), out.reshape(S * Q, heads, d))[:T]

    def _rows(self, qx: torch.Tensor, kx: torch.Tensor, vx: torch.Tensor, kg: torch.Tensor,
              vg: torch.Tensor) -> torch.Tensor:
        """Attention as reductions that inductor fuses into loops, each query position summing
        over its [cached | new] keys and values in one pass: scores over the head dim, softmax,
        output over the positions. The cached keys are read straight from the pool by slot.

        Where the cached part ends and the new part begins does not enter the sums, nor does any
        other row or sequence of the step, so a position's output is the same bits in a decode
        step, a verify tree or a batch. (Reduced in two parts, cached then new, a token decoded
        alone and the same token second in a verify differ in the last bits, enough to flip a
        near-tie.) On the default model a decode step costs the same as with a separate graph
        specialised to one query (7.4 ms at 128 cached tokens, 11.8 ms at 800, one thread of
        loops); the loops' cost grows with rows times context, so long prefill chunks take the
        matmuls."""
        ks, vs = torch.cat([kg, kx], 1), torch.cat([vg, vx], 1)                            # (S, W + Q, kv, d)
        if torch.compiler.is_compiling():
            return self._attend(qx, ks, vs, self.mask)
        S, Q, kv_heads, group, d = qx.shape
        per_row = ks.shape[1] * kv_heads * group * d  # the products' elements per query row
        if S * Q * per_row <= EAGER_ROWS_ELEMENTS:
            return self._attend(qx, ks, vs, self.mask)
        # Run eagerly (the EAGLE head off the CPU), the products below are materialised: a sequence
        # and a few query rows at a time keep them bounded. Every sum is over d or over positions
        # within one query row, so the pieces are the same bits as the whole.
        step = max(1, EAGER_ROWS_ELEMENTS // per_row)
        return torch.cat([torch.cat([self._attend(qx[s:s + 1, a:a + step], ks[s:s + 1], vs[s:s + 1],
                                                  self.mask[s:s + 1, a:a + step]) for a in range(0, Q, step)], 1)
                          for s in range(S)])

    @staticmethod
    def _attend(qx: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The rows form's sums: queries (S, Q, kv, group, d) over keys and values (S, W + Q, kv, d)
        where ``mask`` (S, Q, W + Q) lets them see."""
        scale = qx.shape[-1] ** -0.5
        scores = (qx[:, :, None] * ks[:, None, :, :, None, :]).sum(-1) * scale             # (S, Q, W + Q, kv, group)
        scores = scores.masked_fill(~mask[:, :, :, None, None], float("-inf"))
        probs = torch.softmax(scores, dim=2)
        return (probs[..., None] * vs[:, None, :, :, None, :]).sum(2)                      # (S, Q, kv, group, d)

    def _matmuls(self, qx: torch.Tensor, kx: torch.Tensor, vx: torch.Tensor, kg: torch.Tensor,
                 vg: torch.Tensor) -> torch.Tensor:
        """Prefill chunks: attention as two batched matmuls."""
        S, Q, kv_heads, group, d = qx.shape
        W = kg.shape[1]
        ks, vs = torch.cat([kg, kx], 1), torch.cat([vg, vx], 1)                              # (S, W + Q, kv, d)
        qg = qx.permute(0, 2, 3, 1, 4).reshape(S, kv_heads, group * Q, d)
        scores = torch.matmul(qg, ks.permute(0, 2, 3, 1)) * (d ** -0.5)                     # (S, kv, group * Q, W + Q)
        scores = scores.view(S, kv_heads, group, Q, W + Q).masked_fill(~self.mask[:, None, None], float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(vs.dtype).view(S, kv_heads, group * Q, W + Q)
        out = torch.matmul(probs, vs.permute(0, 2, 1, 3))                                    # (S, kv, group * Q, d)
        return out.view(S, kv_heads, group, Q, d).permute(0, 3, 1, 2, 4)                    # (S, Q, kv, group, d)


@dataclass(frozen=True)
class PaddedSizes:
    """The padded step's sizes: sequences S, query rows Q, cached slots W, token rows T."""

    sequences: int
    queries: int
    context: int
    tokens: int


@dataclass(frozen=True)
class StepShape:
    """Which graph a step (or a part of one) runs: ``rows`` or ``chunks`` (the module docstring)."""

    chunks: bool

    @classmethod
    def of(cls, meta: AttentionMetadata) -> "StepShape":
        return cls(any(s.query_len > ROWS_MAX for s in meta.seqs))

    @property
    def name(self) -> str:
        return "chunks" if self.chunks else "rows"

    def dynamic_dims(self) -> tuple[dict[int, object], ...]:
        """The dims of ``ForwardWithFeatures``' inputs that vary, for ``torch.export``: tokens T,
        sequences S, query rows Q, cached slots W and the pool's slots."""
        auto = torch.export.Dim.AUTO
        return {0: auto}, {0: auto}, {0: auto, 1: auto}, {0: auto, 1: auto}, {0: auto, 1: auto, 2: auto}, {1: auto}


def split(meta: AttentionMetadata) -> list[tuple[StepShape, torch.Tensor | None, AttentionMetadata]]:
    """The parts of a step by form: (shape, the part's token rows in the step or None for all of
    them, the part's metadata). One part unless the step holds both short and long sequences."""
    kinds = [s.query_len > ROWS_MAX for s in meta.seqs]
    if len(set(kinds)) == 1:
        return [(StepShape(kinds[0]), None, meta)]
    starts = [0]
    for s in meta.seqs:
        starts.append(starts[-1] + s.query_len)
    parts = []
    for chunks in (False, True):
        picked = [i for i, k in enumerate(kinds) if k == chunks]
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in picked])
        part = AttentionMetadata([meta.seqs[i] for i in picked], meta.slot_mapping[rows.to(meta.slot_mapping.device)],
                                 meta.block_size)
        parts.append((StepShape(chunks), rows, part))
    return parts
