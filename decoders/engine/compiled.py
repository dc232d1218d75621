"""The compiled step: one compiled forward per step shape, with paged attention inside the graph.

Eager PyTorch spends most of a batch-1 CPU forward in Python dispatch (about 35
small ops per layer). Compiled by inductor, a layer becomes a few fused C++
kernels around the weight-only GEMMs, and a forward costs about half as much.

Attention must be in the graph, so ``PaddedPagedAttention`` expresses every
step (decode batches, EAGLE trees, diffusion canvases, prefill chunks) in one
tensor-only form: the S sequences of a step are padded to Q query rows and W
cached slots,

  rows      (S, Q)        row of each query in the flattened batch; padding -> a dummy row T
  context   (S, W)        flat KV slot of each cached token; padding -> slot 0, masked out
  mask      (S, Q, W + Q) what each query sees: valid cached slots, then its own new tokens

and each layer attends with two batched matmuls; the graph returns every layer's
new keys/values, stored at ``slot_mapping`` after it runs (``KVCache.store``). No
Python runs per layer, so there is nothing to gather per sequence.

Shapes are dynamic, so one graph serves every length; PyTorch still
specialises sizes 0 and 1, so a step compiles into one of four graphs by
whether it has one sequence and one query row (``StepShape``), and W is padded
to at least 2. On the CPU each graph is an AOTInductor package (``aoti.py``),
built once per host and model under the model cache (minutes on 2 cores) and
loaded in well under a second on later starts; elsewhere it is a
``torch.compile``'d graph. Either way the work happens on a background thread:
until a shape's graph is ready, that shape runs eagerly, and every shape's
build or load is logged with its time.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch._inductor.runtime.cache_dir_utils import cache_dir as default_cache_dir

from . import aoti
from .heap import trim_heap
from .paged_attention import AttentionMetadata, KVCache, SeqAttention, as_stored, mask_tensor

log = logging.getLogger("dualserve.compile")

GRAPH_LIMIT = 64  # compiled graphs per code object (dynamo's recompile_limit), see _compile


class PaddedPagedAttention:
    """Paged attention over a padded step; tensors only, so it traces into one graph."""

    def __init__(self, stacked: torch.Tensor, slot_mapping: torch.Tensor | None, rows: torch.Tensor,
                 context: torch.Tensor, mask: torch.Tensor):
        self.stacked = stacked                     # (2 * layers, slots, kv_heads, head_dim): keys, then values
        self.layers = stacked.shape[0] // 2
        self.slot_mapping = slot_mapping           # (T,); None inside the graph (the caller stores)
        self.rows = rows                           # (S, Q)
        self.context = context                     # (S, W)
        self.mask = mask                           # (S, Q, W + Q) bool
        # Each layer's new keys and values, as stored (cache dtype), in layer order. The graph
        # returns them and the caller writes the cache (``KVCache.store``) after the forward: a
        # cache write inside the graph is a mutation of a graph input, which inductor may turn into
        # a copy of the whole layer's cache on every step.
        self.new_k: list[torch.Tensor] = []
        self.new_v: list[torch.Tensor] = []

    @classmethod
    def build(cls, cache: KVCache, meta: AttentionMetadata, device) -> "PaddedPagedAttention":
        seqs = meta.seqs
        total = sum(s.query_len for s in seqs)
        S, Q = len(seqs), max(s.query_len for s in seqs)
        W = max(2, max(s.context_len for s in seqs))
        rows = torch.full((S, Q), total, dtype=torch.long)
        context = torch.zeros(S, W, dtype=torch.long)
        mask = torch.zeros(S, Q, W + Q, dtype=torch.bool)
        start = 0
        for i, s in enumerate(seqs):
            rows[i, : s.query_len] = torch.arange(start, start + s.query_len)
            start += s.query_len
            idx = meta.context_index(i, "cpu")
            if idx is not None:
                context[i, : idx.numel()] = idx.cpu()
                mask[i, : s.query_len, : idx.numel()] = True
            new = mask_tensor(s, "cpu")
            own = torch.ones(s.query_len, s.query_len, dtype=torch.bool) if new is None else new[:, -s.query_len:]
            mask[i, : s.query_len, W: W + s.query_len] = own
            mask[i, s.query_len:, W + s.query_len - 1] = True  # padded queries see one slot: no empty softmax
        slots = meta.slot_mapping
        return cls(cache.stacked, slots.to(device), rows.to(device), context.to(device), mask.to(device))

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kc, vc = self.stacked[layer_idx], self.stacked[self.layers + layer_idx]  # (slots, kv_heads, head_dim)
        self.new_k.append(k.to(kc.dtype))
        self.new_v.append(v.to(vc.dtype))
        k, v = as_stored(k, kc), as_stored(v, vc)
        S, Q = self.rows.shape
        T, heads, d = q.shape
        kv_heads = k.shape[1]
        pad = q.new_zeros(1, heads, d)
        qx = torch.cat([q, pad])[self.rows].view(S, Q, kv_heads, heads // kv_heads, d)  # (S, Q, kv, group, d)
        kx = torch.cat([k, pad[:, :kv_heads]])[self.rows]                                # (S, Q, kv, d)
        vx = torch.cat([v, pad[:, :kv_heads]])[self.rows]
        kg, vg = kc[self.context].to(q.dtype), vc[self.context].to(q.dtype)              # (S, W, kv, d)
        out = self._reductions(qx, kx, vx, kg, vg) if Q == 1 else self._matmuls(qx, kx, vx, kg, vg)
        return q.new_zeros(T + 1, heads, d).index_copy_(0, self.rows.reshape(-1), out.reshape(S * Q, heads, d))[:T]

    def _reductions(self, qx: torch.Tensor, kx: torch.Tensor, vx: torch.Tensor, kg: torch.Tensor,
                    vg: torch.Tensor) -> torch.Tensor:
        """Decode steps (one query per sequence): attention as three reductions (scores over the
        head dim, softmax, output over the context) that inductor fuses into loops reading each
        cached key and value once, straight from the pool by slot. As batched matmuls, the gathered
        context is first copied and permuted: on the default model a decode step's graph at 800
        cached tokens took 15.8 ms that way and takes 8.1 ms this way (4.8 and 4.6 ms at 30).
        Multi-token steps keep the matmuls, whose cost grows with query rows times context."""
        W, scale = kg.shape[1], qx.shape[-1] ** -0.5
        cached = (qx[:, :, None] * kg[:, None, :, :, None, :]).sum(-1) * scale                # (S, Q, W, kv, group)
        own = (qx[:, :, None] * kx[:, None, :, :, None, :]).sum(-1) * scale                  # (S, Q, Q, kv, group)
        scores = torch.cat([cached, own], 2).masked_fill(~self.mask[:, :, :, None, None], float("-inf"))
        probs = torch.softmax(scores, dim=2)                                                  # (S, Q, W + Q, kv, group)
        return (probs[:, :, :W, :, :, None] * vg[:, None, :, :, None, :]).sum(2) + \
            (probs[:, :, W:, :, :, None] * vx[:, None, :, :, None, :]).sum(2)                # (S, Q, kv, group, d)

    def _matmuls(self, qx: torch.Tensor, kx: torch.Tensor, vx: torch.Tensor, kg: torch.Tensor,
                 vg: torch.Tensor) -> torch.Tensor:
        """Multi-token steps (prefill chunks, trees, canvases): attention as two batched matmuls."""
        S, Q, kv_heads, group, d = qx.shape
        W = kg.shape[1]
        ks, vs = torch.cat([kg, kx], 1), torch.cat([vg, vx], 1)                              # (S, W + Q, kv, d)
        qg = qx.permute(0, 2, 3, 1, 4).reshape(S, kv_heads, group * Q, d)
        scores = torch.matmul(qg, ks.permute(0, 2, 3, 1)) * (d ** -0.5)                     # (S, kv, group * Q, W + Q)
        scores = scores.view(S, kv_heads, group, Q, W + Q).masked_fill(~self.mask[:, None, None], float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(vs.dtype).view(S, kv_heads, group * Q, W + Q)
        out = torch.matmul(probs, vs.permute(0, 2, 1, 3))                                    # (S, kv, group * Q, d)
        return out.view(S, kv_heads, group, Q, d).permute(0, 3, 1, 2, 4)                    # (S, Q, kv, group, d)


@dataclass(frozen=True)
class StepShape:
    """Which of the four graphs a step runs: PyTorch specialises sizes of one."""

    many_seqs: bool
    many_queries: bool

    @classmethod
    def of(cls, meta: AttentionMetadata) -> "StepShape":
        return cls(len(meta.seqs) > 1, max(s.query_len for s in meta.seqs) > 1)

    @property
    def name(self) -> str:
        return f"{'batch' if self.many_seqs else 'single'}/{'multi' if self.many_queries else 'one'}-token"

    def dynamic_dims(self) -> tuple[dict[int, object], ...]:
        """The dims of ``ForwardWithFeatures``' inputs that vary within this shape, for
        ``torch.export``: tokens T, sequences S, query rows Q, cached slots W and the pool's slots."""
        auto = torch.export.Dim.AUTO
        s = {0: auto} if self.many_seqs else {}
        q = {1: auto} if self.many_queries else {}
        t = {0: auto} if self.many_seqs or self.many_queries else {}
        return t, t, {**s, **q}, {**s, 1: auto}, {**s, **q, 2: auto}, {1: auto}


class ForwardWithFeatures(torch.nn.Module):
    """One step as a graph of tensors only: ``model``'s forward over a padded step, also returning
    the residual stream after the ``aux_layers``.

    Inputs: token ids (T,), positions (T,), and the padded attention's ``rows``, ``context``,
    ``mask`` and the KV pool's ``stacked`` view (see ``PaddedPagedAttention``). Outputs, flat:
    hidden (T, hidden), one (T, hidden) per feature layer, then the new keys and the new values
    (layers, T, kv_heads, head_dim) for the caller to store."""

    def __init__(self, model: torch.nn.Module, aux_layers: tuple[int, ...]):
        super().__init__()
        self.model = model
        self.aux_layers = aux_layers

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor, context: torch.Tensor,
                mask: torch.Tensor, stacked: torch.Tensor) -> tuple[torch.Tensor, ...]:
        attn = PaddedPagedAttention(stacked, None, rows, context, mask)
        hidden, aux = self.model(ids, pos, attn, aux_layers=self.aux_layers)
        return (hidden, *aux, torch.stack(attn.new_k), torch.stack(attn.new_v))


class CompileWorker:
    """One background thread that runs compile jobs in the order they were asked for.

    Shared by every runner of a deployment, so compiles never compete with each other for the cores.
    The thread exits as soon as its queue is empty (and a new one starts with the next job): a thread
    that ran torch work keeps an OpenMP worker pool while it lives, and an extra pool throttles the
    engine's OpenMP spinning (see ``openmp``)."""

    def __init__(self) -> None:
        self._queue: deque[Callable[[], None]] = deque()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            self._queue.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="dualserve-compile", daemon=True)
                self._thread.start()

    @property
    def busy(self) -> bool:
        with self._lock:
            return self._thread is not None

    def _work(self) -> None:
        while True:
            with self._lock:
                job = self._queue.popleft() if self._queue else None
                if job is None:
                    self._thread = None
            if job is None:
                trim_heap()  # what tracing and code generation freed
                return
            job()


class CompiledStep:
    """Compiled forwards by step shape, built on a background thread; eager until each is ready.

    On the CPU each shape is an AOTInductor package (``aoti.py``): built once per host and model,
    loaded from the cache in a fraction of a second on later starts, and called without dynamo's
    guards. Elsewhere it is a ``torch.compile``'d graph."""

    def __init__(self, model: torch.nn.Module, cache: KVCache, scratch: Callable[[int], torch.Tensor],
                 cache_dir: Path | None = None, worker: CompileWorker | None = None):
        """``worker``: compile in the background on it (eager until ready); None: compile on first use."""
        if cache_dir is not None:
            # Inductor reads its cache location from the environment; set once, before any compile.
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir))
        self.model = model
        self.cache = cache
        self.scratch = scratch
        self.worker = worker
        self.device = cache.stacked.device
        self.packaged = aoti.available(self.device)
        self.package_dir = Path(cache_dir or default_cache_dir()) / "aoti"
        self._fns: dict[tuple[int, ...], Callable] = {}  # torch.compile: one forward per set of feature layers
        self._graphs: dict[tuple[StepShape, tuple[int, ...]], Callable[..., Sequence[torch.Tensor]]] = {}
        self.ready: set[tuple[StepShape, tuple[int, ...]]] = set()
        self.failed = False
        self.seconds: dict[str, float] = {}
        self.how: dict[str, str] = {}  # shape name -> built / loaded (a package) or compiled
        self.features: tuple[int, ...] = ()  # feature layers every step computes (set by prewarm)
        self._pending: set[tuple[StepShape, tuple[int, ...]]] = set()
        self._lock = threading.Lock()

    def fn(self, aux_layers: tuple[int, ...]) -> Callable:
        """The torch.compile'd forward that also returns these layers' features. The layer indices
        live on a module, where dynamo specialises ints: passed as arguments to a ``dynamic=True``
        function they would become symbolic, and one graph would serve every set of the same
        length, returning the first set's layers."""
        with self._lock:
            if aux_layers not in self._fns:
                self._fns[aux_layers] = torch.compile(ForwardWithFeatures(self.model, aux_layers), dynamic=True)
            return self._fns[aux_layers]

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata,
                 aux_layers: Sequence[int]) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """The compiled forward of this step, or None while its graph is not ready (run eager then)."""
        wanted = tuple(aux_layers)
        key = (StepShape.of(meta), wanted or self.features)
        graph = self._graphs.get(key)
        if graph is None:
            self._request(key)
            graph = self._graphs.get(key)
            if graph is None:
                return None
        attn = PaddedPagedAttention.build(self.cache, meta, ids.device)
        out = graph(ids, pos, attn.rows, attn.context, attn.mask, self.cache.stacked)
        self.cache.store(attn.slot_mapping, out[-2], out[-1])
        return out[0], list(out[1:-2]) if wanted else []

    def _request(self, key: tuple[StepShape, tuple[int, ...]]) -> None:
        with self._lock:
            if self.failed or key in self._pending:
                return
            self._pending.add(key)
        if self.worker is None:
            self._compile(key)
        else:
            self.worker.submit(lambda: self._compile(key))

    def prewarm(self, aux_layers: Sequence[int] = ()) -> None:
        """Ask for the four shapes now, decode first, so they compile while the server starts.

        ``aux_layers``: the variant that also returns those layers' features, for EAGLE. It then
        serves every step of this runner, features asked for or not: graphs that differ only in
        their outputs still fuse differently, and a prompt prefilled by ``ar`` through one graph
        and by ``eagle`` through another gets keys and values that differ in the last bits, which
        is enough to flip a near-tie and break greedy identity between the two decoders."""
        if aux_layers:
            self.features = tuple(aux_layers)
        for shape in (StepShape(False, False), StepShape(False, True), StepShape(True, False), StepShape(True, True)):
            self._request((shape, tuple(aux_layers)))

    def warm(self, keys: Sequence[tuple[StepShape, tuple[int, ...]]]) -> None:
        """Compile these shapes now, on the calling thread (start-up, tests)."""
        for key in keys:
            with self._lock:
                self._pending.add(key)
            self._compile(key)

    def _compile(self, key: tuple[StepShape, tuple[int, ...]]) -> None:
        shape, aux = key
        if not aux and self.features:  # steps without features run the feature variant (prewarm)
            with self._lock:
                self._pending.discard(key)
            return
        start = time.perf_counter()
        try:
            graph, how = self._package(key) if self.packaged else (self._torch_compile(key), "compiled")
        except Exception:  # noqa: BLE001 - any compiler failure leaves eager mode in charge
            log.warning("compiling the %s forward failed; staying eager", shape.name, exc_info=True)
            with self._lock:
                self.failed = True
            return
        self.seconds[shape.name] = time.perf_counter() - start
        self.how[shape.name] = how
        log.info("%s the %s forward in %.1f s", how, shape.name, self.seconds[shape.name])
        with self._lock:
            self._graphs[key] = graph
            self.ready.add(key)

    def _package(self, key: tuple[StepShape, tuple[int, ...]]) -> tuple[Callable[..., Sequence[torch.Tensor]], str]:
        """This shape's AOTInductor package: loaded from the cache, or built there first; used
        only once it matches the eager forward at two sizes."""
        shape, aux = key
        module = ForwardWithFeatures(self.model, aux)
        # The code the graph is traced from: the model's own modules, and the step's classes here.
        sources = [*sorted({inspect.getmodule(type(m)) for m in self.model.modules()
                            if type(m).__module__.startswith("dualserve.")}, key=lambda m: m.__name__),
                   PaddedPagedAttention, ForwardWithFeatures]
        digest = aoti.package_key(self.model, sources, self.cache.dtype, shape, aux, sorted(PACKAGE_INDUCTOR.items()))
        path = self.package_dir / f"step-{shape.name.replace('/', '-')}-{digest}.pt2"
        how = "loaded"
        if not path.exists():
            aoti.build(module, self._inputs(shape, 5), shape.dynamic_dims(), path, PACKAGE_INDUCTOR)
            how = "built"
        aoti.mark_used(path)
        graph = aoti.PackagedGraph(path, module)
        with torch.inference_mode():
            for n in (3, 6):
                inputs = self._inputs(shape, n)
                problem = aoti.matches(graph(*inputs), module(*inputs))
                if problem:
                    raise RuntimeError(f"the package {path.name} does not match the eager forward: {problem}")
        return graph, how

    def _torch_compile(self, key: tuple[StepShape, tuple[int, ...]]) -> Callable[..., Sequence[torch.Tensor]]:
        # Every CompiledStep traces the same ``forward`` code object, and dynamo caps the graphs
        # per code object (8 by default): four shapes for each runner (AR, twin), plus EAGLE's
        # auxiliary-feature variants, pass it, and a shape past the cap silently stays eager.
        # Dynamo's config is per thread: the cap is raised on the thread that compiles.
        shape, aux = key
        fn = self.fn(aux)
        with torch._dynamo.config.patch(recompile_limit=GRAPH_LIMIT), torch.inference_mode():
            for n in (3, 5):  # two sizes: the graph must be the dynamic one
                fn(*self._inputs(shape, n))
        return fn

    def _inputs(self, shape: StepShape, n: int) -> tuple[torch.Tensor, ...]:
        """The graph's inputs for a step of this shape over scratch slots only (compiling never
        touches live KV). Sequences differ in context and query length, so no size is tied to
        another by accident: a graph traced on them serves any step of its shape."""
        seqs_n = (2 if n < 6 else 3) if shape.many_seqs else 1
        queries = [max(2, n - i) if shape.many_queries else 1 for i in range(seqs_n)]
        seqs = [SeqAttention(n + i, q, [], "causal", self.scratch(n + i)) for i, q in enumerate(queries)]
        total = sum(queries)
        ids = torch.arange(total, device=self.device) % 7 + 3
        pos = torch.cat([torch.arange(q, device=self.device) + n + i for i, q in enumerate(queries)])
        meta = AttentionMetadata(seqs, self.scratch(total), self.cache.block_size)
        attn = PaddedPagedAttention.build(self.cache, meta, self.device)
        return ids, pos, attn.rows, attn.context, attn.mask, self.cache.stacked


# Inductor's settings for step graphs on the CPU. The graph's wrapper is C++ (always so in a
# package; under torch.compile, ``cpp_wrapper``): a decode step calls some 400 kernels, and their
# Python wrapper cost about 1.5 ms of a 12 ms step. Inductor's own kernels (norms, rotary,
# softmax: small at decode) run on one thread, so a step opens OpenMP parallel regions only in the
# GEMMs, as in eager mode: every region is a barrier, and a barrier is what costs when OpenMP
# cannot spin (see ``openmp``).
PACKAGE_INDUCTOR: dict[str, object] = {"cpp.threads": 1}
