"""Model configuration: one frozen dataclass for every decoder-only transformer we serve.

The same shape covers Llama, Mistral, Qwen2 and SmolLM (the AR families) and the
diffusion families built on them (LLaDA, Dream, block diffusion). Family details
that change the math are fields here (q/k/v bias, tied embeddings, rope scaling,
logit shift, mask token, Gemma's norms and windows); how a family is recognised and
named lives in ``families.py``.

Constructors read Hugging Face ``config.json`` dicts and GGUF metadata, so the
loader never has to know which source a config came from.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .families import FAMILIES, GGUF_ARCHITECTURES, HF_MODEL_TYPES, UnsupportedModel, of_gguf

__all__ = ["GGUF_ARCHITECTURES", "HF_MODEL_TYPES", "UnsupportedModel", "ModelConfig", "RopeScaling"]

Family = Literal["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma3", "llada", "dream", "block_diffusion"]

# Fast-dLLM v2 (model_type "Fast_dLLM_Qwen") hard-codes its [MASK] id ("|<MASK>|") in generate;
# its config.json has none.
FAST_DLLM_V2_MASK_ID = 151665

# The families whose checkpoints are diffusion models (the rest are autoregressive).
DIFFUSION_FAMILIES = frozenset(f.name for f in FAMILIES if f.diffusion and f.network == "core")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling; ``kind`` follows HF's ``rope_type``."""

    kind: Literal["default", "linear", "llama3"] = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


# Gemma 3: every sixth layer attends globally, the others within a sliding window, with their own
# RoPE base (transformers' Gemma3TextConfig defaults, which llama.cpp hard-codes too).
GEMMA3_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class ModelConfig:
    family: Family
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    # llama.cpp's per-frequency divisors (a GGUF's ``rope_freqs`` tensor: Llama 3.1+ scaling), if any.
    rope_factors: tuple[float, ...] = ()
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    qk_norm: bool = False               # RMSNorm over each head's queries and keys before RoPE (Qwen3, Gemma 3)
    # Gemma 3: GELU (tanh) instead of SiLU in the gated feed-forward; norms after attention and the
    # feed-forward as well as before ("sandwich"); the embedding scaled by sqrt(hidden); norms that
    # multiply by ``offset + w`` (HF stores w, GGUF stores 1 + w); per-layer sliding windows with
    # their own RoPE base; an attention scale of query_pre_attn_scalar ** -0.5.
    activation: Literal["silu", "gelu_tanh"] = "silu"
    sandwich_norms: bool = False
    scale_embeddings: bool = False
    norm_offset: float = 0.0
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()  # per layer: attends within ``sliding_window``
    rope_local_theta: float | None = None  # the sliding layers' RoPE base
    attention_scale: float | None = None   # None: head_dim ** -0.5
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # Diffusion families: the [MASK] id, the denoising block size (block diffusion)
    # and whether position i's logits predict token i+1 (Dream / AR-adapted twins).
    mask_token_id: int | None = None
    diffusion_block_size: int | None = None
    shift_logits: bool = False
    diffusion_threshold: float | None = None  # measured best unmasking threshold, when the checkpoint says

    @property
    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(out, in) of each layer's projections, by module (the transformer's fused q/k/v and gate/up)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {"self_attn.qkv_proj": (q + 2 * kv, h), "self_attn.o_proj": (h, q),
                "mlp.gate_up_proj": (2 * self.intermediate_size, h), "mlp.down_proj": (h, self.intermediate_size)}

    @property
    def kv_shapes(self) -> tuple[tuple[int, int], ...]:
        """Per layer: (kv heads, head size) of its cached keys and values."""
        return ((self.num_kv_heads, self.head_dim),) * self.num_layers

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Per layer: the sliding window W (a token sees the W positions ending at itself) or None."""
        if not self.sliding_layers:
            return (None,) * self.num_layers
        return tuple(self.sliding_window if sliding else None for sliding in self.sliding_layers)

    @property
    def is_diffusion(self) -> bool:
        return self.family in DIFFUSION_FAMILIES

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ---- constructors ---------------------------------------------------

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Read a Hugging Face ``config.json`` (Llama, Mistral, Qwen2, Qwen3, LLaDA, Dream, twins)."""
        model_type = str(cfg.get("model_type", "llama")).lower()
        if model_type == "llada":
            return _llada_from_hf(cfg)
        if model_type == "gemma3_text":
            return _gemma3_from_hf(cfg)
        if model_type == "gemma3":
            raise UnsupportedModel("Gemma 3 checkpoints with a vision tower (model_type 'gemma3') are not supported; "
                                   "text-only ones (model_type 'gemma3_text': 270M, 1B) are")
        if model_type == "sdar":
            raise UnsupportedModel("SDAR checkpoints need per-head q/k RMSNorm (Qwen3), which the transformer "
                                   "core lacks")
        if model_type not in HF_MODEL_TYPES:
            raise UnsupportedModel(f"unsupported model type {model_type!r} in config.json; supported: "
                                   f"{', '.join(HF_MODEL_TYPES)}, and DiffusionGemma")
        fast_dllm_v2 = model_type == "fast_dllm_qwen"  # Qwen2 layout + bd_size, shifted logits
        family: Family
        if model_type == "dream":
            family = "dream"
        elif cfg.get("dualserve_diffusion") or cfg.get("bd_size") or cfg.get("block_size"):
            family = "block_diffusion"
        elif model_type in ("qwen2", "qwen3", "mistral", "phi3"):
            family = model_type  # type: ignore[assignment]
        else:
            family = "llama"
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        eos = cfg.get("eos_token_id")
        twin = cfg.get("dualserve_diffusion") or {}
        rope = cfg.get("rope_parameters") or {}
        if float(cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))) != 1.0:
            raise UnsupportedModel(f"{model_type} checkpoints that rotate part of each head are not supported")
        # Mistral (v0.1) and Phi-3 attend within a sliding window on every layer.
        window = cfg.get("sliding_window") if family in ("mistral", "phi3") else None
        return cls(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            rope_scaling=_rope_scaling(cfg.get("rope_scaling") or cfg.get("rope_parameters")),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            # Qwen2 always has q/k/v biases; Llama/Mistral say so with attention_bias.
            attention_bias=bool(cfg.get("attention_bias", family in ("qwen2", "dream") or model_type == "qwen2"
                                        or fast_dllm_v2)),
            qk_norm=family == "qwen3",
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
            pad_token_id=cfg.get("pad_token_id"),
            mask_token_id=cfg.get("mask_token_id", twin.get("mask_token_id",
                                                             FAST_DLLM_V2_MASK_ID if fast_dllm_v2 else None)),
            diffusion_block_size=twin.get("block_size") or cfg.get("bd_size") or cfg.get("block_size"),
            shift_logits=bool(twin.get("shift_logits", family == "dream" or fast_dllm_v2)),
            diffusion_threshold=twin.get("threshold"),
            sliding_window=window,
            sliding_layers=(True,) * cfg["num_hidden_layers"] if window else (),
            rope_factors=tuple(cfg.get("dualserve_rope_factors") or ()),
        )

    @classmethod
    def from_gguf(cls, meta: dict[str, Any]) -> "ModelConfig":
        """Read GGUF metadata (``general.architecture`` in ``GGUF_ARCHITECTURES``)."""
        arch = of_gguf(meta["general.architecture"]).name
        if arch == "gemma3":
            return _gemma3_from_gguf(meta)

        def key(name: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{name}", default)

        hidden = int(key("embedding_length"))
        heads = int(key("attention.head_count"))
        vocab = key("vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
        scaling = RopeScaling()
        if key("rope.scaling.type") == "linear":
            scaling = RopeScaling(kind="linear", factor=float(key("rope.scaling.factor", 1.0)))
        eos = meta.get("tokenizer.ggml.eos_token_id")
        window = key("attention.sliding_window") if arch == "phi3" else None
        if key("rope.dimension_count") not in (None, int(key("attention.key_length", hidden // heads))):
            raise UnsupportedModel(f"{arch} files that rotate part of each head are not supported")
        return cls(
            family=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            num_layers=int(key("block_count")),
            num_heads=heads,
            num_kv_heads=int(key("attention.head_count_kv", heads)),
            head_dim=int(key("attention.key_length", hidden // heads)),
            intermediate_size=int(key("feed_forward_length")),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=int(key("context_length", 4096)),
            attention_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
            tie_word_embeddings=False,  # the loader sets this when output.weight is absent
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=(int(eos),) if eos is not None else (),
            pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
            sliding_window=int(window) if window else None,
            sliding_layers=(True,) * int(key("block_count")) if window else (),
        )


def _rope_scaling(raw: dict[str, Any] | None) -> RopeScaling:
    if not raw:
        return RopeScaling()
    kind = raw.get("rope_type") or raw.get("type") or "default"
    if kind not in ("default", "linear", "llama3"):
        raise UnsupportedModel(f"unsupported rope scaling {kind!r}")
    return RopeScaling(
        kind=kind,
        factor=float(raw.get("factor", 1.0)),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
    )


def _gemma3_layers(num_layers: int, layer_types: list[str] | None) -> tuple[bool, ...]:
    if layer_types:
        return tuple(t == "sliding_attention" for t in layer_types)
    return tuple((i + 1) % GEMMA3_PATTERN != 0 for i in range(num_layers))


def _gemma3_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Gemma 3 text (``Gemma3TextConfig``): RoPE bases per layer type, in ``rope_parameters``
    (transformers 5) or ``rope_theta`` / ``rope_local_base_freq`` (4.x)."""
    params = cfg.get("rope_parameters") or {}
    full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    if cfg.get("final_logit_softcapping") or cfg.get("attn_logit_softcapping"):
        raise UnsupportedModel("Gemma checkpoints with logit soft-capping are not supported")
    eos = cfg.get("eos_token_id")
    return ModelConfig(
        family="gemma3",
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        intermediate_size=cfg["intermediate_size"],
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(full.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))),
        rope_scaling=_rope_scaling(full if full.get("rope_type", "default") != "default" else cfg.get("rope_scaling")),
        max_position_embeddings=cfg.get("max_position_embeddings", 32768),
        attention_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=True,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
        pad_token_id=cfg.get("pad_token_id"),
        activation="gelu_tanh",
        sandwich_norms=True,
        scale_embeddings=True,
        norm_offset=float(cfg.get("dualserve_norm_offset", 1.0)),
        sliding_window=cfg.get("sliding_window"),
        sliding_layers=_gemma3_layers(cfg["num_hidden_layers"], cfg.get("layer_types")),
        rope_local_theta=float(local.get("rope_theta", cfg.get("rope_local_base_freq", GEMMA3_LOCAL_ROPE_THETA))),
        attention_scale=float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5,
    )


def _gemma3_from_gguf(meta: dict[str, Any]) -> ModelConfig:
    """llama.cpp's gemma3 keys. Its norms already hold 1 + w (``norm_offset`` 0); the attention scale
    is 1/sqrt(hidden / heads) for the 27B shape and 1/sqrt(head_dim) otherwise, as llama.cpp sets it."""
    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"gemma3.{name}", default)

    hidden, heads, layers = int(key("embedding_length")), int(key("attention.head_count")), int(key("block_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    scaling = RopeScaling()
    if key("rope.scaling.type") == "linear":
        scaling = RopeScaling(kind="linear", factor=float(key("rope.scaling.factor", 1.0)))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        family="gemma3",
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
        sliding_layers=_gemma3_layers(layers, None),
        rope_local_theta=GEMMA3_LOCAL_ROPE_THETA,
        attention_scale=(hidden / heads) ** -0.5 if (hidden, heads) == (5376, 32) else head_dim ** -0.5,
    )


def _llada_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """LLaDA's OLMo-style config (d_model, n_heads, mlp_hidden_size, ...)."""
    hidden = cfg["d_model"]
    heads = cfg["n_heads"]
    return ModelConfig(
        family="llada",
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
        mask_token_id=cfg.get("mask_token_id", 126336),
    )


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies (head_dim // 2,), with llama3-style scaling if configured.

    llama3 scaling (Llama 3.1 report; HF ``_compute_llama3_parameters``): wavelengths
    longer than ``original_max / low_freq_factor`` are divided by ``factor``, shorter
    than ``original_max / high_freq_factor`` are kept, and the band between is
    interpolated smoothly.
    """
    inv_freq = rope_inv_freq_of(config.head_dim, config.rope_theta, config.rope_scaling)
    if config.rope_factors:
        inv_freq = inv_freq / torch.tensor(config.rope_factors, dtype=torch.float32)
    return inv_freq


def rope_inv_freq_of(dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """``rope_inv_freq`` for a head size, base and scaling (Gemma 3's sliding layers have their own base)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if s.kind == "linear":
        inv_freq = inv_freq / s.factor
    elif s.kind == "llama3":
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(in_band, smoothed, scaled)
    return inv_freq.float()
