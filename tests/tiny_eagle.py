"""Tiny random EAGLE draft heads written in the published checkpoint layouts.

Two layouts exist in the wild and both are reproduced here tensor for tensor, only smaller:

* EAGLE-1/2 (``yuhuili/EAGLE-LLaMA3-Instruct-8B`` and kin): ``fc`` over
  ``cat([embedding, feature])`` plus ``layers.N.*`` Llama layers, where layer 0 has no
  ``input_layernorm``; the frozen ``embed_tokens.weight`` copy ships in the file; there is no
  ``norm`` and no ``lm_head`` (the target's are used). ``fc.bias`` exists unless the config
  says ``"bias": false`` (upstream ``ea_model.py`` treats a missing key as true).
* EAGLE-3 (``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``): ``fc`` over three target features,
  one ``midlayer`` whose q/k/v read ``cat([embedding, hidden])`` (2H wide), its own ``norm``
  and a ``lm_head`` over the reduced draft vocabulary, plus ``d2t`` (int64 offsets,
  ``target_id = draft_id + d2t[draft_id]``) and ``t2d`` (bool mask over the target vocab).

Sources: SafeAILab/EAGLE ``eagle/model/cnets1.py`` and ``cnets.py`` (module names),
``eagle/traineagle3/cnets.py`` (how d2t/t2d are built), the published config.json files.
Each writer stores ``config.json`` plus either ``model.safetensors`` or a
``pytorch_model.bin`` that loads with ``torch.load(..., weights_only=True)``, and returns the
tensors it wrote so tests can compare against what a loader reads back.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file

Format = Literal["safetensors", "bin"]

# Fields every published head config carries (values from the EAGLE-LLaMA3-Instruct-8B file).
_COMMON_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 2048,
    "model_type": "llama",
    "pad_token_id": 0,
    "tie_word_embeddings": False,
    "transformers_version": "4.28.1",
    "use_cache": True,
}


def _geometry(hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int | None) -> tuple[int, int]:
    """Return (q width, kv width); upstream derives head_dim as hidden_size // num_heads."""
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if head_dim is None:
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}")
        head_dim = hidden_size // num_heads
    return num_heads * head_dim, num_kv_heads * head_dim


class _Init:
    """Seeded random tensors: linear weights scaled by fan-in, norm weights near one."""

    def __init__(self, seed: int, dtype: torch.dtype):
        self.gen = torch.Generator().manual_seed(seed)
        self.dtype = dtype

    def linear(self, out_features: int, in_features: int) -> torch.Tensor:
        w = torch.randn(out_features, in_features, generator=self.gen) * in_features ** -0.5
        return w.to(self.dtype)  # (out, in), nn.Linear layout

    def vector(self, size: int, around: float = 0.0, scale: float = 0.02) -> torch.Tensor:
        return (around + scale * torch.randn(size, generator=self.gen)).to(self.dtype)

    def norm(self, size: int) -> torch.Tensor:
        # Not exactly ones, so a loader that forgets a norm weight is caught by numerics tests.
        return self.vector(size, around=1.0, scale=0.1)

    def embedding(self, vocab_size: int, hidden_size: int) -> torch.Tensor:
        return torch.randn(vocab_size, hidden_size, generator=self.gen).to(self.dtype)  # (vocab, hidden)


def _attention_and_mlp(init: _Init, prefix: str, in_size: int, hidden_size: int, q_width: int,
                       kv_width: int, intermediate_size: int) -> dict[str, torch.Tensor]:
    """One Llama layer's projections; ``in_size`` is 2H for the EAGLE-3 midlayer, H otherwise."""
    return {
        f"{prefix}.self_attn.q_proj.weight": init.linear(q_width, in_size),
        f"{prefix}.self_attn.k_proj.weight": init.linear(kv_width, in_size),
        f"{prefix}.self_attn.v_proj.weight": init.linear(kv_width, in_size),
        f"{prefix}.self_attn.o_proj.weight": init.linear(hidden_size, q_width),
        f"{prefix}.mlp.gate_proj.weight": init.linear(intermediate_size, hidden_size),
        f"{prefix}.mlp.up_proj.weight": init.linear(intermediate_size, hidden_size),
        f"{prefix}.mlp.down_proj.weight": init.linear(hidden_size, intermediate_size),
    }


def _write(path: Path, config: dict, state: dict[str, torch.Tensor], fmt: Format) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = OrderedDict((name, t.contiguous()) for name, t in state.items())
    if fmt == "safetensors":
        save_file(tensors, str(path / "model.safetensors"))
    elif fmt == "bin":
        # A plain OrderedDict of tensors is what upstream ships and what weights_only accepts.
        torch.save(tensors, path / "pytorch_model.bin")
    else:
        raise ValueError(f"unknown format {fmt!r}")


def write_tiny_eagle1(path: str | Path, *, hidden_size: int, num_heads: int, num_kv_heads: int,
                      intermediate_size: int, vocab_size: int, seed: int = 0, fmt: Format = "safetensors",
                      bias: bool = False, include_embed: bool = True, num_layers: int = 1,
                      head_dim: int | None = None, rope_theta: float = 10000.0, rms_norm_eps: float = 1e-5,
                      dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """Write an EAGLE-1/2 head for a target of the given geometry; return the tensors written.

    ``bias`` mirrors the config key (LLaMA3 heads: false; Vicuna/llama2 heads omit the key and carry
    ``fc.bias``). ``include_embed`` mirrors the published file, which ships the target's embedding.
    """
    q_width, kv_width = _geometry(hidden_size, num_heads, num_kv_heads, head_dim)
    init = _Init(seed, dtype)
    state: dict[str, torch.Tensor] = {}
    if include_embed:
        state["embed_tokens.weight"] = init.embedding(vocab_size, hidden_size)
    # fc input is cat([embedding, feature]) -> (hidden, 2 * hidden).
    state["fc.weight"] = init.linear(hidden_size, 2 * hidden_size)
    if bias:
        state["fc.bias"] = init.vector(hidden_size)
    for i in range(num_layers):
        prefix = f"layers.{i}"
        state.update(_attention_and_mlp(init, prefix, hidden_size, hidden_size, q_width, kv_width,
                                        intermediate_size))
        if i > 0:  # layer 0 has no input norm (cnets1.py LlamaDecoderLayer: `if self.index != 0`)
            state[f"{prefix}.input_layernorm.weight"] = init.norm(hidden_size)
        state[f"{prefix}.post_attention_layernorm.weight"] = init.norm(hidden_size)
    config = {
        **_COMMON_CONFIG,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "num_hidden_layers": num_layers,
        "rms_norm_eps": rms_norm_eps,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "vocab_size": vocab_size,
        "rope_theta": rope_theta,
        "bias": bias,
    }
    if head_dim is not None:
        config["head_dim"] = head_dim
    _write(Path(path), config, state, fmt)
    return state


def draft_vocab_maps(vocab_size: int, draft_vocab_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Build (d2t, t2d) the way EAGLE-3 training does, from a random pick instead of token counts.

    Upstream keeps the ``draft_vocab_size`` most frequent ids, sorts them ascending and stores
    ``d2t[i] = used[i] - i`` and ``t2d[v] = v in used`` (eagle/traineagle3/cnets.py, scandata).
    """
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} must be in 1..{vocab_size}")
    gen = torch.Generator().manual_seed(seed)
    used = torch.randperm(vocab_size, generator=gen)[:draft_vocab_size].sort().values  # (draft_vocab,)
    d2t = used - torch.arange(draft_vocab_size)  # (draft_vocab,) int64
    t2d = torch.zeros(vocab_size, dtype=torch.bool)  # (vocab,)
    t2d[used] = True
    return d2t, t2d


def write_tiny_eagle3(path: str | Path, *, hidden_size: int, num_heads: int, num_kv_heads: int,
                      intermediate_size: int, vocab_size: int, draft_vocab_size: int, seed: int = 0,
                      fmt: Format = "safetensors", target_hidden_size: int | None = None,
                      head_dim: int | None = None, rope_theta: float | None = None,
                      rms_norm_eps: float = 1e-5, dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """Write an EAGLE-3 head for a target of the given geometry; return the tensors written.

    ``target_hidden_size`` (written to the config only when given) sets the fc input width to
    three target features; ``rope_theta`` is omitted from the config unless given, as in the
    upstream training template (readers then default to 10000).
    """
    q_width, kv_width = _geometry(hidden_size, num_heads, num_kv_heads, head_dim)
    init = _Init(seed, dtype)
    feature_size = target_hidden_size if target_hidden_size is not None else hidden_size
    state: dict[str, torch.Tensor] = {
        # Three target features, low -> mid -> high layer: (hidden, 3 * target_hidden).
        "fc.weight": init.linear(hidden_size, 3 * feature_size),
        "midlayer.input_layernorm.weight": init.norm(hidden_size),
        "midlayer.hidden_norm.weight": init.norm(hidden_size),
    }
    # q/k/v read cat([input_layernorm(embedding), hidden_norm(hidden)]) -> in_features 2H.
    state.update(_attention_and_mlp(init, "midlayer", 2 * hidden_size, hidden_size, q_width, kv_width,
                                    intermediate_size))
    state["midlayer.post_attention_layernorm.weight"] = init.norm(hidden_size)
    state["norm.weight"] = init.norm(hidden_size)
    state["lm_head.weight"] = init.linear(draft_vocab_size, hidden_size)  # (draft_vocab, hidden)
    state["d2t"], state["t2d"] = draft_vocab_maps(vocab_size, draft_vocab_size, seed)
    config = {
        **_COMMON_CONFIG,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "num_hidden_layers": 1,
        "rms_norm_eps": rms_norm_eps,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "vocab_size": vocab_size,
        "draft_vocab_size": draft_vocab_size,
    }
    if target_hidden_size is not None:
        config["target_hidden_size"] = target_hidden_size
    if rope_theta is not None:
        config["rope_theta"] = rope_theta
    if head_dim is not None:
        config["head_dim"] = head_dim
    _write(Path(path), config, state, fmt)
    return state
