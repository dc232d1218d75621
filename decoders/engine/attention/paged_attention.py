"""Paged attention: the KV tensors that live beside the block pool, and the backends that use them.

The block pool (``blocks.py``) hands out block ids; this module owns the
tensors those ids index. One ``KVCache`` per loaded model, sized once at start-up:
per layer, keys and values of shape (num_blocks, block_size, kv_heads, head_dim).

A step's ``AttentionMetadata`` says, for each sequence in the flattened batch,
how many of its tokens are already cached (``context_len``), how many new tokens
it brings (``query_len``), which blocks hold its cache (``block_table``), where the
new keys/values go (``slot_mapping``; empty = do not store, as for a diffusion
canvas that is still changing), and what the new tokens may see among
themselves (``mask``: causal, full, or an explicit boolean matrix such as an
EAGLE draft tree). Cached tokens are always fully visible.

Two backends implement the same call:
  * ``SdpaPagedAttention`` (CPU and any device): gathers each sequence's cached
    keys/values by slot index and runs PyTorch SDPA.
  * ``FlashPagedAttention`` (CUDA, when flash-attn is importable): writes new
    keys/values into the paged cache and calls ``flash_attn_with_kvcache`` with
    the block table; used for causal batches, falling back to SDPA for masks
    flash-attn cannot express and for dtypes or block sizes it does not take (``flash_fits``).

On CUDA without flash-attn, ``SdpaPagedAttention`` is the backend: it reads a sequence's cached
keys/values by slot whatever the block size (256-token blocks included) and dtype, so it needs
no other kernel.

Sliding-window layers (Gemma 3's local layers, Mistral, Phi-3) see only the keys
within their window: ``SdpaPagedAttention`` takes each window's masks. A model whose
layers differ in KV shape and which brings its own attention (DiffusionGemma) gets a
``KVCache.of_layers`` and ``windowed.WindowedPagedAttention``.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence, Union

import numpy as np
import torch

from dualserve.models.kernels import ops as kernel_ops
from dualserve.models.attention import sdpa

from ..blocks import slot_of

# Among a sequence's new tokens: "causal", "bidirectional" (every new token sees every other, as
# models.attention names it), or an explicit (query, query) boolean mask (trees, block-causal).
SeqMask = Union[Literal["causal", "bidirectional"], torch.Tensor]


def zeroed(shapes: Sequence[tuple[int, ...]], dtype: torch.dtype, device: torch.device | str) -> list[torch.Tensor]:
    """Zero-filled tensors for a KV pool, as consecutive views of one buffer. On the CPU the buffer
    is an anonymous memory map: the kernel hands out zero pages on first write, so blocks the pool
    has never used take no resident memory (the default model's 377 MB pool costs only what
    traffic has touched)."""
    sizes = [math.prod(shape) for shape in shapes]
    if torch.device(device).type != "cpu" or sum(sizes) == 0:
        flat = torch.zeros(sum(sizes), dtype=dtype, device=device)
    else:
        itemsize = torch.empty((), dtype=dtype).element_size()
        memory = mmap.mmap(-1, sum(sizes) * itemsize)
        flat = torch.frombuffer(memory, dtype=dtype, count=sum(sizes))  # the tensor keeps the map alive
    return [part.view(shape) for part, shape in zip(flat.split(sizes), shapes)]


class KVCache:
    """Keys and values for every block of the pool, for one model. Owned by its runner."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        tensors = zeroed([shape] * (2 * num_layers), dtype, device)
        self.k, self.v = tensors[:num_layers], tensors[num_layers:]
        # Every layer's keys, then every layer's values, as one (2 * layers, slots, kv_heads, head_dim)
        # view of the same buffer: ``store`` writes a step's new keys and values in one copy.
        self.stacked: torch.Tensor | None = None
        if num_layers:
            base = tensors[0]
            self.stacked = torch.as_strided(base, (2 * num_layers, num_blocks * block_size, num_kv_heads, head_dim),
                                            (base.numel(), num_kv_heads * head_dim, head_dim, 1))

    @classmethod
    def of_layers(cls, layer_shapes: Sequence[tuple[int, int]], num_blocks: int, block_size: int,
                  dtype: torch.dtype, device: torch.device | str) -> "KVCache":
        """A cache whose layers differ in shape: ``layer_shapes[i]`` is layer i's (kv_heads, head_dim)."""
        cache = cls(0, num_blocks, block_size, 0, 0, dtype, device)  # no layers yet: added below
        shapes = [(num_blocks, block_size, kv_heads, head_dim) for kv_heads, head_dim in layer_shapes]
        tensors = zeroed(shapes * 2, dtype, device)
        cache.k, cache.v = tensors[:len(shapes)], tensors[len(shapes):]
        return cache

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8

    @staticmethod
    def bytes_per_block_of_layers(layer_shapes: Sequence[tuple[int, int]], block_size: int,
                                  dtype: torch.dtype) -> int:
        """Bytes one block takes in an ``of_layers`` cache (every layer stores every token)."""
        per_token = sum(2 * kv_heads * head_dim for kv_heads, head_dim in layer_shapes)
        return per_token * block_size * torch.finfo(dtype).bits // 8

    def store(self, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new keys and values of every layer: ``k``, ``v`` are (layers, tokens, kv_heads,
        head_dim), stored at ``slot_mapping`` (tokens,)."""
        if self.stacked is not None:
            if kernel_ops.store_eligible(self.stacked):  # one pass, no concatenated temporary
                kernel_ops.store_kv(self.stacked, slot_mapping, k.to(self.dtype), v.to(self.dtype))
            else:
                self.stacked.index_copy_(1, slot_mapping, torch.cat([k, v]).to(self.dtype))
            return
        for layer in range(len(self.k)):
            kc, vc = self.flat(layer)
            kc.index_copy_(0, slot_mapping, k[layer].to(kc.dtype))
            vc.index_copy_(0, slot_mapping, v[layer].to(vc.dtype))

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(num_slots, kv_heads, head_dim) views of one layer's keys and values."""
        k, v = self.k[layer], self.v[layer]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])

    def move_slots(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Move single token slots (EAGLE keeps the accepted path of a tree in place)."""
        if not src:
            return
        s = torch.tensor(src, device=self.k[0].device)
        d = torch.tensor(dst, device=self.k[0].device)
        for layer in range(len(self.k)):
            k, v = self.flat(layer)
            k[d] = k[s]
            v[d] = v[s]


@dataclass
class SeqAttention:
    context_len: int            # tokens already in the cache, all visible
    query_len: int              # new tokens in this step
    block_table: list[int]
    mask: SeqMask = "causal"    # among the new tokens
    # Positions of the cached tokens this sequence may see (default: all context_len).
    context_slots: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    seqs: list[SeqAttention]
    slot_mapping: torch.Tensor | None  # (total new tokens,) flat slot ids, or None: do not store
    block_size: int
    # (sequence, device) -> its context slots there: the padded forms build theirs on the CPU and
    # the backends read them on the model's device, in the same step.
    _context_index: dict[tuple[int, torch.device], torch.Tensor] = field(default_factory=dict)

    def context_index(self, i: int, device) -> torch.Tensor | None:
        """Flat slot ids of sequence i's cached tokens on ``device``, built once per step and device
        and shared by all layers."""
        seq = self.seqs[i]
        if seq.context_len == 0:
            return None
        key = (i, torch.device(device))
        if key not in self._context_index:
            if seq.context_slots is not None:
                self._context_index[key] = seq.context_slots.to(device)
            else:  # in numpy: a few small torch ops here cost tens of microseconds a step
                slots = slot_of(np.asarray(seq.block_table, dtype=np.int64), np.arange(seq.context_len), self.block_size)
                self._context_index[key] = torch.from_numpy(slots).to(device)
        return self._context_index[key]


def mask_tensor(seq: SeqAttention, device) -> torch.Tensor | None:
    """(query_len, context_len + query_len) boolean mask, or None if SDPA needs none."""
    q, c = seq.query_len, seq.context_len
    if isinstance(seq.mask, torch.Tensor):
        new = seq.mask.to(device=device, dtype=torch.bool)
    elif seq.mask == "bidirectional" or q == 1:
        return None
    else:  # causal among new tokens
        new = torch.ones(q, q, dtype=torch.bool, device=device).tril()
    if c == 0:
        return new
    return torch.cat([torch.ones(q, c, dtype=torch.bool, device=device), new], dim=1)


def as_stored(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """New keys/values rounded as the cache holds them (bf16 KV under fp32 compute): a token then
    attends to the same numbers whether its neighbours were computed in this step or cached."""
    return x if x.dtype == cache.dtype else x.to(cache.dtype).to(x.dtype)


class SdpaPagedAttention:
    """Gather cached keys/values and run attention (the CPU path).

    Where the project's kernels are built (``models.kernels``) and the model computes in fp32,
    every sequence takes ``attend_rows``, the compiled graphs' own attention, whatever its query
    length: one formulation for decodes, draft trees, diffusion canvases and prompts, so a row's
    output is the same bits alone, in a tree, in a batch or in a prefill chunk, fresh or after a
    prefix-cache hit, eager or compiled. It was also no slower than SDPA's batched matmuls for
    prompts up to a thousand tokens (docs/numerics.md). Otherwise sequences
    with one new token (decode steps) run together as one padded, batched grouped-query
    attention; the rest (prefill chunks, and trees and canvases without the kernel) run one
    SDPA call each.
    """

    def __init__(self, cache: KVCache, meta: AttentionMetadata, windows: Sequence[int | None] = ()):
        self.cache = cache
        self.meta = meta
        # Per layer: None, or a sliding window W (Gemma 3's local layers: a token sees the W positions
        # ending at itself). Only windows that some sequence outgrows this step change a mask.
        self.windows: list[int | None] = []
        if windows:
            longest = max((s.context_len + s.query_len for s in meta.seqs), default=0)
            self.windows = [w if w is not None and longest > w else None for w in windows]
        self._masks: list[torch.Tensor | None] | None = None
        self._decode: DecodeBatch | None = None
        self._rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._windowed: dict[int, tuple] = {}  # window -> its rows form, or its per-sequence masks
        self._rest: list[int] = []
        self._starts: list[int] = []

    def _plan(self, q: torch.Tensor) -> None:
        seqs, device = self.meta.seqs, q.device
        self._starts = query_starts(self.meta)
        if kernel_ops.attend_eligible(q):
            rows, context, mask = padded_rows(self.meta, range(len(seqs)))
            self._rows = (rows.to(device), context.to(device), mask.to(device))
            for w in set(self.windows) - {None}:
                self._windowed[w] = (self._rows[0], self._rows[1],
                                     within_window(self.meta, range(len(seqs)), mask, w).to(device))
            self._rest = []
            self._masks = [None] * len(seqs)
            return
        if any(self.windows):  # without the rows kernel: every sequence takes SDPA with full masks
            self._decode, self._rest = None, list(range(len(seqs)))
            self._masks = [full_mask(s, device) for s in seqs]
            for w in set(self.windows) - {None}:
                self._windowed[w] = tuple(within_window(self.meta, [i], m[None], w, columns=s.context_len)[0]
                                          for i, (s, m) in enumerate(zip(seqs, self._masks)))
            return
        singles = [i for i, s in enumerate(seqs) if s.query_len == 1]
        if len(singles) < 2:
            singles = []
        self._decode = DecodeBatch.build(self.meta, singles, self._starts, device) if singles else None
        single_set = set(singles)
        self._rest = [i for i in range(len(seqs)) if i not in single_set]
        self._masks = [mask_tensor(s, device) if i not in single_set else None for i, s in enumerate(seqs)]

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        k_flat, v_flat = self.cache.flat(layer_idx)
        if meta.slot_mapping is not None:
            k_flat.index_copy_(0, meta.slot_mapping, k.to(k_flat.dtype))
            v_flat.index_copy_(0, meta.slot_mapping, v.to(v_flat.dtype))
        k, v = as_stored(k, k_flat), as_stored(v, v_flat)
        if self._masks is None:
            self._plan(q)
        window = self.windows[layer_idx] if self.windows else None
        if self._rows is not None:
            rows = self._rows if window is None else self._windowed[window]
            out = kernel_ops.attend_rows(q, k, v, k_flat, v_flat, *rows, q.shape[-1] ** -0.5)
            if not self._rest:
                return out
        elif self._decode is not None and not self._rest:
            return self._decode(q, k, v, k_flat, v_flat)
        else:
            out = q.new_empty(q.shape) if len(meta.seqs) > 1 else None
        if self._decode is not None:
            out[self._decode.rows] = self._decode(q, k, v, k_flat, v_flat)
        for i in self._rest:
            seq = meta.seqs[i]
            sl = slice(self._starts[i], self._starts[i] + seq.query_len)
            idx = meta.context_index(i, q.device)
            if idx is None:
                kk, vv = k[sl], v[sl]
            else:
                kk = torch.cat([k_flat.index_select(0, idx).to(k.dtype), k[sl]], 0)
                vv = torch.cat([v_flat.index_select(0, idx).to(v.dtype), v[sl]], 0)
            mask = self._masks[i] if window is None else self._windowed[window][i]
            causal = mask is None and seq.mask == "causal" and seq.context_len == 0
            res = sdpa(q[sl], kk, vv, mask, causal)
            if out is None:
                return res
            out[sl] = res
        return out


def padded_rows(meta: AttentionMetadata, seq_ids: Sequence[int], sizes: tuple[int, int, int, int] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows form of some of a step's sequences, on the CPU: rows (S, Q) of each one's new
    tokens in the flattened step (T, the step's token count, where padded), context (S, W) its
    cached slots, mask (S, Q, W + Q) what each new token sees. ``sizes``: pad to (S, Q, W, T)
    instead of the sequences' own. A padded query sees one slot, so no softmax is empty.

    Built in numpy: it runs every step (and every head catch-up), where a few dozen small torch
    ops cost a tenth of a millisecond."""
    seqs, starts = meta.seqs, query_starts(meta)
    S, Q = len(seq_ids), max(seqs[i].query_len for i in seq_ids)
    W, total = max(2, max(seqs[i].context_len for i in seq_ids)), sum(s.query_len for s in seqs)
    if sizes is not None:
        S, Q, W, total = sizes
    rows = np.full((S, Q), total, dtype=np.int64)
    context = np.zeros((S, W), dtype=np.int64)
    mask = np.zeros((S, Q, W + Q), dtype=np.bool_)
    for r, i in enumerate(seq_ids):
        s = seqs[i]
        q = s.query_len
        rows[r, :q] = np.arange(starts[i], starts[i] + q)
        idx = meta.context_index(i, "cpu")
        if idx is not None:  # its cached slots, all visible (built on another device if a layer asked first)
            context[r, : idx.numel()] = idx.cpu().numpy()
            mask[r, :q, : idx.numel()] = True
        if isinstance(s.mask, torch.Tensor):
            mask[r, :q, W: W + q] = s.mask.to(device="cpu", dtype=torch.bool).numpy()[:, -q:]
        elif s.mask == "bidirectional" or q == 1:
            mask[r, :q, W: W + q] = True
        else:  # causal among the new tokens
            mask[r, :q, W: W + q] = np.tri(q, dtype=np.bool_)
        mask[r, q:, W + q - 1] = True
    mask[len(seq_ids):, :, W - 1] = True  # padded sequences (a bucket's) too
    return torch.from_numpy(rows), torch.from_numpy(context), torch.from_numpy(mask)


def full_mask(seq: SeqAttention, device) -> torch.Tensor:
    """(query_len, context_len + query_len) boolean mask of what each new token sees."""
    mask = mask_tensor(seq, device)
    if mask is None:
        q, c = seq.query_len, seq.context_len
        own = torch.ones(q, q, dtype=torch.bool, device=device)
        mask = torch.cat([torch.ones(q, c, dtype=torch.bool, device=device), own], 1)
    return mask


def new_offsets(seq: SeqAttention) -> torch.Tensor:
    """Each new token's position after the cached ones: its index, or its depth in a draft tree (a node
    sees its ancestors and itself)."""
    if isinstance(seq.mask, torch.Tensor):
        return seq.mask.to(device="cpu", dtype=torch.long).sum(-1) - 1
    return torch.arange(seq.query_len)


def within_window(meta: AttentionMetadata, seq_ids: Sequence[int], mask: torch.Tensor, window: int,
                  columns: int | None = None) -> torch.Tensor:
    """``mask`` (S, Q, C + Q) with the keys a sliding window hides removed: a query at position p sees
    keys at p - window < j <= p. Cached column j holds position j (C = ``columns``, else the padded
    width); new column C + k holds the sequence's k-th new token. Padded query rows keep their slot."""
    mask = mask.clone()
    width = mask.shape[-1] - mask.shape[1] if columns is None else columns
    for r, i in enumerate(seq_ids):
        seq = meta.seqs[i]
        off = new_offsets(seq)
        query = seq.context_len + off                                           # (q,)
        keys = torch.cat([torch.arange(width), seq.context_len + off,
                          torch.full((mask.shape[-1] - width - seq.query_len,), -(1 << 40))])
        visible = keys[None, :] > query[:, None] - window
        mask[r, : seq.query_len] &= visible.to(mask.device)
    return mask


def query_starts(meta: AttentionMetadata) -> list[int]:
    """Row of each sequence's first new token in the flattened batch."""
    starts, pos = [], 0
    for s in meta.seqs:
        starts.append(pos)
        pos += s.query_len
    return starts


class DecodeBatch:
    """Sequences with one new token each, attended in one batched call.

    Each row holds its cached slots, then its new token, then padding up to the
    longest row (masked out): the same layout as the sequence alone, with masked
    entries only at the end, so batching adds nothing to a row's sums. Built once
    per step and shared by every layer."""

    def __init__(self, rows: torch.Tensor, index: torch.Tensor, lens: torch.Tensor, valid: torch.Tensor):
        self.rows = rows      # (n,) rows of the flattened batch
        self.index = index    # (n, width + 1) flat slot ids of cached tokens, 0 elsewhere
        self.lens = lens      # (n,) cached tokens per row: where the new token goes
        self.valid = valid    # (n, width + 1) bool: cached slots and the new token

    @classmethod
    def build(cls, meta: AttentionMetadata, seq_ids: list[int], starts: list[int], device) -> "DecodeBatch":
        slots = [meta.context_index(i, device) for i in seq_ids]
        lens = torch.tensor([0 if x is None else int(x.numel()) for x in slots], device=device)
        width = int(lens.max())
        index = torch.zeros(len(seq_ids), width + 1, dtype=torch.long, device=device)
        for r, x in enumerate(slots):
            if x is not None:
                index[r, : x.numel()] = x
        valid = torch.arange(width + 1, device=device)[None, :] <= lens[:, None]
        rows = torch.tensor([starts[i] for i in seq_ids], dtype=torch.long, device=device)
        return cls(rows, index, lens, valid)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_flat: torch.Tensor,
                 v_flat: torch.Tensor) -> torch.Tensor:
        n, width1 = self.index.shape
        _, heads, d = q.shape
        kv_heads = k.shape[1]
        group = heads // kv_heads
        flat = self.index.view(-1)
        at = (torch.arange(n, device=q.device), self.lens)
        kk = k_flat.index_select(0, flat).view(n, width1, kv_heads, d).to(k.dtype)   # (n, width + 1, kv_heads, d)
        vv = v_flat.index_select(0, flat).view(n, width1, kv_heads, d).to(v.dtype)
        kk[at] = k.index_select(0, self.rows)
        vv[at] = v.index_select(0, self.rows)
        # Each query twice, as in ``small_query_attention``: the GEMMs take the kernel a chunk's rows take.
        qg = q.index_select(0, self.rows).view(n, kv_heads, group, d).repeat(1, 1, 2, 1)  # (n, kv_heads, 2g, d)
        scores = torch.matmul(qg, kk.permute(0, 2, 3, 1)) * (d ** -0.5)     # (n, kv_heads, 2g, width + 1)
        scores = scores.masked_fill(~self.valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(vv.dtype)
        out = torch.matmul(probs, vv.permute(0, 2, 1, 3))                   # (n, kv_heads, 2g, d)
        return out[:, :, :group].reshape(n, heads, d)


class FlashPagedAttention(SdpaPagedAttention):
    """flash-attn with block tables for all-causal batches; SDPA gathering otherwise."""

    def __init__(self, cache: KVCache, meta: AttentionMetadata, flash: Callable[..., torch.Tensor] | None = None):
        """``flash``: a function with ``flash_attn_with_kvcache``'s signature (the CUDA-shaped
        profile's PyTorch stand-in, ``cuda_shaped.py``); None: flash-attn's own."""
        super().__init__(cache, meta)
        if flash is None:
            from flash_attn import flash_attn_with_kvcache as flash  # optional GPU extra
        self._flash = flash
        # A pool flash-attn cannot read runs SDPA; the queries' dtype is checked per call.
        self._usable = (meta.slot_mapping is not None and flash_fits(cache.dtype, cache.dtype, cache.block_size)
                        and all(isinstance(s.mask, str) and s.mask == "causal" and s.context_slots is None
                                for s in meta.seqs))
        if self._usable:
            width = max(len(s.block_table) for s in meta.seqs)
            table = torch.zeros(len(meta.seqs), width, dtype=torch.int32)
            for i, s in enumerate(meta.seqs):
                table[i, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
            device = cache.k[0].device
            self._table = table.to(device)
            self._seqlens = torch.tensor([s.context_len + s.query_len for s in meta.seqs],
                                         dtype=torch.int32, device=device)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not self._usable or not flash_fits(q.dtype, self.cache.dtype, self.cache.block_size):
            return super().__call__(layer_idx, q, k, v)
        meta = self.meta
        k_flat, v_flat = self.cache.flat(layer_idx)
        k_flat.index_copy_(0, meta.slot_mapping, k.to(k_flat.dtype))
        v_flat.index_copy_(0, meta.slot_mapping, v.to(v_flat.dtype))
        outs = []
        start = 0
        # One call per sequence keeps ragged query lengths exact; decode batches
        # (all query_len == 1) go through one batched call.
        if all(s.query_len == 1 for s in meta.seqs):
            out = self._flash(q[:, None], self.cache.k[layer_idx], self.cache.v[layer_idx],
                              cache_seqlens=self._seqlens, block_table=self._table, causal=True)
            return out[:, 0]
        for i, s in enumerate(meta.seqs):
            sl = slice(start, start + s.query_len)
            start += s.query_len
            out = self._flash(q[sl][None], self.cache.k[layer_idx], self.cache.v[layer_idx],
                              cache_seqlens=self._seqlens[i: i + 1], block_table=self._table[i: i + 1],
                              causal=True)
            outs.append(out[0])
        return torch.cat(outs, 0)


# flash-attn's kernels take fp16 and bf16 alone ("FlashAttention only support fp16 and bf16 data
# type"), and its paged KV cache blocks of a multiple of 256 tokens ("Paged KV cache block size must
# be divisible by 256"): flash-attn's csrc/flash_attn/flash_api.cpp, mha_fwd_kvcache.
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_BLOCK = 256


def flash_fits(dtype: torch.dtype, kv_dtype: torch.dtype, block_size: int) -> bool:
    """Whether flash-attn's paged kernel takes queries in ``dtype`` over a pool of ``kv_dtype`` in
    blocks of ``block_size`` tokens (it takes one dtype for all three)."""
    return dtype in FLASH_DTYPES and kv_dtype == dtype and block_size % FLASH_BLOCK == 0


def flash_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()
