"""DiffusionGemma's model and loader against transformers' ``DiffusionGemmaForBlockDiffusion``.

The tiny checkpoint (``write_tiny_diffusion_gemma``: a sliding then a full layer with their own
head sizes, 4 experts top-2 beside the dense MLP, sliding window 8, canvas 8) is loaded by us and
by transformers. The denoiser's logits must be *bit-identical* (``torch.equal``): the sampler
draws from them, and any rounding difference can flip a multinomial draw. Covered:

* prompts shorter and longer than the sliding window (a masked encoder, a trimmed cache);
* a first step (no self-conditioning) and a later one (self-conditioning logits);
* a canvas after another canvas was encoded at the canvas positions (the encoder with a cache);
* the runner's paged keys/values of the same prompt equal the dense cache's, and a canvas over
  them gives the dense cache's logits.
The config is read as ``DiffusionGemmaTextConfig`` resolves it (per-layer head sizes and kv
heads, RoPE per layer type; the RoPE frequencies equal the reference's buffers). The name table
takes every tensor of the file, accepts encoder-side names, refuses unknown names and tied copies
that differ. transformers is only the reference; the code under test never imports it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dualserve.decoders.diffusion.gemma import DenseCache
from dualserve.decoders.engine.attention.paged_attention import KVCache
from dualserve.decoders.engine.runner import ForwardItem, ModelRunner
from dualserve.models.diffusion_gemma import DiffusionGemmaConfig, load_diffusion_gemma, read_state
from tiny_checkpoints import write_tiny_diffusion_gemma

VOCAB = 512


class StubTokenizer:
    """The tiny checkpoint ships no tokenizer; the model tests need none."""

    eos_token_ids = (1,)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_diffusion_gemma(tmp_path_factory.mktemp("diffusion_gemma"))


@pytest.fixture(scope="module")
def reference(tiny: Path):
    from transformers import DiffusionGemmaForBlockDiffusion

    return DiffusionGemmaForBlockDiffusion.from_pretrained(tiny).eval()


@pytest.fixture(scope="module")
def ours(tiny: Path):
    return load_diffusion_gemma(tiny, tokenizer=StubTokenizer())


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def test_config_reads_per_layer_shapes_and_rope(tiny: Path, reference, ours) -> None:
    cfg: DiffusionGemmaConfig = ours.config
    text = reference.config.text_config
    assert cfg.layer_types == ("sliding_attention", "full_attention")
    assert cfg.head_dims == (16, 32) and cfg.kv_heads == (1, 1) and cfg.num_heads == 2
    assert (cfg.sliding_window, cfg.canvas_length, cfg.vocab_size) == (8, 8, VOCAB)
    assert (cfg.num_experts, cfg.top_k_experts, cfg.moe_intermediate_size) == (4, 2, 32)
    assert cfg.final_logit_softcapping == text.final_logit_softcapping == 30.0
    assert cfg.eos_token_ids == (1,) and cfg.pad_token_id == 0 and cfg.bos_token_id == 2
    assert cfg.denoising.max_denoising_steps == 48 and cfg.denoising.entropy_bound == 0.1  # global defaults
    assert cfg.kv_shapes == ((1, 16), (1, 32)) and cfg.windows == (8, None)
    assert KVCache.bytes_per_block_of_layers(cfg.kv_shapes, 4, torch.float32) == 4 * 4 * 2 * (16 + 32)
    rotary = reference.model.decoder.rotary_emb
    for i, kind in enumerate(cfg.layer_types):
        assert torch.equal(ours.model.inv_freq(i, torch.device("cpu")), getattr(rotary, f"{kind}_inv_freq"))
    raw = json.loads((tiny / "config.json").read_text())
    del raw["text_config"]["per_layer_config"]  # an unserialized config: the global_head_dim rule applies
    raw["text_config"].update(global_head_dim=32, num_global_key_value_heads=1)
    assert DiffusionGemmaConfig.from_hf(raw).head_dims == (16, 32)


@pytest.mark.parametrize("prompt_len", [5, 13], ids=["inside-window", "beyond-window"])
def test_logits_equal_transformers(reference, ours, prompt_len: int) -> None:
    from transformers.cache_utils import DynamicCache

    prompt, canvas, later = ids(prompt_len, 1), ids(8, 2), ids(8, 3)
    first_pos, next_pos = torch.arange(prompt_len, prompt_len + 8), torch.arange(prompt_len + 8, prompt_len + 16)
    with torch.no_grad():
        cache = DynamicCache(config=reference.config.get_text_config(decoder=True))
        ref1 = reference(input_ids=prompt[None], decoder_input_ids=canvas[None], cache=cache,
                         position_ids=torch.arange(prompt_len)[None], decoder_position_ids=first_pos[None]).logits[0]
        sc = ref1 / 0.7
        ref2 = reference(decoder_input_ids=later[None], cache=cache, self_conditioning_logits=sc[None],
                         decoder_position_ids=first_pos[None]).logits[0]
        reference.model.encoder(input_ids=later[None], cache=cache, position_ids=first_pos[None])
        ref3 = reference(decoder_input_ids=canvas[None], cache=cache, decoder_position_ids=next_pos[None]).logits[0]
    model, dense = ours.model, DenseCache(ours.config)
    with torch.inference_mode():
        model.encode(prompt, torch.arange(prompt_len), dense.writer())
        got1 = model.denoise(canvas, first_pos, dense.reader())
        got2 = model.denoise(later, first_pos, dense.reader(), sc)
        model.encode(later, first_pos, dense.writer())
        got3 = model.denoise(canvas, next_pos, dense.reader())
    for got, ref in ((got1, ref1), (got2, ref2), (got3, ref3)):
        assert got.dtype == torch.float32 and got.abs().max() <= 30.0
        assert torch.equal(got, ref), (got - ref).abs().max()


def test_paged_cache_holds_the_dense_cache_keys(ours) -> None:
    cfg, prompt, canvas = ours.config, ids(13, 4), ids(8, 5)
    dense, runner = DenseCache(cfg), ModelRunner(ours.model, num_blocks=8, block_size=4)
    table = [5, 2, 7, 0]
    slots = torch.tensor([table[p // 4] * 4 + p % 4 for p in range(13)])
    with torch.inference_mode():
        ours.model.encode(prompt, torch.arange(13), dense.writer())
        runner.encode([ForwardItem(prompt, torch.arange(13), 0, table, slots)])
        want = ours.model.denoise(canvas, torch.arange(13, 21), dense.reader())
        item = ForwardItem(canvas, torch.arange(13, 21), 13, table, None, mask="bidirectional")
        got = runner.denoise([item])
    for layer in range(cfg.num_layers):
        keys = runner.kv.flat(layer)[0][slots]
        assert keys.shape[1:] == (cfg.kv_heads[layer], cfg.head_dims[layer])  # per-layer KV shapes
        kept = dense.k[layer].shape[0]  # the sliding layer keeps the last W-1 = 7
        assert kept == (7 if cfg.layer_types[layer] == "sliding_attention" else 13)
        assert torch.equal(keys[-kept:], dense.k[layer])
    assert torch.equal(got, want)


def test_name_table_takes_every_tensor_and_either_side_of_the_ties(tiny: Path, tmp_path: Path, ours) -> None:
    tensors = load_file(str(tiny / "model.safetensors"))
    state = read_state(tiny)
    assert set(state) == set(ours.model.state_dict())
    # The same weights under the encoder's names (the other side of every tie) load the same model.
    flipped = {}
    for name, t in tensors.items():
        if name.startswith("model.decoder.") and ".self_conditioning." not in name and "layer_scalar" not in name:
            name = name.replace("model.decoder.", "model.encoder.language_model.")
        flipped[name] = t
    (tmp_path / "config.json").write_text((tiny / "config.json").read_text())
    save_file(flipped, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    other = read_state(tmp_path)
    assert other.keys() == state.keys() and all(torch.equal(other[k], state[k]) for k in state)
    # Two copies of a tied weight that disagree mean an untied checkpoint: refused.
    tensors["model.encoder.language_model.norm.weight"] = tensors["model.decoder.norm.weight"] + 1
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="differ"):
        read_state(tmp_path)
    save_file({**flipped, "model.mystery.weight": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected tensor"):
        read_state(tmp_path)


def test_bfloat16_load_runs(tiny: Path) -> None:
    loaded = load_diffusion_gemma(tiny, dtype=torch.bfloat16, tokenizer=StubTokenizer())
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    dense = DenseCache(loaded.config)
    with torch.inference_mode():
        loaded.model.encode(ids(5, 1), torch.arange(5), dense.writer())
        logits = loaded.model.denoise(ids(8, 2), torch.arange(5, 13), dense.reader(), torch.randn(8, VOCAB))
    assert logits.shape == (8, VOCAB) and logits.dtype == torch.float32 and torch.isfinite(logits).all()
