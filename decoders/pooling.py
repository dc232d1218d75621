"""Pooling decoders: a prompt in, one vector out (embeddings, and rerank's yes/no logits).

A pooling request is a prefill and nothing else. Each step it computes a chunk of its prompt
through the model runner, batched with every other scheduled pooling request in one forward,
and folds the chunk's final-normed hidden states (before the output head) into its running
state: a sum for mean pooling, the first row for cls, the last row for last-token pooling. When
the whole prompt is done it emits one final delta carrying the result (``Delta.pooled``):

* ``EmbeddingReadout``: the pooled state, L2-normalised (``models.pooling``);
* ``LabelReadout``: the logits of a few tokens at the last position (rerank's "yes" and "no").

The prefix cache is left untouched: a pooling request's blocks are its own, written by its
chunks and freed when it finishes. Nothing is published (its progress is recorded on its table
directly, not through ``BlockPool.mark_written``, which would publish full blocks), and its KV
namespace is its own (``pooling_key``), so it never takes a hit that generation published
either. Its answer then does not depend on what else ran before it.

Pooling decoders are registered under ``pooling_key(name)``, not under the served name, so
``Engine.decoders_for(name)`` (``/v1/models``, the router, calibration) never offers them for
generation; the server's embeddings and rerank endpoints find them with ``pooling_decoder``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Literal, Sequence

import torch

from dualserve.models.pooling import Pooling, PoolingProfile, l2_normalize, label_ids, read_profile

from .ar import span_items
from .engine.blocks import BlockPool
from .engine.isolation import guard
from .engine.request import DecoderState, Request
from .engine.runner import ModelRunner
from .engine.scheduler import Scheduled

Task = Literal["embed", "score"]


def pooling_key(model: str) -> str:
    """The engine's model key of ``model``'s pooling decoders (the module docstring)."""
    return f"{model}:pooling"


@dataclass
class PoolingState(DecoderState):
    """A request's running pooled state; dropped on preemption, when the prompt starts over."""

    total: torch.Tensor | None = None   # (hidden,) fp32: sum of rows (mean), or the row kept (cls, last)


@dataclass(frozen=True)
class EmbeddingReadout:
    """The pooled final hidden state, L2-normalised."""

    pooling: Pooling

    def fold(self, st: PoolingState, rows: torch.Tensor, start: int) -> None:
        """Fold the rows of positions [start, start + len(rows)) into ``st``."""
        if self.pooling == "mean":
            chunk = rows.float().sum(0)
            st.total = chunk if st.total is None else st.total + chunk
        elif self.pooling == "cls":
            st.total = rows[0].float() if start == 0 else st.total
        else:
            st.total = rows[-1].float()

    def result(self, runner: ModelRunner, st: PoolingState, length: int) -> torch.Tensor:
        pooled = st.total / length if self.pooling == "mean" else st.total
        return l2_normalize(pooled)


@dataclass(frozen=True)
class LabelReadout:
    """The logits of ``token_ids`` at the last position (fp32)."""

    token_ids: tuple[int, ...]

    def fold(self, st: PoolingState, rows: torch.Tensor, start: int) -> None:
        st.total = rows[-1]

    def result(self, runner: ModelRunner, st: PoolingState, length: int) -> torch.Tensor:
        return runner.logits(st.total[None])[0, list(self.token_ids)].float()


Readout = EmbeddingReadout | LabelReadout


@dataclass
class PoolingDecoder:
    """Prefill a prompt in chunks and emit its pooled vector (a ``Decoder``; never generates)."""

    name: Task
    runner: ModelRunner
    pool: BlockPool
    readout: Readout
    profile: PoolingProfile = field(default_factory=PoolingProfile)
    width: int = 0                      # the length of an ``embed`` vector (the hidden size)
    shares_prompt_blocks = False
    supports_infill = False
    default_max_tokens = None
    draft_choices = ()

    @property
    def kv_owner(self) -> ModelRunner:
        return self.runner

    def plan(self, req: Request, budget: int) -> tuple[int, int]:
        return min(len(req.prompt_ids) - req.num_computed, budget), 0

    def step(self, batch: Sequence[Scheduled], emit) -> None:
        batch = [s for s in batch if s.num_new_tokens > 0]
        if not batch:
            return
        hidden, _ = self.runner.forward(span_items(batch, self.pool))  # (tokens, hidden), final norm applied
        ends = itertools.accumulate(s.num_new_tokens for s in batch)
        for s, end in zip(batch, ends):
            req, n = s.request, s.num_new_tokens
            with guard(req, emit, "pooling"):
                self._advance(req, hidden[end - n: end], emit)

    def _advance(self, req: Request, rows: torch.Tensor, emit) -> None:
        start = req.num_computed
        if not isinstance(req.decoder_state, PoolingState):
            req.decoder_state = PoolingState()
        self.readout.fold(req.decoder_state, rows, start)
        # The KV of [0, start + n) is written into blocks this request alone holds. It is recorded
        # here rather than with BlockPool.mark_written, which would publish the full blocks.
        req.table.num_tokens = start + len(rows)
        req.num_forwards += 1
        if req.num_computed < len(req.prompt_ids):
            return
        delta = req.finish("stop")
        delta.pooled = self.readout.result(self.runner, req.decoder_state, len(req.prompt_ids)).cpu()
        emit(req, delta)


def register_pooling(engine, name: str, runner: ModelRunner, loaded, override: Pooling | None = None) -> None:
    """Register ``name``'s pooling decoders under ``pooling_key(name)``, as its profile allows: an
    embedding model embeds, a reranker scores, and a generation model does both (mean pooling;
    scoring through its chat template, where "yes" and "no" are one token each)."""
    profile = read_profile(loaded.path, override)
    key, tok, vocab = pooling_key(name), loaded.tokenizer, loaded.config.vocab_size
    if profile.purpose != "rerank":
        engine.add_decoder(key, PoolingDecoder("embed", runner, engine.pool, EmbeddingReadout(profile.pooling),
                                               profile, loaded.config.hidden_size), tok, vocab)
    labels = label_ids(tok)
    scores = profile.purpose == "rerank" or (profile.purpose == "generation" and tok.chat_template is not None)
    if labels is not None and scores:
        engine.add_decoder(key, PoolingDecoder("score", runner, engine.pool, LabelReadout(labels), profile), tok, vocab)


def pooling_decoder(engine, model: str, task: Task) -> PoolingDecoder | None:
    """``model``'s pooling decoder for ``task``, or None where it has none."""
    return engine.decoders.get((pooling_key(model), task))
