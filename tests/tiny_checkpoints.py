"""Tiny random diffusion-LM checkpoints written in the published upstream layouts.

Each writer stores ``config.json`` plus one ``model.safetensors`` in a directory and returns
that directory. Tensor names, shapes, dtypes and config fields follow the released
checkpoints; only the sizes shrink. No tokenizer is written.

* LLaDA (``GSAI-ML/LLaDA-8B-Instruct``, ``modeling_llada.py``): OLMo-style names under
  ``model.transformer.``; SwiGLU is ``ff_out(silu(ff_proj(x)) * up_proj(x))`` (``ff_proj`` is the
  gate); the LM head is ``model.transformer.ff_out`` because ``weight_tying`` is false.
* Dream (``Dream-org/Dream-v0-Instruct-7B``): the Qwen2 layout (q/k/v biases, untied
  ``lm_head``) under ``model_type: "Dream"``.
* Block diffusion on a Qwen backbone: Fast-dLLM v2 (``Efficient-Large-Model/Fast_dLLM_v2_7B``,
  Qwen2 layout, block size in ``bd_size``, mask id not in the config) or SDAR
  (``JetLM/SDAR-1.7B-Chat``, Qwen3 layout with q/k norms, ``block_size`` and ``mask_token_id``
  in the config).
* DiffusionGemma: built with the transformers classes and ``save_pretrained``, so the layout
  is whatever transformers writes (decoder weights kept, tied encoder copies dropped).

The default vocabularies are the real ones, so each family's real mask id is a valid row;
the hidden size is kept small (32) so the embedding and head stay a few MB in bfloat16.
Weights are drawn so that mistakes show up in numerics: norm weights are ``1 + noise`` (a
``(1 + w)`` Gemma-style norm would be caught), biases are non-zero, linear weights are scaled
by fan-in. Everything comes from a ``torch.Generator`` seeded with ``seed``; the global RNG
is left as it was.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file

LLADA_MASK_ID = 126336
LLADA_VOCAB = 126464
DREAM_MASK_ID = 151666
DREAM_VOCAB = 152064
FAST_DLLM_V2_MASK_ID = 151665  # "|<MASK>|"; hard-coded upstream, absent from config.json
SDAR_MASK_ID = 151669  # "<|MASK|>"
QWEN2_VOCAB = 152064  # Qwen2.5-7B, the base of Fast_dLLM_v2_7B
QWEN3_VOCAB = 151936  # Qwen3-1.7B, the base of SDAR-1.7B-Chat

BlockDiffusionFlavor = Literal["fast_dllm_v2", "sdar"]

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


class _Init:
    """Seeded random tensors of one kind each, cast to the checkpoint dtype."""

    def __init__(self, seed: int, dtype: torch.dtype):
        self.gen = torch.Generator().manual_seed(seed)
        self.dtype = dtype

    def _randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen)

    def embedding(self, rows: int, cols: int) -> torch.Tensor:
        return self._randn(rows, cols).to(self.dtype)

    def linear(self, out_features: int, in_features: int) -> torch.Tensor:
        return (self._randn(out_features, in_features) / in_features**0.5).to(self.dtype)

    def norm(self, size: int) -> torch.Tensor:
        return (1.0 + 0.1 * self._randn(size)).to(self.dtype)

    def bias(self, size: int) -> torch.Tensor:
        return (0.1 * self._randn(size)).to(self.dtype)


def _check_vocab(vocab_size: int, mask_token_id: int) -> None:
    if not 0 <= mask_token_id < vocab_size:
        raise ValueError(f"mask id {mask_token_id} is not a row of a {vocab_size}-token vocabulary")


def _write(path: str | Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # Contiguous copies: safetensors refuses views; "format": "pt" is what transformers writes.
    contiguous = {name: tensor.contiguous() for name, tensor in tensors.items()}
    save_file(contiguous, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _llada_config(hidden: int, layers: int, heads: int, mlp: int, vocab: int, mask_id: int, dtype: str) -> dict:
    """LLaDA-8B-Instruct's config.json with the sizes replaced."""
    return {
        "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0,
        "architectures": ["LLaDAModelLM"], "attention_dropout": 0.0,
        "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
        "auto_map": {
            "AutoConfig": "configuration_llada.LLaDAConfig",
            "AutoModel": "modeling_llada.LLaDAModelLM",
            "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
        },
        "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama",
        "d_model": hidden, "embedding_dropout": 0.0, "embedding_size": vocab,
        "eos_token_id": 126081, "flash_attention": False, "include_bias": False,
        "include_qkv_bias": False, "init_cutoff_factor": None, "init_device": "meta",
        "init_fn": "mitchell", "init_std": 0.02, "input_emb_norm": False,
        "layer_norm_type": "rms", "layer_norm_with_affine": True, "mask_token_id": mask_id,
        "max_sequence_length": 4096, "mlp_hidden_size": mlp, "mlp_ratio": 4,
        "model_type": "llada", "multi_query_attention": None, "n_heads": heads,
        "n_kv_heads": heads, "n_layers": layers, "pad_token_id": 126081,
        "precision": "amp_bf16", "residual_dropout": 0.0, "rms_norm_eps": 1e-05, "rope": True,
        "rope_full_precision": True, "rope_theta": 500000.0, "scale_logits": False,
        "torch_dtype": dtype, "transformers_version": "4.51.2", "use_cache": False,
        "vocab_size": vocab, "weight_tying": False,
    }


def write_tiny_llada(
    path: str | Path,
    seed: int = 0,
    *,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    mlp_hidden_size: int = 64,
    vocab_size: int = LLADA_VOCAB,
    mask_token_id: int = LLADA_MASK_ID,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write a tiny LLaDA checkpoint (MHA, untied head, no biases) and return its directory."""
    _check_vocab(vocab_size, mask_token_id)
    init = _Init(seed, dtype)
    prefix = "model.transformer."
    tensors = {prefix + "wte.weight": init.embedding(vocab_size, hidden_size)}
    for i in range(num_layers):
        block = f"{prefix}blocks.{i}."
        tensors[block + "attn_norm.weight"] = init.norm(hidden_size)
        for name in ("q_proj", "k_proj", "v_proj", "attn_out"):  # n_kv_heads == n_heads: all square
            tensors[block + f"{name}.weight"] = init.linear(hidden_size, hidden_size)
        tensors[block + "ff_norm.weight"] = init.norm(hidden_size)
        tensors[block + "ff_proj.weight"] = init.linear(mlp_hidden_size, hidden_size)  # the SwiGLU gate
        tensors[block + "up_proj.weight"] = init.linear(mlp_hidden_size, hidden_size)
        tensors[block + "ff_out.weight"] = init.linear(hidden_size, mlp_hidden_size)
    tensors[prefix + "ln_f.weight"] = init.norm(hidden_size)
    tensors[prefix + "ff_out.weight"] = init.linear(vocab_size, hidden_size)
    config = _llada_config(
        hidden_size, num_layers, num_heads, mlp_hidden_size, vocab_size, mask_token_id, _DTYPE_NAMES[dtype]
    )
    return _write(path, config, tensors)


def _qwen_tensors(
    init: _Init,
    *,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    vocab: int,
    qkv_bias: bool,
    qk_norm: bool,
) -> dict[str, torch.Tensor]:
    """Qwen2 (q/k/v bias) or Qwen3 (per-head q/k RMSNorm) decoder tensors with an untied lm_head."""
    tensors = {"model.embed_tokens.weight": init.embedding(vocab, hidden)}
    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    for i in range(layers):
        layer = f"model.layers.{i}."
        tensors[layer + "input_layernorm.weight"] = init.norm(hidden)
        for name, width in (("q_proj", q_width), ("k_proj", kv_width), ("v_proj", kv_width)):
            tensors[layer + f"self_attn.{name}.weight"] = init.linear(width, hidden)
            if qkv_bias:
                tensors[layer + f"self_attn.{name}.bias"] = init.bias(width)
        tensors[layer + "self_attn.o_proj.weight"] = init.linear(hidden, q_width)
        if qk_norm:
            tensors[layer + "self_attn.q_norm.weight"] = init.norm(head_dim)
            tensors[layer + "self_attn.k_norm.weight"] = init.norm(head_dim)
        tensors[layer + "post_attention_layernorm.weight"] = init.norm(hidden)
        tensors[layer + "mlp.gate_proj.weight"] = init.linear(intermediate, hidden)
        tensors[layer + "mlp.up_proj.weight"] = init.linear(intermediate, hidden)
        tensors[layer + "mlp.down_proj.weight"] = init.linear(hidden, intermediate)
    tensors["model.norm.weight"] = init.norm(hidden)
    tensors["lm_head.weight"] = init.linear(vocab, hidden)
    return tensors


def _qwen_config(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int) -> dict:
    """Fields shared by the Qwen2/Qwen3-derived configs, with the sizes replaced."""
    return {
        "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": hidden,
        "initializer_range": 0.02, "intermediate_size": intermediate,
        "max_position_embeddings": 32768, "num_attention_heads": heads,
        "num_hidden_layers": layers, "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "sliding_window": None, "tie_word_embeddings": False,
        "use_sliding_window": False, "vocab_size": vocab,
    }


def write_tiny_dream(
    path: str | Path,
    seed: int = 0,
    *,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 64,
    vocab_size: int = DREAM_VOCAB,
    mask_token_id: int = DREAM_MASK_ID,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write a tiny Dream checkpoint (Qwen2 layout, GQA, untied head) and return its directory."""
    _check_vocab(vocab_size, mask_token_id)
    tensors = _qwen_tensors(
        _Init(seed, dtype), hidden=hidden_size, layers=num_layers, heads=num_heads, kv_heads=num_kv_heads,
        head_dim=hidden_size // num_heads, intermediate=intermediate_size, vocab=vocab_size,
        qkv_bias=True, qk_norm=False,
    )
    config = _qwen_config(hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, vocab_size)
    config.update({
        "architectures": ["DreamModel"],
        "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
        "bos_token_id": 151643, "eos_token_id": 151643, "pad_token_id": 151643,
        "mask_token_id": mask_token_id, "max_position_embeddings": 131072, "max_window_layers": num_layers,
        "model_type": "Dream", "rope_theta": 1000000.0, "torch_dtype": _DTYPE_NAMES[dtype],
        "transformers_version": "4.46.2", "use_cache": False,
    })
    return _write(path, config, tensors)


def _block_diffusion_config(flavor: BlockDiffusionFlavor, block_size: int, mask_token_id: int, layers: int) -> dict:
    """The family-specific config fields: where the block size and mask id are recorded."""
    if flavor == "fast_dllm_v2":
        return {
            "architectures": ["Fast_dLLM_QwenForCausalLM"],
            "auto_map": {
                "AutoConfig": "configuration.Fast_dLLM_QwenConfig",
                "AutoModel": "modeling.Fast_dLLM_QwenModel",
                "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM",
            },
            "bd_size": block_size, "bos_token_id": 151643, "eos_token_id": 151645,
            "layer_types": ["full_attention"] * layers, "max_window_layers": layers,
            "model_type": "Fast_dLLM_Qwen", "rope_theta": 1000000.0,
            "transformers_version": "4.53.0", "use_cache": True,
        }
    return {
        "architectures": ["SDARForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_sdar.SDARConfig",
            "AutoModel": "modeling_sdar.SDARModel",
            "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM",
        },
        "attention_bias": False, "block_size": block_size, "bos_token_id": 151643,
        "eos_token_id": 151643, "head_dim": None, "mask_token_id": mask_token_id,
        "max_window_layers": layers, "model_type": "sdar", "rope_theta": 1000000,
        "transformers_version": "4.52.4", "use_cache": False,
    }


def write_tiny_block_diffusion(
    path: str | Path,
    seed: int = 0,
    *,
    flavor: BlockDiffusionFlavor = "fast_dllm_v2",
    block_size: int | None = None,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 64,
    vocab_size: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write a tiny block-diffusion checkpoint and return its directory.

    ``flavor="fast_dllm_v2"``: Qwen2 layout, ``bd_size`` (default 8; the release uses 32), mask
    id 151665 known only to the code. ``flavor="sdar"``: Qwen3 layout, ``block_size`` (default 4,
    as released) and ``mask_token_id`` 151669 in the config.
    """
    sdar = flavor == "sdar"
    mask_id = SDAR_MASK_ID if sdar else FAST_DLLM_V2_MASK_ID
    vocab = vocab_size or (QWEN3_VOCAB if sdar else QWEN2_VOCAB)
    _check_vocab(vocab, mask_id)
    head_dim = hidden_size // num_heads
    tensors = _qwen_tensors(
        _Init(seed, dtype), hidden=hidden_size, layers=num_layers, heads=num_heads, kv_heads=num_kv_heads,
        head_dim=head_dim, intermediate=intermediate_size, vocab=vocab, qkv_bias=not sdar, qk_norm=sdar,
    )
    config = _qwen_config(hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, vocab)
    config.update(_block_diffusion_config(flavor, block_size or (4 if sdar else 8), mask_id, num_layers))
    if sdar:
        config["head_dim"] = head_dim  # Qwen3 configs state head_dim explicitly
    config["torch_dtype"] = _DTYPE_NAMES[dtype]
    return _write(path, config, tensors)


def _tiny_diffusion_gemma_config(canvas_length: int, vocab_size: int):
    from transformers import DiffusionGemmaConfig, DiffusionGemmaTextConfig, Gemma4VisionConfig

    text = DiffusionGemmaTextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=32,
        num_global_key_value_heads=1, sliding_window=8, num_experts=4, top_k_experts=2,
        moe_intermediate_size=32, max_position_embeddings=512,
        layer_types=["sliding_attention", "full_attention"],
    )
    # The vision tower is mandatory in the config; a default one would be ~100M parameters.
    vision = Gemma4VisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8, position_embedding_size=64,
    )
    return DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=canvas_length)


def _redraw_diffusion_gemma(model: torch.nn.Module, init: _Init) -> None:
    """Redraw every weight so logits are peaked (multi-token acceptance, early stopping)."""
    for name, param in model.named_parameters():  # tied copies appear once
        if param.ndim == 1:
            value = init.norm(param.shape[0])  # norm weights, router scales
        elif name.endswith("embed_tokens.weight"):
            value = init.embedding(*param.shape)
        elif param.ndim == 3:  # experts: (num_experts, out, in)
            value = torch.stack([init.linear(*param.shape[1:]) for _ in range(param.shape[0])])
        else:
            value = init.linear(*param.shape)
        param.data.copy_(value)
    decoder_layers = model.model.decoder.layers
    encoder_layers = model.model.encoder.language_model.layers
    for dec, enc in zip(decoder_layers, encoder_layers, strict=True):
        scalar = 0.5 + torch.rand(1, generator=init.gen)  # buffers, saved once per stack
        dec.layer_scalar.copy_(scalar)
        enc.layer_scalar.copy_(scalar)


def write_tiny_diffusion_gemma(
    path: str | Path, seed: int = 0, *, canvas_length: int = 8, vocab_size: int = 512
) -> Path:
    """Write a tiny DiffusionGemma checkpoint with transformers' own classes; return its directory.

    Two layers (sliding then full attention), hidden 64, 4 experts (top-2) beside the dense MLP,
    sliding window 8, canvas 8, float32. ``generation_config.json`` carries bos 2 / eos 1 / pad 0
    and leaves the diffusion knobs unset, so ``generate`` applies its global defaults.
    """
    from transformers import DiffusionGemmaForBlockDiffusion

    config = _tiny_diffusion_gemma_config(canvas_length, vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DiffusionGemmaForBlockDiffusion(config).eval()
    with torch.no_grad():
        _redraw_diffusion_gemma(model, _Init(seed, torch.float32))
    model.generation_config.bos_token_id = 2
    model.generation_config.eos_token_id = 1
    model.generation_config.pad_token_id = 0
    out = Path(path)
    model.save_pretrained(out)
    return out
