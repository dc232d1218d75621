"""Twin loading: the merged weights are exactly base + scale * B @ A, and the config is block diffusion."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dualserve.models.adapter import (ADAPTER_FILE, DEFAULT_TWIN_DIR, TwinSpec, apply_twin, is_twin_dir, lora_names,
                                      save_twin)
from dualserve.models import kernels
from dualserve.models.attention import DenseAttention
from dualserve.models.families import read_config
from dualserve.models.loader import hf_config_dict, load_model, load_twin
from tiny_twin import write_tiny_llama

MASK_ID = 4


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("base") / "tiny-llama")


def random_adapter(model, rank: int, seed: int = 0, zero_b: bool = False) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {"mask_embedding": torch.randn(model.config.hidden_size, generator=gen)}
    state = model.state_dict()
    for name in lora_names(model):
        out_f, in_f = state[f"{name}.weight"].shape
        out[f"{name}.lora_A"] = torch.randn(rank, in_f, generator=gen) * 0.1
        b = torch.randn(out_f, rank, generator=gen) * 0.1
        out[f"{name}.lora_B"] = torch.zeros_like(b) if zero_b else b
    return out


def write_twin(base_dir: Path, out: Path, *, rank: int = 4, alpha: float = 8.0, zero_b: bool = False) -> Path:
    base = load_model(base_dir)
    spec = TwinSpec(block_size=4, mask_token_id=MASK_ID, base_model=str(base_dir), rank=rank, alpha=alpha)
    save_twin(out, hf_config_dict(base.config), spec, random_adapter(base.model, rank, zero_b=zero_b))
    return out


def test_merged_weights_are_base_plus_scaled_lora(base_dir: Path, tmp_path: Path) -> None:
    twin_dir = write_twin(base_dir, tmp_path / "twin")
    base = load_model(base_dir)
    twin = load_twin(twin_dir)
    adapter = {k: v.float() for k, v in load_file(str(twin_dir / ADAPTER_FILE)).items()}  # as stored (bf16)
    ours, theirs = twin.model.state_dict(), base.model.state_dict()
    scale = 8.0 / 4
    for name in lora_names(base.model):
        expected = theirs[f"{name}.weight"] + scale * adapter[f"{name}.lora_B"] @ adapter[f"{name}.lora_A"]
        torch.testing.assert_close(ours[f"{name}.weight"], expected, rtol=0, atol=1e-6)
    emb, base_emb = ours["embed_tokens.weight"], theirs["embed_tokens.weight"]
    assert torch.equal(emb[MASK_ID], adapter["mask_embedding"])
    others = torch.arange(emb.shape[0]) != MASK_ID
    assert torch.equal(emb[others], base_emb[others])
    for name in theirs:
        if "norm" in name:
            assert torch.equal(ours[name], theirs[name])


def test_twin_config_is_block_diffusion(base_dir: Path, tmp_path: Path) -> None:
    twin = load_twin(write_twin(base_dir, tmp_path / "twin"))
    cfg = twin.config
    assert (cfg.family, cfg.diffusion_block_size, cfg.mask_token_id, cfg.shift_logits) == (
        "block_diffusion", 4, MASK_ID, True)
    assert cfg.is_diffusion and twin.model.config == cfg
    # The same keys read from config.json alone, as any loader of the directory would.
    from_json = read_config(json.loads((tmp_path / "twin" / "config.json").read_text()))
    assert (from_json.family, from_json.diffusion_block_size, from_json.mask_token_id, from_json.shift_logits) == (
        "block_diffusion", 4, MASK_ID, True)


def test_zero_adapter_computes_the_base_model(base_dir: Path, tmp_path: Path) -> None:
    base = load_model(base_dir)
    twin = apply_twin(base, write_twin(base_dir, tmp_path / "twin", zero_b=True))
    ids = torch.tensor([1, 7, 9, 11, 2, 12, 13])  # no [MASK]
    pos = torch.arange(len(ids))
    with torch.inference_mode():
        a = base.model.logits(base.model(ids, pos, DenseAttention([len(ids)]))[0])
        b = twin.model.logits(twin.model(ids, pos, DenseAttention([len(ids)]))[0])
    keep = torch.arange(a.shape[1]) != MASK_ID  # tied head: the [MASK] column follows the new row
    torch.testing.assert_close(a[:, keep], b[:, keep], rtol=0, atol=1e-5)


def test_apply_twin_leaves_the_base_alone_and_shares_norms(base_dir: Path, tmp_path: Path) -> None:
    base = load_model(base_dir)
    before = {k: v.clone() for k, v in base.model.state_dict().items()}
    twin = apply_twin(base, write_twin(base_dir, tmp_path / "twin"))
    for k, v in base.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert twin.model.norm.weight.data_ptr() == base.model.norm.weight.data_ptr()
    assert twin.tokenizer is base.tokenizer


def test_relative_base_path_and_detection(base_dir: Path, tmp_path: Path) -> None:
    twin_dir = write_twin(base_dir, tmp_path / "twin")
    cfg = json.loads((twin_dir / "config.json").read_text())
    (tmp_path / "base").symlink_to(base_dir)
    cfg["dualserve_diffusion"]["base_model"] = "../base"
    (twin_dir / "config.json").write_text(json.dumps(cfg))
    assert is_twin_dir(twin_dir) and not is_twin_dir(base_dir)
    assert load_twin(twin_dir).config.family == "block_diffusion"
    assert load_model(twin_dir).config.family == "block_diffusion"  # the loader's hook for twin directories


def test_default_twin_is_committed() -> None:
    cfg = json.loads((DEFAULT_TWIN_DIR / "config.json").read_text())
    assert cfg["dualserve_diffusion"]["base_model"] == "SmolLM2-135M-Instruct"
    assert read_config(cfg).family == "block_diffusion"
    assert (DEFAULT_TWIN_DIR / ADAPTER_FILE).stat().st_size < 64 * 2**20


def test_shape_mismatch_is_an_error(base_dir: Path, tmp_path: Path) -> None:
    twin_dir = write_twin(base_dir, tmp_path / "twin")
    cfg = json.loads((twin_dir / "config.json").read_text())
    cfg["hidden_size"] += 1
    (twin_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="trained for"):
        load_twin(twin_dir)


@pytest.mark.slow
def test_default_twin_on_the_default_model(default_gguf: Path, cache_dir: Path) -> None:
    base = load_model(default_gguf, cache_dir=cache_dir)
    twin = apply_twin(base, DEFAULT_TWIN_DIR, name=base.name)
    cfg = twin.config
    assert (cfg.family, cfg.shift_logits, cfg.num_layers) == ("block_diffusion", True, base.config.num_layers)
    tok = base.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}]))
    seq = torch.tensor(prompt + [cfg.mask_token_id] * (-len(prompt) % cfg.diffusion_block_size or 8))
    attn = DenseAttention([len(seq)], "block_causal", cfg.diffusion_block_size)
    with torch.inference_mode():
        logits = twin.model.logits(twin.model(seq, torch.arange(len(seq)), attn)[0])
    assert torch.isfinite(logits).all()
    assert (logits[len(prompt) - 1:-1].argmax(-1) != cfg.mask_token_id).all()


def test_recorded_threshold_is_the_decoders_default() -> None:
    from dualserve.decoders.diffusion.decoder import default_config

    spec = TwinSpec(block_size=4, mask_token_id=4, base_model="m", rank=2, alpha=2.0, threshold=0.7)
    base = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 48}
    cfg = read_config(base | spec.config_keys())
    assert TwinSpec.from_config(base | spec.config_keys()) == spec
    assert cfg.diffusion_threshold == 0.7 and default_config(cfg).policy.tau == 0.7
    plain = TwinSpec(block_size=4, mask_token_id=4, base_model="m", rank=2, alpha=2.0)
    assert "threshold" not in plain.config_keys()["dualserve_diffusion"]
    assert default_config(read_config(base | plain.config_keys())).policy.tau == 0.9


@pytest.mark.parametrize("fmt", ["int4", "w4a8"])
def test_twin_shares_a_quantized_base(default_gguf, cache_dir, fmt: str) -> None:
    """On quantized weights the twin adds only its adapter: every base projection, norm and the head are the
    AR model's own objects, and its block-causal logits follow the merged fp32 twin's. Beside dot8 layers
    the adapter runs in dot8 too."""
    from dualserve.models.adapter import LoRA, MaskedEmbedding
    from dualserve.models.quant import Dot8Linear, W8A8Linear

    if fmt == "w4a8" and not kernels.available():
        pytest.skip(f"the dot8 kernel is not available: {kernels.unavailable_reason()}")
    base = load_model(default_gguf, cache_dir=cache_dir, quantization=fmt)
    twin = load_twin(DEFAULT_TWIN_DIR, base=base).model
    layer, own = twin.layers[2], base.model.layers[2]
    assert isinstance(layer.mlp.down_proj, LoRA) and layer.mlp.down_proj.base is own.mlp.down_proj
    kind = Dot8Linear if fmt == "w4a8" else W8A8Linear
    assert isinstance(layer.mlp.down_proj.down, kind) and isinstance(layer.mlp.down_proj.up, kind)
    assert layer.input_layernorm is own.input_layernorm and twin.lm_head is base.model.lm_head
    assert isinstance(twin.embed_tokens, MaskedEmbedding) and twin.embed_tokens.base is base.model.embed_tokens
    merged = load_twin(DEFAULT_TWIN_DIR, base=load_model(default_gguf, cache_dir=cache_dir)).model
    ids = torch.tensor([1, 504, 3575, 282, 4649, 314] + [merged.config.mask_token_id] * 4)
    attn = DenseAttention([len(ids)], "block_causal", merged.config.diffusion_block_size)
    with torch.inference_mode():
        got = twin.logits(twin(ids, torch.arange(len(ids)), attn)[0])
        want = merged.logits(merged(ids, torch.arange(len(ids)), attn)[0])
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.99


@pytest.mark.parametrize("fmt", ["int4", "w4a8"])
def test_the_adapter_gives_a_row_the_same_bits_in_any_batch(default_gguf, cache_dir, fmt: str) -> None:
    """Batching never changes the twin's output: each adapted projection maps a row to the same bits
    whatever rows share its batch, and the thread count does not matter either."""
    from dualserve.models.adapter import LoRA

    if fmt == "w4a8" and not kernels.available():
        pytest.skip(f"the dot8 kernel is not available: {kernels.unavailable_reason()}")
    base = load_model(default_gguf, cache_dir=cache_dir, quantization=fmt)
    twin = load_twin(DEFAULT_TWIN_DIR, base=base).model
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    try:
        for module in (twin.layers[0].self_attn.qkv_proj, twin.layers[0].mlp.down_proj):
            assert isinstance(module, LoRA)
            x = torch.randn(24, module.down.in_features)
            with torch.inference_mode():
                whole = module(x)
                for n in {1, threads}:
                    torch.set_num_threads(n)
                    assert torch.equal(torch.cat([module(x[i:i + 1]) for i in range(24)]), whole)
                    assert torch.equal(module(x[5:9]), whole[5:9])
    finally:
        torch.set_num_threads(threads)



@pytest.mark.parametrize("force_scalar", [0, 1])
def test_the_fused_adapter_kernel_gives_the_three_calls_bits(force_scalar: int) -> None:
    """``dot8_lora`` (projection and both factors in one call) against the three dot8 calls it
    replaces, on every code path this host has, at row counts across the kernel's row blocks."""
    if not kernels.available():
        pytest.skip(f"the dot8 kernel is not available: {kernels.unavailable_reason()}")
    from dualserve.models.adapter import LoRA
    from dualserve.models.quant import Dot8Linear
    torch.manual_seed(0)
    base = Dot8Linear.from_float(torch.randn(200, 576) * 0.05, bits=4)  # 200: a partial last tile
    lora = LoRA.from_factors(base, torch.randn(32, 576) * 0.05, torch.randn(200, 32) * 0.05, 2.0)
    assert lora.fused
    ops, b, a, u = torch.ops.dualserve, lora.base, lora.down, lora.up
    for rows in (1, 3, 8, 9, 19):
        x = torch.randn(rows, 576)
        down = ops.dot8_linear(x, a.packed, a.d, a.m, a.out_features, 8, force_scalar)
        want = ops.dot8_linear(x, b.packed, b.d, b.m, 200, 4, force_scalar) + \
            ops.dot8_linear(down, u.packed, u.d, u.m, 200, 8, force_scalar)
        got = ops.dot8_lora(x, b.packed, b.d, b.m, 200, 4, a.packed, a.d, a.m, 32, u.packed, u.d, u.m, force_scalar)
        assert torch.equal(got, want), rows
    assert torch.equal(lora(x), lora.base(x) + lora.up(lora.down(x)))  # the module takes the fused call
