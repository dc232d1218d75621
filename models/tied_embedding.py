"""A tied embedding read from its output head's packed weight: one copy of the table in memory.

A checkpoint without an output head of its own (``output.weight`` in GGUF) ties the head to the
embedding. Under the dot8 formats the head is then a ``Dot8Linear`` holding the file's table
exactly (``quant.head_linear``), and ``HeadRowsEmbedding`` looks tokens up in that head's tensors
instead of keeping a second table (Llama 3.2 1B Q4_K_M: 113 MB; Gemma 3 270M: 178 MB).

**Ownership.** The head owns ``packed``, ``d``, ``m``, ``s`` and ``mn``. The embedding holds the
head in a tuple, outside the module tree: it has no parameters, buffers or state-dict entries of
its own, so ``model.to()``, ``torch.func.functional_call`` (the AOTInductor step passes the
weights in by name: ``lm_head.packed`` ...) and the strict load see one copy, and a lookup always
reads the head's current tensors.

**Bits.** A looked-up row is the row of ``head.dequantize()``, bit for bit: the same fp32
operations in the same order (``portable.dequantize_portable``). For the int8 groups without a
minimum (Q8_0, Q5_0, IQ4_NL, Q6_K, IQ4_XS) that is also what ``QuantEmbedding`` gave; for the
kinds with a minimum (Q4_0, Q4_1, Q4_K, Q5_1, Q5_K: 4 or 5 bits) it is the file's value where
``QuantEmbedding`` quantized it again. Where a minimum is added, ``q * scale`` is exact in fp32
(a 5-bit value times an fp16 scale times a 7-bit multiplier), so a compiler that fuses the
multiply and the add (FMA) gives the same bits.

**Traceable.** The lookup is index, shift, mask and multiply on the head's tensors, with shapes
and Python branches fixed by the layout (``kernels/dot8.cpp``'s header): it runs inside
``torch.compile``'d and exported graphs. Row r sits in tile r // 16, lane r % 16; per tile and
group of 32 inputs, ``bits`` chunks of 64 bytes, 4 bytes of each for each of the 16 rows.
"""

from __future__ import annotations

import torch
from torch import nn

from .kernels.layout import GROUP, TILE, offset
from .quant import Dot8Linear


def _lanes(v: torch.Tensor, tile: torch.Tensor, lane: torch.Tensor, groups: int) -> torch.Tensor:
    """Per-tile values v (tiles, g, [k,] 16) at rows (tile, lane) -> (n, groups, k); g is groups or
    groups / 8 (one per super-block, repeated over its 8 groups)."""
    v = v.view(v.shape[0], v.shape[1], -1, TILE).permute(0, 3, 1, 2)[tile, lane]   # (n, g, k)
    n, g, k = v.shape
    if g != groups:
        v = v.unsqueeze(2).expand(n, g, groups // g, k).reshape(n, groups, k)
    return v


def head_rows(head: Dot8Linear, ids: torch.Tensor) -> torch.Tensor:
    """float32 (*ids.shape, in_features): rows ``ids`` of ``head.dequantize()``, the same bits,
    gathered from those rows' lanes with plain tensor ops (no copy of the table, no host sync)."""
    shape, bits = ids.shape, head.bits
    ids = ids.reshape(-1).long()
    n, groups = ids.shape[0], head.in_features // GROUP
    tiles = -(-head.out_features // TILE)
    tile, lane = ids // TILE, ids % TILE
    lanes = head.packed.view(tiles, groups, bits, TILE, 4).permute(0, 3, 1, 2, 4)
    sel = lanes[tile, lane]                                                   # (n, groups, bits, 4) uint8
    if bits == 8:  # chunk j holds inputs 4j..4j+3
        u = sel
    else:  # chunk j < 4: inputs 8j..8j+3 in the low nibbles, 8j+4..8j+7 in the high: vector i = 2j + h
        nib = sel[:, :, :4]
        u = torch.stack([nib & 0x0F, nib >> 4], dim=3).reshape(n, groups, 8, 4)
        if bits > 4:  # planes of the high bits: vector i at bits hb * (i % per) of plane i // per
            hb = bits - 4
            per, mask = 8 // hb, (1 << hb) - 1
            planes = sel[:, :, 4:]                                            # (n, groups, hb, 4)
            high = torch.stack([(planes >> (hb * k)) & mask for k in range(per)], dim=3)  # (n, g, hb, per, 4)
            u = u | (high.reshape(n, groups, 8, 4) << 4)
    q = u.reshape(n, groups, GROUP).float()
    off = offset(bits, head.minimum)
    if off:
        q = q - off
    # dequantize_portable's order: scale (* multiplier), q * scale, + zero (* its multiplier)
    scale = _lanes(head.d, tile, lane, groups).float()                      # (n, groups, 1)
    if head.s is not None:
        scale = scale * _lanes(head.s, tile, lane, groups).float()          # (n, groups, 1 or 2)
    halves = scale.shape[-1]
    w = q.view(n, groups, halves, GROUP // halves) * scale[..., None]
    if head.minimum:
        zero = _lanes(head.m, tile, lane, groups).float()                   # (n, groups, 1)
        if head.mn is not None:
            zero = zero * _lanes(head.mn, tile, lane, groups).float()
        w = w + zero[..., None]
    return w.reshape(*shape, head.in_features)


class HeadRowsEmbedding(nn.Module):
    """Token embeddings read from a ``Dot8Linear`` output head's packed tensors (the tied table),
    which this module borrows and does not own (the module docstring)."""

    def __init__(self, head: Dot8Linear, dtype: torch.dtype = torch.float32):
        super().__init__()
        if not isinstance(head, Dot8Linear):
            raise TypeError(f"a head-rows embedding reads a Dot8Linear head, not {type(head).__name__}")
        self._borrowed = (head,)  # a tuple keeps the head out of this module's tree and state
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.dtype = dtype

    @property
    def head(self) -> Dot8Linear:
        """The output head whose tensors hold the table."""
        return self._borrowed[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return head_rows(self.head, ids).to(self.dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized table (rows, dim), made on each call: for tools and training, not for serving."""
        return self.head.dequantize().to(device=self.head.packed.device, dtype=self.dtype)

    def extra_repr(self) -> str:
        return f"rows of the output head: {self.num_embeddings} x {self.embedding_dim}, dtype={self.dtype}"


def tied_embedding(head: nn.Module, table: dict[str, torch.Tensor] | torch.Tensor,
                   dtype: torch.dtype) -> HeadRowsEmbedding | None:
    """The embedding of a tied model read from its head, when the head holds the table's values
    exactly (a ``Dot8Linear`` built from the file's own blocks); None otherwise (the caller keeps a
    separate table: int8/int4 heads, and float tables, whose head rounds its scales to fp16)."""
    if not isinstance(head, Dot8Linear) or not isinstance(table, dict):
        return None
    return HeadRowsEmbedding(head, dtype)
