"""A decoder-free sanity check for twins: masked-block denoising against the AR model's own tokens.

For a held-out answer (the AR model's greedy tokens), each of its first few
blocks is masked in full and filled given the *clean* prefix before it, exactly
the condition a block-diffusion decoder meets at the start of every block:

- **one-shot**: a single forward, argmax at every masked position;
- **threshold** (Fast-dLLM, Wu et al. 2025, arXiv 2505.22618, section 3.3):
  each forward commits every masked token whose top probability is at least
  tau, and always the single most confident one; tau > 1 commits one token per
  forward in confidence order (LLaDA's low-confidence remasking at one token
  per step).

The score is the share of filled tokens equal to the AR greedy tokens (block
padding after EOS excluded), and tokens per forward for the iterative rules.
No cache: each forward runs the whole prefix + canvas with block-causal
attention, with logits shifted (row j-1 predicts token j).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dualserve.models.attention import DenseAttention
from dualserve.models.transformer import Transformer

from .diffusion_twin import Example


@dataclass
class FillScore:
    rule: str
    tokens: int = 0
    correct: int = 0
    filled: int = 0     # canvas positions filled, padding included
    forwards: int = 0

    @property
    def accuracy(self) -> float:
        return self.correct / max(self.tokens, 1)

    @property
    def tokens_per_forward(self) -> float:
        return self.filled / max(self.forwards, 1)

    def row(self) -> dict:
        return {"rule": self.rule, "accuracy": round(self.accuracy, 4),
                "tokens_per_forward": round(self.tokens_per_forward, 3), "tokens": self.tokens}


def canvas_probs(model: Transformer, seq: torch.Tensor, start: int, block_size: int) -> torch.Tensor:
    """Probabilities (canvas, vocab) for positions start..len(seq)-1, each from the row before it."""
    positions = torch.arange(len(seq), device=seq.device)
    attn = DenseAttention([len(seq)], mode="block_causal", block_size=block_size)
    hidden, _ = model(seq, positions, attn)  # (tokens, hidden)
    return torch.softmax(model.logits(hidden[start - 1:len(seq) - 1]), -1)


def fill_block(model: Transformer, prefix: list[int], length: int, mask_id: int, block_size: int,
               tau: float | None) -> tuple[list[int], int]:
    """Fill ``length`` masked tokens after ``prefix``; tau None = one-shot. Returns (tokens, forwards)."""
    device = model.embed_tokens.weight.device
    seq = torch.tensor(prefix + [mask_id] * length, device=device)  # (prefix + canvas,)
    start = len(prefix)
    masked = torch.ones(length, dtype=torch.bool, device=device)
    forwards = 0
    while bool(masked.any()):
        probs = canvas_probs(model, seq, start, block_size)
        probs[:, mask_id] = 0.0  # the [MASK] id is never an answer
        conf, tok = probs.max(-1)  # (canvas,)
        forwards += 1
        if tau is None:
            commit = masked
        else:
            conf = torch.where(masked, conf, torch.full_like(conf, -1.0))
            commit = masked & (conf >= tau)
            commit[int(conf.argmax())] = True
        seq[start:][commit] = tok[commit]
        masked &= ~commit
    return seq[start:].tolist(), forwards


@torch.inference_mode()
def denoise_eval(model: Transformer, examples: list[Example], block_size: int, mask_id: int,
                 max_blocks: int = 2, taus: tuple[float | None, ...] = (None, 0.9, 1.01)) -> list[FillScore]:
    """Scores per rule over the first ``max_blocks`` answer blocks of each example."""
    scores = {tau: FillScore("one-shot" if tau is None else f"threshold {tau:g}") for tau in taus}
    for ex in examples:
        first = ex.prompt_len // block_size
        for k in range(first, first + max_blocks):
            start = max(ex.prompt_len, k * block_size)
            end = min((k + 1) * block_size, ex.answer_end)
            if start >= end:
                break
            truth = ex.ids[start:end]
            for tau, score in scores.items():
                got, forwards = fill_block(model, ex.ids[:start], (k + 1) * block_size - start, mask_id,
                                           block_size, tau)
                score.tokens += len(truth)
                score.correct += sum(int(a == b) for a, b in zip(got, truth))
                score.forwards += forwards
                score.filled += len(got)
    return list(scores.values())
