"""Quantized weights: weight-only int8 (per output channel) and int4 (groups along the input).

A quantized model keeps one copy of each linear layer's weight in a low-bit
layout and multiplies with PyTorch's own weight-only kernels, so batch-1
decoding streams 4 to 8 times fewer bytes than fp32:

  * ``Int4Linear``: asymmetric groups of ``group_size`` input columns,
    ``w = q * scale + zero`` with q in 0..15. Runs ``aten._weight_int4pack_mm_for_cpu``
    (``aten._weight_int4pack_mm`` on CUDA), whose packed layout and
    ``(q - 8) * scale + mid`` convention are its own; ``mid = zero + 8 * scale``. CUDA's
    packing takes only some shapes (``cuda_int4_inner_k_tiles``); a layer it does not take is
    kept in the model's float dtype there (``layer_format``), and the output head too.
  * ``Int8Linear``: symmetric per output channel, ``w = q * scale``, ``aten._weight_int8pack_mm``.
  * ``W8A8Linear``: int8 per output channel times int8 activations quantized per
    token at run time (``torch._int_mm``, int32 accumulation; padded on CUDA to the shapes cuBLAS
    takes, ``padded_int_mm``). Integer sums are exact,
    so a row's result is the same bits for any row count, blocking or thread count,
    on any CPU; float GEMMs are not (MKL picks kernels by row count and splits long
    reductions across threads). The twin's adapter uses it for that reason.
  * ``Dot8Linear``: groups of 32 inputs of 4-bit (``w = q * scale + min``, GGUF's Q4_1), 5- or
    6-bit (Q5_0, Q5_1, Q5_K; Q6_K) or 8-bit values (``w = q * scale``, Q8_0, optionally ``+ min``),
    each held in the fewest bits its values need, optionally with integer multipliers of the
    scale per group or half group and of the minimum (the K-quants, IQ4_XS), times
    activations quantized per row to int8 groups of 32 at run time, as llama.cpp multiplies:
    the project's ``dot8`` kernel (``models.kernels``). Every GGUF type in ``GGUF_PACKED`` is
    one of these exactly. Two formats use it, the file's blocks and head as they are:
    ``w4a8`` quantizes each activation group to one int8 digit, as llama.cpp does;
    ``w4a16`` to two (the second quantizes what the first left over, on a sixteenth of its
    scale), about 12 bits of activation summed as one integer, 16 a0 + a1. The activations' rounding is the
    whole of w4a8's error against the same weights in float (``clients/eval_fidelity``),
    and w4a16 removes nearly all of it at little cost where one token is bound by memory.
  * ``QuantEmbedding``: int8 rows with one scale per group of 32 columns (GGUF's
    Q8_0 exactly); a lookup dequantizes only the rows it gathers.

The portable layout (what the model cache stores, ``PORTABLE_KEYS``; ``portable.py``) is
plain integers and float scales; the kernels' packed layouts are built at load time
because they differ between CPU and CUDA builds.

The kernels take bf16 activations: on CPU both are about 10x faster with bf16
inputs than with fp32 (measured on the 576 -> 3072 projection of SmolLM2-135M,
2 threads: 66 vs 1502 us for int4), and their scales must be bf16 to match. Only
the GEMM inputs are rounded: a layer returns its result in the caller's dtype,
so the residual stream, norms and attention keep the model's compute dtype
(fp32 on CPU), and eager and compiled forwards round at the same places. Every row of the output depends on its own input row only, with the
same arithmetic for any number of rows, so greedy output does not depend on how
requests are batched.

GGUF blocks map onto the portable layout without re-quantizing (``portable.gguf_blocks``).
Under the dot8 formats every packed type is a ``Dot8Linear`` exactly; under ``int4`` the
int4 kinds (Q4_0, Q4_1, Q4_K) keep their integers with their scales rounded to bf16; other
kinds and formats dequantize and quantize again (an output head to int8 per channel, whose
logits' cosine against the file's values is tested).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from .kernels import ops as kernel_ops
from .portable import (GGUF_PACKED, PORTABLE_KEYS, concat_portable, dequantize_portable,  # noqa: F401 (the loader's)
                       gguf_blocks, portable_kind)

Quantization = Literal["none", "int8", "int4", "w4a8", "w4a16"]
QUANTIZATIONS: tuple[Quantization, ...] = ("none", "int8", "int4", "w4a8", "w4a16")
# The dot8 formats: int8 digits per activation group of 32.
DOT8_DIGITS: dict[str, int] = {"w4a8": 1, "w4a16": 2}
GROUP = 32  # GGUF's block size, and the int4 group size
INT8_K = 16  # aten._weight_int8pack_mm on CPU needs an input width that is a multiple of this (else it crashes)


# torch._int_mm on CUDA (cuBLAS) takes more than 16 rows, and K and N multiples of 8 ("self.size(0)
# needs to be greater than 16", aten/src/ATen/native/cuda/Blas.cpp, _int_mm_out_cuda); the CPU's takes any.
INT_MM_MIN_ROWS = 17
INT_MM_MULTIPLE = 8


def padded_int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch._int_mm(a, b)`` (int8 (m, k) @ int8 (k, n) -> int32 (m, n)) computed in a shape CUDA
    takes: zero rows up to ``INT_MM_MIN_ROWS``, zero columns of ``a`` and rows of ``b`` up to a
    multiple of 8 in k, zero columns of ``b`` up to one in n; the result is sliced back. Integer
    sums are exact, so the padding changes no bit of the result on any device."""
    m, k = a.shape
    n = b.shape[1]
    rows, k8, n8 = max(m, INT_MM_MIN_ROWS), -(-k // INT_MM_MULTIPLE) * INT_MM_MULTIPLE, \
        -(-n // INT_MM_MULTIPLE) * INT_MM_MULTIPLE
    if (rows, k8) != (m, k):
        a = torch.nn.functional.pad(a, (0, k8 - k, 0, rows - m))
    if (k8, n8) != (k, n):
        b = torch.nn.functional.pad(b, (0, n8 - n, 0, k8 - k))
    return torch._int_mm(a, b)[:m, :n]


def int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch._int_mm``, padded on CUDA to the shapes its kernel takes (``padded_int_mm``)."""
    return padded_int_mm(a, b) if a.device.type == "cuda" else torch._int_mm(a, b)


def _act(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)


# Where an int4 layer runs: PyTorch's CPU kernel (any shape this module makes) or its CUDA kernel
# (tinygemm, only the shapes ``cuda_int4_inner_k_tiles`` accepts).
Int4Kernel = Literal["cpu", "cuda"]
CUDA_INNER_K_TILES = (8, 4, 2)  # the packings CUDA's int4 kernel has, widest (16-byte loads) first
CUDA_GROUP_SIZES = (32, 64, 128, 256)


def cuda_int4_inner_k_tiles(out_features: int, in_features: int, group_size: int = GROUP) -> int | None:
    """The inner k-tiles CUDA's int4 kernel packs an (out, in) weight with, or None where it takes
    none of its packings (such a layer is kept in the model's float dtype on CUDA: ``int4_runs``).

    The checks are PyTorch's (aten/src/ATen/native/cuda/int4mm.cu):
    ``_convert_weight_to_int4pack_cuda`` takes 2, 4 or 8 inner k-tiles of 16 and needs K to be an
    even multiple of ``innerKTiles * 16``; ``_weight_int4pack_mm_cuda`` reads N back as the packed
    weight's n-tiles times 8 and checks the scales' N against it (so N is a multiple of 8), and takes
    groups of 32, 64, 128 or 256 that divide K.
    """
    if out_features % 8 or group_size not in CUDA_GROUP_SIZES or in_features % group_size:
        return None
    return next((t for t in CUDA_INNER_K_TILES if in_features % (16 * t) == 0), None)


def int4_runs(out_features: int, in_features: int, device: torch.device | str, group_size: int = GROUP) -> bool:
    """Whether ``Int4Linear`` takes an (out, in) weight on ``device``: on the CPU any width of whole
    groups; on CUDA the shapes its kernel packs (``cuda_int4_inner_k_tiles``)."""
    if in_features % group_size:
        return False
    if torch.device(device).type == "cuda":
        return cuda_int4_inner_k_tiles(out_features, in_features, group_size) is not None
    return True


def pack_int4(q: torch.Tensor, kernel: Int4Kernel, group_size: int = GROUP) -> torch.Tensor:
    """q (out, in) integers 0..15 in the packed layout of ``kernel``'s int4 matmul: CUDA's takes two
    values a byte, high nibble first, tiled by ``cuda_int4_inner_k_tiles``; the CPU's takes int32."""
    q32 = q.to(torch.int32)
    if kernel == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q32, 1)
    out_features, in_features = q.shape
    tiles = cuda_int4_inner_k_tiles(out_features, in_features, group_size)
    if tiles is None:
        raise ValueError(f"CUDA's int4 kernel takes no ({out_features}, {in_features}) weight in groups of "
                         f"{group_size} (quant.cuda_int4_inner_k_tiles); keep this layer in float")
    nibbles = (q32[:, ::2] << 4 | q32[:, 1::2]).to(torch.uint8).contiguous()  # (out, in // 2)
    return torch.ops.aten._convert_weight_to_int4pack(nibbles, tiles)


class Int4Linear(nn.Module):
    """y = x @ W^T (+ b) with W in asymmetric int4 groups along the input dimension."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 bias: torch.Tensor | None = None, group_size: int = GROUP):
        """q: (out, in) integers 0..15; scales, zeros: (out, in // group_size), w = q * scale + zero."""
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.group_size = group_size
        self.kernel: Int4Kernel = "cuda" if q.device.type == "cuda" else "cpu"
        packed = pack_int4(q, self.kernel, group_size)
        mid = zeros.float() + 8 * scales.float()
        # (in // group, out, 2): the kernel's scale-and-zero layout.
        sz = torch.stack([scales.float().t(), mid.t()], dim=-1).contiguous().to(torch.bfloat16)
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", sz)
        self.register_buffer("bias", None if bias is None else bias.to(torch.bfloat16))

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None, group_size: int = GROUP) -> "Int4Linear":
        """Round-to-nearest min/max quantization of a float weight (out, in)."""
        q, scales, zeros = quantize_int4(w, group_size)
        return cls(q, scales, zeros, bias, group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = _act(x).reshape(-1, self.in_features)
        if self.kernel == "cuda":  # int4mm.cu checks A.is_contiguous()
            y = torch.ops.aten._weight_int4pack_mm(x2.contiguous(), self.packed, self.group_size,
                                                   self.scales_and_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales_and_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features).to(x.dtype)

    def values(self) -> torch.Tensor:
        """The (out, in) integers 0..15, exactly: the layer's own kernel with scale 1 and ``mid`` 8
        returns them for an identity input (small integers are exact in bf16)."""
        unit = torch.zeros_like(self.scales_and_zeros)
        unit[..., 0], unit[..., 1] = 1.0, 8.0
        eye = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.packed.device)
        if self.kernel == "cuda":
            y = torch.ops.aten._weight_int4pack_mm(eye, self.packed, self.group_size, unit)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, self.group_size, unit)
        return y.t().round().to(torch.uint8)

    def dequantize(self) -> torch.Tensor:
        """The float weight (out, in) this layer multiplies by (for tests and references)."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.packed.device)
        bias, self.bias = self.bias, None
        try:
            return self.forward(eye).t().float()
        finally:
            self.bias = bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, group={self.group_size}"


class Int8Linear(nn.Module):
    """y = x @ (q * scale)^T (+ b), symmetric int8 per output channel."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = q.shape
        if self.in_features % INT8_K:
            raise ValueError(f"int8 weights need an input width that is a multiple of {INT8_K}, "
                             f"not {self.in_features}")
        self.register_buffer("qweight", q.to(torch.int8).contiguous())
        self.register_buffer("scales", scales.to(torch.bfloat16))
        self.register_buffer("bias", None if bias is None else bias.to(torch.bfloat16))

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None) -> "Int8Linear":
        w = w.float()
        scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
        return cls((w / scales[:, None]).round().clamp(-127, 127), scales, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int8pack_mm(_act(x).reshape(-1, self.in_features), self.qweight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features).to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}"


class W8A8Linear(nn.Module):
    """y = (round(x / s) @ q^T) * s * scale (+ b): int8 weights per output channel, int8 activations per token.

    ``digits`` > 1 writes each activation as that many int8 digits (x ~ d0 s + d1 s/254 + ...),
    multiplied in one integer GEMM of stacked rows: about 7 more bits of activation per
    digit, still exact integer sums.
    """

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None, digits: int = 1):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.digits = digits
        self.register_buffer("qweight", q.to(torch.int8).contiguous())
        self.register_buffer("scales", scales.float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.float())

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None, digits: int = 1) -> "W8A8Linear":
        w = w.float()
        scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
        return cls((w / scales[:, None]).round().clamp(-127, 127), scales, bias, digits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rest = x.reshape(-1, self.in_features).float()
        step = (rest.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-30)  # per token; a zero row stays zero
        digits, steps = [], []
        for _ in range(self.digits):
            d = (rest / step).round()
            digits.append(d)
            steps.append(step)
            rest, step = rest - d * step, step / 254  # the remainder is within half a step
        acc = int_mm(torch.cat(digits).to(torch.int8), self.qweight.t()).float()
        acc = acc.view(self.digits, -1, self.out_features)
        y = acc[0] * steps[0]
        for i in range(1, self.digits):
            y = y + acc[i] * steps[i]
        y = y * self.scales
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features).to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scales[:, None]

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, digits={self.digits}"


def symmetric_int4(scales: torch.Tensor, mins: torch.Tensor | None) -> bool:
    """Whether int4 groups with these scales and minimums are ``d (q - 8)``, as fp16 holds them."""
    if mins is None or not mins.numel():
        return False
    d = scales.detach().cpu().half().float()
    return torch.equal(mins.detach().cpu().half().float(), -8 * d)


class Dot8Linear(nn.Module):
    """y = x @ W^T (+ b) with W in groups of 32 (4, 5, 6 or 8 bits with a scale and optionally a
    minimum; optionally with integer multipliers: every GGUF type in
    ``GGUF_PACKED``) and x quantized per row to int8 groups of 32 at run time, multiplied in
    exact integer sums by ``dualserve::dot8_linear`` (``models.kernels``). ``bits`` is what the
    values are stored in: a portable weight takes the fewest that hold it (Q5 types 5, Q6_K 6).
    """

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int,
                 bias: torch.Tensor | None = None, digits: int = 1, scale_mult: torch.Tensor | None = None,
                 zero_mult: torch.Tensor | None = None):
        """q (out, in): values that fit ``bits`` (``kernels.value_range``: -8..7, or with mins 0..15, for
        4; -16..15, or with mins 0..31, for 5; -32..31 for 6; -128..127 for 8), in groups of 32 inputs with
        scales and mins (out, in // 32): w = scale * q (+ min). With scale_mult (out, in // 32, 2) int8
        (inputs 0..15 and 16..31) and, beside mins, zero_mult (out, in // 32) int8:
        w = (scale * scale_mult) * q + min * zero_mult. Scales and mins are held in fp16.
        digits: int8 digits per activation group (1: w4a8, 2: w4a16).

        int4 whose every minimum is -8 times its scale (GGUF Q4_0: w = d (q - 8)) is held as q - 8
        without a minimum: the same weight, and each group's sum of q a is then one exact integer,
        which the kernel scales once instead of adding a scaled minimum."""
        super().__init__()
        from . import kernels
        if not kernels.available():
            raise RuntimeError(f"the dot8 kernel is not available here: {kernels.unavailable_reason()}")
        if scale_mult is None and zero_mult is not None or (
                scale_mult is not None and (zero_mult is None) != (mins is None)):
            raise ValueError("zero_mult goes with scale_mult and mins")
        if scale_mult is not None and kernels.multiplied_bound(q, scale_mult) > kernels.MAX_MULTIPLIED:
            raise ValueError(f"dot8's integer sums stay exact while a group's max|q s| over its two halves "
                             f"add up to at most {kernels.MAX_MULTIPLIED}")
        if bits == 4 and scale_mult is None and symmetric_int4(scales, mins):
            q, mins = (q.to(torch.int16) - 8).to(torch.int8), None
        self.out_features, self.in_features = q.shape
        self.bits = bits
        self.digits = digits
        self.minimum = mins is not None
        packed, d, m = kernels.pack(q.cpu(), scales.cpu(), None if mins is None else mins.cpu(), bits)
        s = mn = None
        if scale_mult is not None:
            s, mn = kernels.pack_multipliers(scale_mult.cpu(), None if zero_mult is None else zero_mult.cpu())
        self.register_buffer("packed", packed.to(q.device))
        self.register_buffer("d", d.to(q.device))
        self.register_buffer("m", m.to(q.device))
        self.register_buffer("s", None if s is None else s.to(q.device))
        self.register_buffer("mn", None if mn is None else mn.to(q.device))
        self.register_buffer("bias", None if bias is None else bias.float())

    def __setstate__(self, state):  # an unpickled layer (a build's child process) needs the library too
        from . import kernels
        kernels.available()
        super().__setstate__(state)

    @classmethod
    def from_portable(cls, parts: dict[str, torch.Tensor], bias: torch.Tensor | None = None,
                      digits: int = 1) -> "Dot8Linear":
        """A portable weight (``portable.py``) of any kind, exactly: no rounding. int4 entries keep 4
        bits; int8 ones take the fewest bits their values fit (``kernels.narrowest_bits``)."""
        from .kernels import narrowest_bits
        q = parts["qweight"]
        bits = 4 if portable_kind(parts) == "int4" else narrowest_bits(q, "zeros" in parts)
        return cls(q, parts["scales"], parts.get("zeros"), bits, bias, digits, parts.get("scale_mult"),
                   parts.get("zero_mult"))

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None, bits: int = 4,
                   digits: int = 1) -> "Dot8Linear":
        if bits == 4:
            return cls(*quantize_int4(w), 4, bias, digits)
        out, inp = w.shape
        g = w.float().view(out, inp // GROUP, GROUP)
        scales = (g.abs().amax(-1) / 127).clamp(min=1e-12).half().float()
        return cls((g / scales[..., None]).round().clamp(-127, 127).view(out, inp), scales, None, 8, bias, digits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype not in (torch.float32, torch.bfloat16):
            x2 = x2.float()
        y = kernel_ops.dot8_linear(x2.contiguous(), self.packed, self.d, self.m, self.out_features, self.bits,
                                   self.digits, self.s, self.mn, self.minimum)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features).to(x.dtype)

    def _portable(self, ids: torch.Tensor | None) -> dict[str, torch.Tensor]:
        from .kernels import unpack
        return unpack(self.packed.cpu(), self.d.cpu(), self.m.cpu(), None if self.s is None else self.s.cpu(),
                      None if self.mn is None else self.mn.cpu(), self.out_features, self.in_features, self.bits,
                      self.minimum, ids)

    def portable(self) -> dict[str, torch.Tensor]:
        """The weight in the portable layout, exactly (scales and mins as the fp16 values the kernel reads)."""
        return self._portable(None)

    def dequantize(self) -> torch.Tensor:
        """The float weight (out, in) this layer multiplies by, as gguf.quants gives it (for tests and references)."""
        return dequantize_portable(self.portable())

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 (len(ids), in_features): rows ``ids`` of ``dequantize()``, the same bits, unpacked from
        those rows' lanes alone (a tied embedding reads the head's weight this way)."""
        return dequantize_portable(self._portable(ids))

    def extra_repr(self) -> str:
        kind = f"bits={self.bits}" + (", minimum" if self.minimum and self.bits != 4 else "") + (
            ", multipliers" if self.s is not None else "")
        return (f"in={self.in_features}, out={self.out_features}, {kind}, "
                f"activations={self.digits} int8 digit(s) per group of 32")


class QuantEmbedding(nn.Module):
    """Token embeddings stored as int8 with one scale per group of columns; rows dequantize on lookup."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_embeddings, self.embedding_dim = q.shape
        self.dtype = dtype
        self.register_buffer("qweight", q.to(torch.int8).contiguous())
        self.register_buffer("scales", scales.float().contiguous())  # (rows, dim // group)

    @classmethod
    def from_portable(cls, parts: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> "QuantEmbedding":
        """A file's table: int8 groups (Q8_0, Q5_0, IQ4_NL; Q6_K and IQ4_XS with a scale per 16 columns,
        their multipliers folded in, exact in fp32) as they are; other kinds dequantized and quantized again."""
        if portable_kind(parts) != "int8_grouped":
            return cls.from_float(dequantize_portable(parts), dtype)
        scales = parts["scales"].float()
        if "scale_mult" in parts:
            scales = (scales[..., None] * parts["scale_mult"].float()).flatten(-2)  # (rows, dim // 16)
        return cls(parts["qweight"], scales, dtype)

    @classmethod
    def from_float(cls, w: torch.Tensor, dtype: torch.dtype = torch.float32) -> "QuantEmbedding":
        rows, dim = w.shape
        groups = w.float().view(rows, dim // GROUP, GROUP)
        scales = (groups.abs().amax(-1) / 127).clamp(min=1e-12)
        q = (groups / scales[..., None]).round().clamp(-127, 127).view(rows, dim)
        return cls(q, scales, dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize_grouped(self.qweight[ids], self.scales[ids]).to(self.dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized table (rows, dim); for tools that need the matrix, not for decoding."""
        return dequantize_grouped(self.qweight, self.scales).to(self.dtype)


def dequantize_grouped(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 (..., dim) with scales (..., dim // group) -> float32 (..., dim)."""
    groups = scales.shape[-1]
    return (q.float().unflatten(-1, (groups, -1)) * scales.float()[..., None]).flatten(-2)


def quantize_int4(w: torch.Tensor, group_size: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min/max asymmetric int4 per group: returns q (out, in) in 0..15, scales and zeros (out, in // group)."""
    out, inp = w.shape
    g = w.float().view(out, inp // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scales = ((hi - lo) / 15).clamp(min=1e-12)
    q = ((g - lo[..., None]) / scales[..., None]).round().clamp(0, 15).view(out, inp)
    return q.to(torch.uint8), scales, lo


def to_linear(parts: dict[str, torch.Tensor], fmt: Quantization, bias: torch.Tensor | None,
              dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """A portable weight as a linear layer in ``fmt``: exact under the dot8 formats (every kind), the
    file's integers under ``int4`` when it came as int4; else dequantized, then ``fmt``."""
    parts = {k: v.to(device) for k, v in parts.items()}
    digits = DOT8_DIGITS.get(fmt)
    if digits and parts["qweight"].shape[1] % GROUP == 0:
        return Dot8Linear.from_portable(parts, bias, digits)
    if fmt == "int4" and portable_kind(parts) == "int4" and int4_runs(*parts["qweight"].shape, device):
        scales, zeros = int4_group_scales(parts)
        if scales is not None:
            return Int4Linear(parts["qweight"], scales, zeros, bias)
    return float_to_linear(dequantize_portable(parts), bias, fmt, dtype)


def int4_group_scales(parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """An int4 entry's scale and zero per group of 32 (fp32, exact), its multipliers folded in; None
    where a group's two halves have different multipliers (no layout of one scale a group holds it)."""
    scales, zeros = parts["scales"].float(), parts["zeros"].float()
    if "scale_mult" not in parts:
        return scales, zeros
    mult = parts["scale_mult"]
    if not torch.equal(mult[..., 0], mult[..., 1]):
        return None, None
    return scales * mult[..., 0].float(), zeros * parts["zero_mult"].float()


def head_linear(weight: dict[str, torch.Tensor] | torch.Tensor, fmt: Quantization, dtype: torch.dtype,
                device: torch.device | str) -> nn.Module:
    """The output head of a quantized model, in the layers' kernel family: under the dot8 formats a
    file's head as its blocks are (a Q8_0 or Q6_K head exactly) and a float head as int8 groups of 32;
    int4 on CUDA: float in ``dtype``; else int8 per channel (checkpoint.HEAD_QUANTIZATION: 8 bits
    whatever the layers use)."""
    width = weight["qweight"].shape[1] if isinstance(weight, dict) else weight.shape[1]
    if fmt in DOT8_DIGITS and width % GROUP == 0:
        digits = DOT8_DIGITS[fmt]
        if isinstance(weight, dict):
            return Dot8Linear.from_portable({k: v.to(device) for k, v in weight.items()}, digits=digits)
        return Dot8Linear.from_float(weight.to(device), bits=8, digits=digits)
    if fmt == "int4" and torch.device(device).type == "cuda":
        # aten._weight_int8pack_mm's CUDA kernel is missing from older builds this project accepts
        # (torch>=2.4) and naive where present (one thread per output, aten/src/ATen/native/cuda/
        # int8mm.cu): the head stays in the model's float dtype there.
        w = dequantize_portable(weight) if isinstance(weight, dict) else weight
        return float_to_linear(w.to(device), None, "none", dtype)
    if isinstance(weight, dict):
        return to_linear(weight, "int8", None, dtype, device)
    return Int8Linear.from_float(weight.to(device))


def layer_format(fmt: Quantization, out_features: int, in_features: int,
                 device: torch.device | str) -> Quantization:
    """The format a float (out, in) weight is built in under ``fmt`` outside the dot8 kernel: int4
    where ``Int4Linear`` takes the shape on ``device``, else int8 where its kernel takes the width,
    else float ("none"). On CUDA an int4 layer its kernel does not pack stays float (the model's
    bf16), never int8 (see ``head_linear``)."""
    if fmt in DOT8_DIGITS:
        fmt = "int8"
    if fmt == "int4" and int4_runs(out_features, in_features, device):
        return "int4"
    if fmt == "int4" and torch.device(device).type == "cuda":
        return "none"
    if fmt in ("int4", "int8") and in_features % INT8_K == 0:
        return "int8"
    return "none"


def float_to_linear(w: torch.Tensor, bias: torch.Tensor | None, fmt: Quantization,
                    dtype: torch.dtype) -> nn.Module:
    if fmt in DOT8_DIGITS and w.shape[1] % GROUP == 0:
        return Dot8Linear.from_float(w, bias, digits=DOT8_DIGITS[fmt])
    fmt = layer_format(fmt, *w.shape, w.device)
    if fmt == "int4":
        return Int4Linear.from_float(w, bias)
    if fmt == "int8":
        return Int8Linear.from_float(w, bias)
    layer = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(w.to(dtype), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
    return layer


def quantize_linears(module: nn.Module, fmt: Quantization, bits: int = 4) -> nn.Module:
    """Swap every float ``nn.Linear`` under ``module`` for ``fmt``'s layer, in place: a draft model
    beside a quantized target then streams a fraction of its float bytes per forward. ``bits``: the
    weights of a dot8 swap (8: the same integer kernel with Q8_0-like weights)."""
    if fmt == "none":
        return module
    for name, child in list(module.named_modules()):
        if isinstance(child, nn.Linear):
            w, bias = child.weight.detach(), None if child.bias is None else child.bias.detach()
            if fmt in DOT8_DIGITS and w.shape[1] % GROUP == 0:
                layer = Dot8Linear.from_float(w, bias, bits=bits, digits=DOT8_DIGITS[fmt])
            else:
                layer = float_to_linear(w, bias, fmt, w.dtype)
            module.set_submodule(name, layer)
    return module


def linear_weight(module: nn.Module) -> torch.Tensor:
    """The (out, in) float weight of a float or quantized linear layer."""
    if isinstance(module, nn.Linear):
        return module.weight
    return module.dequantize()
