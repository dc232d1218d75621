"""EAGLE draft heads: the EAGLE-1/2 head and the EAGLE-3 head, and their loader.

A draft head is a one-layer transformer that runs beside a target model and
guesses the target's next tokens from the target's own hidden features
(Li et al., "EAGLE", ICML 2024, section 4; "EAGLE-3", 2025, section 3).

* EAGLE-1/2 (``Eagle1Head``): ``fc`` fuses ``[embedding(t_{j+1}); f_j]`` where
  f_j is the target's final, post-norm hidden state at position j; one decoder
  layer of the target's own class follows, with its first input norm dropped
  (upstream ``cnets1.py``: ``if self.index != 0``). Its output is the guess of
  f_{j+1}; draft logits are the *target's* lm_head applied to it, with no norm.
  EAGLE-2 uses the same head and only changes how the draft tree is grown.
* EAGLE-3 (``Eagle3Head``): ``fc`` maps three target residual streams (low,
  middle, high layer; 3H -> H) to the hidden input; the ``midlayer`` attends over
  ``[input_layernorm(embedding); hidden_norm(h)]`` (2H wide) with the un-normed h
  as residual; the head has its own ``norm`` and an ``lm_head`` over a reduced
  draft vocabulary whose ids map to target ids through ``d2t``
  (``target = draft + d2t[draft]``; ``t2d`` marks the target ids kept).

Both heads borrow the target's embedding (and, for EAGLE-1, its lm_head) by
reference: the tensors are shared, never copied or registered as parameters.
Both expose one interface to the decoder and the trainer:
  ``features(final, aux)`` -> what one target position contributes (tokens, H);
  ``forward(ids, hidden, positions, attn)`` -> the head's output h (tokens, H),
  which is also the next ``hidden`` when drafting deeper;
  ``logits(h)`` -> draft logits (tokens, draft_vocab) in fp32;
  ``to_target(draft_ids)`` -> target token ids.

Loading follows ``loader.py``: config.json, then ``model.safetensors`` or a
``weights_only`` ``pytorch_model.bin``, names renamed through ``HEAD_NAMES`` and
fused through ``loader.FUSED``, built on meta and assigned. Checkpoint format
details: SafeAILab/EAGLE ``eagle/model/cnets1.py``, ``cnets.py``, ``ea_model.py``; vLLM
speculators' ``*-speculator.eagle3`` configs are flattened first (``speculators.py``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .attention import AttentionBackend
from .config import ModelConfig
from .families import PLAIN, read_layer
from .speculators import flatten_speculators_config, is_speculators
from .checkpoint import FUSED, rename, to_module_names
from .transformer import Attention, DecoderLayer, RMSNorm, Rotary, SwiGLU, Transformer

HeadKind = Literal["eagle1", "eagle3"]


@dataclass(frozen=True)
class EagleConfig:
    kind: HeadKind
    layer: ModelConfig              # geometry of the draft layer(s); vocab_size is the target's
    target_hidden_size: int
    draft_vocab_size: int           # EAGLE-1: the target vocabulary
    fc_bias: bool = False
    # EAGLE-3: indices i of the target layers whose *output* is fused (our
    # ``Transformer.forward(aux_layers=...)`` convention), ascending.
    aux_layers: tuple[int, ...] = ()
    # EAGLE-3: the midlayer's residual is hidden_norm(h) instead of h (speculators' option).
    norm_before_residual: bool = False

    @property
    def num_layers(self) -> int:
        return self.layer.num_layers

    @classmethod
    def from_hf(cls, cfg: dict, kind: HeadKind, target: ModelConfig, fc_bias: bool | None = None) -> "EagleConfig":
        """Read a head's config.json; fields absent from published heads get upstream's defaults."""
        cfg = dict(cfg)
        cfg.setdefault("rope_theta", 10000.0)  # upstream EConfig: base 10000 when absent
        if isinstance(cfg.get("rope_scaling"), dict) and cfg["rope_scaling"].get("rope_type") == "llama3":
            cfg["rope_scaling"] = None  # heads use plain RoPE (upstream EConfig rejects llama3 scaling)
        layer = read_layer(cfg)
        layer = layer.replace(vocab_size=target.vocab_size, attention_bias=bool(cfg.get("qkv_bias", False)),
                              tie_word_embeddings=False)
        if kind == "eagle1":
            # Missing "bias" key means fc has a bias (ea_model.py: `except: bias = True`).
            bias = cfg.get("bias", True) if fc_bias is None else fc_bias
            return cls(kind, layer, target.hidden_size, target.vocab_size, bool(bias))
        return cls(kind, layer.replace(num_layers=1), cfg.get("target_hidden_size") or layer.hidden_size,
                   cfg.get("draft_vocab_size") or target.vocab_size, bool(fc_bias),
                   eagle3_aux_layers(cfg, target.num_layers), bool(cfg.get("norm_before_residual", False)))


def eagle3_aux_layers(cfg: dict, num_target_layers: int) -> tuple[int, ...]:
    """Target layers fused by EAGLE-3, as indices of layer outputs.

    Upstream captures the residual stream *entering* layers (2, N//2, N-3)
    (``modeling_llama_kv.py``); vLLM's ``eagle_aux_hidden_state_layer_ids`` uses
    the same "entering layer j" convention. Entering layer j = output of j - 1.
    """
    n = num_target_layers
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or [2, n // 2, n - 3]
    out = tuple(sorted(int(j) - 1 for j in ids))
    if len(set(out)) != 3 or out[0] < 0 or out[-1] >= n:
        raise ValueError(f"EAGLE-3 needs three distinct target layers, got {ids} for {n} layers")
    return out


class _Head(nn.Module):
    """What both heads share: RoPE and the borrowed target embedding."""

    def __init__(self, config: EagleConfig):
        super().__init__()
        self.config = config
        self.rotary = Rotary(config.layer)
        self.target: tuple[Transformer, ...] = ()  # set by attach(); a tuple keeps it out of our modules

    def attach(self, target: Transformer) -> "_Head":
        """Borrow the target's embedding (and head): shared modules, in whatever weight format it has."""
        self.target = (target,)
        return self

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.target[0].embed_tokens.weight

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.target[0].embed_tokens(ids)  # (tokens, hidden)

    def features(self, final: torch.Tensor, aux: Sequence[torch.Tensor]) -> torch.Tensor:
        """What target positions contribute: ``project`` of their raw features, the target's final
        hidden states (EAGLE-1/2) or its auxiliary layers' side by side (EAGLE-3)."""
        return self.project(torch.cat(list(aux), dim=-1) if aux else final)

    def project(self, raw: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Eagle1Head(_Head):
    def __init__(self, config: EagleConfig):
        super().__init__(config)
        h = config.layer.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=config.fc_bias)
        self.layers = nn.ModuleList(DecoderLayer(config.layer, i, input_norm=i > 0)
                                    for i in range(config.num_layers))
    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.target[0].lm_head_weight

    def project(self, raw: torch.Tensor) -> torch.Tensor:
        return raw  # the target's post-norm last hidden state (cnets1.py / ge_data: hidden_states[-1])

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                attn: AttentionBackend) -> torch.Tensor:
        x = self.fc(torch.cat([self.embed(ids), hidden], dim=-1))  # (tokens, hidden); embedding first
        cos, sin = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, attn)
        return x

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.target[0].logits(h)  # (tokens, vocab) fp32; no norm (cnets1.py topK_genrate)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids


class Eagle3Layer(nn.Module):
    """EAGLE-3's ``midlayer``: attention over [input_layernorm(emb); hidden_norm(h)], residual h."""

    def __init__(self, config: ModelConfig, norm_before_residual: bool = False):
        super().__init__()
        h = config.hidden_size
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.self_attn = Attention(config, 0, input_size=2 * h)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = SwiGLU(h, config.intermediate_size)

    def forward(self, emb: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionBackend) -> torch.Tensor:
        hn = self.hidden_norm(h)
        a = torch.cat([self.input_layernorm(emb), hn], dim=-1)  # (tokens, 2 * hidden)
        x = (hn if self.norm_before_residual else h) + self.self_attn(a, cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(_Head):
    def __init__(self, config: EagleConfig):
        super().__init__(config)
        h = config.layer.hidden_size
        self.fc = nn.Linear(3 * config.target_hidden_size, h, bias=config.fc_bias)
        self.midlayer = Eagle3Layer(config.layer, config.norm_before_residual)
        self.norm = RMSNorm(h, config.layer.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(config.layer.vocab_size, dtype=torch.bool))

    def project(self, raw: torch.Tensor) -> torch.Tensor:
        return self.fc(raw)  # (tokens, 3 * target_hidden) -> (tokens, hidden)

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                attn: AttentionBackend) -> torch.Tensor:
        cos, sin = self.rotary(positions, hidden.dtype)
        return self.midlayer(self.embed(ids), hidden, cos, sin, attn)  # pre-norm, fed back when drafting deeper

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h)).float()  # (tokens, draft_vocab)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


EagleHead = Eagle1Head | Eagle3Head
HEAD_CLASSES: dict[HeadKind, type] = {"eagle1": Eagle1Head, "eagle3": Eagle3Head}

# Checkpoint names -> canonical names that ``loader.to_module_names`` fuses into
# ours. vLLM/SGLang exports prefix everything but lm_head with "model.".
HEAD_NAMES: list[tuple[str, str]] = [
    (r"^(?:model\.)?fc\.(weight|bias)$", r"fc.\1"),
    (r"^(?:model\.)?embed_tokens\.weight$", "embed_tokens.weight"),
    (r"^(?:model\.)?layers\.(\d+)\.(.+)$", r"layers.\1.\2"),
    (r"^(?:model\.)?midlayer\.(.+)$", r"midlayer.\1"),
    (r"^(?:model\.)?norm\.weight$", "norm.weight"),
    (r"^lm_head\.weight$", "lm_head.weight"),
    (r"^(d2t|t2d)$", r"\1"),
]
IGNORED = (r"rotary_emb\.inv_freq$", r"^verifier_(norm|lm_head)\.weight$")  # speculators' frozen verifier copies


def read_draft_state(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a draft model's directory (an EAGLE head or a DFlash drafter): model.safetensors, else
    pytorch_model.bin (never unpickled)."""
    if (path / "model.safetensors").exists():
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    if (path / "pytorch_model.bin").exists():
        return dict(torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True))
    raise FileNotFoundError(f"no model.safetensors or pytorch_model.bin in {path}")


def head_kind(names: Sequence[str]) -> HeadKind:
    """EAGLE-3 heads are the ones with a hidden_norm (their attention reads [emb; hidden])."""
    return "eagle3" if any("hidden_norm" in n for n in names) else "eagle1"


def map_head_state(raw: dict[str, torch.Tensor], kind: HeadKind) -> dict[str, torch.Tensor]:
    canonical: dict[str, torch.Tensor] = {}
    for name, tensor in raw.items():
        new = rename(name, HEAD_NAMES)
        if new is None:
            if any(re.search(p, name) for p in IGNORED):
                continue
            raise ValueError(f"unexpected tensor {name!r} in EAGLE head")
        if kind == "eagle3" and new.startswith("layers.0."):
            new = "midlayer." + new.removeprefix("layers.0.")  # vLLM's renaming of the midlayer
        canonical[new] = tensor
    return to_module_names(canonical)


def build_head(config: EagleConfig, state: dict[str, torch.Tensor], target: Transformer,
               dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> EagleHead:
    """Build on meta, assign (strict), borrow the target's embedding/lm_head. Runs in the target's dtype."""
    ref = target.norm.weight  # the target's compute dtype and device (its embedding may be quantized)
    dtype, device = dtype or ref.dtype, device or ref.device
    own_embed = state.pop("embed_tokens.weight", None)
    want = (target.config.vocab_size, target.config.hidden_size)
    if own_embed is not None and tuple(own_embed.shape) != want:
        raise ValueError(f"head embedding {tuple(own_embed.shape)} does not match the target's {want}")
    with torch.device("meta"):
        head = HEAD_CLASSES[config.kind](config)
    state = {k: v.to(device) if k in ("d2t", "t2d") else v.to(device=device, dtype=dtype) for k, v in state.items()}
    if config.kind == "eagle3":
        state["d2t"], state["t2d"] = state["d2t"].long(), state["t2d"].bool()
    head.load_state_dict(state, strict=True, assign=True)
    head.rotary.reset(device)
    return head.attach(target).eval().requires_grad_(False)


def load_eagle_head(path: Path | str, target: Transformer, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> EagleHead:
    """Load an EAGLE-1/2 or EAGLE-3 head directory for ``target`` (upstream, vLLM or speculators layout)."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    if is_speculators(cfg):  # vLLM speculators' *-speculator.eagle3 layout
        cfg = flatten_speculators_config(cfg)
    raw = read_draft_state(path)
    kind = head_kind(list(raw))
    # The checkpoint is the ground truth for fc.bias (vicuna heads omit the config key).
    config = EagleConfig.from_hf(cfg, kind, target.config, fc_bias="fc.bias" in raw)
    if config.layer.hidden_size != target.config.hidden_size:
        raise ValueError(f"head hidden size {config.layer.hidden_size} does not match the target's "
                         f"{target.config.hidden_size}: the head borrows the target's embedding")
    state = map_head_state(raw, kind)
    if kind == "eagle3" and "d2t" not in state:  # draft vocab == target vocab: identity maps
        state["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(target.config.vocab_size, dtype=torch.bool)
    return build_head(config, state, target, dtype, device)


# ---- writing a head (the trainer's output) ------------------------------------

def head_config_dict(config: EagleConfig, target: ModelConfig) -> dict:
    """config.json in the published layout (EAGLE-LLaMA3-Instruct-8B / EAGLE-3 training template)."""
    c = config.layer
    out = {
        "architectures": [PLAIN.hf_architecture], "model_type": PLAIN.name, "hidden_act": "silu",
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "num_hidden_layers": c.num_layers, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings, "vocab_size": target.vocab_size,
        "bos_token_id": target.bos_token_id, "eos_token_id": list(target.eos_token_ids),
        "tie_word_embeddings": False, "torch_dtype": "float16", "bias": config.fc_bias,
    }
    if config.kind == "eagle3":
        out["draft_vocab_size"] = config.draft_vocab_size
        if config.norm_before_residual:
            out["norm_before_residual"] = True
        out["eagle_config"] = {"use_aux_hidden_state": True,
                               "eagle_aux_hidden_state_layer_ids": [i + 1 for i in config.aux_layers]}
    return out


def published_state(head: EagleHead) -> dict[str, torch.Tensor]:
    """Our parameter names -> the published tensor names, splitting fused projections."""
    out: dict[str, torch.Tensor] = {}
    for name, t in head.state_dict().items():
        for parts, fused in FUSED:
            if f".{fused}." in f".{name}":
                prefix, suffix = name.split(fused)
                sizes = _fused_sizes(head.config, parts)
                for part, chunk in zip(parts, t.split(sizes, dim=0)):
                    out[f"{prefix}{part}{suffix}"] = chunk
                break
        else:
            out[name] = t
    return out


def _fused_sizes(config: EagleConfig, parts: tuple[str, ...]) -> list[int]:
    c = config.layer
    if len(parts) == 3:
        return [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
    return [c.intermediate_size, c.intermediate_size]


def save_eagle_head(head: EagleHead, target: ModelConfig, path: Path | str,
                    dtype: torch.dtype = torch.float16, metadata: dict[str, str] | None = None) -> Path:
    """Write config.json + model.safetensors that ``load_eagle_head`` (and upstream) read; no embedding copy."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: (v if k in ("d2t", "t2d") else v.to(dtype)).detach().cpu().contiguous()
             for k, v in published_state(head).items()}
    config = head_config_dict(head.config, target)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt", **(metadata or {})})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path
