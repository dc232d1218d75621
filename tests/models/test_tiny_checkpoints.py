"""The tiny diffusion checkpoints really are in the upstream layouts.

LLaDA has no transformers class, so its tensor names are listed by hand from
``modeling_llada.py``. Dream, Fast-dLLM v2 and SDAR are Qwen2/Qwen3 layouts, so their files
must match the state dict of the transformers Qwen2/Qwen3 model built on the meta device.
DiffusionGemma is written by transformers itself; the test pins what that layout looks like.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tiny_checkpoints import (
    DREAM_MASK_ID,
    FAST_DLLM_V2_MASK_ID,
    LLADA_MASK_ID,
    SDAR_MASK_ID,
    write_tiny_block_diffusion,
    write_tiny_diffusion_gemma,
    write_tiny_dream,
    write_tiny_llada,
)


def _read(directory: Path) -> tuple[dict, dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """config.json and {tensor name: (shape, dtype)} from model.safetensors."""
    config = json.loads((directory / "config.json").read_text())
    tensors = {}
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        for name in f.keys():
            tensor = f.get_tensor(name)
            tensors[name] = (tuple(tensor.shape), tensor.dtype)
    return config, tensors


def _meta_state_shapes(model_cls, config) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = model_cls(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def test_llada_names_shapes_and_mask_row(tmp_path: Path):
    config, tensors = _read(write_tiny_llada(tmp_path))
    assert config["model_type"] == "llada" and config["mask_token_id"] == LLADA_MASK_ID
    assert config["weight_tying"] is False and config["block_type"] == "llama"
    H, M, V = config["d_model"], config["mlp_hidden_size"], config["embedding_size"]
    assert V == config["vocab_size"] == 126464 and LLADA_MASK_ID < V
    expected = {
        "model.transformer.wte.weight": (V, H),
        "model.transformer.ln_f.weight": (H,),
        "model.transformer.ff_out.weight": (V, H),
    }
    for i in range(config["n_layers"]):
        block = f"model.transformer.blocks.{i}."
        expected.update({
            block + "attn_norm.weight": (H,), block + "ff_norm.weight": (H,),
            block + "q_proj.weight": (H, H), block + "k_proj.weight": (H, H), block + "v_proj.weight": (H, H),
            block + "attn_out.weight": (H, H), block + "ff_proj.weight": (M, H),
            block + "up_proj.weight": (M, H), block + "ff_out.weight": (H, M),
        })
    assert {name: shape for name, (shape, _) in tensors.items()} == expected
    assert {dtype for _, dtype in tensors.values()} == {torch.bfloat16}


def test_dream_matches_qwen2_layout(tmp_path: Path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config, tensors = _read(write_tiny_dream(tmp_path))
    assert config["model_type"] == "Dream" and config["mask_token_id"] == DREAM_MASK_ID < config["vocab_size"]
    fields = {k: config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                     "num_attention_heads", "num_key_value_heads", "vocab_size")}
    reference = _meta_state_shapes(Qwen2ForCausalLM, Qwen2Config(tie_word_embeddings=False, **fields))
    assert {name: shape for name, (shape, _) in tensors.items()} == reference
    assert "model.layers.0.self_attn.q_proj.bias" in tensors


@pytest.mark.parametrize("flavor", ["fast_dllm_v2", "sdar"])
def test_block_diffusion_matches_qwen_layout(tmp_path: Path, flavor: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config, tensors = _read(write_tiny_block_diffusion(tmp_path, flavor=flavor))
    fields = {k: config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                     "num_attention_heads", "num_key_value_heads", "vocab_size")}
    if flavor == "sdar":
        assert config["model_type"] == "sdar" and config["block_size"] == 4
        assert config["mask_token_id"] == SDAR_MASK_ID < config["vocab_size"]
        cls, cfg = Qwen3ForCausalLM, Qwen3Config(head_dim=config["head_dim"], tie_word_embeddings=False, **fields)
    else:
        assert config["model_type"] == "Fast_dLLM_Qwen" and config["bd_size"] == 8
        assert "mask_token_id" not in config and FAST_DLLM_V2_MASK_ID < config["vocab_size"]
        cls, cfg = Qwen2ForCausalLM, Qwen2Config(tie_word_embeddings=False, **fields)
    assert {name: shape for name, (shape, _) in tensors.items()} == _meta_state_shapes(cls, cfg)


def test_writers_are_deterministic_and_keep_the_global_rng(tmp_path: Path):
    name = "model.transformer.blocks.1.ff_proj.weight"
    before = torch.get_rng_state()
    tensors = []
    for sub in ("a", "b"):
        with safe_open(str(write_tiny_llada(tmp_path / sub, seed=3) / "model.safetensors"), "pt") as f:
            tensors.append(f.get_tensor(name))
    assert torch.equal(*tensors)
    assert torch.equal(before, torch.get_rng_state())
    with pytest.raises(ValueError, match="mask id"):
        write_tiny_dream(tmp_path / "c", vocab_size=1000)


def test_diffusion_gemma_layout(tmp_path: Path):
    config, tensors = _read(write_tiny_diffusion_gemma(tmp_path))
    assert config["model_type"] == "diffusion_gemma" and config["canvas_length"] == 8
    text = config["text_config"]
    assert text["layer_types"] == ["sliding_attention", "full_attention"]
    assert text["per_layer_config"] == {"1": {"head_dim": 32}}  # global head_dim on full layers
    # Tied copies are dropped: no lm_head, no encoder text weights except the per-layer scalar buffers.
    assert "lm_head.weight" not in tensors
    encoder_text = {n for n in tensors if n.startswith("model.encoder.language_model.")}
    assert encoder_text == {f"model.encoder.language_model.layers.{i}.layer_scalar" for i in range(2)}
    layer0, layer1 = "model.decoder.layers.0.", "model.decoder.layers.1."
    assert tensors[layer0 + "self_attn.v_proj.weight"][0] == (16, 64)  # sliding: own v_proj
    assert layer1 + "self_attn.v_proj.weight" not in tensors  # full attention: values come from k_proj
    assert tensors[layer1 + "self_attn.k_proj.weight"][0] == (32, 64)
    assert tensors[layer0 + "experts.gate_up_proj"][0] == (4, 64, 64)
    assert tensors[layer0 + "experts.down_proj"][0] == (4, 64, 32)
    for name in ("model.decoder.embed_tokens.weight", "model.decoder.norm.weight",
                 "model.decoder.self_conditioning.gate_proj.weight", layer0 + "router.per_expert_scale"):
        assert name in tensors
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (2, 1, 0)
