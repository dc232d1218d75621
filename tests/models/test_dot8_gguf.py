"""GGUF's block types kept packed: random raw blocks of every type in ``GGUF_PACKED`` dequantize to
``gguf.quants.dequantize``'s bits through the portable layout and through a ``Dot8Linear``, the
kernel computes the documented sum of the represented weight, every code path gives the same bits,
and the layers, heads, embeddings, fused parts and shards built from them stay exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dualserve.models import kernels
from dualserve.models.portable import GGUF_PACKED, concat_portable, dequantize_portable, gguf_blocks, portable_kind
from dualserve.models.quant import Dot8Linear, Int4Linear, QuantEmbedding, head_linear, to_linear

from dot8_child import run_in_child

needs_kernel = pytest.mark.skipif(not kernels.available(), reason="no C++ compiler for the dot8 kernel")

# Per type: the byte offsets of its fp16 fields, and the field's typical size (weights of about
# 0.05: D sc q for the K-quants, whose 6-bit sc and 4- to 6-bit q multiply D by up to ~4000).
FP16_FIELDS = {
    "Q4_0": ((0,), 0.01), "Q4_1": ((0, 2), 0.01), "Q8_0": ((0,), 5e-4), "Q5_0": ((0,), 4e-3),
    "Q5_1": ((0, 2), 4e-3), "IQ4_NL": ((0,), 5e-4), "Q4_K": ((0, 2), 1e-4), "Q5_K": ((0, 2), 5e-5),
    "Q6_K": ((208,), 2e-5), "IQ4_XS": ((0,), 2e-5),
}
NEW_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS")


def random_rows(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw GGUF rows (rows, bytes): random bytes, with each fp16 field a random finite value of its
    type's size (random sign and exponent, so D and Dmin differ in exponent and gguf's fp32 rounds)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    offsets, typical = FP16_FIELDS[kind]
    for at in offsets:
        v = typical * 10 ** rng.uniform(-0.5, 0.5, (rows, cols // block)) * rng.choice([-1, 1], (rows, cols // block))
        data[..., at:at + 2] = v.astype(np.float16)[..., None].view(np.uint8)
    return data.reshape(rows, -1)


def gguf_weight(data: np.ndarray, kind: str) -> torch.Tensor:
    import gguf
    from gguf import quants

    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(data, gguf.GGMLQuantizationType[kind])))


@pytest.mark.parametrize("kind", GGUF_PACKED)
def test_every_packed_type_dequantizes_to_gguf_bits(kind: str) -> None:
    data = random_rows(kind, 24, 512)
    parts = gguf_blocks(data, kind)
    assert torch.equal(dequantize_portable(parts), gguf_weight(data, kind))
    if kernels.available():
        assert torch.equal(Dot8Linear.from_portable(parts).dequantize(), gguf_weight(data, kind))


@needs_kernel
@pytest.mark.parametrize("digits", [1, 2])
@pytest.mark.parametrize("kind", NEW_TYPES + ("Q4_1", "Q8_0"))
def test_the_kernel_computes_the_documented_sum(kind: str, digits: int) -> None:
    out, inp = 40, 512  # 40: a partial last tile
    parts = gguf_blocks(random_rows(kind, out, inp, seed=1), kind)
    layer = Dot8Linear.from_portable(parts, digits=digits)
    torch.manual_seed(1)
    x = torch.randn(9, inp)
    x[0, :32] = 0  # an all-zero group quantizes to zeros with a zero scale
    bits = 4 if portable_kind(parts) == "int4" else 8
    want = kernels.reference(x, parts["qweight"], parts["scales"], parts.get("zeros"), bits, digits,
                             parts.get("scale_mult"), parts.get("zero_mult"))
    for rows in (1, 3, 8, 9):
        got = layer(x[:rows])
        torch.testing.assert_close(got.double(), want[:rows], rtol=1e-5, atol=1e-5 * float(want.abs().max()))
        assert torch.equal(got, layer(x)[:rows])  # a row's bits never depend on the rows beside it
    exact = x.double() @ layer.dequantize().double().t()
    assert (layer(x).double() - exact).abs().max() < (0.05 if digits == 1 else 1e-3) * exact.abs().max()


def kernel_args(layer: Dot8Linear) -> tuple:
    return layer.packed, layer.d, layer.m, layer.out_features, layer.bits


@needs_kernel
@pytest.mark.parametrize("kind", NEW_TYPES)
def test_the_scalar_path_gives_the_same_bits(kind: str) -> None:
    layer = Dot8Linear.from_portable(gguf_blocks(random_rows(kind, 200, 256, seed=2), kind))
    x = torch.randn(11, 256).to(torch.bfloat16)
    for digits in (1, 2):
        run = [torch.ops.dualserve.dot8_linear(x, *kernel_args(layer), force, digits, layer.s, layer.mn, layer.minimum)
               for force in (0, 1)]
        assert torch.equal(run[0], run[1])


@needs_kernel
@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q5_0", "Q5_K"])
def test_a_projection_with_multipliers_and_its_adapter_in_one_call(kind: str) -> None:
    """dot8_lora with a K-quant or 5-bit projection gives the bits of the three dot8_linear calls."""
    ops = torch.ops.dualserve
    base = Dot8Linear.from_portable(gguf_blocks(random_rows(kind, 200, 512, seed=3), kind))
    torch.manual_seed(3)
    a = Dot8Linear.from_float(torch.randn(32, 512) * 0.05, bits=8)
    u = Dot8Linear.from_float(torch.randn(200, 32) * 0.05, bits=8)
    x = torch.randn(5, 512)
    extra = (base.s, base.mn, base.minimum)
    want = ops.dot8_linear(x, *kernel_args(base), 0, 1, *extra) + u(a(x))
    got = ops.dot8_lora(x, *kernel_args(base), a.packed, a.d, a.m, 32, u.packed, u.d, u.m, 0, 1, *extra)
    assert torch.equal(got, want)


@needs_kernel
def test_multipliers_beyond_exact_integer_sums_are_refused() -> None:
    q = torch.full((16, 32), -128, dtype=torch.int8)
    with pytest.raises(ValueError, match="exact"):
        Dot8Linear(q, torch.ones(16, 1), None, 8, scale_mult=torch.full((16, 1, 2), 64, dtype=torch.int8))
    layer = Dot8Linear.from_portable(gguf_blocks(random_rows("Q6_K", 16, 256), "Q6_K"))
    with pytest.raises(RuntimeError, match="multipliers"):
        torch.ops.dualserve.dot8_linear(torch.randn(1, 256), *kernel_args(layer), 0, 1, None, layer.s, False)


@needs_kernel
@pytest.mark.parametrize("path", ["avx2", "scalar"])
def test_the_narrower_paths_a_host_may_take_give_the_same_bits(tmp_path, path: str) -> None:
    """Every packed type, one and two digits, in a child forced onto the path an AVX2-only host takes."""
    layers = {f"{kind}/{digits}": Dot8Linear.from_portable(gguf_blocks(random_rows(kind, 72, 256, seed=4), kind),
                                                           digits=digits)
              for kind in GGUF_PACKED for digits in (1, 2)}
    torch.manual_seed(4)
    x = torch.randn(11, 256)
    took, got = run_in_child(tmp_path, layers, x, {"DUALSERVE_DOT8_PATH": path})
    if path == "avx2" and took != "avx2":
        pytest.skip(f"this CPU has no AVX2 (took {took})")
    assert took == path
    for name, layer in layers.items():
        assert torch.equal(got[name], layer(x)), name


@needs_kernel
@pytest.mark.parametrize("fmt", ["w4a8", "w4a16"])
def test_the_dot8_formats_take_every_packed_type_exactly(fmt: str) -> None:
    for kind in GGUF_PACKED:
        data = random_rows(kind, 32, 256, seed=5)
        parts = gguf_blocks(data, kind)
        bias = torch.randn(32)
        for layer in (to_linear(parts, fmt, bias, torch.float32, "cpu"), head_linear(parts, fmt, torch.float32, "cpu")):
            assert isinstance(layer, Dot8Linear) and torch.equal(layer.dequantize(), gguf_weight(data, kind)), kind


def test_other_formats_dequantize_or_keep_the_int4_integers() -> None:
    for kind in ("Q4_K", "Q6_K", "Q5_1"):
        data = random_rows(kind, 32, 256, seed=6)
        w = gguf_weight(data, kind)
        layer = to_linear(gguf_blocks(data, kind), "none", None, torch.float32, "cpu")
        assert torch.equal(layer.weight, w), kind
    # Q4_K under int4: the file's integers, its scales D sc and minimums -Dmin m rounded to bf16 as Q4_1's are
    parts = gguf_blocks(random_rows("Q4_K", 32, 256, seed=6), "Q4_K")
    layer = to_linear(parts, "int4", None, torch.float32, "cpu")
    assert isinstance(layer, Int4Linear)
    w = dequantize_portable(parts)
    assert (layer.dequantize() - w).abs().max() <= w.abs().max() * 2 ** -6


@pytest.mark.parametrize("kind", ["Q8_0", "Q6_K", "IQ4_XS", "Q5_0", "Q4_K"])
def test_an_embedding_table_keeps_its_int8_groups(kind: str) -> None:
    data = random_rows(kind, 50, 256, seed=7)
    emb = QuantEmbedding.from_portable(gguf_blocks(data, kind))
    ids = torch.tensor([0, 7, 49])
    want = gguf_weight(data, kind)[ids]
    if kind == "Q4_K":  # a minimum: quantized again to int8 groups
        torch.testing.assert_close(emb(ids), want, rtol=0, atol=float(want.abs().max()) / 127)
    else:
        assert torch.equal(emb(ids), want)


def test_fused_parts_of_different_types_concatenate_exactly() -> None:
    """A K-quant file's q and k in Q4_K beside v in Q6_K (and other mixes) widen to one kind, exactly."""
    for kinds in (("Q4_K", "Q4_K", "Q6_K"), ("Q4_1", "Q5_1"), ("Q8_0", "Q4_0"), ("Q4_K", "Q8_0"), ("Q6_K", "Q8_0")):
        datas = [random_rows(k, 16 * (i + 1), 256, seed=8 + i) for i, k in enumerate(kinds)]
        fused = concat_portable([gguf_blocks(d, k) for d, k in zip(datas, kinds)])
        want = torch.cat([gguf_weight(d, k) for d, k in zip(datas, kinds)])
        assert torch.equal(dequantize_portable(fused), want), kinds
        if kernels.available():
            assert torch.equal(Dot8Linear.from_portable(fused).dequantize(), want), kinds


@needs_kernel
def test_shards_of_a_multiplier_layer_are_exact() -> None:
    from dualserve.models.sharding import take_cols, take_rows

    parts = gguf_blocks(random_rows("Q5_K", 48, 512, seed=9), "Q5_K")
    layer = Dot8Linear.from_portable(parts, digits=2)
    w = layer.dequantize()
    rows = torch.arange(8, 40)
    assert torch.equal(take_rows(layer, rows).dequantize(), w[rows])
    cols = take_cols(layer, 64, 320, keep_bias=False)
    assert torch.equal(cols.dequantize(), w[:, 64:320]) and cols.digits == 2
    x = torch.randn(3, 512)
    assert torch.equal(take_rows(layer, rows)(x), layer(x)[:, rows])


# Bits per weight in memory (packed values, d and m, multipliers) and the values' bits, by type.
MEMORY_BITS = {"Q4_0": (4, 4.5), "Q4_1": (4, 5.0), "Q8_0": (8, 8.5), "Q5_0": (5, 5.5), "Q5_1": (5, 6.0),
               "Q4_K": (4, 4.625), "Q5_K": (5, 5.625), "Q6_K": (6, 6.5625), "IQ4_NL": (8, 8.5), "IQ4_XS": (8, 8.3125)}


@needs_kernel
def test_q4_0_is_held_without_a_minimum() -> None:
    """Q4_0's minimum is -8 times its scale: the layer holds q - 8 and no minimum (Q4_1 keeps its own)."""
    q40 = Dot8Linear.from_portable(gguf_blocks(random_rows("Q4_0", 32, 256, seed=3), "Q4_0"))
    q41 = Dot8Linear.from_portable(gguf_blocks(random_rows("Q4_1", 32, 256, seed=3), "Q4_1"))
    assert (q40.bits, q40.minimum, q40.m.numel()) == (4, False, 0)
    assert (q41.bits, q41.minimum) == (4, True)
    back = q40.portable()
    assert back["qweight"].dtype == torch.int8 and int(back["qweight"].min()) >= -8 and "zeros" not in back


@needs_kernel
@pytest.mark.parametrize("kind", GGUF_PACKED)
def test_each_type_takes_its_bits_in_memory(kind: str) -> None:
    layer = Dot8Linear.from_portable(gguf_blocks(random_rows(kind, 64, 512, seed=10), kind))
    held = sum(b.numel() * b.element_size() for b in (layer.packed, layer.d, layer.m, layer.s, layer.mn)
               if b is not None)
    assert (layer.bits, 8 * held / (64 * 512)) == MEMORY_BITS[kind]


@needs_kernel
@pytest.mark.parametrize("kind", GGUF_PACKED)
def test_rows_are_the_dequantized_rows(kind: str) -> None:
    layer = Dot8Linear.from_portable(gguf_blocks(random_rows(kind, 40, 512, seed=11), kind))
    w = layer.dequantize()
    assert layer.rows(torch.tensor([], dtype=torch.long)).shape == (0, 512)
    for ids in (torch.tensor([0]), torch.tensor([39, 3, 17, 3, 16, 15]), torch.arange(40)):
        got = layer.rows(ids)
        assert got.dtype == torch.float32 and torch.equal(got, w[ids])


@needs_kernel
def test_a_q4_k_m_files_fused_projection_keeps_six_bits() -> None:
    """Q4_K q and k beside a Q6_K v: one 6-bit layer with a minimum (values -32..31), exact."""
    datas = [random_rows(k, 32, 256, seed=12 + i) for i, k in enumerate(("Q4_K", "Q4_K", "Q6_K"))]
    layer = Dot8Linear.from_portable(concat_portable([gguf_blocks(d, k) for d, k in
                                                      zip(datas, ("Q4_K", "Q4_K", "Q6_K"))]))
    assert layer.bits == 6 and layer.minimum
    assert torch.equal(layer.dequantize(), torch.cat([gguf_weight(d, k) for d, k in zip(datas, ("Q4_K", "Q4_K", "Q6_K"))]))


def test_rows_convert_a_few_at_a_time_with_the_same_result(monkeypatch) -> None:
    from dualserve.models import portable

    for kind in ("Q4_K", "Q6_K", "Q5_0"):
        data = random_rows(kind, 37, 512, seed=13)
        whole = gguf_blocks(data, kind)
        monkeypatch.setattr(portable, "BLOCK_ROWS_BYTES", 5 * data.shape[1])  # 5 rows a step, a partial last one
        parts = gguf_blocks(data, kind)
        monkeypatch.undo()
        assert parts.keys() == whole.keys() and all(torch.equal(parts[k], whole[k]) for k in whole), kind
