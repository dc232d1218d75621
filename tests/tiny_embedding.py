"""Tiny random Qwen3 checkpoints for embeddings and rerank, and a ``dualserve serve`` on one.

The weights are written by transformers (``Qwen3ForCausalLM.from_config`` + ``save_pretrained``),
with a word-level tokenizer over a small vocabulary whose specials are Qwen's (``<|endoftext|>``,
``<|im_start|>``, ``<|im_end|>``, ``<think>``, ``</think>``) and a ChatML template. Three kinds:

* ``write_tiny_qwen3``: a plain chat model (no pooling declared: mean pooling, rerank through its
  chat template);
* ``write_tiny_qwen3_embedding``: Qwen3-Embedding's layout: the sentence-transformers files it ships
  (``modules.json``, ``1_Pooling/config.json`` with last-token pooling, ``2_Normalize``) and a
  tokenizer whose post-processor appends ``<|endoftext|>``, which is not its eos;
* ``write_tiny_qwen3_reranker``: Qwen3-Reranker's, known by its README's title (as llama.cpp's
  converter knows it).

``reference_hidden`` and ``reference_logits`` are the transformers computations the server is
checked against.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterator

import torch

from server_fixture import serving

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<unk>"]
WORDS = ["system", "user", "assistant", "yes", "no", "the", "a", "is", "what", "of", "and", "to", "in", "capital",
         "city", "river", "paris", "france", "cat", "dog", "sat", "on", "mat", "red", "planet", "mars", "<Query>:",
         "<Document>:", "<Instruct>:", "Judge", "whether", "Document", "Query", "search", "web"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VOCAB = 96
HIDDEN = 32


def write_tokenizer(directory: Path, append_endoftext: bool = False) -> None:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    vocab.update({f"w{i}": i for i in range(len(vocab), VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    if append_endoftext:  # Qwen3-Embedding's tokenizer.json: "$A <|endoftext|>"
        tok.post_processor = processors.TemplateProcessing(single="$A <|endoftext|>", pair="$A <|endoftext|> $B:1",
                                                           special_tokens=[("<|endoftext|>", 0)])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": "<unk>", "chat_template": CHATML}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2]}))


def write_tiny_qwen3(directory: Path, seed: int = 0, append_endoftext: bool = False) -> Path:
    """A 2-layer Qwen3 (GQA, per-head q/k norms, untied head) in transformers' layout, plus its tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=2)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # larger than the 0.02 init, so hidden states and logits are not flat
        for name, p in model.named_parameters():
            scale = p.shape[-1] ** 0.5 if p.dim() > 1 else 1.0
            noise = torch.randn(p.shape, generator=gen) / scale
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else noise)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    write_tokenizer(directory, append_endoftext)
    return directory


def write_tiny_qwen3_embedding(directory: Path, seed: int = 1) -> Path:
    write_tiny_qwen3(directory, seed, append_endoftext=True)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": HIDDEN, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": True, "include_prompt": True}))
    (directory / "2_Normalize").mkdir(exist_ok=True)
    (directory / "config_sentence_transformers.json").write_text(json.dumps({
        "prompts": {"query": "Instruct: Given a web search query, retrieve relevant passages that answer the query\n"
                             "Query:", "document": ""}, "default_prompt_name": None, "similarity_fn_name": "cosine"}))
    return directory


def write_tiny_qwen3_reranker(directory: Path, seed: int = 2) -> Path:
    write_tiny_qwen3(directory, seed)
    (directory / "README.md").write_text("# Qwen3-Reranker-tiny\n\nRandom weights in Qwen3-Reranker's layout.\n")
    return directory


# ---- references -------------------------------------------------------------------------------


def encode(directory: Path, text: str, add_special_tokens: bool = True) -> list[int]:
    """The ids transformers' fast tokenizer gives (it runs the same tokenizer.json)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    return tok.encode(text, add_special_tokens=add_special_tokens).ids


@torch.no_grad()
def reference_hidden(directory: Path, ids: list[int]) -> torch.Tensor:
    """The final-normed last hidden states (tokens, hidden) of transformers' Qwen3 over ``ids``."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return model.model(torch.tensor([ids])).last_hidden_state[0]


@torch.no_grad()
def reference_logits(directory: Path, ids: list[int]) -> torch.Tensor:
    """transformers' logits (vocab,) at the last position of ``ids``."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return model(torch.tensor([ids])).logits[0, -1]


# ---- a server -----------------------------------------------------------------------------------


@contextlib.contextmanager
def serve(checkpoint: Path, log_dir: Path, *extra: str) -> Iterator[str]:
    """``dualserve serve`` on ``checkpoint`` in a subprocess (eager, float weights, one thread);
    yields its base URL and stops it on exit."""
    log = log_dir / f"{checkpoint.name}.log"
    args = ["--model", str(checkpoint), "--cache-dir", str(log_dir / "cache"), "--no-compile", "--quantization",
            "none", "--dtype", "float32", "--eagle", "none", "--twin", "none", "--datastore", "none", "--threads", "1",
            "--num-blocks", "256", *extra]
    with serving(args, log) as url:
        yield url


@contextlib.contextmanager
def serve_in_process(checkpoints: list[Path]) -> Iterator[tuple[str, object]]:
    """The checkpoints loaded as one deployment (one engine, one block pool) and served by uvicorn on
    a thread; yields (base URL, deployment)."""
    from dualserve.decoders.deployment import PoolSpec, build_deployment
    from dualserve.decoders.engine.engine import EngineConfig
    from dualserve.models.loader import load_model
    from dualserve.server.app import AppState, create_app
    from dualserve.server.cli import served_models
    from dualserve.server.router import Router
    from dualserve.server.service import Service
    from server_fixture import serve_in_thread

    loaded = [load_model(path, name=path.name) for path in checkpoints]
    # A small step budget: long prompts (rerank's, the prefix-cache test's) run in chunks.
    dep = build_deployment(loaded, EngineConfig(max_batched_tokens=16), PoolSpec(block_size=4, num_blocks=512))
    service = Service(dep.engine, served_models(dep, 512), Router())
    dep.engine.start()
    try:
        with serve_in_thread(create_app(AppState(service=service))) as url:
            yield url, dep
    finally:
        dep.engine.shutdown()
