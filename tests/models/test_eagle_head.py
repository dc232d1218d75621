"""EAGLE heads load from the published layouts and compute what the papers' heads compute.

The reference below is written from the upstream module code (SafeAILab/EAGLE ``cnets1.py``
for EAGLE-1/2, ``cnets.py`` for EAGLE-3) with plain tensor ops on the checkpoint's own
tensors, so a wrong rename, a missed fusion, a swapped concatenation order or a norm in
the wrong place all show up as a numerical mismatch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dualserve.models.attention import DenseAttention
from dualserve.models.config import ModelConfig
from dualserve.models.eagle import (Eagle1Head, Eagle3Head, eagle3_aux_layers, load_eagle_head, map_head_state,
                                    published_state, save_eagle_head)
from dualserve.models.transformer import Transformer
from tiny_eagle import write_tiny_eagle1, write_tiny_eagle3

GEOMETRY = dict(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96, vocab_size=256)
TARGET = ModelConfig(family="llama", vocab_size=256, hidden_size=64, num_layers=8, num_heads=4, num_kv_heads=2,
                     head_dim=16, intermediate_size=96, rms_norm_eps=1e-5, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def target() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(TARGET)
    model.rotary.reset("cpu")
    return model.eval().requires_grad_(False)


# ---- reference (plain ops on the checkpoint tensors) ------------------------------

def rms(x, w, eps=1e-5):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta=10000.0):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def attention(x, w, prefix, pos, heads=4, kv_heads=2):
    t = x.shape[0]
    q = (x @ w[f"{prefix}.self_attn.q_proj.weight"].T).view(t, heads, -1)
    k = (x @ w[f"{prefix}.self_attn.k_proj.weight"].T).view(t, kv_heads, -1)
    v = (x @ w[f"{prefix}.self_attn.v_proj.weight"].T).view(t, kv_heads, -1)
    q, k = rope(q, pos), rope(k, pos)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(t, -1)
    return out @ w[f"{prefix}.self_attn.o_proj.weight"].T


def mlp(x, w, prefix):
    gate = x @ w[f"{prefix}.mlp.gate_proj.weight"].T
    up = x @ w[f"{prefix}.mlp.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ w[f"{prefix}.mlp.down_proj.weight"].T


def ref_eagle1(w, embed, lm_head, ids, feats, pos):
    x = torch.cat([embed[ids], feats], -1) @ w["fc.weight"].T
    if "fc.bias" in w:
        x = x + w["fc.bias"]
    x = x + attention(x, w, "layers.0", pos)  # layer 0: no input norm
    x = x + mlp(rms(x, w["layers.0.post_attention_layernorm.weight"]), w, "layers.0")
    return x, x @ lm_head.T  # no final norm: the target's lm_head on the predicted feature


def ref_eagle3(w, embed, aux, ids, pos):
    h = torch.cat(aux, -1) @ w["fc.weight"].T
    a = torch.cat([rms(embed[ids], w["midlayer.input_layernorm.weight"]),
                   rms(h, w["midlayer.hidden_norm.weight"])], -1)
    x = h + attention(a, w, "midlayer", pos)
    x = x + mlp(rms(x, w["midlayer.post_attention_layernorm.weight"]), w, "midlayer")
    return x, rms(x, w["norm.weight"]) @ w["lm_head.weight"].T


# ---- tests ------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("bias", [False, True])
def test_eagle1_matches_reference(tmp_path: Path, target: Transformer, fmt: str, bias: bool) -> None:
    written = write_tiny_eagle1(tmp_path, **GEOMETRY, fmt=fmt, bias=bias, dtype=torch.float32)
    head = load_eagle_head(tmp_path, target)
    assert isinstance(head, Eagle1Head) and head.config.fc_bias == bias
    # Borrowed by reference: the target's own storage, and not a parameter of the head.
    assert head.embed_weight.data_ptr() == target.embed_tokens.weight.data_ptr()
    assert head.lm_head_weight.data_ptr() == target.lm_head_weight.data_ptr()
    assert not any("embed" in n for n, _ in head.named_parameters())
    ids = torch.tensor([5, 17, 3, 99, 42, 7])
    feats = torch.randn(6, 64)
    pos = torch.arange(6)
    h = head(ids, feats, pos, DenseAttention([6]))
    w = {k: v.float() for k, v in written.items()}
    ref_h, ref_logits = ref_eagle1(w, target.embed_tokens.weight, target.lm_head_weight, ids, feats, pos)
    torch.testing.assert_close(h, ref_h, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(head.logits(h), ref_logits, rtol=1e-4, atol=1e-3)
    assert torch.equal(head.to_target(ids), ids)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_eagle3_matches_reference(tmp_path: Path, target: Transformer, fmt: str) -> None:
    written = write_tiny_eagle3(tmp_path, **GEOMETRY, draft_vocab_size=48, fmt=fmt, dtype=torch.float32)
    head = load_eagle_head(tmp_path, target)
    assert isinstance(head, Eagle3Head)
    assert head.config.draft_vocab_size == 48 and head.config.aux_layers == (1, 3, 4)
    ids = torch.tensor([1, 2, 3, 4, 5])
    pos = torch.arange(5)
    final, aux = target(ids, pos, DenseAttention([5]), aux_layers=head.config.aux_layers)
    assert len(aux) == 3
    h = head(ids, head.features(final, aux), pos, DenseAttention([5]))
    ref_h, ref_logits = ref_eagle3({k: v.float() for k, v in written.items() if v.is_floating_point()},
                                   target.embed_tokens.weight, aux, ids, pos)
    torch.testing.assert_close(h, ref_h, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(head.logits(h), ref_logits, rtol=1e-4, atol=1e-3)
    # Draft ids map to target ids through d2t; t2d marks exactly those ids.
    draft = torch.arange(48)
    target_ids = head.to_target(draft)
    assert torch.equal(target_ids, draft + written["d2t"])
    assert bool(head.t2d[target_ids].all()) and int(head.t2d.sum()) == 48


def test_eagle3_aux_layer_convention() -> None:
    # Upstream captures the stream entering layers 2, N//2, N-3 = outputs of layers 1, N//2-1, N-4.
    assert eagle3_aux_layers({}, 30) == (1, 14, 26)
    assert eagle3_aux_layers({}, 32) == (1, 15, 28)
    cfg = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [3, 10, 20]}}
    assert eagle3_aux_layers(cfg, 24) == (2, 9, 19)
    with pytest.raises(ValueError):
        eagle3_aux_layers({}, 6)  # 2, 3, 3: not distinct


def test_prefixed_names_and_vllm_midlayer(tmp_path: Path, target: Transformer) -> None:
    written = write_tiny_eagle3(tmp_path, **GEOMETRY, draft_vocab_size=48, dtype=torch.float32)
    renamed = {("model." + k.replace("midlayer.", "layers.0.") if k.startswith(("midlayer", "fc", "norm")) else k): v
               for k, v in written.items()}
    assert set(map_head_state(renamed, "eagle3")) == set(map_head_state(dict(written), "eagle3"))
    with pytest.raises(ValueError):
        map_head_state({**written, "mystery.weight": torch.zeros(1)}, "eagle3")


def test_save_round_trip(tmp_path: Path, target: Transformer) -> None:
    written = write_tiny_eagle3(tmp_path / "in", **GEOMETRY, draft_vocab_size=48, dtype=torch.float32)
    head = load_eagle_head(tmp_path / "in", target)
    save_eagle_head(head, TARGET, tmp_path / "out", dtype=torch.float32)
    again = load_eagle_head(tmp_path / "out", target)
    assert set(published_state(again)) == set(written)  # the published names, unfused
    for name, tensor in published_state(again).items():
        assert torch.equal(tensor, written[name]), name
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 48
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]


def test_eagle1_checkpoint_without_bias_key(tmp_path: Path, target: Transformer) -> None:
    # Vicuna-style heads omit "bias" and carry fc.bias; the tensor decides.
    write_tiny_eagle1(tmp_path, **GEOMETRY, bias=True, include_embed=False)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["bias"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_eagle_head(tmp_path, target).config.fc_bias


def test_geometry_mismatch_is_an_error(tmp_path: Path, target: Transformer) -> None:
    write_tiny_eagle1(tmp_path, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=48, vocab_size=256)
    with pytest.raises(ValueError):
        load_eagle_head(tmp_path, target)
