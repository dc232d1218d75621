"""EAGLE training batches from the self-distillation shards, with target features computed per batch
(or kept in a ``FeatureStore``, ``features.py``, where a trainer names one).

The shards (``distil.py``) hold token ids only: storing three fused layers plus the
final hidden state for every position would cost about 4.6 KB a token in fp16, some
gigabytes for 500k answer tokens with their prompts. So by default each batch runs the
target once, without gradients, in the weight format it is served in (the head must
draft from the features the server will hand it), and the head trains on those
features. With disk to spare, ``--feature-store`` keeps them (4.6 GB in bf16 for the
default model's 1M tokens) and a later pass reads them instead.

Order, resumable while the shards grow: training goes in passes. A pass takes the
records on disk when it starts, cuts them into blocks of ``block`` records, visits
the blocks in a seeded order, and within a block shuffles, groups records of similar
length into batches (little padding) and shuffles the batches. A ``Cursor``
(pass, blocks in the pass, block, batch) therefore names one batch for good: the
shards are append-only, so the first records never change, and a resumed run draws
exactly the batches a straight run would. Records written after a pass started join
at the next pass.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence as Seq

import torch

from dualserve.models.attention import DenseAttention
from dualserve.models.transformer import Transformer

from .distil import answered_records
from .eagle_losses import Batch
from .features import FeatureStore


@dataclass(frozen=True)
class Cursor:
    pass_index: int = 0
    blocks: int = 0      # complete blocks in this pass (fixed when the pass starts)
    block: int = 0       # position in the pass's block order
    batch: int = 0       # batch within that block

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Sequence:
    ids: torch.Tensor    # (length,) prompt then answer
    prompt_len: int


def load_distilled(data_dirs: Path | Seq[Path], max_len: int,
                   exclude: Callable[[list[int]], bool] | None = None) -> list[Sequence]:
    """Answered records of each directory in turn, cut to ``max_len`` tokens (``distil.answered_records``),
    but for those whose prompt ``exclude`` names (a prompt that holds an evaluation prompt)."""
    dirs = [data_dirs] if isinstance(data_dirs, Path) else list(data_dirs)
    return [Sequence(torch.tensor(rec["prompt_ids"] + rec["answer_ids"], dtype=torch.long), len(rec["prompt_ids"]))
            for d in dirs for rec in answered_records(d, max_len)
            if exclude is None or not exclude(rec["prompt_ids"])]


class ShardStream:
    """Deterministic, resumable batches over shards that may still be growing."""

    def __init__(self, data_dir: Path | Seq[Path], batch_size: int, block: int = 256, seed: int = 0, max_len: int = 1024,
                 exclude: Callable[[list[int]], bool] | None = None):
        self.data_dir, self.batch_size, self.block, self.seed, self.max_len = data_dir, batch_size, block, seed, max_len
        self.exclude = exclude
        self.seqs: list[Sequence] = []
        self._groups: dict[tuple[int, int], list[list[int]]] = {}

    def refresh(self) -> int:
        """Reread the shards (they only grow); returns the number of complete blocks."""
        self.seqs = load_distilled(self.data_dir, self.max_len, self.exclude)
        self._groups.clear()
        return len(self.seqs) // self.block

    def start(self, cursor: Cursor | None) -> Cursor:
        """Load the data; a fresh cursor begins pass 0 over every complete block on disk."""
        blocks = self.refresh()
        if cursor is None or cursor.blocks == 0:
            if blocks == 0:
                raise ValueError(f"{self.data_dir} holds {len(self.seqs)} sequences, fewer than one block "
                                 f"({self.block})")
            return Cursor(0, blocks, 0, 0)
        return cursor

    def _block_order(self, cursor: Cursor) -> list[int]:
        order = list(range(cursor.blocks))
        random.Random(f"{self.seed}:{cursor.pass_index}").shuffle(order)
        return order

    def groups(self, cursor: Cursor) -> list[list[int]]:
        """The batches (as sequence indices) of the cursor's block."""
        key = (cursor.pass_index, cursor.block)
        if key not in self._groups:
            b = self._block_order(cursor)[cursor.block]
            idx = list(range(b * self.block, (b + 1) * self.block))
            rng = random.Random(f"{self.seed}:{cursor.pass_index}:{b}")
            rng.shuffle(idx)
            idx.sort(key=lambda i: len(self.seqs[i].ids))  # stable: equal lengths keep the shuffled order
            groups = [idx[i:i + self.batch_size] for i in range(0, len(idx), self.batch_size)]
            rng.shuffle(groups)
            self._groups = {key: groups}
        return self._groups[key]

    def next(self, cursor: Cursor) -> tuple[list[Sequence], Cursor]:
        """The batch at ``cursor`` and the cursor after it (a new pass rereads the shards)."""
        groups = self.groups(cursor)
        batch = [self.seqs[i] for i in groups[cursor.batch]]
        if cursor.batch + 1 < len(groups):
            return batch, Cursor(cursor.pass_index, cursor.blocks, cursor.block, cursor.batch + 1)
        if cursor.block + 1 < cursor.blocks:
            return batch, Cursor(cursor.pass_index, cursor.blocks, cursor.block + 1, 0)
        return batch, Cursor(cursor.pass_index + 1, self.refresh(), 0, 0)


class ShardBatches:
    """A ``ShardStream`` as the training loop's ``Batches`` (``loop.py``): the checkpoint records the
    cursor past the last batch, and ``make`` turns a batch's sequences into what the loss takes."""

    def __init__(self, stream: ShardStream, make: Callable[[list[Sequence]], object]):
        self.stream, self.make = stream, make
        self.cursor = Cursor()

    def resume(self, progress: dict) -> None:
        self.cursor = self.stream.start(Cursor(**progress["cursor"]) if "cursor" in progress else None)

    def next(self, step: int) -> tuple[object, int]:
        seqs, self.cursor = self.stream.next(self.cursor)
        return self.make(seqs), self.cursor.pass_index

    def progress(self) -> dict:
        return {"cursor": self.cursor.as_dict()}


@torch.no_grad()
def target_batch(target: Transformer, seqs: list[Sequence], aux_layers: tuple[int, ...],
                 store: FeatureStore | None = None) -> Batch:
    """The target's features of ``seqs`` (no cache, causal), padded into a ``Batch``: from ``store``
    where it holds them, else from one forward over the others (then kept in ``store``)."""
    found = [store.load(s.ids) if store is not None else None for s in seqs]
    todo = [i for i, f in enumerate(found) if f is None]
    for i, (final, aux) in zip(todo, _forward(target, [seqs[i] for i in todo], aux_layers) if todo else []):
        if store is not None:
            store.save(seqs[i].ids, final, aux)
            final, aux = final.to(store.dtype), aux.to(store.dtype)  # as a later pass will read them
        found[i] = (final, aux)
    device = target.norm.weight.device
    lens = [len(s.ids) for s in seqs]
    b, t = len(seqs), max(lens)
    out_ids = torch.zeros(b, t, dtype=torch.long, device=device)
    out_final = torch.zeros(b, t, found[0][0].shape[-1], device=device)
    out_aux = torch.zeros(b, t, found[0][1].shape[-1], device=device)
    valid = torch.zeros(b, t, dtype=torch.bool, device=device)
    for i, (s, n, (final, aux)) in enumerate(zip(seqs, lens, found)):
        out_ids[i, :n] = s.ids
        out_final[i, :n] = final.float()
        out_aux[i, :n] = aux.float()
        valid[i, s.prompt_len:n] = True
    return Batch(out_ids, out_final, out_aux, valid, torch.tensor(lens, device=device))


def _forward(target: Transformer, seqs: list[Sequence], aux_layers: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence (final, aux): the target's post-norm last hidden state and its ``aux_layers``' outputs
    side by side, each (length, width), from one forward over the sequences packed."""
    lens = [len(s.ids) for s in seqs]
    ids = torch.cat([s.ids for s in seqs]).to(target.norm.weight.device)
    positions = torch.cat([torch.arange(n) for n in lens]).to(ids.device)
    final, aux = target(ids, positions, DenseAttention(lens), aux_layers=aux_layers)
    aux_cat = torch.cat(aux, -1) if aux else final[:, :0]
    return list(zip(final.split(lens), aux_cat.split(lens)))
