"""A tiny random Llama checkpoint with a chat tokenizer, as ``dualserve train-diffusion`` needs one.

The weights are written by transformers (``from_config`` + ``save_pretrained``), so the twin
tools are tested on the layout real checkpoints have. The tokenizer is word-level over a small
vocabulary whose first ids mirror SmolLM2's specials (``<|endoftext|>`` 0, ``<|im_start|>`` 1,
``<|im_end|>`` 2, ``<repo_name>`` 3, ``<reponame>`` 4), with a ChatML template, so the
self-distillation stage (chat template, EOS, mask-token choice) runs as it does on the real model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>", "<unk>"]
WORDS = ["system", "user", "assistant", "the", "a", "is", "what", "of", "and", "to", "in", "write", "repeat",
         "capital", "json", "name", "city", "number", "answer", "with", "just", "one", "word", "list"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VOCAB = 64
HIDDEN = 32


def write_chat_tokenizer(directory: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    vocab.update({f"w{i}": i for i in range(len(vocab), VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": "<unk>", "add_bos_token": False, "chat_template": CHATML}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2]}))


def write_tiny_llama(directory: Path, seed: int = 0, family: str = "llama") -> Path:
    """A 2-layer Llama (tied embeddings, GQA) with transformers' own file layout, plus the tokenizer.

    ``family="qwen2"`` writes a Qwen2 instead: q/k/v biases and untied output embeddings."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "qwen2":
        config = Qwen2Config(**common, tie_word_embeddings=False)
    else:
        config = LlamaConfig(**common, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # larger than the 0.02 init, so logits are not flat
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) / (p.shape[-1] ** 0.5 if p.dim() > 1 else 1.0))
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    write_chat_tokenizer(directory)
    return directory
