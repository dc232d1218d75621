"""Write a random-weight GGUF of any Llama / Qwen shape, for benchmarks only.

Run as::

    python -m dualserve.clients.write_gguf /work/bench/llama-3.2-1b-q4_0.gguf --shape llama-3.2-1b
    python -m dualserve.clients.write_gguf tiny.gguf --arch qwen3 --hidden 256 --layers 2 --heads 4 \\
        --kv-heads 2 --head-dim 64 --ffn 512 --type Q4_K

A benchmark of a bigger model than the default needs a file of that shape, not its trained
weights: the cost of a step depends on the shapes and the block types alone. Design choices:

- **The tokenizer is copied**, every ``tokenizer.*`` key (vocabulary, merges, token types, special
  ids, chat template), from a source GGUF, by default the default model's file as ``--model``
  resolves it. The file tokenizes like the default model, so the benchmark prompts give the same
  token counts, and the vocabulary (hence the embedding and head) has the source's size, not the
  named model's (49152 rows for the default source, not Llama 3.2's 128256).
- **Raw blocks, not quantized floats.** Each block's integers are random bytes; its fp16 scale
  (and min) fields are set so that the weights have mean 0 and standard deviation about 0.02
  (``STD``), the usual initialisation. Writing bytes is fast for every block type, K-quants
  included, which ``gguf.quants`` cannot quantize. Norm weights are 1, Qwen2's q/k/v biases
  random with the same deviation.
- **Control tokens never win.** Their rows of the embedding (and of an untied head) are zero, so
  their logits are 0 while the random tokens' maxima are several times larger: a greedy reply
  never ends early on an end-of-turn token and every request decodes its full ``max_tokens``.
- **Streamed.** All tensor infos are declared first, then each tensor is made and written in
  turn (``GGUFWriter.add_tensor_info`` / ``write_tensor_data``), so the largest array in memory
  is one tensor (the embedding) however large the model.
- **llama.cpp's names, shapes and keys.** Tensors as in llama.cpp's ``LLM_TENSOR_NAMES``
  (``blk.N.attn_q`` ... ``ffn_down``, ``token_embd``, ``output``; ``attn_{q,k,v}.bias`` for qwen2,
  ``attn_{q,k}_norm`` for qwen3); a row length a block type cannot hold falls back as llama.cpp's
  quantizer does (``src/llama-quant.cpp``: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, then F16).
  No ``rope_freqs`` tensor (Llama 3's rope scaling): it changes no step's cost.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

import numpy as np

Arch = Literal["llama", "qwen2", "qwen3", "gemma3"]
ARCHES: tuple[Arch, ...] = ("llama", "qwen2", "qwen3", "gemma3")
TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "F16", "F32")
STD = 0.02  # standard deviation of every random weight


@dataclass(frozen=True)
class Shape:
    """The hyperparameters a GGUF of this family needs (vocabulary size comes from the tokenizer)."""

    arch: Arch
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    rope_theta: float
    rms_eps: float
    context_length: int
    tied: bool
    sliding_window: int | None = None  # gemma3: its local layers' window


# From each model's config.json on the Hugging Face hub.
PRESETS: dict[str, Shape] = {
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 64, 8192, 500000.0, 1e-5, 131072, True),
    "llama-3.2-3b": Shape("llama", 3072, 28, 24, 8, 128, 8192, 500000.0, 1e-5, 131072, True),
    "qwen2.5-0.5b": Shape("qwen2", 896, 24, 14, 2, 64, 4864, 1000000.0, 1e-6, 32768, True),
    "qwen2.5-1.5b": Shape("qwen2", 1536, 28, 12, 2, 128, 8960, 1000000.0, 1e-6, 32768, True),
    "qwen3-0.6b": Shape("qwen3", 1024, 28, 16, 8, 128, 3072, 1000000.0, 1e-6, 40960, True),
    "gemma-3-270m": Shape("gemma3", 640, 18, 4, 1, 256, 2048, 1000000.0, 1e-6, 32768, True, 512),
    "gemma-3-1b": Shape("gemma3", 1152, 26, 4, 1, 256, 6912, 1000000.0, 1e-6, 32768, True, 512),
}


# ---------------------------------------------------------------------------------------------
# Random blocks


def _uniform_std(bits: int) -> float:
    """Standard deviation of an integer uniform on 0 .. 2**bits - 1."""
    return float(np.sqrt((4.0**bits - 1) / 12))


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    """(n,) floats -> (n, 2) little-endian fp16 bytes."""
    return np.ascontiguousarray(values, dtype="<f2").view(np.uint8).reshape(-1, 2)


def _signs(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.choice(np.array([-1.0, 1.0]), n)


def _k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """(n, 8) 6-bit sub-block scales and mins -> (n, 12) bytes, inverse of ``get_scale_min_k4``
    in ggml's ``ggml-quants.c``."""
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    return out


def random_blocks(kind: str, n: int, rng: np.random.Generator, std: float = STD) -> np.ndarray:
    """(n, bytes per block) random blocks of a GGUF quant type, weights of mean 0 and deviation ``std``.

    Layouts from ggml's ``ggml-common.h``: the integer fields stay random bytes, the fp16 scales are
    chosen. Symmetric types get a random sign on ``d`` (zero mean); types with a min get
    ``m = -d * mean(q)``; K-quants draw their 6-bit sub-block scales from 8..15.
    """
    import gguf

    size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][1]
    b = np.frombuffer(rng.bytes(n * size), np.uint8).reshape(n, size).copy()
    if kind in ("Q4_0", "Q5_0", "Q8_0"):  # d, then q: w = d * (q - offset)
        bits = {"Q4_0": 4, "Q5_0": 5, "Q8_0": 8}[kind]
        b[:, 0:2] = _f16_bytes(_signs(rng, n) * std / _uniform_std(bits))
    elif kind in ("Q4_1", "Q5_1"):  # d, m, then q: w = d * q + m
        bits = 4 if kind == "Q4_1" else 5
        d = np.full(n, std / _uniform_std(bits))
        b[:, 0:2] = _f16_bytes(d)
        b[:, 2:4] = _f16_bytes(-d * (2**bits - 1) / 2)
    elif kind in ("Q4_K", "Q5_K"):  # d, dmin, 12 scale bytes, ...: w = d * sc * q - dmin * m
        bits = 4 if kind == "Q4_K" else 5
        sc = rng.integers(8, 16, (n, 8), dtype=np.uint8)
        rms_sc = float(np.sqrt(np.mean(np.arange(8, 16) ** 2)))
        d = np.full(n, std / (rms_sc * _uniform_std(bits)))
        b[:, 0:2] = _f16_bytes(d)
        b[:, 2:4] = _f16_bytes(d * (2**bits - 1) / 2)  # m = sc: each sub-block centred
        b[:, 4:16] = _k_scales(sc, sc)
    elif kind == "Q6_K":  # ql, qh, 16 int8 scales, d: w = d * sc * (q - 32)
        sc = rng.integers(8, 16, (n, 16)) * _signs(rng, n * 16).reshape(n, 16)
        b[:, 192:208] = sc.astype(np.int8).view(np.uint8)
        rms_sc = float(np.sqrt(np.mean(np.arange(8, 16) ** 2)))
        b[:, 208:210] = _f16_bytes(np.full(n, std / (rms_sc * _uniform_std(6))))
    else:
        raise ValueError(f"no random block layout for {kind}")
    return b


# ---------------------------------------------------------------------------------------------
# Tensors

Fill = Literal["random", "ones"]

# llama.cpp's quantizer, for a row length the chosen block does not divide (src/llama-quant.cpp).
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of the file: llama.cpp name, numpy shape (rows = output features), type, fill."""

    name: str
    shape: tuple[int, ...]
    kind: str
    fill: Fill = "random"
    zero_rows: tuple[int, ...] = ()  # rows left zero (control tokens in the embedding and head)

    @property
    def params(self) -> int:
        return int(np.prod(self.shape))

    @property
    def byte_shape(self) -> tuple[int, ...]:
        import gguf

        if self.kind in ("F16", "F32"):
            return self.shape
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[self.kind]]
        return (*self.shape[:-1], self.shape[-1] // block * size)

    @property
    def nbytes(self) -> int:
        per = {"F32": 4, "F16": 2}.get(self.kind, 1)
        return int(np.prod(self.byte_shape)) * per


def block_type(kind: str, row: int) -> str:
    """``kind``, or llama.cpp's fallback when ``row`` elements are not a whole number of its blocks."""
    import gguf

    while kind not in ("F16", "F32") and row % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][0]:
        kind = FALLBACK.get(kind, "F16")
    return kind


def plan_tensors(shape: Shape, vocab: int, matrix_type: str, embedding_type: str,
                 control_ids: Sequence[int] = ()) -> list[TensorPlan]:
    """Every tensor llama.cpp's ``llm_build_llama`` / ``qwen2`` / ``qwen3`` / ``gemma3`` reads."""
    h, q_dim, kv_dim = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    zero = tuple(sorted(set(control_ids)))

    def matrix(name: str, rows: int, cols: int) -> TensorPlan:
        return TensorPlan(name, (rows, cols), block_type(matrix_type, cols))

    plans = [TensorPlan("token_embd.weight", (vocab, h), block_type(embedding_type, h), zero_rows=zero)]
    for i in range(shape.layers):
        p = f"blk.{i}."
        plans += [TensorPlan(p + "attn_norm.weight", (h,), "F32", "ones"),
                  matrix(p + "attn_q.weight", q_dim, h), matrix(p + "attn_k.weight", kv_dim, h),
                  matrix(p + "attn_v.weight", kv_dim, h), matrix(p + "attn_output.weight", h, q_dim)]
        if shape.arch == "qwen2":
            plans += [TensorPlan(p + "attn_q.bias", (q_dim,), "F32"), TensorPlan(p + "attn_k.bias", (kv_dim,), "F32"),
                      TensorPlan(p + "attn_v.bias", (kv_dim,), "F32")]
        if shape.arch in ("qwen3", "gemma3"):
            plans += [TensorPlan(p + "attn_q_norm.weight", (shape.head_dim,), "F32", "ones"),
                      TensorPlan(p + "attn_k_norm.weight", (shape.head_dim,), "F32", "ones")]
        if shape.arch == "gemma3":  # norms after attention and the feed-forward too (GGUF holds 1 + w)
            plans += [TensorPlan(p + "post_attention_norm.weight", (h,), "F32", "ones"),
                      TensorPlan(p + "post_ffw_norm.weight", (h,), "F32", "ones")]
        plans += [TensorPlan(p + "ffn_norm.weight", (h,), "F32", "ones"),
                  matrix(p + "ffn_gate.weight", shape.ffn, h), matrix(p + "ffn_up.weight", shape.ffn, h),
                  matrix(p + "ffn_down.weight", h, shape.ffn)]
    plans.append(TensorPlan("output_norm.weight", (h,), "F32", "ones"))
    if not shape.tied:
        plans.append(TensorPlan("output.weight", (vocab, h), block_type(embedding_type, h), zero_rows=zero))
    return plans


def tensor_data(plan: TensorPlan, rng: np.random.Generator) -> np.ndarray:
    """The bytes (quant types) or floats (F16 / F32) of one tensor, shaped ``plan.byte_shape``."""
    if plan.fill == "ones":
        data = np.ones(plan.shape, np.float32 if plan.kind == "F32" else np.float16)
    elif plan.kind in ("F16", "F32"):
        data = (rng.standard_normal(plan.shape, np.float32) * STD).astype(np.float32 if plan.kind == "F32"
                                                                           else np.float16)
    else:
        data = random_blocks(plan.kind, int(np.prod(plan.byte_shape)) // _block_bytes(plan.kind), rng)
        data = data.reshape(plan.byte_shape)
    if plan.zero_rows:
        data[list(plan.zero_rows)] = 0  # all-zero bytes are weight 0 in every block type
    return data


def _block_bytes(kind: str) -> int:
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][1]


# ---------------------------------------------------------------------------------------------
# The file


@dataclass(frozen=True)
class MetaField:
    """One metadata key copied from the source GGUF, with its GGUF value types."""

    key: str
    value: object
    vtype: object  # gguf.GGUFValueType
    sub_type: object | None = None


def tokenizer_fields(source: Path) -> list[MetaField]:
    """Every ``tokenizer.*`` key of ``source`` (vocabulary, merges, token types, ids, chat template)."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    out = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = gguf.GGUFValueType(field.types[0])
        sub = gguf.GGUFValueType(field.types[1]) if vtype == gguf.GGUFValueType.ARRAY else None
        out.append(MetaField(key, field.contents(), vtype, sub))
    if not any(f.key == "tokenizer.ggml.tokens" for f in out):
        raise ValueError(f"{source} has no tokenizer.ggml.tokens")
    return out


def control_token_ids(fields: Sequence[MetaField]) -> list[int]:
    """Control tokens (llama.cpp's token type 3) and the end-of-sequence ids."""
    meta = {f.key: f.value for f in fields}
    ids = [i for i, t in enumerate(meta.get("tokenizer.ggml.token_type", ())) if t == 3]
    ids += [int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    return sorted(set(ids))


FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "Q4_0": "MOSTLY_Q4_0", "Q4_1": "MOSTLY_Q4_1",
              "Q8_0": "MOSTLY_Q8_0", "Q5_0": "MOSTLY_Q5_0", "Q5_1": "MOSTLY_Q5_1", "Q4_K": "MOSTLY_Q4_K_S",
              "Q5_K": "MOSTLY_Q5_K_S", "Q6_K": "MOSTLY_Q6_K"}


def add_metadata(writer, shape: Shape, vocab: int, matrix_type: str, name: str,
                 fields: Sequence[MetaField]) -> None:
    import gguf

    writer.add_type("model")
    writer.add_name(name)
    writer.add_description("random weights, for benchmarks only (dualserve.clients.write_gguf)")
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_rope_dimension_count(shape.head_dim)
    if shape.head_dim * shape.heads != shape.hidden:  # else llama.cpp derives it as hidden / heads
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    if shape.sliding_window:
        writer.add_sliding_window(shape.sliding_window)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType[FILE_TYPES[matrix_type]])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for f in fields:
        writer.add_key_value(f.key, f.value, f.vtype, sub_type=f.sub_type)


@dataclass(frozen=True)
class Written:
    path: Path
    nbytes: int
    params: int
    embedding_params: int  # the embedding and an untied head
    fallbacks: dict[str, str]  # tensor name -> block type used instead of the one asked for
    seconds: float


def write_gguf(out: Path, shape: Shape, fields: Sequence[MetaField], *, matrix_type: str = "Q4_0",
               embedding_type: str = "Q8_0", seed: int = 0, name: str = "random") -> Written:
    """Write the file (through ``out.partial``, renamed at the end)."""
    import gguf

    start = time.perf_counter()
    tokens = next(f.value for f in fields if f.key == "tokenizer.ggml.tokens")
    vocab = len(tokens)
    plans = plan_tensors(shape, vocab, matrix_type, embedding_type, control_token_ids(fields))
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(partial, shape.arch)
    add_metadata(writer, shape, vocab, matrix_type, name, fields)
    for p in plans:
        dtype = {"F32": np.float32, "F16": np.float16}.get(p.kind, np.uint8)
        writer.add_tensor_info(p.name, p.byte_shape, np.dtype(dtype), p.nbytes,
                               raw_dtype=gguf.GGMLQuantizationType[p.kind])
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for i, p in enumerate(plans):  # one generator per tensor: a tensor's bytes do not depend on order
            writer.write_tensor_data(tensor_data(p, np.random.default_rng([seed, i])))
    finally:
        writer.close()
    partial.replace(out)
    wanted = {"token_embd.weight": embedding_type, "output.weight": embedding_type}
    fallbacks = {p.name: p.kind for p in plans
                 if len(p.shape) == 2 and p.kind != wanted.get(p.name, matrix_type)}
    embedding = sum(p.params for p in plans if p.name in wanted)
    return Written(out, out.stat().st_size, sum(p.params for p in plans), embedding, fallbacks,
                   time.perf_counter() - start)


# ---------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dualserve.clients.write_gguf", description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path, help="the GGUF file to write")
    p.add_argument("--shape", choices=sorted(PRESETS), help="a named shape; the flags below override its fields")
    p.add_argument("--arch", choices=ARCHES)
    for flag, what in (("hidden", "embedding width"), ("layers", "decoder layers"), ("heads", "query heads"),
                       ("kv-heads", "key/value heads (default: --heads)"), ("ffn", "SwiGLU width"),
                       ("head-dim", "per-head width (default: hidden / heads)"),
                       ("context-length", "context_length key (default 32768)")):
        p.add_argument(f"--{flag}", type=int, help=what)
    p.add_argument("--rope-theta", type=float, help="rope.freq_base (default 500000 for llama, 1e6 for qwen)")
    p.add_argument("--type", dest="matrix_type", choices=TYPES, default="Q4_0",
                   help="block type of the layers' matrices")
    p.add_argument("--embedding-type", choices=TYPES, default="Q8_0",
                   help="block type of the embedding and of an untied head")
    p.add_argument("--tied", action=argparse.BooleanOptionalAction, default=None,
                   help="share the embedding as the head (default: the shape's, else tied)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer-from", type=Path, default=None,
                   help="GGUF whose tokenizer.* keys are copied (default: the default model's file)")
    p.add_argument("--cache-dir", default=None, help="model cache, to find the default model")
    p.add_argument("--twin", type=Path, default=None,
                   help="also write a random diffusion twin of the file here (a rank-32 adapter on every "
                        "projection, block 4), to time a twin step at this shape")
    args = p.parse_args(argv)
    try:
        args.shape_obj = build_shape(args)
    except ValueError as exc:
        p.error(str(exc))
    return args


def build_shape(args: argparse.Namespace) -> Shape:
    """The preset named by ``--shape`` with the explicit flags laid over it."""
    given = {"arch": args.arch, "hidden": args.hidden, "layers": args.layers, "heads": args.heads,
             "kv_heads": args.kv_heads, "head_dim": args.head_dim, "ffn": args.ffn,
             "rope_theta": args.rope_theta, "context_length": args.context_length, "tied": args.tied}
    given = {k: v for k, v in given.items() if v is not None}
    if args.shape:
        shape = dataclasses.replace(PRESETS[args.shape], **given)
    else:
        missing = [f"--{k}" for k in ("arch", "hidden", "layers", "heads", "ffn") if k not in given]
        if missing:
            raise ValueError(f"without --shape, give {' '.join(missing)}")
        arch = given["arch"]
        shape = Shape(arch=arch, hidden=given["hidden"], layers=given["layers"], heads=given["heads"],
                      kv_heads=given.get("kv_heads", given["heads"]),
                      head_dim=given.get("head_dim", given["hidden"] // given["heads"]), ffn=given["ffn"],
                      rope_theta=given.get("rope_theta", 500000.0 if arch == "llama" else 1000000.0),
                      rms_eps=1e-5 if arch == "llama" else 1e-6,
                      context_length=given.get("context_length", 32768), tied=given.get("tied", True),
                      sliding_window=512 if arch == "gemma3" else None)
    if min(shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.head_dim, shape.ffn) < 1:
        raise ValueError("every width and count must be positive")
    if shape.heads % shape.kv_heads:
        raise ValueError(f"--heads {shape.heads} is not a multiple of --kv-heads {shape.kv_heads}")
    if shape.head_dim % 2:
        raise ValueError("--head-dim must be even (rope rotates pairs)")
    return shape


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    source = args.tokenizer_from
    if source is None:
        from dualserve.models.hub import default_cache_dir, resolve_model

        _, source = resolve_model(None, default_cache_dir(args.cache_dir))
    shape = args.shape_obj
    name = f"random {args.shape or shape.arch}"
    w = write_gguf(args.out, shape, tokenizer_fields(source), matrix_type=args.matrix_type,
                   embedding_type=args.embedding_type, seed=args.seed, name=name)
    print(f"wrote {w.path}: {w.nbytes / 2**20:,.1f} MiB ({w.nbytes:,} bytes) in {w.seconds:.1f}s")
    print(f"{shape.arch}: hidden {shape.hidden}, {shape.layers} layers, {shape.heads} heads / {shape.kv_heads} kv "
          f"x {shape.head_dim}, ffn {shape.ffn}, {'tied' if shape.tied else 'untied'} head; matrices "
          f"{args.matrix_type}, embedding {args.embedding_type}; tokenizer from {source.name}")
    print(f"parameters: {w.params:,} ({w.params / 1e9:.3f} B), {w.params - w.embedding_params:,} "
          f"outside the embedding and head")
    for kind in sorted(set(w.fallbacks.values())):
        names = [t for t, k in w.fallbacks.items() if k == kind]
        print(f"{len(names)} tensors as {kind} (rows not a whole number of blocks of the type asked for), "
              f"e.g. {names[0]}")
    if args.twin is not None:
        write_random_twin(args.out, args.twin, args.seed)
        print(f"wrote a random twin of it to {args.twin}")
    return 0


def write_random_twin(gguf_path: Path, out: Path, seed: int = 0, rank: int = 32, block: int = 4) -> Path:
    """A twin directory (``models/adapter.py``'s layout) over ``gguf_path`` with random factors of the
    trained twins' rank on every adapted projection: what a twin step costs at the file's shape."""
    import gguf
    import torch

    from dualserve.models.adapter import LORA_TARGETS, TwinSpec, save_twin
    from dualserve.models.families import read_gguf_config
    from dualserve.models.loader import gguf_metadata, hf_config_dict

    config = read_gguf_config(gguf_metadata(gguf.GGUFReader(str(gguf_path))))
    shapes, gen = config.projection_shapes, torch.Generator().manual_seed(seed)
    adapter = {"mask_embedding": torch.randn(config.hidden_size, generator=gen) * STD}
    for i in range(config.num_layers):
        for target in LORA_TARGETS:
            outp, inp = shapes[target]
            adapter[f"layers.{i}.{target}.lora_A"] = torch.randn(rank, inp, generator=gen) * STD
            adapter[f"layers.{i}.{target}.lora_B"] = torch.randn(outp, rank, generator=gen) * STD
    spec = TwinSpec(block_size=block, mask_token_id=config.vocab_size - 1, base_model=str(Path(gguf_path).resolve()),
                    rank=rank, alpha=float(rank), threshold=0.9)
    return save_twin(out, hf_config_dict(config), spec, adapter)


if __name__ == "__main__":
    from dualserve.models.errors import one_line

    raise SystemExit(one_line(main))
