"""One loader for every checkpoint: Hugging Face directories and GGUF files.

The model is built on the meta device (no memory, no init cost), tensors are
streamed from safetensors or dequantized from GGUF through the ``gguf`` package,
renamed through tables kept as data, fused where the core fuses projections, and
assigned. No pickle anywhere.

Renaming happens in two steps so each table stays small and readable:
  1. source name -> canonical Hugging Face Llama name (``GGUF_NAMES``, a family's own ``source_names``);
  2. canonical name -> our module name, fusing q/k/v and gate/up (``FUSED``).

A GGUF file is slow to parse (its metadata arrays are read element by element),
so the first load converts it once into a Hugging Face directory in the cache
(config.json, model.safetensors, tokenizer files); later loads read that.
"""

from __future__ import annotations

import json
import logging
import mmap
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator, Literal

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .adapter import TwinSpec, apply_twin, is_twin_dir
from .checkpoint import LoadedModel, Weight, build, iter_weights, portable_tensors, rename, safetensors_files, stream_module_names
from .config import ModelConfig
from .errors import UnsupportedModel
from .families import family, of_hf, read_config, read_gguf_config
from .huge_pages import place_on_huge_pages
from .quant import GGUF_PACKED, Quantization, gguf_blocks
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

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
    (r"^blk\.(\d+)\.attn_q_norm\.weight$", r"model.layers.\1.self_attn.q_norm.weight"),
    (r"^blk\.(\d+)\.attn_k_norm\.weight$", r"model.layers.\1.self_attn.k_norm.weight"),
    (r"^blk\.(\d+)\.ffn_norm\.weight$", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"^blk\.(\d+)\.ffn_gate\.weight$", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"^blk\.(\d+)\.ffn_up\.weight$", r"model.layers.\1.mlp.up_proj.weight"),
    (r"^blk\.(\d+)\.ffn_down\.weight$", r"model.layers.\1.mlp.down_proj.weight"),
]


def gguf_names(name: str) -> list[tuple[str, str]]:
    """A family's own GGUF names (``families.py``), then the common table."""
    return list(family(name).gguf_names) + GGUF_NAMES


def load_hf_state(path: Path, config: ModelConfig) -> Iterator[tuple[str, Weight]]:
    """A checkpoint's weights under our module names, streamed tensor by tensor."""
    table = family(config.family).source_names  # None: the canonical names already

    def canonical() -> Iterator[tuple[str, Weight]]:
        for name, tensor in iter_weights(path):
            new = rename(name, table) if table else name
            if new is None:
                raise ValueError(f"unexpected tensor {name!r} in {path}")
            yield new, tensor

    return stream_module_names(canonical())


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


def gguf_weights(reader, config: ModelConfig) -> Iterator[tuple[str, Weight]]:
    """A GGUF's tensors under canonical HF names, one at a time: packed block types in the portable
    layout (``portable.gguf_blocks``), the others dequantized to fp32."""
    from gguf import quants

    table = gguf_names(config.family)
    permuted = family(config.family).gguf_qk_permuted
    for t in reader.tensors:
        name = rename(t.name, table)
        if name is None:
            continue  # e.g. rope_freqs: recomputed from the config
        if t.tensor_type.name in GGUF_PACKED and len(t.shape) == 2:
            parts = {k: v.numpy() for k, v in gguf_blocks(np.asarray(t.data), t.tensor_type.name).items()}
        else:
            try:
                parts = {"w": np.require(quants.dequantize(t.data, t.tensor_type), np.float32, ["C", "W"])}
            except NotImplementedError:
                raise UnsupportedModel(f"tensor {t.name} has GGUF type {t.tensor_type.name}, which this build "
                                       f"does not read; packed: {', '.join(GGUF_PACKED)}; read as float: "
                                       "F32, F16, BF16 and the other types the gguf package dequantizes") from None
        # llama.cpp permutes q/k rows for the llama architecture (Mistral GGUFs use it too).
        heads = None
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            heads = config.num_heads
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            heads = config.num_kv_heads
        if heads is not None:
            parts = {k: unpermute_rope(v, heads) for k, v in parts.items()}
        tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in parts.items()}
        yield name, tensors.pop("w") if "w" in tensors else tensors
        _drop_pages(reader, t)


def _drop_pages(reader, tensor) -> None:
    """Let go of the file pages a converted tensor was read from: a memory map's pages count in the
    process's resident memory until it is closed, so a whole GGUF would be resident by the end of
    its conversion. Pages read again later come back from the file."""
    mapped = getattr(reader.data, "_mmap", None)
    if mapped is None or not hasattr(mapped, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = tensor.data_offset - tensor.data_offset % mmap.PAGESIZE
    end = min(tensor.data_offset + tensor.n_bytes, len(mapped))
    try:
        mapped.madvise(mmap.MADV_DONTNEED, start, end - start)
    except (OSError, ValueError):  # a platform that refuses: the pages stay until the map closes
        pass


def hf_config_dict(config: ModelConfig) -> dict:
    """A Hugging Face style config.json for a converted GGUF."""
    row = family(config.family)
    return {
        "architectures": [row.hf_architecture],
        "model_type": row.hf_model_type or config.family,
        **row.hf_keys(config),
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
        "sliding_window": config.sliding_window,
        **({"dualserve_rope_factors": list(config.rope_factors)} if config.rope_factors else {}),
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
    """Convert a GGUF file into a Hugging Face directory (safetensors + tokenizer), streaming: one
    tensor and one shard in memory at a time.

    The block types in ``GGUF_PACKED`` keep their integers and scales (``checkpoint.portable_tensors``);
    other types are stored dequantized in fp32."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, IndexError, KeyError, OSError) as e:  # truncated, not GGUF, or a newer GGUF version
        raise UnsupportedModel(f"{path.name} is not a GGUF file this build reads ({type(e).__name__}: {e})") from None
    config = read_gguf_config(gguf_metadata(reader))
    by_name = {t.name: t for t in reader.tensors}
    if "rope_factors_long.weight" in by_name:
        raise UnsupportedModel(f"{path.name}: LongRoPE scaling (rope_factors_long) is not supported")
    if "rope_freqs.weight" in by_name:  # Llama 3.1+ scaling, as llama.cpp's divisors of each frequency
        factors = np.asarray(by_name["rope_freqs.weight"].data, dtype=np.float32)
        config = config.replace(rope_factors=tuple(float(f) for f in factors))
    tokenizer = Tokenizer.from_gguf(reader)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".partial-", dir=out_dir.parent))
    try:
        names = write_shards(gguf_weights(reader, config), tmp, {"format": "pt", "source": path.name})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if "lm_head.weight" not in names:
        config = config.replace(tie_word_embeddings=True)
    (tmp / "config.json").write_text(json.dumps(hf_config_dict(config), indent=2))
    save_tokenizer(tokenizer, tmp)
    try:
        tmp.rename(out_dir)
    except OSError:  # another process converted the same file first
        if not (out_dir / "config.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


SHARD_BYTES = 64 << 20


def write_shards(weights: Iterator[tuple[str, Weight]], out_dir: Path, metadata: dict[str, str]) -> set[str]:
    """Write a stream of weights as safetensors shards of about ``SHARD_BYTES`` (one file, model.safetensors,
    when they fit; else model-NNNNN.safetensors and an index), holding one shard at a time. Returns the
    weights' names."""
    names: set[str] = set()
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    size = 0
    files: list[str] = []

    def flush() -> None:
        nonlocal size
        file = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(out_dir / file), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, file))
        files.append(file)
        shard.clear()
        size = 0

    for name, w in weights:
        names.add(name)
        tensors = portable_tensors(name, w) if isinstance(w, dict) else {name: w}
        shard.update(tensors)
        size += sum(t.numel() * t.element_size() for t in tensors.values())
        if size >= SHARD_BYTES:
            flush()
    if shard or not files:
        flush()
    if len(files) == 1:
        (out_dir / files[0]).rename(out_dir / "model.safetensors")
    else:
        (out_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return names


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


# Bumped when the converted layout changes, so an older conversion is never read as a newer one.
CONVERTED_LAYOUT = "q2"


def converted_dir(path: Path, cache_dir: Path) -> Path:
    stat = path.stat()
    return cache_dir / "converted" / f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}-{CONVERTED_LAYOUT}"


def stored_quantization(source: Path) -> Quantization:
    """The format a checkpoint already holds: int4 when any weight is stored as int4 groups."""
    for file in safetensors_files(source):
        with safe_open(str(file), framework="pt") as f:
            if any(k.endswith(".zeros") for k in f.keys()):
                return "int4"
    return "none"


def prepare_source(path: Path, cache_dir: Path | None) -> Path:
    """The Hugging Face directory a model loads from: itself, or its GGUF's conversion (made once)."""
    if path.is_file() and path.suffix == ".gguf":
        target = converted_dir(path, cache_dir or path.parent / ".dualserve")
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            log.info("converting %s into %s (once; later loads read the conversion) ...", path.name, target)
            start = time.perf_counter()
            convert_gguf(path, target)
            log.info("converted %s in %.1fs", path.name, time.perf_counter() - start)
        return target
    return path


def load_model(path: Path | str, *, name: str | None = None, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", cache_dir: Path | None = None,
               quantization: Quantization | Literal["auto"] = "none") -> LoadedModel:
    """Load a Hugging Face directory or a GGUF file (converted once into ``cache_dir``).

    ``quantization``: ``none`` computes in ``dtype`` from float weights; ``int8`` / ``int4``
    quantize at load (exactly, for GGUF Q4_0/Q4_1/Q8_0 data); ``auto`` keeps the format the
    checkpoint holds (int4 for a Q4 GGUF, else none).
    """
    start = time.perf_counter()
    path = Path(path)
    if is_twin_dir(path):
        return load_twin(path, name=name, dtype=dtype, device=device, cache_dir=cache_dir,
                         quantization=quantization)
    source = prepare_source(path, cache_dir)
    raw = json.loads((source / "config.json").read_text())
    row = of_hf(raw)
    if row.load is not None:  # a network with its own loader (float weights only)
        return row.load(source, dtype, device, name=name)
    if quantization == "auto":
        quantization = stored_quantization(source)
    config = read_config(raw)
    # The tokenizer first: parsing a large vocabulary (Gemma's 262k tokens) briefly takes hundreds of
    # MB, which would otherwise come on top of the loaded weights at the load's peak.
    tokenizer = Tokenizer.from_hf_dir(source)
    model = build(config, load_hf_state(source, config), dtype, device, quantization)
    place_on_huge_pages(model)  # a decode streams every weight: on 2 MB pages, not 4 KB ones
    if tokenizer.chat_template is None:  # a file without one: the family's own turn format
        tokenizer.chat_template = family(config.family).chat_template
    return LoadedModel(name=name or (path.stem if path.is_file() else path.name), path=path,
                       config=model.config, model=model, tokenizer=tokenizer,
                       load_seconds=time.perf_counter() - start, quantization=quantization)


def load_twin(path: Path | str, *, name: str | None = None, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu", cache_dir: Path | None = None,
              base: LoadedModel | None = None, quantization: Quantization | Literal["auto"] = "none") -> LoadedModel:
    """Load a twin directory: its base model (the default model by name, else a path), then the adapter.

    ``base_model`` in config.json is resolved relative to the twin directory when it
    is a relative path. Pass ``base`` to reuse a loaded base instead of loading it again.
    """
    from .hub import ALIASES, default_cache_dir, resolve_model

    path = Path(path)
    if base is None:
        spec = TwinSpec.from_config(json.loads((path / "config.json").read_text()))
        cache = cache_dir or default_cache_dir()
        if spec.base_model in ALIASES:
            base_name, base_path = resolve_model(spec.base_model, cache)
        else:
            base_path = Path(spec.base_model).expanduser()
            base_path = base_path if base_path.is_absolute() else path / base_path
            base_name = base_path.stem if base_path.is_file() else base_path.name
        base = load_model(base_path, name=base_name, dtype=dtype, device=device, cache_dir=cache,
                          quantization=quantization)
    return apply_twin(base, path, name=name)

