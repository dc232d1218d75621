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
The clean blocks before the canvas are run once and their K/V kept
(``PrefixKV``); each denoising forward runs only the canvas's block, with logits
shifted (row j-1 predicts token j).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dualserve.models.attention import block_causal_mask, sdpa
from dualserve.models.transformer import Transformer

from .diffusion_twin import Example

ORACLE = "oracle"  # a rule name beside the thresholds: commit what already agrees with AR
Rule = float | str | None


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


class PrefixKV:
    """Attention that keeps the K/V of whole clean blocks and lets one canvas block attend to them.

    Under block-causal attention the clean blocks before the canvas never see it, so
    their K/V are computed once per block (``store`` pass); each denoising forward then
    runs only the canvas block, which sees all of the prefix and all of its own block.
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.storing = True
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.storing:
            self.k[layer_idx], self.v[layer_idx] = k, v
            return sdpa(q, k, v, block_causal_mask(len(q), self.block_size, device=q.device))
        if layer_idx in self.k:
            k, v = torch.cat([self.k[layer_idx], k]), torch.cat([self.v[layer_idx], v])
        return sdpa(q, k, v)


def encode_prefix(model: Transformer, prefix: list[int], block_size: int) -> tuple[PrefixKV, torch.Tensor | None]:
    """Run the whole clean blocks of ``prefix`` once; returns their K/V and the last row's hidden state."""
    device = model.embed_tokens.weight.device
    cached = len(prefix) // block_size * block_size  # the rest shares the canvas's block
    attn = PrefixKV(block_size)
    last = None
    if cached:
        hidden, _ = model(torch.tensor(prefix[:cached], device=device), torch.arange(cached, device=device), attn)
        last = hidden[-1:]  # (1, hidden)
    attn.storing = False
    return attn, last


def fill_block(model: Transformer, prefix: list[int], length: int, mask_id: int, block_size: int,
               tau: Rule, encoded: tuple[PrefixKV, torch.Tensor | None] | None = None,
               truth: list[int] | None = None) -> tuple[list[int], int]:
    """Fill ``length`` masked tokens after ``prefix`` up to a block end; tau None = one-shot,
    ``ORACLE`` = commit what agrees with ``truth`` (the AR tokens; past their end, padding agrees).

    Returns (tokens, forwards). Logits are shifted: canvas position j is read from row
    j-1, which for a canvas starting on a block boundary is the prefix's last row.
    ``encoded`` (from ``encode_prefix``) lets several rules share one prefix pass.
    """
    device = model.embed_tokens.weight.device
    start = len(prefix)
    cached = start // block_size * block_size
    attn, last = encoded or encode_prefix(model, prefix, block_size)
    block = torch.tensor(prefix[cached:] + [mask_id] * length, device=device)  # (block,)
    positions = torch.arange(cached, cached + len(block), device=device)
    masked = torch.ones(length, dtype=torch.bool, device=device)
    if tau == ORACLE:
        if truth is None:
            raise ValueError("the oracle rule needs the AR tokens")
        known = torch.tensor(truth[:length], dtype=torch.long, device=device)
        agree_any = torch.arange(length, device=device) >= len(known)  # padding past the answer
    forwards = 0
    while bool(masked.any()):
        hidden, _ = model(block, positions, attn)  # (block, hidden)
        rows = hidden[start - cached - 1:-1] if start > cached else torch.cat([last, hidden[:-1]])
        probs = torch.softmax(model.logits(rows), -1)  # (canvas, vocab)
        probs[:, mask_id] = 0.0  # the [MASK] id is never an answer
        conf, tok = probs.max(-1)  # (canvas,)
        forwards += 1
        if tau is None:
            commit = masked
        elif tau == ORACLE:
            right = agree_any.clone()
            right[:len(known)] = tok[:len(known)] == known
            commit = masked & right
            first = int(masked.nonzero()[0])
            if first < len(known):
                tok[first] = known[first]
            commit[first] = True
        else:
            conf = torch.where(masked, conf, torch.full_like(conf, -1.0))
            commit = masked & (conf >= tau)
            commit[int(conf.argmax())] = True
        block[start - cached:][commit] = tok[commit]
        masked &= ~commit
    return block[start - cached:].tolist(), forwards


@torch.inference_mode()
def denoise_eval(model: Transformer, examples: list[Example], block_size: int, mask_id: int,
                 max_blocks: int = 2, taus: tuple[Rule, ...] = (None, 0.9, 1.01)) -> list[FillScore]:
    """Scores per rule over the first ``max_blocks`` answer blocks of each example."""
    def name(tau: Rule) -> str:
        return "one-shot" if tau is None else tau if isinstance(tau, str) else f"threshold {tau:g}"

    scores = {tau: FillScore(name(tau)) for tau in taus}
    for ex in examples:
        first = ex.prompt_len // block_size
        for k in range(first, first + max_blocks):
            start = max(ex.prompt_len, k * block_size)
            end = min((k + 1) * block_size, ex.answer_end)
            if start >= end:
                break
            truth = ex.ids[start:end]
            encoded = encode_prefix(model, ex.ids[:start], block_size)
            for tau, score in scores.items():
                got, forwards = fill_block(model, ex.ids[:start], (k + 1) * block_size - start, mask_id,
                                           block_size, tau, encoded, truth)
                score.tokens += len(truth)
                score.correct += sum(int(a == b) for a, b in zip(got, truth))
                score.forwards += forwards
                score.filled += len(got)
    return list(scores.values())
