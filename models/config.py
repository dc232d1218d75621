"""Model configuration: one frozen dataclass for every decoder-only transformer we serve.

The same shape covers Llama, Mistral, Qwen2 and SmolLM (the AR families) and the
diffusion families built on them (LLaDA, Dream, block diffusion). Family details
that change the math are fields here (q/k/v bias, tied embeddings, rope scaling,
logit shift, mask token); nothing else about a family lives outside this file
and the tensor-name tables in ``loader.py``.

Constructors read Hugging Face ``config.json`` dicts and GGUF metadata, so the
loader never has to know which source a config came from.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

Family = Literal["llama", "qwen2", "qwen3", "mistral", "llada", "dream", "block_diffusion"]

# Fast-dLLM v2 (model_type "Fast_dLLM_Qwen") hard-codes its [MASK] id ("|<MASK>|") in generate;
# its config.json has none.
FAST_DLLM_V2_MASK_ID = 151665

# The families whose checkpoints are diffusion models (the rest are autoregressive).
DIFFUSION_FAMILIES = frozenset({"llada", "dream", "block_diffusion"})


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling; ``kind`` follows HF's ``rope_type``."""

    kind: Literal["default", "linear", "llama3"] = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


class UnsupportedModel(ValueError):
    """A checkpoint of a family or format this build does not load; the message names it and what is
    supported (the CLI prints it as one line)."""


GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")
# config.json model types the core reads; twins and block-diffusion checkpoints carry one of these too.
HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "dream", "llada", "fast_dllm_qwen")


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
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    qk_norm: bool = False               # RMSNorm over each head's queries and keys before RoPE (Qwen3)
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
        elif model_type in ("qwen2", "qwen3", "mistral"):
            family = model_type  # type: ignore[assignment]
        else:
            family = "llama"
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        eos = cfg.get("eos_token_id")
        twin = cfg.get("dualserve_diffusion") or {}
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
        )

    @classmethod
    def from_gguf(cls, meta: dict[str, Any]) -> "ModelConfig":
        """Read GGUF metadata (``general.architecture`` in ``GGUF_ARCHITECTURES``)."""
        arch = meta["general.architecture"]
        if arch not in GGUF_ARCHITECTURES:
            raise UnsupportedModel(f"unsupported GGUF architecture {arch!r}; supported: "
                                   f"{', '.join(GGUF_ARCHITECTURES)}")

        def key(name: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{name}", default)

        hidden = int(key("embedding_length"))
        heads = int(key("attention.head_count"))
        vocab = key("vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
        scaling = RopeScaling()
        if key("rope.scaling.type") == "linear":
            scaling = RopeScaling(kind="linear", factor=float(key("rope.scaling.factor", 1.0)))
        eos = meta.get("tokenizer.ggml.eos_token_id")
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
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    s = config.rope_scaling
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
