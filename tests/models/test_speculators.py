"""EAGLE-3 heads in vLLM speculators' layout (``*-speculator.eagle3``) load and compute as upstream heads do.

The tiny checkpoint is written in exactly the layout speculators saves
(vllm-project/speculators ``models/eagle3/config.py``, ``models/eagle3/core.py``,
``model.py``): a nested ``transformer_layer_config``, EAGLE-3 fields at the top level,
a ``speculators_config`` block, and tensors ``fc``, ``layers.0.*``, ``norm``, ``lm_head``,
``d2t``, ``t2d`` plus the verifier's ``embed_tokens`` copy.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dualserve.models.attention import DenseAttention
from dualserve.models.eagle import Eagle3Head, load_eagle_head
from dualserve.models.transformer import Transformer
from test_eagle_head import GEOMETRY, attention, mlp, ref_eagle3, rms, target  # noqa: F401 - fixture
from tiny_eagle import write_tiny_eagle3

DRAFT_VOCAB = 48


def speculators_config(hidden: int, layer_ids: list[int] | None = None, **top) -> dict:
    layer = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": GEOMETRY["vocab_size"],
             "hidden_size": hidden, "intermediate_size": GEOMETRY["intermediate_size"], "num_hidden_layers": 1,
             "num_attention_heads": GEOMETRY["num_heads"], "num_key_value_heads": GEOMETRY["num_kv_heads"],
             "head_dim": hidden // GEOMETRY["num_heads"], "hidden_act": "silu", "rms_norm_eps": 1e-5,
             "max_position_embeddings": 2048, "attention_bias": False, "mlp_bias": False,
             "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "dtype": "float32"}
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "speculators_version": "0.3.0", "transformer_layer_config": layer, "draft_vocab_size": DRAFT_VOCAB,
            "norm_before_residual": False, "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": layer_ids,
            "norm_before_fc": False, "fc_norm": False, "norm_output": False, "embed_requires_grad": False,
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5,
                                                         "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                                   "verifier": {"name_or_path": "tiny-target",
                                                "architectures": ["LlamaForCausalLM"]}},
            **top}


def write_speculators(path: Path, target: Transformer, **top) -> dict[str, torch.Tensor]:
    """An upstream-layout tiny head re-saved the way speculators saves it; returns the upstream tensors."""
    upstream = write_tiny_eagle3(path / "upstream", **GEOMETRY, draft_vocab_size=DRAFT_VOCAB, dtype=torch.float32)
    state = {k.replace("midlayer.", "layers.0."): v for k, v in upstream.items()}
    state["embed_tokens.weight"] = target.embed_tokens.weight.detach().clone()  # speculators keeps a copy
    out = path / "tiny-speculator.eagle3"
    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(speculators_config(GEOMETRY["hidden_size"], **top), indent=2))
    return upstream


def run_head(head: Eagle3Head, target: Transformer):
    ids, pos = torch.tensor([1, 2, 3, 4, 5]), torch.arange(5)
    final, aux = target(ids, pos, DenseAttention([5]), aux_layers=head.config.aux_layers)
    h = head(ids, head.features(final, aux), pos, DenseAttention([5]))
    return ids, pos, aux, h


def test_speculators_layout_loads_as_the_upstream_head(tmp_path: Path, target: Transformer) -> None:
    upstream = write_speculators(tmp_path, target)
    head = load_eagle_head(tmp_path / "tiny-speculator.eagle3", target)
    ref = load_eagle_head(tmp_path / "upstream", target)
    assert isinstance(head, Eagle3Head)
    geometry = lambda c: (c.kind, c.target_hidden_size, c.aux_layers, c.layer.hidden_size, c.layer.num_heads,
                          c.layer.num_kv_heads, c.layer.head_dim, c.layer.intermediate_size, c.layer.rope_theta)
    assert geometry(head.config) == geometry(ref.config)
    assert head.config.draft_vocab_size == DRAFT_VOCAB and head.config.aux_layers == (1, 3, 4)
    ids, pos, aux, h = run_head(head, target)
    _, _, _, h_ref = run_head(ref, target)
    assert torch.equal(h, h_ref) and torch.equal(head.logits(h), ref.logits(h_ref))
    w = {k: v for k, v in upstream.items() if v.is_floating_point()}
    want_h, want_logits = ref_eagle3(w, target.embed_tokens.weight, aux, ids, pos)
    torch.testing.assert_close(h, want_h, rtol=1e-4, atol=1e-4)
    assert torch.equal(head.to_target(torch.arange(DRAFT_VOCAB)), torch.arange(DRAFT_VOCAB) + upstream["d2t"])
    assert head.embed_weight.data_ptr() == target.embed_tokens.weight.data_ptr()  # borrowed, not the copy


def test_speculators_layer_ids_and_norm_before_residual(tmp_path: Path, target: Transformer) -> None:
    upstream = write_speculators(tmp_path, target, eagle_aux_hidden_state_layer_ids=[2, 5, 7],
                                 norm_before_residual=True)
    head = load_eagle_head(tmp_path / "tiny-speculator.eagle3", target)
    assert head.config.aux_layers == (1, 4, 6) and head.config.norm_before_residual  # "entering layer j"
    ids, pos, aux, h = run_head(head, target)
    w = {k.replace("midlayer.", "m."): v for k, v in upstream.items() if v.is_floating_point()}
    x = torch.cat(aux, -1) @ w["fc.weight"].T
    hn = rms(x, w["m.hidden_norm.weight"])
    a = torch.cat([rms(target.embed_tokens.weight[ids], w["m.input_layernorm.weight"]), hn], -1)
    y = hn + attention(a, w, "m", pos)  # speculators: the residual is the normed hidden
    y = y + mlp(rms(y, w["m.post_attention_layernorm.weight"]), w, "m")
    torch.testing.assert_close(h, y, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("change", [{"norm_before_fc": True}, {"fc_norm": True}, {"norm_output": True},
                                    {"speculators_model_type": "eagle"}])
def test_unsupported_speculators_variants_are_refused(tmp_path: Path, target: Transformer, change: dict) -> None:
    write_speculators(tmp_path, target, **change)
    with pytest.raises(ValueError):
        load_eagle_head(tmp_path / "tiny-speculator.eagle3", target)
