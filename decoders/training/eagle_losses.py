"""Training objectives for EAGLE heads, as pure functions on batches of target features.

A batch is padded (batch, length): ``ids`` are the tokens, ``final`` the target's
post-norm last hidden state and ``aux`` its fused low/mid/high features at each
fed position, ``valid`` marks positions whose *predicted* token is part of an
answer (prompt tokens are context, not targets: upstream's ``loss_mask``).
Row i pairs the feature of position i with token i+1 and predicts token i+2,
whose target distribution is the target's lm_head at position i+1.

* EAGLE-1/2 (paper section 4.2; upstream ``v1`` ``eagle/train/main.py``):
  SmoothL1 regression of f_{i+1} plus 0.1 x soft cross-entropy of the draft
  logits against the target's distribution; input features get U(-0.1, 0.1) noise.
* EAGLE-3 "training-time test" (EAGLE-3 section 3.2; upstream
  ``eagle/traineagle3/cnets.py``): the head is unrolled for ``steps`` steps, step k
  feeding its own previous output and the token k further on, at RoPE position
  i + k, attending to the real prefix (step 0 keys, causal) plus, for each earlier
  step, only the key of its own row: exactly what it sees when drafting k deep.
  Loss = sum_k 0.8^k soft cross-entropy over the draft vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F

from dualserve.models.attention import DenseAttention
from dualserve.models.eagle import Eagle1Head, Eagle3Head


@dataclass
class Batch:
    ids: torch.Tensor      # (batch, length) token ids, 0-padded
    final: torch.Tensor    # (batch, length, hidden) post-norm target hidden
    aux: torch.Tensor      # (batch, length, 3 * hidden) EAGLE-3 features, or empty
    valid: torch.Tensor    # (batch, length) bool: token at this position is an answer token
    lengths: torch.Tensor  # (batch,) real lengths (features exist for positions < length - 1)


def shifted(x: torch.Tensor, k: int, fill=0) -> torch.Tensor:
    """x[:, i] -> x[:, i + k] along dim 1, padded at the end."""
    if k == 0:
        return x
    pad = torch.full_like(x[:, :k], fill)
    return torch.cat([x[:, k:], pad], dim=1)


def row_mask(batch: Batch, k: int) -> torch.Tensor:
    """(batch, length) rows whose step-k prediction (token i+2+k) is trainable."""
    b, t = batch.ids.shape
    i = torch.arange(t, device=batch.ids.device)[None, :]
    has_target = i + 1 + k <= batch.lengths[:, None] - 2  # feature at i+1+k was computed
    return has_target & shifted(batch.valid, 2 + k, False)


class UnrolledAttention:
    """Attention for the training-time test; one instance per batch, called once per step.

    Step 0 is causal over the step-0 keys. Step k >= 1 sees step-0 keys at
    positions <= i and the keys of steps 1..k at position i only (the draft
    path's own ancestors), as in upstream ``traineagle3/cnets.py``.
    """

    def __init__(self, batch: int, length: int):
        self.b, self.t = batch, length
        self.keys: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, t, hq, d = self.b, self.t, q.shape[1], q.shape[2]
        rep = hq // k.shape[1]
        # (batch, heads, length, head_dim)
        qb = q.view(b, t, hq, d).transpose(1, 2)
        kb = k.view(b, t, -1, d).transpose(1, 2).repeat_interleave(rep, 1)
        vb = v.view(b, t, -1, d).transpose(1, 2).repeat_interleave(rep, 1)
        self.keys.append((kb, vb))
        if len(self.keys) == 1:
            out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True)
            return out.transpose(1, 2).reshape(q.shape)
        k0, v0 = self.keys[0]
        scale = d ** -0.5
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        s0 = (qb @ k0.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))  # (b, h, t, t)
        ks = torch.stack([kk for kk, _ in self.keys[1:]], dim=-2)  # (b, h, t, steps, d)
        vs = torch.stack([vv for _, vv in self.keys[1:]], dim=-2)
        sd = (qb[..., None, :] * ks).sum(-1) * scale  # (b, h, t, steps)
        w = torch.softmax(torch.cat([s0, sd], dim=-1).float(), dim=-1).to(q.dtype)
        out = w[..., :t] @ v0 + (w[..., t:, None] * vs).sum(-2)  # (b, h, t, d)
        return out.transpose(1, 2).reshape(q.shape)


def soft_ce(logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Mean over masked rows of -sum p log q; also the count of rows where argmaxes agree."""
    p = torch.softmax(target_logits.float(), dim=-1)
    logq = torch.log_softmax(logits.float(), dim=-1)
    ce = -(p * logq).sum(-1)
    n = mask.sum().clamp(min=1)
    hits = int(((logits.argmax(-1) == target_logits.argmax(-1)) & mask).sum())
    return (ce * mask).sum() / n, hits


def unrolled(head: Eagle3Head, batch: Batch, steps: int) -> Iterator[torch.Tensor]:
    """The head's output (batch, length, hidden) at each step of the training-time test: step k feeds
    its own step k - 1 output with the token k further on, at RoPE position i + k."""
    b, t = batch.ids.shape
    hidden = head.fc(batch.aux.to(head.fc.weight.dtype))  # (b, t, hidden)
    attn = UnrolledAttention(b, t)
    for k in range(steps):
        ids = shifted(batch.ids, 1 + k)
        pos = (torch.arange(t, device=ids.device) + k).repeat(b)
        hidden = head(ids.reshape(-1), hidden.reshape(b * t, -1), pos, attn).view(b, t, -1)
        yield hidden


def eagle3_loss(head: Eagle3Head, batch: Batch, draft_lm_head: torch.Tensor, steps: int,
                decay: float = 0.8, t2d: torch.Tensor | None = None) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Training-time-test loss; ``draft_lm_head`` (draft_vocab, hidden) = target lm_head rows of the draft vocab.

    With ``t2d`` (target vocab,) bool, a row whose target token is outside the draft
    vocabulary is not trained (upstream ``position_mask``: the head cannot propose it,
    and the softmax over the draft vocabulary would teach a wrong second choice). The
    target token is the data's next token, which is the target's argmax in greedy data.

    Returns the loss and, per step, (argmax hits, rows) for accuracy reporting.
    """
    target_logits = batch.final.float() @ draft_lm_head.T  # (b, t, draft_vocab), no grad
    total = torch.zeros((), device=batch.ids.device)
    stats = []
    for k, h in enumerate(unrolled(head, batch, steps)):
        mask = row_mask(batch, k)
        if t2d is not None:
            mask = mask & t2d[shifted(batch.ids, 2 + k)]
        # logits of the trained rows only: prompt and padding rows are about half a batch, and the
        # draft-vocabulary head (forward and backward) is a third of a step's work
        rows = mask.nonzero(as_tuple=True)
        loss, hits = soft_ce(head.logits(h[rows]), shifted(target_logits, 1 + k)[rows], mask[rows])
        total = total + decay ** k * loss
        stats.append((hits, int(mask.sum())))
    return total, stats


def eagle1_loss(head: Eagle1Head, batch: Batch, noise: float = 0.1, reg_weight: float = 1.0,
                token_weight: float = 0.1) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Feature regression + token loss (EAGLE paper, eq. for L = L_reg + w_cls L_cls)."""
    b, t = batch.ids.shape
    x = batch.final.float()
    if noise:
        x = x + (torch.rand_like(x) - 0.5) * 2 * noise
    ids = shifted(batch.ids, 1)
    pos = torch.arange(t, device=ids.device).repeat(b)
    h = head(ids.reshape(-1), x.reshape(b * t, -1), pos, DenseAttention([t] * b)).view(b, t, -1)
    mask = row_mask(batch, 0)
    target = shifted(batch.final.float(), 1)
    n = mask.sum().clamp(min=1)
    reg = (F.smooth_l1_loss(h, target, reduction="none").mean(-1) * mask).sum() / n
    rows = mask.nonzero(as_tuple=True)
    with torch.no_grad():
        target_logits = head.logits(target[rows])
    ce, hits = soft_ce(head.logits(h[rows]), target_logits, torch.ones(len(rows[0]), dtype=torch.bool))
    return reg_weight * reg + token_weight * ce, [(hits, int(n))]
