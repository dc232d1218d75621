"""CUDA graphs of the rows step: the buckets, the padding they add (checked on the CPU), and the
captured replay against the uncaptured forward (on a GPU)."""

from __future__ import annotations

import random

import pytest
import torch

from dualserve.decoders.ar import ARDecoder
from dualserve.decoders.engine.attention.padded import PaddedPagedAttention, PaddedSizes, StepShape
from dualserve.decoders.engine.compile.cuda_graphs import CONTEXT_MIN, bucket
from dualserve.decoders.engine.compile.step_graph import ForwardWithFeatures
from dualserve.decoders.engine.engine import Engine, EngineConfig
from dualserve.decoders.engine.attention.paged_attention import KVCache
from dualserve.decoders.engine.runner import ModelRunner
from dualserve.decoders.engine.sampling import SamplingParams
from dualserve.models.transformer import Transformer
from tiny_engine import BLOCK, CFG, FakeTokenizer, meta_for, tiny

TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)


def test_buckets_cover_decode_batches_and_verify_trees_and_nothing_larger() -> None:
    decodes = meta_for([(70, 1, "causal"), (3, 1, "causal"), (12, 1, "causal")])
    assert bucket(decodes) == PaddedSizes(sequences=4, queries=1, context=128, tokens=4)
    mixed = meta_for([(9, 4, TREE), (5, 1, "causal")])
    assert bucket(mixed) == PaddedSizes(sequences=2, queries=4, context=CONTEXT_MIN, tokens=8)
    assert bucket(meta_for([(9, 20, "causal")])) == PaddedSizes(1, 24, CONTEXT_MIN, 24)  # T never above S x Q
    assert bucket(meta_for([(9, 25, "causal")])) is None                                # a prefill chunk
    assert bucket(meta_for([(1, 1, "causal")] * 257)) is None                           # past the largest batch


@pytest.mark.parametrize("seqs", [
    [(7, 1, "causal")],
    [(7, 1, "causal"), (0, 1, "causal"), (13, 1, "causal")],
    [(9, 4, TREE), (3, 1, "causal")],
    [(6, 4, "bidirectional")],
])
def test_a_step_padded_to_its_bucket_gives_its_tokens_the_same_outputs(seqs) -> None:
    """What a captured graph computes, eagerly on the CPU: the step padded to its bucket (more
    sequences, query rows, cached slots and token rows, all masked) gives the step's own tokens the
    hidden states and the new keys and values of the unpadded step."""
    torch.manual_seed(3)
    cache = KVCache(CFG.num_layers, 64, BLOCK, CFG.num_kv_heads, CFG.head_dim, torch.float32, "cpu")
    cache.stacked.normal_()
    forward = ForwardWithFeatures(tiny(), (1,))
    meta = meta_for(seqs)
    T = sum(s[1] for s in seqs)
    ids, pos = torch.randint(3, CFG.vocab_size, (T,)), torch.cat([torch.arange(c, c + n) for c, n, _ in seqs])
    with torch.inference_mode():
        plain = PaddedPagedAttention.build(cache, meta, "cpu", False)
        want = forward(ids, pos, plain.rows, plain.context, plain.mask, cache.stacked)
        sizes = bucket(meta)
        padded = PaddedPagedAttention.build(cache, meta, "cpu", False, sizes)
        assert padded.rows.shape == (sizes.sequences, sizes.queries)
        assert padded.mask.shape == (sizes.sequences, sizes.queries, sizes.context + sizes.queries)
        fill = torch.zeros(sizes.tokens - T, dtype=torch.long)
        got = forward(torch.cat([ids, fill]), torch.cat([pos, fill]), padded.rows, padded.context, padded.mask,
                      cache.stacked)
    assert torch.equal(padded.slot_mapping, plain.slot_mapping)
    for g, w in zip(got[:-2], want[:-2]):  # hidden states, then the feature layer's
        torch.testing.assert_close(g[:T], w, rtol=1e-5, atol=1e-5)
    for g, w in zip(got[-2:], want[-2:]):  # new keys and values, (layers, T, kv_heads, head_dim)
        torch.testing.assert_close(g[:, :T], w, rtol=1e-5, atol=1e-5)


def decode(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        engine.submit("m", "ar", prompt, params, lambda _c, d, i=i: out[i].extend(d.token_ids))
    engine.run_until_idle()
    assert engine.pool.num_used_blocks == 0
    return [out[i] for i in range(len(prompts))]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_decode_steps_give_the_uncaptured_tokens_on_a_gpu() -> None:
    """On CUDA the compiled rows step replays a captured graph per bucket; greedy tokens equal
    those of the same compiled forward without graphs, in any batch."""

    def engine_for(model: Transformer, graphs: bool) -> tuple[Engine, object]:
        engine = Engine(EngineConfig(num_blocks=256, block_size=BLOCK, max_batched_tokens=24))
        runner = ModelRunner(model, 256, BLOCK, use_flash=False, device="cuda")
        step = runner.compile()
        step.warm([(StepShape(False), ()), (StepShape(True), ())])
        if not graphs:
            step.cuda_graphs = None
        engine.add_decoder("m", ARDecoder(runner, engine.pool), FakeTokenizer(), CFG.vocab_size)
        return engine, step

    rng = random.Random(2)
    prompts = [[rng.randrange(3, CFG.vocab_size) for _ in range(rng.randrange(2, 14))] for _ in range(6)]
    model = tiny().to("cuda")
    plain, _ = engine_for(model, graphs=False)
    captured, step = engine_for(model, graphs=True)
    want = decode(plain, prompts)
    assert decode(captured, prompts) == want
    assert decode(captured, prompts[:1]) == want[:1]
    assert any(g.graphs for g in step.cuda_graphs.values())
