"""Unmasking policies and step schedules for masked diffusion decoding, as pure functions on tensors.

A masked diffusion decoder (LLaDA, Nie et al. 2025, arXiv 2502.09992; Dream, Ye et al. 2025,
arXiv 2508.15487) denoises a *unit* of [MASK] positions over several forwards. Each forward
gives, for every still-masked position of the unit, a distribution over the vocabulary. Three
independent choices turn those into committed tokens, and each is a function here:

1. **proposal**: which token each masked position would take (argmax, or a sample from the
   request's temperature / top-k / top-p distribution with its own generator);
2. **confidence**: how sure the model is of that proposal (``Confidence``):
   - ``"prob"``: probability of the proposed token (LLaDA "low_confidence", Dream "maskgit_plus");
   - ``"margin"``: top-1 minus top-2 probability (Dream "topk_margin");
   - ``"neg_entropy"``: sum p log p (Dream "entropy"; higher is more certain);
   - ``"random"``: uniform noise (LLaDA "random" remasking);
3. **selection** (a ``Policy``): which proposals are committed this step:
   - ``LowConfidence``: the k most confident, k from a schedule (LLaDA ``generate.py``);
   - ``Threshold``: every proposal with confidence >= tau, and always the most confident one
     (Fast-dLLM, Wu et al. 2025, arXiv 2505.22618, section 3.3; ``get_transfer_index``);
   - ``Factor``: the largest n whose n-th confidence c_n satisfies (n + 1)(1 - c_n) < f
     (Fast-dLLM's "factor" rule, ``get_transfer_index_dynamic``, quirks kept);
   - ``DynamicThreshold``: all above tau if that is at least k, else the top k
     (SDAR ``generate.py``, "low_confidence_dynamic").

A *schedule* says how many tokens each step of a unit commits when the policy asks for a count:
``LinearSchedule`` (LLaDA Eq. 8: the same expected number per step, remainder first) or
``DreamSchedule`` (Dream's ``k = int(masked * (1 - s / t))`` over ``linspace(1, eps, steps + 1)``).
Counts are computed once at the start of a unit; zero-count steps are dropped, since a forward
that commits nothing changes nothing at temperature 0.

Confidences are computed from the model's own distribution (softmax of the logits at
temperature 1, [MASK] excluded), as LLaDA and Fast-dLLM do, so a threshold of 0.9 means the same
thing at every sampling temperature. (Dream's samplers use the tempered distribution; at
temperature 0 both agree.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

import torch

from ..engine.sampling import SamplingParams, truncated_probs

Confidence = Literal["prob", "margin", "neg_entropy", "random"]


# ---- schedules ---------------------------------------------------------------------


def linear_counts(num_masked: int, steps: int) -> list[int]:
    """LLaDA's ``get_num_transfer_tokens``: ``num_masked`` split over ``steps``, remainder first."""
    base, rem = divmod(num_masked, steps)
    return [base + 1] * rem + [base] * (steps - rem)


def dream_counts(num_masked: int, steps: int, eps: float = 1e-3) -> list[int]:
    """Dream's per-step counts for one sequence, in its float32 arithmetic.

    ``k_i = int(m_i * (1 - s / t))`` with t, s consecutive points of ``linspace(1, eps, steps + 1)``
    and m_i the masks left; the last step takes all that remain (Dream ``generation_utils.py``).
    """
    timesteps = torch.linspace(1, eps, steps + 1)  # (steps + 1,) float32
    left = num_masked
    counts = []
    for i in range(steps):
        if i < steps - 1:
            ratio = 1 - timesteps[i + 1] / timesteps[i]
            k = int(torch.tensor(float(left), dtype=torch.float32) * ratio)
        else:
            k = left
        counts.append(k)
        left -= k
    return counts


@dataclass(frozen=True)
class LinearSchedule:
    """``steps`` forwards per unit (None: one token per step, LLaDA's steps == gen_length)."""

    steps: int | None = None

    def counts(self, num_masked: int) -> list[int]:
        steps = min(self.steps or num_masked, num_masked)  # never more steps than masks
        return [c for c in linear_counts(num_masked, steps) if c > 0]


@dataclass(frozen=True)
class DreamSchedule:
    steps: int
    eps: float = 1e-3

    def counts(self, num_masked: int) -> list[int]:
        return [c for c in dream_counts(num_masked, self.steps, self.eps) if c > 0]


Schedule = Union[LinearSchedule, DreamSchedule]


# ---- proposals and confidences ----------------------------------------------------------


def propose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """One token per row of (rows, vocab) logits: argmax when greedy, else a sample (rows,).

    Sampling is inverse-CDF with one uniform per row drawn on the generator's own device (as
    ``sampling.sample_token`` does), so a seed gives the same tokens on any backend and batch.
    """
    if params.greedy:
        return logits.argmax(-1)
    cdf = truncated_probs(logits.float(), params).cumsum(-1)  # (rows, vocab)
    u = torch.rand(cdf.shape[0], generator=generator, device=generator.device).to(cdf.device)
    picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]  # (rows,)
    return picked.clamp(max=cdf.shape[-1] - 1)


def confidence(kind: Confidence, probs: torch.Tensor, tokens: torch.Tensor,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """Scores (rows,) of the proposed ``tokens`` under the model's ``probs`` (rows, vocab)."""
    if kind == "prob":
        return probs.gather(-1, tokens[:, None])[:, 0]
    if kind == "margin":
        top = probs.topk(2, dim=-1).values  # (rows, 2)
        return top[:, 0] - top[:, 1]
    if kind == "neg_entropy":
        return (probs * torch.log(probs + 1e-10)).sum(-1)  # Dream adds 1e-10 inside the log
    if kind == "random":
        if generator is None:
            raise ValueError("random confidences need the request's generator")
        return torch.rand(probs.shape[0], generator=generator, device=generator.device).to(probs.device)
    raise ValueError(f"unknown confidence {kind!r}")


# ---- selection rules --------------------------------------------------------------------
# Each takes confidences (m,) of the masked candidates and the schedule's count k, and
# returns the indices (into the candidates) to commit: never empty when m > 0.


def top_k(conf: torch.Tensor, k: int) -> torch.Tensor:
    """The k most confident candidates (torch.topk, as upstream, so ties break alike)."""
    return torch.topk(conf, min(max(k, 1), conf.numel())).indices


@dataclass(frozen=True)
class LowConfidence:
    """Commit the k most confident proposals (LLaDA low-confidence remasking)."""

    def select(self, conf: torch.Tensor, k: int) -> torch.Tensor:
        return top_k(conf, k)


@dataclass(frozen=True)
class Threshold:
    """Commit every proposal with confidence >= tau, and always the most confident one."""

    tau: float = 0.9

    def select(self, conf: torch.Tensor, k: int) -> torch.Tensor:
        order = top_k(conf, conf.numel())  # all candidates, most confident first
        keep = conf[order] >= self.tau
        keep[0] = True
        return order[keep]


@dataclass(frozen=True)
class Factor:
    """Fast-dLLM's factor rule: walk the sorted confidences while c_n >= 1 - f / (n + 1).

    Exactly ``get_transfer_index_dynamic``: the first candidate always passes; the count is the
    index of the first failure, except that a failure at the last candidate (or no failure)
    takes them all.
    """

    factor: float = 1.0

    def select(self, conf: torch.Tensor, k: int) -> torch.Tensor:
        m = conf.numel()
        ordered = torch.sort(conf, descending=True).values.tolist()
        take = m - 1
        for i, c in enumerate(ordered):
            bound = -1.0 if i == 0 else 1.0 - self.factor / (i + 2)  # n = i + 1
            if c < bound:
                take = i
                break
        if take == 0 or take == m - 1:
            take += 1
        return top_k(conf, take)


@dataclass(frozen=True)
class DynamicThreshold:
    """SDAR's dynamic rule: all proposals above tau when there are at least k, else the top k."""

    tau: float = 0.9

    def select(self, conf: torch.Tensor, k: int) -> torch.Tensor:
        above = int((conf > self.tau).sum())
        return top_k(conf, above if above >= k else k)


Policy = Union[LowConfidence, Threshold, Factor, DynamicThreshold]
