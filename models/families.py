"""The model families this build loads, as data: one row a family.

A row says how a checkpoint of the family is recognised (``config.json``'s ``model_type`` and
``architectures``, GGUF's ``general.architecture``), how its tensors are named in GGUF beyond the
common table (``loader.GGUF_NAMES``), whether llama.cpp permuted its q/k rows, which network and
loader build it (the transformer core, or DiffusionGemma's own), what a converted GGUF's
``config.json`` names it, and the chat template to use when a checkpoint carries none (llama.cpp
falls back on its built-in templates the same way). Everything that changes the math of a layer is
a ``ModelConfig`` field, read by ``config.py``; nothing else about a family lives outside this
table and the model files. Adding a family is a row here, its config reader, and (when its layers
differ) a model file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


class UnsupportedModel(ValueError):
    """A checkpoint of a family or format this build does not load; the message names it and what is
    supported (the CLI prints it as one line)."""


# Gemma's turn format (Gemma 3's published template, text parts only); a GGUF may ship without it.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] -%}{%- if item['type'] == 'text' -%}{{ item['text'] | trim }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


@dataclass(frozen=True)
class Family:
    name: str
    hf_model_types: tuple[str, ...] = ()
    gguf_architecture: str | None = None
    hf_architecture: str = "LlamaForCausalLM"          # what a converted GGUF's config.json says
    hf_model_type: str | None = None                   # likewise (default: the family's name)
    # GGUF tensor names read before the common table: (pattern, canonical HF name) rows.
    gguf_names: tuple[tuple[str, str], ...] = ()
    gguf_qk_permuted: bool = False                     # llama.cpp's convert permutes q/k rows (llama)
    network: Literal["core", "diffusion_gemma"] = "core"
    chat_template: str | None = None                   # when the checkpoint carries none
    diffusion: bool = False


FAMILIES: tuple[Family, ...] = (
    Family("llama", ("llama",), "llama", gguf_qk_permuted=True),
    Family("mistral", ("mistral",), "mistral", gguf_qk_permuted=True),
    Family("qwen2", ("qwen2",), "qwen2", "Qwen2ForCausalLM"),
    Family("phi3", ("phi3",), "phi3", "Phi3ForCausalLM",
           gguf_names=(  # Phi-3 stores q/k/v and gate/up fused, in the order the core fuses them
               (r"^blk\.(\d+)\.attn_qkv\.weight$", r"model.layers.\1.self_attn.qkv_proj.weight"),
               (r"^blk\.(\d+)\.ffn_up\.weight$", r"model.layers.\1.mlp.gate_up_proj.weight"),
           )),
    Family("qwen3", ("qwen3",), "qwen3", "Qwen3ForCausalLM"),
    Family("gemma3", ("gemma3_text",), "gemma3", "Gemma3ForCausalLM", "gemma3_text",
           gguf_names=(
               # Gemma's ffn_norm leads the feed-forward; two more norms follow attention and the MLP.
               (r"^blk\.(\d+)\.post_attention_norm\.weight$", r"model.layers.\1.post_attention_layernorm.weight"),
               (r"^blk\.(\d+)\.ffn_norm\.weight$", r"model.layers.\1.pre_feedforward_layernorm.weight"),
               (r"^blk\.(\d+)\.post_ffw_norm\.weight$", r"model.layers.\1.post_feedforward_layernorm.weight"),
           ),
           chat_template=GEMMA_TEMPLATE),
    Family("llada", ("llada",), diffusion=True),
    Family("dream", ("dream",), diffusion=True),
    Family("block_diffusion", ("fast_dllm_qwen",), diffusion=True),
    Family("diffusion_gemma", network="diffusion_gemma", diffusion=True),
)

BY_NAME = {f.name: f for f in FAMILIES}
GGUF_ARCHITECTURES = tuple(f.gguf_architecture for f in FAMILIES if f.gguf_architecture)
HF_MODEL_TYPES = tuple(t for f in FAMILIES for t in f.hf_model_types)
# Checkpoints named by their class rather than a model_type the core reads.
HF_ARCHITECTURES = {"DiffusionGemmaForBlockDiffusion": "diffusion_gemma"}


def family(name: str) -> Family:
    return BY_NAME[name]


def of_gguf(architecture: str) -> Family:
    for f in FAMILIES:
        if f.gguf_architecture == architecture:
            return f
    raise UnsupportedModel(f"unsupported GGUF architecture {architecture!r}; supported: "
                           f"{', '.join(GGUF_ARCHITECTURES)}")


def of_hf(raw: dict[str, Any]) -> Family:
    """The family of a ``config.json``: by its class for the few read by name, else by model_type."""
    for arch in raw.get("architectures") or ():
        if arch in HF_ARCHITECTURES:
            return BY_NAME[HF_ARCHITECTURES[arch]]
    model_type = str(raw.get("model_type", "llama")).lower()
    for f in FAMILIES:
        if model_type in f.hf_model_types:
            return f
    raise UnsupportedModel(f"unsupported model type {model_type!r} in config.json; supported: "
                           f"{', '.join(HF_MODEL_TYPES)}, and DiffusionGemma")
