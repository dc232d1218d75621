"""The tiny EAGLE fixtures really are in the published layouts and load without pickle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tiny_eagle import draft_vocab_maps, write_tiny_eagle1, write_tiny_eagle3

# A scaled-down SmolLM2-style target: GQA with 2 query heads per kv head.
GEOMETRY = dict(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96, vocab_size=256)
H, I, V, Q, KV = 64, 96, 256, 64, 32  # hidden, intermediate, vocab, q width, kv width (head_dim 16)
D = 48  # draft vocab

EAGLE1_SHAPES = {
    "embed_tokens.weight": (V, H),
    "fc.weight": (H, 2 * H),
    "layers.0.self_attn.q_proj.weight": (Q, H),
    "layers.0.self_attn.k_proj.weight": (KV, H),
    "layers.0.self_attn.v_proj.weight": (KV, H),
    "layers.0.self_attn.o_proj.weight": (H, Q),
    "layers.0.mlp.gate_proj.weight": (I, H),
    "layers.0.mlp.up_proj.weight": (I, H),
    "layers.0.mlp.down_proj.weight": (H, I),
    "layers.0.post_attention_layernorm.weight": (H,),
}

EAGLE3_SHAPES = {
    "fc.weight": (H, 3 * H),
    "midlayer.input_layernorm.weight": (H,),
    "midlayer.hidden_norm.weight": (H,),
    "midlayer.self_attn.q_proj.weight": (Q, 2 * H),
    "midlayer.self_attn.k_proj.weight": (KV, 2 * H),
    "midlayer.self_attn.v_proj.weight": (KV, 2 * H),
    "midlayer.self_attn.o_proj.weight": (H, Q),
    "midlayer.post_attention_layernorm.weight": (H,),
    "midlayer.mlp.gate_proj.weight": (I, H),
    "midlayer.mlp.up_proj.weight": (I, H),
    "midlayer.mlp.down_proj.weight": (H, I),
    "norm.weight": (H,),
    "lm_head.weight": (D, H),
    "d2t": (D,),
    "t2d": (V,),
}

WEIGHT_FILE = {"safetensors": "model.safetensors", "bin": "pytorch_model.bin"}


def read_back(path: Path, fmt: str) -> dict[str, torch.Tensor]:
    """Load the way a pickle-free loader must: safetensors, or torch.load with weights_only."""
    file = path / WEIGHT_FILE[fmt]
    if fmt == "safetensors":
        with safe_open(str(file), framework="pt") as f:
            names = set(f.keys())
        state = load_file(str(file))
        assert set(state) == names
        return state
    return torch.load(file, map_location="cpu", weights_only=True)


def assert_same(written: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> None:
    assert set(loaded) == set(written)
    for name, tensor in written.items():
        assert loaded[name].dtype == tensor.dtype, name
        assert torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_eagle1_layout(tmp_path: Path, fmt: str) -> None:
    written = write_tiny_eagle1(tmp_path, **GEOMETRY, fmt=fmt)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["config.json", WEIGHT_FILE[fmt]])
    loaded = read_back(tmp_path, fmt)
    assert_same(written, loaded)
    assert {name: tuple(t.shape) for name, t in loaded.items()} == EAGLE1_SHAPES
    assert all(t.dtype == torch.float16 for t in loaded.values())
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["bias"] is False
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (H, 4, 2)
    assert (config["intermediate_size"], config["vocab_size"]) == (I, V)


def test_eagle1_variants(tmp_path: Path) -> None:
    with_bias = write_tiny_eagle1(tmp_path / "vicuna", **GEOMETRY, bias=True, include_embed=False,
                                  num_layers=2, dtype=torch.float32)
    assert with_bias["fc.bias"].shape == (H,)
    assert "embed_tokens.weight" not in with_bias
    # Only layers after the first carry an input norm.
    assert "layers.0.input_layernorm.weight" not in with_bias
    assert with_bias["layers.1.input_layernorm.weight"].shape == (H,)
    assert json.loads((tmp_path / "vicuna" / "config.json").read_text())["bias"] is True
    assert all(t.dtype == torch.float32 for t in with_bias.values())


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_eagle3_layout(tmp_path: Path, fmt: str) -> None:
    written = write_tiny_eagle3(tmp_path, **GEOMETRY, draft_vocab_size=D, fmt=fmt)
    loaded = read_back(tmp_path, fmt)
    assert_same(written, loaded)
    assert {name: tuple(t.shape) for name, t in loaded.items()} == EAGLE3_SHAPES
    assert loaded["d2t"].dtype == torch.int64 and loaded["t2d"].dtype == torch.bool
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["draft_vocab_size"] == D and config["vocab_size"] == V
    assert "target_hidden_size" not in config and "rope_theta" not in config


def test_eagle3_target_hidden_size(tmp_path: Path) -> None:
    written = write_tiny_eagle3(tmp_path, **GEOMETRY, draft_vocab_size=D, target_hidden_size=40)
    assert written["fc.weight"].shape == (H, 120)
    assert json.loads((tmp_path / "config.json").read_text())["target_hidden_size"] == 40


def test_draft_vocab_maps_agree() -> None:
    d2t, t2d = draft_vocab_maps(V, D, seed=3)
    target_ids = torch.arange(D) + d2t  # draft id -> target id
    assert bool((target_ids[1:] > target_ids[:-1]).all())  # sorted ascending, no duplicates
    assert 0 <= int(target_ids.min()) and int(target_ids.max()) < V
    assert int(t2d.sum()) == D and bool(t2d[target_ids].all())
    full_d2t, full_t2d = draft_vocab_maps(V, V)
    assert not full_d2t.any() and bool(full_t2d.all())


def test_seeded(tmp_path: Path) -> None:
    a = write_tiny_eagle3(tmp_path / "a", **GEOMETRY, draft_vocab_size=D, seed=1)
    b = write_tiny_eagle3(tmp_path / "b", **GEOMETRY, draft_vocab_size=D, seed=1)
    c = write_tiny_eagle3(tmp_path / "c", **GEOMETRY, draft_vocab_size=D, seed=2)
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert not torch.equal(a["fc.weight"], c["fc.weight"])
