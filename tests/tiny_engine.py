"""A tiny random transformer core and the engine pieces around it, for the compiled-step tests:
its config, a tokenizer that needs no files, and attention metadata over consecutive blocks."""

from __future__ import annotations

import torch

from dualserve.decoders.engine.attention.paged_attention import AttentionMetadata, SeqAttention
from dualserve.models.checkpoint import build
from dualserve.models.config import ModelConfig
from dualserve.models.transformer import Transformer

CFG = ModelConfig(family="llama", vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, intermediate_size=96, tie_word_embeddings=True)
BLOCK = 4


class FakeTokenizer:
    eos_token_id = None
    eos_token_ids: tuple[int, ...] = ()
    vocab_size = CFG.vocab_size

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(65 + i % 26) for i in ids)

    def id_to_token(self, i: int) -> str:
        return chr(65 + i % 26)


def tiny(quantization: str = "none") -> Transformer:
    """The same random weights every call (seed 0), in fp32 or quantized."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Transformer(CFG).eval().requires_grad_(False)
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.fill_(1.0)
    if quantization == "none":
        return model
    return build(CFG, dict(model.state_dict()), torch.float32, "cpu", quantization)


def meta_for(seqs: list[tuple[int, int, object]]) -> AttentionMetadata:
    """Sequences (context, new tokens, mask) over consecutive blocks, storing the new tokens."""
    out, slots, block = [], [], 0
    for context, new, mask in seqs:
        blocks = list(range(block, block + (context + new + BLOCK - 1) // BLOCK))
        block += len(blocks)
        out.append(SeqAttention(context, new, blocks, mask))
        pos = torch.arange(context, context + new)
        slots.append(torch.tensor(blocks)[pos // BLOCK] * BLOCK + pos % BLOCK)
    return AttentionMetadata(out, torch.cat(slots), BLOCK)
