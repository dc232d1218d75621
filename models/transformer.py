"""One decoder-only transformer core: Llama, Mistral, Qwen2, Qwen3, Gemma 3, SmolLM, LLaDA, Dream.

Reads top to bottom like the Llama paper (Touvron et al., 2023, section 2.2):
pre-normalisation with RMSNorm, rotary position embeddings (RoPE, with llama3
frequency scaling), grouped-query attention, and a SwiGLU feed-forward block.
Qwen2 adds q/k/v biases; Qwen3 normalises each head's queries and keys (RMSNorm over
the head dimension) before the rotary embedding; small models tie the output head
to the embedding. Gemma 3 (Gemma Team, 2025) changes four things, each a config field:
a GELU-gated feed-forward, RMSNorm after attention and the feed-forward as well as before
(``SandwichLayer``), an embedding scaled by sqrt(hidden), and five local layers (a sliding
window, their own RoPE base) for every global one. Which keys a sliding layer sees is the
attention backend's business (``config.windows``); the model picks each layer's rotation.

What a token may attend to is not decided here. ``forward`` takes an explicit
``AttentionBackend`` (see ``attention.py``): causal for AR decoding, bidirectional
for masked diffusion, block-causal for block diffusion, a tree mask for EAGLE
verification. The same weights serve all of them.

The linear layers are ``nn.Linear`` as built; a quantized model swaps them
(and the output head and embedding) for the int8/int4 modules of ``quant.py``
at load, so this file never mentions a weight format.

Two projections are fused for fewer kernel launches at batch 1, which is where
Python dispatch, not arithmetic, dominates: q/k/v into one ``qkv_proj`` and
gate/up into one ``gate_up_proj``. The loader concatenates the checkpoint's
separate tensors (see ``loader.FUSED``).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .kernels import ops as kernel_ops
from .attention import AttentionBackend
from .config import ModelConfig, RopeScaling, rope_inv_freq, rope_inv_freq_of
from .quant import linear_weight


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * w, computed in fp32 as the reference does.

    On the CPU in fp32 the norms, the SwiGLU product and the rotary angles run as the project's
    ops (``kernels.pointwise``): their sums and transcendental functions then round the same way
    in an eager step and in every compiled graph, so greedy output does not depend on which ran."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))  # Gemma's 1 + w is added at load (``config.norm_offset``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.pointwise(x) and self.weight.dtype == torch.float32:
            return kernel_ops.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """RoPE in the rotate-half layout (HF convention; GGUF q/k are un-permuted at load).
    ``local``: the frequencies of Gemma 3's sliding layers (their own base, no scaling)."""

    def __init__(self, config: ModelConfig, local: bool = False):
        super().__init__()
        self.config = config
        self.local = local
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        if self.local:
            return rope_inv_freq_of(self.config.head_dim, self.config.rope_local_theta, RopeScaling())
        return rope_inv_freq(self.config)

    def reset(self, device: torch.device | str) -> None:
        """Recompute the frequencies on a real device (the model is built on meta)."""
        self.inv_freq = self._inv_freq().to(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if dtype == torch.float32 and kernels.pointwise(self.inv_freq):
            cos, sin = kernel_ops.rotary(positions, self.inv_freq)  # (tokens, head_dim)
            return cos[:, None, :], sin[:, None, :]
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (tokens, head_dim / 2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # (tokens, 1, head_dim)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, input_size: int | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.split = (q_size, kv_size, kv_size)
        # EAGLE-3's draft layer attends over [embedding; feature], hence input_size.
        self.qkv_proj = nn.Linear(input_size or config.hidden_size, sum(self.split), bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        # The backends scale by head_dim ** -0.5; a model with another scale (Gemma 3 27B) pre-scales q.
        scale = config.attention_scale
        self.q_scale = None if scale is None or scale == config.head_dim ** -0.5 else scale * config.head_dim ** 0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionBackend) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        if self.q_scale is not None:
            q = q * self.q_scale
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        out = attn(self.layer_idx, q, k, v)  # (tokens, heads, head_dim)
        return self.o_proj(out.reshape(tokens, -1))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) (Shazeer, 2020)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if kernels.pointwise(gate_up):
            return self.down_proj(kernel_ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class GeGLU(SwiGLU):
    """down(gelu_tanh(gate(x)) * up(x)): the gated feed-forward with GELU's tanh form (Gemma)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


def feed_forward(config: ModelConfig) -> SwiGLU:
    return (GeGLU if config.activation == "gelu_tanh" else SwiGLU)(config.hidden_size, config.intermediate_size)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, input_norm: bool = True):
        super().__init__()
        # EAGLE-1/2 heads drop the first input norm (their input is already a fused feature).
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps) if input_norm else nn.Identity()
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = feed_forward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionBackend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class SandwichLayer(nn.Module):
    """Gemma 3's layer: each block's output is normed before it joins the residual stream
    (HF names: post_attention_layernorm follows attention; pre_feedforward_layernorm leads the MLP)."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(dim, eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps)
        self.mlp = feed_forward(config)
        self.post_feedforward_layernorm = RMSNorm(dim, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionBackend) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, attn))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        layer = SandwichLayer if config.sandwich_norms else DecoderLayer
        self.layers = nn.ModuleList(layer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config)
        self.rotary_local = Rotary(config, local=True) if config.rope_local_theta is not None else None
        self.local_layers = frozenset(i for i, w in enumerate(config.windows) if w is not None)
        # The output head: None when tied to the embedding and not quantized separately
        # (``quant.py`` gives a quantized model its own head even when the checkpoint ties it).
        self.lm_head: nn.Module | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The (vocab, hidden) output matrix in float (dequantized for a quantized head)."""
        if self.lm_head is None:
            return self.embed_tokens.weight
        return linear_weight(self.lm_head)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, attn: AttentionBackend,
                inputs_embeds: torch.Tensor | None = None,
                aux_layers: Sequence[int] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run the stack over a flattened batch of tokens.

        input_ids, positions: (tokens,). Returns the final-normed hidden states
        (tokens, hidden) and, for each index in ``aux_layers``, the residual stream
        after that layer (EAGLE-3 draws its features from three of them).
        """
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.rotary(positions, x.dtype)
        local = rope if self.rotary_local is None else self.rotary_local(positions, x.dtype)
        aux: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            x = layer(x, *(local if i in self.local_layers else rope), attn)
            if i in aux_layers:
                aux.append(x)
        return self.norm(x), aux

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings, times sqrt(hidden) where the family scales them (Gemma: in fp32, as
        transformers' scaled embedding and llama.cpp do)."""
        x = self.embed_tokens(input_ids)
        if self.config.scale_embeddings:
            x = x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(tokens, hidden) -> (tokens, vocab) in fp32."""
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()
