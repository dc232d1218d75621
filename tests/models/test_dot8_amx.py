"""dot8's Intel AMX path gives the AVX-512 VNNI path's bits (and the scalar path's) for every weight
kind, one or two digits, 1 to 17 rows and odd shapes, and for a projection with its adapter. The
path is forced per call: ``force_scalar`` 2 keeps the vector path off AMX, 3 takes AMX at every row
count. Skipped where the CPU (or the kernel) gives no AMX."""

from __future__ import annotations

import pytest
import torch

from dualserve.models import kernels
from dualserve.models.quant import Dot8Linear

from dot8_child import run_in_child
from test_dot8 import NARROW, narrow_entry

VNNI, AMX = 2, 3  # force_scalar values

pytestmark = pytest.mark.skipif(not kernels.available() or torch.ops.dualserve.dot8_amx_from() == 0,
                                reason="no AMX int8 tiles on this CPU (or no kernel)")


def calls(layer: Dot8Linear, x: torch.Tensor, force: int) -> torch.Tensor:
    return torch.ops.dualserve.dot8_linear(x, layer.packed, layer.d, layer.m, layer.out_features, layer.bits, force,
                                           layer.digits, layer.s, layer.mn, layer.minimum)


@pytest.mark.parametrize("digits", [1, 2])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(72, 96), (200, 160), (16, 32), (33, 1536)])  # partial tiles, one group
def test_amx_gives_the_vnni_and_scalar_bits(bits: int, digits: int, shape) -> None:
    torch.manual_seed(7)
    out, inp = shape
    layer = Dot8Linear.from_float(torch.randn(out, inp) * 0.05, bits=bits, digits=digits)
    x = torch.randn(17, inp)
    x[0, :32] = 0  # an all-zero group
    for rows in range(1, 18):
        amx = calls(layer, x[:rows], AMX)
        assert torch.equal(amx, calls(layer, x[:rows], VNNI)), rows
        assert torch.equal(amx, calls(layer, x[:rows], 0)), rows
        if rows in (1, 9, 17):
            assert torch.equal(amx, calls(layer, x[:rows], 1)), rows


KINDS = NARROW + [(8, minimum, mult) for minimum in (False, True) for mult in (0, 1, 2)] + [(4, True, 1), (4, True, 2)]


@pytest.mark.parametrize("bits,minimum,mult", KINDS)
def test_amx_gives_the_same_bits_for_every_kind(bits: int, minimum: bool, mult: int) -> None:
    """Minimum, multipliers per group and per half group, compact scales: every kind (the int4 and
    int8 kinds with multipliers hold values of a narrower kind's range)."""
    parts = narrow_entry(bits if bits in (5, 6) else 5 if bits == 4 else 6, minimum, mult, out=40,
                         inp=288 if mult == 0 else 512, seed=bits + 2 * minimum + 4 * mult)
    q = parts["qweight"]
    if bits == 4:
        q = q.clamp(0, 15) if minimum else q.clamp(-8, 7)
    elif bits == 8 and not mult:
        q = torch.randint(-128, 128, q.shape, generator=torch.Generator().manual_seed(bits)).to(torch.int8)
    torch.manual_seed(8)
    x = torch.randn(17, q.shape[1])
    x[1, 32:64] = 0
    for digits in (1, 2):
        layer = Dot8Linear(q, parts["scales"], parts.get("zeros"), bits, None, digits, parts.get("scale_mult"),
                           parts.get("zero_mult"))
        assert layer.minimum == minimum and (layer.s is not None) == bool(mult)
        for rows in (1, 2, 3, 5, 8, 9, 16, 17):
            amx = calls(layer, x[:rows], AMX)
            assert torch.equal(amx, calls(layer, x[:rows], VNNI)), (digits, rows)
        assert torch.equal(calls(layer, x[:7], AMX), calls(layer, x[:7], 1))


@pytest.mark.parametrize("symmetric", [False, True])
def test_amx_rows_are_the_same_bits_in_any_batch_and_thread_count(symmetric: bool) -> None:
    """Also where a tile's blocks of tokens share its B tiles (more than 16 tokens), with a minimum and
    without (Q4_0: minimums of -8 scales, held as q - 8)."""
    torch.manual_seed(9)
    if symmetric:
        scales = (torch.rand(3072, 18) * 0.01 + 1e-3).half().float()
        layer = Dot8Linear(torch.randint(0, 16, (3072, 576), dtype=torch.uint8), scales, -8 * scales, 4, digits=2)
        assert not layer.minimum
    else:
        layer = Dot8Linear.from_float(torch.randn(3072, 576) * 0.02, digits=2)
    x = torch.randn(40, 576)  # 80 quantized rows: three blocks of up to 16 tokens
    full = calls(layer, x, AMX)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert torch.equal(calls(layer, x, VNNI), full)
            assert torch.equal(torch.cat([calls(layer, x[i:i + 3], AMX) for i in range(0, 39, 3)] +
                                         [calls(layer, x[39:], 0)]), full)
    finally:
        torch.set_num_threads(threads)


def test_a_projection_with_its_adapter_on_amx() -> None:
    from dualserve.models.adapter import LoRA

    torch.manual_seed(10)
    base = Dot8Linear.from_float(torch.randn(72, 96) * 0.05, digits=2)
    lora = LoRA.from_factors(base, torch.randn(32, 96) * 0.05, torch.randn(72, 32) * 0.05, 2.0)
    assert lora.fused
    x = torch.randn(9, 96)
    a, u = lora.down, lora.up

    def call(force: int) -> torch.Tensor:
        return torch.ops.dualserve.dot8_lora(x, base.packed, base.d, base.m, 72, 4, a.packed, a.d, a.m, 32, u.packed,
                                             u.d, u.m, force, 2)
    assert torch.equal(call(AMX), call(VNNI))
    assert torch.equal(call(AMX), lora(x))


@pytest.mark.parametrize("setting,want", [("0", 0), ("1", 1)])
def test_the_environment_turns_amx_off_or_on_from_any_row_count(tmp_path, setting: str, want: int) -> None:
    """DUALSERVE_DOT8_AMX (read once, in a child): 0 keeps dot8 off AMX, N takes it from N rows."""
    torch.manual_seed(11)
    layer = Dot8Linear.from_float(torch.randn(72, 96) * 0.05, digits=2)
    x = torch.randn(5, 96)
    said, out = run_in_child(tmp_path, {"layer": layer}, x, {"DUALSERVE_DOT8_AMX": setting}, rows=(1, 5),
                             report="amx_from")
    assert int(said) == want
    got = out["layer"]
    assert all(torch.equal(y, layer(x[:r])) for y, r in zip(got, (1, 5)))
