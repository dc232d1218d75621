"""The dot8 kernel (int4/int8 weight groups times int8 activation groups): its packed layout
round-trips, it computes the documented sum, every code path gives the same bits, and a row's
result never depends on the rows beside it or on the thread count."""

from __future__ import annotations

import pytest
import torch

from dualserve.models import kernels
from dualserve.models.quant import Dot8Linear, quantize_int4

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C++ compiler for the dot8 kernel")


def int8_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out, inp = w.shape
    g = w.view(out, inp // 32, 32)
    scales = (g.abs().amax(-1) / 127).clamp(min=1e-12).half().float()
    return (g / scales[..., None]).round().clamp(-127, 127).view(out, inp), scales


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(16, 32), (40, 64), (200, 96)])  # 40 and 200: a partial last tile
def test_pack_and_unpack_round_trip(bits: int, shape) -> None:
    torch.manual_seed(0)
    w = torch.randn(*shape)
    if bits == 4:
        q, scales, mins = quantize_int4(w)
        want = q.float().view(shape[0], -1, 32) * scales.half().float()[..., None] + mins.half().float()[..., None]
    else:
        q, scales = int8_groups(w)
        mins = None
        want = q.float().view(shape[0], -1, 32) * scales[..., None]
    packed = kernels.pack(q, scales, mins, bits)
    got_q, got_scales, got_mins = kernels.unpack_integers(*packed, shape[0], shape[1], bits)
    assert torch.equal(got_q, q.to(got_q.dtype)) and torch.equal(got_scales, scales.half().float())
    if bits == 4:
        assert torch.equal(got_mins, mins.half().float())
    layer = Dot8Linear(q, scales, mins, bits)
    assert torch.equal(layer.dequantize(), want.view(shape))
    assert torch.equal(Dot8Linear.from_portable(layer.portable()).packed, layer.packed)


@pytest.mark.parametrize("digits", [1, 2])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3, 8, 13])  # 13: more rows than a register block
def test_dot8_computes_the_documented_sum(bits: int, rows: int, digits: int) -> None:
    torch.manual_seed(1)
    w, x = torch.randn(72, 96) * 0.05, torch.randn(rows, 96)
    x[0, :32] = 0  # an all-zero group quantizes to zeros with a zero scale
    if bits == 4:
        q, scales, mins = quantize_int4(w)
    else:
        (q, scales), mins = int8_groups(w), None
    packed = kernels.pack(q, scales, mins, bits)
    got = torch.ops.dualserve.dot8_linear(x, *packed, 72, bits, 0, digits)
    want = kernels.reference(x, q, scales, mins, bits, digits)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    # and it stays near the float product: the activations keep about 8 bits per group, 15 with two digits
    exact = x @ Dot8Linear(q, scales, mins, bits).dequantize().t()
    torch.testing.assert_close(got, exact, rtol=0.05 if digits == 1 else 1e-3, atol=0.1 if digits == 1 else 1e-3)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_code_path_gives_the_same_bits(bits: int, dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    layer = Dot8Linear.from_float(torch.randn(200, 160) * 0.05, bits=bits)
    x = torch.randn(11, 160).to(dtype).contiguous()
    args = (layer.packed, layer.d, layer.m, 200, bits)
    assert torch.equal(torch.ops.dualserve.dot8_linear(x, *args), torch.ops.dualserve.dot8_linear(x, *args, 1))
    assert kernels.code_path() in ("avx512_vnni", "avx2", "scalar")


@pytest.mark.parametrize("digits", [1, 2])
@pytest.mark.parametrize("shape", [(32, 1536), (3072, 32), (49, 576)])
def test_rows_are_the_same_bits_in_any_batch_and_thread_count(shape, digits: int) -> None:
    torch.manual_seed(3)
    out, inp = shape
    layer = Dot8Linear.from_float(torch.randn(out, inp) * 0.02, bias=torch.randn(out), digits=digits)
    x = torch.randn(17, inp)
    full = layer(x)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert torch.equal(torch.cat([layer(x[i:i + 1]) for i in range(17)]), full)
            assert torch.equal(layer(x[3:12]), full[3:12])
    finally:
        torch.set_num_threads(threads)


def test_bad_shapes_are_refused() -> None:
    layer = Dot8Linear.from_float(torch.randn(16, 64))
    with pytest.raises(RuntimeError, match="input width"):
        torch.ops.dualserve.dot8_linear(torch.randn(2, 48), layer.packed, layer.d, layer.m, 16, 4)
    with pytest.raises(ValueError, match="divisible by 32"):
        kernels.pack(torch.zeros(16, 40, dtype=torch.uint8), torch.ones(16, 1), torch.zeros(16, 1), 4)


def test_the_kernel_library_is_cached_by_source() -> None:
    so = kernels.library_path()
    assert so.exists() and so.parent.name == "kernels"
    assert kernels.build() == so  # built once per machine: a second call finds it


@pytest.mark.parametrize("path", ["avx2", "scalar"])
def test_the_narrower_paths_a_host_may_take_give_the_same_bits(tmp_path, path: str) -> None:
    """Run in a child with DUALSERVE_DOT8_PATH forcing the path an AVX2-only host takes."""
    import os
    import subprocess
    import sys

    torch.manual_seed(4)
    from dualserve.models.adapter import LoRA
    layers = {bits: Dot8Linear.from_float(torch.randn(72, 96) * 0.05, bits=bits) for bits in (4, 8)}
    layers["w4a16"] = Dot8Linear.from_float(torch.randn(72, 96) * 0.05, digits=2)
    # A projection with its adapter: one dot8_lora call on that path.
    layers["lora"] = LoRA.from_factors(layers[4], torch.randn(32, 96) * 0.05, torch.randn(72, 32) * 0.05, 2.0)
    assert layers["lora"].fused
    x = torch.randn(11, 96)
    torch.save({"layers": layers, "x": x}, tmp_path / "job.pt")
    code = ("import sys, torch; from dualserve.models import kernels; kernels.available(); "
            "job = torch.load(sys.argv[1], weights_only=False); "
            "torch.save({b: l(job['x']) for b, l in job['layers'].items()}, sys.argv[2]); "
            "print(kernels.code_path())")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "job.pt"), str(tmp_path / "out.pt")],
                          env={**os.environ, "DUALSERVE_DOT8_PATH": path}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    took = done.stdout.split()[-1]
    if path == "avx2" and took != "avx2":
        pytest.skip(f"this CPU has no AVX2 (took {took})")
    assert took == path
    got = torch.load(tmp_path / "out.pt")
    for bits, layer in layers.items():
        assert torch.equal(got[bits], layer(x)), bits


def test_describe_names_the_path_or_why_there_is_none(monkeypatch) -> None:
    line = kernels.describe()
    assert line.startswith(f"dot8 {kernels.code_path()}, attend_rows, pointwise; built by ") and "\n" not in line
    monkeypatch.setattr(kernels, "_loaded", False)
    monkeypatch.setattr(kernels, "_error", "building the kernels failed: x.cpp:1: error: boom\nmore")
    assert kernels.describe() == ("kernels unavailable: building the kernels failed: x.cpp:1: error: boom; "
                                  "w4a8/w4a16 not offered, attention uses SDPA")
