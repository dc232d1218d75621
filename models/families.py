"""The model families this build loads, as data: one row a family, the one plug-in point.

A row says everything the rest of the code asks about a family:

  * how a checkpoint is recognised: ``config.json``'s ``model_type`` or class (``architectures``),
    GGUF's ``general.architecture``;
  * how its config is read (``read_config``, ``read_gguf``, with the row's ``Layout`` for what the
    checkpoint leaves to convention), and what a converted GGUF's ``config.json`` says;
  * how its tensors are named (GGUF names beyond the loader's common table, whether llama.cpp
    permuted q/k rows, a checkpoint's own names) and which network class they build (``network``;
    ``load``: a network with its own loader);
  * how tensor parallelism splits it (``sharder``, ``sharded_modules``, ``cannot_split``);
  * which decoders serve it and whether its steps compile;
  * the chat template to use when a checkpoint carries none (llama.cpp falls back on its built-in
    templates the same way);
  * its own files: the only files besides this one that may name the family or test its classes
    (``tests/models/test_family_plugin.py`` greps for the rest).

The engine, the loader and tensor parallelism ask ``family(config.family)``; none of them names a
family or tests a network's class. Adding a family is a row here and, where its layers or keys
differ from the core's, a file of its own (docs/architecture.md, "Adding a family").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

from torch import nn

from . import gemma3, llada
from .checkpoint import LoadedModel
from .config import BLOCK_DIFFUSION_KEYS, Layout, ModelConfig, read_gguf, read_hf
from .diffusion_gemma import DiffusionGemma, DiffusionGemmaConfig, load_diffusion_gemma
from .errors import UnsupportedModel
from .network import Network, NetworkConfig
from .sharding_core import CoreSharder, cannot_split, sharded_modules
from .sharding_gemma import GemmaSharder, cannot_split as gemma_cannot_split, sharded_modules as gemma_modules
from .transformer import Transformer

# The decoders a family's network is served by (``decoders/deployment.py`` builds them):
#   "ar"                token by token, with the parts an AR model may bring (an EAGLE head or
#                       suffix drafts, a diffusion twin, embeddings and rerank);
#   "masked_diffusion"  a [MASK] canvas unmasked unit by unit (``decoders/diffusion/decoder.py``);
#   "uniform_diffusion" a canvas of random tokens refined by an encoder-denoiser network
#                       (``decoders/diffusion/gemma.py``).
DecoderKind = Literal["ar", "masked_diffusion", "uniform_diffusion"]
ConfigReader = Callable[[dict[str, Any], str, Layout], NetworkConfig]


def read_diffusion_gemma(raw: dict[str, Any], family: str, layout: Layout) -> DiffusionGemmaConfig:
    return DiffusionGemmaConfig.from_hf(raw)


@dataclass(frozen=True)
class Family:
    name: str
    # Recognition.
    hf_model_types: tuple[str, ...] = ()
    hf_classes: tuple[str, ...] = ()                   # config.json classes read by name, not model_type
    gguf_architecture: str | None = None
    # Config.
    layout: Layout = Layout()
    read_config: ConfigReader = read_hf
    read_gguf: Callable[[dict[str, Any], str, Layout], ModelConfig] = read_gguf
    hf_architecture: str = "LlamaForCausalLM"          # what a converted GGUF's config.json says
    hf_model_type: str | None = None                   # likewise (default: the family's name)
    hf_keys: Callable[[ModelConfig], dict[str, Any]] = lambda config: {}  # and what else it adds
    # Tensors and the network.
    gguf_names: tuple[tuple[str, str], ...] = ()       # (pattern, canonical HF name), before the common table
    gguf_qk_permuted: bool = False                     # llama.cpp's convert permutes q/k rows (llama)
    source_names: tuple[tuple[str, str], ...] | None = None  # a checkpoint's own names -> canonical HF names
    network: type[nn.Module] = Transformer
    load: Callable[..., LoadedModel] | None = None     # a network with its own loader (None: the core's)
    # Tensor parallelism.
    sharder: type = CoreSharder
    sharded_modules: Callable[[Network], list[nn.Module]] = sharded_modules
    cannot_split: Callable[[Any, int], str | None] = cannot_split
    # Serving.
    decoders: tuple[DecoderKind, ...] = ("ar",)
    compiles: bool = True                              # steps run through compiled graphs (core only)
    chat_template: str | None = None                   # when the checkpoint carries none
    own_files: tuple[str, ...] = ()                    # besides this one, the files that may name it

    @property
    def diffusion(self) -> bool:
        return "ar" not in self.decoders

    @property
    def core(self) -> bool:
        """Whether the transformer core runs it (the weight formats and compiled steps apply)."""
        return self.network is Transformer


DIFFUSION = ("masked_diffusion",)

FAMILIES: tuple[Family, ...] = (
    Family("llama", ("llama",), gguf_architecture="llama", gguf_qk_permuted=True),
    Family("mistral", ("mistral",), gguf_architecture="mistral", gguf_qk_permuted=True,
           layout=Layout(window_everywhere=True)),
    Family("qwen2", ("qwen2",), gguf_architecture="qwen2", hf_architecture="Qwen2ForCausalLM",
           layout=Layout(attention_bias=True)),
    Family("phi3", ("phi3",), gguf_architecture="phi3", hf_architecture="Phi3ForCausalLM",
           layout=Layout(window_everywhere=True, gguf_window=True),
           gguf_names=(  # Phi-3 stores q/k/v and gate/up fused, in the order the core fuses them
               (r"^blk\.(\d+)\.attn_qkv\.weight$", r"model.layers.\1.self_attn.qkv_proj.weight"),
               (r"^blk\.(\d+)\.ffn_up\.weight$", r"model.layers.\1.mlp.gate_up_proj.weight"),
           )),
    Family("qwen3", ("qwen3",), gguf_architecture="qwen3", hf_architecture="Qwen3ForCausalLM",
           layout=Layout(qk_norm=True)),
    Family("gemma3", ("gemma3_text",), gguf_architecture="gemma3", hf_architecture="Gemma3ForCausalLM",
           hf_model_type="gemma3_text", read_config=gemma3.read_hf, read_gguf=gemma3.read_gguf,
           hf_keys=gemma3.hf_keys,
           gguf_names=(
               # Gemma's ffn_norm leads the feed-forward; two more norms follow attention and the MLP.
               (r"^blk\.(\d+)\.post_attention_norm\.weight$", r"model.layers.\1.post_attention_layernorm.weight"),
               (r"^blk\.(\d+)\.ffn_norm\.weight$", r"model.layers.\1.pre_feedforward_layernorm.weight"),
               (r"^blk\.(\d+)\.post_ffw_norm\.weight$", r"model.layers.\1.post_feedforward_layernorm.weight"),
           ),
           chat_template=gemma3.CHAT_TEMPLATE, own_files=("models/gemma3.py",)),
    Family("llada", ("llada",), read_config=llada.read_hf, layout=Layout(mask_token_id=llada.MASK_TOKEN_ID),
           source_names=tuple(llada.NAMES), decoders=DIFFUSION, own_files=("models/llada.py",)),
    Family("dream", ("dream",), layout=Layout(attention_bias=True, shift_logits=True), decoders=DIFFUSION),
    # Fast-dLLM v2 (Qwen2 layout, block size in bd_size) hard-codes its [MASK] id ("|<MASK>|") in
    # generate; its config.json has none. Twins (``adapter.py``) are of this family too.
    Family("block_diffusion", ("fast_dllm_qwen",),
           layout=Layout(attention_bias=True, shift_logits=True, mask_token_id=151665), decoders=DIFFUSION,
           own_files=("models/adapter.py",)),
    # SDAR (JetLM/SDAR-*-Chat): Qwen3's layer, q/k norms included, block-causal over block_size, each
    # masked position sampled from its own logits (JetAstra/SDAR generate.py, block_diffusion_generate).
    Family("sdar", ("sdar",), layout=Layout(qk_norm=True), decoders=DIFFUSION),
    Family("diffusion_gemma", hf_classes=("DiffusionGemmaForBlockDiffusion",), read_config=read_diffusion_gemma,
           network=DiffusionGemma, load=load_diffusion_gemma, sharder=GemmaSharder, sharded_modules=gemma_modules,
           cannot_split=gemma_cannot_split, decoders=("uniform_diffusion",), compiles=False,
           own_files=("models/diffusion_gemma.py", "models/sharding_gemma.py", "decoders/diffusion/gemma.py")),
)

BY_NAME = {f.name: f for f in FAMILIES}
GGUF_ARCHITECTURES = tuple(f.gguf_architecture for f in FAMILIES if f.gguf_architecture)
HF_MODEL_TYPES = tuple(t for f in FAMILIES for t in f.hf_model_types)
HF_CLASSES = {c: f for f in FAMILIES for c in f.hf_classes}
# An AR family's config.json that declares block diffusion (BLOCK_DIFFUSION_KEYS) is read as this
# family over the AR family's layout: a twin saved whole, or a block-diffusion conversion.
BLOCK_DIFFUSION = BY_NAME["block_diffusion"]
# The plain core layer: what a config.json without a model_type is, and what draft models' layers
# are (EAGLE heads and speculators' EAGLE-3 heads name it in their config.json).
PLAIN = BY_NAME["llama"]
# The layer a DFlash drafter's config.json names, as the published drafters do (q/k norms of its own).
DFLASH_LAYER = BY_NAME["qwen3"]
# Model types this build refuses with a reason of their own.
REFUSED = {"gemma3": "Gemma 3 checkpoints with a vision tower (model_type 'gemma3') are not supported; "
                     "text-only ones (model_type 'gemma3_text': 270M, 1B) are"}


def family(name: str) -> Family:
    return BY_NAME[name]


def supported() -> str:
    return ", ".join([*HF_MODEL_TYPES, *HF_CLASSES])


def of_gguf(architecture: str) -> Family:
    for f in FAMILIES:
        if f.gguf_architecture == architecture:
            return f
    raise UnsupportedModel(f"unsupported GGUF architecture {architecture!r}; supported: "
                           f"{', '.join(GGUF_ARCHITECTURES)}")


def of_hf(raw: dict[str, Any]) -> Family:
    """The family of a ``config.json``: by its class for the few read by name, else by model_type."""
    for arch in raw.get("architectures") or ():
        if arch in HF_CLASSES:
            return HF_CLASSES[arch]
    model_type = str(raw.get("model_type", PLAIN.name)).lower()
    if model_type in REFUSED:
        raise UnsupportedModel(REFUSED[model_type])
    for f in FAMILIES:
        if model_type in f.hf_model_types:
            return f
    raise UnsupportedModel(f"unsupported model type {model_type!r} in config.json; supported: {supported()}")


def read_config(raw: dict[str, Any]) -> NetworkConfig:
    """A ``config.json``'s config, read by its family's reader."""
    row = of_hf(raw)
    if row.read_config is read_hf and not row.diffusion and any(raw.get(k) for k in BLOCK_DIFFUSION_KEYS):
        return read_hf(raw, BLOCK_DIFFUSION.name, row.layout)
    return row.read_config(raw, row.name, row.layout)


def read_gguf_config(meta: dict[str, Any]) -> ModelConfig:
    """GGUF metadata's config, read by its family's reader."""
    row = of_gguf(meta["general.architecture"])
    return row.read_gguf(meta, row.name, row.layout)


def read_layer(raw: dict[str, Any]) -> ModelConfig:
    """A draft model's layer config (an EAGLE head's, a DFlash drafter's): the plain core layer."""
    return read_hf(raw, PLAIN.name, PLAIN.layout)
