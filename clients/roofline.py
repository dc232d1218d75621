"""Random models of a real checkpoint's shape, and the roofline of a forward over them.

Shapes: Llama-3.1-8B (the AR and EAGLE target), its EAGLE-3 head (one layer, a
32000-token draft vocabulary, as ``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``),
LLaDA-8B (the diffusion model; MHA, so its KV is 4x Llama's per token), and toy
versions of all three for checking the tools on a CPU.

Models are built on the meta device and materialised with ``to_empty`` on the
target device, then filled there: an 8B model in bf16 never exists as a 16 GB
copy in host memory. Weights are N(0, 1/fan_in), norms are ones: timings do not
depend on the values, and the activations stay finite.

Roofline (Williams et al., CACM 2009): a forward takes at least
max(FLOPs / peak matmul rate, bytes / memory bandwidth).

  FLOPs = 2 x layer weights x new tokens + 2 x output-head weights x logit rows
          + 4 x layers x heads x head_dim x sum(query tokens x keys seen)   (QK^T and PV)
  bytes = (layer weights + output head) x bytes per weight, read once
          + keys and values of every cached and new token, once

The embedding is a gather of a few rows, so it is left out of both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dualserve.models.config import ModelConfig, RopeScaling
from dualserve.models.eagle import Eagle3Head, EagleConfig, eagle3_aux_layers
from dualserve.models.transformer import Transformer

# meta-llama/Llama-3.1-8B-Instruct config.json
LLAMA3_8B = ModelConfig(family="llama", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                        num_kv_heads=8, head_dim=128, intermediate_size=14336, rms_norm_eps=1e-5,
                        rope_theta=500000.0, rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
                        max_position_embeddings=131072)
# GSAI-ML/LLaDA-8B-Instruct config.json
LLADA_8B = ModelConfig(family="llada", vocab_size=126464, hidden_size=4096, num_layers=32, num_heads=32,
                       num_kv_heads=32, head_dim=128, intermediate_size=12288, rms_norm_eps=1e-5,
                       rope_theta=500000.0, mask_token_id=126336)
EAGLE3_DRAFT_VOCAB_8B = 32000
# Eight layers: the fewest for which EAGLE-3's default layers (2, N/2, N-3) are distinct.
TOY_LLAMA = ModelConfig(family="llama", vocab_size=1024, hidden_size=64, num_layers=8, num_heads=4, num_kv_heads=2,
                        head_dim=16, intermediate_size=128)
TOY_LLADA = ModelConfig(family="llada", vocab_size=1024, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
                        head_dim=16, intermediate_size=128, mask_token_id=1000)
TOY_DRAFT_VOCAB = 256


def materialise(module: nn.Module, device: torch.device | str) -> nn.Module:
    """Allocate a meta-built module on ``device`` and fill it there: N(0, 1/fan_in) matrices, unit norms."""
    module = module.to_empty(device=device)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return module.eval().requires_grad_(False)


def on_meta(build, dtype: torch.dtype):
    """``build()`` on the meta device with ``dtype`` as the default (parameters take it)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            return build()
    finally:
        torch.set_default_dtype(default)


def random_model(config: ModelConfig, device: torch.device | str, dtype: torch.dtype) -> Transformer:
    model = materialise(on_meta(lambda: Transformer(config), dtype), device)
    model.rotary.reset(device)
    return model


def eagle3_config(target: ModelConfig, draft_vocab: int) -> EagleConfig:
    """An EAGLE-3 head for ``target``: one layer of the target's geometry, plain RoPE, upstream's aux layers."""
    layer = target.replace(num_layers=1, rope_scaling=RopeScaling(), tie_word_embeddings=False)
    return EagleConfig("eagle3", layer, target.hidden_size, draft_vocab,
                       aux_layers=eagle3_aux_layers({}, target.num_layers))


def random_eagle3_head(target: Transformer, draft_vocab: int) -> Eagle3Head:
    """A random EAGLE-3 head on the target's device, borrowing its embedding like a loaded one."""
    device = target.norm.weight.device
    config = eagle3_config(target.config, draft_vocab)
    head = materialise(on_meta(lambda: Eagle3Head(config), target.norm.weight.dtype), device)
    with torch.no_grad():  # identity vocabulary map: draft id i is target id i
        head.d2t.zero_()
        head.t2d.fill_(True)
    head.rotary.reset(device)
    return head.attach(target)


@dataclass(frozen=True)
class Shape:
    """What a roofline needs of a model: weights per token, output-head weights, attention geometry."""

    layer_params: int     # matmul weights every token meets (all layers)
    out_params: int       # output-head weights (vocab x hidden), met by each logit row
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, model: Transformer | Eagle3Head) -> "Shape":
        """Read off the built modules (meta ones too), so the count is what actually runs."""
        if isinstance(model, Eagle3Head):
            layers, out, c = [model.midlayer], model.lm_head.weight.numel(), model.config.layer
        else:
            c = model.config
            layers, out = list(model.layers), c.vocab_size * c.hidden_size
        params = sum(m.weight.numel() for layer in layers for m in layer.modules() if isinstance(m, nn.Linear))
        return cls(params, out, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim)


@dataclass(frozen=True)
class Work:
    flops: float
    bytes: float

    def __add__(self, other: "Work") -> "Work":
        return Work(self.flops + other.flops, self.bytes + other.bytes)

    def __mul__(self, n: int) -> "Work":
        return Work(self.flops * n, self.bytes * n)


def forward_work(s: Shape, batch: int, query: int, context: int, logit_rows: int, bytes_per: int) -> Work:
    """One forward of ``batch`` sequences, each ``query`` new tokens over ``context`` cached ones,
    with ``logit_rows`` rows per sequence through the output head (see the module docstring)."""
    tokens, keys = batch * query, context + query
    flops = (2 * s.layer_params * tokens + 2 * s.out_params * batch * logit_rows
             + 4 * s.num_layers * s.num_heads * s.head_dim * tokens * keys)
    kv_width = 2 * s.num_layers * s.num_kv_heads * s.head_dim  # key + value elements per token
    weights = (s.layer_params + (s.out_params if logit_rows else 0)) * bytes_per
    return Work(flops, weights + batch * keys * kv_width * bytes_per)


def roofline_ms(work: Work, peak_flops: float, peak_bandwidth: float) -> tuple[float, str]:
    """(least milliseconds, "compute" or "memory": which bound it is)."""
    t_compute, t_memory = work.flops / peak_flops, work.bytes / peak_bandwidth
    return 1e3 * max(t_compute, t_memory), "compute" if t_compute >= t_memory else "memory"
