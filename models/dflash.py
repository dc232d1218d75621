"""DFlash: a block-diffusion drafter conditioned on the target's hidden features.

DFlash (Chen, Liang, Liu, "DFlash: Block Diffusion for Flash Speculative Decoding",
2026; upstream ``z-lab/dflash``, ``dflash/model.py``) drafts a whole block in ONE
forward of a few transformer layers:

* **Context by KV injection.** The target's residual streams at a few layers
  (``target_layer_ids``, the outputs of those layers) are concatenated per
  position and fused, ``c_j = hidden_norm(fc([h^{l_1}_j; ...; h^{l_m}_j]))``. Every
  draft layer turns c_j into its own key and value at position j (its ``k_proj``,
  ``k_norm`` and RoPE, its ``v_proj``). The context never runs through the layers,
  so it costs two projections per layer and position, once.
* **The block.** The last committed token (the anchor, which the target has not
  consumed yet) is followed by ``block_size - 1`` copies of the mask token, all
  embedded with the target's own embedding, at their positions. Each layer is a
  Qwen3 decoder layer (q/k RMS norms) whose queries are the block's, and whose
  keys and values are [the context's; the block's own], attended without a causal
  mask: the block sees the whole context and itself in both directions.
* **Output.** ``norm`` then the target's ``lm_head``: block row i guesses the token
  i positions after the anchor. The target verifies the chain in one forward.

The drafter borrows the target's embedding and output head (never copied). A
checkpoint may add ``d2t`` (as EAGLE-3 heads do): the draft vocabulary is then
the target ids ``arange(len(d2t)) + d2t``, and logits are computed over those rows
of the target's head only, which on a CPU is most of the drafter's cost saved.

Checkpoints: upstream's layout, read as is (``config.json`` with ``dflash_config``
``{block_size, mask_token_id, target_layer_ids}``; ``model.safetensors`` with
``fc``, ``hidden_norm``, ``layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj,
self_attn.{q,k}_norm, post_attention_layernorm, mlp.{gate,up,down}_proj}``,
``norm``). DFlash2's extras (dynamic convolutions, candidate selector) and
sliding-window layers are refused by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import save_file
from torch import nn

from .attention import AttentionBackend
from .checkpoint import rename, to_module_names
from .config import ModelConfig
from .eagle import published_state, read_draft_state
from .families import DFLASH_LAYER, read_layer
from .transformer import RMSNorm, Rotary, SwiGLU, Transformer, apply_rope


@dataclass(frozen=True)
class DFlashConfig:
    layer: ModelConfig                 # the draft layers' geometry; vocab_size is the target's
    target_layer_ids: tuple[int, ...]  # target layers whose outputs are fused (``aux_layers`` convention)
    target_hidden_size: int
    block_size: int                    # anchor + block_size - 1 drafted tokens
    mask_token_id: int
    draft_vocab_size: int              # the target vocabulary unless the checkpoint has ``d2t``

    @property
    def num_layers(self) -> int:
        return self.layer.num_layers

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.target_layer_ids

    @classmethod
    def from_hf(cls, cfg: dict, target: ModelConfig, draft_vocab_size: int | None = None) -> "DFlashConfig":
        extra = cfg.get("dflash_config") or {}

        def value(name: str, default=None):
            return extra.get(name, cfg.get(name, default))

        if "DFlash2DraftModel" in (cfg.get("architectures") or []) or value("selector_rank") is not None:
            raise ValueError("DFlash2 drafters (dynamic convolutions, candidate selector) are not supported")
        if "sliding_attention" in (cfg.get("layer_types") or []):
            raise ValueError("DFlash drafters with sliding-window layers are not supported")
        ids = value("target_layer_ids")
        if not ids:
            raise ValueError("a DFlash config must name dflash_config.target_layer_ids")
        ids = tuple(int(i) for i in ids)
        if any(i < 0 or i >= target.num_layers for i in ids):
            raise ValueError(f"target_layer_ids {list(ids)} outside the target's {target.num_layers} layers")
        mask = value("mask_token_id")
        if mask is None or not 0 <= int(mask) < target.vocab_size:
            raise ValueError(f"DFlash mask_token_id {mask!r} is not a target token id")
        plain = {k: v for k, v in cfg.items() if k not in ("dflash_config", "block_size", "layer_types")}
        layer = read_layer(plain)
        layer = layer.replace(vocab_size=target.vocab_size, tie_word_embeddings=False,
                              attention_bias=bool(cfg.get("attention_bias", False)))
        return cls(layer, ids, int(cfg.get("target_hidden_size") or target.hidden_size), int(value("block_size", 16)),
                   int(mask), draft_vocab_size or target.vocab_size)


class DFlashAttention(nn.Module):
    """Qwen3 attention (RMS-normed q and k per head) whose context keys and values come from features."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(config.hidden_size, sum(self.split), bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (RoPE'd) and values of ``x`` (tokens, hidden): each (tokens, kv_heads, head_dim)."""
        _, k, v = self.qkv_proj(x).split(self.split, dim=-1)  # the one projection, in whatever weight format
        k = apply_rope(self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim)), cos, sin)
        return k, v.view(-1, self.num_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = apply_rope(self.q_norm(q.view(tokens, self.num_heads, self.head_dim)), cos, sin)
        k = apply_rope(self.k_norm(k.view(tokens, self.num_kv_heads, self.head_dim)), cos, sin)
        out = attn(self.layer_idx, q, k, v.view(tokens, self.num_kv_heads, self.head_dim))
        return self.o_proj(out.reshape(tokens, -1))


class DFlashLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """The drafter; ``attach`` lends it the target's embedding and output head."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        h = config.layer.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * config.target_hidden_size, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.layer.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config.layer, i) for i in range(config.num_layers))
        self.norm = RMSNorm(h, config.layer.rms_norm_eps)
        self.rotary = Rotary(config.layer)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.target: tuple[Transformer, ...] = ()  # set by attach(); a tuple keeps it out of our modules
        self.draft_rows: torch.Tensor | None = None  # (draft_vocab, hidden) rows of the target's head
        self.draft_layer: tuple[nn.Module, ...] = ()  # those rows in the target's weight format (serve_in)

    def attach(self, target: Transformer) -> "DFlashDrafter":
        self.target = (target,)
        if self.config.draft_vocab_size != target.config.vocab_size:
            used = torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t
            self.draft_rows = target.lm_head_weight[used.to(target.norm.weight.device)].to(target.norm.weight.dtype)
        return self

    def features(self, final: torch.Tensor, aux: Sequence[torch.Tensor]) -> torch.Tensor:
        """What one target position contributes: c_j (tokens, hidden), the fused context feature."""
        return self.project(torch.cat(list(aux), dim=-1))

    def project(self, raw: torch.Tensor) -> torch.Tensor:
        """c_j from the target's auxiliary layers side by side (tokens, layers * target_hidden)."""
        return self.hidden_norm(self.fc(raw))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each layer's keys and values of context features: (layers, tokens, kv_heads, head_dim) twice."""
        cos, sin = self.rotary(positions, context.dtype)
        kv = [layer.self_attn.key_value(context, cos, sin) for layer in self.layers]
        return torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv])

    def block_ids(self, anchor: int, length: int) -> list[int]:
        return [anchor] + [self.config.mask_token_id] * (length - 1)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """Block tokens (anchor, masks) at their positions -> post-norm hidden (tokens, hidden)."""
        x = self.target[0].embed_tokens(ids).to(self.norm.weight.dtype)
        cos, sin = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, attn)
        return self.norm(x)

    def serve_in(self, fmt: str, bits: int = 8) -> None:
        """Beside a quantized target, the borrowed draft-vocabulary rows become a layer in its format
        (``quant.quantize_linears``, as the drafter's own layers), so drafting does not stream them
        in fp32: 7 rows of 4096 cost 2.8 ms a block that way on a 2-core host. Training keeps the
        float rows."""
        from .quant import quantize_linears
        if self.draft_rows is None or fmt == "none":
            return
        rows = nn.Linear(self.draft_rows.shape[1], self.draft_rows.shape[0], bias=False,
                         device=self.draft_rows.device, dtype=self.draft_rows.dtype)
        rows.weight = nn.Parameter(self.draft_rows, requires_grad=False)
        holder = quantize_linears(nn.ModuleList([rows]), fmt, bits=bits)
        self.draft_layer = (holder[0],)  # a tuple keeps it out of the checkpoint's modules

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(tokens, draft_vocab) in fp32 through the target's head (or its draft-vocabulary rows)."""
        if self.draft_layer:
            return self.draft_layer[0](h).float()
        if self.draft_rows is None:
            return self.target[0].logits(h)
        return nn.functional.linear(h.to(self.draft_rows.dtype), self.draft_rows).float()

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


# ---- checkpoints -----------------------------------------------------------------

NAMES: list[tuple[str, str]] = [
    (r"^(?:model\.)?(fc|hidden_norm|norm)\.weight$", r"\1.weight"),
    (r"^(?:model\.)?layers\.(\d+)\.(.+)$", r"layers.\1.\2"),
    (r"^d2t$", "d2t"),
]


def is_dflash(path: Path | str) -> bool:
    """Whether a draft model's directory holds a DFlash drafter, not an EAGLE head (by its config)."""
    config = Path(path) / "config.json"
    if not config.exists():
        return False
    cfg = json.loads(config.read_text())
    return "dflash_config" in cfg or any("DFlash" in a for a in cfg.get("architectures") or [])


def load_dflash(path: Path | str, target: Transformer, dtype: torch.dtype | None = None,
                device: torch.device | str | None = None) -> DFlashDrafter:
    """Load a DFlash drafter directory (upstream layout) for ``target``."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    raw = read_draft_state(path)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in raw.items():
        new = rename(name, NAMES)
        if new is None:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            raise ValueError(f"unexpected tensor {name!r} in a DFlash drafter")
        state[new] = tensor
    state = to_module_names(state)
    d2t = state.pop("d2t", None)
    config = DFlashConfig.from_hf(cfg, target.config, None if d2t is None else len(d2t))
    if config.layer.hidden_size != target.config.hidden_size:
        raise ValueError(f"drafter hidden size {config.layer.hidden_size} does not match the target's "
                         f"{target.config.hidden_size}: the drafter borrows the target's embedding")
    ref = target.norm.weight
    dtype, device = dtype or ref.dtype, device or ref.device
    with torch.device("meta"):
        drafter = DFlashDrafter(config)
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    state["d2t"] = (d2t if d2t is not None else torch.zeros(config.draft_vocab_size)).long().to(device)
    drafter.load_state_dict(state, strict=True, assign=True)
    drafter.rotary.reset(device)
    return drafter.attach(target).eval().requires_grad_(False)


def dflash_config_dict(config: DFlashConfig, target: ModelConfig) -> dict:
    c = config.layer
    r = c.rope_scaling
    scaling = None if r.kind == "default" else {
        "rope_type": r.kind, "factor": r.factor, "low_freq_factor": r.low_freq_factor,
        "high_freq_factor": r.high_freq_factor, "original_max_position_embeddings": r.original_max_position_embeddings}
    return {
        "rope_scaling": scaling,
        "architectures": ["DFlashDraftModel"], "model_type": DFLASH_LAYER.name, "hidden_act": "silu",
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "num_hidden_layers": c.num_layers, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings, "vocab_size": target.vocab_size,
        "attention_bias": c.attention_bias, "tie_word_embeddings": False, "is_causal": False,
        "num_target_layers": target.num_layers, "target_hidden_size": config.target_hidden_size,
        "dflash_config": {"block_size": config.block_size, "mask_token_id": config.mask_token_id,
                          "target_layer_ids": list(config.target_layer_ids)},
    }


def save_dflash(drafter: DFlashDrafter, target: ModelConfig, path: Path | str, dtype: torch.dtype = torch.float16,
                metadata: dict[str, str] | None = None) -> Path:
    """Write config.json + model.safetensors in upstream's layout (``d2t`` only with a draft vocabulary)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: (v if k == "d2t" else v.to(dtype)).detach().cpu().contiguous()
             for k, v in published_state(drafter).items()}
    if drafter.config.draft_vocab_size == target.vocab_size:
        state.pop("d2t")
    config = dflash_config_dict(drafter.config, target)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt", **(metadata or {})})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path
