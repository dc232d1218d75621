"""dot8's packed weight layout (``dot8.cpp``'s header has the byte order): packing integers, scales
and multipliers for the kernel, unpacking them exactly (whole, or a few rows), and the choice of
how many bits a portable weight's values take.

Values are stored unsigned, ``u = q + offset(bits, minimum)``: int4 (a minimum kind's 0..15, or
Q4_0's -8..7 as q + 8), 5 bits (Q5_0's -16..15 as q + 16, or a minimum kind's 0..31), 6 bits
(-32..31 as q + 32) and int8 (q + 128).
The kernel subtracts ``offset * sum(a)`` from ``sum(u a)``, which gives ``sum(q a)`` exactly.

Packing runs over a few output tiles at a time (``CHUNK_WEIGHTS`` weights) into one preallocated
result, so building a layer needs its packed bytes plus temporaries of a few MB, whatever its
size; unpacking the whole matrix runs the same way. Scales are kept compact where the weight
allows, exactly: ``d`` and ``m`` once per super-block of 8 groups where all 8 hold the same fp16
bits (the K-quants' ``D`` and ``Dmin``), one multiplier per group where both halves have the same
(Q4_K, Q5_K, IQ4_XS), and no ``m`` without a minimum.
"""

from __future__ import annotations

import torch

TILE = 16
GROUP = 32
SUPER = 8  # groups of a GGUF K-quant super-block (256 inputs)
CHUNK_WEIGHTS = 1 << 20  # weights packed or unpacked per step
# With multipliers a group's integer s_lo dot_lo + s_hi dot_hi stays below 2^24, so exact in fp32,
# while 16 * 127 * (max|q_lo| |s_lo| + max|q_hi| |s_hi|) < 2^24 (Q6_K: 32 * 128 * 2 = 8192).
MAX_MULTIPLIED = 8256


def offset(bits: int, minimum: bool) -> int:
    """What the layout adds to a value q to store it unsigned (dot8_tiles.h: offset_of)."""
    return {4: 0 if minimum else 8, 5: 0 if minimum else 16, 6: 32, 8: 128}[bits]


def value_range(bits: int, minimum: bool) -> tuple[int, int]:
    """The values q a weight of ``bits`` holds: (lowest, highest)."""
    off = offset(bits, minimum)
    return -off, (1 << bits) - 1 - off


def narrowest_bits(q: torch.Tensor, minimum: bool) -> int:
    """The fewest bits (4 without a minimum, 5, 6 or 8) that hold an int8 weight's values exactly
    (int4 entries stay 4)."""
    if not q.numel():
        return 8
    lo, hi = int(q.min()), int(q.max())
    for bits in (5, 6) if minimum else (4, 5, 6):
        low, high = value_range(bits, minimum)
        if low <= lo and hi <= high:
            return bits
    return 8


def multiplied_bound(q: torch.Tensor, scale_mult: torch.Tensor) -> int:
    """The largest max|q_lo| |s_lo| + max|q_hi| |s_hi| over the groups of q (out, in), a few rows at a time."""
    out, inp = q.shape
    step, bound = max(1, CHUNK_WEIGHTS // max(inp, 1)), 0
    for r in range(0, out, step):
        h = q[r: r + step].view(-1, inp // GROUP, 2, GROUP // 2)
        top = torch.maximum(h.amax(-1).to(torch.int32).abs(), h.amin(-1).to(torch.int32).abs())  # (rows, groups, 2)
        bound = max(bound, int((top * scale_mult[r: r + step].to(torch.int32).abs()).sum(-1).max()))
    return bound


def _per_tile(v: torch.Tensor, tiles: int) -> torch.Tensor:
    """(out, ...) -> (tiles, 16, ...), padded with zero rows."""
    padded = v.new_zeros((tiles * TILE, *v.shape[1:]))
    padded[: v.shape[0]] = v
    return padded.view(tiles, TILE, *v.shape[1:])


def _same_per_super_block(v: torch.Tensor) -> bool:
    """Whether every super-block's 8 groups hold the same bits in v (tiles, groups, 16)."""
    bits = v.view(torch.int16).view(v.shape[0], -1, SUPER, TILE)
    return bool((bits == bits[:, :, :1]).all())


def pack_scales(scales: torch.Tensor, mins: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """scales, mins (out, groups) -> the kernel's fp16 d and m, [tile][group][16], or [tile][group / 8][16]
    where each super-block shares them; m is empty without mins."""
    tiles, groups = -(-scales.shape[0] // TILE), scales.shape[1]
    d = _per_tile(scales.half(), tiles).permute(0, 2, 1).contiguous()   # (tiles, groups, 16); fp16 values, exact
    m = torch.empty(0, dtype=torch.float16)
    if mins is not None:
        m = _per_tile(mins.half(), tiles).permute(0, 2, 1).contiguous()
    if groups and groups % SUPER == 0 and _same_per_super_block(d) and (mins is None or _same_per_super_block(m)):
        d = d[:, ::SUPER].contiguous()
        m = m if mins is None else m[:, ::SUPER].contiguous()
    return d, m


def pack_multipliers(scale_mult: torch.Tensor, zero_mult: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """scale_mult (out, groups, 2) and zero_mult (out, groups) int8 -> the kernel's s, [tile][group][16]
    where every group's halves share one, else [tile][group][2][16], and mn [tile][group][16]."""
    tiles = -(-scale_mult.shape[0] // TILE)
    s = _per_tile(scale_mult.to(torch.int8), tiles)                              # (tiles, 16, groups, 2)
    s = s[..., 0].permute(0, 2, 1).contiguous() if torch.equal(s[..., 0], s[..., 1]) \
        else s.permute(0, 2, 3, 1).contiguous()
    mn = None if zero_mult is None else _per_tile(zero_mult.to(torch.int8), tiles).permute(0, 2, 1).contiguous()
    return s, mn


def _place(dst: torch.Tensor, u: torch.Tensor, bits: int) -> None:
    """Stored values u (tc * 16, in) uint8 into dst (tc, groups, bits, 16, 4), a slice of the result."""
    tc, groups = dst.shape[:2]
    v = u.view(tc, TILE, groups, 8, 4)   # int8: chunk j = k // 4; else nibble vector i = k // 4
    if bits == 8:
        dst.copy_(v.permute(0, 2, 3, 1, 4))
        return
    nib = (v[:, :, :, 0::2] & 0x0F) | (v[:, :, :, 1::2] << 4)                   # (tc, 16, groups, 4, 4)
    dst[:, :, :4].copy_(nib.permute(0, 2, 3, 1, 4))
    if bits > 4:
        hb, per = bits - 4, 8 // (bits - 4)
        high = v >> 4
        for p in range(hb):
            plane = torch.zeros_like(high[:, :, :, 0])
            for k in range(per):
                plane |= high[:, :, :, p * per + k] << (hb * k)
            dst[:, :, 4 + p].copy_(plane.permute(0, 2, 1, 3))


def pack(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (out, in) whose values fit ``bits`` (``value_range``: -8..7, or with mins 0..15, for int4;
    -16..15, or with mins 0..31, for 5; -32..31 for 6; -128..127 for 8), in groups of 32 along the input with
    scales / mins (out, in // 32): w = d q (+ m). Returns the kernel's (q, d, m) (``pack_scales``)."""
    out, inp = q.shape
    if inp % GROUP:
        raise ValueError(f"dot8 needs an input width divisible by {GROUP}, not {inp}")
    if bits not in (4, 5, 6, 8):
        raise ValueError(f"dot8 weights have 4, 5, 6 or 8 bits, not {bits}")
    lo, hi = value_range(bits, mins is not None)
    if q.numel() and (int(q.min()) < lo or int(q.max()) > hi):
        raise ValueError(f"{bits}-bit dot8 values lie in {lo}..{hi}, not {int(q.min())}..{int(q.max())}")
    groups, tiles = inp // GROUP, -(-out // TILE)
    packed = torch.empty((tiles, groups, bits, TILE, 4), dtype=torch.uint8)
    step = max(1, CHUNK_WEIGHTS // (TILE * max(inp, 1)))
    for t0 in range(0, tiles, step):
        t1 = min(tiles, t0 + step)
        rows = q[t0 * TILE: t1 * TILE]
        u = torch.zeros(((t1 - t0) * TILE, inp), dtype=torch.int16)   # padding rows stay 0
        u[: rows.shape[0]] = rows
        u[: rows.shape[0]] += -lo
        _place(packed[t0:t1], u.to(torch.uint8), bits)
    return (packed.view(-1), *pack_scales(scales, mins))


def _values(sel: torch.Tensor, bits: int) -> torch.Tensor:
    """Gathered lanes (n, groups, bits, 4) uint8 -> the stored values u (n, in) int16."""
    n, groups = sel.shape[:2]
    if bits == 8:
        return sel.reshape(n, groups * GROUP).to(torch.int16)
    nib = sel[:, :, :4]
    u = torch.stack([nib & 0x0F, nib >> 4], dim=3).view(n, groups, 8, 4)       # nibble vector i = 2j + n
    if bits > 4:
        hb, per = bits - 4, 8 // (bits - 4)
        shifts = (hb * (torch.arange(8) % per)).to(torch.uint8).view(8, 1)
        high = (sel[:, :, 4:].repeat_interleave(per, dim=2) >> shifts) & ((1 << hb) - 1)
        u = u | (high << 4)
    return u.reshape(n, groups * GROUP).to(torch.int16)


def _gather(v: torch.Tensor, ids: torch.Tensor, groups: int) -> torch.Tensor:
    """Per-tile values v (tiles, g, [k,] 16) at rows ids -> (n, groups[, k]); g may be groups / 8."""
    tiles = v.shape[0]
    v = v.view(tiles, v.shape[1], -1, TILE)[ids // TILE, :, :, ids % TILE]  # (n, g, k)
    v = v.repeat_interleave(groups // v.shape[1], dim=1) if v.shape[1] != groups else v
    return v[..., 0] if v.shape[-1] == 1 else v


def unpack(packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor, s: torch.Tensor | None,
           mn: torch.Tensor | None, out: int, inp: int, bits: int, minimum: bool,
           ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """``pack`` and ``pack_multipliers`` inverted, exactly: the portable weight (``portable.py``) of
    rows ``ids`` (all by default): qweight uint8 (int4 with a minimum) or int8, scales and zeros as the fp16 values
    the kernel reads (in fp32), scale_mult (n, groups, 2) and zero_mult (n, groups)."""
    groups, tiles = inp // GROUP, -(-out // TILE)
    lanes = packed.view(tiles, groups, bits, TILE, 4)
    off = offset(bits, minimum)
    dtype = torch.uint8 if bits == 4 and minimum else torch.int8
    if ids is None:
        ids = torch.arange(out)
        q = torch.empty((out, inp), dtype=dtype)
        step = max(1, CHUNK_WEIGHTS // (TILE * max(inp, 1)))
        for t0 in range(0, tiles, step):
            t1 = min(tiles, t0 + step)
            sel = lanes[t0:t1].permute(0, 3, 1, 2, 4).reshape(-1, groups, bits, 4)
            r1 = min(out, t1 * TILE)
            q[t0 * TILE: r1] = (_values(sel, bits) - off)[: r1 - t0 * TILE]
    else:
        ids = torch.as_tensor(ids, dtype=torch.long).flatten().cpu()
        sel = lanes[ids // TILE, :, :, ids % TILE]                                # (n, groups, bits, 4)
        q = (_values(sel, bits) - off).to(dtype)
    parts = {"qweight": q, "scales": _gather(d, ids, groups).float()}
    if minimum:
        parts["zeros"] = _gather(m, ids, groups).float()
    if s is not None:
        mult = _gather(s, ids, groups)
        parts["scale_mult"] = mult if mult.dim() == 3 else torch.stack([mult, mult], dim=-1)
        if mn is not None:
            parts["zero_mult"] = _gather(mn, ids, groups)
    return parts
