"""The compiled step: one compiled forward per step shape, with paged attention inside the graph.

Eager PyTorch spends most of a batch-1 CPU forward in Python dispatch (about 35
small ops per layer). Compiled by inductor, a layer becomes a few fused C++
kernels around the weight-only GEMMs, and a forward costs about half as much.

Attention is in the graph in its padded form (``attention/padded.py``), and a step runs one of
two graphs, rows or chunks (``StepShape``); a step with both kinds of sequences runs each part
through its graph. The graph's module is ``step_graph.ForwardWithFeatures``. Shapes are dynamic,
and sizes of one are not specialised (``aoti_build.build`` exports size-obliviously), so the one
``rows`` graph serves one sequence or many, one query row or many: a decode row runs the very code
a verify row runs. W is padded to at least 2. On the CPU each graph is an AOTInductor package
(``aoti.py``), built once per host and model under the model cache (minutes on 2 cores) and
loaded in well under a second on later starts; elsewhere it is a ``torch.compile``'d graph,
and on CUDA a rows step replays a CUDA graph captured for its bucket of sizes (``cuda_graphs``).
Either way the work happens on a background thread (``compile_worker``): until a shape's graph
is ready, that shape runs eagerly, and every shape's build or load is logged with its place in
the queue ("graph 2 of 4") and its time; a build also logs its elapsed time while it runs.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch._inductor.runtime.cache_dir_utils import cache_dir as default_cache_dir

from dualserve.models import kernels
from ..attention.paged_attention import AttentionMetadata, KVCache, SeqAttention
from ..attention.padded import PaddedPagedAttention, StepShape, split
from . import aoti, aoti_build, cuda_shaped
from .compile_worker import CompileWorker
from .cuda_graphs import CudaGraphs
from .step_graph import PACKAGE_INDUCTOR, ForwardWithFeatures, bit_exact
from .tracing import size_oblivious

log = logging.getLogger("dualserve.compile")

GRAPH_LIMIT = 64  # compiled graphs per code object (dynamo's recompile_limit), see _compile


class CompiledStep:
    """Compiled forwards by step shape, built on a background thread; eager until each is ready.

    On the CPU each shape is an AOTInductor package (``aoti.py``): built once per host and model,
    loaded from the cache in a fraction of a second on later starts, and called without dynamo's
    guards. Elsewhere it is a ``torch.compile``'d graph."""

    def __init__(self, model: torch.nn.Module, cache: KVCache, scratch: Callable[[int], torch.Tensor],
                 cache_dir: Path | None = None, worker: CompileWorker | None = None, attend_kernel: bool = True):
        """``cache_dir``: the compile cache (packages under its ``aoti/``);
        ``worker``: compile in the background on it (eager until ready), None: compile on first use;
        ``attend_kernel``: see ``step_graph``'s note on the attention kernel."""
        self.model = model
        self.cache = cache
        self.scratch = scratch
        self.worker = worker
        self.attend_kernel = attend_kernel
        self.device = cache.stacked.device
        # The CUDA-shaped profile takes the torch.compile branch the CUDA path takes (``cuda_shaped``).
        self.packaged = aoti.available(self.device) and not cuda_shaped.active()
        self.cache_dir = cache_dir
        self.package_dir = Path(cache_dir or default_cache_dir()) / "aoti"
        if self.packaged:
            aoti_build.sweep(self.package_dir)  # what builds of killed processes left there
        self._fns: dict[tuple[bool, tuple[int, ...]], Callable] = {}  # torch.compile: one per form and feature set
        self._graphs: dict[tuple[StepShape, tuple[int, ...]], Callable[..., Sequence[torch.Tensor]]] = {}
        self.ready: set[tuple[StepShape, tuple[int, ...]]] = set()
        self.failed = False
        self.seconds: dict[str, float] = {}
        self.how: dict[str, str] = {}  # shape name -> built / loaded (a package) or compiled
        self.features: tuple[int, ...] = ()  # feature layers every step computes (set by prewarm)
        self._pending: set[tuple[StepShape, tuple[int, ...]]] = set()
        # Set when a shape's compile job has ended, whatever its outcome (``_package``'s ``after``).
        self._settled: dict[tuple[StepShape, tuple[int, ...]], threading.Event] = {}
        self._lock = threading.Lock()
        # Whether the two forms compute the same bits (every step by the project's ops alone), so
        # that one graph may run a step of both kinds of sequences (``__call__``).
        self.one_form = self.packaged and bit_exact(model, attend_kernel)
        # CUDA: each compiled rows forward's captured graphs (``cuda_graphs``), by the forward's id.
        self.cuda_graphs: dict[int, CudaGraphs] | None = {} if self.device.type == "cuda" else None

    def fn(self, shape: StepShape, aux_layers: tuple[int, ...]) -> Callable:
        """The torch.compile'd forward of this form that also returns these layers' features. The
        layer indices and the form live on a module, where dynamo specialises them: passed as
        arguments to a ``dynamic=True`` function the ints would become symbolic, and one graph
        would serve every set of the same length, returning the first set's layers."""
        key = (shape.chunks, aux_layers)
        with self._lock:
            if key not in self._fns:
                forward = ForwardWithFeatures(self.model, aux_layers, shape.chunks, self.attend_kernel)
                self._fns[key] = torch.compile(forward, dynamic=True,
                                               options={"emulate_precision_casts": True})  # see PACKAGE_INDUCTOR
            return self._fns[key]

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata,
                 aux_layers: Sequence[int]) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """The compiled forward of this step, or None while a graph it needs is not ready (run
        eager then). A step with both short and long sequences runs each part through its graph,
        or all of it through the chunks graph where both forms give the same bits (``one_form``)."""
        wanted = tuple(aux_layers)
        aux = wanted or self.features
        if self.one_form and StepShape.of(meta).chunks and (StepShape(True), aux) in self._graphs:
            # Both forms attend by the same kernel here, so a step of decodes beside a prompt chunk
            # is one pass over the weights through the chunks graph, not one per form.
            parts = [(StepShape(True), None, meta)]
        else:
            parts = split(meta)
        graphs = []
        for shape, _, _ in parts:
            graph = self._graphs.get((shape, aux))
            if graph is None:
                self._request((shape, aux))
                graph = self._graphs.get((shape, aux))
                if graph is None:
                    return None
            graphs.append(graph)
        if len(parts) == 1:
            out = self._run(graphs[0], parts[0][0], ids, pos, meta)
        else:
            out = None
            for graph, (shape, rows, part) in zip(graphs, parts):
                rows = rows.to(ids.device)
                got = self._run(graph, shape, ids[rows], pos[rows], part)
                if out is None:
                    out = [g.new_empty(ids.shape[0], *g.shape[1:]) for g in got]
                for o, g in zip(out, got):
                    o[rows] = g
        return out[0], list(out[1:]) if wanted else []

    def _run(self, graph: Callable[..., Sequence[torch.Tensor]], shape: StepShape, ids: torch.Tensor,
             pos: torch.Tensor, meta: AttentionMetadata) -> Sequence[torch.Tensor]:
        """One graph over ``meta``'s sequences: stores their new keys and values, returns the
        hidden states and the feature layers'. On CUDA a rows step replays its bucket's CUDA graph."""
        graphs = self.cuda_graphs.get(id(graph)) if self.cuda_graphs is not None else None
        if graphs is not None:
            replayed = graphs(ids, pos, meta)
            if replayed is not None:
                self.cache.store(replayed.slot_mapping, replayed.new_k, replayed.new_v)
                return replayed.outputs
        attn = PaddedPagedAttention.build(self.cache, meta, ids.device, shape.chunks)
        out = graph(ids, pos, attn.rows, attn.context, attn.mask, self.cache.stacked)
        self.cache.store(attn.slot_mapping, out[-2], out[-1])
        return out[:-2]

    def _request(self, key: tuple[StepShape, tuple[int, ...]]) -> None:
        with self._lock:
            # Steps without features run the feature variant once there is one (``prewarm``).
            if self.failed or key in self._pending or (not key[1] and self.features):
                return
            self._pending.add(key)
            self._settled[key] = threading.Event()
            rows = (StepShape(False), key[1])
            # A chunks graph asked for after its rows graph builds after it (``_package``'s ``after``).
            after = self._settled.get(rows) if key[0].chunks and rows in self._pending else None
        if self.worker is None:
            self._compile(key)
        else:
            self.worker.submit(lambda: self._compile(key, after), name="chunks" if key[0].chunks else "rows")

    def prewarm(self, aux_layers: Sequence[int] = ()) -> None:
        """Ask for both shapes now, rows (decode) first, so they compile while the server starts.

        ``aux_layers``: the variant that also returns those layers' features, for EAGLE. It then
        serves every step of this runner, features asked for or not: graphs that differ only in
        their outputs still fuse differently, and a prompt prefilled by ``ar`` through one graph
        and by ``eagle`` through another gets keys and values that differ in the last bits, which
        is enough to flip a near-tie and break greedy identity between the two decoders."""
        if aux_layers:
            self.features = tuple(aux_layers)
        for shape in (StepShape(False), StepShape(True)):
            self._request((shape, tuple(aux_layers)))

    def warm(self, keys: Sequence[tuple[StepShape, tuple[int, ...]]]) -> None:
        """Compile these shapes now, on the calling thread (start-up, tests)."""
        for key in keys:
            with self._lock:
                self._pending.add(key)
            self._compile(key)

    def _compile(self, key: tuple[StepShape, tuple[int, ...]], after: threading.Event | None = None) -> None:
        try:
            self._compile_now(key, after)
        finally:
            settled = self._settled.get(key)
            if settled is not None:
                settled.set()

    def _compile_now(self, key: tuple[StepShape, tuple[int, ...]], after: threading.Event | None) -> None:
        shape, aux = key
        if not aux and self.features:  # steps without features run the feature variant (prewarm)
            with self._lock:
                self._pending.discard(key)
            return
        start = time.perf_counter()
        where = self._where()
        try:
            graph, how = (self._package(key, where, after) if self.packaged
                          else (self._torch_compile(key), "compiled"))
        except aoti_build.BuildCancelled:  # the process is exiting
            return
        except Exception:  # noqa: BLE001 - any compiler failure leaves eager mode in charge
            log.warning("compiling the %s forward failed; staying eager", shape.name, exc_info=True)
            with self._lock:
                self.failed = True
            return
        self.seconds[shape.name] = time.perf_counter() - start
        self.how[shape.name] = how
        log.info("%s the %s forward in %.1f s%s", how, shape.name, self.seconds[shape.name], where)
        with self._lock:
            self._graphs[key] = graph
            self.ready.add(key)

    def _wait_for(self, job: threading.Event, name: str) -> None:
        """Wait until ``job`` has ended (``_package``: ``after``); none of the server's work waits on this."""
        job.wait()
        if self.worker is not None and self.worker.stopped:
            raise aoti_build.BuildCancelled(f"building the {name} forward was ended: the server is stopping")

    def _where(self) -> str:
        """The running job's place in the compile queue, for the log (" (graph 2 of 4)")."""
        if self.worker is None:
            return ""
        k, n = self.worker.position()
        return f" (graph {k} of {n})"

    def _package(self, key: tuple[StepShape, tuple[int, ...]], where: str = "",
                 after: threading.Event | None = None) -> tuple[Callable[..., Sequence[torch.Tensor]], str]:
        """This shape's AOTInductor package: loaded from the cache, or built there first; used
        only once it matches the eager forward at two sizes.

        ``after``: a build of this package first waits for it (the rows graph's compile job). A
        first start serves while it builds, and its two builds side by side shared what serving
        left of the cores: with requests arriving throughout, each took 86 s on a 2-core host where
        one alone takes 61, and decode ran eagerly until both were done. Built alone first, the rows
        graph (every decode step) is ready that much sooner; the chunks graph (prompts), whose
        eager step costs about what its compiled one does, and the EAGLE head follow side by side.
        A package in the cache loads at once, without waiting."""
        shape, aux = key
        module = ForwardWithFeatures(self.model, aux, shape.chunks, self.attend_kernel)
        # The code the graph is traced from: the model's own modules, and the step's classes here.
        sources = aoti.traced_sources(self.model, PaddedPagedAttention, ForwardWithFeatures)
        # A rows graph calls the attention kernel where it is built, and loading a package that calls
        # it needs the kernels' library loaded first (a model without dot8 layers has not loaded it).
        uses_kernel = self.attend_kernel and kernels.available()
        digest = aoti.package_key(self.model, sources, self.cache.dtype, shape, aux, sorted(PACKAGE_INDUCTOR.items()),
                                  uses_kernel, kernels.library_path().name if kernels.available() else None)
        path = self.package_dir / f"step-{shape.name.replace('/', '-')}-{digest}.pt2"
        # A model computed by the project's ops alone must match bit for bit (docs/numerics.md): a
        # package that does not would answer differently from the eager steps it replaces.
        tolerance = 0.0 if bit_exact(self.model, self.attend_kernel) else 0.2
        return aoti.load_or_build(
            module, path, lambda n: self._inputs(shape, n), shape.dynamic_dims(), PACKAGE_INDUCTOR, example=5,
            checks=(3, 6), tolerance=tolerance,
            announce=lambda: log.info("building the %s forward%s in a child process: once per host and model, "
                                      "minutes on a small CPU; its steps run eagerly until it is ready",
                                      shape.name, where),
            before_build=None if after is None else lambda: self._wait_for(after, shape.name),
            progress=lambda s: log.info("building the %s forward%s: %.0f s so far", shape.name, where, s))

    def _torch_compile(self, key: tuple[StepShape, tuple[int, ...]]) -> Callable[..., Sequence[torch.Tensor]]:
        # Every CompiledStep traces the same ``forward`` code object, and dynamo caps the graphs
        # per code object (8 by default): four shapes for each runner (AR, twin), plus EAGLE's
        # auxiliary-feature variants, pass it, and a shape past the cap silently stays eager.
        # Dynamo's config is per thread: the cap is raised on the thread that compiles.
        shape, aux = key
        fn = self.fn(shape, aux)
        with torch._dynamo.config.patch(recompile_limit=GRAPH_LIMIT), size_oblivious(), torch.inference_mode():
            for n in (3, 5):  # two sizes: the graph must be the dynamic one
                fn(*self._inputs(shape, n))
        if self.cuda_graphs is not None and not shape.chunks:
            lock = self.worker.device_lock if self.worker is not None else None
            self.cuda_graphs[id(fn)] = CudaGraphs(fn, self.cache, lock)
        return fn

    def _inputs(self, shape: StepShape, n: int) -> tuple[torch.Tensor, ...]:
        """The graph's inputs for a step of this shape over scratch slots only (compiling never
        touches live KV). Sequences differ in context and query length, so no size is tied to
        another by accident: a graph traced on them serves any step of its shape."""
        seqs_n = 2 if n < 6 else 3
        queries = [max(2, n - i) for i in range(seqs_n)]
        seqs = [SeqAttention(n + i, q, [], "causal", self.scratch(n + i)) for i, q in enumerate(queries)]
        total = sum(queries)
        ids = torch.arange(total, device=self.device) % 7 + 3
        pos = torch.cat([torch.arange(q, device=self.device) + n + i for i, q in enumerate(queries)])
        meta = AttentionMetadata(seqs, self.scratch(total), self.cache.block_size)
        attn = PaddedPagedAttention.build(self.cache, meta, self.device, shape.chunks)
        return ids, pos, attn.rows, attn.context, attn.mask, self.cache.stacked
