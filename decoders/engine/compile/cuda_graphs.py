"""CUDA graphs for the rows step: decode batches and verify trees replayed with one launch.

A decode step of an 8B model launches some 500 kernels. At batch 1 on a GPU the step streams the
weights in a few milliseconds, and launching its kernels one by one from Python costs as much
again. A CUDA graph records the step's kernels once and replays them with one launch (vLLM and
SGLang capture their decode batch sizes the same way). A graph has fixed shapes and fixed
addresses, so:

- a step is padded to a bucket (``bucket``): sequences and token rows to powers of two, query
  rows to 1, 2, 4, 8, 16 or ``ROWS_MAX``, cached slots to powers of two from ``CONTEXT_MIN``.
  Padding is masked (``PaddedPagedAttention.build`` with ``sizes``): padded queries attend to one
  slot, padded token rows are never attended to and their keys are never stored;
- each bucket owns static input tensors; a replay copies the step's inputs into them and clones
  the outputs out, because the next replay of the bucket overwrites them;
- the KV pool is read in place (its address never changes), and the new keys and values are stored
  after the replay by the caller, as for every compiled step (``compiled``);
- a bucket is captured the first time a step needs it, at most ``MAX_GRAPHS`` of them, in one
  shared memory pool; a step beyond the largest bucket, or once the cap is reached, runs the
  compiled forward without a graph;
- a capture and the compile thread's jobs take turns on one lock (``CompileWorker.device_lock``):
  a capture records whatever any thread launches on the device meanwhile, and under
  ``torch.cuda.graph``'s default ``capture_error_mode="global"`` another thread's synchronising
  call (a compile job's warm-up runs, its allocations) fails the capture (torch/cuda/graphs.py).
  A step that finds a job running does not wait for it: it runs uncaptured and its bucket is
  captured by a later step. A capture that fails is logged in one line, and its bucket's steps
  run the compiled forward uncaptured from then on.

Prefill chunks (the chunks graph) are not captured: their shapes vary widely, and their kernels
are long enough that launching them costs little.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..attention.paged_attention import AttentionMetadata, KVCache
from ..attention.padded import ROWS_MAX, PaddedPagedAttention, PaddedSizes

log = logging.getLogger("dualserve.compile")

SEQUENCES_MAX = 256                             # the largest batch captured
QUERY_BUCKETS = (1, 2, 4, 8, 16, ROWS_MAX)      # query rows per sequence
CONTEXT_MIN = 64                                # the smallest bucket of cached slots
MAX_GRAPHS = 96                                 # captured buckets per feature set


def _power_of_two(n: int, least: int = 1) -> int:
    p = least
    while p < n:
        p *= 2
    return p


def bucket(meta: AttentionMetadata) -> PaddedSizes | None:
    """The padded sizes of a rows step's CUDA graph, or None when no bucket holds it."""
    seqs = meta.seqs
    S, Q = len(seqs), max(s.query_len for s in seqs)
    if S > SEQUENCES_MAX or Q > ROWS_MAX:
        return None
    W = max(2, max(s.context_len for s in seqs))
    T = sum(s.query_len for s in seqs)
    sequences = _power_of_two(S)
    queries = next(b for b in QUERY_BUCKETS if b >= Q)
    return PaddedSizes(sequences, queries, _power_of_two(W, CONTEXT_MIN),
                       min(_power_of_two(T), sequences * queries))


def static_inputs(sizes: PaddedSizes, device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """A bucket's static inputs (ids, positions, rows, context, mask), which each replay overwrites
    with its step's; until then every query row is padding and sees one slot."""
    S, Q, W, T = sizes.sequences, sizes.queries, sizes.context, sizes.tokens
    mask = torch.zeros(S, Q, W + Q, dtype=torch.bool, device=device)
    mask[..., W - 1] = True
    return (torch.zeros(T, dtype=torch.long, device=device), torch.zeros(T, dtype=torch.long, device=device),
            torch.full((S, Q), T, dtype=torch.long, device=device),
            torch.zeros(S, W, dtype=torch.long, device=device), mask)


@dataclass
class Captured:
    """One bucket's graph: its static inputs (ids, positions, rows, context, mask) and outputs."""

    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]
    outputs: Sequence[torch.Tensor]


@dataclass(frozen=True)
class Replayed:
    """A replayed step's outputs for its own T tokens: hidden states and features, then the new
    keys and values to store at ``slot_mapping``."""

    outputs: list[torch.Tensor]
    slot_mapping: torch.Tensor
    new_k: torch.Tensor
    new_v: torch.Tensor


class CudaGraphs:
    """The rows forward ``fn`` (``ForwardWithFeatures``, compiled), captured per bucket on first use."""

    def __init__(self, fn: Callable[..., Sequence[torch.Tensor]], cache: KVCache,
                 lock: threading.Lock | None = None, capture: Callable[[PaddedSizes], Captured] | None = None):
        """``lock``: the compile thread's ``device_lock``, held by each capture; while a job holds
        it, steps run uncaptured (the module docstring); ``capture``: records one bucket (default
        ``_capture``; tests inject theirs)."""
        self.fn = fn
        self.cache = cache
        self.device = cache.stacked.device
        self.lock = lock or threading.Lock()
        self.capture = capture or self._capture
        self.graphs: dict[PaddedSizes, Captured] = {}
        self.failed: set[PaddedSizes] = set()  # buckets whose capture raised: they run uncaptured
        self.pool = None  # one memory pool for every bucket's graph, made with the first

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> Replayed | None:
        """Replay the step's bucket (capturing it first if new); None: run without a graph."""
        sizes = bucket(meta)
        if sizes is None:
            return None
        captured = self.graphs.get(sizes) or self._captured(sizes)
        if captured is None:
            return None
        attn = PaddedPagedAttention.build(self.cache, meta, self.device, False, sizes)
        T = ids.shape[0]
        static_ids, static_pos, rows, context, mask = captured.inputs
        static_ids.zero_()[:T].copy_(ids)
        static_pos.zero_()[:T].copy_(pos)
        rows.copy_(attn.rows)
        context.copy_(attn.context)
        mask.copy_(attn.mask)
        captured.graph.replay()
        *out, new_k, new_v = captured.outputs
        return Replayed([o[:T].clone() for o in out], attn.slot_mapping, new_k[:, :T].clone(), new_v[:, :T].clone())

    def _captured(self, sizes: PaddedSizes) -> Captured | None:
        """This bucket's graph, captured now; None where it cannot be now (the compile thread is
        running a job, the cap is reached) or ever (its capture failed)."""
        if sizes in self.failed or len(self.graphs) >= MAX_GRAPHS:
            return None
        if not self.lock.acquire(blocking=False):
            return None
        try:
            captured = self.capture(sizes)
        except Exception as e:  # noqa: BLE001 - the compiled forward still serves the bucket
            self.failed.add(sizes)
            log.warning("capturing a CUDA graph for %d sequences x %d query rows, %d cached slots failed (%s: %s); "
                        "those steps run the compiled forward uncaptured", sizes.sequences, sizes.queries,
                        sizes.context, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            return None
        finally:
            self.lock.release()
        self.graphs[sizes] = captured
        return captured

    def _capture(self, sizes: PaddedSizes) -> Captured:
        """Record ``fn`` on static inputs of these sizes, after warm-up runs on a side stream (so the
        compiled code and the allocator's blocks exist before capture, as ``torch.cuda.graph`` needs)."""
        start = time.perf_counter()
        dev = self.device
        inputs = static_inputs(sizes, dev)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.fn(*inputs, self.cache.stacked)
        torch.cuda.current_stream(dev).wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = self.fn(*inputs, self.cache.stacked)
        log.info("captured a CUDA graph for %d sequences x %d query rows, %d cached slots, %d tokens in %.2f s "
                 "(%d graphs)", sizes.sequences, sizes.queries, sizes.context, sizes.tokens,
                 time.perf_counter() - start, len(self.graphs) + 1)
        return Captured(graph, inputs, outputs)
