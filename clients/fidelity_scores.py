"""What both fidelity measures share (``eval_fidelity``, ``fidelity_layers``): the corpus, read by
section and tokenized; the per-token scores of a model against the float reference (KL divergence,
top-1 agreement, the next token's NLL), gathered chunk by chunk; and the markdown tables they
print."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch


# ---- corpus ---------------------------------------------------------------------------------

def read_sections(path: Path) -> list[tuple[str, str]]:
    """(kind, text) of every ``%% kind`` section, in file order."""
    parts = re.split(r"^%% *(\S+) *\n", path.read_text(encoding="utf-8"), flags=re.M)
    return [(parts[i], parts[i + 1]) for i in range(1, len(parts) - 1, 2)]


@dataclass
class Corpus:
    ids: list[int]            # every section's ids, concatenated
    kinds: list[int]          # index into ``names`` of the section each id came from
    names: list[str]          # kinds of text, in first-seen order
    sections: list[tuple[str, str, list[int]]]  # (kind, text, ids)

    def chunks(self, ctx: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(ids, kinds) of each whole chunk of ``ctx`` tokens; a short tail is left out, as llama.cpp does."""
        ids, kinds = torch.tensor(self.ids), torch.tensor(self.kinds)
        return [(ids[i: i + ctx], kinds[i: i + ctx]) for i in range(0, len(self.ids) - ctx + 1, ctx)]


def tokenize_corpus(tokenizer, path: Path) -> Corpus:
    ids, kinds, names, sections = [], [], [], []
    for kind, text in read_sections(path):
        if kind not in names:
            names.append(kind)
        part = tokenizer.encode(text)  # specials inside the text (ChatML markers) become their ids
        sections.append((kind, text, part))
        ids += part
        kinds += [names.index(kind)] * len(part)
    return Corpus(ids, kinds, names, sections)


# ---- metrics --------------------------------------------------------------------------------

def token_metrics(ref_logp: torch.Tensor, logits: torch.Tensor,
                  targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per scored row: KL(ref || this), whether the argmaxes agree, and this model's NLL of the
    next token. ``ref_logp``: the reference's float64 log-probabilities (rows, vocab)."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
    agree = logp.argmax(-1) == ref_logp.argmax(-1)
    nll = -logp.gather(1, targets[:, None])[:, 0]
    return kl, agree, nll


@dataclass
class Scores:
    """Per-token metrics of one model against the reference, gathered chunk by chunk."""

    kl: list[torch.Tensor] = field(default_factory=list)
    agree: list[torch.Tensor] = field(default_factory=list)
    nll: list[torch.Tensor] = field(default_factory=list)
    kinds: list[torch.Tensor] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, ref_logp: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, kinds: torch.Tensor) -> None:
        for store, value in zip((self.kl, self.agree, self.nll), token_metrics(ref_logp, logits, targets)):
            store.append(value)
        self.kinds.append(kinds)

    def summary(self, names: Sequence[str] = ()) -> dict:
        kl, agree = torch.cat(self.kl), torch.cat(self.agree).double()
        nll, kinds = torch.cat(self.nll), torch.cat(self.kinds)
        n = kl.numel()
        top1 = agree.mean().item()
        out = {"tokens": n, "kl_mean": kl.mean().item(), "kl_se": (kl.std() / math.sqrt(n)).item() if n > 1 else 0.0,
               "kl_p99": torch.quantile(kl, 0.99).item(), "kl_max": kl.max().item(),
               "top1": top1, "top1_se": math.sqrt(top1 * (1 - top1) / n), "ppl": math.exp(nll.mean().item()),
               "seconds": round(self.seconds, 2), "by_kind": {}}
        for i, name in enumerate(names):
            mask = kinds == i
            if mask.any():
                out["by_kind"][name] = {"tokens": int(mask.sum()), "kl_mean": kl[mask].mean().item(),
                                        "top1": agree[mask].mean().item()}
        return out



# ---- tables ---------------------------------------------------------------------------------

def markdown(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    return [line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows]
