"""Tensor parallelism's step driver: rank 0 describes each runner call, the other ranks replay it.

Rank 0 runs everything a single-process server runs (HTTP, router, scheduler, block pool,
decoders). Its runners are ``TensorParallelRunner``s: before each call that touches the model or
the KV tensors (``forward``, ``logits``, ``move_slots``; an encoder-denoiser network's
``encode`` and ``denoise``) the runner broadcasts a step description,
and every other rank (``serve_steps``) runs the same call on its shard of the weights and of the
KV (its own KV heads of every block). The description is plain integer tensors over
torch.distributed (gloo on the CPU, NCCL on CUDA):

  header   (7,) int64      op, runner index, then op-specific sizes
  forward  (n,) int64      token ids, positions, slot mapping, aux layers, then per sequence its
                           context length, query length, mask kind, block table, context slots
                           and explicit mask: ``AttentionMetadata`` rebuilt exactly on each rank
  logits   (rows, hidden)  the hidden rows rank 0 asks logits for (the head is vocab-split)
  move     (2n,) int64     EAGLE's slot moves
  encode   as forward      an encoder-denoiser network's encoder over a prefix
  denoise  as forward      its denoiser over canvases, then, when the step has them,
                           the self-conditioning logits (tokens, vocab) fp32 and the rows that
                           have them (tokens,) int64 (``SC_NONE`` / ``SC_ALL`` / ``SC_ROWS``)

Block ids, slots and scratch space are rank 0's decisions; the other ranks only index their own
KV tensors with them, so the block pool's bookkeeping exists once and abort or preemption frees
blocks everywhere by freeing them on rank 0. Decoders above the runner are unchanged: each
forward returns the full hidden states (the sharded model all-reduces them) and ``logits``
returns full logits on rank 0. The EAGLE head drafts on rank 0 alone with unsharded copies of
the embedding and output head it borrows (``head_view``).

Faults: every call after a broadcast is collective, so any exception inside one leaves the ranks
out of step; the group is then failed for good (``ParallelGroup.fail``), every later call raises
``RankFailure`` at once, and the server's callback reports it and exits. A dead rank closes its
sockets and fails the next collective at once; a hung rank fails it after the group's timeout.
While idle, rank 0 sends a heartbeat (a broadcast and an all-reduce) every ``heartbeat`` seconds,
so a fault is noticed within ``heartbeat + timeout`` seconds even with no traffic.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from enum import IntEnum
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from dualserve.models.network import Network
from dualserve.models.sharding import Shard, Sharder
from dualserve.models.transformer import Transformer

from .attention.paged_attention import AttentionMetadata, SeqAttention
from .runner import ForwardItem, ModelRunner

log = logging.getLogger("dualserve.parallel")


class Op(IntEnum):
    FORWARD = 1
    LOGITS = 2
    MOVE = 3
    PING = 4
    STOP = 5
    ENCODE = 6
    DENOISE = 7


MASK_CAUSAL, MASK_BIDIRECTIONAL, MASK_EXPLICIT = 0, 1, 2
SC_NONE, SC_ALL, SC_ROWS = 0, 1, 2  # a denoise step's self-conditioning: none, every row, some rows
HEADER = 7


class RankFailure(RuntimeError):
    """A rank of the tensor-parallel group died, hung or fell out of step; the group is unusable."""


# ---- the step description ----------------------------------------------------------------


def encode_forward(ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata,
                   aux_layers: Sequence[int]) -> tuple[list[int], torch.Tensor]:
    """(header sizes, payload) of one forward; ``decode_forward`` inverts it."""
    heads: list[int] = []
    tables: list[int] = []
    extra: list[torch.Tensor] = []
    for s in meta.seqs:
        if isinstance(s.mask, torch.Tensor):
            kind, mask = MASK_EXPLICIT, s.mask.reshape(-1).long().cpu()
        else:
            kind, mask = (MASK_CAUSAL if s.mask == "causal" else MASK_BIDIRECTIONAL), torch.zeros(0, dtype=torch.long)
        ctx = s.context_slots
        heads += [s.context_len, s.query_len, kind, len(s.block_table), -1 if ctx is None else int(ctx.numel()),
                  int(mask.numel())]
        tables += list(s.block_table)
        extra += [torch.zeros(0, dtype=torch.long) if ctx is None else ctx.reshape(-1).long().cpu(), mask]
    payload = torch.cat([ids.cpu(), pos.cpu().long(), meta.slot_mapping.cpu().long(),
                         torch.tensor(list(aux_layers), dtype=torch.long), torch.tensor(heads, dtype=torch.long),
                         torch.tensor(tables, dtype=torch.long), *extra])
    return [int(payload.numel()), int(ids.numel()), len(meta.seqs), len(aux_layers)], payload


def decode_forward(sizes: Sequence[int], payload: torch.Tensor, block_size: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, tuple[int, ...]]:
    """(ids, positions, attention metadata, aux layers) from ``encode_forward``'s output."""
    _, tokens, num_seqs, num_aux = sizes
    p = payload.cpu()
    at = 0

    def take(n: int) -> torch.Tensor:
        nonlocal at
        at += n
        return p[at - n: at]

    ids, pos, slots = take(tokens).to(device), take(tokens).to(device), take(tokens).to(device)
    aux = tuple(take(num_aux).tolist())
    heads = take(6 * num_seqs).view(num_seqs, 6).tolist()
    tables = [take(h[3]).tolist() for h in heads]
    seqs = []
    for h, table in zip(heads, tables):
        context_len, query_len, kind, _, num_ctx, num_mask = h
        ctx = None if num_ctx < 0 else take(num_ctx).to(device)
        mask = take(num_mask)
        seq_mask = ("causal" if kind == MASK_CAUSAL else "bidirectional" if kind == MASK_BIDIRECTIONAL
                    else mask.view(query_len, query_len).bool())
        seqs.append(SeqAttention(context_len, query_len, table, seq_mask, ctx))
    return ids, pos, AttentionMetadata(seqs, slots, block_size), aux


# ---- rank 0: the group and its runners -----------------------------------------------------


class ParallelGroup:
    """This process's membership of the group. Every rank uses it to shard its models and agree on
    sizes; on rank 0 it also sends the step descriptions, in order, and watches the other ranks.

    One lock orders rank 0's collectives (the engine thread's steps, the heartbeat thread's pings)."""

    def __init__(self, shard: Shard, device: torch.device | str = "cpu", heartbeat: float = 5.0):
        """``heartbeat``: idle seconds between liveness checks; each collective's own bound is the
        timeout the process group was created with (``--tp-timeout``)."""
        self.shard = shard
        self.device = torch.device(device)
        self.heartbeat = heartbeat
        self.failure: str | None = None            # set once, by fail()
        self.runners: list[TensorParallelRunner] = []  # in creation order: the index workers use
        self.head_views: dict[int, Transformer] = {}   # id(model) -> its unsharded embedding and head
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[str], None]] = []
        self._last = time.monotonic()
        self._stopped = threading.Event()
        self.processes: list = []                  # spawned ranks (server/tensor_parallel.py), if any

    # ---- collectives ----

    @contextmanager
    def step(self, what: str) -> Iterator[None]:
        """One collective call; any exception inside fails the group (the ranks are out of step)."""
        with self._lock:
            if self.failure is not None:
                raise RankFailure(self.failure)
            try:
                yield
            except Exception as e:  # noqa: BLE001 - any error mid-collective desynchronises the ranks
                self.fail(f"tensor-parallel {what} failed: {type(e).__name__}: {e}")
                raise RankFailure(self.failure) from e
            finally:
                self._last = time.monotonic()

    def send(self, op: Op, index: int, sizes: Sequence[int] = (), payload: torch.Tensor | None = None) -> None:
        header = torch.zeros(HEADER, dtype=torch.long)
        header[0], header[1] = int(op), index
        header[2: 2 + len(sizes)] = torch.tensor(list(sizes), dtype=torch.long)
        dist.broadcast(header.to(self.device), 0, group=self.shard.group)
        if payload is not None:
            dist.broadcast(payload.to(self.device).contiguous(), 0, group=self.shard.group)

    def ping(self) -> None:
        """A broadcast and an all-reduce: returns only when every rank has answered."""
        with self.step("heartbeat"):
            self.send(Op.PING, 0)
            alive = torch.ones(1, device=self.device)
            dist.all_reduce(alive, group=self.shard.group)
            if int(alive.item()) != self.shard.world:
                raise RankFailure(f"heartbeat summed to {int(alive.item())}, not {self.shard.world}")

    # ---- start, faults, stop ----

    def agree(self, value: int) -> int:
        """Rank 0's ``value`` on every rank (the pool's block count: memory may differ between nodes)."""
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.broadcast(t, 0, group=self.shard.group)
        return int(t.item())

    def start(self) -> None:
        """Rank 0, once its runners exist: wait for every rank's (``serve_steps``), then keep watching."""
        dist.barrier(group=self.shard.group)
        self._last = time.monotonic()
        threading.Thread(target=self._beat, name="dualserve-tp-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        while not self._stopped.wait(self.heartbeat / 2):
            if self.failure is not None:
                return
            if time.monotonic() - self._last < self.heartbeat:
                continue
            try:
                self.ping()
            except RankFailure:
                return

    def on_failure(self, callback: Callable[[str], None]) -> None:
        self._callbacks.append(callback)
        if self.failure is not None:
            callback(self.failure)

    def fail(self, reason: str) -> None:
        """Mark the group failed (once) and tell the callbacks; later calls raise ``RankFailure``."""
        if self.failure is not None or self._stopped.is_set():
            return
        self.failure = reason
        log.error("%s", reason)
        for callback in self._callbacks:
            callback(reason)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every rank: a STOP step, then wait for spawned ranks (terminated if they linger)."""
        if self._stopped.is_set():
            return
        self._stopped.set()  # first: a rank that exits after STOP is not a failure (``fail``)
        if self.failure is None:
            with self._lock:
                try:
                    self.send(Op.STOP, 0)
                except Exception:  # noqa: BLE001 - a rank already gone: nothing left to stop there
                    log.warning("tensor-parallel stop could not reach every rank", exc_info=True)
        deadline = time.monotonic() + timeout
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.terminate()
                p.join(2)
            if p.is_alive():
                p.kill()
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- models ----

    def shard_models(self, models: Sequence[Network], keep_head_for: Sequence[Transformer] = ()) -> None:
        """Shard ``models`` in place, each by its family's sharder (shared modules once);
        ``keep_head_for`` keep an unsharded view of their embedding and head for an EAGLE head
        drafting on rank 0."""
        if self.shard.rank == 0:  # only rank 0 drafts
            for model in keep_head_for:
                self.head_views[id(model)] = head_view(model)
        sharder = Sharder(self.shard)
        for model in models:
            sharder(model)


def head_view(model: Transformer) -> Transformer:
    """A transformer with only ``model``'s embedding, final norm and output head, unsharded: what an
    EAGLE head borrows (built on meta, its layers dropped: it is never run)."""
    with torch.device("meta"):
        view = Transformer(model.config)
    view.layers = nn.ModuleList()
    view.embed_tokens, view.norm, view.rotary = model.embed_tokens, model.norm, model.rotary
    view.lm_head = model.lm_head
    return view


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: broadcasts each call, then makes it on its own shard (see module docstring)."""

    def __init__(self, model: Network, num_blocks: int, block_size: int, kv_dtype: torch.dtype | None = None,
                 device: torch.device | str = "cpu", use_flash: bool | None = None, *, group: ParallelGroup):
        super().__init__(model, num_blocks, block_size, kv_dtype, device, use_flash)
        self.group = group
        self.index = len(group.runners)
        group.runners.append(self)

    def compile(self, *args, **kwargs):
        raise TypeError("tensor-parallel steps run eagerly (collectives inside a compiled graph are not wired)")

    @torch.inference_mode()
    def forward(self, items: Sequence[ForwardItem], aux_layers: Sequence[int] = (),
                inputs_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if inputs_embeds is not None:
            raise NotImplementedError("tensor-parallel forwards take token ids")
        ids, pos, meta = self.describe(items)
        sizes, payload = encode_forward(ids, pos, meta, aux_layers)
        with self.group.step("forward"):
            self.group.send(Op.FORWARD, self.index, sizes, payload)
            return self.model(ids, pos, self.attention(self.kv, meta), aux_layers=aux_layers)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.to(self.dtype).contiguous()  # (rows, hidden)
        with self.group.step("logits"):
            self.group.send(Op.LOGITS, self.index, [hidden.shape[0], hidden.shape[1]], hidden)
            return self.model.logits(hidden)

    def move_slots(self, src: Sequence[int], dst: Sequence[int]) -> None:
        if not src:
            return
        with self.group.step("move"):
            self.group.send(Op.MOVE, self.index, [len(src)], torch.tensor(list(src) + list(dst), dtype=torch.long))
            self.kv.move_slots(src, dst)

    @torch.inference_mode()
    def encode(self, items: Sequence[ForwardItem]) -> None:
        ids, pos, meta = self.describe(items)
        sizes, payload = encode_forward(ids, pos, meta, ())
        with self.group.step("encode"):
            self.group.send(Op.ENCODE, self.index, sizes, payload)
            self.model.encode(ids, pos, self.attention(self.kv, meta))

    @torch.inference_mode()
    def denoise(self, items: Sequence[ForwardItem], sc_logits: torch.Tensor | None = None,
                sc_rows: torch.Tensor | None = None) -> torch.Tensor:
        ids, pos, meta = self.describe(items)
        sizes, payload = encode_forward(ids, pos, meta, ())
        kind = SC_NONE if sc_logits is None else SC_ALL if sc_rows is None else SC_ROWS
        with self.group.step("denoise"):
            self.group.send(Op.DENOISE, self.index, [*sizes, kind], payload)
            if sc_logits is not None:
                sc_logits = sc_logits.float().contiguous()  # what the other ranks receive
                dist.broadcast(sc_logits.to(self.group.device), 0, group=self.group.shard.group)
            if sc_rows is not None:
                dist.broadcast(sc_rows.long().to(self.group.device), 0, group=self.group.shard.group)
            return self.model.denoise(ids, pos, self.attention(self.kv, meta), sc_logits, sc_rows)


# ---- the other ranks ------------------------------------------------------------------------


@torch.inference_mode()
def serve_steps(runners: Sequence[ModelRunner], shard: Shard) -> None:
    """Replay rank 0's calls on this rank's runners until it sends STOP (or a collective fails,
    which raises: rank 0 died or hung, and this rank should exit)."""
    dist.barrier(group=shard.group)
    device = runners[0].device if runners else torch.device("cpu")
    while True:
        header = torch.zeros(HEADER, dtype=torch.long, device=device)
        dist.broadcast(header, 0, group=shard.group)
        op, index, *sizes = header.tolist()
        if op == Op.STOP:
            return
        if op == Op.PING:
            alive = torch.ones(1, device=device)
            dist.all_reduce(alive, group=shard.group)
            continue
        runner = runners[index]
        if op in (Op.FORWARD, Op.ENCODE, Op.DENOISE):
            payload = torch.zeros(sizes[0], dtype=torch.long, device=device)
            dist.broadcast(payload, 0, group=shard.group)
            ids, pos, meta, aux = decode_forward(sizes[:4], payload, runner.block_size, device)
            attn = runner.attention(runner.kv, meta)
            if op == Op.FORWARD:
                runner.model(ids, pos, attn, aux_layers=aux)
            elif op == Op.ENCODE:
                runner.model.encode(ids, pos, attn)
            else:
                sc, rows = receive_self_conditioning(sizes[4], ids.numel(), runner.config.vocab_size, shard,
                                                     device)
                runner.model.denoise(ids, pos, attn, sc, rows)
        elif op == Op.LOGITS:
            hidden = torch.zeros(sizes[0], sizes[1], dtype=runner.dtype, device=device)
            dist.broadcast(hidden, 0, group=shard.group)
            runner.model.logits(hidden)
        elif op == Op.MOVE:
            moves = torch.zeros(2 * sizes[0], dtype=torch.long, device=device)
            dist.broadcast(moves, 0, group=shard.group)
            n = sizes[0]
            runner.kv.move_slots(moves[:n].tolist(), moves[n:].tolist())
        else:
            raise RankFailure(f"unknown step op {op}")


def receive_self_conditioning(kind: int, tokens: int, vocab: int, shard: Shard,
                              device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A denoise step's self-conditioning logits and rows, as ``TensorParallelRunner.denoise`` sends them."""
    sc = rows = None
    if kind != SC_NONE:
        sc = torch.zeros(tokens, vocab, dtype=torch.float32, device=device)
        dist.broadcast(sc, 0, group=shard.group)
    if kind == SC_ROWS:
        rows = torch.zeros(tokens, dtype=torch.long, device=device)
        dist.broadcast(rows, 0, group=shard.group)
        rows = rows.bool()
    return sc, rows
