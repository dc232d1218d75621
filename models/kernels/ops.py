"""Typed wrappers of the project's kernel ops (``torch.ops.dualserve.*``), and the rule for when
attention may run as ``attend_rows``.

Every call into the kernels goes through here, except the loader's own (``kernels/__init__.py``
loads the library, registers the ops' fake shapes for tracing and describes the code path). A
wrapper never loads the library: its caller has decided the op applies (``attend_eligible``,
``kernels.pointwise``, or a dot8 layer, which exists only where the kernels are built). The
wrappers are plain functions, so ``torch.compile`` and AOTInductor trace straight through them
to the op.

``path``: which of a kernel's code paths runs (``CodePath``; the best the CPU offers unless a
test compares them, which must give the same bits).
"""

from __future__ import annotations

from enum import IntEnum

import torch

from .. import kernels



class CodePath(IntEnum):
    """A kernel's code path, as the ops' ``force_scalar`` argument numbers them."""

    BEST = 0    # the best the CPU offers for the shape
    SCALAR = 1  # plain C
    AVX2 = 2    # attend_rows, silu_mul: AVX2 even where AVX-512 is there; dot8: vectors without AMX tiles
    AMX = 3     # dot8: AMX tiles at every row count, where the CPU has them


# attend_rows vectorises over head_dim in 16-float lanes (``attend.cpp``).
ATTEND_LANES = 16


def attend_eligible(q: torch.Tensor) -> bool:
    """Whether attention for queries like ``q`` (tokens, heads, head_dim) may run as ``attend_rows``:
    fp32 on the CPU, head_dim a whole number of the kernel's lanes, and the kernels built."""
    return (q.dtype == torch.float32 and q.device.type == "cpu" and q.shape[-1] % ATTEND_LANES == 0
            and kernels.available())


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                rows: torch.Tensor, context: torch.Tensor, mask: torch.Tensor, scale: float,
                path: CodePath = CodePath.BEST) -> torch.Tensor:
    """Paged attention, each query row over its visible keys alone (``attend.cpp``): ``q`` (T, heads,
    head_dim), the step's ``k``/``v`` (T, kv_heads, head_dim) and the caches (slots, kv_heads,
    head_dim); ``rows`` (S, Q) each sequence's query rows, ``context`` (S, W) its cached slots,
    ``mask`` (S, Q, W + Q). Returns (T, heads, head_dim)."""
    return torch.ops.dualserve.attend_rows(q, k, v, k_cache, v_cache, rows, context, mask, scale, int(path))


def dot8_linear(x: torch.Tensor, packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor, out_features: int,
                bits: int, digits: int = 1, s: torch.Tensor | None = None, mn: torch.Tensor | None = None,
                minimum: bool = False, path: CodePath = CodePath.BEST) -> torch.Tensor:
    """``x`` (rows, in_features), contiguous, times a packed ``bits``-bit weight (``layout.pack``:
    scales ``d``, minimums ``m``, multipliers ``s``/``mn``), activations quantized to ``digits``
    int8 digits per group. Returns (rows, out_features) fp32."""
    return torch.ops.dualserve.dot8_linear(x, packed, d, m, out_features, bits, int(path), digits, s, mn,
                                           minimum)


def dot8_lora(x: torch.Tensor, packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor, out_features: int,
              bits: int, down: tuple[torch.Tensor, torch.Tensor, torch.Tensor], rank: int,
              up: tuple[torch.Tensor, torch.Tensor, torch.Tensor], digits: int = 1, s: torch.Tensor | None = None,
              mn: torch.Tensor | None = None, minimum: bool = False, path: CodePath = CodePath.BEST) -> torch.Tensor:
    """``dot8_linear`` plus a LoRA delta in the same pass: ``down`` and ``up`` are the 8-bit factors'
    (packed, d, m), ``down`` (rank, in_features) and ``up`` (out_features, rank)."""
    return torch.ops.dualserve.dot8_lora(x, packed, d, m, out_features, bits, *down, rank, *up, int(path),
                                         digits, s, mn, minimum)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension, fp32 (``pointwise.cpp``)."""
    return torch.ops.dualserve.rms_norm(x, weight, eps)


def silu_mul(gate_up: torch.Tensor, path: CodePath = CodePath.BEST) -> torch.Tensor:
    """SwiGLU: silu(gate) * up, ``gate_up`` (..., 2 * intermediate) holding gate then up."""
    return torch.ops.dualserve.silu_mul(gate_up, int(path))


def rotary(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary cos and sin, each (tokens, head_dim), for ``positions`` (tokens,) and ``inv_freq``
    (head_dim / 2,)."""
    cos, sin = torch.ops.dualserve.rotary(positions, inv_freq)
    return cos, sin


def store_eligible(pool: torch.Tensor) -> bool:
    """Whether a step's keys and values may go into ``pool`` by ``store_kv``: a CPU pool whose slot
    rows are contiguous, and the kernels built."""
    return (pool.device.type == "cpu" and pool.stride(-1) == 1 and pool.stride(-2) == pool.shape[-1]
            and kernels.available())


def store_kv(pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """A step's new keys and values into the KV pool (``kv_store.cpp``): ``pool`` (2 L, slots, kv_heads,
    head_dim) holds every layer's keys then every layer's values, ``k`` and ``v`` (L, tokens, kv_heads,
    head_dim) in its dtype, stored at ``slots`` (tokens,)."""
    torch.ops.dualserve.store_kv(pool, slots, k, v)
