"""The transformer core and its cache-free attention against references written out by hand.

* ``DenseAttention`` in all three modes (causal, bidirectional, block-causal) against a naive
  attention with explicit loops and an explicit softmax, GQA done by repeating kv heads the
  way transformers' ``repeat_kv`` does (query head h reads kv head h // (heads // kv_heads)).
* The whole ``Transformer`` against a naive model (RMSNorm, RoPE pair by pair, naive attention,
  SwiGLU) in every mode, so the fused projections and the backend wiring are covered too.
* RoPE frequencies, including llama3 scaling, against transformers' own rope init functions,
  and our rotation against ``apply_rotary_pos_emb``.
* Ragged batches: a flattened batch of sequences of different lengths gives exactly what
  running each sequence alone gives.
"""

from __future__ import annotations

import math

import pytest
import torch

from dualserve.models.attention import DenseAttention, block_causal_mask
from dualserve.models.config import ModelConfig, RopeScaling, rope_inv_freq
from dualserve.models.families import read_config
from dualserve.models.transformer import Transformer, apply_rope

MODES = ["causal", "bidirectional", "block_causal"]
BLOCK = 4
ATOL = 2e-5  # fp32: the references sum in a different order than SDPA


# ---- naive references -------------------------------------------------------------


def may_attend(mode: str, i: int, j: int, block_size: int = BLOCK) -> bool:
    """Whether query position i sees key position j, written from the definitions."""
    if mode == "causal":
        return j <= i
    if mode == "bidirectional":
        return True
    return j // block_size <= i // block_size  # full inside a block, causal across blocks


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mode: str,
                    mask: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence. q: (n, heads, d); k, v: (n, kv_heads, d) -> (n, heads, d), in float64."""
    n, heads, d = q.shape
    group = heads // k.shape[1]
    out = torch.zeros(n, heads, d, dtype=torch.float64)
    q, k, v = q.double(), k.double(), v.double()
    for h in range(heads):
        kv = h // group  # repeat_kv: each kv head serves `group` consecutive query heads
        for i in range(n):
            visible = [j for j in range(n) if (bool(mask[i, j]) if mask is not None else may_attend(mode, i, j))]
            scores = [float(q[i, h] @ k[j, kv]) / math.sqrt(d) for j in visible]
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            for j, w in zip(visible, weights):
                out[i, h] += (w / total) * v[j, kv]
    return out


def naive_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def naive_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate each pair (i, i + d/2) by pos * theta^(-2i/d): the rotate-half convention. x: (n, heads, d)."""
    n, heads, d = x.shape
    out = x.clone()
    for p in range(n):
        for i in range(d // 2):
            angle = float(positions[p]) * theta ** (-2 * i / d)
            c, s = math.cos(angle), math.sin(angle)
            a, b = x[p, :, i], x[p, :, i + d // 2]
            out[p, :, i] = a * c - b * s
            out[p, :, i + d // 2] = a * s + b * c
    return out


def naive_forward(model: Transformer, ids: torch.Tensor, mode: str) -> torch.Tensor:
    """Logits (n, vocab) for one sequence, in float64, from the model's weights."""
    cfg = model.config
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    positions = torch.arange(len(ids))
    x = model.embed_tokens.weight[ids].double()
    for layer in model.layers:
        h = naive_rms_norm(x, layer.input_layernorm.weight.double(), cfg.rms_norm_eps)
        w = layer.self_attn.qkv_proj.weight.double()
        b = layer.self_attn.qkv_proj.bias
        qkv = h @ w.T + (b.double() if b is not None else 0)
        q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
        q = naive_rope(q.reshape(len(ids), cfg.num_heads, cfg.head_dim), positions, cfg.rope_theta)
        k = naive_rope(k.reshape(len(ids), cfg.num_kv_heads, cfg.head_dim), positions, cfg.rope_theta)
        v = v.reshape(len(ids), cfg.num_kv_heads, cfg.head_dim)
        attn = naive_attention(q, k, v, mode).reshape(len(ids), -1)
        x = x + attn @ layer.self_attn.o_proj.weight.double().T
        h = naive_rms_norm(x, layer.post_attention_layernorm.weight.double(), cfg.rms_norm_eps)
        gate, up = (h @ layer.mlp.gate_up_proj.weight.double().T).chunk(2, dim=-1)
        x = x + (torch.nn.functional.silu(gate) * up) @ layer.mlp.down_proj.weight.double().T
    x = naive_rms_norm(x, model.norm.weight.double(), cfg.rms_norm_eps)
    return x @ model.lm_head_weight.double().T


# ---- fixtures ---------------------------------------------------------------------------


def tiny_config(**changes) -> ModelConfig:
    base = ModelConfig(family="llama", vocab_size=61, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=8, intermediate_size=48, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=128)
    return base.replace(**changes)


def random_model(config: ModelConfig, seed: int = 0) -> Transformer:
    """A Transformer with every weight redrawn so that mistakes show in the logits."""
    gen = torch.Generator().manual_seed(seed)
    model = Transformer(config).eval().requires_grad_(False)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith("bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        elif p.ndim == 2 and "embed" not in name:
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
        else:
            p.copy_(torch.randn(p.shape, generator=gen))
    return model


def run(model: Transformer, seqs: list[torch.Tensor], mode: str) -> list[torch.Tensor]:
    """Logits per sequence from one flattened call; positions restart at 0 for each sequence."""
    ids = torch.cat(seqs)
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    attn = DenseAttention([len(s) for s in seqs], mode=mode, block_size=BLOCK)
    hidden, _ = model(ids, positions, attn)
    return list(model.logits(hidden).split([len(s) for s in seqs]))


def qkv(lens: list[int], heads: int = 4, kv_heads: int = 2, d: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lens)
    return (torch.randn(total, heads, d, generator=gen), torch.randn(total, kv_heads, d, generator=gen),
            torch.randn(total, kv_heads, d, generator=gen))


# ---- attention backend -----------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lens", [[7], [6, 6, 6], [5, 1, 9, 3]], ids=["single", "equal", "ragged"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_dense_attention_matches_naive(mode: str, lens: list[int], kv_heads: int) -> None:
    q, k, v = qkv(lens, kv_heads=kv_heads)
    out = DenseAttention(lens, mode=mode, block_size=BLOCK)(0, q, k, v)
    assert out.shape == q.shape
    start = 0
    for n in lens:
        sl = slice(start, start + n)
        ref = naive_attention(q[sl], k[sl], v[sl], mode)
        torch.testing.assert_close(out[sl].double(), ref, atol=ATOL, rtol=0)
        start += n


def test_explicit_masks_match_naive() -> None:
    """A per-sequence explicit mask (EAGLE tree verification) overrides the mode."""
    lens = [5, 4]
    gen = torch.Generator().manual_seed(3)
    masks = [torch.rand(n, n, generator=gen) > 0.5 for n in lens]
    for m in masks:
        m.fill_diagonal_(True)  # every row sees at least itself
    q, k, v = qkv(lens, seed=1)
    out = DenseAttention(lens, mode="causal", masks=masks)(0, q, k, v)
    ref = torch.cat([naive_attention(q[:5], k[:5], v[:5], "", masks[0]),
                     naive_attention(q[5:], k[5:], v[5:], "", masks[1])])
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=0)


def test_block_causal_mask_definition() -> None:
    n = 10
    mask = block_causal_mask(n, BLOCK)
    expected = torch.tensor([[may_attend("block_causal", i, j) for j in range(n)] for i in range(n)])
    assert torch.equal(mask, expected)
    # offset keeps blocks aligned to absolute positions: start at 2, the first block ends at 3.
    shifted = block_causal_mask(n, BLOCK, offset=2)
    expected = torch.tensor([[(j + 2) // BLOCK <= (i + 2) // BLOCK for j in range(n)] for i in range(n)])
    assert torch.equal(shifted, expected)


def test_block_causal_needs_block_size() -> None:
    q, k, v = qkv([4])
    with pytest.raises(ValueError, match="block size"):
        DenseAttention([4], mode="block_causal")(0, q, k, v)


# ---- whole model ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", ["untied", "tied_bias"])
def test_transformer_matches_naive(mode: str, variant: str) -> None:
    cfg = tiny_config() if variant == "untied" else tiny_config(tie_word_embeddings=True, attention_bias=True)
    model = random_model(cfg, seed=1)
    ids = torch.randint(0, cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(2))
    (logits,) = run(model, [ids], mode)
    assert logits.dtype == torch.float32 and logits.shape == (9, cfg.vocab_size)
    torch.testing.assert_close(logits.double(), naive_forward(model, ids, mode), atol=1e-4, rtol=1e-5)


def test_modes_differ_where_they_should() -> None:
    """With one layer, causal and block-causal agree on the last token of each full block and
    differ inside it; bidirectional and causal agree on the last token only. (With more layers the
    earlier tokens' states already differ, so nothing need agree.)"""
    model = random_model(tiny_config(num_layers=1), seed=4)
    ids = torch.randint(0, 61, (8,), generator=torch.Generator().manual_seed(5))
    causal, bidir, block = (run(model, [ids], m)[0] for m in MODES)
    torch.testing.assert_close(block[[3, 7]], causal[[3, 7]], atol=1e-5, rtol=0)
    assert (block[0] - causal[0]).abs().max() > 1e-3
    torch.testing.assert_close(bidir[-1], causal[-1], atol=1e-5, rtol=0)  # the last token sees all in both
    assert (bidir[0] - causal[0]).abs().max() > 1e-3


def test_aux_layers_return_residual_stream() -> None:
    model = random_model(tiny_config(num_layers=3), seed=6)
    ids = torch.arange(5)
    attn = DenseAttention([5])
    hidden, aux = model(ids, torch.arange(5), attn, aux_layers=(0, 2))
    assert len(aux) == 2 and all(a.shape == hidden.shape for a in aux)
    torch.testing.assert_close(model.norm(aux[1]), hidden)  # after the last layer, before the final norm


# ---- ragged batches -----------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lens", [[5, 1, 9, 3], [6, 6, 6]], ids=["ragged", "equal"])
def test_batch_equals_each_sequence_alone(mode: str, lens: list[int]) -> None:
    cfg = tiny_config(attention_bias=True)
    model = random_model(cfg, seed=7)
    gen = torch.Generator().manual_seed(8)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in lens]
    batched = run(model, seqs, mode)
    for seq, got in zip(seqs, batched):
        (alone,) = run(model, [seq], mode)
        torch.testing.assert_close(got, alone, atol=2e-5, rtol=1e-5)


# ---- RoPE against transformers ----------------------------------------------------------

LLAMA31 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=8192)
SCALINGS = {
    "default": ({"rope_type": "default"}, 128, 500000.0),
    "linear": ({"rope_type": "linear", "factor": 4.0}, 64, 10000.0),
    "llama3_8b": (LLAMA31, 128, 500000.0),  # Llama 3.1 8B's own values: every band is populated
    # A short original context pushes more frequencies into the interpolated band.
    "llama3_short": (dict(LLAMA31, factor=32.0, low_freq_factor=2.0, high_freq_factor=8.0,
                          original_max_position_embeddings=256), 64, 10000.0),
}


def hf_llama_config(rope: dict, head_dim: int, theta: float):
    from transformers import LlamaConfig

    heads = 4
    return LlamaConfig(vocab_size=64, hidden_size=heads * head_dim, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=131072,
                       rope_parameters={**rope, "rope_theta": theta})


@pytest.mark.parametrize("name", list(SCALINGS))
def test_rope_inv_freq_matches_transformers(name: str) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope, head_dim, theta = SCALINGS[name]
    hf = hf_llama_config(rope, head_dim, theta)
    ours = read_config(hf.to_dict())
    assert ours.rope_theta == theta and ours.head_dim == head_dim
    assert ours.rope_scaling.kind == rope["rope_type"]
    if rope["rope_type"] == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        ref, scale = LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
    else:
        ref, scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu")
    assert scale == 1.0  # no attention scaling for these rope types, so cos/sin are not rescaled
    torch.testing.assert_close(rope_inv_freq(ours), ref.float(), atol=0, rtol=1e-6)


def test_llama3_scaling_touches_every_band() -> None:
    """The Llama 3.1 table really exercises all three branches: kept, divided, and smoothed."""
    cfg = tiny_config(head_dim=128, rope_theta=500000.0, rope_scaling=RopeScaling(**{
        k: v for k, v in LLAMA31.items() if k != "rope_type"}, kind="llama3"))
    plain = rope_inv_freq(cfg.replace(rope_scaling=RopeScaling()))
    ratio = plain / rope_inv_freq(cfg)
    assert torch.isclose(ratio, torch.tensor(1.0)).any()
    assert torch.isclose(ratio, torch.tensor(8.0)).any()
    assert ((ratio > 1.01) & (ratio < 7.99)).any()


def test_legacy_rope_scaling_key_is_read() -> None:
    """Older config.json files keep the scaling under ``rope_scaling`` with ``rope_theta`` at top level."""
    legacy = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 4, "intermediate_size": 64, "rope_theta": 500000.0, "rope_scaling": LLAMA31}
    cfg = read_config(legacy)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScaling(kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)


@pytest.mark.parametrize("name", ["default", "llama3_short"])
def test_rotary_matches_transformers(name: str) -> None:
    """cos/sin at scattered positions and the rotation itself, against LlamaRotaryEmbedding."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    rope, head_dim, theta = SCALINGS[name]
    hf = hf_llama_config(rope, head_dim, theta)
    model = Transformer(read_config(hf.to_dict()))
    positions = torch.tensor([0, 1, 2, 17, 255, 256, 1000, 4095, 30000])
    cos, sin = model.rotary(positions, torch.float32)  # (tokens, 1, head_dim)
    x = torch.zeros(1, len(positions), head_dim)
    ref_cos, ref_sin = LlamaRotaryEmbedding(hf)(x, positions[None])  # (1, tokens, head_dim)
    # Both sides form the angle pos * inv_freq in float32, from inv_freq values that may differ in
    # the last bit, so the angles may differ by a few ulps of pos: the bound grows with position.
    tol = (1e-6 + 4 * torch.finfo(torch.float32).eps * positions.float())[:, None]  # (tokens, 1)
    assert ((cos[:, 0] - ref_cos[0]).abs() <= tol).all()
    assert ((sin[:, 0] - ref_sin[0]).abs() <= tol).all()

    gen = torch.Generator().manual_seed(9)
    q = torch.randn(len(positions), 4, head_dim, generator=gen)
    k = torch.randn(len(positions), 2, head_dim, generator=gen)
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], ref_cos, ref_sin)
    for ours, ref in ((apply_rope(q, cos, sin), ref_q), (apply_rope(k, cos, sin), ref_k)):
        assert ((ours - ref[0].transpose(0, 1)).abs() <= 8 * tol[:, :, None]).all()
