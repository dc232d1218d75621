"""Choosing the weight format by measuring this host.

CPUs differ: the bf16 and int8 units of AVX512-BF16 and AMX make the weight-only
kernels fast where AVX2 alone may favour plain fp32. So at start-up (``--quantization
auto``) the linear shapes of the model being loaded are timed in each format, for
one token (decode) and eight (EAGLE verify, diffusion blocks, prefill), and the
fastest decode format wins. The table is cached per host and model shape under
the model cache, so only the first start pays the second or two it takes.

The estimate is the sum of the GEMMs of one forward (every layer's projections
plus the output head), timed with random weights of the right shapes; attention
and elementwise work are the same in every format and are left out.

One format serves every token count: the lossless decoders (``ar`` and EAGLE's
verify) must run the same numerics, so the multi-token column is reported, not
used to pick a second copy of the weights.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .quant import Int4Linear, Int8Linear, Quantization

Candidate = Literal["fp32", "bf16", "int8", "int4"]
CANDIDATES: tuple[Candidate, ...] = ("fp32", "bf16", "int8", "int4")
TOKENS = (1, 8)
# The checkpoint's own format is kept unless another is this much faster: it is exact to the file.
KEEP_STORED_MARGIN = 0.9


@dataclass(frozen=True)
class FormatTable:
    """Estimated GEMM milliseconds of one forward, by format and token count, on this host."""

    host: str
    ms: dict[str, dict[str, float]]   # format -> {"1": ms, "8": ms}

    def decode_ms(self, fmt: str) -> float:
        return self.ms[fmt]["1"]

    def as_rows(self) -> list[tuple[str, float, float]]:
        return [(f, v["1"], v["8"]) for f, v in self.ms.items()]


def host_key() -> str:
    """What the measurement depends on: the CPU's kernels and the thread count."""
    return f"{torch.backends.cpu.get_cpu_capability()}-amx{int(torch.cpu._is_amx_tile_supported())}-" \
           f"bf16{int(torch.cpu._is_avx512_bf16_supported())}-t{torch.get_num_threads()}-torch{torch.__version__}"


def _shapes(config: ModelConfig) -> list[tuple[int, int, int]]:
    """(out, in, count) of every GEMM in one forward."""
    h, q = config.hidden_size, config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    n = config.num_layers
    return [(q + 2 * kv, h, n), (h, q, n), (2 * config.intermediate_size, h, n), (h, config.intermediate_size, n),
            (config.vocab_size, h, 1)]


def _time(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e3


def _layer(fmt: Candidate, out: int, inp: int, head: bool):
    w = torch.randn(out, inp) * 0.02
    if fmt == "fp32":
        return lambda x: F.linear(x, w)
    if fmt == "bf16":
        wb = w.bfloat16()
        return lambda x: F.linear(x.bfloat16(), wb)
    if fmt == "int8" or head or inp % 32:
        return Int8Linear.from_float(w)  # quantized models keep an int8 head (checkpoint.HEAD_QUANTIZATION)
    return Int4Linear.from_float(w)


@torch.inference_mode()
def measure(config: ModelConfig) -> FormatTable:
    ms: dict[str, dict[str, float]] = {}
    for fmt in CANDIDATES:
        ms[fmt] = {}
        layers = [(_layer(fmt, o, i, o == config.vocab_size), i, c) for o, i, c in _shapes(config)]
        for tokens in TOKENS:
            total = 0.0
            for layer, inp, count in layers:
                x = torch.randn(tokens, inp)
                total += _time(lambda: layer(x)) * count
            ms[fmt][str(tokens)] = round(total, 3)
    return FormatTable(host_key(), ms)


def cached_measure(config: ModelConfig, cache_dir: Path | None) -> FormatTable:
    """``measure``, read from / written to ``cache_dir/formats.json`` keyed by host and model shape."""
    key = f"{host_key()}|{config.hidden_size}x{config.intermediate_size}x{config.num_layers}x{config.vocab_size}"
    path = cache_dir / "formats.json" if cache_dir else None
    known = json.loads(path.read_text()) if path and path.exists() else {}
    if key in known:
        return FormatTable(**known[key])
    table = measure(config)
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        known[key] = asdict(table)
        path.write_text(json.dumps(known, indent=1))
    return table


def choose(table: FormatTable, stored: Quantization) -> tuple[Quantization, Candidate]:
    """The decode format: the fastest one, unless the checkpoint's own is within the margin.

    Returns (quantization, candidate); quantization "none" means float weights, in
    the candidate's dtype (fp32 or bf16).
    """
    best = min(CANDIDATES, key=table.decode_ms)
    own: Candidate = "fp32" if stored == "none" else stored
    if best != own and table.decode_ms(best) > KEEP_STORED_MARGIN * table.decode_ms(own):
        best = own
    return ("none" if best in ("fp32", "bf16") else best), best
