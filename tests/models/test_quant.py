"""Quantized weights: GGUF blocks repacked without rounding, bounded error per layer and in the logits,
the converted cache stored quantized, and the format choice on both sides of every branch."""

from __future__ import annotations

import dataclasses

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dualserve.models.attention import DenseAttention
from dualserve.models.checkpoint import build
from dualserve.models.config import ModelConfig
from dualserve.models import formats
from dualserve.models.formats import FormatTable, cached_measure, choose, measure
from dualserve.models.host import NeighbourLoad
from dualserve.models.loader import converted_dir, load_model
from dualserve.models.quant import (Int4Linear, Int8Linear, QuantEmbedding, W8A8Linear, dequantize_portable,
                                    gguf_blocks, quantize_int4)


@pytest.fixture(scope="module")
def gguf_reader(default_gguf: Path):
    import gguf

    return gguf.GGUFReader(str(default_gguf))


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_gguf_blocks_are_repacked_exactly(gguf_reader, kind: str) -> None:
    from gguf import quants

    t = next(t for t in gguf_reader.tensors if t.tensor_type.name == kind)
    parts = gguf_blocks(np.asarray(t.data), kind)
    want = quants.dequantize(t.data, t.tensor_type)
    assert torch.equal(dequantize_portable(parts), torch.from_numpy(np.ascontiguousarray(want)))


def test_q4_0_layout() -> None:
    """A hand-made Q4_0 block: d = 0.5, nibbles 0..15 -> w = 0.5 * (q - 8)."""
    q = np.arange(32) % 16
    packed = (q[:16] | (q[16:] << 4)).astype(np.uint8)
    block = np.concatenate([np.array([0.5], dtype=np.float16).view(np.uint8), packed])[None]
    w = dequantize_portable(gguf_blocks(block, "Q4_0"))
    assert torch.equal(w[0], torch.tensor(0.5 * (q - 8), dtype=torch.float32))


def test_int4_and_int8_layers_multiply_by_their_dequantized_weights() -> None:
    torch.manual_seed(0)
    w, x = torch.randn(96, 128), torch.randn(5, 128)
    for layer in (Int4Linear.from_float(w), Int8Linear.from_float(w)):
        got = layer(x)
        assert got.dtype == x.dtype
        ref = x.bfloat16().float() @ layer.dequantize().t()
        torch.testing.assert_close(got, ref, rtol=0.02, atol=0.05)
        # one row at a time gives the same bits: batching never changes a row
        assert torch.equal(torch.cat([layer(x[i:i + 1]) for i in range(5)]), got)
    q, scales, zeros = quantize_int4(w)
    assert int(q.max()) <= 15 and int(q.min()) >= 0
    assert (Int4Linear(q, scales, zeros).dequantize() - w).abs().max() < scales.max() * 0.51 + 0.05


@pytest.mark.parametrize("shape", [(32, 1536), (3072, 32), (96, 128)])
def test_w8a8_rows_are_the_same_bits_in_any_batch_and_thread_count(shape) -> None:
    """Integer sums: a row's output depends on that row alone, for every row count and thread count
    (float GEMMs differ by both on some CPUs), and follows the float product within int8's error."""
    torch.manual_seed(0)
    out, inp = shape
    w, x = torch.randn(out, inp) * 0.05, torch.randn(40, inp)
    want = x @ w.t()
    layer = W8A8Linear.from_float(w, digits=2)
    got = layer(x)
    one_digit = W8A8Linear.from_float(w)(x)
    torch.testing.assert_close(one_digit, want, rtol=0.05, atol=0.05 * float(want.abs().max()))
    # against the int8 weights themselves, the second digit removes nearly all of the activations' error
    exact = x @ layer.dequantize().t()
    assert (got - exact).abs().max() < 0.02 * (one_digit - exact).abs().max()
    threads = torch.get_num_threads()
    try:
        for n in {1, threads}:
            torch.set_num_threads(n)
            for rows in (1, 2, 3, 5, 8, 11, 16, 17, 40):
                assert torch.equal(layer(x[:rows]), got[:rows]), (n, rows)
                assert torch.equal(layer(x[rows - 1:rows]), got[rows - 1:rows]), (n, rows)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(layer(torch.zeros(2, inp)), torch.zeros(2, out))  # a padding row stays zero


def test_quantized_embedding_lookup() -> None:
    table = torch.randn(50, 64)
    emb = QuantEmbedding.from_float(table)
    ids = torch.tensor([0, 7, 49])
    torch.testing.assert_close(emb(ids), table[ids], rtol=0, atol=float(table.abs().max()) / 127)


@pytest.fixture(scope="module")
def default_models(default_gguf: Path, cache_dir: Path):
    return {q: load_model(default_gguf, cache_dir=cache_dir, quantization=q) for q in ("none", "int4", "int8")}


def test_the_default_gguf_is_cached_quantized_and_loads_as_int4(default_gguf, cache_dir, default_models) -> None:
    stored = list(converted_dir(default_gguf, cache_dir).glob("model*.safetensors"))  # one file or shards
    assert stored and sum(f.stat().st_size for f in stored) < 160 * 2**20, "the cache holds 4-bit weights, not fp32"
    int4 = default_models["int4"].model
    assert load_model(default_gguf, cache_dir=cache_dir, quantization="auto").quantization == "int4"
    assert isinstance(int4.layers[0].self_attn.qkv_proj, Int4Linear)
    assert isinstance(int4.lm_head, Int8Linear) and isinstance(int4.embed_tokens, QuantEmbedding)
    # int4 is the file's own numbers: each layer dequantizes to the fp32 model's weight, up to bf16 scales.
    fp32 = default_models["none"].model
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        ours = int4.layers[3].get_submodule(name).dequantize()
        ref = fp32.layers[3].get_submodule(name).weight
        assert (ours - ref).abs().max() <= ref.abs().max() * 2 ** -7, name


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_quantized_logits_stay_close_to_fp32(default_models, fmt: str) -> None:
    tok = default_models["none"].tokenizer
    ids = torch.tensor(tok.encode("The capital of France is Paris. The capital of Italy is", add_special_tokens=True))
    pos = torch.arange(len(ids))
    logits = {}
    with torch.inference_mode():
        for q in ("none", fmt):
            m = default_models[q].model
            hidden, _ = m(ids, pos, DenseAttention([len(ids)]))
            logits[q] = m.logits(hidden)
    cos = F.cosine_similarity(logits[fmt], logits["none"], dim=-1)
    assert cos.min() > 0.99, cos
    assert (logits[fmt].argmax(-1) == logits["none"].argmax(-1)).float().mean() >= 0.85


def test_hf_weights_quantize_at_load() -> None:
    cfg = ModelConfig(family="llama", vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, intermediate_size=96, tie_word_embeddings=True)
    torch.manual_seed(0)
    from dualserve.models.transformer import Transformer

    ref = Transformer(cfg).eval()
    ids = torch.arange(10)
    want, _ = ref(ids, torch.arange(10), DenseAttention([10]))
    for fmt in ("int8", "int4"):
        model = build(cfg, dict(ref.state_dict()), torch.float32, "cpu", fmt)
        got, _ = model(ids, torch.arange(10), DenseAttention([10]))
        assert F.cosine_similarity(got, want, dim=-1).min() > 0.98, fmt


def table(fp32: float, bf16: float, int8: float, int4: float) -> FormatTable:
    return FormatTable("test", {"fp32": {"1": fp32, "8": fp32}, "bf16": {"1": bf16, "8": bf16},
                                "int8": {"1": int8, "8": int8}, "int4": {"1": int4, "8": int4}})


def test_format_choice_on_every_kind_of_host() -> None:
    # a host with fast weight-only kernels keeps the file's int4
    assert choose(table(40, 30, 12, 10), "int4") == ("int4", "int4")
    # int8 faster than the stored int4: it is less faithful than llama.cpp's, never picked
    assert choose(table(40, 30, 5, 10), "int4") == ("int4", "int4")
    # a host where the quantized kernels are slow (AVX2 only): fp32 wins
    assert choose(table(20, 60, 45, 50), "int4") == ("none", "fp32")
    # bf16 units make bf16 the fastest float format
    assert choose(table(40, 15, 30, 30), "none") == ("none", "bf16")
    # a float checkpoint on a host where int4 is far faster is quantized
    assert choose(table(40, 30, 12, 10), "none") == ("int4", "int4")


def test_auto_picks_the_fastest_format_as_faithful_as_llama_cpp(monkeypatch) -> None:
    monkeypatch.setattr(formats, "runnable", lambda: formats.CANDIDATES)
    ms = {"fp32": 40, "bf16": 30, "int8": 12, "int4": 10, "w4a8": 4, "w4a16": 5}
    t = FormatTable("test", {f: {"1": v, "8": v} for f, v in ms.items()})
    assert choose(t, "int4") == ("w4a16", "w4a16")  # w4a8 is faster, and never picked


TINY = ModelConfig(family="llama", vocab_size=128, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                   head_dim=16, intermediate_size=96, tie_word_embeddings=True)


def test_measure_covers_every_format_and_token_count() -> None:
    t = measure(TINY, rounds=2)
    assert set(t.ms) == set(formats.runnable()) >= {"fp32", "bf16", "int8", "int4"}
    assert set(formats.candidates()) == set(formats.runnable()) - {"int8", "w4a8"}
    assert all(set(v) == {"1", "8"} and min(v.values()) > 0 for v in t.ms.values())
    assert t.neighbour_cores >= 0


def test_measure_times_widths_no_group_kernel_takes_in_the_layer_the_loader_builds() -> None:
    odd = dataclasses.replace(TINY, hidden_size=48, num_heads=3, num_kv_heads=1, intermediate_size=80)
    t = measure(odd, rounds=1)
    assert set(t.ms) == set(formats.runnable())


def test_a_table_measured_on_a_busy_host_keeps_the_stored_format_and_is_not_cached(tmp_path, monkeypatch) -> None:
    # int8 "faster" only because a neighbour slowed the int4 timings: the file's format stays
    busy = FormatTable("test", table(40, 30, 4, 239).ms, neighbour_cores=1.0)
    assert not busy.quiet and choose(busy, "int4") == ("int4", "int4")
    assert choose(busy, "none") == ("none", "fp32")
    monkeypatch.setattr(formats, "measure", lambda config: busy)
    assert cached_measure(TINY, tmp_path) is busy
    assert not (tmp_path / "formats.json").exists()
    quiet = FormatTable("test", table(40, 30, 12, 10).ms, neighbour_cores=0.1)
    monkeypatch.setattr(formats, "measure", lambda config: quiet)
    assert cached_measure(TINY, tmp_path) is quiet
    monkeypatch.setattr(formats, "measure", lambda config: pytest.fail("measured again"))
    assert cached_measure(TINY, tmp_path) == quiet  # read back from the cache


def test_neighbour_load_counts_another_process_not_this_one() -> None:
    """This process's own work is its own ticks, not a neighbour's; a child's busy loop is a
    neighbour's. (Whatever else the host runs meanwhile only adds to the neighbours: the test
    holds on a busy host, as in a parallel test run.)"""
    import os
    import subprocess
    import sys
    import time

    from dualserve.models.host import own_ticks

    ticks, cpu = own_ticks(), time.process_time()
    sum(range(20_000_000))  # about a core for a while
    own, used = (own_ticks() - ticks) / os.sysconf("SC_CLK_TCK"), time.process_time() - cpu
    assert abs(own - used) < 0.05 + 0.1 * used
    with NeighbourLoad() as beside:
        subprocess.run([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 0.6: pass"])
    assert beside.cores > 0.4


def test_quantize_linears_swaps_every_float_linear() -> None:
    """A draft model beside a quantized target: each nn.Linear becomes the target format's layer (8-bit
    dot8 weights for w4a8; int8 where the input width is not a whole number of groups; float where
    torch's int8 kernel cannot take the width), in place."""
    from dualserve.models import kernels
    from dualserve.models.quant import Dot8Linear, Int8Linear, quantize_linears

    if not kernels.available():
        pytest.skip(f"the dot8 kernel is not available: {kernels.unavailable_reason()}")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.SiLU(), torch.nn.Linear(96, 48, bias=True),
                                torch.nn.Linear(48, 40), torch.nn.Linear(40, 8))
    x = torch.randn(5, 64)
    want = model(x).detach()
    assert quantize_linears(model, "none") is model and isinstance(model[0], torch.nn.Linear)
    quantize_linears(model, "w4a8", bits=8)
    assert [type(m) for m in model] == [Dot8Linear, torch.nn.SiLU, Dot8Linear, Int8Linear, torch.nn.Linear]
    assert model[0].bits == 8 and model[2].bias is not None
    cos = torch.nn.functional.cosine_similarity(model(x).flatten(), want.flatten(), dim=0)
    assert cos > 0.999
    with pytest.raises(ValueError, match="multiple of 16"):
        Int8Linear.from_float(torch.randn(8, 40))
