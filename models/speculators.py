"""EAGLE-3 heads in the layout of vLLM's ``speculators`` library (``*-speculator.eagle3`` checkpoints).

A speculators head directory holds ``config.json`` and ``model.safetensors``. Its
config nests the draft layer's Hugging Face config under ``transformer_layer_config``
and keeps the EAGLE-3 fields at the top level (vllm-project/speculators
``src/speculators/models/eagle3/config.py``)::

    {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
     "transformer_layer_config": {"model_type": "llama", "hidden_size": ..., ...},
     "draft_vocab_size": 32000, "target_hidden_size": null, "norm_before_residual": false,
     "eagle_aux_hidden_state_layer_ids": null,
     "speculators_config": {"algorithm": "eagle3", "proposal_methods": [...],
                            "default_proposal_method": "greedy", "verifier": {...}},
     "speculators_version": "..."}

Its tensors are the EAGLE-3 head's with the midlayer named ``layers.0`` (as vLLM
names it): ``fc``, ``layers.0.{hidden_norm, input_layernorm, self_attn.*, mlp.*}``,
``norm``, ``lm_head``, ``d2t``, ``t2d`` and optionally the verifier's
``embed_tokens``; ``models/eagle.py`` already maps those. Layer ids follow vLLM's
"entering layer j" convention, and absent ids mean (2, N//2, N-3)
(speculators ``models/utils.py: resolve_target_layer_ids``), as upstream EAGLE.

This module only turns that config into the flat one ``EagleConfig.from_hf`` reads,
and refuses the variants our head does not implement.
"""

from __future__ import annotations

from typing import Any

from .families import PLAIN

# Options of the speculators EAGLE-3 model that change the computation; ours implements none
# of them (norm_before_residual is supported separately).
UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")


def is_speculators(cfg: dict[str, Any]) -> bool:
    return "speculators_config" in cfg or "speculators_model_type" in cfg


def flatten_speculators_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A speculators EAGLE-3 config.json -> the flat layout of published EAGLE-3 heads."""
    kind = cfg.get("speculators_model_type") or (cfg.get("speculators_config") or {}).get("algorithm")
    if kind != "eagle3":
        raise ValueError(f"speculators checkpoint of type {kind!r}: only eagle3 heads load")
    on = [f for f in UNSUPPORTED_FLAGS if cfg.get(f)]
    if on:
        raise ValueError(f"speculators EAGLE-3 options {on} are not supported")
    layer = dict(cfg["transformer_layer_config"])
    if layer.get("model_type", PLAIN.name) not in PLAIN.hf_model_types:
        raise ValueError(f"speculators draft layer of type {layer['model_type']!r}: only {PLAIN.name} layers load")
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise ValueError("speculators EAGLE-3 heads with more than one draft layer are not supported")
    if layer.get("mlp_bias"):
        raise ValueError("speculators draft layers with MLP biases are not supported")
    rope = layer.get("rope_parameters") or {}  # transformers >= 5 nests rope_theta here
    flat = {**layer, "qkv_bias": bool(layer.get("attention_bias", False)),
            "rope_theta": layer.get("rope_theta") or rope.get("rope_theta") or 10000.0,
            "draft_vocab_size": cfg.get("draft_vocab_size") or layer.get("vocab_size"),
            "target_hidden_size": cfg.get("target_hidden_size"),
            "norm_before_residual": bool(cfg.get("norm_before_residual", False))}
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids:
        flat["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(ids)}
    return flat
