"""Training objective for DFlash drafters (``models/dflash.py``), a pure function on target features.

The batch is an ``eagle_losses.Batch``: padded ``ids``, the target's fused features
``aux`` (its outputs at ``drafter.config.target_layer_ids``, concatenated) at every
position, ``valid`` marking answer tokens, and the real ``lengths``.

Per sequence, up to ``anchors_per_seq`` distinct anchors a are drawn among the answer
tokens with a + 1 < length. An anchor stands for the last committed token at serving
time: the target has consumed positions j < a (their features form the context), not
a itself. Its block is [ids[a], mask x (B - 1)] at positions a .. a + B - 1; in every
draft layer the block attends to the context keys of positions j < a and to all B
keys of its own block, nothing else, so all blocks of a batch run in one forward.
Block row k (1 <= k < B) predicts ids[a + k] (when that position exists), by
cross-entropy weighted exp(-(k - 1) / decay) (DFlash's position decay: an early
miss ends the accepted chain, so early rows matter most).

With a draft vocabulary, labels are mapped to draft ids (``draft_index``) and a row
whose label lies outside is not trained: the drafter cannot propose that token. It
still counts as a miss in the statistics, which report what a greedy verifier would
accept: per offset k the argmax hits, and per block the number of leading hits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dualserve.models.dflash import DFlashDrafter

from .eagle_losses import Batch


@dataclass
class DFlashStats:
    per_offset: list[tuple[int, int]]  # offsets 1 .. B-1: (argmax hits, rows with a label)
    accepted: int                      # leading hits summed over blocks (greedy acceptance)
    blocks: int

    @property
    def acceptance(self) -> float:
        """Mean drafted tokens a greedy verifier accepts per block (the bonus token not counted)."""
        return self.accepted / max(self.blocks, 1)


def draft_index(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(vocab,) long: the draft id of each target id, -1 for ids outside the draft vocabulary."""
    out = torch.full((vocab_size,), -1, dtype=torch.long, device=d2t.device)
    out[torch.arange(len(d2t), device=d2t.device) + d2t] = torch.arange(len(d2t), device=d2t.device)
    return out


def sample_anchors(batch: Batch, per_seq: int, generator: torch.Generator) -> torch.Tensor:
    """(batch, anchors) positions, ascending per sequence, -1 where a sequence has fewer."""
    valid, lengths = batch.valid.cpu(), batch.lengths.cpu()
    picked = []
    for i in range(valid.shape[0]):
        n = int(lengths[i])
        cands = valid[i, :max(n - 1, 0)].nonzero()[:, 0]  # answer tokens with a successor
        order = torch.randperm(len(cands), generator=generator)[:per_seq]
        picked.append(cands[order].sort().values)
    width = max(1, max(len(p) for p in picked))
    out = torch.full((len(picked), width), -1, dtype=torch.long)
    for i, p in enumerate(picked):
        out[i, :len(p)] = p
    return out.to(batch.ids.device)


class BlockAttention:
    """Training attention for blocks laid out (batch, anchors, block) and flattened.

    A block sees the context keys of its own sequence at positions before its anchor
    and the keys of its own block (both directions); a padded block (anchor -1) sees
    only itself. Context keys and values are given per layer, (layers, batch, t, kv_heads, d).
    """

    def __init__(self, ctx_k: torch.Tensor, ctx_v: torch.Tensor, anchors: torch.Tensor, block_size: int):
        self.ctx_k, self.ctx_v = ctx_k, ctx_v
        b, a = anchors.shape
        self.b, self.n = b, a * block_size
        t = ctx_k.shape[2]
        before = torch.arange(t, device=anchors.device)[None, None, :] < anchors[:, :, None]  # (b, a, t)
        before = before.repeat_interleave(block_size, dim=1)  # (b, n, t)
        blk = torch.arange(self.n, device=anchors.device) // block_size
        own = (blk[:, None] == blk[None, :]).expand(b, -1, -1)  # (b, n, n)
        self.mask = torch.cat([before, own], dim=-1)[:, None]  # (b, 1, n, t + n): True = may attend

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, n, heads, d = self.b, self.n, q.shape[1], q.shape[2]
        keys = torch.cat([self.ctx_k[layer_idx].to(q.dtype), k.view(b, n, -1, d).to(q.dtype)], dim=1)
        values = torch.cat([self.ctx_v[layer_idx].to(q.dtype), v.view(b, n, -1, d).to(q.dtype)], dim=1)
        rep = heads // keys.shape[2]
        qb = q.view(b, n, heads, d).transpose(1, 2)  # (b, heads, n, d)
        kb = keys.transpose(1, 2).repeat_interleave(rep, dim=1)  # (b, heads, t + n, d)
        vb = values.transpose(1, 2).repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=self.mask)
        return out.transpose(1, 2).reshape(q.shape)


def block_inputs(drafter: DFlashDrafter, batch: Batch, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block token ids and positions, each (batch, anchors, B): the anchor's token, then masks."""
    size = drafter.config.block_size
    start = anchors.clamp(min=0)
    ids = torch.full((*anchors.shape, size), drafter.config.mask_token_id, dtype=torch.long, device=anchors.device)
    ids[..., 0] = batch.ids.gather(1, start)
    positions = start[..., None] + torch.arange(size, device=anchors.device)
    return ids, positions


def block_hidden(drafter: DFlashDrafter, batch: Batch, anchors: torch.Tensor) -> torch.Tensor:
    """The drafter's post-norm hidden state of every block row: (batch, anchors, B, hidden)."""
    b = batch.ids.shape[0]
    t = max(1, int(anchors.max()))  # no block sees the context at or after its anchor
    c = drafter.features(None, [batch.aux[:, :t].reshape(b * t, -1)])  # c_j, computed once per position
    positions = torch.arange(t, device=c.device).repeat(b)
    ctx_k, ctx_v = drafter.context_kv(c, positions)  # (layers, b * t, kv_heads, d)
    ctx_k, ctx_v = (x.view(x.shape[0], b, t, *x.shape[2:]) for x in (ctx_k, ctx_v))
    ids, pos = block_inputs(drafter, batch, anchors)
    attn = BlockAttention(ctx_k, ctx_v, anchors, drafter.config.block_size)
    h = drafter(ids.reshape(-1), pos.reshape(-1), attn)
    return h.view(*ids.shape, -1)


def block_labels(batch: Batch, anchors: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target ids (batch, anchors, B) of each row and whether the row has one (row 0, the anchor, never)."""
    pos = anchors.clamp(min=0)[..., None] + torch.arange(block_size, device=anchors.device)
    b, a, _ = pos.shape
    inside = pos < batch.lengths[:, None, None]
    flat = pos.clamp(max=batch.ids.shape[1] - 1).view(b, -1)
    labels = batch.ids.gather(1, flat).view(b, a, -1)
    answer = batch.valid.gather(1, flat).view(b, a, -1)
    has = inside & answer & (anchors >= 0)[..., None]
    has[..., 0] = False
    return labels, has


def dflash_loss(drafter: DFlashDrafter, batch: Batch, anchors_per_seq: int, generator: torch.Generator,
                decay: float, t2d_index: torch.Tensor | None = None,
                anchors: torch.Tensor | None = None) -> tuple[torch.Tensor, DFlashStats]:
    """Position-weighted cross-entropy over sampled blocks; ``anchors`` (batch, n) overrides the sampling."""
    size = drafter.config.block_size
    if anchors is None:
        anchors = sample_anchors(batch, anchors_per_seq, generator)
    labels, has = block_labels(batch, anchors, size)
    if not bool(has.any()):  # nothing to learn from: a zero loss that still reaches every parameter
        zero = sum(p.sum() for p in drafter.parameters() if p.requires_grad) * 0.0
        return zero, DFlashStats([(0, 0)] * (size - 1), 0, 0)
    h = block_hidden(drafter, batch, anchors)
    rows = has.nonzero(as_tuple=True)
    target = labels[rows]
    if t2d_index is not None:
        target = t2d_index[target]
    inside = target >= 0  # in the draft vocabulary
    logits = drafter.logits(h[rows])  # (rows, draft_vocab) fp32
    ce = F.cross_entropy(logits, target.clamp(min=0), reduction="none")
    offset = rows[2]
    weight = torch.exp(-(offset - 1).float() / decay) * inside
    loss = (ce * weight).sum() / weight.sum().clamp(min=1e-6)

    with torch.no_grad():
        hit = (logits.argmax(-1) == target) & inside
        grid = torch.zeros_like(has)
        grid[rows] = hit
        per_offset = [(int(grid[..., k].sum()), int(has[..., k].sum())) for k in range(1, size)]
        leading = grid[..., 1:].long().cumprod(-1).sum(-1)  # a row without a label ends the chain
        blocks = int((anchors >= 0).sum())
    return loss, DFlashStats(per_offset, int(leading.sum()), blocks)


def default_decay(block_size: int) -> float:
    """The default decay constant: half the block, so the last row of a block of 8 weighs exp(-1.5), 0.22."""
    return max(1.0, block_size / 2)

