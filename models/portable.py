"""The portable layout of quantized weights, and GGUF's block types in it.

A portable entry is what the loader hands to ``quant.to_linear`` and what the model cache stores
(``checkpoint.portable_tensors``): plain integers and float scales in groups of 32 inputs, with
no kernel's packing. Its kind follows from its keys and the dtype of ``qweight``
(``portable_kind``):

  * ``int4``: ``qweight`` uint8 (out, in) in 0..15, ``scales`` and ``zeros`` (out, groups),
    ``w = scale * q + zero`` (GGUF Q4_0, Q4_1, Q4_K);
  * ``int8_grouped``: ``qweight`` int8 and ``scales``, ``w = scale * q`` (Q8_0, Q5_0, Q6_K,
    IQ4_NL, IQ4_XS);
  * ``int8_asym``: ``qweight`` int8 with ``zeros``, ``w = scale * q + zero`` (Q5_1, Q5_K).

Any kind may carry integer multipliers, for the K-quants and IQ4_XS, whose per-group scales
``D * sc`` (fp16 times a 6-bit integer) and minimums ``Dmin * m`` are not fp16 numbers:
``scale_mult`` int8 (out, groups, 2), one for inputs 0..15 and one for 16..31 (Q6_K's sub-scales
cover 16 inputs), and with zeros ``zero_mult`` int8 (out, groups). Then ``scales`` and ``zeros``
hold the super-block's ``D`` and ``-Dmin``, repeated over its 8 groups, and
``w = (scale * scale_mult) * q + zero * zero_mult``: the fp32 operations, in the order, of
``gguf.quants.dequantize``, so ``dequantize_portable`` gives its bits exactly. Every scale and
zero is an fp16 value, so the dot8 kernel holds them without rounding.

Block layouts: ggml-common.h (``block_q4_K`` ...), as read by the ``gguf`` package's
``gguf/quants.py``, which is the reference the tests compare against.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

PORTABLE_KEYS = ("qweight", "scales", "zeros", "scale_mult", "zero_mult")
PortableKind = Literal["int4", "int8_grouped", "int8_asym"]

# GGUF block types kept in their own integers (``gguf_blocks``); the loader dequantizes the others.
GGUF_PACKED = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")

BLOCK_ROWS_BYTES = 1 << 19  # of a GGUF tensor's raw rows converted at a time (``gguf_blocks``)

# IQ4_NL's and IQ4_XS's 16 non-linear levels (ggml-common.h: kvalues_iq4nl).
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def portable_kind(parts: dict[str, torch.Tensor]) -> PortableKind:
    if "zeros" not in parts:
        return "int8_grouped"
    return "int8_asym" if parts["qweight"].dtype == torch.int8 else "int4"


def dequantize_portable(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float32 weight (out, in) a portable entry stands for, in gguf.quants' order of operations."""
    q = parts["qweight"]
    out, inp = q.shape
    groups = parts["scales"].shape[-1]
    scale = parts["scales"].float()[..., None]                            # (out, groups, 1)
    if "scale_mult" in parts:
        scale = scale * parts["scale_mult"].float()                        # (out, groups, 2): per half group
    w = q.float().view(out, groups, scale.shape[-1], inp // (groups * scale.shape[-1])) * scale[..., None]
    if "zeros" in parts:
        zero = parts["zeros"].float()
        if "zero_mult" in parts:
            zero = zero * parts["zero_mult"].float()
        w = w + zero[..., None, None]
    return w.view(out, inp)


def widened(parts: dict[str, torch.Tensor], kind: PortableKind, mult: bool) -> dict[str, torch.Tensor]:
    """``parts`` as a wider kind, exactly: int4 as int8, no minimum as a zero one, unit multipliers."""
    out = dict(parts)
    if kind != "int4":
        out["qweight"] = parts["qweight"].to(torch.int8)
    if kind != "int8_grouped" and "zeros" not in parts:
        out["zeros"] = torch.zeros_like(parts["scales"])
        if "scale_mult" in parts:
            out["zero_mult"] = torch.zeros_like(parts["scales"], dtype=torch.int8)
    if mult and "scale_mult" not in parts:
        out["scale_mult"] = torch.ones(*parts["scales"].shape, 2, dtype=torch.int8)
        if "zeros" in out:
            out["zero_mult"] = torch.ones_like(parts["scales"], dtype=torch.int8)
    return out


def concat_portable(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack several portable weights along the output dimension (fused q/k/v, gate/up). Parts of
    different kinds (a K-quant file's Q4_K q and k beside a Q6_K v) are first widened to the
    narrowest kind that holds them all, exactly (``widened``)."""
    kinds = {portable_kind(p) for p in parts}
    kind: PortableKind = kinds.pop() if len(kinds) == 1 else "int8_asym"
    mult = any("scale_mult" in p for p in parts)
    parts = [widened(p, kind, mult) for p in parts]
    return {k: torch.cat([p[k] for p in parts], 0) for k in parts[0]}


# ---- GGUF blocks ---------------------------------------------------------------

def _f16(b: np.ndarray) -> np.ndarray:
    """(..., 2) bytes -> the fp16 values (...) as float32."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., 16) bytes -> (..., 32): low nibbles are elements 0..15, high 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's (..., 4) bytes of high bits (a little-endian uint32) -> (..., 32) bits."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and minimums -> (..., 8) each (ggml's get_scale_min_k4)."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _super(v: np.ndarray) -> np.ndarray:
    """A super-block's value (rows, blocks) repeated over its 8 groups of 32: (rows, blocks * 8)."""
    return np.repeat(v, 8, axis=-1)


def _entry(rows: int, q: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None = None,
           scale_mult: np.ndarray | None = None, zero_mult: np.ndarray | None = None) -> dict[str, torch.Tensor]:
    out = {"qweight": torch.from_numpy(np.ascontiguousarray(q).reshape(rows, -1)),
           "scales": torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32).reshape(rows, -1))}
    if zeros is not None:
        out["zeros"] = torch.from_numpy(np.ascontiguousarray(zeros, dtype=np.float32).reshape(rows, -1))
    if scale_mult is not None:
        out["scale_mult"] = torch.from_numpy(np.ascontiguousarray(scale_mult, dtype=np.int8).reshape(rows, -1, 2))
    if zero_mult is not None:
        out["zero_mult"] = torch.from_numpy(np.ascontiguousarray(zero_mult, dtype=np.int8).reshape(rows, -1))
    return out


def _k_quant(b: np.ndarray, q: np.ndarray, rows: int, bits: int) -> dict[str, torch.Tensor]:
    """Q4_K/Q5_K: w = (D sc) q - Dmin m per group of 32, D and Dmin fp16 per 256, sc and m 6-bit."""
    sc, mn = _k_scales(b[..., 4:16])
    two = np.stack([sc, sc], axis=-1)
    qweight = q.astype(np.uint8 if bits == 4 else np.int8)
    return _entry(rows, qweight, _super(_f16(b[..., 0:2])), _super(-_f16(b[..., 2:4])), two, mn)


def gguf_blocks(data: np.ndarray, kind: str) -> dict[str, torch.Tensor]:
    """Raw GGUF rows (rows, bytes) of a ``GGUF_PACKED`` type -> the portable layout, no rounding. Rows
    are converted a few at a time (``BLOCK_ROWS_BYTES`` of the file each) into the preallocated
    result, so the temporaries stay a few MB for any tensor (an output head's among them)."""
    rows = data.shape[0]
    step = max(1, BLOCK_ROWS_BYTES // max(data.shape[1], 1))
    first = _blocks(data[:step], kind)
    if step >= rows:
        return first
    out = {k: torch.empty((rows, *v.shape[1:]), dtype=v.dtype) for k, v in first.items()}
    for r in range(0, rows, step):
        part = first if r == 0 else _blocks(data[r: r + step], kind)
        for k, v in part.items():
            out[k][r: r + step] = v
    return out


def _blocks(data: np.ndarray, kind: str) -> dict[str, torch.Tensor]:
    rows = data.shape[0]
    if kind == "Q4_0":  # d, 16 bytes of nibbles; w = d (q - 8)
        b = data.reshape(rows, -1, 18)
        d = _f16(b[..., :2])
        return _entry(rows, _nibbles(b[..., 2:]), d, -8 * d)
    if kind == "Q4_1":  # d, m, 16 bytes of nibbles; w = d q + m
        b = data.reshape(rows, -1, 20)
        return _entry(rows, _nibbles(b[..., 4:]), _f16(b[..., :2]), _f16(b[..., 2:4]))
    if kind == "Q8_0":  # d, 32 int8; w = d q
        b = data.reshape(rows, -1, 34)
        return _entry(rows, b[..., 2:].copy().view(np.int8), _f16(b[..., :2]))
    if kind == "Q5_0":  # d, 4 bytes of fifth bits, 16 bytes of nibbles; w = d (q - 16)
        b = data.reshape(rows, -1, 22)
        q = _nibbles(b[..., 6:]) | (_fifth_bits(b[..., 2:6]) << 4)
        return _entry(rows, q.astype(np.int8) - 16, _f16(b[..., :2]))
    if kind == "Q5_1":  # d, m, 4 bytes of fifth bits, 16 bytes of nibbles; w = d q + m
        b = data.reshape(rows, -1, 24)
        q = _nibbles(b[..., 8:]) | (_fifth_bits(b[..., 4:8]) << 4)
        return _entry(rows, q.astype(np.int8), _f16(b[..., :2]), _f16(b[..., 2:4]))
    if kind == "IQ4_NL":  # d, 16 bytes of nibbles indexing IQ4_LEVELS; w = d level
        b = data.reshape(rows, -1, 18)
        return _entry(rows, IQ4_LEVELS[_nibbles(b[..., 2:])], _f16(b[..., :2]))
    if kind == "Q4_K":  # D, Dmin, 12 bytes of scales, 128 bytes: 32 bytes hold groups 2i (low) and 2i+1 (high)
        b = data.reshape(rows, -1, 144)
        qs = b[..., 16:].reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8)[:, None]
        return _k_quant(b, qs & 0x0F, rows, 4)
    if kind == "Q5_K":  # as Q4_K, with 32 bytes of fifth bits before the nibbles: bit j for group j
        b = data.reshape(rows, -1, 176)
        low = b[..., 48:].reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8)[:, None]
        high = b[..., 16:48].reshape(rows, -1, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]
        return _k_quant(b, (low & 0x0F).reshape(rows, -1, 8, 32) | ((high & 1) << 4), rows, 8)
    if kind == "Q6_K":  # 128 bytes of low nibbles, 64 of high 2 bits, 16 int8 scales (per 16), D; w = D s (q - 32)
        b = data.reshape(rows, -1, 210)
        low = (b[..., :128].reshape(rows, -1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8)[:, None]) & 0x0F
        high = (b[..., 128:192].reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
        q = low.reshape(rows, -1, 8, 32) | (high.reshape(rows, -1, 8, 32) << 4)
        sub = b[..., 192:208].copy().view(np.int8).reshape(rows, -1, 8, 2)
        return _entry(rows, q.astype(np.int8) - 32, _super(_f16(b[..., 208:210])), scale_mult=sub)
    if kind == "IQ4_XS":  # D, 2 bytes of scales' high bits, 4 of low nibbles, 128 bytes of level indices
        b = data.reshape(rows, -1, 136)
        high = (b[..., 2:4].copy().view(np.uint16) >> (2 * np.arange(8, dtype=np.uint16))) & 3
        low = (b[..., 4:8, None] >> np.array([0, 4], dtype=np.uint8)).reshape(rows, -1, 8) & 0x0F
        ls = (low | (high.astype(np.uint8) << 4)).astype(np.int8) - 32           # (rows, blocks, 8)
        q = IQ4_LEVELS[_nibbles(b[..., 8:].reshape(rows, -1, 8, 16))]
        return _entry(rows, q, _super(_f16(b[..., :2])), scale_mult=np.stack([ls, ls], axis=-1))
    raise ValueError(f"no direct layout for GGUF {kind}")
