"""Model configuration: one frozen dataclass for every network the transformer core builds.

Every field changes the math of a layer (q/k/v bias, q/k norms, tied embeddings, rope scaling,
windows, Gemma's norms, the logit shift and mask token of diffusion models); which family a
checkpoint is, and which reader turns its ``config.json`` or GGUF metadata into these fields, is
the family row's business (``families.py``). The readers here serve every family whose config
follows the common Hugging Face keys; a family with other keys brings its own reader in its own
file (``gemma3.py``, ``llada.py``). What a family's ``config.json`` leaves to convention (Qwen2's
q/k/v biases, say) reaches the reader as the row's ``Layout``, so no reader names a family.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .errors import UnsupportedModel

__all__ = ["Layout", "ModelConfig", "RopeScaling", "UnsupportedModel", "read_gguf", "read_hf", "rope_scaling_of"]


@dataclass(frozen=True)
class Layout:
    """What a family's checkpoint leaves to convention, as the core's readers apply it."""

    attention_bias: bool = False       # q/k/v biases unless config.json says otherwise (Qwen2)
    qk_norm: bool = False              # RMSNorm over each head's queries and keys (Qwen3, SDAR)
    window_everywhere: bool = False    # config.json's sliding_window applies to every layer (Mistral v0.1, Phi-3)
    gguf_window: bool = False          # likewise for the GGUF's attention.sliding_window (Phi-3)
    shift_logits: bool = False         # position i's logits predict token i+1 (Dream, Fast-dLLM v2)
    mask_token_id: int | None = None   # a [MASK] id the code hard-codes and config.json omits


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling; ``kind`` follows HF's ``rope_type``."""

    kind: Literal["default", "linear", "llama3"] = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    family: str                         # its row in ``families.FAMILIES``
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
    # Diffusion models: the [MASK] id, the attention block of block-causal ones (block diffusion)
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
        """A core network is a diffusion model when it has a [MASK] token to denoise."""
        return self.mask_token_id is not None

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


# ---- readers -------------------------------------------------------------------------------

# Keys by which a config.json of an AR family declares block diffusion (a twin, or a converted
# block-diffusion checkpoint): read then as the block-diffusion family over the AR layout.
BLOCK_DIFFUSION_KEYS = ("dualserve_diffusion", "bd_size", "block_size")


def hf_common(cfg: dict[str, Any]) -> dict[str, Any]:
    """The ``ModelConfig`` fields every Hugging Face ``config.json`` names alike: the shape, the
    norm's epsilon and the special tokens (a family's own reader adds the rest)."""
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    eos = cfg.get("eos_token_id")
    return dict(
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        intermediate_size=cfg["intermediate_size"],
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
        pad_token_id=cfg.get("pad_token_id"),
    )


def read_hf(cfg: dict[str, Any], family: str, layout: Layout) -> ModelConfig:
    """Read a Hugging Face ``config.json`` in the common keys (``LlamaConfig`` and its kin)."""
    model_type = cfg.get("model_type", family)
    twin = cfg.get("dualserve_diffusion") or {}
    rope = cfg.get("rope_parameters") or {}
    if float(cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))) != 1.0:
        raise UnsupportedModel(f"{model_type} checkpoints that rotate part of each head are not supported")
    window = cfg.get("sliding_window") if layout.window_everywhere else None
    return ModelConfig(
        family=family,
        **hf_common(cfg),
        rope_theta=cfg.get("rope_theta", rope.get("rope_theta", 10000.0)),
        rope_scaling=rope_scaling_of(cfg.get("rope_scaling") or cfg.get("rope_parameters")),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        attention_bias=bool(cfg.get("attention_bias", layout.attention_bias)),
        qk_norm=layout.qk_norm,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        mask_token_id=cfg.get("mask_token_id", twin.get("mask_token_id", layout.mask_token_id)),
        diffusion_block_size=twin.get("block_size") or cfg.get("bd_size") or cfg.get("block_size"),
        shift_logits=bool(twin.get("shift_logits", layout.shift_logits)),
        diffusion_threshold=twin.get("threshold"),
        sliding_window=window,
        sliding_layers=(True,) * cfg["num_hidden_layers"] if window else (),
        rope_factors=tuple(cfg.get("dualserve_rope_factors") or ()),
    )


def read_gguf(meta: dict[str, Any], family: str, layout: Layout) -> ModelConfig:
    """Read GGUF metadata in llama.cpp's common keys (``<general.architecture>.<key>``)."""
    arch = meta["general.architecture"]

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    vocab = key("vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    scaling = RopeScaling()
    if key("rope.scaling.type") == "linear":
        scaling = RopeScaling(kind="linear", factor=float(key("rope.scaling.factor", 1.0)))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    window = key("attention.sliding_window") if layout.gguf_window else None
    if key("rope.dimension_count") not in (None, int(key("attention.key_length", hidden // heads))):
        raise UnsupportedModel(f"{arch} files that rotate part of each head are not supported")
    return ModelConfig(
        family=family,
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
        attention_bias=layout.attention_bias,
        qk_norm=layout.qk_norm,
        tie_word_embeddings=False,  # the loader sets this when output.weight is absent
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        sliding_window=int(window) if window else None,
        sliding_layers=(True,) * int(key("block_count")) if window else (),
    )


def rope_scaling_of(raw: dict[str, Any] | None) -> RopeScaling:
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
