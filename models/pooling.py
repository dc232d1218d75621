"""What a checkpoint says about pooling, and the small pure functions embeddings and rerank use.

A served model has one ``PoolingProfile``, read once from its files:

* ``purpose``: ``embedding`` for a checkpoint that declares itself an embedding model (a
  sentence-transformers ``modules.json`` with a ``Pooling`` module, as Qwen3-Embedding ships, or a
  GGUF ``<arch>.pooling_type`` of mean, cls or last); ``rerank`` for a yes/no reranker
  (Qwen3-Reranker, recognised as llama.cpp's ``convert_hf_to_gguf.py`` recognises it: its README's
  title, its name, a ``*ForSequenceClassification`` class, or a GGUF pooling type of rank);
  ``generation`` for everything else (a chat or completion model).
* ``pooling``: how token states become one vector, as llama.cpp's ``--pooling``: ``last`` for
  decoder-only embedding models, whose last token has seen the whole text; ``mean`` (the default
  for a model that declares nothing) or ``cls`` otherwise.
* ``dimensions``: the output sizes the model was trained to be cut to (Matryoshka: the first d
  values, renormalised), ``None`` where any size up to its width is allowed (a declared embedding
  model, as sentence-transformers' ``truncate_dim`` allows) and ``()`` where only the full width is
  (a generation model: its hidden state was never trained to be cut).

Vectors are L2-normalised, as llama.cpp (``--embd-normalize 2``) and Qwen3-Embedding do.

The rerank prompts follow Qwen3-Reranker's model card: a system turn that asks for "yes" or "no",
an ``<Instruct>/<Query>/<Document>`` user turn, and the score P(yes) = softmax over the "yes" and
"no" logits at the last position. A declared reranker gets the card's exact token layout; another
chat model gets the same turns through its own chat template.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

Pooling = Literal["mean", "cls", "last"]
POOLINGS: tuple[Pooling, ...] = ("mean", "cls", "last")
Purpose = Literal["generation", "embedding", "rerank"]

# llama.cpp's enum llama_pooling_type (include/llama.h), as GGUF's <arch>.pooling_type stores it.
GGUF_POOLING: dict[int, Pooling | Literal["rank"]] = {1: "mean", 2: "cls", 3: "last", 4: "rank"}
# sentence-transformers' Pooling config keys (sentence_transformers/models/Pooling.py), in our names.
ST_POOLING: dict[str, Pooling] = {"pooling_mode_lasttoken": "last", "pooling_mode_cls_token": "cls",
                                  "pooling_mode_mean_tokens": "mean"}

# Qwen3-Reranker's model card (https://huggingface.co/Qwen/Qwen3-Reranker-0.6B).
JUDGE_SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
                'Note that the answer can only be "yes" or "no".')
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
RERANKER_PREFIX = f"<|im_start|>system\n{JUDGE_SYSTEM}<|im_end|>\n<|im_start|>user\n"
RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
LABELS = ("yes", "no")


@dataclass(frozen=True)
class PoolingProfile:
    """What one served model offers embeddings and rerank (the module docstring)."""

    purpose: Purpose = "generation"
    pooling: Pooling = "mean"
    dimensions: tuple[int, ...] | None = ()


# ---- reading a checkpoint ------------------------------------------------------------------


def read_profile(path: Path, override: Pooling | None = None) -> PoolingProfile:
    """The profile of the checkpoint at ``path`` (a Hugging Face directory or a GGUF file);
    ``override`` (``--pooling``) replaces the declared pooling."""
    path = Path(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        profile = _gguf_profile(path)
    elif path.is_dir():
        profile = _hf_profile(path)
    else:
        profile = PoolingProfile()
    if override is not None:
        profile = PoolingProfile(profile.purpose, override, profile.dimensions)
    return profile


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _hf_profile(directory: Path) -> PoolingProfile:
    config = _read_json(directory / "config.json") or {}
    if _is_reranker(directory, config):
        return PoolingProfile("rerank", "last", ())
    pooling = _st_pooling(directory)
    if pooling is None:
        return PoolingProfile()
    # vLLM's keys for the sizes a Matryoshka model was trained at (vllm/config/model.py).
    sizes = config.get("matryoshka_dimensions")
    return PoolingProfile("embedding", pooling, tuple(int(d) for d in sizes) if isinstance(sizes, list) else None)


def _st_pooling(directory: Path) -> Pooling | None:
    """The pooling a sentence-transformers ``modules.json`` declares, or None when there is none."""
    modules = _read_json(directory / "modules.json")
    if not isinstance(modules, list):
        return None
    for module in modules:
        if isinstance(module, dict) and str(module.get("type", "")).endswith(".Pooling"):
            config = _read_json(directory / str(module.get("path", "")) / "config.json") or {}
            return next((name for key, name in ST_POOLING.items() if config.get(key)), "mean")
    return None


def _is_reranker(directory: Path, config: dict) -> bool:
    """Qwen3-Reranker ships as a plain Qwen3ForCausalLM; llama.cpp's convert_hf_to_gguf.py
    (Qwen3Model._is_qwen3_reranker) knows it by its README's title, its name or a classifier class."""
    readme = directory / "README.md"
    text = readme.read_text(errors="replace").lower() if readme.is_file() else ""
    if "# qwen3-reranker" in text:
        return True
    names = (directory.name, str(config.get("_name_or_path", "")))
    if any("qwen3-reranker" in n.lower() for n in names):
        return True
    return any("sequenceclassification" in str(a).lower() for a in config.get("architectures") or ())


def _gguf_profile(path: Path) -> PoolingProfile:
    import gguf

    from .tokenizer import _gguf_value as gguf_value  # the one reader of GGUF metadata values

    reader = gguf.GGUFReader(path)
    arch = gguf_value(reader, "general.architecture")
    kind = GGUF_POOLING.get(gguf_value(reader, f"{arch}.pooling_type") or 0)
    if kind == "rank":
        return PoolingProfile("rerank", "last", ())
    if kind is None:
        return PoolingProfile()
    return PoolingProfile("embedding", kind, None)


# ---- token ids --------------------------------------------------------------------------------


def text_ids(tokenizer, text: str) -> list[int]:
    """The ids of one text to embed, as transformers' ``tokenizer(text)`` gives them: through the
    checkpoint's own post-processor where it has one (Qwen3-Embedding's appends ``<|endoftext|>``,
    which is not its eos, and its last-token pooling reads that position), else with the
    tokenizer's bos/eos rules (a GGUF vocabulary)."""
    backend = tokenizer.backend
    if backend.post_processor is None:
        return tokenizer.encode(text, add_special_tokens=True)
    return backend.encode_batch([text], add_special_tokens=True)[0].ids


def label_ids(tokenizer) -> tuple[int, int] | None:
    """The ("yes", "no") token ids, or None where either is not one token of the vocabulary."""
    ids = [tokenizer.encode(label) for label in LABELS]
    return (ids[0][0], ids[1][0]) if all(len(i) == 1 for i in ids) else None


def rerank_user_turn(query: str, document: str, instruction: str | None = None) -> str:
    return f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"


def reranker_ids(tokenizer, query: str, document: str, instruction: str | None = None) -> list[int]:
    """A declared reranker's prompt, laid out as its model card does: the prefix, the user turn
    and the suffix tokenized apart and joined."""
    parts = (RERANKER_PREFIX, rerank_user_turn(query, document, instruction), RERANKER_SUFFIX)
    return [t for part in parts for t in tokenizer.encode(part, add_special_tokens=False)]


def judge_ids(tokenizer, query: str, document: str, instruction: str | None = None) -> list[int]:
    """The same question put to a chat model through its own chat template."""
    messages = [{"role": "system", "content": JUDGE_SYSTEM},
                {"role": "user", "content": rerank_user_turn(query, document, instruction)}]
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


# ---- vectors ----------------------------------------------------------------------------------


def l2_normalize(v: torch.Tensor) -> torch.Tensor:
    """v / ||v|| over the last dimension (llama.cpp's common_embd_normalize with norm 2)."""
    return torch.nn.functional.normalize(v.float(), p=2.0, dim=-1)


def truncate(v: torch.Tensor, dimensions: int) -> torch.Tensor:
    """A Matryoshka vector cut to its first ``dimensions`` values and renormalised."""
    return l2_normalize(v[..., :dimensions])


def yes_probability(label_logits: torch.Tensor) -> torch.Tensor:
    """P(yes) from the (..., 2) logits of ("yes", "no"): a softmax over the two."""
    return torch.softmax(label_logits.float(), dim=-1)[..., 0]
