"""One loader for every checkpoint: Hugging Face directories and GGUF files.

The model is built on the meta device (no memory, no init cost), tensors are
streamed from safetensors or dequantized from GGUF through the ``gguf`` package,
renamed through tables kept as data, fused where the core fuses projections, and
assigned. No pickle anywhere.

Renaming happens in two steps so each table stays small and readable:
  1. source name -> canonical Hugging Face Llama name (``GGUF_NAMES``, ``LLADA_NAMES``);
  2. canonical name -> our module name, fusing q/k/v and gate/up (``FUSED``).

A GGUF file is slow to parse (its metadata arrays are read element by element),
so the first load converts it once into a Hugging Face directory in the cache
(config.json, model.safetensors, tokenizer files); later loads read that.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import ModelConfig
from .tokenizer import Tokenizer
from .transformer import Transformer

# Source name patterns -> canonical HF Llama names. Anchored regexes, tried in order.
GGUF_NAMES: list[tuple[str, str]] = [
    (r"^token_embd\.weight$", "model.embed_tokens.weight"),
    (r"^output_norm\.weight$", "model.norm.weight"),
    (r"^output\.weight$", "lm_head.weight"),
    (r"^blk\.(\d+)\.attn_norm\.weight$", r"model.layers.\1.input_layernorm.weight"),
    (r"^blk\.(\d+)\.attn_q\.(weight|bias)$", r"model.layers.\1.self_attn.q_proj.\2"),
    (r"^blk\.(\d+)\.attn_k\.(weight|bias)$", r"model.layers.\1.self_attn.k_proj.\2"),
    (r"^blk\.(\d+)\.attn_v\.(weight|bias)$", r"model.layers.\1.self_attn.v_proj.\2"),
    (r"^blk\.(\d+)\.attn_output\.weight$", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"^blk\.(\d+)\.ffn_norm\.weight$", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"^blk\.(\d+)\.ffn_gate\.weight$", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"^blk\.(\d+)\.ffn_up\.weight$", r"model.layers.\1.mlp.up_proj.weight"),
    (r"^blk\.(\d+)\.ffn_down\.weight$", r"model.layers.\1.mlp.down_proj.weight"),
]

# LLaDA (OLMo-derived) names; ff_proj is the SwiGLU gate: act(ff_proj(x)) * up_proj(x).
LLADA_NAMES: list[tuple[str, str]] = [
    (r"^model\.transformer\.wte\.weight$", "model.embed_tokens.weight"),
    (r"^model\.transformer\.ln_f\.weight$", "model.norm.weight"),
    (r"^model\.transformer\.ff_out\.weight$", "lm_head.weight"),
    (r"^model\.transformer\.blocks\.(\d+)\.attn_norm\.weight$", r"model.layers.\1.input_layernorm.weight"),
    (r"^model\.transformer\.blocks\.(\d+)\.ff_norm\.weight$", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"^model\.transformer\.blocks\.(\d+)\.(q|k|v)_proj\.(weight|bias)$", r"model.layers.\1.self_attn.\2_proj.\3"),
    (r"^model\.transformer\.blocks\.(\d+)\.attn_out\.weight$", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"^model\.transformer\.blocks\.(\d+)\.ff_proj\.weight$", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"^model\.transformer\.blocks\.(\d+)\.up_proj\.weight$", r"model.layers.\1.mlp.up_proj.weight"),
    (r"^model\.transformer\.blocks\.(\d+)\.ff_out\.weight$", r"model.layers.\1.mlp.down_proj.weight"),
]

SOURCE_NAMES = {"gguf": GGUF_NAMES, "llada": LLADA_NAMES}

# Canonical names fused into one of our parameters: (parts in order, fused name).
FUSED: list[tuple[tuple[str, ...], str]] = [
    (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn.qkv_proj"),
    (("mlp.gate_proj", "mlp.up_proj"), "mlp.gate_up_proj"),
]


@dataclass
class LoadedModel:
    name: str
    path: Path
    config: ModelConfig
    model: Transformer
    tokenizer: Tokenizer
    load_seconds: float


def rename(name: str, table: list[tuple[str, str]]) -> str | None:
    for pattern, repl in table:
        new, n = re.subn(pattern, repl, name)
        if n:
            return new
    return None


def to_module_names(canonical: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Canonical HF names -> our parameter names, concatenating fused projections."""
    out: dict[str, torch.Tensor] = {}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in canonical.items():
        short = name.removeprefix("model.")
        for parts, fused in FUSED:
            hit = next((p for p in parts if f".{p}." in f".{short}"), None)
            if hit:
                prefix, suffix = short.split(hit)
                key = f"{prefix}{fused}{suffix}"
                pending.setdefault(key, {})[hit] = tensor
                if len(pending[key]) == len(parts):
                    got = pending.pop(key)
                    out[key] = torch.cat([got[p] for p in parts], 0)
                break
        else:
            out[short] = tensor
    if pending:
        raise ValueError(f"incomplete fused projections in checkpoint: {sorted(pending)[:4]}")
    return out


def build(config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype,
          device: torch.device | str) -> Transformer:
    """Build on meta, then assign real tensors; strict, so a missing or extra tensor is an error."""
    if "lm_head.weight" not in state and not config.tie_word_embeddings:
        config = config.replace(tie_word_embeddings=True)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = Transformer(config)
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary.reset(device)
    return model.eval().requires_grad_(False)


# ---- Hugging Face directories -------------------------------------------------

def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    return files


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_hf_state(path: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    table = SOURCE_NAMES.get(config.family)
    canonical: dict[str, torch.Tensor] = {}
    for name, tensor in iter_safetensors(path):
        new = rename(name, table) if table else name
        if new is None:
            raise ValueError(f"unexpected tensor {name!r} in {path}")
        canonical[new] = tensor
    return to_module_names(canonical)


# ---- GGUF ---------------------------------------------------------------------

def gguf_metadata(reader) -> dict:
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key not in (
                "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.padding_token_id", "tokenizer.ggml.model", "tokenizer.ggml.pre"):
            continue  # vocab arrays: the tokenizer reads them itself
        try:
            meta[key] = field.contents()
        except Exception:  # noqa: BLE001 - exotic field types are not needed
            continue
    return meta


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs -> rotate-half).

    Inverse of ``permute`` in llama.cpp's convert_hf_to_gguf.py.
    """
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf_state(reader, config: ModelConfig) -> dict[str, torch.Tensor]:
    from gguf import quants

    canonical: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = rename(t.name, GGUF_NAMES)
        if name is None:
            continue  # e.g. rope_freqs: recomputed from the config
        w = np.require(quants.dequantize(t.data, t.tensor_type), np.float32, ["C", "W"])
        # llama.cpp permutes q/k rows for the llama architecture (Mistral GGUFs use it too).
        if config.family in ("llama", "mistral") and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_rope(w, config.num_heads)
        elif config.family in ("llama", "mistral") and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_rope(w, config.num_kv_heads)
        canonical[name] = torch.from_numpy(np.require(w, np.float32, ["C", "W"]))
    return canonical


def hf_config_dict(config: ModelConfig) -> dict:
    """A Hugging Face style config.json for a converted GGUF."""
    return {
        "architectures": ["Qwen2ForCausalLM" if config.family == "qwen2" else "LlamaForCausalLM"],
        "model_type": config.family,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": config.attention_bias,
        "rope_scaling": None if config.rope_scaling.kind == "default" else {
            "rope_type": config.rope_scaling.kind, "factor": config.rope_scaling.factor,
            "low_freq_factor": config.rope_scaling.low_freq_factor,
            "high_freq_factor": config.rope_scaling.high_freq_factor,
            "original_max_position_embeddings": config.rope_scaling.original_max_position_embeddings},
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids),
        "pad_token_id": config.pad_token_id,
        "torch_dtype": "float32",
    }


def convert_gguf(path: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF file into a Hugging Face directory (fp32 safetensors + tokenizer)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    config = ModelConfig.from_gguf(gguf_metadata(reader))
    canonical = load_gguf_state(reader, config)
    if "lm_head.weight" not in canonical:
        config = config.replace(tie_word_embeddings=True)
    tokenizer = Tokenizer.from_gguf(reader)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".partial-", dir=out_dir.parent))
    save_file(canonical, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": path.name})
    (tmp / "config.json").write_text(json.dumps(hf_config_dict(config), indent=2))
    save_tokenizer(tokenizer, tmp)
    try:
        tmp.rename(out_dir)
    except OSError:  # another process converted the same file first
        if not (out_dir / "config.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def save_tokenizer(tok: Tokenizer, out_dir: Path) -> None:
    """Write a tokenizer as tokenizer.json + tokenizer_config.json + generation_config.json."""
    tok.backend.save(str(out_dir / "tokenizer.json"))

    def text(i: int | None) -> str | None:
        return tok.backend.id_to_token(i) if i is not None else None

    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": text(tok.bos_token_id), "eos_token": text(tok.eos_token_id),
        "pad_token": text(tok.pad_token_id), "unk_token": text(tok.unk_token_id),
        "add_bos_token": tok.add_bos_token, "add_eos_token": tok.add_eos_token,
        "chat_template": tok.chat_template}, indent=2))
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": list(tok.eos_token_ids)}))


def converted_dir(path: Path, cache_dir: Path) -> Path:
    stat = path.stat()
    return cache_dir / "converted" / f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}"


def load_model(path: Path | str, *, name: str | None = None, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", cache_dir: Path | None = None) -> LoadedModel:
    """Load a Hugging Face directory or a GGUF file (converted once into ``cache_dir``)."""
    start = time.perf_counter()
    path = Path(path)
    if path.is_dir() and (path / "adapter.safetensors").exists():
        from .adapter import load_twin  # a diffusion twin: base model + LoRA adapter

        return load_twin(path, name=name, dtype=dtype, device=device, cache_dir=cache_dir)
    if path.is_file() and path.suffix == ".gguf":
        target = converted_dir(path, cache_dir or path.parent / ".dualserve")
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            convert_gguf(path, target)
        source = target
    else:
        source = path
    raw = json.loads((source / "config.json").read_text())
    if raw.get("architectures") == ["DiffusionGemmaForBlockDiffusion"]:
        from .diffusion_gemma import load_diffusion_gemma  # it imports LoadedModel from here

        return load_diffusion_gemma(source, dtype, device, name=name)
    config = ModelConfig.from_hf(raw)
    model = build(config, load_hf_state(source, config), dtype, device)
    tokenizer = Tokenizer.from_hf_dir(source)
    return LoadedModel(name=name or (path.stem if path.is_file() else path.name), path=path,
                       config=model.config, model=model, tokenizer=tokenizer,
                       load_seconds=time.perf_counter() - start)
