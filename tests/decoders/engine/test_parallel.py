"""Tensor parallelism on the CPU: 2 ranks over gloo, started the way ``dualserve serve`` starts them.

Rank 0 is this test process (``tensor_parallel.start`` spawns rank 1); both load the same
checkpoint through ``load_deployment`` and rank 0 drives the engine. Every generation is compared
token for token with a one-rank deployment of the same checkpoint. The step description's
encoding and the exact slicing of quantized layers are checked without ranks.
"""

from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import torch

from dualserve.decoders.engine.attention.paged_attention import AttentionMetadata, SeqAttention
from dualserve.decoders.engine.parallel import RankFailure, decode_forward, encode_forward
from dualserve.decoders.engine.sampling import SamplingParams
from dualserve.models.quant import Int4Linear, Int8Linear
from dualserve.models.sharding import sharded_bytes, split_sizes, take_cols, take_rows
from dualserve.server import tensor_parallel
from dualserve.server.cli import load_deployment, model_settings
from dualserve.server.settings import Settings
from tiny_checkpoints import write_tiny_llada
from tiny_twin import write_chat_tokenizer, write_tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[1, 5, 7, 9, 11], [1, 3, 4, 20, 21, 22, 23, 30, 31], [1, 12, 13]]
CHATS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]


def settings_for(*argv: str, tp: int = 1) -> Settings:
    # Admission by places only: on a slow host a queued request must wait its turn, not end in a 429.
    return model_settings(["--device", "cpu", "--no-compile", "--threads", "1", "--tensor-parallel-size", str(tp),
                           "--tp-timeout", "120", "--tp-heartbeat", "2", "--max-queue-wait", "0",
                           "--max-run-time", "0", *argv])


@contextmanager
def ranks(*argv: str) -> Iterator:
    """A 2-rank deployment; the spawned rank is stopped (or killed) however the test ends."""
    settings = settings_for(*argv, tp=2)
    group = tensor_parallel.start(settings)
    try:
        yield load_deployment(settings, group)
    finally:
        group.shutdown(timeout=10)
        for p in group.processes:
            assert not p.is_alive()


def generate(dep, prompts, max_tokens: int = 12, decoder: str | None = None, chat: bool = False) -> list[list[int]]:
    name = next(iter(dep.models))
    decoder = decoder or dep.engine.decoders_for(name)[0]
    tok = dep.models[name].tokenizer
    outs: list[list[int]] = []
    reasons: list[str] = []
    for p in prompts:
        if chat:
            p = tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True),
                           add_special_tokens=False)
        got: list[int] = []

        def on_delta(_, d, got=got) -> None:
            got.extend(d.token_ids)
            if d.finish_reason:
                reasons.append(d.finish_reason)

        dep.engine.submit(name, decoder, list(p), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                 ignore_eos=not chat), on_delta)
        outs.append(got)
    dep.engine.run_until_idle()
    assert len(reasons) == len(prompts) and "error" not in reasons, reasons
    return outs


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("qwen2"), family="qwen2")


# ---- without ranks -------------------------------------------------------------------------------


def test_step_description_round_trips():
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    seqs = [SeqAttention(5, 2, [3, 4], "causal"), SeqAttention(0, 3, [7], tree, torch.tensor([1, 2, 9])),
            SeqAttention(16, 1, [1, 2, 5], "bidirectional")]
    meta = AttentionMetadata(seqs, torch.arange(6) + 40, 16)
    ids, pos = torch.arange(6) + 100, torch.tensor([5, 6, 0, 1, 1, 16])
    sizes, payload = encode_forward(ids, pos, meta, (2, 7))
    ids2, pos2, meta2, aux = decode_forward(sizes, payload, 16, torch.device("cpu"))
    assert torch.equal(ids, ids2) and torch.equal(pos, pos2) and aux == (2, 7)
    assert torch.equal(meta2.slot_mapping, meta.slot_mapping) and meta2.block_size == 16
    for a, b in zip(meta.seqs, meta2.seqs):
        assert (a.context_len, a.query_len, a.block_table) == (b.context_len, b.query_len, b.block_table)
        assert (a.context_slots is None) == (b.context_slots is None)
        if a.context_slots is not None:
            assert torch.equal(a.context_slots, b.context_slots)
        assert torch.equal(a.mask, b.mask) if isinstance(a.mask, torch.Tensor) else a.mask == b.mask


def test_split_sizes_are_whole_units_and_uneven_heads_split():
    assert split_sizes(3, 2) == [2, 1]  # SmolLM2-135M's KV heads
    assert split_sizes(1536, 2, 32) == [768, 768]
    assert split_sizes(96, 2, 32) == [64, 32]
    with pytest.raises(ValueError):
        split_sizes(1, 2)


@pytest.mark.parametrize("kind", [Int4Linear, Int8Linear])
def test_quantized_layers_slice_exactly(kind):
    """Rows and columns of a quantized layer multiply exactly as the same rows and columns of the
    whole layer: no re-quantization."""
    torch.manual_seed(0)
    layer = kind.from_float(torch.randn(96, 128))
    full = layer.dequantize()
    rows = torch.cat([torch.arange(16), torch.arange(48, 64)])  # the CPU int4 packing takes rows in 16s
    assert torch.equal(take_rows(layer, rows).dequantize(), full[rows])
    assert torch.equal(take_cols(layer, 32, 96, keep_bias=True).dequantize(), full[:, 32:96])


# ---- two ranks ---------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("reduction", ["exact", "sum"])
def test_tiny_models_greedy_identical(family, reduction, llama, qwen2):
    """Tied (llama, GQA) and untied with q/k/v biases (qwen2), in fp32: both reductions give the
    one-rank tokens (fp32 partial sums of these tiny layers round alike)."""
    path = str(llama if family == "llama" else qwen2)
    argv = ("--model", path, "--eagle", "none", "--twin", "none", "--quantization", "none",
            "--num-blocks", "64", "--tp-reduction", reduction)
    want = generate(load_deployment(settings_for(*argv)), PROMPTS)
    with ranks(*argv) as dep:
        assert generate(dep, PROMPTS) == want


def test_each_rank_holds_its_share_of_the_weights(llama):
    argv = ("--model", str(llama), "--eagle", "none", "--twin", "none", "--quantization", "none", "--num-blocks", "16")
    whole = sharded_bytes(next(iter(load_deployment(settings_for(*argv)).models.values())).model)
    with ranks(*argv) as dep:
        model = next(iter(dep.models.values())).model
        # 4 heads / 2 KV heads, MLP 48, vocab 64: everything splits evenly, so exactly half
        # (the tied head is the embedding's own rows, counted once).
        assert sharded_bytes(model) == whole // 2
        runner = next(iter(dep.runners.values()))
        assert runner.kv.k[0].shape[2] == 1  # one of the two KV heads per block


@pytest.fixture(scope="module")
def llada(tmp_path_factory) -> Path:
    path = write_tiny_llada(tmp_path_factory.mktemp("llada"), vocab_size=64, mask_token_id=63)
    write_chat_tokenizer(path)
    return path


def test_tiny_llada_diffusion_greedy_identical(llada):
    argv = ("--model", str(llada), "--quantization", "none", "--num-blocks", "64")
    want = generate(load_deployment(settings_for(*argv)), PROMPTS, max_tokens=16)
    with ranks(*argv) as dep:
        assert dep.engine.decoders_for(next(iter(dep.models))) == ["diffusion"]
        assert generate(dep, PROMPTS, max_tokens=16) == want


def test_abort_and_preemption_free_every_block(llama):
    """Blocks are rank 0's bookkeeping; the other ranks only index their KV shards with the ids it
    sends. After an abort and under preemption (a pool too small for every request), every block
    is free again, and requests that reuse the freed blocks still get the one-rank tokens."""
    argv = ("--model", str(llama), "--eagle", "none", "--twin", "none", "--quantization", "none",
            "--num-blocks", "6", "--block-size", "4")
    prompts = PROMPTS * 2
    want = generate(load_deployment(settings_for(*argv)), prompts, max_tokens=10)
    with ranks(*argv) as dep:
        pool = dep.engine.pool
        name = next(iter(dep.models))
        rid = dep.engine.submit(name, "ar", PROMPTS[1], SamplingParams(max_tokens=50, temperature=0.0,
                                                                       ignore_eos=True), lambda *_: None)
        for _ in range(3):
            dep.engine.step()
        assert pool.num_free_blocks < pool.num_blocks
        dep.engine.abort(rid)
        dep.engine.run_until_idle()
        assert pool.num_free_blocks == pool.num_blocks
        assert generate(dep, prompts, max_tokens=10) == want
        assert dep.engine.scheduler.num_preemptions > 0
        assert pool.num_free_blocks == pool.num_blocks


def test_a_killed_rank_fails_requests_not_hangs(llama):
    """SIGKILL the other rank mid-generation: the running request ends with an error, the group is
    failed, and later requests fail at once."""
    argv = ("--model", str(llama), "--eagle", "none", "--twin", "none", "--quantization", "none", "--num-blocks", "64")
    with ranks(*argv) as dep:
        group, name = dep.parallel, next(iter(dep.models))
        reasons: list[str] = []
        group.on_failure(reasons.append)
        finishes: list[str] = []
        dep.engine.submit(name, "ar", PROMPTS[0], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True),
                          lambda _, d: finishes.append(d.finish_reason) if d.finish_reason else None)
        for _ in range(3):
            dep.engine.step()
        os.kill(group.processes[0].pid, signal.SIGKILL)
        started = time.monotonic()
        dep.engine.run_until_idle()
        assert time.monotonic() - started < 60  # a closed connection fails the next collective at once
        assert finishes == ["error"] and reasons and group.failure
        with pytest.raises(RankFailure):
            next(iter(dep.runners.values())).logits(torch.zeros(1, 32))


def test_a_hung_rank_is_noticed_within_the_timeout(llama):
    """SIGSTOP the other rank while idle: the heartbeat's all-reduce times out and fails the group."""
    argv = ("--model", str(llama), "--eagle", "none", "--twin", "none", "--quantization", "none",
            "--num-blocks", "16", "--tp-timeout", "4", "--tp-heartbeat", "1")
    with ranks(*argv) as dep:
        group = dep.parallel
        os.kill(group.processes[0].pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            while group.failure is None and time.monotonic() - started < 30:
                time.sleep(0.1)
            assert group.failure is not None
            assert time.monotonic() - started < 4 + 1 + 5  # timeout + heartbeat, with slack for a busy host
        finally:
            os.kill(group.processes[0].pid, signal.SIGCONT)


@pytest.mark.slow
def test_dflash_drafter_greedy_identical(llama, tmp_path):
    """eagle with a DFlash drafter alone: it drafts on rank 0 (unsharded embedding and head) and the
    verify runs on both ranks; 48 tokens take it past EXPLORE_AFTER, so the untrained drafter drafts."""
    from tiny_dflash import write_tiny_dflash
    from tiny_twin import HIDDEN, VOCAB

    write_tiny_dflash(tmp_path, hidden_size=HIDDEN, num_heads=4, num_kv_heads=2, head_dim=HIDDEN // 4,
                      intermediate_size=48, vocab_size=VOCAB, num_layers=1, target_layer_ids=[0, 1],
                      num_target_layers=2, block_size=4, mask_token_id=VOCAB - 1)
    argv = ("--model", str(llama), "--eagle", "none", "--dflash", str(tmp_path), "--twin", "none",
            "--quantization", "none", "--num-blocks", "64")
    one = load_deployment(settings_for(*argv))
    want = generate(one, PROMPTS, 48, "eagle")
    del one
    with ranks(*argv) as dep:
        assert generate(dep, PROMPTS, 48, "eagle") == want


def test_default_model_greedy_identical_for_every_decoder():
    """SmolLM2-135M in the format a CPU host serves by default (w4a16 where the kernels build, 9 heads
    over 3 KV heads: split 6/3) with its EAGLE head and diffusion twin: the ``exact`` reduction gives
    the one-rank tokens for ar, eagle and diffusion."""
    from dualserve.models import kernels

    argv = ("--quantization", "w4a16" if kernels.available() else "int4", "--num-blocks", "128")
    one = load_deployment(settings_for(*argv))
    want = {d: generate(one, CHATS, 24, d, chat=True) for d in ("ar", "eagle", "diffusion")}
    del one
    with ranks(*argv) as dep:
        for decoder in ("ar", "eagle", "diffusion"):
            assert generate(dep, CHATS, 24, decoder, chat=True) == want[decoder], decoder


@pytest.fixture(scope="module")
def diffusion_gemma(tmp_path_factory) -> Path:
    """The tiny DiffusionGemma (2 query heads over 1 KV head in both layers: each rank takes one
    query head and replicates the KV head), with a tokenizer beside it."""
    from tiny_checkpoints import write_tiny_diffusion_gemma

    path = write_tiny_diffusion_gemma(tmp_path_factory.mktemp("diffusion_gemma"), vocab_size=512)
    generation = (path / "generation_config.json").read_text()
    write_chat_tokenizer(path)
    (path / "generation_config.json").write_text(generation)  # keep the checkpoint's own
    return path


@pytest.mark.parametrize("reduction", ["exact", "sum"])
def test_tiny_diffusion_gemma_greedy_identical(reduction, diffusion_gemma):
    """Encoder, denoiser with self-conditioning, experts: the one-rank canvases, at temperature 0
    (deterministic noise), with prompts batched into one step."""
    argv = ("--model", str(diffusion_gemma), "--num-blocks", "64", "--tp-reduction", reduction)
    want = generate(load_deployment(settings_for(*argv)), PROMPTS, max_tokens=16)
    assert all(len(w) == 16 for w in want)
    with ranks(*argv) as dep:
        assert dep.engine.decoders_for(next(iter(dep.models))) == ["diffusion"]
        assert generate(dep, PROMPTS, max_tokens=16) == want


def test_diffusion_gemma_ranks_hold_their_share(diffusion_gemma):
    """Each rank holds half of the split tensors (projections, experts, self-conditioning) but the
    replicated single KV head's projections, and a KV cache of that one head per layer."""
    from dualserve.models.diffusion_gemma import load_diffusion_gemma
    from dualserve.models.sharding import Shard, Sharder

    whole_model = load_diffusion_gemma(diffusion_gemma).model
    whole = sharded_bytes(whole_model)
    kv_proj = sum(p.numel() * 4 for layer in whole_model.layers for m in (layer.self_attn.k_proj,
              layer.self_attn.v_proj) if m is not None for p in m.parameters())
    shares = [sharded_bytes(Sharder(Shard(rank, 2, reduction="exact"))(load_diffusion_gemma(diffusion_gemma).model))
              for rank in range(2)]
    assert shares == [(whole - kv_proj) // 2 + kv_proj] * 2
    model = Sharder(Shard(0, 2))(load_diffusion_gemma(diffusion_gemma).model)
    assert model.config.kv_heads == (1, 1) and [layer.self_attn.num_heads for layer in model.layers] == [1, 1]


def test_a_diffusion_gemma_that_does_not_split_is_refused_before_any_rank_starts(diffusion_gemma):
    """2 query heads over 1 KV head split over 2 ranks, not 3: refused by name in the start-up check,
    as a Llama-family model is (not by the sharder inside each rank)."""
    from dualserve.models.errors import InputError
    from dualserve.server.tensor_parallel import check_fits

    check_fits(settings_for("--model", str(diffusion_gemma), tp=2))
    with pytest.raises(InputError, match="--tensor-parallel-size 3 cannot split .*: its 2 query heads over 1 "
                                         "key/value heads do not split over 3 ranks"):
        check_fits(settings_for("--model", str(diffusion_gemma), tp=3))


def test_head_split_replicates_kv_heads_only_when_there_are_fewer_than_ranks():
    from dualserve.models.sharding_gemma import head_split

    assert [head_split(8, 4, 2, r) for r in range(2)] == [(0, 4, 0, 2), (4, 8, 2, 4)]
    assert [head_split(8, 2, 4, r) for r in range(4)] == [(0, 2, 0, 1), (2, 4, 0, 1), (4, 6, 1, 2), (6, 8, 1, 2)]
    with pytest.raises(ValueError):
        head_split(6, 2, 4, 0)


@pytest.mark.slow
@pytest.mark.parametrize("reduction", ["exact", "sum"])
def test_default_model_shards_partition_its_weights(reduction, cache_dir):
    """Each rank's share of SmolLM2-135M's sharded tensors (int4 layers, int8 embedding and head),
    built for rank 0 and rank 1 (sharding itself needs no group): together exactly the whole, each
    within a few percent of half (3 KV heads split 2 and 1)."""
    from dualserve.models.hub import resolve_model
    from dualserve.models.loader import load_model
    from dualserve.models.sharding import Shard, Sharder

    name, path = resolve_model(None, cache_dir)

    def load():
        return load_model(path, name=name, dtype=torch.float32, device="cpu", cache_dir=cache_dir,
                          quantization="int4").model

    whole = sharded_bytes(load())
    shares = [sharded_bytes(Sharder(Shard(rank, 2, reduction=reduction))(load())) for rank in range(2)]
    assert sum(shares) == whole
    assert all(0.47 < s / whole < 0.53 for s in shares), [s / whole for s in shares]
