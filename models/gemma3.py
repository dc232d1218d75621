"""Gemma 3 (text): its config readers, and what a converted GGUF's ``config.json`` adds for it.

Gemma 3 runs on the transformer core: GELU-tanh, sandwich norms, a scaled embedding, norms that
multiply by ``1 + w``, q/k norms, and sliding-window layers with their own RoPE base, all of them
``ModelConfig`` fields. Its ``config.json`` (``Gemma3TextConfig``) and llama.cpp's GGUF keys say
some of them differently from the common keys, so the family row (``families.py``) names these
readers instead of ``config.read_hf`` / ``config.read_gguf``.
"""

from __future__ import annotations

from typing import Any

from .config import Layout, ModelConfig, RopeScaling, hf_common, rope_scaling_of
from .errors import UnsupportedModel

# Every sixth layer attends globally, the others within a sliding window, with their own RoPE base
# (transformers' Gemma3TextConfig defaults, which llama.cpp hard-codes too).
PATTERN = 6
LOCAL_ROPE_THETA = 10000.0

# Gemma's turn format (Gemma 3's published template, text parts only); a GGUF may ship without it.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] -%}{%- if item['type'] == 'text' -%}{{ item['text'] | trim }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def sliding_layers(num_layers: int, layer_types: list[str] | None) -> tuple[bool, ...]:
    if layer_types:
        return tuple(t == "sliding_attention" for t in layer_types)
    return tuple((i + 1) % PATTERN != 0 for i in range(num_layers))


def read_hf(cfg: dict[str, Any], family: str, layout: Layout) -> ModelConfig:
    """Gemma 3 text (``Gemma3TextConfig``): RoPE bases per layer type, in ``rope_parameters``
    (transformers 5) or ``rope_theta`` / ``rope_local_base_freq`` (4.x)."""
    params = cfg.get("rope_parameters") or {}
    full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    if cfg.get("final_logit_softcapping") or cfg.get("attn_logit_softcapping"):
        raise UnsupportedModel("Gemma checkpoints with logit soft-capping are not supported")
    common = hf_common(cfg)
    return ModelConfig(
        family=family,
        **common,
        rope_theta=float(full.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))),
        rope_scaling=rope_scaling_of(full if full.get("rope_type", "default") != "default"
                                     else cfg.get("rope_scaling")),
        max_position_embeddings=cfg.get("max_position_embeddings", 32768),
        attention_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=True,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        activation="gelu_tanh",
        sandwich_norms=True,
        scale_embeddings=True,
        norm_offset=float(cfg.get("dualserve_norm_offset", 1.0)),
        sliding_window=cfg.get("sliding_window"),
        sliding_layers=sliding_layers(cfg["num_hidden_layers"], cfg.get("layer_types")),
        rope_local_theta=float(local.get("rope_theta", cfg.get("rope_local_base_freq", LOCAL_ROPE_THETA))),
        attention_scale=float(cfg.get("query_pre_attn_scalar", common["head_dim"])) ** -0.5,
    )


def read_gguf(meta: dict[str, Any], family: str, layout: Layout) -> ModelConfig:
    """llama.cpp's keys for Gemma 3. Its norms already hold 1 + w (``norm_offset`` 0); the attention scale
    is 1/sqrt(hidden / heads) for the 27B shape and 1/sqrt(head_dim) otherwise, as llama.cpp sets it."""
    arch = meta["general.architecture"]

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    hidden, heads, layers = int(key("embedding_length")), int(key("attention.head_count")), int(key("block_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    scaling = RopeScaling()
    if key("rope.scaling.type") == "linear":
        scaling = RopeScaling(kind="linear", factor=float(key("rope.scaling.factor", 1.0)))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        family=family,
        vocab_size=int(key("vocab_size") or len(meta.get("tokenizer.ggml.tokens", [])) or 262144),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=head_dim,
        intermediate_size=int(key("feed_forward_length")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 1_000_000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(key("context_length", 32768)),
        qk_norm=True,
        tie_word_embeddings=False,  # the loader sets this when output.weight is absent
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        activation="gelu_tanh",
        sandwich_norms=True,
        scale_embeddings=True,
        norm_offset=0.0,
        sliding_window=int(key("attention.sliding_window", 512)),
        sliding_layers=sliding_layers(layers, None),
        rope_local_theta=LOCAL_ROPE_THETA,
        attention_scale=(hidden / heads) ** -0.5 if (hidden, heads) == (5376, 32) else head_dim ** -0.5,
    )


def hf_keys(config: ModelConfig) -> dict[str, Any]:
    """What a converted GGUF's ``config.json`` adds to the common keys, for ``read_hf``."""
    return {"layer_types": ["sliding_attention" if s else "full_attention" for s in config.sliding_layers],
            "rope_local_base_freq": config.rope_local_theta,
            "query_pre_attn_scalar": config.attention_scale ** -2, "hidden_activation": "gelu_pytorch_tanh",
            "dualserve_norm_offset": config.norm_offset}  # GGUF norms hold 1 + w already
