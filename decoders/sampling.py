"""Sampling parameters and the pure functions that turn logits into tokens.

Every rule is a function on tensors so each can be tested alone and every
decoder (AR, EAGLE verification, diffusion unmasking) applies the same ones:

  logits -> logit_bias -> penalties (repetition, presence, frequency)
         -> temperature -> top_k -> top_p -> min_p -> sample / argmax

Penalties follow OpenAI (presence and frequency over generated tokens) and the
CTRL paper's repetition penalty (Keskar et al., 2019, section 4.1; over prompt and
generated tokens, divide positive logits and multiply negative ones).

Seeds: each request owns a ``torch.Generator``, so its samples do not depend on
what else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0              # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None     # number of top alternatives; 0 = only the chosen token
    prompt_logprobs: bool = False   # echo with logprobs
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-5

    @property
    def needs_processing(self) -> bool:
        return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0 \
            or self.repetition_penalty != 1.0


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    if bias:
        ids = torch.tensor(list(bias.keys()), device=logits.device)
        logits[..., ids] += torch.tensor(list(bias.values()), device=logits.device, dtype=logits.dtype)
    return logits


def apply_penalties(logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int],
                    params: SamplingParams) -> torch.Tensor:
    """logits: (vocab,) for one sequence, modified in place and returned."""
    vocab = logits.shape[-1]
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=logits.device)
        seen = seen[seen < vocab]
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(output_ids, device=logits.device), minlength=vocab)[:vocab]
        logits -= params.frequency_penalty * counts.to(logits.dtype)
        logits -= params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def process_logits(logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int],
                   params: SamplingParams) -> torch.Tensor:
    """Bias and penalties for one sequence (vocab,). Temperature and truncation come later."""
    if not params.needs_processing:
        return logits
    logits = logits.clone()
    apply_logit_bias(logits, params.logit_bias)
    return apply_penalties(logits, prompt_ids, output_ids, params)


def truncated_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution actually sampled from: temperature, then top-k, top-p, min-p.

    logits: (..., vocab) -> probabilities of the same shape. EAGLE's lossless
    rejection sampling compares target and draft under exactly this distribution.
    """
    logits = logits / max(params.temperature, 1e-5)
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest set whose mass reaches top_p (the first token always stays).
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    if params.min_p > 0:
        floor = params.min_p * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from (vocab,) processed logits."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = truncated_probs(logits.float(), params)
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


def token_logprobs(logits: torch.Tensor, chosen: list[int], top_n: int) -> list[TokenLogprob]:
    """Logprobs of the model's raw distribution (as OpenAI reports them) for each row's chosen token.

    logits: (rows, vocab); chosen: one token id per row.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(-1, torch.tensor(chosen, device=logp.device)[:, None])[:, 0].tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in chosen]
    if top_n > 0:
        vals, ids = logp.topk(top_n, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    return [TokenLogprob(c, p, t) for c, p, t in zip(chosen, picked, tops)]
