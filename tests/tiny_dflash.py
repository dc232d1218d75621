"""Tiny random DFlash drafters written in the published checkpoint layout.

Layout of ``z-lab/Qwen3-8B-DFlash-b16`` and kin (upstream ``dflash/model.py``,
``DFlashDraftModel``), tensor for tensor, only smaller: ``fc.weight``
(hidden, len(target_layer_ids) * target hidden), ``hidden_norm.weight``, per layer
``input_layernorm``, ``self_attn.{q,k,v,o}_proj``, ``self_attn.{q,k}_norm`` (per head
dim), ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``, then ``norm.weight``;
no embedding and no lm_head (the target's are used). ``config.json`` is a Qwen3 config
with ``dflash_config`` {block_size, mask_token_id, target_layer_ids}.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_tiny_dflash(path: Path, *, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                      intermediate_size: int, vocab_size: int, num_layers: int, target_layer_ids: list[int],
                      num_target_layers: int, block_size: int, mask_token_id: int, seed: int = 0,
                      d2t: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Write config.json + model.safetensors; return the tensors written."""
    g = torch.Generator().manual_seed(seed)

    def linear(out: int, inp: int) -> torch.Tensor:
        return (torch.randn(out, inp, generator=g) / inp ** 0.5).to(dtype)

    def norm(n: int) -> torch.Tensor:
        return (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)

    h, q, kv = hidden_size, num_heads * head_dim, num_kv_heads * head_dim
    state = {"fc.weight": linear(h, len(target_layer_ids) * h), "hidden_norm.weight": norm(h)}
    for i in range(num_layers):
        p = f"layers.{i}."
        state |= {
            p + "input_layernorm.weight": norm(h),
            p + "self_attn.q_proj.weight": linear(q, h),
            p + "self_attn.k_proj.weight": linear(kv, h),
            p + "self_attn.v_proj.weight": linear(kv, h),
            p + "self_attn.o_proj.weight": linear(h, q),
            p + "self_attn.q_norm.weight": norm(head_dim),
            p + "self_attn.k_norm.weight": norm(head_dim),
            p + "post_attention_layernorm.weight": norm(h),
            p + "mlp.gate_proj.weight": linear(intermediate_size, h),
            p + "mlp.up_proj.weight": linear(intermediate_size, h),
            p + "mlp.down_proj.weight": linear(h, intermediate_size),
        }
    state["norm.weight"] = norm(h)
    if d2t is not None:
        state["d2t"] = d2t.long()
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"))
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "attention_bias": False,
        "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": h, "intermediate_size": intermediate_size,
        "head_dim": head_dim, "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "num_hidden_layers": num_layers, "num_target_layers": num_target_layers, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 2048, "vocab_size": vocab_size,
        "tie_word_embeddings": False, "use_cache": True, "is_causal": False,
        "layer_types": ["full_attention"] * num_layers, "block_size": block_size,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": target_layer_ids},
        "dtype": str(dtype).removeprefix("torch."),
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return state
