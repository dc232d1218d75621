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

and each layer attends in one of the two forms below; the graph returns every layer's
new keys/values, stored at ``slot_mapping`` after it runs (``KVCache.store``). No
Python runs per layer, so there is nothing to gather per sequence.

Attention takes one of two forms, and a step one of two graphs (``StepShape``):

  rows     every sequence brings at most ``ROWS_MAX`` new tokens (decode batches, EAGLE trees,
           diffusion canvases, short prompts). Each query position reduces over its [cached | new]
           keys in one pass, in position order, by the same generated loops whatever the step
           holds: a token's keys, values and hidden state are bit for bit the same whether it is
           decoded alone, verified in a tree, or computed beside other sequences. That is what
           keeps speculation lossless and batching invisible in greedy output.
  chunks   prefill chunks. Where the project's kernels build, attention is the same
           ``attend_rows`` as the rows form's, so a prompt's rows get the bits a decode would
           (docs/numerics.md); elsewhere two batched matmuls, whose cost grows with query rows
           times context far slower than inductor's loops' (a chunk of hundreds of rows).

A step with both kinds of sequences runs each part through its graph. Shapes are dynamic, and
sizes of one are not specialised (``aoti.build`` exports size-obliviously), so the one
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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import torch
from torch._inductor.runtime.cache_dir_utils import cache_dir as default_cache_dir

from dualserve.models import kernels
from dualserve.models.kernels import ops as kernel_ops
from . import aoti, cuda_shaped
from .compile_worker import CompileWorker
from ..attention.paged_attention import AttentionMetadata, KVCache, SeqAttention, as_stored, padded_rows

if TYPE_CHECKING:
    from .cuda_graphs import CudaGraphs

log = logging.getLogger("dualserve.compile")

GRAPH_LIMIT = 64  # compiled graphs per code object (dynamo's recompile_limit), see _compile
# New tokens per sequence up to which a step runs the rows form (see the module docstring): CPU
# verify trees (at most 21 tokens) and diffusion canvases. Above it the matmuls are cheaper (on
# the default model, 128 cached tokens: 16 rows cost 35.9 ms as rows and 29.7 ms as matmuls).
ROWS_MAX = 24
# The rows form's products (query rows x positions x heads x head_dim) that an eager run materialises
# at once; above it the sums run a few rows at a time (``PaddedPagedAttention._rows``). Graphs fuse
# them into loops and never materialise them.
EAGER_ROWS_ELEMENTS = 2**25
# Graph attention runs as the project's kernel (``models.kernels``: ``attend_rows``) where it is
# built, unless a step is made with ``attend_kernel=False`` (``CompileSpec.attend_kernel``, from
# DUALSERVE_ATTEND_KERNEL=0: inductor's loops, for comparison).


def bit_exact(model: torch.nn.Module, attend_kernel: bool = True) -> bool:
    """Whether every step of ``model`` runs the project's ops alone on the CPU (dot8 layers, the
    attention kernel, the pointwise ops), so an eager step and a compiled graph give the same bits."""
    from dualserve.models.quant import Dot8Linear

    linears = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, Dot8Linear))]
    return (attend_kernel and kernels.available() and bool(linears)
            and all(isinstance(m, Dot8Linear) for m in linears)
            and all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters()))


class PaddedPagedAttention:
    """Paged attention over a padded step; tensors only, so it traces into one graph."""

    def __init__(self, stacked: torch.Tensor, slot_mapping: torch.Tensor | None, rows: torch.Tensor,
                 context: torch.Tensor, mask: torch.Tensor, chunks: bool, attend_kernel: bool = True):
        self.chunks = chunks                       # the form: matmuls (prefill chunks) or rows
        self.attend_kernel = attend_kernel         # attend_rows where the kernels are built
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
    def build(cls, cache: KVCache, meta: AttentionMetadata, device, chunks: bool | None = None,
              sizes: "PaddedSizes | None" = None) -> "PaddedPagedAttention":
        """The padded form of ``meta``; ``chunks``: which attention form (default: the one
        ``StepShape.of`` picks for these sequences); ``sizes``: pad to these (S, Q, W, T), at
        least the step's own (a CUDA graph's bucket; the step's tokens then come first in T)."""
        padded = None if sizes is None else (sizes.sequences, sizes.queries, sizes.context, sizes.tokens)
        rows, context, mask = padded_rows(meta, range(len(meta.seqs)), padded)
        slots = meta.slot_mapping
        chunks = StepShape.of(meta).chunks if chunks is None else chunks
        return cls(cache.stacked, slots.to(device), rows.to(device), context.to(device), mask.to(device), chunks)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kc, vc = self.stacked[layer_idx], self.stacked[self.layers + layer_idx]  # (slots, kv_heads, head_dim)
        self.new_k.append(k.to(kc.dtype))
        self.new_v.append(v.to(vc.dtype))
        k, v = as_stored(k, kc), as_stored(v, vc)
        if self.attend_kernel and kernel_ops.attend_eligible(q):
            # the same sums as ``_rows`` (each row over its visible keys alone), vectorised in C++, in
            # both forms: a prompt's rows then get the bits an eager step or a decode would give them
            return kernel_ops.attend_rows(q, k, v, kc, vc, self.rows, self.context, self.mask, q.shape[-1] ** -0.5)
        S, Q = self.rows.shape
        T, heads, d = q.shape
        kv_heads = k.shape[1]
        pad = q.new_zeros(1, heads, d)
        qx = torch.cat([q, pad])[self.rows].view(S, Q, kv_heads, heads // kv_heads, d)  # (S, Q, kv, group, d)
        kx = torch.cat([k, pad[:, :kv_heads]])[self.rows]                                # (S, Q, kv, d)
        vx = torch.cat([v, pad[:, :kv_heads]])[self.rows]
        kg, vg = kc[self.context].to(q.dtype), vc[self.context].to(q.dtype)              # (S, W, kv, d)
        out = self._matmuls(qx, kx, vx, kg, vg) if self.chunks else self._rows(qx, kx, vx, kg, vg)
        return q.new_zeros(T + 1, heads, d).index_copy_(0, self.rows.reshape(-1), out.reshape(S * Q, heads, d))[:T]

    def _rows(self, qx: torch.Tensor, kx: torch.Tensor, vx: torch.Tensor, kg: torch.Tensor,
              vg: torch.Tensor) -> torch.Tensor:
        """Attention as reductions that inductor fuses into loops, each query position summing
        over its [cached | new] keys and values in one pass: scores over the head dim, softmax,
        output over the positions. The cached keys are read straight from the pool by slot.

        Where the cached part ends and the new part begins does not enter the sums, nor does any
        other row or sequence of the step, so a position's output is the same bits in a decode
        step, a verify tree or a batch. (Reduced in two parts, cached then new, a token decoded
        alone and the same token second in a verify differ in the last bits, enough to flip a
        near-tie.) On the default model a decode step costs the same as with a separate graph
        specialised to one query (7.4 ms at 128 cached tokens, 11.8 ms at 800, one thread of
        loops); the loops' cost grows with rows times context, so long prefill chunks take the
        matmuls."""
        ks, vs = torch.cat([kg, kx], 1), torch.cat([vg, vx], 1)                            # (S, W + Q, kv, d)
        if torch.compiler.is_compiling():
            return self._attend(qx, ks, vs, self.mask)
        S, Q, kv_heads, group, d = qx.shape
        per_row = ks.shape[1] * kv_heads * group * d  # the products' elements per query row
        if S * Q * per_row <= EAGER_ROWS_ELEMENTS:
            return self._attend(qx, ks, vs, self.mask)
        # Run eagerly (the EAGLE head off the CPU), the products below are materialised: a sequence
        # and a few query rows at a time keep them bounded. Every sum is over d or over positions
        # within one query row, so the pieces are the same bits as the whole.
        step = max(1, EAGER_ROWS_ELEMENTS // per_row)
        return torch.cat([torch.cat([self._attend(qx[s:s + 1, a:a + step], ks[s:s + 1], vs[s:s + 1],
                                                  self.mask[s:s + 1, a:a + step]) for a in range(0, Q, step)], 1)
                          for s in range(S)])

    @staticmethod
    def _attend(qx: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The rows form's sums: queries (S, Q, kv, group, d) over keys and values (S, W + Q, kv, d)
        where ``mask`` (S, Q, W + Q) lets them see."""
        scale = qx.shape[-1] ** -0.5
        scores = (qx[:, :, None] * ks[:, None, :, :, None, :]).sum(-1) * scale             # (S, Q, W + Q, kv, group)
        scores = scores.masked_fill(~mask[:, :, :, None, None], float("-inf"))
        probs = torch.softmax(scores, dim=2)
        return (probs[..., None] * vs[:, None, :, :, None, :]).sum(2)                      # (S, Q, kv, group, d)

    def _matmuls(self, qx: torch.Tensor, kx: torch.Tensor, vx: torch.Tensor, kg: torch.Tensor,
                 vg: torch.Tensor) -> torch.Tensor:
        """Prefill chunks: attention as two batched matmuls."""
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
class PaddedSizes:
    """The padded step's sizes: sequences S, query rows Q, cached slots W, token rows T."""

    sequences: int
    queries: int
    context: int
    tokens: int


@dataclass(frozen=True)
class StepShape:
    """Which graph a step (or a part of one) runs: ``rows`` or ``chunks`` (the module docstring)."""

    chunks: bool

    @classmethod
    def of(cls, meta: AttentionMetadata) -> "StepShape":
        return cls(any(s.query_len > ROWS_MAX for s in meta.seqs))

    @property
    def name(self) -> str:
        return "chunks" if self.chunks else "rows"

    def dynamic_dims(self) -> tuple[dict[int, object], ...]:
        """The dims of ``ForwardWithFeatures``' inputs that vary, for ``torch.export``: tokens T,
        sequences S, query rows Q, cached slots W and the pool's slots."""
        auto = torch.export.Dim.AUTO
        return {0: auto}, {0: auto}, {0: auto, 1: auto}, {0: auto, 1: auto}, {0: auto, 1: auto, 2: auto}, {1: auto}


def split(meta: AttentionMetadata) -> list[tuple[StepShape, torch.Tensor | None, AttentionMetadata]]:
    """The parts of a step by form: (shape, the part's token rows in the step or None for all of
    them, the part's metadata). One part unless the step holds both short and long sequences."""
    kinds = [s.query_len > ROWS_MAX for s in meta.seqs]
    if len(set(kinds)) == 1:
        return [(StepShape(kinds[0]), None, meta)]
    starts = [0]
    for s in meta.seqs:
        starts.append(starts[-1] + s.query_len)
    parts = []
    for chunks in (False, True):
        picked = [i for i, k in enumerate(kinds) if k == chunks]
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in picked])
        part = AttentionMetadata([meta.seqs[i] for i in picked], meta.slot_mapping[rows.to(meta.slot_mapping.device)],
                                 meta.block_size)
        parts.append((StepShape(chunks), rows, part))
    return parts


class ForwardWithFeatures(torch.nn.Module):
    """One step as a graph of tensors only: ``model``'s forward over a padded step, also returning
    the residual stream after the ``aux_layers``.

    Inputs: token ids (T,), positions (T,), and the padded attention's ``rows``, ``context``,
    ``mask`` and the KV pool's ``stacked`` view (see ``PaddedPagedAttention``). Outputs, flat:
    hidden (T, hidden), one (T, hidden) per feature layer, then the new keys and the new values
    (layers, T, kv_heads, head_dim) for the caller to store."""

    def __init__(self, model: torch.nn.Module, aux_layers: tuple[int, ...], chunks: bool = False,
                 attend_kernel: bool = True):
        super().__init__()
        self.model = model
        self.aux_layers = aux_layers
        self.chunks = chunks
        self.attend_kernel = attend_kernel

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor, context: torch.Tensor,
                mask: torch.Tensor, stacked: torch.Tensor) -> tuple[torch.Tensor, ...]:
        attn = PaddedPagedAttention(stacked, None, rows, context, mask, self.chunks, self.attend_kernel)
        hidden, aux = self.model(ids, pos, attn, aux_layers=self.aux_layers)
        return (hidden, *aux, torch.stack(attn.new_k), torch.stack(attn.new_v))


class CompiledStep:
    """Compiled forwards by step shape, built on a background thread; eager until each is ready.

    On the CPU each shape is an AOTInductor package (``aoti.py``): built once per host and model,
    loaded from the cache in a fraction of a second on later starts, and called without dynamo's
    guards. Elsewhere it is a ``torch.compile``'d graph."""

    def __init__(self, model: torch.nn.Module, cache: KVCache, scratch: Callable[[int], torch.Tensor],
                 cache_dir: Path | None = None, worker: CompileWorker | None = None, attend_kernel: bool = True):
        """``cache_dir``: the compile cache (packages under its ``aoti/``, and a build child's inductor
        cache unless TORCHINDUCTOR_CACHE_DIR names one; the command line sets that once at start-up);
        ``worker``: compile in the background on it (eager until ready), None: compile on first use;
        ``attend_kernel``: see ``ROWS_MAX``."""
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
            aoti.sweep(self.package_dir)  # what builds of killed processes left there
        self._fns: dict[tuple[bool, tuple[int, ...]], Callable] = {}  # torch.compile: one per form and feature set
        self._graphs: dict[tuple[StepShape, tuple[int, ...]], Callable[..., Sequence[torch.Tensor]]] = {}
        self.ready: set[tuple[StepShape, tuple[int, ...]]] = set()
        self.failed = False
        self.seconds: dict[str, float] = {}
        self.how: dict[str, str] = {}  # shape name -> built / loaded (a package) or compiled
        self.features: tuple[int, ...] = ()  # feature layers every step computes (set by prewarm)
        self._pending: set[tuple[StepShape, tuple[int, ...]]] = set()
        self._lock = threading.Lock()
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
        eager then). A step with both short and long sequences runs each part through its graph."""
        wanted = tuple(aux_layers)
        aux = wanted or self.features
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
        if self.worker is None:
            self._compile(key)
        else:
            self.worker.submit(lambda: self._compile(key), name="chunks" if key[0].chunks else "rows")

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

    def _compile(self, key: tuple[StepShape, tuple[int, ...]]) -> None:
        shape, aux = key
        if not aux and self.features:  # steps without features run the feature variant (prewarm)
            with self._lock:
                self._pending.discard(key)
            return
        start = time.perf_counter()
        where = self._where()
        try:
            graph, how = self._package(key, where) if self.packaged else (self._torch_compile(key), "compiled")
        except aoti.BuildCancelled:  # the process is exiting
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

    def _where(self) -> str:
        """The running job's place in the compile queue, for the log (" (graph 2 of 4)")."""
        if self.worker is None:
            return ""
        k, n = self.worker.position()
        return f" (graph {k} of {n})"

    def _package(self, key: tuple[StepShape, tuple[int, ...]],
                 where: str = "") -> tuple[Callable[..., Sequence[torch.Tensor]], str]:
        """This shape's AOTInductor package: loaded from the cache, or built there first; used
        only once it matches the eager forward at two sizes."""
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
            checks=(3, 6), tolerance=tolerance, inductor_cache=self.cache_dir,
            announce=lambda: log.info("building the %s forward%s in a child process: once per host and model, "
                                      "minutes on a small CPU; its steps run eagerly until it is ready",
                                      shape.name, where),
            progress=lambda s: log.info("building the %s forward%s: %.0f s so far", shape.name, where, s))

    def _torch_compile(self, key: tuple[StepShape, tuple[int, ...]]) -> Callable[..., Sequence[torch.Tensor]]:
        # Every CompiledStep traces the same ``forward`` code object, and dynamo caps the graphs
        # per code object (8 by default): four shapes for each runner (AR, twin), plus EAGLE's
        # auxiliary-feature variants, pass it, and a shape past the cap silently stays eager.
        # Dynamo's config is per thread: the cap is raised on the thread that compiles.
        shape, aux = key
        fn = self.fn(shape, aux)
        with torch._dynamo.config.patch(recompile_limit=GRAPH_LIMIT), aoti.size_oblivious(), torch.inference_mode():
            for n in (3, 5):  # two sizes: the graph must be the dynamic one
                fn(*self._inputs(shape, n))
        if self.cuda_graphs is not None and not shape.chunks:
            from .cuda_graphs import CudaGraphs  # CUDA only; it builds on this module's padded form

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


# Inductor's settings for step graphs on the CPU. The graph's wrapper is C++ (always so in a
# package; under torch.compile, ``cpp_wrapper``): a decode step calls some 400 kernels, and their
# Python wrapper cost about 1.5 ms of a 12 ms step. Inductor's own kernels (norms, rotary,
# softmax: small at decode) run on one thread, so a step opens OpenMP parallel regions only in the
# GEMMs, as in eager mode: every region is a barrier, and a barrier is what costs when OpenMP
# cannot spin (see ``openmp``).
#
# Casts round where the code says they do (``emulate_precision_casts``): by default inductor keeps a
# value in fp32 inside a fused kernel even where the code rounds it to bf16. A new token's key, which
# the pool stores in bf16, then entered its own step's attention unrounded but every later step's
# rounded, and a token verified in a tree (its parent's key new) differed from the same token
# decoded after its parent (the key cached): greedy EAGLE left AR's output at near-ties.
#
# The wrapper (the C++ that calls the kernels: some 77,000 lines for the default model, most of them
# checks of the weights' dtypes and strides) compiles at -O0: at inductor's -O1 it took 51 of a
# graph's 90 s of building on 2 cores, at -O0 19 s. The kernels themselves compile at -O3 either way.
PACKAGE_INDUCTOR: dict[str, object] = {"cpp.threads": 1, "emulate_precision_casts": True,
                                       "aot_inductor.compile_wrapper_opt_level": "O0"}
