"""The dot8 kernel (int4/int8 weight groups times int8 activation groups): its packed layout
round-trips, it computes the documented sum, every code path gives the same bits, and a row's
result never depends on the rows beside it or on the thread count."""

from __future__ import annotations

import pytest
import torch

from dualserve.models import kernels
from dualserve.models.quant import Dot8Linear, quantize_int4

from dot8_child import run_in_child

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
    parts = kernels.unpack(*packed, None, None, shape[0], shape[1], bits, mins is not None)
    assert torch.equal(parts["qweight"], q.to(parts["qweight"].dtype))
    assert torch.equal(parts["scales"], scales.half().float())
    if bits == 4:
        assert torch.equal(parts["zeros"], mins.half().float())
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
    # and it stays near the float product: the activations keep about 8 bits per group, 12 with two digits
    exact = x @ Dot8Linear(q, scales, mins, bits).dequantize().t()
    torch.testing.assert_close(got, exact, rtol=0.05 if digits == 1 else 1e-3, atol=0.1 if digits == 1 else 1e-3)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("digits", [1, 2])
@pytest.mark.parametrize("rows,width", [(11, 160), (24, 1536)])  # the second is quantized on both threads
def test_every_code_path_gives_the_same_bits(bits: int, dtype: torch.dtype, digits: int, rows: int, width: int) -> None:
    torch.manual_seed(2)
    layer = Dot8Linear.from_float(torch.randn(40, width) * 0.05, bits=bits)
    x = torch.randn(rows, width)
    x[1, :32] = 0            # a group of zeros
    x[2, 32:64] = 1e-30      # and one whose second digit is all zero
    x[3] *= 1e4
    x = x.to(dtype).contiguous()
    args = (layer.packed, layer.d, layer.m, 40, bits)
    want = torch.ops.dualserve.dot8_linear(x, *args, 1, digits)
    for force in (0, 2, 3):
        assert torch.equal(torch.ops.dualserve.dot8_linear(x, *args, force, digits), want), force
    assert kernels.code_path() in ("avx512_vnni", "avx2", "scalar")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("digits", [1, 2])
def test_quotients_near_a_half_round_as_a_division_rounds_them(dtype: torch.dtype, digits: int) -> None:
    """Groups whose every value is within a few ulps of (m + 1/2) s, where a quotient computed any
    other way than by a division (a multiply by the reciprocal: tried, and slower) would round to
    the other integer: every path's quantizer gives the bits of the plain C one."""
    g = torch.Generator().manual_seed(7)
    rows, width = 16, 512
    s = torch.rand(rows, width // 32, 1, generator=g) * 0.1 + 1e-3
    m = torch.randint(-126, 126, (rows, width // 32, 32), generator=g).float() + 0.5
    x = m * s * (1 + torch.randint(-4, 5, m.shape, generator=g).float() * 2.0 ** -24)
    x[..., 0] = 127 * s[..., 0]  # the group's largest value: its scale is s, give or take an ulp
    x = x.reshape(rows, width).to(dtype).contiguous()
    layer = Dot8Linear.from_float(torch.randn(40, width) * 0.05, bits=4)
    args = (layer.packed, layer.d, layer.m, 40, 4)
    want = torch.ops.dualserve.dot8_linear(x, *args, 1, digits)
    for force in (0, 2, 3):
        assert torch.equal(torch.ops.dualserve.dot8_linear(x, *args, force, digits), want), force


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


def test_the_sources_compile_side_by_side_and_link_or_fail_in_one_line(tmp_path, monkeypatch) -> None:
    """Each source is compiled to its own object, then linked: a library that loads; a source that
    does not compile is one error naming it."""
    import ctypes

    a, b, bad = tmp_path / "a.cpp", tmp_path / "b.cpp", tmp_path / "bad.cpp"
    a.write_text('extern "C" int a() { return 1; }\n')
    b.write_text('extern "C" int b() { return 2; }\n')
    bad.write_text("int f( {\n")
    monkeypatch.setattr(kernels, "_compile_flags", lambda: ["-O1", "-fPIC"])
    monkeypatch.setattr(kernels, "_link_flags", lambda: ["-shared"])
    monkeypatch.setattr(kernels, "SOURCES", (a, b))
    kernels._compile_and_link(tmp_path, tmp_path / "lib.so")
    lib = ctypes.CDLL(str(tmp_path / "lib.so"))
    assert (lib.a(), lib.b()) == (1, 2)
    monkeypatch.setattr(kernels, "SOURCES", (a, bad, b))
    with pytest.raises(RuntimeError, match=r"^building the kernels failed: \S*bad.cpp:1:\d+: error"):
        kernels._compile_and_link(tmp_path, tmp_path / "other.so")
    assert not (tmp_path / "other.so").exists()


def test_a_cpu_builds_the_code_paths_it_can_run(monkeypatch) -> None:
    """dot8's AVX2, AVX-512 and AMX tables are built for a CPU that torch reads as able to run
    each, and compiled empty otherwise (a null table, which dot8 never picks); the set is in the
    library's name."""
    cpus = {"avx2": (True, False, False, False), "avx512": (True, True, True, False), "amx": (True, True, True, True)}
    omitted = {}
    names = set()
    for cpu, (avx2, avx512, vnni, amx) in cpus.items():
        for name, value in (("avx2", avx2), ("avx512", avx512), ("vnni", vnni), ("amx_tile", amx)):
            monkeypatch.setattr(torch.cpu, f"_is_{name}_supported", lambda v=value: v)
        kernels._omitted.cache_clear()
        kernels.library_path.cache_clear()
        try:
            omitted[cpu] = kernels._omitted()
            names.add(kernels.library_path().name)
        finally:
            monkeypatch.undo()
            kernels._omitted.cache_clear()
            kernels.library_path.cache_clear()
    assert omitted == {"avx2": {"dot8_avx512.cpp", "dot8_amx.cpp"}, "avx512": {"dot8_amx.cpp"}, "amx": set()}
    assert len(names) == 3
    for source in kernels.PATH_SOURCES:  # an omitted path's source still compiles (to a null table)
        path = next(s for s in kernels.SOURCES if s.name == source)
        kernels._run([kernels._compiler(), "-fsyntax-only", str(path), *kernels._compile_flags(), "-DDOT8_OMIT"])


def test_two_environments_of_one_torch_name_the_library_alike(monkeypatch) -> None:
    """Where an environment keeps torch's headers and libraries is not in the library's name (the
    versions are): two virtual environments sharing a cache load one library, so their starts keep
    one host key. A flag that changes the code still changes the name."""
    def named(*flags: str) -> str:
        monkeypatch.setattr(kernels, "_flags", lambda: list(flags))
        kernels.library_path.cache_clear()
        return kernels.library_path().name

    try:
        a = named("-O3", "-I/venv-a/include", "-L/venv-a/lib", "-Wl,-rpath,/venv-a/lib", "-lc10")
        b = named("-O3", "-I/venv-b/include", "-L/venv-b/lib", "-Wl,-rpath,/venv-b/lib", "-lc10")
        o2 = named("-O2", "-I/venv-a/include", "-L/venv-a/lib", "-Wl,-rpath,/venv-a/lib", "-lc10")
    finally:
        monkeypatch.undo()
        kernels.library_path.cache_clear()
    assert a == b != o2


@pytest.mark.parametrize("path", ["avx2", "scalar"])
def test_the_narrower_paths_a_host_may_take_give_the_same_bits(tmp_path, path: str) -> None:
    """Run in a child with DUALSERVE_DOT8_PATH forcing the path an AVX2-only host takes."""
    torch.manual_seed(4)
    from dualserve.models.adapter import LoRA
    layers = {bits: Dot8Linear.from_float(torch.randn(72, 96) * 0.05, bits=bits) for bits in (4, 8)}
    layers["w4a16"] = Dot8Linear.from_float(torch.randn(72, 96) * 0.05, digits=2)
    # A projection with its adapter: one dot8_lora call on that path.
    layers["lora"] = LoRA.from_factors(layers[4], torch.randn(32, 96) * 0.05, torch.randn(72, 32) * 0.05, 2.0)
    assert layers["lora"].fused
    x = torch.randn(11, 96)
    took, got = run_in_child(tmp_path, layers, x, {"DUALSERVE_DOT8_PATH": path})
    if path == "avx2" and took != "avx2":
        pytest.skip(f"this CPU has no AVX2 (took {took})")
    assert took == path
    for bits, layer in layers.items():
        assert torch.equal(got[bits], layer(x)), bits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_avx2_quantizer_gives_the_same_bits(tmp_path, dtype: torch.dtype) -> None:
    """The AVX2 path's activation quantizer, in a child forced onto it, on one and two digits of wide
    rows (quantized on both threads) with edge groups: the bits of this host's path."""
    torch.manual_seed(6)
    layers = {d: Dot8Linear.from_float(torch.randn(40, 1536) * 0.05, digits=d) for d in (1, 2)}
    x = torch.randn(24, 1536)
    x[1, :32] = 0
    x[2, 32:64] = 1e-30
    x[3] *= 1e4
    x = x.to(dtype)
    took, got = run_in_child(tmp_path, layers, x, {"DUALSERVE_DOT8_PATH": "avx2"})
    if took != "avx2":
        pytest.skip(f"this CPU has no AVX2 (took {took})")
    for digits, layer in layers.items():
        assert torch.equal(got[digits], layer(x)), digits


def test_describe_names_the_path_or_why_there_is_none(monkeypatch) -> None:
    line = kernels.describe()
    amx = f" + amx from {kernels.amx_from()} rows" if kernels.amx_from() else ""
    assert line.startswith(f"dot8 {kernels.code_path()}{amx}, attend_rows, pointwise; built by ") and "\n" not in line
    monkeypatch.setattr(kernels, "_loaded", False)
    monkeypatch.setattr(kernels, "_error", "building the kernels failed: x.cpp:1: error: boom\nmore")
    assert kernels.describe() == ("kernels unavailable: building the kernels failed: x.cpp:1: error: boom; "
                                  "w4a8/w4a16 not offered, attention uses SDPA")


# ---- 5- and 6-bit weights, compact scales, packing in chunks ----

def narrow_entry(bits: int, minimum: bool, mult: int, out: int = 40, inp: int = 512, seed: int = 0) -> dict:
    """A portable weight whose values span ``bits`` (kernels.value_range), with K-quant-like scales
    (one D per super-block of 8 groups) and multipliers: none, equal halves (1) or per half (2)."""
    gen = torch.Generator().manual_seed(seed)
    lo, hi = kernels.value_range(bits, minimum)
    q = torch.randint(lo, hi + 1, (out, inp), generator=gen, dtype=torch.int16).to(torch.int8)
    groups = inp // 32
    per_block = (torch.rand(out, groups // 8, generator=gen) * 0.01 + 1e-4).half().float()
    parts = {"qweight": q, "scales": per_block.repeat_interleave(8, 1) if mult else
             (torch.rand(out, groups, generator=gen) * 0.01).half().float()}
    if minimum:
        zeros = -parts["scales"] * 3 if mult else torch.randn(out, groups, generator=gen) * 0.01
        parts["zeros"] = zeros.half().float()
    if mult:
        s = torch.randint(-127, 128, (out, groups, 2), generator=gen).clamp(-8256 // (2 * max(-lo, hi)),
                                                                          8256 // (2 * max(-lo, hi)))
        parts["scale_mult"] = (s if mult == 2 else s[..., :1].expand(-1, -1, 2)).to(torch.int8).contiguous()
        if minimum:
            parts["zero_mult"] = torch.randint(0, 64, (out, groups), generator=gen).to(torch.int8)
    return parts


# 4 bits without a minimum (Q4_0's q - 8 in -8..7) beside the 5- and 6-bit kinds
NARROW = [(4, False, mult) for mult in (0, 1, 2)] + [
    (bits, minimum, mult) for bits in (5, 6) for minimum in (False, True) for mult in (0, 1, 2)]


def as_int8(parts: dict, digits: int) -> Dot8Linear:
    """The same weight in the int8 representation (the kinds that existed before 5 and 6 bits)."""
    return Dot8Linear(parts["qweight"], parts["scales"], parts.get("zeros"), 8, None, digits,
                      parts.get("scale_mult"), parts.get("zero_mult"))


@pytest.mark.parametrize("bits,minimum,mult", NARROW)
def test_narrow_weights_pack_compactly_and_round_trip(bits: int, minimum: bool, mult: int) -> None:
    parts = narrow_entry(bits, minimum, mult)
    layer = Dot8Linear.from_portable(parts)
    assert layer.bits == bits and layer.packed.numel() == 3 * 16 * bits * 64  # 3 tiles, 16 groups
    assert (layer.d.shape[1] == 2) == bool(mult)  # D per super-block where the scales repeat over 8 groups
    assert layer.m.numel() == (layer.d.numel() if minimum else 0)
    assert mult != 1 or layer.s.shape == (3, 16, 16)  # one multiplier a group where both halves agree
    back = layer.portable()
    assert back.keys() == parts.keys() and all(torch.equal(back[k], parts[k]) for k in parts)
    assert torch.equal(Dot8Linear.from_portable(back).packed, layer.packed)


@pytest.mark.parametrize("bits,minimum,mult", NARROW)
def test_narrow_weights_give_the_int8_representations_bits(bits: int, minimum: bool, mult: int) -> None:
    """Same integers, same epilogue: on the AVX-512 (or the host's) and scalar paths, for 1, 3, 8 and 9
    rows and one or two digits; and the compact scales give the bits of their expanded forms."""
    parts = narrow_entry(bits, minimum, mult, seed=bits + 2 * minimum + 4 * mult)
    torch.manual_seed(5)
    x = torch.randn(9, 512)
    x[0, :32] = 0
    ops = torch.ops.dualserve
    for digits in (1, 2):
        narrow, wide = Dot8Linear.from_portable(parts, digits=digits), as_int8(parts, digits)
        assert narrow.bits == bits and wide.bits == 8
        full = wide(x)
        for rows in (1, 3, 8, 9):
            assert torch.equal(narrow(x[:rows]), full[:rows]), rows
        d = narrow.d.repeat_interleave(8, 1) if narrow.d.shape[1] != 16 else narrow.d
        m = narrow.m.repeat_interleave(8, 1) if minimum and narrow.m.shape[1] != 16 else narrow.m
        s = narrow.s if narrow.s is None or narrow.s.dim() == 4 else torch.stack([narrow.s, narrow.s], 2)
        for force in (0, 1):
            for args in ((narrow.d, narrow.m, narrow.s), (d, m, s)):
                got = ops.dot8_linear(x, narrow.packed, args[0], args[1], 40, bits, force, digits, args[2],
                                      narrow.mn, minimum)
                assert torch.equal(got, full), (force, args[0].shape)


def test_the_avx2_path_gives_the_int8_representations_bits(tmp_path) -> None:
    """Every narrow kind (4 bits without a minimum, 5 and 6 bits) and its int8 twin, in a child forced
    onto the AVX2 path."""
    layers = {}
    for bits, minimum, mult in NARROW:
        parts = narrow_entry(bits, minimum, mult, out=72, inp=256, seed=9)
        for digits in (1, 2):
            layers[f"{bits}/{minimum}/{mult}/{digits}"] = Dot8Linear.from_portable(parts, digits=digits)
            layers[f"{bits}/{minimum}/{mult}/{digits}/int8"] = as_int8(parts, digits)
    torch.manual_seed(6)
    x = torch.randn(9, 256)
    took, got = run_in_child(tmp_path, layers, x, {"DUALSERVE_DOT8_PATH": "avx2"}, rows=(1, 3, 8, 9))
    if took != "avx2":
        pytest.skip("this CPU has no AVX2")
    for name, layer in layers.items():
        want = layer(x)
        for rows, y in zip((1, 3, 8, 9), got[name]):
            assert torch.equal(y, want[:rows]), (name, rows)
        if not name.endswith("int8"):
            assert all(torch.equal(a, b) for a, b in zip(got[name], got[name + "/int8"])), name


def test_packing_in_chunks_gives_the_same_bytes(monkeypatch) -> None:
    from dualserve.models.kernels import layout

    parts = narrow_entry(6, True, 2, out=100, inp=256)
    whole = Dot8Linear.from_portable(parts)
    monkeypatch.setattr(layout, "CHUNK_WEIGHTS", 16 * 256 * 2)  # two tiles a step, a partial last one
    chunked = Dot8Linear.from_portable(parts)
    assert torch.equal(chunked.packed, whole.packed)
    back = chunked.portable()
    assert all(torch.equal(back[k], parts[k]) for k in parts)


def test_narrow_values_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match="-16..15"):
        kernels.pack(torch.full((16, 32), 16), torch.ones(16, 1), None, 5)
    with pytest.raises(ValueError, match="0..31"):
        kernels.pack(torch.full((16, 32), -1), torch.ones(16, 1), torch.zeros(16, 1), 5)
    assert kernels.narrowest_bits(torch.tensor([[-32, 31]]), False) == 6
    assert kernels.narrowest_bits(torch.tensor([[-33, 0]]), True) == 8


@pytest.mark.parametrize("force", [0, 1])  # the host's widest path, plain C
@pytest.mark.parametrize("digits", [1, 2])
def test_a_threads_reused_activation_buffers_change_no_bits(digits: int, force: int) -> None:
    """Quantized activations live in buffers each thread keeps from call to call (one per nesting
    depth: a LoRA call holds two): a small product after a large one, whose digits are left in
    them, and a LoRA call between them give the bits they give first and on a new thread."""
    import threading

    torch.manual_seed(5)
    q, scales, mins = quantize_int4(torch.randn(72, 96) * 0.05)
    base = kernels.pack(q, scales, mins, 4)
    qa, sa = int8_groups(torch.randn(32, 96) * 0.05)
    qb, sb = int8_groups(torch.randn(72, 32) * 0.05)
    a, b = kernels.pack(qa, sa, None, 8), kernels.pack(qb, sb, None, 8)
    small, large = torch.randn(1, 96), torch.randn(40, 96)

    def linear(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.dualserve.dot8_linear(x, *base, 72, 4, force, digits)

    def lora(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.dualserve.dot8_lora(x, *base, 72, 4, *a, 32, *b, force, digits)

    first, first_lora = linear(small), lora(small)
    linear(large)
    lora(large)
    fresh: list[torch.Tensor] = []
    thread = threading.Thread(target=lambda: fresh.extend([linear(small), lora(small)]))
    thread.start()
    thread.join()
    assert torch.equal(linear(small), first) and torch.equal(lora(small), first_lora)
    assert torch.equal(fresh[0], first) and torch.equal(fresh[1], first_lora)
