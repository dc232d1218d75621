"""The model runner: one loaded model, its KV tensors, and how a batch becomes a forward.

The runner owns the model weights (by reference), the ``KVCache`` tensors
indexed by the shared block pool's block ids, and the choice of attention
backend (flash-attn, its stand-in under the CUDA-shaped profile, or SDPA; made
once, ``attention_backend``). Decoders describe the work of a step as
``ForwardItem``s (which tokens, at which positions, with what cache and mask)
and get hidden states back; they never touch the KV tensors directly. What else
they need of the KV goes through the runner too: moving slots (EAGLE keeps an
accepted path in place), scratch slots, and a KV cache plus backend for a draft
head over the same blocks.

With ``compile()``, steps run through torch.compile'd graphs with paged
attention inside them (``compiled.py``); eager stays the fallback.

Tokens that must not be stored (a diffusion canvas still being denoised) are
written to a scratch block that no request owns, so one batch can mix stored
and unstored sequences without a second kernel path.

Every family's network runs through the same runner, by what it declares
(``models/network.py``): one that brings its own attention kernel gets a KV
cache with one shape per layer (``KVCache.of_layers``) and the
``WindowedPagedAttention`` backend over that kernel; an encoder-denoiser network
is run through the runner's ``encode`` and ``denoise`` instead of ``forward``.
Only a family whose row says it compiles is compiled.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Sequence

import torch

from dualserve.models.attention import AttentionBackend
from dualserve.models.families import family
from dualserve.models.network import Network, attention_kernel

from .attention.paged_attention import (AttentionMetadata, FlashPagedAttention, KVCache, SdpaPagedAttention,
                                        SeqAttention, SeqMask, flash_available, flash_fits)
from .attention.padded import ROWS_MAX
from .attention.windowed import WindowedPagedAttention
from .compile import cuda_shaped
from .compile.compile_worker import CompileWorker
from .compile.compiled import CompiledStep

log = logging.getLogger(__name__)


@dataclass
class ForwardItem:
    token_ids: Sequence[int] | torch.Tensor
    positions: Sequence[int] | torch.Tensor
    context_len: int                   # cached tokens this sequence sees
    block_table: list[int]
    slots: Sequence[int] | None        # where new keys/values go; None = do not store
    mask: SeqMask = "causal"
    context_slots: torch.Tensor | None = None  # explicit cached slots (EAGLE tree / sparse context)


def attention_backend(dtype: torch.dtype, kv_dtype: torch.dtype, block_size: int,
                      use_flash: bool | None) -> Callable[[KVCache, AttentionMetadata], AttentionBackend]:
    """flash-attn's paged kernel where it is importable on CUDA (``use_flash``: decided by the
    caller) and fits (fp16/bf16 throughout, blocks of a multiple of 256 tokens); under the
    CUDA-shaped profile, its PyTorch stand-in wherever it fits; else SDPA over gathered blocks."""
    if not flash_fits(dtype, kv_dtype, block_size):
        return SdpaPagedAttention
    if cuda_shaped.active() and use_flash is None:
        return partial(FlashPagedAttention, flash=cuda_shaped.flash_attn_with_kvcache)
    return FlashPagedAttention if (use_flash if use_flash is not None else flash_available()) else SdpaPagedAttention


class ModelRunner:
    def __init__(self, model: Network, num_blocks: int, block_size: int,
                 kv_dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
                 use_flash: bool | None = None):
        cfg = model.config
        self.model = model
        self.config = cfg
        self.device = torch.device(device)
        self.block_size = block_size
        self.dtype = next(model.parameters()).dtype
        self.backend: Callable[[KVCache, AttentionMetadata], AttentionBackend]
        # One extra block at the end is scratch space for tokens that are not stored.
        kernel = attention_kernel(model)
        if kernel is not None:  # a network with its own attention and per-layer KV shapes
            self.kv = KVCache.of_layers(cfg.kv_shapes, num_blocks + 1, block_size, kv_dtype or self.dtype, self.device)
            self.backend = partial(WindowedPagedAttention, windows=cfg.windows, kernel=kernel)
        else:
            self.kv = KVCache(cfg.num_layers, num_blocks + 1, block_size, cfg.num_kv_heads, cfg.head_dim,
                              kv_dtype or self.dtype, self.device)
            self.backend = attention_backend(self.dtype, kv_dtype or self.dtype, block_size, use_flash)
            if any(w is not None for w in cfg.windows):  # sliding layers (Gemma 3): windowed masks
                self.backend = partial(SdpaPagedAttention, windows=cfg.windows)
        self._scratch_block = num_blocks
        self.compiled: CompiledStep | None = None  # set by compile()

    def compile(self, cache_dir: Path | None = None, worker: CompileWorker | None = None,
                attend_kernel: bool = True) -> CompiledStep | None:
        """Run steps through compiled graphs (``compile/compiled.py``) once each shape's graph is built: on
        ``worker``'s thread (eager until then), or, with no worker, on first use. ``attend_kernel``:
        graph attention as the project's kernel where it is built (``attention/padded.py``'s ``ROWS_MAX`` note)."""
        if not family(self.config.family).compiles:
            raise TypeError(f"{self.config.family}'s steps are not compiled (its family row says so)")
        if any(w is not None for w in self.config.windows):
            log.info("%s has sliding-window layers, which compiled steps do not take yet: it runs eager",
                     self.config.family)
            return None
        self.compiled = CompiledStep(self.model, self.kv, self.scratch_slots, cache_dir, worker, attend_kernel)
        return self.compiled

    @property
    def rows_max(self) -> int:
        """The most new tokens a sequence may bring to a step for each of its rows to come out as
        the same token decoded alone would (compiled: the rows graph's bound; eager: any length).
        A lossless verify stays within it."""
        return ROWS_MAX if self.compiled is not None else 1 << 30

    def _as_tensor(self, x, dtype=torch.long) -> torch.Tensor:
        return x.to(self.device) if isinstance(x, torch.Tensor) else torch.tensor(list(x), dtype=dtype,
                                                                                 device=self.device)

    def scratch_slots(self, n: int) -> torch.Tensor:
        """(n,) slots of the scratch block: keys/values written there are never read."""
        return self._scratch_block * self.block_size + torch.arange(n, device=self.device) % self.block_size

    def move_slots(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Move the keys/values of single slots in every layer (src[i] -> dst[i])."""
        self.kv.move_slots(src, dst)

    def head_kv(self, num_layers: int, num_kv_heads: int, head_dim: int, spare: int = 0) -> KVCache:
        """A KV cache for a draft head, indexed by the same block ids as the model's own, with at
        least ``spare`` slots past them (from ``kv.num_blocks * block_size``) that the head owns."""
        spare_blocks = -(-spare // self.block_size)
        return KVCache(num_layers, self.kv.num_blocks + spare_blocks, self.block_size, num_kv_heads, head_dim,
                       self.kv.dtype, self.device)

    def store_head_kv(self, kv: KVCache, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write a draft model's keys and values (layers, tokens, kv_heads, head_dim) at ``slots`` of
        ``kv`` (from ``head_kv``), without running attention: a DFlash drafter's context."""
        kv.store(slots, k, v)

    def attention(self, kv: KVCache, meta: AttentionMetadata) -> AttentionBackend:
        """The attention backend chosen at start-up, over ``kv`` (the model's or a head's)."""
        return self.backend(kv, meta)

    def metadata(self, items: Sequence[ForwardItem]) -> AttentionMetadata:
        seqs = [SeqAttention(it.context_len, len(it.token_ids), it.block_table, it.mask, it.context_slots)
                for it in items]
        slots = self._joined([self.scratch_slots(len(it.token_ids)) if it.slots is None else it.slots
                              for it in items])
        return AttentionMetadata(seqs, slots, self.block_size)

    @torch.inference_mode()
    def forward(self, items: Sequence[ForwardItem], aux_layers: Sequence[int] = (),
                inputs_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run one forward over all items; returns (hidden (tokens, hidden), aux hidden states)."""
        ids, pos, meta = self.describe(items)
        if self.compiled is not None and inputs_embeds is None:
            out = self.compiled(ids, pos, meta, aux_layers)
            if out is not None:
                return out
        attn = self.attention(self.kv, meta)
        return self.model(ids, pos, attn, inputs_embeds=inputs_embeds, aux_layers=aux_layers)

    def describe(self, items: Sequence[ForwardItem]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(token ids, positions, attention metadata) of one forward over ``items``."""
        return self._joined([it.token_ids for it in items]), self._joined([it.positions for it in items]), \
            self.metadata(items)

    def _joined(self, parts: list) -> torch.Tensor:
        """The items' sequences (lists, ranges or tensors) end to end as one long tensor; plain ones
        made into it at once (a step of 16 decodes made 48 small tensors and 3 concatenations
        otherwise, about 0.4 ms)."""
        if any(isinstance(p, torch.Tensor) for p in parts):
            return torch.cat([self._as_tensor(p) for p in parts])
        return torch.tensor(list(itertools.chain.from_iterable(parts)), dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def encode(self, items: Sequence[ForwardItem]) -> None:
        """An encoder-denoiser network's encoder over ``items``: it writes their keys and values."""
        ids, pos, meta = self.describe(items)
        self.model.encode(ids, pos, self.attention(self.kv, meta))

    @torch.inference_mode()
    def denoise(self, items: Sequence[ForwardItem], sc_logits: torch.Tensor | None = None,
                sc_rows: torch.Tensor | None = None) -> torch.Tensor:
        """An encoder-denoiser network's denoiser logits (tokens, vocab) over ``items``
        (``network.EncoderDenoiser.denoise``)."""
        ids, pos, meta = self.describe(items)
        return self.model.denoise(ids, pos, self.attention(self.kv, meta), sc_logits, sc_rows)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)
