"""The loader against transformers: the default GGUF, and tiny random Hugging Face checkpoints.

* The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) loaded by us and by transformers'
  ``LlamaForCausalLM`` from the same file: both dequantize the same blocks to fp32, so the
  logits differ only by summation order. Measured max |diff| is 7e-5 on the 37-token chat
  prompt (logits up to ~38); the bound asserted is 1e-3, and every position's argmax must agree.
  A wrong q/k un-permutation, norm epsilon or rope base moves the logits by whole units.
* The GGUF is converted once into a cache directory; the second load reads the cache, skips the
  conversion, is faster, and gives bit-identical logits.
* Tiny random checkpoints written by transformers itself (``from_config`` + ``save_pretrained``,
  safetensors): Qwen2-style with q/k/v biases, Llama-style with an untied head and llama3 rope
  scaling, a sharded one with ``model.safetensors.index.json``, and a tied-embedding one. Our
  logits must match transformers' within 1e-4 (fp32).
* The config.json written for a converted GGUF reads back into the same ModelConfig.

transformers is only a test reference here; the code under test never imports it.
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import pytest
import torch

from dualserve.models import loader
from dualserve.models.attention import DenseAttention
from dualserve.models.config import ModelConfig, RopeScaling
from dualserve.models.families import read_config
from dualserve.models.loader import LoadedModel, load_model

GGUF_BOUND = 1e-3
TINY_BOUND = 1e-4
VOCAB = 97


def our_logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """(tokens, vocab) fp32 logits for one sequence starting at position 0."""
    tokens = torch.tensor(ids)
    hidden, _ = loaded.model(tokens, torch.arange(len(ids)), DenseAttention([len(ids)], windows=loaded.config.windows))
    return loaded.model.logits(hidden)


# ---- the default GGUF --------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_loads(default_gguf: Path, tmp_path_factory: pytest.TempPathFactory):
    """Two loads into a fresh cache: the first converts, the second must reuse the conversion."""
    cache = tmp_path_factory.mktemp("dualserve-cache")
    calls: list[Path] = []
    convert = loader.convert_gguf

    def counting_convert(path: Path, out_dir: Path) -> Path:
        calls.append(out_dir)
        return convert(path, out_dir)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loader, "convert_gguf", counting_convert)
        first = load_model(default_gguf, cache_dir=cache)
        converted_after_first = list(calls)
        second = load_model(default_gguf, cache_dir=cache)
    return first, second, converted_after_first, list(calls), cache


@pytest.fixture(scope="module")
def hf_gguf_model(default_gguf: Path):
    """transformers' model from the same GGUF file, loaded once (about 40 s on 2 CPU cores)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name,
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def chat_ids(gguf_loads) -> list[int]:
    tok = gguf_loads[1].tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.slow
def test_gguf_logits_match_transformers(gguf_loads, hf_gguf_model, chat_ids: list[int]) -> None:
    ours = gguf_loads[1]
    assert type(hf_gguf_model).__name__ == "LlamaForCausalLM"
    assert ours.config.family == "llama" and ours.config.tie_word_embeddings
    assert ours.config.vocab_size == hf_gguf_model.config.vocab_size
    assert len(chat_ids) >= 30  # the template adds a system prompt
    logits = our_logits(ours, chat_ids)
    with torch.inference_mode():
        ref = hf_gguf_model(torch.tensor([chat_ids])).logits[0].float()
    assert logits.shape == ref.shape
    diff = (logits - ref).abs().max().item()
    assert diff < GGUF_BOUND, f"max |logit diff| {diff:.2e} exceeds {GGUF_BOUND}"
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))


@pytest.mark.slow
def test_gguf_conversion_is_cached(gguf_loads, chat_ids: list[int]) -> None:
    first, second, after_first, after_second, cache = gguf_loads
    assert len(after_first) == 1, "the first load into an empty cache converts the GGUF"
    assert after_second == after_first, "the second load must reuse the conversion"
    target = after_first[0]
    assert target.parent == cache / "converted"
    files = {p.name for p in target.iterdir()}
    assert {"config.json", "tokenizer.json"} <= files
    assert "model.safetensors" in files or "model.safetensors.index.json" in files
    assert not list(target.parent.glob("*.partial")), "no half-written conversion is left behind"
    assert second.load_seconds < first.load_seconds
    assert second.config == first.config
    assert torch.equal(our_logits(first, chat_ids), our_logits(second, chat_ids))


def test_gguf_conversion_streams_into_shards(gguf_loads, default_gguf: Path, tmp_path: Path, monkeypatch,
                                             chat_ids: list[int]) -> None:
    """The conversion holds one shard at a time: with small shards it writes several and an index, and
    the model loads from them (streaming too) to the same logits."""
    monkeypatch.setattr(loader, "SHARD_BYTES", 16 << 20)
    sharded = load_model(default_gguf, cache_dir=tmp_path)
    target = next((tmp_path / "converted").iterdir())
    shards = sorted(target.glob("model-*.safetensors"))
    assert len(shards) > 3 and (target / "model.safetensors.index.json").is_file()
    assert not (target / "model.safetensors").exists()
    first = gguf_loads[0]
    assert torch.equal(our_logits(sharded, chat_ids), our_logits(first, chat_ids))


# ---- tiny random Hugging Face checkpoints ---------------------------------------------------

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0}


def write_word_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer.json over ``vocab_size`` tokens: load_model reads a tokenizer too."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))


def redraw(model: torch.nn.Module, seed: int) -> None:
    """Replace transformers' small init (std 0.02) with weights whose mistakes show in the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied head appears once, as the embedding
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)


def write_tiny(directory: Path, family: str, *, tied: bool = False, max_shard_size: str | None = None,
               seed: int = 0) -> torch.nn.Module:
    """Write a tiny random checkpoint with transformers and return transformers' model."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    sizes = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                 rms_norm_eps=1e-6, tie_word_embeddings=tied)
    if family == "qwen2":
        config = Qwen2Config(**sizes, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    elif family == "qwen3":  # a head size that is not hidden / heads, as in the real Qwen3 models
        config = Qwen3Config(**sizes, head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    elif family == "mistral":  # every layer within a window shorter than the prompt (Mistral v0.1)
        from transformers import MistralConfig
        config = MistralConfig(**sizes, sliding_window=12)
    elif family == "phi3":  # q/k/v and gate/up stored fused; a sliding window on every layer
        from transformers import Phi3Config
        config = Phi3Config(**sizes, sliding_window=12, pad_token_id=0)
    elif family == "gemma3":  # 3 layers: two sliding (window 8, shorter than the prompt), one global
        from transformers import Gemma3TextConfig
        config = Gemma3TextConfig(**{**sizes, "num_hidden_layers": 3, "tie_word_embeddings": True}, head_dim=32,
                                  sliding_window=8, layer_types=["sliding_attention", "sliding_attention",
                                                                 "full_attention"],
                                  query_pre_attn_scalar=24, final_logit_softcapping=None,
                                  attn_logit_softcapping=None)
    else:
        config = LlamaConfig(**sizes, rope_parameters=dict(LLAMA3_ROPE))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    redraw(model, seed)
    model.save_pretrained(directory, max_shard_size=max_shard_size or "1GB")
    write_word_tokenizer(directory, VOCAB)
    return model


def compare(directory: Path, ref: torch.nn.Module, length: int = 40) -> LoadedModel:
    ours = load_model(directory)
    ids = torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = our_logits(ours, ids)
    with torch.inference_mode():
        expected = ref(torch.tensor([ids])).logits[0].float()
    assert expected.abs().max() > 1.0, "the reference logits are too flat to tell mistakes apart"
    torch.testing.assert_close(logits, expected, atol=TINY_BOUND, rtol=0)
    return ours


def test_qwen2_with_qkv_bias(tmp_path: Path) -> None:
    ref = write_tiny(tmp_path, "qwen2")
    assert ref.model.layers[0].self_attn.q_proj.bias is not None
    ours = compare(tmp_path, ref)
    assert ours.config.family == "qwen2" and ours.config.attention_bias
    assert not ours.config.tie_word_embeddings
    assert ours.model.layers[0].self_attn.qkv_proj.bias is not None
    assert ours.config.rope_theta == 1000000.0


def test_qwen3_with_qk_norm(tmp_path: Path) -> None:
    ref = write_tiny(tmp_path, "qwen3", seed=3)
    assert ref.model.layers[0].self_attn.q_norm.weight.shape == (32,)
    ours = compare(tmp_path, ref)
    cfg = ours.config
    assert cfg.family == "qwen3" and cfg.qk_norm and not cfg.attention_bias and cfg.head_dim == 32
    assert ours.model.layers[0].self_attn.k_norm is not None


def test_gemma3_with_sliding_layers_and_sandwich_norms(tmp_path: Path) -> None:
    """Gemma 3: GELU-tanh gate, four norms a layer (1 + w), embedding times sqrt(hidden), q/k norms,
    local layers with a window shorter than the prompt and their own RoPE base, a query scale that
    is not head_dim ** -0.5."""
    ref = write_tiny(tmp_path, "gemma3", seed=4)
    ours = compare(tmp_path, ref)
    cfg = ours.config
    assert cfg.family == "gemma3" and cfg.windows == (8, 8, None) and cfg.norm_offset == 1.0
    assert cfg.rope_local_theta == 10000.0 and cfg.rope_theta == 1000000.0 and cfg.tie_word_embeddings
    written = json.loads(json.dumps(loader.hf_config_dict(cfg.replace(norm_offset=0.0))))
    assert read_config(written) == cfg.replace(norm_offset=0.0)


@pytest.mark.parametrize("family", ["mistral", "phi3"])
def test_sliding_window_families(tmp_path: Path, family: str) -> None:
    ref = write_tiny(tmp_path, family, seed=5)
    if family == "phi3":
        assert hasattr(ref.model.layers[0].self_attn, "qkv_proj"), "Phi-3 checkpoints store q/k/v fused"
    ours = compare(tmp_path, ref)
    assert ours.config.family == family and ours.config.windows == (12, 12)
    written = json.loads(json.dumps(loader.hf_config_dict(ours.config)))
    assert read_config(written) == ours.config


def test_llama_untied_with_llama3_rope(tmp_path: Path) -> None:
    ref = write_tiny(tmp_path, "llama", seed=1)
    ours = compare(tmp_path, ref)
    cfg = ours.config
    assert cfg.family == "llama" and not cfg.attention_bias and not cfg.tie_word_embeddings
    assert cfg.rope_scaling.kind == "llama3" and cfg.rope_scaling.factor == 8.0
    assert cfg.rope_scaling.original_max_position_embeddings == 64 and cfg.rope_theta == 500000.0
    assert not torch.equal(ours.model.lm_head.weight, ours.model.embed_tokens.weight)


def test_sharded_safetensors(tmp_path: Path) -> None:
    ref = write_tiny(tmp_path, "llama", max_shard_size="40KB", seed=2)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((tmp_path / s).is_file() for s in shards)
    assert not list(tmp_path.glob("*.bin")), "save_pretrained writes safetensors only"
    assert loader.safetensors_files(tmp_path) == sorted(tmp_path / s for s in shards)
    compare(tmp_path, ref)


def test_tied_embeddings(tmp_path: Path) -> None:
    ref = write_tiny(tmp_path, "qwen2", tied=True, seed=3)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys(), "a tied checkpoint stores the embedding only"
    ours = compare(tmp_path, ref)
    assert ours.config.tie_word_embeddings
    assert ours.model.lm_head is None  # tied: no separate head tensor
    assert ours.model.lm_head_weight is ours.model.embed_tokens.weight


def test_load_is_strict(tmp_path: Path) -> None:
    """An unknown tensor in a checkpoint is an error, not silently dropped."""
    from safetensors.torch import load_file, save_file

    write_tiny(tmp_path, "llama", seed=4)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["model.layers.0.mlp.extra.weight"] = torch.zeros(2, 2)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises((RuntimeError, ValueError)):
        load_model(tmp_path)


def test_meta_build_keeps_dtype_and_device(tmp_path: Path) -> None:
    write_tiny(tmp_path, "qwen2", seed=5)
    start = time.perf_counter()
    ours = load_model(tmp_path, dtype=torch.bfloat16)
    assert time.perf_counter() - start >= ours.load_seconds >= 0
    params = list(ours.model.parameters())
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" and not p.requires_grad for p in params)
    assert ours.model.rotary.inv_freq.device.type == "cpu"
    assert ours.model.rotary.inv_freq.dtype == torch.float32  # frequencies stay fp32 under bf16 weights


# ---- the converted GGUF's config.json ----------------------------------------------------------

_BASE = dict(vocab_size=100, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
             intermediate_size=96, bos_token_id=1, eos_token_ids=(2,), pad_token_id=2)


@pytest.mark.parametrize("config", [
    ModelConfig(family="llama", tie_word_embeddings=True, **_BASE),
    ModelConfig(family="qwen2", attention_bias=True, rope_theta=1e6, **_BASE),
    pytest.param(ModelConfig(family="llama", rope_scaling=RopeScaling(kind="linear", factor=4.0), **_BASE)),
], ids=["llama_tied", "qwen2_bias", "llama_linear_rope"])
def test_converted_config_round_trips(config: ModelConfig) -> None:
    """A GGUF is served from its conversion, so config.json must carry everything from_gguf read."""
    written = json.loads(json.dumps(loader.hf_config_dict(config)))
    assert read_config(written) == config


def test_gguf_conversion_logs_its_progress(tmp_path: Path, monkeypatch, caplog) -> None:
    """The one-time conversion says when it starts and how long it took; a cached load says nothing."""
    source = tmp_path / "m.gguf"
    source.write_bytes(b"GGUF")

    def fake_convert(path: Path, out_dir: Path) -> Path:
        out_dir.mkdir(parents=True)
        return out_dir

    monkeypatch.setattr(loader, "convert_gguf", fake_convert)
    with caplog.at_level(logging.INFO, logger="dualserve.models.loader"):
        target = loader.prepare_source(source, tmp_path / "cache")
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 2 and lines[0].startswith("converting m.gguf into ") and str(target) in lines[0]
        assert re.fullmatch(r"converted m\.gguf in \d+\.\ds", lines[1]), lines
        caplog.clear()
        assert loader.prepare_source(source, tmp_path / "cache") == target and not caplog.records


def test_gguf_rope_freqs_give_llama3_scaling() -> None:
    """A Llama 3.1+ GGUF carries its RoPE scaling as ``rope_freqs`` (llama.cpp's convert: a divisor per
    frequency); dividing by them gives the frequencies transformers computes from rope_scaling."""
    import math

    from dualserve.models.config import rope_inv_freq

    scaled = ModelConfig(family="llama", rope_theta=500000.0, rope_scaling=RopeScaling(
        kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64), **{**_BASE, "head_dim": 64})
    s = scaled.rope_scaling
    low, high = s.original_max_position_embeddings / s.low_freq_factor, s.original_max_position_embeddings / s.high_freq_factor
    factors = []
    for freq in rope_inv_freq(scaled.replace(rope_scaling=RopeScaling())).tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high:
            factors.append(1.0)
        elif wavelen > low:
            factors.append(s.factor)
        else:
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
            factors.append(1 / ((1 - smooth) / s.factor + smooth))
    from_file = scaled.replace(rope_scaling=RopeScaling(), rope_factors=tuple(factors))
    assert 1.0 < max(factors) and min(factors) == 1.0
    torch.testing.assert_close(rope_inv_freq(from_file), rope_inv_freq(scaled), rtol=1e-6, atol=0)
    written = json.loads(json.dumps(loader.hf_config_dict(from_file)))
    assert read_config(written) == from_file


@pytest.mark.parametrize("content", [b"GGUF", b"not a model at all", b""], ids=["magic only", "text", "empty"])
def test_a_file_that_is_not_gguf_is_an_unsupported_model(tmp_path: Path, content: bytes) -> None:
    from dualserve.models.config import UnsupportedModel

    path = tmp_path / "broken.gguf"
    path.write_bytes(content)
    with pytest.raises(UnsupportedModel, match="broken.gguf is not a GGUF file"):
        load_model(path, cache_dir=tmp_path / "cache")
    assert not list((tmp_path / "cache" / "converted").glob("*")), "no conversion is left behind"
