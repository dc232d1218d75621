"""The block-diffusion training objective for twins: LoRA modules, the two-stream layout, the loss.

A twin is an AR model taught to fill a block of [MASK] tokens given a clean
prefix (Fast-dLLM v2, Wu et al. 2025, arXiv 2509.26328, section 3). Three
choices make the AR weights a good starting point, and all three are here:

**Block-causal attention.** Tokens attend bidirectionally inside their block of
``B`` tokens and causally across blocks; blocks are aligned to absolute
positions (``models.attention.block_causal_mask``), so at inference the block
that holds the end of the prompt is the first canvas.

**Token shift.** The logits at position i predict token i+1, as in the AR model
(Dream, section 2; Fast-dLLM v2, section 3.2): a masked token at position j is
predicted from row j-1, and the first token of a block from the last row of the
previous block, which is clean context.

**Clean stream + noisy streams in one sequence.** At inference the model sees a
clean committed prefix and one noisy block. Masking every block of one sequence
would make later blocks see noisy earlier blocks, a condition inference never
has. Instead each training sequence is ``[x0 | view_a | view_b]``: the clean
tokens x0 (L) followed by two noisy copies of the answer blocks (BD3-LM, Arriola
et al. 2025, arXiv 2503.09573, section 3.2 "vectorized training"; Fast-dLLM v2
section 3.2 uses the same clean/noisy concatenation). The attention mask lets

  - clean token i see clean token j when block(j) <= block(i) (block-causal);
  - noisy token i see clean token j when block(j) < block(i) (the clean prefix),
    and noisy token j of its own view when block(j) == block(i);
  - nothing see another view, and clean tokens never see noisy ones,

so each view is exactly "clean prefix + one noisy block" for every block at
once, with the same RoPE positions as x0. The two views use complementary masks
(Fast-dLLM v2, section 3.2, "complementary masking"): per block a ratio t ~ U(0, 1)
masks each answer token of view a with probability t, view b masks exactly the
others, so every answer token is a target once per sample. Sharing one clean
stream between both views costs L + 2 * L_answer tokens instead of 4 * L.

Noisy copies start at the block that holds the first answer token; earlier
blocks (all prompt) have nothing to predict. Prompt tokens are never masked.
The loss is the mean cross-entropy over masked tokens (no 1/t weighting:
complementary views already balance high and low mask ratios). Two optional
terms (``Objective``) push the twin towards committing several tokens per forward
at its parent's quality:

  - **soft targets** (knowledge distillation, Hinton et al. 2015): the cross-entropy
    to the AR parent's whole next-token distribution at each target, taken from the
    parent's causal forward over the clean tokens, mixed with the hard target;
  - **certainty forcing** (dParallel, Chen et al. 2025, arXiv 2509.26488, section 3.2):
    the entropy (at a softmax temperature) of the masked tokens the twin already
    predicts right is minimised, so they pass the unmasking threshold in the same
    forward instead of one after another.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dualserve.models.adapter import LORA_TARGETS
from dualserve.models.attention import DenseAttention
from dualserve.models.transformer import Transformer


class LoRALinear(nn.Module):
    """y = base(x) + scale * (x @ A^T) @ B^T, with B = 0 at the start (Hu et al. 2021, section 4.1)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator):
        super().__init__()
        self.base = base
        self.scale = alpha / rank
        device = base.weight.device
        a = torch.empty(rank, base.in_features)  # (rank, in)
        # PEFT's default: kaiming-uniform A (a = sqrt(5)), zero B, so the twin starts as the AR model.
        bound = 1 / math.sqrt(base.in_features)
        a.uniform_(-bound, bound, generator=generator)
        self.lora_A = nn.Parameter(a.to(device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=device))  # (out, rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low = F.linear(x, self.lora_A)  # (tokens, rank)
        if x.dim() == 2:
            # Accumulate inside the GEMM: no (tokens, out) temporaries for the scale and the sum.
            # Out of place: autocast casts ``addmm``'s operands, it never casts an in-place ``addmm_``.
            return torch.addmm(self.base(x), low, self.lora_B.t(), alpha=self.scale)
        return self.base(x) + F.linear(low, self.lora_B) * self.scale


def add_lora(model: Transformer, rank: int, alpha: float, seed: int,
             targets: tuple[str, ...] = LORA_TARGETS) -> dict[str, LoRALinear]:
    """Wrap each target projection of ``model`` in place; returns {"layers.N.<target>": module}."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, LoRALinear] = {}
    for i, layer in enumerate(model.layers):
        for target in targets:
            parent_name, attr = target.rsplit(".", 1)
            parent = layer.get_submodule(parent_name)
            module = LoRALinear(getattr(parent, attr), rank, alpha, gen)
            setattr(parent, attr, module)
            out[f"layers.{i}.{target}"] = module
    return out


def adapter_tensors(loras: dict[str, LoRALinear], mask_embedding: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors of ``adapter.safetensors`` (see ``models/adapter.py``)."""
    out = {"mask_embedding": mask_embedding.detach()}
    for name, m in loras.items():
        out[f"{name}.lora_A"] = m.lora_A.detach()
        out[f"{name}.lora_B"] = m.lora_B.detach()
    return out


@dataclass
class Example:
    """One training sequence: clean tokens ``ids`` whose first ``prompt_len`` are never masked.

    ``answer_end`` is where the answer ends and block padding begins."""

    ids: list[int]
    prompt_len: int
    answer_end: int


def make_example(prompt_ids: list[int], answer_ids: list[int], finished: bool, block_size: int,
                 pad_id: int) -> Example | None:
    """A finished answer is padded to its block's end with ``pad_id`` (the decoder then learns to
    fill a block's tail after EOS, as LLaDA's SFT pads with EOS, section 2.3); a cut-off one is
    trimmed to whole blocks. None when no answer token is left."""
    ids = list(prompt_ids) + list(answer_ids)
    end = len(ids)
    if finished:
        ids += [pad_id] * (-len(ids) % block_size)
    else:
        ids = ids[: len(ids) // block_size * block_size]
    if len(ids) <= len(prompt_ids):
        return None
    return Example(ids, len(prompt_ids), min(end, len(ids)))


@dataclass
class Packed:
    """One example laid out as [clean | view_a | view_b] with its mask and loss targets."""

    input_ids: torch.Tensor    # (T,) with [MASK] in the noisy views
    positions: torch.Tensor    # (T,)
    attn_mask: torch.Tensor    # (T, T) bool, True = may attend
    source_rows: torch.Tensor  # (targets,) rows whose logits predict ...
    targets: torch.Tensor      # (targets,) ... these tokens
    target_pos: torch.Tensor   # (targets,) their absolute positions j in the clean tokens
    clean_len: int             # the clean tokens x0 come first: input_ids[:clean_len]

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])


def stream_mask(length: int, noisy_start: int, block_size: int) -> torch.Tensor:
    """The (T, T) mask for [clean (length) | view a | view b], each view covering noisy_start..length."""
    blk_c = torch.arange(length) // block_size                  # (L,)
    blk_n = torch.arange(noisy_start, length) // block_size     # (Ln,)
    ln = length - noisy_start
    t = length + 2 * ln
    mask = torch.zeros(t, t, dtype=torch.bool)
    mask[:length, :length] = blk_c[:, None] >= blk_c[None, :]
    for v in range(2):
        rows = slice(length + v * ln, length + (v + 1) * ln)
        mask[rows, :length] = blk_n[:, None] > blk_c[None, :]
        mask[rows, rows] = blk_n[:, None] == blk_n[None, :]
    return mask


def pack(ex: Example, block_size: int, mask_id: int, gen: torch.Generator) -> Packed:
    """Sample complementary masks for ``ex`` and lay it out (see the module docstring)."""
    x0 = torch.tensor(ex.ids)  # (L,)
    length, p = len(ex.ids), ex.prompt_len
    n0 = p // block_size * block_size
    ln = length - n0
    blocks = torch.arange(n0, length) // block_size - n0 // block_size    # (Ln,) block index within views
    ratio = torch.rand(int(blocks.max()) + 1, generator=gen)              # (blocks,) t per block
    answer = torch.arange(n0, length) >= p                                # (Ln,)
    mask_a = (torch.rand(ln, generator=gen) < ratio[blocks]) & answer
    mask_b = answer & ~mask_a
    views, rows, targets, where = [], [], [], []
    for v, m in enumerate((mask_a, mask_b)):
        views.append(torch.where(m, torch.full_like(x0[n0:], mask_id), x0[n0:]))
        pos = torch.nonzero(m).squeeze(1) + n0                            # absolute positions j
        first = pos % block_size == 0
        # j predicted from row j-1: clean stream at a block start, else this view's own row.
        rows.append(torch.where(first, pos - 1, length + v * ln + (pos - 1 - n0)))
        targets.append(x0[pos])
        where.append(pos)
    return Packed(input_ids=torch.cat([x0, *views]),
                  positions=torch.cat([torch.arange(length), torch.arange(n0, length), torch.arange(n0, length)]),
                  attn_mask=stream_mask(length, n0, block_size),
                  source_rows=torch.cat(rows), targets=torch.cat(targets), target_pos=torch.cat(where),
                  clean_len=length)


def embedding_with_mask(model: Transformer, mask_embedding: torch.Tensor, mask_id: int) -> torch.Tensor:
    """The (vocab, hidden) embedding with the trainable [MASK] row swapped in (differentiable in the row)."""
    weight = model.embed_tokens.weight
    return weight.index_put((torch.tensor([mask_id], device=weight.device),), mask_embedding[None].to(weight))


@dataclass(frozen=True)
class Objective:
    """The terms added to the hard-target cross-entropy (see the module docstring)."""

    distil: float = 0.0       # weight of the parent's soft targets; the hard targets get 1 - distil
    certainty: float = 0.0    # weight of the entropy of correctly predicted masked tokens
    temperature: float = 0.5  # the softmax temperature of that entropy (dParallel uses 0.5)


def parent_logprobs(parent: Transformer, batch: list[Packed]) -> torch.Tensor:
    """(targets, vocab) log-probabilities of the AR parent for each target j, from row j-1 of its
    causal forward over the clean tokens: what the parent itself would say at that position."""
    device = parent.embed_tokens.weight.device
    lens = [p.clean_len for p in batch]
    ids = torch.cat([p.input_ids[:p.clean_len] for p in batch]).to(device)
    positions = torch.cat([torch.arange(n) for n in lens]).to(device)
    hidden, _ = parent(ids, positions, DenseAttention(lens, "causal"))
    offsets = torch.tensor([0] + lens[:-1]).cumsum(0).tolist()
    rows = torch.cat([p.target_pos - 1 + o for p, o in zip(batch, offsets)]).to(device)
    return F.log_softmax(parent.logits(hidden[rows]).float(), -1)


def twin_loss(model: Transformer, mask_embedding: torch.Tensor, mask_id: int, batch: list[Packed],
              objective: Objective = Objective(), parent: Transformer | None = None,
              ) -> tuple[torch.Tensor, int, int]:
    """The twin's loss over a batch of packed examples (the mean masked-token cross-entropy, plus
    ``objective``'s terms; ``parent`` is needed for soft targets); also (targets, correct)."""
    device = model.embed_tokens.weight.device
    ids = torch.cat([p.input_ids for p in batch]).to(device)
    positions = torch.cat([p.positions for p in batch]).to(device)
    emb = embedding_with_mask(model, mask_embedding, mask_id)
    attn = DenseAttention([p.length for p in batch], masks=[p.attn_mask for p in batch])
    hidden, _ = model(None, positions, attn, inputs_embeds=F.embedding(ids, emb))  # (tokens, hidden)
    offsets = torch.tensor([0] + [p.length for p in batch[:-1]]).cumsum(0)
    rows = torch.cat([p.source_rows + o for p, o in zip(batch, offsets.tolist())]).to(device)
    targets = torch.cat([p.targets for p in batch]).to(device)
    # With tied embeddings the output row of [MASK] is the trained row too; training pushes it down.
    head = emb if model.config.tie_word_embeddings else model.lm_head.weight
    logits = F.linear(hidden[rows], head).float()  # (targets, vocab)
    predicted = logits.argmax(-1) == targets
    loss = F.cross_entropy(logits, targets)
    if objective.distil:
        if parent is None:
            raise ValueError("soft targets need the AR parent")
        with torch.no_grad():
            soft = parent_logprobs(parent, batch).exp()
        soft_ce = -(soft * F.log_softmax(logits, -1)).sum(-1).mean()
        loss = (1 - objective.distil) * loss + objective.distil * soft_ce
    if objective.certainty and bool(predicted.any()):
        logp = F.log_softmax(logits[predicted] / objective.temperature, -1)
        entropy = -(logp.exp() * logp).sum(-1).mean()
        loss = loss + objective.certainty * entropy
    return loss, int(targets.numel()), int(predicted.sum())
