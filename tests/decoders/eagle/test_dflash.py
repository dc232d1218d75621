"""The DFlash drafter: its published layout, its forward against a dense reference, and ``eagle`` with it.

The reference follows upstream's ``Qwen3DFlashAttention`` step by step with the
checkpoint's own (unfused) tensors: context keys and values are the layer's k/v
projections of ``hidden_norm(fc(features))``, concatenated before the block's own,
RoPE over [context positions; block positions], attention without a causal mask.
Ours writes the context's keys and values into a paged cache at catch-up and runs the
block over it; both must give the same draft logits. In the decoder, correctness is
the usual check: the same tokens as plain AR.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dualserve.decoders.engine.attention.paged_attention import (AttentionMetadata, KVCache, SdpaPagedAttention,
                                                                 SeqAttention)
from dualserve.decoders.eagle.tree import TreeConfig
from dualserve.decoders.engine.sampling import SamplingParams
from dualserve.models.attention import DenseAttention
from dualserve.models.dflash import DFlashDrafter, is_dflash, load_dflash, save_dflash
from dualserve.models.transformer import rotate_half
from test_eagle import GREEDY, PROMPTS, V, Tok, assert_first_two_tokens_follow, assert_same_as_ar, make_engine, \
    oracle_head, run, tiny_target
from tiny_dflash import write_tiny_dflash

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = [1, 4, 6]
MASK = V - 1


def tiny_drafter(path: Path, target, block_size: int = 5, d2t: torch.Tensor | None = None, seed: int = 0):
    state = write_tiny_dflash(path, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
                              vocab_size=V, num_layers=2, target_layer_ids=LAYERS, num_target_layers=8,
                              block_size=block_size, mask_token_id=MASK, seed=seed, d2t=d2t)
    return load_dflash(path, target), state


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """x (tokens, heads, dim), HF rotate-half RoPE."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    freqs = positions.float()[:, None] * inv[None]
    emb = torch.cat([freqs, freqs], -1)
    return x * emb.cos()[:, None] + rotate_half(x) * emb.sin()[:, None]


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_logits(state: dict, target, features: torch.Tensor, anchor: int, block: int) -> torch.Tensor:
    """Upstream's forward, dense: draft logits (block - 1, vocab) after ``features`` (n, 3H)."""
    n = features.shape[0]
    ctx = rms(features @ state["fc.weight"].T, state["hidden_norm.weight"])
    x = target.embed_tokens(torch.tensor([anchor] + [MASK] * (block - 1)))
    pos_ctx, pos_blk = torch.arange(n), torch.arange(n, n + block)
    for i in range(2):
        p = lambda name: state[f"layers.{i}.{name}"]
        h = rms(x, p("input_layernorm.weight"))
        q = rope(rms((h @ p("self_attn.q_proj.weight").T).view(block, 4, 8), p("self_attn.q_norm.weight")), pos_blk)
        k_of = lambda t, pos: rope(rms((t @ p("self_attn.k_proj.weight").T).view(len(t), 2, 8),
                                       p("self_attn.k_norm.weight")), pos)
        k = torch.cat([k_of(ctx, pos_ctx), k_of(h, pos_blk)])
        v = torch.cat([ctx @ p("self_attn.v_proj.weight").T, h @ p("self_attn.v_proj.weight").T]).view(-1, 2, 8)
        qh, kh, vh = q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1)
        out = F.scaled_dot_product_attention(qh, kh, vh).transpose(0, 1).reshape(block, -1)
        x = x + out @ p("self_attn.o_proj.weight").T
        h = rms(x, p("post_attention_layernorm.weight"))
        x = x + (F.silu(h @ p("mlp.gate_proj.weight").T) * (h @ p("mlp.up_proj.weight").T)) @ p("mlp.down_proj.weight").T
    return target.logits(rms(x, state["norm.weight"])[1:])


def paged_logits(drafter: DFlashDrafter, features: torch.Tensor, anchor: int, block: int) -> torch.Tensor:
    """What ``BlockSource`` does: catch-up writes context KV into a paged cache; the block reads it."""
    n, bs = features.shape[0], 4
    c = drafter.config.layer
    cache = KVCache(c.num_layers, 16, bs, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    table = [5, 2, 9, 11, 7]  # scattered blocks
    slots = torch.tensor([table[j // bs] * bs + j % bs for j in range(n)])
    k, v = drafter.context_kv(drafter.features(None, [features]), torch.arange(n))
    cache.store(slots, k, v)
    meta = AttentionMetadata([SeqAttention(n, block, table, "bidirectional", slots)], None, bs)
    h = drafter(torch.tensor(drafter.block_ids(anchor, block)), torch.arange(n, n + block),
                SdpaPagedAttention(cache, meta))
    return drafter.logits(h[1:])


def target_features(target, ids: list[int]) -> torch.Tensor:
    _, aux = target(torch.tensor(ids), torch.arange(len(ids)), DenseAttention([len(ids)]), aux_layers=LAYERS)
    return torch.cat(aux, -1)


def test_published_layout_loads_and_matches_the_dense_reference(tmp_path: Path) -> None:
    target = tiny_target(3, 0.5)
    drafter, state = tiny_drafter(tmp_path, target)
    assert is_dflash(tmp_path) and drafter.config.block_size == 5 and drafter.config.mask_token_id == MASK
    assert drafter.config.aux_layers == tuple(LAYERS)
    ids = [5, 9, 17, 3, 40, 22, 8, 13, 30]
    feats = target_features(target, ids)
    for n in (1, 6, 9):  # context lengths, the anchor after it
        got = paged_logits(drafter, feats[:n], ids[n % len(ids)], 5)
        want = reference_logits(state, target, feats[:n], ids[n % len(ids)], 5)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_save_round_trip_and_draft_vocabulary(tmp_path: Path) -> None:
    target = tiny_target(3, 0.5)
    used = torch.tensor([1, 3, 4, 8, 20, 33, 50, 63])
    drafter, _ = tiny_drafter(tmp_path / "a", target, d2t=used - torch.arange(len(used)))
    assert drafter.config.draft_vocab_size == 8
    feats = target_features(target, [5, 9, 17, 3])
    full = target.logits(drafter(torch.tensor(drafter.block_ids(7, 4)), torch.arange(4, 8),
                                 DenseAttention([4]))[1:])  # no context: the block alone
    draft = drafter.logits(drafter(torch.tensor(drafter.block_ids(7, 4)), torch.arange(4, 8), DenseAttention([4]))[1:])
    torch.testing.assert_close(draft, full[:, used], rtol=1e-5, atol=1e-5)  # the same rows of the target's head
    assert drafter.to_target(torch.tensor([0, 7])).tolist() == [1, 63]
    save_dflash(drafter, target.config, tmp_path / "b", dtype=torch.float32)
    again = load_dflash(tmp_path / "b", target)
    torch.testing.assert_close(paged_logits(again, feats, 11, 4), paged_logits(drafter, feats, 11, 4))


def test_beside_a_w4a8_target_the_draft_rows_run_in_its_format(tmp_path: Path) -> None:
    from dualserve.models import kernels
    from dualserve.models.quant import Dot8Linear
    if not kernels.available():
        pytest.skip(f"the dot8 kernel is not available: {kernels.unavailable_reason()}")
    target = tiny_target(3, 0.5)
    used = torch.tensor([1, 3, 4, 8, 20, 33, 50, 63])
    drafter, _ = tiny_drafter(tmp_path, target, d2t=used - torch.arange(len(used)))
    h = drafter(torch.tensor(drafter.block_ids(7, 4)), torch.arange(4, 8), DenseAttention([4]))
    before = drafter.logits(h)
    drafter.serve_in("w4a8", bits=8)
    assert isinstance(drafter.draft_layer[0], Dot8Linear) and "draft_layer" not in str(drafter.state_dict().keys())
    torch.testing.assert_close(drafter.logits(h), before, rtol=0.05, atol=0.05)  # 8-bit rows, int8 activations


def test_rope_scaling_survives_a_save(tmp_path: Path) -> None:
    import dataclasses
    from dualserve.models.config import RopeScaling
    target = tiny_target(3, 0.5)
    drafter, _ = tiny_drafter(tmp_path / "a", target)
    scaled = RopeScaling("llama3", 8.0, 1.0, 4.0, 512)
    drafter.config = dataclasses.replace(drafter.config, layer=drafter.config.layer.replace(rope_scaling=scaled))
    save_dflash(drafter, target.config, tmp_path / "b", dtype=torch.float32)
    assert load_dflash(tmp_path / "b", target).config.layer.rope_scaling == scaled


def test_refuses_what_it_cannot_run(tmp_path: Path) -> None:
    import json
    target = tiny_target(3, 0.5)
    tiny_drafter(tmp_path, target)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for change, message in [({"layer_types": ["sliding_attention"] * 2}, "sliding"),
                            ({"dflash_config": {**cfg["dflash_config"], "target_layer_ids": [1, 9]}}, "outside"),
                            ({"architectures": ["DFlash2DraftModel"]}, "DFlash2")]:
        (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ValueError, match=message):
            load_dflash(tmp_path, target)


@pytest.mark.parametrize("bigram", [0.0, 0.4])
def test_greedy_identical_to_ar(tmp_path: Path, bigram: float) -> None:
    target = tiny_target(7, bigram)
    drafter, _ = tiny_drafter(tmp_path, target)
    engine = make_engine(target, None, TreeConfig(depth=3, top_k=2, num_nodes=4), block=drafter)
    outs = assert_same_as_ar(engine)
    assert all(o[-1].stats.get("block_steps", 0) > 0 for o in outs)  # the drafter drafted
    # With suffix drafts merged in, repeated output gets accepted: the KV moves run too.
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, draft="both")
    outs = assert_same_as_ar(engine, params)
    assert max(o[-1].stats["mean_accept_length"] for o in outs) > 1.5


def test_head_and_drafter_side_by_side(tmp_path: Path) -> None:
    """Both model sources in one decoder: each request drafts from the one it names, in one batch."""
    from dualserve.decoders.ar import ARDecoder
    from dualserve.decoders.eagle.decoder import EagleDecoder
    from dualserve.decoders.engine.engine import Engine, EngineConfig
    from dualserve.decoders.engine.runner import ModelRunner

    target = tiny_target(1)  # a bigram target: the oracle head's drafts are accepted
    drafter, _ = tiny_drafter(tmp_path, target)
    engine = Engine(EngineConfig(num_blocks=256, block_size=4))
    runner = ModelRunner(target, 256, 4)
    engine.add_decoder("m", ARDecoder(runner, engine.pool), Tok())
    eagle = EagleDecoder(runner, engine.pool, oracle_head(target), TreeConfig(depth=3, top_k=2, num_nodes=4),
                         block=drafter)
    engine.add_decoder("m", eagle, Tok())
    assert eagle.prefer == "head" and list(eagle.sources) == ["head", "block", "suffix"]
    params = {d: SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, draft=d) for d in ("head", "block")}
    jobs = [(dec, p, params[d]) for p in PROMPTS[:3] for d in ("head", "block") for dec in ("ar", "eagle")]
    outs = run(engine, jobs)
    for i in range(0, len(jobs), 2):
        assert [t for d in outs[i + 1] for t in d.token_ids] == [t for d in outs[i] for t in d.token_ids]
        stats, model = outs[i + 1][-1].stats, jobs[i + 1][2].draft
        assert stats.get(f"{model}_steps", 0) > 0 and not stats.get(f"{'block' if model == 'head' else 'head'}_steps")
    assert max(o[-1].stats["mean_accept_length"] for o in outs[1::4]) > 2  # the oracle head's requests
    engine.pool.check()
    with pytest.raises(TypeError, match="block="):  # "head" names the EAGLE head alone
        EagleDecoder(runner, engine.pool, drafter, block=drafter)


def test_mixed_batch_prefix_cache_and_preemption(tmp_path: Path) -> None:
    target = tiny_target(5, 0.2)
    drafter, _ = tiny_drafter(tmp_path, target, block_size=4)
    engine = make_engine(target, None, TreeConfig(depth=3, top_k=2, num_nodes=6), block=drafter, num_blocks=40,
                         max_batched_tokens=24)
    long = list(range(1, 30))
    jobs = [(d, p, GREEDY) for p in [long, long[:17], PROMPTS[0], long] for d in ("ar", "eagle")]
    outs = run(engine, jobs)
    for i in range(0, len(jobs), 2):
        assert [t for d in outs[i + 1] for t in d.token_ids] == [t for d in outs[i] for t in d.token_ids]
    assert engine.scheduler.num_preemptions > 0
    engine.pool.check()


def test_sampling_matches_plain_sampling(tmp_path: Path) -> None:
    vocab = 8
    target = tiny_target(6, 0.3, vocab=vocab)
    state = write_tiny_dflash(tmp_path, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
                              vocab_size=vocab, num_layers=1, target_layer_ids=LAYERS, num_target_layers=8,
                              block_size=3, mask_token_id=vocab - 1)
    assert state
    drafter = load_dflash(tmp_path, target)
    engine = make_engine(target, None, TreeConfig(depth=2, top_k=2, num_nodes=4), block=drafter, num_blocks=1024,
                         max_num_seqs=256, max_waiting=4096, max_batched_tokens=4096)
    params = SamplingParams(max_tokens=4, temperature=0.9, top_k=6, top_p=0.95, ignore_eos=True, seed=0)
    prompt = [3, 1, 4]
    n = 800
    outs = run(engine, [("eagle", prompt, SamplingParams(**{**params.__dict__, "seed": i})) for i in range(n)])
    assert sum(o[-1].stats.get("block_steps", 0) for o in outs) > n // 2
    assert_first_two_tokens_follow(target, prompt, params, outs)
