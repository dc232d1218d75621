"""What the CUDA path asks of PyTorch's kernels, checked on the CPU before any GPU sees it.

- int4: CUDA's packing (``_convert_weight_to_int4pack``, aten/src/ATen/native/cuda/int4mm.cu) takes
  2, 4 or 8 inner k-tiles of 16 and needs K to be a multiple of ``16 * tiles``; its matmul needs N
  to be a multiple of 8. ``cuda_int4_inner_k_tiles`` picks a packing for every projection of the
  bundled models, the write_gguf presets, Llama-3.1-8B and their tensor-parallel shards, and
  ``Int4Linear`` on CUDA packs with it (the packing op replaced by one that makes the kernel's own
  checks);
- ``torch._int_mm`` on CUDA takes more than 16 rows and K, N multiples of 8: the padded product is
  the same bits as the plain one on the CPU;
- the dot8 formats are refused off the CPU, and ``auto`` there picks a format CUDA runs.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from dualserve.clients.write_gguf import PRESETS
from dualserve.models import formats, quant
from dualserve.models.config import ModelConfig
from dualserve.models.families import read_config
from dualserve.models.errors import InputError
from dualserve.models.quant import (GROUP, Int4Linear, W8A8Linear, cuda_int4_inner_k_tiles, int4_runs, pack_int4,
                                    padded_int_mm)
from dualserve.models.sharding import most_ranks, split_sizes

ASSETS = Path(quant.__file__).parent / "assets"
GPU_WORLDS = (2, 4, 8)  # tensor-parallel sizes of one GPU machine (NVLink groups)
# Llama-3.1-8B's config.json on the Hugging Face hub (write_gguf has no 8B preset).
LLAMA_8B = ModelConfig(family="llama", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                       num_kv_heads=8, head_dim=128, intermediate_size=14336)


def kernel_accepts(out_features: int, in_features: int, tiles: int, group: int = GROUP) -> bool:
    """The TORCH_CHECKs of int4mm.cu that a weight of this shape meets with this packing."""
    if tiles not in (2, 4, 8):
        return False
    convert = in_features % (tiles * 16) == 0 and in_features // (tiles * 16) >= 1  # isEvenDivisor(K, tiles*16)
    k_tiles = -(-in_features // 16)
    mm = (group in (32, 64, 128, 256) and k_tiles * 16 % group == 0
          and k_tiles % tiles == 0                     # launch_tinygemm_kernel: kTiles a multiple of innerKTiles
          and -(-out_features // 8) * 8 == out_features)  # qScaleAndZeros.size(1) == n-tiles * 8
    return convert and mm


def projections(cfg: ModelConfig) -> set[tuple[int, int]]:
    """(out, in) of every int4 projection of ``cfg``: the layers' fused q/k/v, o, gate/up, down."""
    return set(cfg.projection_shapes.values())


def shards(cfg: ModelConfig, world: int) -> set[tuple[int, int]]:
    """(out, in) of every rank's projections under ``models.sharding`` (both reductions): q/k/v and
    gate/up by whole heads and MLP groups; o and down either by input columns (sum) or output rows
    (exact, in units of 16 where they divide)."""
    group, d = cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    mlp_unit = GROUP if cfg.intermediate_size // GROUP >= world else 1
    shapes = set()
    for kv in split_sizes(cfg.num_kv_heads, world):
        shapes |= {(kv * (group + 2) * d, cfg.hidden_size), (cfg.hidden_size, kv * group * d)}
    for inter in split_sizes(cfg.intermediate_size, world, mlp_unit):
        shapes |= {(2 * inter, cfg.hidden_size), (cfg.hidden_size, inter)}
    unit = 16 if cfg.hidden_size % (16 * world) == 0 else 1
    for out in split_sizes(cfg.hidden_size, world, unit):
        shapes |= {(out, cfg.num_heads * d), (out, cfg.intermediate_size)}
    return shapes


def bundled_configs() -> dict[str, ModelConfig]:
    configs = {p.parent.name: read_config(json.loads(p.read_text())) for p in ASSETS.glob("*/config.json")}
    for name, s in PRESETS.items():
        configs[name] = ModelConfig(family="llama", vocab_size=32000, hidden_size=s.hidden, num_layers=s.layers,
                                    num_heads=s.heads, num_kv_heads=s.kv_heads, head_dim=s.head_dim,
                                    intermediate_size=s.ffn)
    configs["llama-3.1-8b"] = LLAMA_8B
    return configs


@functools.cache
def every_shape() -> dict[str, set[tuple[int, int]]]:
    out = {}
    for name, cfg in bundled_configs().items():
        shapes = projections(cfg)
        ranks = most_ranks(cfg.num_kv_heads, cfg.intermediate_size, cfg.vocab_size)[0]
        for world in (w for w in GPU_WORLDS if w <= ranks):
            shapes |= shards(cfg, world)
        out[name] = shapes
    eagle = bundled_configs()["eagle-smollm2"]
    out["eagle-smollm2"].add((eagle.hidden_size, 3 * eagle.hidden_size))  # EAGLE-3's fc: three residual streams
    return out


def test_the_default_models_shapes_get_the_widest_packing_cuda_takes() -> None:
    # SmolLM2-135M: hidden 576 (= 4.5 x 128) takes 4 inner k-tiles, its MLP's 1536 takes 8;
    # the EAGLE head's fc (1728) 4; a rank's o_proj of one kv head (192) 4.
    assert cuda_int4_inner_k_tiles(960, 576) == 4
    assert cuda_int4_inner_k_tiles(576, 1536) == 8
    assert cuda_int4_inner_k_tiles(576, 1728) == 4
    assert cuda_int4_inner_k_tiles(576, 192) == 4
    assert cuda_int4_inner_k_tiles(576, 96) == 2
    assert not kernel_accepts(960, 576, 8)  # the fixed packing of 8 tiles, which CUDA refused here
    assert cuda_int4_inner_k_tiles(576, 48) is None  # not whole groups of 32
    assert cuda_int4_inner_k_tiles(100, 576) is None  # N not a multiple of 8


@pytest.mark.parametrize("name", sorted(every_shape()))
def test_every_projection_and_shard_packs_as_cuda_checks(name: str) -> None:
    for out_features, in_features in sorted(every_shape()[name]):
        tiles = cuda_int4_inner_k_tiles(out_features, in_features)
        assert tiles is not None, (name, out_features, in_features)
        assert kernel_accepts(out_features, in_features, tiles), (name, out_features, in_features, tiles)
        wider = [t for t in (8, 4, 2) if t > tiles]
        assert not any(kernel_accepts(out_features, in_features, t) for t in wider)  # the widest that fits


def test_the_tile_choice_agrees_with_the_kernels_checks_on_every_small_shape() -> None:
    for out_features in (8, 16, 24, 100, 576):
        for in_features in range(32, 2049, 32):
            tiles = cuda_int4_inner_k_tiles(out_features, in_features)
            fits = [t for t in (8, 4, 2) if kernel_accepts(out_features, in_features, t)]
            assert tiles == (fits[0] if fits else None), (out_features, in_features)


def test_int4_on_cuda_packs_with_the_chosen_tiles(monkeypatch) -> None:
    """``Int4Linear``'s CUDA packing, with the CUDA op replaced by one that makes its checks and
    returns its output shape (int4mm.cu: [n / 8][k / (tiles * 16)][32][tiles / 2])."""
    seen = []

    def convert(nibbles: torch.Tensor, tiles: int) -> torch.Tensor:
        n, k = nibbles.shape[0], nibbles.shape[1] * 2
        assert nibbles.dtype == torch.uint8 and nibbles.is_contiguous()
        assert kernel_accepts(n, k, tiles), (n, k, tiles)
        seen.append(tiles)
        return torch.zeros(n // 8, k // (tiles * 16), 32, tiles // 2, dtype=torch.int32)

    monkeypatch.setattr(torch.ops.aten, "_convert_weight_to_int4pack", convert, raising=False)
    q = torch.randint(0, 16, (960, 576), dtype=torch.uint8)
    assert pack_int4(q, "cuda").shape == (120, 576 // 64, 32, 2)
    pack_int4(torch.randint(0, 16, (576, 1536), dtype=torch.uint8), "cuda")
    assert seen == [4, 8]
    with pytest.raises(ValueError, match="keep this layer in float"):
        pack_int4(torch.randint(0, 16, (576, 48), dtype=torch.uint8), "cuda")


def test_the_cpu_int4_layout_and_numerics_are_unchanged() -> None:
    torch.manual_seed(0)
    w = torch.randn(96, 576) * 0.02
    layer = Int4Linear.from_float(w)
    assert layer.kernel == "cpu" and "cuda" not in vars(layer) and callable(layer.cuda)
    q, scales, zeros = quant.quantize_int4(w)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    assert torch.equal(layer.packed, packed)
    x = torch.randn(3, 576)
    want = torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), packed, GROUP, layer.scales_and_zeros).float()
    assert torch.equal(layer(x), want)
    assert layer.cpu() is layer  # nn.Module.cpu() / .cuda() are the module's own again


def test_int4_layers_cuda_cannot_pack_stay_float_there() -> None:
    assert int4_runs(576, 48, "cpu") is False and int4_runs(576, 96, "cpu") is True
    assert int4_runs(100, 576, "cpu") is True and int4_runs(100, 576, "cuda") is False
    assert quant.layer_format("int4", 960, 576, "cuda") == "int4"
    assert quant.layer_format("int4", 100, 576, "cuda") == "none"   # bf16 there, not CUDA's naive int8
    assert quant.layer_format("int4", 100, 576, "cpu") == "int4"    # the CPU's choices are as they were
    assert quant.layer_format("int4", 96, 48, "cpu") == "int8"
    assert quant.layer_format("int4", 96, 40, "cpu") == "none"
    assert quant.layer_format("w4a16", 96, 48, "cpu") == "int8"


@pytest.mark.parametrize("rows", [1, 3, 8, 16, 17, 40])
@pytest.mark.parametrize("k, n", [(576, 32), (32, 960), (20, 12)])
def test_int_mm_padded_to_cudas_shapes_gives_the_same_bits(rows: int, k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(rows * k + n)
    a = torch.randint(-127, 128, (rows, k), generator=gen, dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    want = torch._int_mm(a, w.t())
    assert torch.equal(want, (a.long() @ w.long().t()).int())  # exact sums
    got = padded_int_mm(a, w.t())
    assert got.shape == (rows, n) and got.dtype == torch.int32
    assert torch.equal(got, want)


def test_the_twins_lora_layer_is_the_same_bits_with_padded_products(monkeypatch) -> None:
    """W8A8Linear (two digits, as the twin's LoRA) with every product padded as on CUDA."""
    torch.manual_seed(1)
    layer = W8A8Linear.from_float(torch.randn(32, 576) * 0.05, digits=2)
    x = torch.randn(4, 576)
    want = layer(x)
    monkeypatch.setattr(quant, "int_mm", padded_int_mm)
    assert torch.equal(layer(x), want)


def test_dot8_formats_are_refused_off_the_cpu_in_one_line() -> None:
    for fmt in ("w4a8", "w4a16"):
        formats.check_device(fmt, "cpu")
        with pytest.raises(InputError) as e:  # printed as one line by every command (errors.one_line)
            formats.check_device(fmt, "cuda:0")
        assert "\n" not in str(e.value) and fmt in str(e.value)
    for fmt in ("none", "int8", "int4", "auto"):
        formats.check_device(fmt, "cuda")


def test_auto_off_the_cpu_picks_a_format_cuda_runs(monkeypatch) -> None:
    from dualserve.models import kernels

    monkeypatch.setattr(kernels, "available", lambda: pytest.fail("the CPU kernels were asked for"))
    assert formats.off_cpu_choice("int4", "cuda") == "int4"
    assert formats.off_cpu_choice("none", "cuda") == "none"
    assert formats.off_cpu_choice("w4a16", "cuda") == "int4"
    assert formats.off_cpu_choice("w4a16", "cpu") == "w4a16"


def test_an_int4_layer_gives_back_its_integers_exactly() -> None:
    """``Int4Linear.values`` (what tensor-parallel slicing re-packs, ``sharding_core.int4_values``)."""
    torch.manual_seed(2)
    q, scales, zeros = quant.quantize_int4(torch.randn(96, 128))
    assert torch.equal(Int4Linear(q, scales, zeros).values(), q)
