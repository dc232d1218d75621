"""The bottom of loading: the loaded-model record, tensor readers, renaming, and ``build``.

Every loader (``loader.py`` for the transformer core and GGUF, ``adapter.py``
for twins, ``eagle.py`` for draft heads, a family's own loader named by its row
in ``families.py``) imports from here and nothing imports back, so loading runs
one way: shared types and readers at the bottom, loaders above, one dispatch at
the top (``loader.load_model``, through the family row).

A state dict here maps names to tensors, or, for a weight stored quantized in
the model cache, to a *portable* entry ``{"qweight", "scales"[, "zeros", "scale_mult",
"zero_mult"]}`` (see ``portable.py``). On disk the entry is its tensors beside each other,
``<module>.qweight``, ``<module>.scales`` ..., with int4 values (a uint8 ``qweight`` with
``zeros``) packed two to a byte (even column in the low nibble); int8 values are stored as they are.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Union

import torch
from safetensors import safe_open
from torch import nn

from .config import ModelConfig
from .heap import trim_heap
from .network import Network, NetworkConfig
from .portable import PORTABLE_KEYS, concat_portable, dequantize_portable, portable_kind
from .quant import DOT8_DIGITS, GROUP, QuantEmbedding, Quantization, float_to_linear, head_linear, to_linear
from .tied_embedding import HeadRowsEmbedding, tied_embedding
from .tokenizer import Tokenizer
from .transformer import Transformer

Weight = Union[torch.Tensor, dict]  # a tensor, or a portable quantized entry


@dataclass
class LoadedModel:
    name: str
    path: Path
    config: NetworkConfig
    model: Network
    tokenizer: Tokenizer
    load_seconds: float
    quantization: Quantization = "none"


# Canonical names fused into one of our parameters: (parts in order, fused name).
FUSED: list[tuple[tuple[str, ...], str]] = [
    (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn.qkv_proj"),
    (("mlp.gate_proj", "mlp.up_proj"), "mlp.gate_up_proj"),
]

# The output head of a quantized model is int8 per channel, whatever the layers use:
# logits decide every greedy token, and int8 keeps them within a cosine of 0.9999 of
# the default model's Q8_0 head, where 4 bits would not.
HEAD_QUANTIZATION: Quantization = "int8"

# A tied model's embedding reads its rows from a dot8 head that holds the file's table exactly
# (``tied_embedding.py``), instead of keeping a second copy; False keeps the copy (tests compare).
TIED_FROM_HEAD = True


def rename(name: str, table: list[tuple[str, str]]) -> str | None:
    for pattern, repl in table:
        new, n = re.subn(pattern, repl, name)
        if n:
            return new
    return None


def _concat(parts: list[Weight]) -> Weight:
    """Fused parts: one portable entry when all are (a file may store q, k and v in different block
    types: ``concat_portable`` widens them to one kind exactly), else float."""
    if all(isinstance(p, dict) for p in parts):
        return concat_portable(parts)
    return torch.cat([dequantize_portable(p) if isinstance(p, dict) else p for p in parts], 0)


def stream_module_names(canonical: Iterable[tuple[str, Weight]]) -> Iterator[tuple[str, Weight]]:
    """Canonical HF names -> our parameter names, concatenating fused projections as soon as their
    last part arrives, so a checkpoint streams through with only a layer's parts held at once. The
    parts' portable entries are emptied once concatenated (``to_module_names`` passes copies)."""
    pending: dict[str, dict[str, Weight]] = {}
    for name, tensor in canonical:
        short = name.removeprefix("model.")
        for parts, fused in FUSED:
            hit = next((p for p in parts if f".{p}." in f".{short}"), None)
            if hit:
                prefix, suffix = short.split(hit)
                key = f"{prefix}{fused}{suffix}"
                pending.setdefault(key, {})[hit] = tensor
                if len(pending[key]) == len(parts):
                    got = pending.pop(key)
                    trim_heap(collect=False)  # the parts' reading temporaries, back before the concatenation
                    whole = _concat([got[p] for p in parts])
                    for part in got.values():  # consumed: their tensors go before the fused layer is built,
                        if isinstance(part, dict):  # though the stream below may still hold the entries
                            part.clear()
                    del got, tensor
                    trim_heap(collect=False)  # and the parts, before the fused layer is built
                    yield key, whole
                    del whole  # and the fused source before the next tensor is read
                break
        else:
            yield short, tensor
    if pending:
        raise ValueError(f"incomplete fused projections in checkpoint: {sorted(pending)[:4]}")


def to_module_names(canonical: dict[str, Weight]) -> dict[str, Weight]:
    """``stream_module_names`` over a whole state dict (left as it is)."""
    return dict(stream_module_names((k, dict(v) if isinstance(v, dict) else v) for k, v in canonical.items()))


def _quantize_into(model: Transformer, weights: Iterable[tuple[str, Weight]], fmt: Quantization,
                   dtype: torch.dtype, device: torch.device | str) -> tuple[dict[str, torch.Tensor], dict[str, Weight], bool]:
    """Swap the meta model's linear layers, head and embedding for ``fmt`` modules, each built as soon
    as its weight (and bias) arrives from ``weights`` and its source tensors then dropped: a checkpoint
    streams through with one layer's source held at once beside the model being built.

    A tied model's table (``config.tie_word_embeddings``) becomes its dot8 head on arrival and its
    embedding reads the head's rows (``tied_embedding.py``); elsewhere the embedding keeps a table.

    Returns the new modules' tensors, by name, for the strict load, the other entries (norms), and
    whether the checkpoint had no head of its own (tied to the embedding).
    """
    linears = {f"layers.{n}": m.bias is not None for n, m in model.layers.named_modules() if isinstance(m, nn.Linear)}
    done: dict[str, torch.Tensor] = {}
    rest: dict[str, Weight] = {}
    waiting: dict[str, dict[str, Weight]] = {}
    # A tied table becomes the dot8 head as soon as it arrives, its source dropped: one table is held
    # through the stream instead of the source until the end and then the head beside it.
    early = TIED_FROM_HEAD and model.config.tie_word_embeddings and fmt in DOT8_DIGITS
    head: nn.Module | None = None

    def place(name: str, module: nn.Module) -> None:
        if "." in name:
            model.set_submodule(name, module)
        else:  # lm_head may be None on a tied model, which set_submodule refuses to replace
            setattr(model, name, module)
        done.update({f"{name}.{k}": t for k, t in module.state_dict().items()})

    for name, weight in weights:
        module, _, leaf = name.rpartition(".")
        if (early and name == "embed_tokens.weight" and isinstance(weight, dict)
                and weight["qweight"].shape[1] % GROUP == 0):
            head = head_linear(weight, fmt, dtype, device)
            del weight
            continue
        if module not in linears or leaf not in ("weight", "bias"):
            rest[name] = weight
            continue
        got = waiting.setdefault(module, {})
        got[leaf] = weight
        del weight  # the source goes as soon as its layer is built, before the next one is read
        if "weight" in got and ("bias" in got or not linears[module]):
            got = waiting.pop(module)
            bias = None if got.get("bias") is None else got["bias"].to(device)
            w = got["weight"]
            place(module, to_linear(w, fmt, bias, dtype, device) if isinstance(w, dict)
                  else float_to_linear(w.to(device), bias, fmt, dtype))
            del got, w
            trim_heap(collect=False)  # the freed sources and packing temporaries, back before the next layer
    if waiting:
        raise ValueError(f"linear layers without their weights in the checkpoint: {sorted(waiting)[:4]}")
    if head is not None:  # the table arrived and is packed as the head
        if "lm_head.weight" in rest:  # a head of its own after all: the table is the embedding's alone
            place("embed_tokens", QuantEmbedding.from_portable({k: v.to(device) for k, v in head.portable().items()},
                                                              dtype))
            place("lm_head", head_linear(rest.pop("lm_head.weight"), fmt, dtype, device))
            return done, rest, False
        place("lm_head", head)
        model.embed_tokens = HeadRowsEmbedding(head, dtype)
        return done, rest, True
    emb = rest.pop("embed_tokens.weight")
    tied = "lm_head.weight" not in rest
    place("lm_head", head_linear(rest.pop("lm_head.weight", emb), fmt, dtype, device))
    shared = tied_embedding(model.lm_head, emb, dtype) if tied and TIED_FROM_HEAD else None
    if shared is not None:  # one table: the lookup reads the head's packed rows (tied_embedding.py)
        model.embed_tokens = shared
    elif isinstance(emb, dict):  # a GGUF table: its int8 groups as they are (Q8_0, Q6_K ...), else quantized again
        place("embed_tokens", QuantEmbedding.from_portable({k: v.to(device) for k, v in emb.items()}, dtype))
    else:
        place("embed_tokens", QuantEmbedding.from_float(emb.to(device), dtype))
    return done, rest, tied


def build(config: ModelConfig, weights: dict[str, Weight] | Iterable[tuple[str, Weight]], dtype: torch.dtype,
          device: torch.device | str, quantization: Quantization = "none") -> Transformer:
    """Build on meta, then assign real tensors; strict, so a missing or extra tensor is an error.

    ``weights``: a state dict, or (name, weight) pairs as a checkpoint streams them. With a quantized
    format the linear layers, the output head and the embedding become that format's modules as they
    arrive (exactly, when the source already holds that layout); everything else (norms, residual
    stream, attention) computes in ``dtype``.
    """
    pairs = weights.items() if isinstance(weights, dict) else weights
    with torch.device("meta"):
        model = Transformer(config)
    done: dict[str, torch.Tensor] = {}
    if quantization != "none":
        done, state, tied = _quantize_into(model, pairs, quantization, dtype, device)
    else:
        state = dict(pairs)
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        tied = "lm_head.weight" not in state
        if tied:
            model.lm_head = None
    if tied and not config.tie_word_embeddings:  # a checkpoint without a head ties it to the embedding
        config = config.replace(tie_word_embeddings=True)
    model.config = config
    full = {k: (dequantize_portable(v) if isinstance(v, dict) else v).to(device=device, dtype=dtype)
            for k, v in state.items()}
    if config.norm_offset:  # Gemma's norms multiply by 1 + w, added once here in fp32 as transformers does
        full = {k: v + config.norm_offset if k.endswith("norm.weight") else v for k, v in full.items()}
    model.load_state_dict({**full, **done}, strict=True, assign=True)
    model.rotary.reset(device)
    if model.rotary_local is not None:
        model.rotary_local.reset(device)
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


# The format's dtype names (a file with another is read through ``safe_open``).
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor, one file after another, in name order within a file (a module's tensors are then
    next to each other). Each is read from the file into memory of its own: no memory map, whose pages
    count in the process's resident memory while the file is open (up to a shard, 64 MB, at the peak
    of a load) and would need a copy besides (a tensor kept in the model, a norm, would keep them)."""
    for file in safetensors_files(path):
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
            header.pop("__metadata__", None)
            if any(info["dtype"] not in SAFETENSORS_DTYPES for info in header.values()):
                with safe_open(str(file), framework="pt") as g:
                    for name in sorted(g.keys()):
                        yield name, g.get_tensor(name).clone()
                continue
            for name in sorted(header):
                info = header[name]
                begin, end = info["data_offsets"]
                raw = torch.empty(end - begin, dtype=torch.uint8)
                f.seek(8 + size + begin)
                if f.readinto(raw.numpy()) != end - begin:
                    raise ValueError(f"{file}: {name} runs past the end of the file")
                yield name, raw.view(SAFETENSORS_DTYPES[info["dtype"]]).reshape(info["shape"])


def iter_weights(path: Path) -> Iterator[tuple[str, Weight]]:
    """Like ``iter_safetensors``, with stored portable entries regrouped under ``<module>.weight``, each
    yielded once its module's tensors have all been read."""
    module, parts = "", {}

    def entry() -> tuple[str, Weight]:
        if portable_kind(parts) == "int4":  # stored two to a byte
            packed = parts["qweight"]
            parts["qweight"] = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)
        return f"{module}.weight", parts

    for name, tensor in iter_safetensors(path):
        owner, _, key = name.rpartition(".")
        if parts and owner != module:
            yield entry()
            parts = {}
        if key in PORTABLE_KEYS:
            module = owner
            parts[key] = tensor
        else:
            yield name, tensor
    if parts:
        yield entry()


def portable_tensors(name: str, entry: dict) -> dict[str, torch.Tensor]:
    """The on-disk tensors of one portable entry named ``<module>.weight``."""
    module = name.removesuffix(".weight")
    out = {f"{module}.{k}": v.contiguous() for k, v in entry.items()}
    if portable_kind(entry) == "int4":
        q = entry["qweight"].to(torch.uint8)
        out[f"{module}.qweight"] = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
    return out
