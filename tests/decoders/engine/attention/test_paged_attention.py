"""Paged attention against dense attention: same outputs whatever blocks hold the cache.

Each sequence gets random queries, keys and values for its whole length. Its first
``context`` tokens are written into a ``KVCache`` through a block table drawn at random
from the pool; the rest are the step's new tokens. ``SdpaPagedAttention`` over the new
tokens must equal ``models.attention.DenseAttention`` over the whole sequence (its rows
for the new tokens), for causal, full and explicit masks, mixed in one batch. A last
check runs a tiny model through ``ModelRunner`` in chunks and compares with one dense
forward. The flash-attn path is compared with this one on a GPU (``gpu`` mark).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from dualserve.decoders.engine.blocks import slot_of
from dualserve.decoders.engine.attention.paged_attention import (AttentionMetadata, KVCache, SdpaPagedAttention,
                                                                 SeqAttention)
from dualserve.decoders.engine.runner import ForwardItem, ModelRunner
from dualserve.models.attention import DenseAttention
from dualserve.models.config import ModelConfig
from dualserve.models.kernels import ops as kernel_ops
from dualserve.models.transformer import Transformer

HEADS, KV_HEADS, DIM, BS, NUM_BLOCKS = 4, 2, 16, 4, 64


@dataclass
class Seq:
    context: int
    new: int
    mask: str | torch.Tensor = "causal"   # among the new tokens


def tree_mask(n: int, gen: torch.Generator) -> torch.Tensor:
    """A random draft-tree mask: each token sees itself and a random earlier parent chain."""
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        parent = int(torch.randint(0, i, (1,), generator=gen))
        mask[i] |= mask[parent]
    return mask


def dense_mask(seq: Seq) -> torch.Tensor:
    """(total, total) mask for DenseAttention: causal context, then what the new tokens see."""
    c, q = seq.context, seq.new
    full = torch.ones(c + q, c + q, dtype=torch.bool).tril()
    if isinstance(seq.mask, torch.Tensor):
        full[c:, c:] = seq.mask
    elif seq.mask == "bidirectional":
        full[c:, c:] = True
    return full


def run_case(seqs: list[Seq], seed: int, store: bool = True, device: str = "cpu", dtype=torch.float32,
             backend=SdpaPagedAttention) -> tuple[torch.Tensor, torch.Tensor, KVCache, torch.Tensor, torch.Tensor]:
    """(paged output, dense reference, cache, new keys, new slots) for one batch."""
    gen = torch.Generator().manual_seed(seed)
    cache = KVCache(1, NUM_BLOCKS, BS, KV_HEADS, DIM, dtype, device)
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    k_flat, v_flat = cache.flat(0)
    qs, ks, vs, slots, metas, refs = [], [], [], [], [], []
    for s in seqs:
        total = s.context + s.new
        table = [free.pop() for _ in range(-(-total // BS))]
        slot = torch.tensor([table[p // BS] * BS + p % BS for p in range(total)])
        q = torch.randn(total, HEADS, DIM, generator=gen).to(device, dtype)  # (tokens, heads, head_dim)
        k = torch.randn(total, KV_HEADS, DIM, generator=gen).to(device, dtype)
        v = torch.randn(total, KV_HEADS, DIM, generator=gen).to(device, dtype)
        k_flat[slot[:s.context].to(device)] = k[:s.context]
        v_flat[slot[:s.context].to(device)] = v[:s.context]
        qs.append(q[s.context:])
        ks.append(k[s.context:])
        vs.append(v[s.context:])
        slots.append(slot[s.context:])
        metas.append(SeqAttention(s.context, s.new, table, s.mask))
        ref = DenseAttention([total], masks=[dense_mask(s)])(0, q.float(), k.float(), v.float())
        refs.append(ref[s.context:])
    new_slots = torch.cat(slots).to(device)
    meta = AttentionMetadata(metas, new_slots if store else None, BS)
    k_new = torch.cat(ks)
    out = backend(cache, meta)(0, torch.cat(qs), k_new, torch.cat(vs))
    return out, torch.cat(refs), cache, k_new, new_slots


MIXED = [Seq(0, 7), Seq(13, 5), Seq(20, 1), Seq(9, 4, "bidirectional"), Seq(0, 6, "bidirectional"), Seq(3, 1)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mixed_causal_and_full_batch_matches_dense(seed):
    out, ref, cache, k_new, slots = run_case(MIXED, seed)
    assert out.shape == ref.shape == (sum(s.new for s in MIXED), HEADS, DIM)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache.flat(0)[0][slots], k_new), "new keys are stored at their slots"


@pytest.mark.parametrize("store", [True, False])
def test_all_decode_batch_runs_as_one_padded_call(store):
    """Only single-token steps: one batched call, padded to the longest context (incl. an empty one)."""
    seqs = [Seq(20, 1), Seq(3, 1), Seq(0, 1), Seq(31, 1), Seq(8, 1, "bidirectional")]
    out, ref, *_ = run_case(seqs, seed=4, store=store)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_explicit_tree_masks_match_dense():
    gen = torch.Generator().manual_seed(5)
    seqs = [Seq(11, 6, tree_mask(6, gen)), Seq(0, 5, tree_mask(5, gen)), Seq(16, 1), Seq(7, 3)]
    out, ref, *_ = run_case(seqs, seed=5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_unstored_tokens_leave_the_cache_unchanged():
    seqs = [Seq(8, 4, "bidirectional"), Seq(5, 3, "bidirectional")]
    out, ref, cache, _, slots = run_case(seqs, seed=3, store=False)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert not cache.flat(0)[0][slots].any(), "nothing was written for a do-not-store step"


def test_sparse_context_slots():
    """A sequence that sees only some cached positions (an EAGLE tree over a kept path)."""
    gen = torch.Generator().manual_seed(9)
    cache = KVCache(1, NUM_BLOCKS, BS, KV_HEADS, DIM, torch.float32, "cpu")
    table = [17, 3, 40, 8]
    visible = [0, 1, 2, 5, 9, 10]
    q = torch.randn(3, HEADS, DIM, generator=gen)
    k = torch.randn(13, KV_HEADS, DIM, generator=gen)
    v = torch.randn(13, KV_HEADS, DIM, generator=gen)
    slot = torch.tensor([table[p // BS] * BS + p % BS for p in range(13)])
    cache.flat(0)[0][slot[:10]] = k[:10]
    cache.flat(0)[1][slot[:10]] = v[:10]
    # With context_slots, context_len counts the visible cached tokens.
    seq = SeqAttention(len(visible), 3, table, "causal", context_slots=slot[visible])
    out = SdpaPagedAttention(cache, AttentionMetadata([seq], slot[10:], BS))(0, q, k[10:], v[10:])
    keep = torch.tensor(visible + [10, 11, 12])
    mask = torch.ones(3, len(keep), dtype=torch.bool)
    mask[:, len(visible):] = torch.ones(3, 3, dtype=torch.bool).tril()
    full_q = torch.zeros(len(keep), HEADS, DIM)
    full_q[len(visible):] = q
    dense_full = torch.ones(len(keep), len(keep), dtype=torch.bool).tril()
    dense_full[len(visible):] = mask
    ref = DenseAttention([len(keep)], masks=[dense_full])(0, full_q, k[keep], v[keep])[len(visible):]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_runner_chunked_prefill_and_decode_match_one_dense_forward():
    cfg = ModelConfig(family="llama", vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, intermediate_size=64)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Transformer(cfg).eval().requires_grad_(False)
    ids = torch.randint(0, 97, (23,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref, _ = model(ids, torch.arange(23), DenseAttention([23]))
    runner = ModelRunner(model, num_blocks=16, block_size=BS, use_flash=False)
    table = [11, 2, 7, 0, 14, 5]  # 6 blocks of 4 cover 23 tokens, scattered on purpose
    pieces = []
    for start, end in [(0, 9), (9, 17), (17, 21), (21, 22), (22, 23)]:  # chunks, then single-token decodes
        slots = [slot_of(table, p, BS) for p in range(start, end)]
        item = ForwardItem(ids[start:end], range(start, end), start, table, slots)
        hidden, _ = runner.forward([item])
        pieces.append(hidden)
    torch.testing.assert_close(torch.cat(pieces), ref, atol=1e-4, rtol=1e-4)


def test_runner_owns_slot_moves_scratch_and_head_kv():
    cfg = ModelConfig(family="llama", vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, intermediate_size=64)
    runner = ModelRunner(Transformer(cfg).eval(), num_blocks=4, block_size=BS, use_flash=False)
    for layer in range(cfg.num_layers):
        k, v = runner.kv.flat(layer)
        k.copy_(torch.randn(k.shape))
        v.copy_(torch.randn(v.shape))
    before = [tuple(t.clone() for t in runner.kv.flat(layer)) for layer in range(cfg.num_layers)]
    runner.move_slots([5, 9], [2, 3])
    for layer, (k0, v0) in enumerate(before):
        k, v = runner.kv.flat(layer)
        assert torch.equal(k[[2, 3]], k0[[5, 9]]) and torch.equal(v[[2, 3]], v0[[5, 9]])
        assert torch.equal(k[4:], k0[4:])
    # Scratch slots lie past the pool's blocks, in the runner's one spare block.
    assert runner.scratch_slots(6).tolist() == [4 * BS + i % BS for i in range(6)]
    head = runner.head_kv(num_layers=1, num_kv_heads=3, head_dim=5)
    assert head.num_blocks == runner.kv.num_blocks and head.dtype == runner.kv.dtype
    assert head.k[0].shape == (runner.kv.num_blocks, BS, 3, 5)
    meta = AttentionMetadata([SeqAttention(0, 2, [0])], torch.tensor([0, 1]), BS)
    assert isinstance(runner.attention(head, meta), SdpaPagedAttention)


def test_store_gives_the_same_pool_with_and_without_the_kernel(monkeypatch):
    """``KVCache.store`` writes through ``store_kv`` where the kernels are built and through
    ``index_copy_`` elsewhere: the same pool either way, an fp32 step into a bf16 pool included."""
    g = torch.Generator().manual_seed(5)
    caches = [KVCache(3, 6, BS, 2, 16, torch.bfloat16, "cpu") for _ in range(2)]
    slots = torch.tensor([3, 17, 8, 9, 22])  # 6 blocks of BS = 4 slots
    k, v = torch.randn(2, 3, 5, 2, 16, generator=g)  # fp32, as an eager step hands them over
    caches[0].store(slots, k, v)
    monkeypatch.setattr(kernel_ops, "store_eligible", lambda pool: False)
    caches[1].store(slots, k, v)
    assert torch.equal(caches[0].stacked, caches[1].stacked)
    assert torch.equal(caches[0].flat(2)[1][8], v[2, 2].bfloat16())
