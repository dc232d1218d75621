"""The attention interface the transformer core calls, and a cache-free backend.

Models never own a KV cache. Each attention layer projects q, k, v, applies RoPE
and hands the three tensors to an ``AttentionBackend`` passed into ``forward``.
The backend decides what the tokens see (causal, bidirectional, block-causal or a
tree mask) and where keys and values are stored (nowhere, or a paged block pool
owned by the engine: see ``dualserve.decoders.engine.attention.paged_attention``).

Token layout is *flattened*: a batch of sequences is one (tokens, ...) tensor,
and the backend knows where each sequence starts. This keeps padding out of the
model and lets prefill, decode, draft trees and diffusion canvases share a batch.
"""

from __future__ import annotations

from typing import Literal, Protocol, Sequence

import torch
import torch.nn.functional as F

MaskMode = Literal["causal", "bidirectional", "block_causal"]


class AttentionBackend(Protocol):
    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: (tokens, heads, head_dim); k, v: (tokens, kv_heads, head_dim) -> (tokens, heads, head_dim)."""
        ...


def block_causal_mask(length: int, block_size: int, offset: int = 0, device=None) -> torch.Tensor:
    """Boolean (length, length) mask, True = may attend: full inside a block, causal across blocks.

    ``offset`` is the absolute position of the first token, so blocks stay aligned
    to multiples of ``block_size`` when a sequence is processed from the middle.
    """
    block = (torch.arange(length, device=device) + offset) // block_size
    return block[:, None] >= block[None, :]


def mask_for(mode: MaskMode, length: int, block_size: int | None = None, device=None) -> torch.Tensor | None:
    """The boolean mask for one sequence, or None when SDPA's own flags suffice."""
    if mode == "block_causal":
        if not block_size:
            raise ValueError("block_causal attention needs a block size")
        return block_causal_mask(length, block_size, device=device)
    return None


# On CPU every query length takes the same explicit-matmul path (``small_query_attention``):
# a token's attention then sums the same terms in the same order whether it is computed in a
# long prefill, in a short chunk after a prefix-cache hit, or as a decode step, so prefix caching
# and chunking do not move greedy output at near-ties (SDPA's flash kernel for long queries
# blocks its sums differently). Its one cost is a (query, key) score matrix per kv head, which a
# prefill chunk of at most ``max_batched_tokens`` rows bounds.
def small_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          mask: torch.Tensor | None) -> torch.Tensor:
    """Grouped-query attention as explicit matmuls (every query length on CPU; see above).

    The ``heads // kv_heads`` query heads that share a kv head are stacked along the
    query axis, so each kv head is read once: (kv_heads, group * q_len, d) @ (kv_heads, d, kv_len).
    """
    q_len, heads, d = q.shape
    if q_len == 1:
        # One query is computed as two identical ones: the batched GEMMs then take the kernel a chunk's
        # rows take (a single row takes a matrix-vector kernel that rounds differently), so a decode
        # step equals the same token's row in a prefill or a verify.
        pair = small_query_attention(q.expand(2, heads, d), k, v, None if mask is None else mask.expand(2, -1))
        return pair[:1]
    kv_heads = k.shape[1]
    group = heads // kv_heads
    qg = q.reshape(q_len, kv_heads, group, d).permute(1, 2, 0, 3).reshape(kv_heads, group * q_len, d)
    scores = torch.bmm(qg, k.permute(1, 2, 0)) * (d ** -0.5)  # (kv_heads, group * q_len, kv_len)
    if mask is not None:
        scores = scores.view(kv_heads, group, q_len, -1).masked_fill(~mask, float("-inf")).view_as(scores)
    out = torch.bmm(torch.softmax(scores.float(), dim=-1).to(v.dtype), v.transpose(0, 1))
    return out.view(kv_heads, group, q_len, d).permute(2, 0, 1, 3).reshape(q_len, heads, d)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
         causal: bool = False) -> torch.Tensor:
    """Grouped-query attention for one sequence.

    q: (q_len, heads, d); k, v: (kv_len, kv_heads, d); mask: (q_len, kv_len) bool.
    Returns (q_len, heads, d). Keys and values are shared across ``heads // kv_heads``
    query heads without materialising copies.
    """
    q_len = q.shape[0]
    if q.device.type == "cpu":
        if causal and mask is None and q_len > 1:
            kv_len = k.shape[0]
            mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
        return small_query_attention(q, k, v, mask)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=mask, is_causal=causal and mask is None and q.shape[0] > 1,
        enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(0, 1)


class DenseAttention:
    """Attention with no cache: every call sees exactly the tokens passed in.

    Used for training, for tests against references, and for diffusion decoding
    without a cache. ``seq_lens`` splits the flattened batch into sequences; when
    they are all equal the batch runs as one SDPA call.
    """

    def __init__(self, seq_lens: Sequence[int], mode: MaskMode = "causal", block_size: int | None = None,
                 masks: Sequence[torch.Tensor] | None = None, windows: Sequence[int | None] = ()):
        self.seq_lens = list(seq_lens)
        self.mode = mode
        self.block_size = block_size
        self.masks = masks  # optional explicit (len, len) bool masks, one per sequence
        self.windows = list(windows)  # per layer, causal mode: a token sees the W positions ending at itself
        self._mask_cache: dict[tuple[int, str, int | None], torch.Tensor | None] = {}

    def _mask(self, i: int, length: int, device, window: int | None = None) -> torch.Tensor | None:
        if self.masks is not None:
            return self.masks[i].to(device)
        key = (length, str(device), window)
        if key not in self._mask_cache:
            mask = mask_for(self.mode, length, self.block_size, device)
            if window is not None and length > window:
                pos = torch.arange(length, device=device)
                mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
            self._mask_cache[key] = mask
        return self._mask_cache[key]

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        window = self.windows[layer_idx] if self.windows and self.mode == "causal" else None
        if window is not None and self.masks is None and max(self.seq_lens) > window:
            outs, start = [], 0
            for i, n in enumerate(self.seq_lens):
                sl = slice(start, start + n)
                outs.append(sdpa(q[sl], k[sl], v[sl], self._mask(i, n, q.device, window), False))
                start += n
            return torch.cat(outs, 0)
        causal = self.mode == "causal"
        lens = self.seq_lens
        if self.masks is None and len(set(lens)) == 1 and len(lens) > 1:
            b, n = len(lens), lens[0]
            # (batch, heads, seq, head_dim)
            qb = q.view(b, n, *q.shape[1:]).transpose(1, 2)
            kb = k.view(b, n, *k.shape[1:]).transpose(1, 2)
            vb = v.view(b, n, *v.shape[1:]).transpose(1, 2)
            mask = self._mask(0, n, q.device)
            out = F.scaled_dot_product_attention(
                qb, kb, vb, attn_mask=mask, is_causal=causal and mask is None,
                enable_gqa=q.shape[1] != k.shape[1])
            return out.transpose(1, 2).reshape(q.shape)
        outs = []
        start = 0
        for i, n in enumerate(lens):
            sl = slice(start, start + n)
            outs.append(sdpa(q[sl], k[sl], v[sl], self._mask(i, n, q.device), causal))
            start += n
        return torch.cat(outs, 0)
