"""GPU attention without flash-attn, and flash-attn's semantics, checked on the CPU at 256-token blocks.

On CUDA without flash-attn the runner takes ``SdpaPagedAttention``: it reads each sequence's cached
keys and values by slot, whatever the block size, so 256-token blocks need no other backend. Here
it runs in bf16 over a pool of 256-token blocks drawn at random (contexts spanning several
blocks; decode batches, draft trees, prefill chunks and canvases mixed), against dense fp32
attention over the same bf16 numbers.

``cuda_shaped.flash_attn_with_kvcache`` is the PyTorch stand-in for flash-attn's paged kernel that
the CUDA-shaped profile runs (``tests/server/test_cuda_shaped.py``): ``FlashPagedAttention`` over
it must give what SDPA gives, its in-place append must write where flash-attn writes, and it
refuses what the kernel refuses. On a GPU the same SDPA cases run on CUDA (``gpu`` mark).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from dualserve.decoders.engine.compile import cuda_shaped
from dualserve.decoders.engine.compile.cuda_shaped import flash_attn_with_kvcache
from dualserve.decoders.engine.attention.paged_attention import (AttentionMetadata, FlashPagedAttention, KVCache,
                                                                 SdpaPagedAttention, SeqAttention)
from dualserve.decoders.engine.runner import attention_backend
from dualserve.models.attention import DenseAttention

BLOCK, NUM_BLOCKS, HEADS, KV_HEADS, DIM = 256, 12, 4, 2, 64


def tree_mask(n: int, gen: torch.Generator) -> torch.Tensor:
    """A random draft-tree mask: each token sees itself and its parent's chain."""
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        mask[i] |= mask[int(torch.randint(0, i, (1,), generator=gen))]
    return mask


def batch(seqs: list[tuple[int, int, object]], seed: int, device: str = "cpu"):
    """A bf16 pool of 256-token blocks holding each sequence's context at a random block table, and
    the step's new tokens: (cache, metadata, q, k, v, dense fp32 reference of the new rows)."""
    gen = torch.Generator().manual_seed(seed)
    cache = KVCache(1, NUM_BLOCKS, BLOCK, KV_HEADS, DIM, torch.bfloat16, device)
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    k_flat, v_flat = cache.flat(0)
    metas, parts, refs, slots = [], [], [], []
    for context, new, mask in seqs:
        total = context + new
        table = [free.pop() for _ in range(-(-total // BLOCK))]
        slot = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(total)])
        q = torch.randn(total, HEADS, DIM, generator=gen).bfloat16()     # (tokens, heads, head_dim)
        k = torch.randn(total, KV_HEADS, DIM, generator=gen).bfloat16()  # (tokens, kv_heads, head_dim)
        v = torch.randn(total, KV_HEADS, DIM, generator=gen).bfloat16()
        k_flat[slot[:context].to(device)] = k[:context].to(device)
        v_flat[slot[:context].to(device)] = v[:context].to(device)
        full = torch.ones(total, total, dtype=torch.bool).tril()
        if isinstance(mask, torch.Tensor):
            full[context:, context:] = mask
        elif mask == "bidirectional":
            full[context:, context:] = True
        ref = DenseAttention([total], masks=[full])(0, q.float(), k.float(), v.float())
        metas.append(SeqAttention(context, new, table, mask))
        parts.append((q[context:], k[context:], v[context:]))
        refs.append(ref[context:])
        slots.append(slot[context:])
    meta = AttentionMetadata(metas, torch.cat(slots).to(device), BLOCK)
    q, k, v = (torch.cat([p[i] for p in parts]).to(device) for i in range(3))
    return cache, meta, q, k, v, torch.cat(refs)


GEN = torch.Generator().manual_seed(7)
CASES = {
    "decodes": [(300, 1, "causal"), (0, 1, "causal"), (511, 1, "causal"), (256, 1, "causal")],
    "prefill across blocks": [(0, 600, "causal")],
    "chunk after a cached prefix": [(257, 300, "causal"), (40, 1, "causal")],
    "trees and canvases": [(700, 9, tree_mask(9, GEN)), (255, 8, "bidirectional"), (12, 1, "causal")],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_sdpa_over_256_token_blocks_in_bf16_matches_dense(name):
    cache, meta, q, k, v, ref = batch(CASES[name], seed=len(name))
    out = SdpaPagedAttention(cache, meta)(0, q, k, v)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    assert torch.equal(cache.flat(0)[0][meta.slot_mapping], k), "new keys are stored at their slots"


@pytest.mark.parametrize("name", ["decodes", "prefill across blocks", "chunk after a cached prefix"])
def test_flash_paged_attention_over_the_stand_in_matches_sdpa(name):
    """Causal batches: the stand-in's path (one batched call for decodes, one call a sequence
    otherwise) against SDPA on the same pool, each over a copy of it."""
    cache, meta, q, k, v, ref = batch(CASES[name], seed=len(name))
    twin = KVCache(1, NUM_BLOCKS, BLOCK, KV_HEADS, DIM, torch.bfloat16, "cpu")
    twin.stacked.copy_(cache.stacked)
    flash = FlashPagedAttention(twin, meta, flash=flash_attn_with_kvcache)
    assert flash._usable
    got = flash(0, q, k, v)
    want = SdpaPagedAttention(cache, meta)(0, q, k, v)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)
    assert torch.equal(twin.stacked, cache.stacked), "both wrote the new keys and values at the same slots"


def test_masks_flash_attn_cannot_express_fall_back_to_sdpa():
    cache, meta, q, k, v, ref = batch(CASES["trees and canvases"], seed=3)
    flash = FlashPagedAttention(cache, meta, flash=flash_attn_with_kvcache)
    assert not flash._usable
    torch.testing.assert_close(flash(0, q, k, v).float(), ref, atol=2e-2, rtol=2e-2)


def test_the_stand_in_appends_new_keys_at_the_cache_length():
    """``k``/``v`` given: written at positions ``cache_seqlens[b]`` onwards through the block table,
    then attended to with the cached ones, causal from the bottom right (flash-attn's docstring)."""
    gen = torch.Generator().manual_seed(11)
    k_cache, v_cache = (torch.randn(4, BLOCK, KV_HEADS, DIM, generator=gen).bfloat16() for _ in range(2))
    cached, new = 250, 10  # the new tokens cross from the sequence's first block into its second
    table = torch.tensor([[2, 0]], dtype=torch.int32)
    q = torch.randn(1, new, HEADS, DIM, generator=gen).bfloat16()
    k, v = (torch.randn(1, new, KV_HEADS, DIM, generator=gen).bfloat16() for _ in range(2))
    before_k = k_cache.clone()
    seqlens = torch.tensor([cached], dtype=torch.int32)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=seqlens, block_table=table, causal=True)
    assert torch.equal(k_cache[2, cached:], k[0, : BLOCK - cached])
    assert torch.equal(k_cache[0, :4], k[0, BLOCK - cached:])
    assert torch.equal(k_cache[1], before_k[1]) and torch.equal(k_cache[2, :cached], before_k[2, :cached])
    keys = torch.cat([k_cache[2], k_cache[0, :4]]).float()
    values = torch.cat([v_cache[2], v_cache[0, :4]]).float()
    full = torch.ones(cached + new, cached + new, dtype=torch.bool).tril()
    qs = torch.cat([torch.zeros(cached, HEADS, DIM), q[0].float()])
    ref = DenseAttention([cached + new], masks=[full])(0, qs, keys, values)[cached:]
    torch.testing.assert_close(out[0].float(), ref, atol=2e-2, rtol=2e-2)


def test_the_stand_in_refuses_what_flash_attn_refuses():
    cache = torch.zeros(2, BLOCK, KV_HEADS, DIM)
    q = torch.zeros(1, 1, HEADS, DIM)
    seqlens, table = torch.tensor([1], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="fp16 and bf16"):
        flash_attn_with_kvcache(q, cache, cache, cache_seqlens=seqlens, block_table=table)
    small = torch.zeros(2, 16, KV_HEADS, DIM, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="divisible by 256"):
        flash_attn_with_kvcache(q.bfloat16(), small, small, cache_seqlens=seqlens, block_table=table)


def test_backend_choice(monkeypatch):
    """SDPA wherever flash-attn is not importable or does not fit; flash-attn where it is; its
    stand-in under the CUDA-shaped profile, where it fits."""
    bf16 = torch.bfloat16
    assert attention_backend(bf16, bf16, BLOCK, use_flash=False) is SdpaPagedAttention
    assert attention_backend(bf16, bf16, BLOCK, use_flash=True) is FlashPagedAttention
    assert attention_backend(bf16, bf16, 16, use_flash=True) is SdpaPagedAttention
    monkeypatch.setattr(cuda_shaped, "_active", True)
    chosen = attention_backend(bf16, bf16, BLOCK, use_flash=None)
    assert isinstance(chosen, partial) and chosen.keywords["flash"] is flash_attn_with_kvcache
    assert attention_backend(torch.float32, torch.float32, BLOCK, use_flash=None) is SdpaPagedAttention


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(CASES))
def test_sdpa_over_256_token_blocks_on_gpu(name):
    cache, meta, q, k, v, ref = batch(CASES[name], seed=len(name), device="cuda")
    out = SdpaPagedAttention(cache, meta)(0, q, k, v)
    torch.testing.assert_close(out.float().cpu(), ref, atol=2e-2, rtol=2e-2)
