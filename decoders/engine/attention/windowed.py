"""Paged attention through a network's own kernel, with a window per layer (DiffusionGemma).

DiffusionGemma's layers differ in KV shape (sliding layers and full layers with their own kv heads
and head size), so its cache is a ``KVCache.of_layers``; its attention runs through the model's own
kernel (its scale, its SDPA dispatch), one sequence at a time, over the keys each layer's window
leaves visible.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..blocks import slot_of
from .paged_attention import AttentionMetadata, KVCache, query_starts


def window_pattern(num_keys: int, q_len: int, end: int, window: int | None,
                   device=None) -> tuple[torch.Tensor | None, bool]:
    """What a causal chunk sees: (bool mask or None, is_causal) for SDPA.

    The keys are the ``num_keys`` positions ending at ``end`` (cached, then the chunk's own), the
    queries the last ``q_len``. Causal; with a window W a query at p sees keys p - W < j <= p.
    Like transformers' ``_ignore_causal_mask_sdpa``, no mask is built when SDPA's flags say the same.
    """
    if (q_len == 1 or num_keys == q_len) and (window is None or num_keys < window):
        return None, q_len > 1
    query_pos = torch.arange(end - q_len, end, device=device)
    key_pos = torch.arange(end - num_keys, end, device=device)
    ok = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        ok &= key_pos[None, :] > query_pos[:, None] - window
    return ok, False


# The model's attention kernel: (q, k, v, mask or None, is_causal) -> out, one sequence.
Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, bool], torch.Tensor]


class WindowedPagedAttention:
    """Paged attention with a window per layer and the model's own kernel (DiffusionGemma).

    ``windows[layer]`` is None (the layer sees every cached token) or W (a sliding layer: a
    sequence sees only its last W - 1 cached tokens, all that a query at its first new position
    may see). Among the new tokens, a "causal" sequence (an encoder chunk) is causal within the
    window (``window_pattern``); a "bidirectional" one (a canvas) sees all of them, unmasked.
    Explicit masks and context slots are not supported. Gathers cached keys/values per sequence,
    like ``SdpaPagedAttention``, and runs ``kernel`` once per sequence.
    """

    def __init__(self, cache: KVCache, meta: AttentionMetadata, windows: Sequence[int | None], kernel: Kernel):
        if any(not isinstance(s.mask, str) or s.context_slots is not None for s in meta.seqs):
            raise ValueError("windowed attention takes causal or bidirectional sequences only")
        self.cache = cache
        self.meta = meta
        self.windows = list(windows)
        self.kernel = kernel
        self._starts = query_starts(meta)
        # Per (sequence, window): visible cached slots, mask, is_causal; shared by the layers.
        self._plans: dict[tuple[int, int | None], tuple[torch.Tensor, torch.Tensor | None, bool]] = {}

    def _plan(self, i: int, window: int | None, device) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        key = (i, window)
        if key not in self._plans:
            seq = self.meta.seqs[i]
            first = 0 if window is None else max(0, seq.context_len - (window - 1))
            pos = torch.arange(first, seq.context_len)
            index = slot_of(torch.tensor(seq.block_table, dtype=torch.long), pos, self.meta.block_size).to(device)
            mask, causal = None, False
            if seq.mask == "causal":
                end = seq.context_len + seq.query_len
                mask, causal = window_pattern(len(pos) + seq.query_len, seq.query_len, end, window, device)
            self._plans[key] = (index, mask, causal)
        return self._plans[key]

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_flat, v_flat = self.cache.flat(layer_idx)
        if self.meta.slot_mapping is not None:
            k_flat.index_copy_(0, self.meta.slot_mapping, k.to(k_flat.dtype))
            v_flat.index_copy_(0, self.meta.slot_mapping, v.to(v_flat.dtype))
        outs = []
        for i, seq in enumerate(self.meta.seqs):
            rows = slice(self._starts[i], self._starts[i] + seq.query_len)
            index, mask, causal = self._plan(i, self.windows[layer_idx], q.device)
            kk = torch.cat([k_flat.index_select(0, index).to(k.dtype), k[rows]])
            vv = torch.cat([v_flat.index_select(0, index).to(v.dtype), v[rows]])
            outs.append(self.kernel(q[rows], kk, vv, mask, causal))
        return outs[0] if len(outs) == 1 else torch.cat(outs)
