"""LLaDA (Nie et al. 2025, arXiv 2502.09992): its OLMo-style config keys and tensor names.

LLaDA is a bidirectional masked-diffusion model on the transformer core (Llama's layer, no logit
shift). Its checkpoint keeps OLMo's names, for the config and the tensors alike, which the family
row (``families.py``) hands to the loader: ``read_hf`` for ``config.json``, ``NAMES`` for renaming
its tensors onto the canonical Hugging Face Llama names.
"""

from __future__ import annotations

from typing import Any

from .config import Layout, ModelConfig

# The [MASK] id of the released checkpoints, when config.json does not say (generate.py's mask_id).
MASK_TOKEN_ID = 126336

# LLaDA (OLMo-derived) names; ff_proj is the SwiGLU gate: act(ff_proj(x)) * up_proj(x).
NAMES: list[tuple[str, str]] = [
    (r"^model\.transformer\.wte\.weight$", "model.embed_tokens.weight"),
    (r"^model\.transformer\.ln_f\.weight$", "model.norm.weight"),
    (r"^model\.transformer\.ff_out\.weight$", "lm_head.weight"),
    (r"^model\.transformer\.blocks\.(\d+)\.attn_norm\.weight$", r"model.layers.\1.input_layernorm.weight"),
    (r"^model\.transformer\.blocks\.(\d+)\.ff_norm\.weight$", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"^model\.transformer\.blocks\.(\d+)\.(q|k|v)_proj\.(weight|bias)$", r"model.layers.\1.self_attn.\2_proj.\3"),
    (r"^model\.transformer\.blocks\.(\d+)\.attn_out\.weight$", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"^model\.transformer\.blocks\.(\d+)\.ff_proj\.weight$", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"^model\.transformer\.blocks\.(\d+)\.up_proj\.weight$", r"model.layers.\1.mlp.up_proj.weight"),
    (r"^model\.transformer\.blocks\.(\d+)\.ff_out\.weight$", r"model.layers.\1.mlp.down_proj.weight"),
]


def read_hf(cfg: dict[str, Any], family: str, layout: Layout) -> ModelConfig:
    """LLaDA's OLMo-style config (d_model, n_heads, mlp_hidden_size, ...)."""
    hidden = cfg["d_model"]
    heads = cfg["n_heads"]
    return ModelConfig(
        family=family,
        vocab_size=cfg.get("embedding_size") or cfg["vocab_size"],
        hidden_size=hidden,
        num_layers=cfg["n_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("n_kv_heads") or heads,
        head_dim=hidden // heads,
        intermediate_size=cfg["mlp_hidden_size"],
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        rope_theta=cfg.get("rope_theta", 500000.0),
        max_position_embeddings=cfg.get("max_sequence_length", 4096),
        attention_bias=bool(cfg.get("include_bias", False) or cfg.get("include_qkv_bias", False)),
        tie_word_embeddings=bool(cfg.get("weight_tying", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=(cfg["eos_token_id"],) if cfg.get("eos_token_id") is not None else (),
        pad_token_id=cfg.get("pad_token_id"),
        mask_token_id=cfg.get("mask_token_id", layout.mask_token_id),
    )
