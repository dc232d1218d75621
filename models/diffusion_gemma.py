"""DiffusionGemma: one Gemma-4 MoE text stack used twice, as encoder and as denoiser.

DiffusionGemma (transformers ``models/diffusion_gemma``, checkpoint ``google/diffusiongemma-26B-A4B-it``)
is uniform-noise block diffusion. An autoregressive **encoder** writes the KV of the prefix; a
**denoiser** with the *same weights* refines a canvas of ``canvas_length`` tokens (uniformly random
at first: there is no mask token), attending to the cached prefix and to the whole canvas, and
never writes the cache. A final canvas is encoded at the same positions, then the next starts.
The sampler is ``dualserve.decoders.diffusion.gemma``; this file is the network and its loader.

The layer (Gemma 4, ``Gemma4TextDecoderLayer``) differs from the Llama core in ``transformer.py``:
  * sandwich norms: RMSNorm before *and after* attention and the feed-forward, ``w`` not ``1 + w``;
  * a dense GELU-tanh MLP and a routed mixture of experts side by side, both reading the residual;
  * attention with RMS-normed queries, keys and values (values without a scale), scaling 1.0 and
    no softcap; "full" layers have their own head size and kv heads, no ``v_proj`` (values are the
    raw keys) and "proportional" RoPE that rotates only a quarter of the dimensions;
  * a per-layer ``layer_scalar``, the only thing the checkpoint stores for both stacks;
  * an input embedding scaled by sqrt(hidden), and the LM head tied to it with a tanh softcap of 30.
The RoPE rotation is the Llama one (``transformer.apply_rope``). Every op follows the reference's
order and kernels (fp32 norms with ``pow(-0.5)``, fp32 router softmax, ``grouped_mm`` experts,
transformers' SDPA dispatch), so the logits are bit-identical to it.

What a token may see is the attention backend's business (the encoder: causal, within W on sliding
layers; the denoiser: the cached prefix, its last W-1 tokens on sliding layers, and the whole canvas).
The config gives each layer's KV shape and window; ``attend`` is the kernel the backends run.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionBackend
from .checkpoint import LoadedModel, iter_safetensors
from .tokenizer import Tokenizer
from .transformer import apply_rope

LayerType = Literal["sliding_attention", "full_attention"]
Stack = Literal["encoder", "denoiser"]


# ---- configuration -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rope:
    """One layer type's RoPE (``rope_parameters[layer_type]``): ``default`` or ``proportional``."""

    kind: Literal["default", "proportional"] = "default"
    theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    factor: float = 1.0

    @classmethod
    def from_hf(cls, raw: dict[str, Any] | None, default: "Rope") -> "Rope":
        if not raw:
            return default
        return cls(raw.get("rope_type", "default"), float(raw.get("rope_theta", 10000.0)),
                   float(raw.get("partial_rotary_factor", 1.0)), float(raw.get("factor", 1.0)))

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """(head_dim // 2,) in fp32, as ``modeling_rope_utils`` computes it.

        Proportional RoPE (Gemma 4) rotates the first ``int(p * head_dim // 2)`` pairs with the
        exponent denominator still ``head_dim``, and leaves the other pairs unrotated (frequency 0).
        """
        if self.kind == "default":
            dim = int(head_dim * self.partial_rotary_factor)
            return 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        angles = int(self.partial_rotary_factor * head_dim // 2)
        rotated = 1.0 / (self.theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim))
        return torch.cat([rotated, torch.zeros(head_dim // 2 - angles)]) / self.factor


@dataclass(frozen=True)
class DenoisingConfig:
    """The sampler's knobs from ``generation_config.json``; unset ones take transformers' global
    defaults (``DiffusionGemmaGenerationConfig._get_default_generation_params``). Early stopping is
    on only when both thresholds are set."""

    max_denoising_steps: int = 48
    entropy_bound: float = 0.1
    t_min: float = 0.4
    t_max: float = 0.8
    stability_threshold: int | None = 1
    confidence_threshold: float | None = 0.005

    @classmethod
    def from_hf(cls, gen: dict[str, Any]) -> "DenoisingConfig":
        base, sampler = cls(), gen.get("sampler_config") or {}
        given = {k: v for k, v in gen.items() if v is not None}  # null is unset
        return cls(
            max_denoising_steps=int(given.get("max_denoising_steps", base.max_denoising_steps)),
            entropy_bound=float(sampler.get("entropy_bound", base.entropy_bound)),
            t_min=float(given.get("t_min", base.t_min)), t_max=float(given.get("t_max", base.t_max)),
            stability_threshold=given.get("stability_threshold", base.stability_threshold),
            confidence_threshold=given.get("confidence_threshold", base.confidence_threshold))


@dataclass(frozen=True)
class DiffusionGemmaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    layer_types: tuple[LayerType, ...]
    head_dims: tuple[int, ...]          # per layer: head_dim, or per_layer_config's for full layers
    kv_heads: tuple[int, ...]           # per layer, likewise
    sliding_window: int
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    canvas_length: int
    rope_sliding: Rope = Rope()
    rope_full: Rope = Rope("proportional", 1e6, 0.25)
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float = 30.0  # a class attribute upstream: never in config.json
    max_position_embeddings: int = 131072
    bos_token_id: int | None = 2
    eos_token_ids: tuple[int, ...] = (1,)
    pad_token_id: int | None = 0
    denoising: DenoisingConfig = field(default_factory=DenoisingConfig)
    family: ClassVar[str] = "diffusion_gemma"
    is_diffusion: ClassVar[bool] = True

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def rope(self, layer_type: LayerType) -> Rope:
        return self.rope_sliding if layer_type == "sliding_attention" else self.rope_full

    @property
    def kv_shapes(self) -> tuple[tuple[int, int], ...]:
        """Per layer (kv_heads, head_dim): the shape of its keys and values."""
        return tuple(zip(self.kv_heads, self.head_dims))

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Per layer: the sliding window W, or None for a full layer."""
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in self.layer_types)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], generation: dict[str, Any] | None = None) -> "DiffusionGemmaConfig":
        """Read ``config.json`` (+ ``generation_config.json``), following ``DiffusionGemmaTextConfig``."""
        text = cfg["text_config"]
        if text.get("use_bidirectional_attention") == "all":
            raise ValueError("DiffusionGemma with a bidirectional encoder is not supported")
        if not cfg.get("tie_word_embeddings", True) or not text.get("tie_word_embeddings", True):
            raise ValueError("DiffusionGemma with untied encoder/denoiser weights is not supported")
        layers = text.get("num_hidden_layers", 30)
        types = list(text.get("layer_types") or [
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)])
        types[-1] = "full_attention"  # __post_init__ forces it
        head_dim, kv = text.get("head_dim", 256), text.get("num_key_value_heads", 4)
        per_layer = text.get("per_layer_config")
        if per_layer is None:  # not serialized yet: __post_init__'s global_head_dim rule
            full = {"head_dim": text.get("global_head_dim", 512)}
            if text.get("num_global_key_value_heads") is not None:
                full["num_key_value_heads"] = text["num_global_key_value_heads"]
            per_layer = {str(i): full for i, t in enumerate(types) if t == "full_attention"}
        override = [per_layer.get(str(i), {}) for i in range(len(types))]
        rope = text.get("rope_parameters") or {}
        gen = generation or {}
        eos = gen.get("eos_token_id", text.get("eos_token_id", 1))
        return cls(
            vocab_size=text.get("vocab_size", 262144), hidden_size=text.get("hidden_size", 2304),
            intermediate_size=text.get("intermediate_size", 9216),
            num_heads=text.get("num_attention_heads", 8), layer_types=tuple(types),
            head_dims=tuple(o.get("head_dim", head_dim) for o in override),
            kv_heads=tuple(o.get("num_key_value_heads", kv) for o in override),
            sliding_window=text.get("sliding_window", 512), num_experts=text["num_experts"],
            top_k_experts=text["top_k_experts"], moe_intermediate_size=text["moe_intermediate_size"],
            canvas_length=cfg.get("canvas_length", 256),
            rope_sliding=Rope.from_hf(rope.get("sliding_attention"), Rope()),
            rope_full=Rope.from_hf(rope.get("full_attention"), Rope("proportional", 1e6, 0.25)),
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            final_logit_softcapping=float(text.get("final_logit_softcapping") or 30.0),
            max_position_embeddings=text.get("max_position_embeddings", 131072),
            bos_token_id=gen.get("bos_token_id", text.get("bos_token_id")),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
            pad_token_id=gen.get("pad_token_id", text.get("pad_token_id")),
            denoising=DenoisingConfig.from_hf(gen))


# ---- layers --------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """x * (mean(x^2) + eps)^-0.5 [* w] in fp32 (``DiffusionGemmaRMSNorm``: plain w, pow not rsqrt)."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            h = h * self.weight.float()
        return h.type_as(x)


def gelu_mlp(x: torch.Tensor, gate: nn.Linear, up: nn.Linear, down: nn.Linear) -> torch.Tensor:
    """down(gelu_tanh(gate(x)) * up(x)): the dense MLP and the self-conditioning block."""
    return down(F.gelu(gate(x), approximate="tanh") * up(x))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_mlp(x, self.gate_proj, self.up_proj, self.down_proj)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
           causal: bool = False) -> torch.Tensor:
    """SDPA with scaling 1.0 (queries and keys are RMS-normed) and grouped-query attention.

    q: (q_len, heads, d); k, v: (kv_len, kv_heads, d); mask: (q_len, kv_len) bool. Dispatches as
    transformers' ``sdpa_attention_forward`` does (``enable_gqa`` only without a mask and for head
    sizes up to 256, repeated kv heads otherwise), so the kernels, and the rounding, are the same.
    """
    q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, k, v))  # (1, heads, len, d)
    gqa = q.shape[1] != k.shape[1]
    if gqa and (mask is not None or k.shape[-1] > 256):
        # transformers' repeat_kv: expand + reshape (a stride-0 view when there is one kv head).
        n = q.shape[1] // k.shape[1]
        k4, v4 = (t[:, :, None].expand(1, t.shape[1], n, *t.shape[2:]).reshape(1, -1, *t.shape[2:])
                  for t in (k4, v4))
        gqa = False
    out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, is_causal=causal, scale=1.0, enable_gqa=gqa)
    return out[0].transpose(0, 1)


class Attention(nn.Module):
    def __init__(self, config: DiffusionGemmaConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.kv_heads = config.num_heads, config.kv_heads[layer_idx]
        self.head_dim = config.head_dims[layer_idx]
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        # Full layers share one projection for keys and values ("attention_k_eq_v").
        sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False) if sliding else None
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.k_norm = RMSNorm(self.head_dim, eps)
        self.v_norm = RMSNorm(self.head_dim, eps, with_scale=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        tokens = x.shape[0]
        q = apply_rope(self.q_norm(self.q_proj(x).view(tokens, self.num_heads, self.head_dim)), cos, sin)
        k = self.k_proj(x).view(tokens, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.kv_heads, self.head_dim) if self.v_proj is not None else k
        k = apply_rope(self.k_norm(k), cos, sin)
        out = attn(self.layer_idx, q, k, self.v_norm(v))  # (tokens, heads, head_dim)
        return self.o_proj(out.reshape(tokens, -1))


class Router(nn.Module):
    """Top-k expert choice on the residual (``DiffusionGemmaTextRouter``)."""

    def __init__(self, config: DiffusionGemmaConfig):
        super().__init__()
        self.top_k = config.top_k_experts
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(config.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(config.num_experts))

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h: (tokens, hidden) -> weights (tokens, k) fp32, expert ids (tokens, k)."""
        z = self.norm(h) * self.scale * h.shape[-1] ** -0.5
        probs = F.softmax(self.proj(z), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` sorted by expert times each expert's (out, in) weight: (rows, out).

    ``ends`` (experts,) int32: cumulative row counts. One ``grouped_mm`` kernel where torch has one
    for the device (transformers' default experts path, hence the same rounding), else a loop.
    """
    if hasattr(F, "grouped_mm") and (x.device.type == "cpu" or (
            x.device.type == "cuda" and weight.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (8, 0))):
        return F.grouped_mm(x.to(weight.dtype), weight.transpose(-2, -1), offs=ends)
    sizes = torch.diff(ends, prepend=ends.new_zeros(1)).tolist()  # rows per expert
    return torch.cat([rows.to(weight.dtype) @ weight[e].T for e, rows in enumerate(x.split(sizes))])


class Experts(nn.Module):
    """Gated GELU experts stored as 3-D tensors (``DiffusionGemmaTextExperts``)."""

    def __init__(self, config: DiffusionGemmaConfig):
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))  # rows [0:i] gate, [i:2i] up
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: (tokens, hidden); weights, ids: (tokens, k). Each token's k outputs are summed in
        top-k order, as transformers' ``grouped_mm_experts_forward`` does."""
        tokens, k = ids.shape
        expert_of, order = torch.sort(ids.reshape(-1))             # (tokens * k,) pairs grouped by expert
        ends = torch.cumsum(torch.bincount(expert_of, minlength=self.num_experts), 0, dtype=torch.int32)
        gate, up = grouped_linear(x[order // k], self.gate_up_proj, ends).chunk(2, dim=-1)
        y = self.down(F.gelu(gate, approximate="tanh") * up, ends)
        y = y * weights.reshape(-1)[order, None]
        out = torch.empty_like(y)
        out[order] = y                                              # back to (token, slot) order
        return out.view(tokens, k, -1).sum(1).to(x.dtype)

    def down(self, act: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """The experts' down projection of rows grouped by expert (tensor parallelism replaces it)."""
        return grouped_linear(act, self.down_proj, ends)


class Layer(nn.Module):
    def __init__(self, config: DiffusionGemmaConfig, layer_idx: int):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(h, config.intermediate_size)
        self.post_feedforward_layernorm_1 = RMSNorm(h, eps)
        self.router = Router(config)
        self.pre_feedforward_layernorm_2 = RMSNorm(h, eps)
        self.experts = Experts(config)
        self.post_feedforward_layernorm_2 = RMSNorm(h, eps)
        self.post_feedforward_layernorm = RMSNorm(h, eps)
        # Buffers are not tied upstream, so each stack has its own (the file stores both).
        self.register_buffer("layer_scalar", torch.ones(1))
        self.register_buffer("encoder_layer_scalar", torch.ones(1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend,
                stack: Stack) -> torch.Tensor:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, attn))
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(h)))
        weights, ids = self.router(h)  # routes on the raw residual
        routed = self.post_feedforward_layernorm_2(self.experts(self.pre_feedforward_layernorm_2(h), weights, ids))
        out = h + self.post_feedforward_layernorm(dense + routed)
        return out * (self.layer_scalar if stack == "denoiser" else self.encoder_layer_scalar)


class SelfConditioning(nn.Module):
    """Adds a gated MLP of the previous step's soft embeddings to the canvas embeddings, then an
    unscaled RMSNorm (``DiffusionGemmaSelfConditioning``)."""

    def __init__(self, config: DiffusionGemmaConfig):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.pre_norm = RMSNorm(h, eps)
        self.post_norm = RMSNorm(h, eps, with_scale=False)
        self.gate_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, h, bias=False)

    def forward(self, embeds: torch.Tensor, soft: torch.Tensor) -> torch.Tensor:
        return self.post_norm(embeds + gelu_mlp(self.pre_norm(soft), self.gate_proj, self.up_proj, self.down_proj))


# ---- the model -----------------------------------------------------------------------------------

class DiffusionGemma(nn.Module):
    attention_kernel: ClassVar = staticmethod(attend)  # the engine runs this network's own attention

    def __init__(self, config: DiffusionGemmaConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Layer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_conditioning = SelfConditioning(config)
        # RoPE frequencies by (layer type, head dim, device), made on first use: the model is built on meta.
        self._inv_freq: dict[tuple[str, int, str], torch.Tensor] = {}

    def inv_freq(self, layer_idx: int, device: torch.device) -> torch.Tensor:
        key = (self.config.layer_types[layer_idx], self.config.head_dims[layer_idx], str(device))
        if key not in self._inv_freq:
            self._inv_freq[key] = self.config.rope(key[0]).inv_freq(key[1]).to(device)
        return self._inv_freq[key]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        # sqrt(hidden) is rounded to the weight dtype first, as upstream does (55.4256 -> 55.5 in bf16).
        scale = torch.tensor(self.config.hidden_size ** 0.5).to(self.embed_tokens.weight.dtype)
        return self.embed_tokens(ids) * scale

    def _stack(self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend, stack: Stack) -> torch.Tensor:
        rope: dict[LayerType, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, layer in enumerate(self.layers):
            kind = self.config.layer_types[i]
            if kind not in rope:
                freqs = positions.float()[:, None] * self.inv_freq(i, x.device)[None, :]  # (tokens, head_dim / 2)
                emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]                      # (tokens, 1, head_dim)
                rope[kind] = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
            x = layer(x, *rope[kind], attn, stack)
        return x

    def encode(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> None:
        """Run the encoder over (tokens,) ids; its output is the KV the backend stores."""
        self._stack(self.embed(input_ids), positions, attn, "encoder")

    def denoise(self, canvas_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                self_conditioning_logits: torch.Tensor | None = None,
                self_conditioning_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Denoiser logits (tokens, vocab), fp32 and softcapped, for flattened canvases.

        ``self_conditioning_logits`` (tokens, vocab): the previous step's temperature-scaled logits;
        None on a first step. ``self_conditioning_rows`` (tokens,) bool marks the rows that have
        them when a batch mixes first and later steps (the others get a zero signal, exactly as a
        first step does upstream).
        """
        embeds = self.embed(canvas_ids)
        weight = self.embed_tokens.weight
        if self_conditioning_logits is None:
            soft = torch.zeros_like(embeds)
        else:
            scale = torch.tensor(self.config.hidden_size ** 0.5).to(weight.dtype).to(embeds.dtype)
            # The reference loop hands the logits over in the embedding dtype, then softmaxes in fp32.
            probs = self_conditioning_logits.to(weight.dtype).softmax(dim=-1, dtype=torch.float32).to(weight.dtype)
            soft = torch.matmul(probs, weight) * scale
            if self_conditioning_rows is not None:
                soft = soft * self_conditioning_rows.to(soft.dtype)[:, None]
        x = self._stack(self.self_conditioning(embeds, soft), positions, attn, "denoiser")
        return self.logits(self.norm(x))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Tied head with Gemma's final softcap: cap * tanh(logits / cap), in fp32."""
        cap = self.config.final_logit_softcapping
        return torch.tanh(F.linear(hidden, self.embed_tokens.weight).float() / cap) * cap


# ---- checkpoint names and the loader -------------------------------------------------------------

# Checkpoint name -> our parameter name (None: not ours to load). The file keeps the denoiser
# ("model.decoder.*") copies of the tied weights; encoder names are accepted too, for files saved
# with the other side of the ties. Only layer_scalar buffers exist once per stack.
_STACK = r"model\.(?:decoder|encoder\.language_model)\."
DIFFUSION_GEMMA_NAMES: list[tuple[str, str | None]] = [
    (r"^model\.encoder\.language_model\.layers\.(\d+)\.layer_scalar$", r"layers.\1.encoder_layer_scalar"),
    (rf"^{_STACK}(embed_tokens|norm)\.weight$", r"\1.weight"),
    (rf"^{_STACK}layers\.(\d+)\.(.+)$", r"layers.\1.\2"),
    (r"^model\.decoder\.self_conditioning\.(.+)$", r"self_conditioning.\1"),
    (r"^lm_head\.weight$", None),                                   # tied to embed_tokens
    (r"^model\.encoder\.(vision_tower|embed_vision)\.", None),      # images: text only here
]


def read_state(path: Path) -> dict[str, torch.Tensor]:
    """Tensors under our names; a tied weight stored twice must hold the same values."""
    state: dict[str, torch.Tensor] = {}
    for name, tensor in iter_safetensors(path):
        rule = next(((p, r) for p, r in DIFFUSION_GEMMA_NAMES if re.search(p, name)), None)
        if rule is None:
            raise ValueError(f"unexpected tensor {name!r} in {path}")
        if rule[1] is None:
            continue
        ours = re.sub(rule[0], rule[1], name)
        if ours in state and not torch.equal(state[ours], tensor):
            raise ValueError(f"encoder and denoiser copies of {ours!r} differ (untied weights)")
        state[ours] = tensor
    for key in [k for k in state if k.endswith(".layer_scalar")]:
        state.setdefault(key.replace(".layer_scalar", ".encoder_layer_scalar"), state[key])
    return state


def load_diffusion_gemma(path: Path | str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                         *, name: str | None = None, tokenizer: Tokenizer | None = None) -> LoadedModel:
    """Load a ``DiffusionGemmaForBlockDiffusion`` directory (safetensors only) for text: built on
    meta, then the tensors assigned (strict: a missing or extra one is an error)."""
    start = time.perf_counter()
    path = Path(path)
    read = lambda file: json.loads(file.read_text()) if file.is_file() else {}  # noqa: E731
    config = DiffusionGemmaConfig.from_hf(read(path / "config.json"), read(path / "generation_config.json"))
    with torch.device("meta"):
        model = DiffusionGemma(config)
    state = {k: v.to(device=device, dtype=dtype) for k, v in read_state(path).items()}
    model.load_state_dict(state, strict=True, assign=True)
    return LoadedModel(name=name or path.name, path=path, config=config,
                       model=model.eval().requires_grad_(False), tokenizer=tokenizer or Tokenizer.from_hf_dir(path),
                       load_seconds=time.perf_counter() - start)
