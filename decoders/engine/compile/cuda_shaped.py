"""The CUDA-shaped profile: the CPU running the choices the CUDA path makes, for tests.

No GPU runs in the suite, yet the CUDA path differs from the CPU path in more than its kernels:
the project's C++ kernels are not used, steps compile through ``torch.compile`` on the compile
thread instead of AOTInductor packages, and eager attention goes through flash-attn's paged
kernel at 256-token blocks. Under this profile the CPU makes those same choices:

  kernels     ``models.kernels.disable``: every layer, norm and attention takes PyTorch's ops
  compile     ``CompiledStep`` takes its ``torch.compile`` branch (``compiled.py``)
  attention   ``FlashPagedAttention`` over ``flash_attn_with_kvcache`` below, a pure-torch
              stand-in for flash-attn's function, where flash-attn's own checks let it run

The profile is chosen once at start-up (``server/settings.py``: ``DUALSERVE_CUDA_SHAPED=1``) and
holds for the process; the dtype and block size are the command line's (``--dtype bfloat16
--block-size 256``). Nothing in it is used on a GPU.
"""

from __future__ import annotations

import torch

from dualserve.models import kernels

_active = False


def activate() -> None:
    """Run this process CUDA-shaped (before any model loads)."""
    global _active
    kernels.disable("the cuda-shaped profile runs without the project's kernels, as CUDA does")
    _active = True


def active() -> bool:
    return _active


def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                            cache_seqlens: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                            causal: bool = False, softmax_scale: float | None = None) -> torch.Tensor:
    """flash-attn's ``flash_attn_with_kvcache`` for a paged cache, in PyTorch (flash-attn 2,
    ``flash_attn/flash_attn_interface.py``):

      q                  (batch, seqlen_q, heads, head_dim)
      k_cache, v_cache   (num_blocks, block_size, kv_heads, head_dim), read through ``block_table``
                         (batch, max blocks) int32; heads a multiple of kv_heads (grouped queries)
      k, v               (batch, seqlen_new, kv_heads, head_dim) or None: written into the cache
                         in place at positions ``cache_seqlens[b]`` onwards, then attended to
      cache_seqlens      (batch,) int32: tokens already in each sequence's cache
      causal             aligned to the bottom right: query i sees keys j <= i + seqlen_k - seqlen_q

    Returns (batch, seqlen_q, heads, head_dim) in q's dtype; scores and the softmax in fp32, as the
    kernel accumulates. It checks what the kernel checks (dtypes, 256-token blocks)."""
    if q.dtype not in (torch.float16, torch.bfloat16) or k_cache.dtype != q.dtype:
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    block_size = k_cache.shape[1]
    if block_size % 256:
        raise RuntimeError("Paged KV cache block size must be divisible by 256")
    batch, seqlen_q, heads, d = q.shape
    kv_heads = k_cache.shape[2]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    k_flat, v_flat = k_cache.view(-1, kv_heads, d), v_cache.view(-1, kv_heads, d)
    out = torch.empty_like(q)
    for b in range(batch):
        cached = int(cache_seqlens[b])
        new = 0 if k is None else k.shape[1]
        length = cached + new
        positions = torch.arange(length, device=q.device)
        slots = block_table[b].long()[positions // block_size] * block_size + positions % block_size
        if new:
            k_flat.index_copy_(0, slots[cached:], k[b].to(k_flat.dtype))
            v_flat.index_copy_(0, slots[cached:], v[b].to(v_flat.dtype))
        keys = k_flat.index_select(0, slots).float().repeat_interleave(heads // kv_heads, 1)  # (length, heads, d)
        values = v_flat.index_select(0, slots).float().repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", q[b].float(), keys) * scale                     # (heads, seqlen_q, length)
        if causal:
            last = torch.arange(seqlen_q, device=q.device)[:, None] + (length - seqlen_q)
            scores = scores.masked_fill(positions[None, :] > last, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[b] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out
