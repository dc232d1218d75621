"""Diffusion twins: an AR checkpoint plus a low-rank adapter that turns it into a block-diffusion model.

A twin directory holds two files:

- ``config.json``: the base model's Hugging Face config with two more keys,
  ``"dualserve_diffusion": {"block_size", "mask_token_id", "shift_logits",
  "base_model"}`` (read by ``families.read_config``) and ``"lora": {"rank",
  "alpha", "targets"}``;
- ``adapter.safetensors``: per adapted projection ``layers.N.<module>.lora_A``
  (rank, in) and ``.lora_B`` (out, rank), in our fused naming (``qkv_proj``,
  ``o_proj``, ``gate_up_proj``, ``down_proj``), plus ``mask_embedding``
  (hidden,), the trained embedding row of the [MASK] token.

``loader.load_twin`` loads the base through the one loader and ``apply_twin`` *merges* the adapter
into a copy of the weights: W' = W + (alpha / rank) * B @ A (LoRA, Hu et al.
2021, section 4.1). Merging costs one copy of the adapted matrices, but a
merged twin runs at exactly the base model's speed; applying the adapter at run
time would add two small matmuls per projection per forward, which at batch 1 on
a CPU is dispatch time the AR model does not pay. Norms are shared with an
already loaded base when one is passed in.

The [MASK] row is written into ``embed_tokens``. With tied embeddings that row
is also the output row of the [MASK] id; training used the same tied matrix, so
the twin has learnt never to predict it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from torch import nn

from .checkpoint import LoadedModel, build
from .config import ModelConfig
from .kernels import ops as kernel_ops
from .quant import GROUP, Dot8Linear, W8A8Linear
from .transformer import Transformer

ADAPTER_FILE = "adapter.safetensors"
# The committed twin of the default model (SmolLM2-135M-Instruct), made by ``dualserve train-diffusion``.
DEFAULT_TWIN_DIR = Path(__file__).parent / "assets" / "twin-smollm2"
# Our fused projections; a LoRA on qkv_proj is one low-rank update of the stacked q/k/v.
LORA_TARGETS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@dataclass(frozen=True)
class TwinSpec:
    """What the ``dualserve_diffusion`` and ``lora`` keys of a twin's config.json say."""

    block_size: int
    mask_token_id: int
    base_model: str
    rank: int
    alpha: float
    targets: tuple[str, ...] = LORA_TARGETS
    shift_logits: bool = True
    threshold: float | None = None  # the unmasking threshold the decoder uses by default

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def config_keys(self) -> dict:
        diffusion = {"block_size": self.block_size, "mask_token_id": self.mask_token_id,
                     "shift_logits": self.shift_logits, "base_model": self.base_model}
        if self.threshold is not None:
            diffusion["threshold"] = self.threshold
        return {"dualserve_diffusion": diffusion,
                "lora": {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets)}}

    @classmethod
    def from_config(cls, cfg: dict) -> "TwinSpec":
        d, lora = cfg["dualserve_diffusion"], cfg["lora"]
        return cls(block_size=int(d["block_size"]), mask_token_id=int(d["mask_token_id"]),
                   base_model=str(d["base_model"]), rank=int(lora["rank"]), alpha=float(lora["alpha"]),
                   targets=tuple(lora.get("targets", LORA_TARGETS)), shift_logits=bool(d.get("shift_logits", True)),
                   threshold=d.get("threshold"))


def twin_config(base: ModelConfig, spec: TwinSpec) -> ModelConfig:
    """The block-diffusion config of a twin of ``base``."""
    return base.replace(family="block_diffusion", mask_token_id=spec.mask_token_id,
                        diffusion_block_size=spec.block_size, shift_logits=spec.shift_logits,
                        diffusion_threshold=spec.threshold)


def is_twin_dir(path: Path | str) -> bool:
    path = Path(path)
    return path.is_dir() and (path / ADAPTER_FILE).exists()


def lora_names(model: Transformer, targets: tuple[str, ...] = LORA_TARGETS) -> list[str]:
    """Parameter prefixes (``layers.N.self_attn.qkv_proj``) that carry an adapter, in layer order."""
    return [f"layers.{i}.{t}" for i in range(len(model.layers)) for t in targets]


def merged_weights(model: Transformer, adapter: dict[str, torch.Tensor], spec: TwinSpec) -> dict[str, torch.Tensor]:
    """The twin's state dict: ``model``'s tensors with W + scale * B @ A and the [MASK] row set.

    Unchanged tensors are returned by reference (shared with ``model``); changed
    ones are new tensors in fp32 arithmetic, cast back to the model's dtype.
    """
    state = dict(model.state_dict())
    for prefix in lora_names(model, spec.targets):
        a, b = adapter[f"{prefix}.lora_A"].float(), adapter[f"{prefix}.lora_B"].float()
        w = state[f"{prefix}.weight"]
        delta = (b @ a) * spec.scale  # (out, in)
        state[f"{prefix}.weight"] = (w.float() + delta.to(w.device)).to(w.dtype)
    emb = state["embed_tokens.weight"].clone()
    emb[spec.mask_token_id] = adapter["mask_embedding"].to(emb)
    state["embed_tokens.weight"] = emb
    if "lm_head.weight" in state and model.config.tie_word_embeddings:
        state["lm_head.weight"] = emb
    return state


class LoRA(nn.Module):
    """y = base(x) + up(down(x)): the adapter beside ``base``, shared with the AR model (any weight format).

    ``down`` (A) and ``up`` (scale * B) multiply in exact integer sums, so a row's correction does
    not depend on the other rows of its batch or the thread count, and batching never changes the
    twin's greedy output on any CPU (float GEMMs gave different bits by row count and thread count:
    MKL on an AMX host):

    - beside dot8 layers (``w4a8``), in the same kernel (``Dot8Linear``, 8-bit weights, activations
      in int8 groups of 32). On the default model's w4a8 base its logits are closer to the merged
      fp32 twin's than the two-digit form's (lowest cosine over a block 0.997 against 0.995).
      The projection and both factors run as one kernel call (``dualserve::dot8_lora``, the same
      bits): three calls per projection had made a compiled twin forward of 4 tokens cost 1.7 ms
      more than the base's on a 2-core AVX-512 host, one call costs 0.7 ms more (medians of 4
      alternating runs: 10.2 and 9.1 ms against 8.5);
    - otherwise in int8 with activations as two int8 digits per value (``W8A8Linear``, digits=2):
      within a cosine of 0.998 of the merged fp32 twin's; one digit per token-wide scale fell to
      0.967.
    """

    def __init__(self, base: nn.Module, down: nn.Module, up: nn.Module):
        super().__init__()
        self.base, self.down, self.up = base, down, up
        # Beside a dot8 projection without a bias, one kernel call does the projection and both
        # factors (``dualserve::dot8_lora``), with the same bits as the three calls.
        self.fused = all(isinstance(m, Dot8Linear) and m.bias is None for m in (base, down, up)) \
            and down.bits == 8 and up.bits == 8

    @classmethod
    def from_factors(cls, base: nn.Module, a: torch.Tensor, b: torch.Tensor, scale: float) -> "LoRA":
        """a: (rank, in), b: (out, rank), as trained: delta W = scale * b @ a."""
        up = b.float() * scale
        if isinstance(base, Dot8Linear) and a.shape[1] % GROUP == 0 and a.shape[0] % GROUP == 0:
            return cls(base, Dot8Linear.from_float(a, bits=8, digits=base.digits),
                       Dot8Linear.from_float(up, bits=8, digits=base.digits))
        return cls(base, W8A8Linear.from_float(a, digits=2), W8A8Linear.from_float(up, digits=2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.dtype == torch.float32:
            b, a, u = self.base, self.down, self.up
            y = kernel_ops.dot8_lora(x.reshape(-1, b.in_features).contiguous(), b.packed, b.d, b.m, b.out_features,
                                     b.bits, (a.packed, a.d, a.m), a.out_features, (u.packed, u.d, u.m), b.digits,
                                     b.s, b.mn, b.minimum)
            return y.view(*x.shape[:-1], b.out_features)
        return self.base(x) + self.up(self.down(x))


class MaskedEmbedding(nn.Module):
    """The base embedding with the trained [MASK] row in place of the base row."""

    def __init__(self, base: nn.Module, mask_token_id: int, row: torch.Tensor):
        super().__init__()
        self.base = base
        self.mask_token_id = mask_token_id
        self.register_buffer("row", row)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.base(ids)
        return torch.where((ids == self.mask_token_id)[..., None], self.row.to(x.dtype), x)


def shared_twin(model: Transformer, adapter: dict[str, torch.Tensor], spec: TwinSpec) -> Transformer:
    """A twin over ``model``'s own modules: the adapter runs beside the shared (quantized) weights.

    Norms, the output head and every base projection are the AR model's objects,
    so the twin adds only the adapter and the [MASK] row to memory.
    """
    dtype = model.norm.weight.dtype
    device = model.norm.weight.device
    with torch.device("meta"):
        twin = Transformer(twin_config(model.config, spec))
    row = adapter["mask_embedding"].to(device=device, dtype=dtype)
    twin.embed_tokens = MaskedEmbedding(model.embed_tokens, spec.mask_token_id, row)
    twin.norm, twin.rotary, twin.lm_head = model.norm, model.rotary, model.lm_head
    for i, (mine, theirs) in enumerate(zip(twin.layers, model.layers)):
        mine.input_layernorm = theirs.input_layernorm
        mine.post_attention_layernorm = theirs.post_attention_layernorm
        for target in LORA_TARGETS:
            base = theirs.get_submodule(target)
            if target in spec.targets:
                a = adapter[f"layers.{i}.{target}.lora_A"].to(device=device, dtype=dtype)
                b = adapter[f"layers.{i}.{target}.lora_B"].to(device=device, dtype=dtype)
                base = LoRA.from_factors(base, a, b, spec.scale)
            mine.set_submodule(target, base)
    assert not any(t.is_meta for t in list(twin.parameters()) + list(twin.buffers())), "twin left a meta tensor"
    return twin.eval().requires_grad_(False)


def apply_twin(base: LoadedModel, path: Path | str, name: str | None = None) -> LoadedModel:
    """A twin built from an already loaded base model (which is left unchanged)."""
    path = Path(path)
    start = time.perf_counter()
    cfg = json.loads((path / "config.json").read_text())
    spec = TwinSpec.from_config(cfg)
    _check_shapes(base.config, cfg)
    adapter = load_file(str(path / ADAPTER_FILE))
    if base.quantization == "none":
        state = merged_weights(base.model, adapter, spec)
        param = next(base.model.parameters())
        model = build(twin_config(base.model.config, spec), state, param.dtype, param.device)
    else:
        model = shared_twin(base.model, adapter, spec)
    return LoadedModel(name=name or path.name, path=path, config=model.config, model=model,
                       tokenizer=base.tokenizer, load_seconds=base.load_seconds + time.perf_counter() - start,
                       quantization=base.quantization)


def _check_shapes(base: ModelConfig, cfg: dict) -> None:
    got = (cfg.get("hidden_size"), cfg.get("num_hidden_layers"), cfg.get("vocab_size"))
    want = (base.hidden_size, base.num_layers, base.vocab_size)
    if got != want:
        raise ValueError(f"twin was trained for (hidden, layers, vocab) = {got}, base model has {want}")


def save_twin(out_dir: Path | str, base_config_json: dict, spec: TwinSpec, adapter: dict[str, torch.Tensor],
              dtype: torch.dtype = torch.bfloat16, metadata: dict[str, str] | None = None) -> Path:
    """Write config.json + adapter.safetensors (adapter tensors cast to ``dtype``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in adapter.items()}
    tmp = out / (ADAPTER_FILE + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt", **(metadata or {})})
    tmp.replace(out / ADAPTER_FILE)
    cfg = {**base_config_json, **spec.config_keys()}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out
