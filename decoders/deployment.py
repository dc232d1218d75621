"""Assemble a deployment: loaded models + one block pool + the decoders each model serves.

This is the single place that decides sizes at start-up, how many KV blocks
the pool has (from a block count or a memory budget), and which decoders are
registered under which served name:

  * an AR model serves ``ar``, plus ``eagle`` when it has a draft head (or is asked to
    draft from suffix lookup alone), plus ``diffusion`` when it has a diffusion twin
    (an adapter on its weights); ``eagle`` sizes its drafts from a verify cost curve
    seeded by the start-up format measurement, when there is one;
  * a diffusion-family model serves ``diffusion`` under its own name, through the
    decoder its family row names (``families.Family.decoders``: a masked canvas, or an
    encoder-denoiser's canvas of random tokens).

Which decoders a model gets and whether its runner compiles are its family row's
answers; this module names no family.

Every model's KV tensors are indexed by the same block ids, so there is no
static split of memory between decoders or models.

Several deployments share one engine (a server holding a completion model and a chat
model): the first one built sizes the pool, once, from the block count or the memory
budget over the models that may be loaded together (``PoolSpec.bytes_per_block``, which
the server computes from every configured model's shape); a deployment built later with
``engine=`` joins that engine, its runners sized for the same block ids, and
``unload_deployment`` takes it out again (decoders, prefix-cache entries, then its KV
tensors and weights once nothing holds them).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

import torch

from dualserve.models.families import DecoderKind, family
from dualserve.models.errors import InputError
from dualserve.models.formats import FormatTable
from dualserve.models.loader import LoadedModel
from dualserve.models.pooling import Pooling

from .ar import ARDecoder
from .diffusion.decoder import register_diffusion
from .diffusion.gemma import register_diffusion_gemma as register_canvas
from .pooling import register_pooling
from .engine.compile.compile_worker import CompileWorker
from .engine import kv_budget
from .engine.engine import Engine, EngineConfig
from dualserve.models.heap import trim_heap
from .engine.attention.paged_attention import KVCache
from .engine.parallel import ParallelGroup, TensorParallelRunner
from .engine.runner import ModelRunner

log = logging.getLogger("dualserve")


@dataclass(frozen=True)
class CompileSpec:
    """Run every model runner through compiled graphs (``engine/compile/compiled.py``)."""

    cache_dir: Path | None = None      # inductor's caches, kept under the model cache
    background: bool = True            # eager until each step shape's graph is ready
    attend_kernel: bool = True         # graph attention as the project's kernel where it is built
    # One compile thread for every runner; a copy sent to another process is a fresh one there.
    worker: CompileWorker = field(default_factory=CompileWorker, compare=False)

    def apply(self, runner: ModelRunner, prewarm: bool = True) -> None:
        runner.compile(self.cache_dir, self.worker if self.background else None, self.attend_kernel)
        if prewarm:
            self.prewarm(runner)

    def prewarm(self, runner: ModelRunner) -> None:
        """Queue the runner's graphs (background only). For a runner that serves EAGLE, call it
        after the head has named its feature layers (``CompiledStep.prewarm``), or the plain graph
        is built first and never used."""
        if self.background and runner.compiled is not None:
            runner.compiled.prewarm()


@dataclass(frozen=True)
class PoolSpec:
    block_size: int = 16
    num_blocks: int | None = None      # explicit count wins
    # else: this much memory for KV, split over all loaded models; None: the device's rule
    # (``engine/kv_budget.py``: a share of host memory on a CPU, of free device memory on CUDA)
    memory_gb: float | None = None
    # The KV bytes of one block over every model that may share the pool at once, when models
    # beyond the first deployment's will join it (a server with several models); None: the first
    # deployment's own models.
    bytes_per_block: int | None = None


@dataclass
class ServedSpec:
    """What one served model name offers."""

    name: str
    base: LoadedModel                  # an AR model, or a diffusion-family model
    # EAGLE draft head directory for an AR base; "suffix": serve ``eagle`` from suffix drafts alone
    eagle_head: Path | Literal["suffix"] | None = None
    # A DFlash drafter directory: a second model draft source of ``eagle`` (``draft: "block"``)
    dflash: Path | None = None
    twin: LoadedModel | None = None    # diffusion twin of an AR base, served as its "diffusion" decoder
    # Answers for ``eagle``'s suffix drafts (``eagle.datastore``): a file or a directory of distilled shards
    datastore: Path | None = None
    pooling: Pooling | None = None     # how embeddings pool, overriding what the checkpoint declares


@dataclass
class Deployment:
    engine: Engine
    models: dict[str, LoadedModel]
    runners: dict[str, ModelRunner] = field(default_factory=dict)
    format_table: FormatTable | None = None  # measured at start-up by --quantization auto, if it ran
    parallel: ParallelGroup | None = None    # the tensor-parallel group, when there is one
    compile: CompileSpec | None = None       # how its runners compile, when they do
    # The engine's model keys its registration added (its served names, and any other key a
    # decoder registers under, such as pooling's): what ``unload_deployment`` takes out again.
    engine_models: list[str] = field(default_factory=list)

    def decoders(self, name: str) -> list[str]:
        return self.engine.decoders_for(name)


def kv_models(specs: list[ServedSpec]) -> list[LoadedModel]:
    out = []
    for s in specs:
        out.append(s.base)
        if s.twin is not None:
            out.append(s.twin)
    return out


def kv_dtype_of(model: LoadedModel) -> torch.dtype:
    """Quantized models keep keys and values in bf16, the precision their GEMMs already take inputs
    in, which halves the pool's memory; float models keep their own dtype."""
    return torch.bfloat16 if model.quantization != "none" else next(model.model.parameters()).dtype


def blocks_for(models: list[LoadedModel], spec: PoolSpec, kv_dtype: torch.dtype, device: str) -> int:
    """The pool's blocks: as given, else its memory (``kv_budget``: on CUDA measured now, after the
    weights are on the device) over the KV bytes of one block of every model that shares it."""
    if spec.num_blocks:
        return spec.num_blocks
    per_block = spec.bytes_per_block or sum(
        KVCache.bytes_per_block_of_layers(m.config.kv_shapes, spec.block_size, kv_dtype) for m in models)
    return kv_budget.pool_blocks(kv_budget.pool_bytes(device, spec.memory_gb), per_block)


def runner_for(model: LoadedModel, num_blocks: int, block_size: int, device: str,
               parallel: ParallelGroup | None) -> ModelRunner:
    """Rank 0 of a tensor-parallel group broadcasts each call (``engine/parallel.py``); other ranks
    and single-process servers run a plain runner."""
    if parallel is not None and parallel.shard.rank == 0:
        return TensorParallelRunner(model.model, num_blocks, block_size, kv_dtype=kv_dtype_of(model), device=device,
                                    group=parallel)
    return ModelRunner(model.model, num_blocks, block_size, kv_dtype=kv_dtype_of(model), device=device)


@dataclass(frozen=True)
class Site:
    """Where one served model's decoders are registered: the engine, its pool's geometry, the
    device, and what every runner shares (the compile spec, the tensor-parallel group)."""

    engine: Engine
    num_blocks: int
    block_size: int
    device: str
    runners: dict[str, ModelRunner]    # the deployment's, filled as runners are made
    compile: CompileSpec | None = None
    parallel: ParallelGroup | None = None
    format_table: FormatTable | None = None

    def runner(self, key: str, model: LoadedModel) -> ModelRunner:
        self.runners[key] = runner_for(model, self.num_blocks, self.block_size, self.device, self.parallel)
        return self.runners[key]


def register(engine: Engine, spec: ServedSpec, num_blocks: int, block_size: int, device: str,
             runners: dict[str, ModelRunner], compile: CompileSpec | None = None,
             parallel: ParallelGroup | None = None, format_table: FormatTable | None = None) -> None:
    """Register ``spec``'s decoders on ``engine``: the ones its family row names, over one runner
    (compiled when the row says its steps compile)."""
    row = family(spec.base.config.family)
    site = Site(engine, num_blocks, block_size, device, runners, compile if row.compiles else None, parallel,
                format_table)
    runner = site.runner(spec.name, spec.base)
    if site.compile is not None:
        site.compile.apply(runner, prewarm=False)  # queued once the EAGLE head (if any) has named its feature layers
    for kind in row.decoders:
        DECODERS[kind](site, spec, runner)


def register_ar(site: Site, spec: ServedSpec, runner: ModelRunner) -> None:
    """``ar``, with what the spec adds to it: ``eagle`` (a draft head, DFlash drafter or suffix
    drafts), embeddings and rerank, and ``diffusion`` from a twin."""
    engine, base, compile = site.engine, spec.base, site.compile
    engine.add_decoder(spec.name, ARDecoder(runner, engine.pool), base.tokenizer, base.config.vocab_size)
    # Embeddings and rerank, never routed for generation.
    register_pooling(engine, spec.name, runner, base, spec.pooling)
    if spec.eagle_head is not None or spec.dflash is not None:
        register_eagle(engine, spec, runner, site.device, compile, site.parallel, site.format_table)
    if compile is not None:
        compile.prewarm(runner)
    if spec.twin is not None:
        twin_runner = site.runner(f"{spec.name}:diffusion", spec.twin)
        if compile is not None:
            # Built on first use of ``diffusion``, not at start: the target's graphs and the EAGLE
            # head are what a first start waits for, and two more builds would hold a core for
            # another two minutes (docs/compiled-step.md). Until they are built, diffusion runs eager.
            compile.apply(twin_runner, prewarm=False)
        register_diffusion(engine, spec.name, twin_runner, spec.twin)


def register_masked_diffusion(site: Site, spec: ServedSpec, runner: ModelRunner) -> None:
    """``diffusion`` over a [MASK] canvas (``diffusion/decoder.py``)."""
    if site.compile is not None:
        site.compile.prewarm(runner)
    register_diffusion(site.engine, spec.name, runner, spec.base)


def register_uniform_diffusion(site: Site, spec: ServedSpec, runner: ModelRunner) -> None:
    """``diffusion`` over a canvas of random tokens, by an encoder-denoiser network (``diffusion/gemma.py``)."""
    register_canvas(site.engine, spec.name, runner, spec.base)


# The decoders a family row may name (``families.DecoderKind``), and how each is registered.
DECODERS: dict[DecoderKind, Callable[[Site, ServedSpec, ModelRunner], None]] = {
    "ar": register_ar,
    "masked_diffusion": register_masked_diffusion,
    "uniform_diffusion": register_uniform_diffusion,
}


def register_eagle(engine: Engine, spec: ServedSpec, runner: ModelRunner, device: str, compile: CompileSpec | None,
                   parallel: ParallelGroup | None, format_table: FormatTable | None) -> None:
    from dualserve.models.dflash import DFlashDrafter, is_dflash, load_dflash
    from dualserve.models.eagle import load_eagle_head
    from dualserve.models.quant import quantize_linears

    from .eagle.budget import CostCurve
    from .eagle.datastore import Datastore
    from .eagle.decoder import EagleDecoder

    base = spec.base
    # Under tensor parallelism the models draft on rank 0 with the unsharded embedding and head.
    target = parallel.head_views.get(id(base.model), base.model) if parallel is not None else base.model
    # --eagle DIR names an EAGLE head or a DFlash drafter; --dflash DIR a drafter beside it.
    paths = [p for p in (spec.eagle_head, spec.dflash) if isinstance(p, Path)]
    drafters = [p for p in paths if p is spec.dflash or is_dflash(p)]
    if len(drafters) > 1:
        raise ValueError("eagle takes one EAGLE head and one DFlash drafter at most")
    head = next((load_eagle_head(p, target, device=device) for p in paths if p not in drafters), None)
    block = load_dflash(drafters[0], target, device=device) if drafters else None
    # Draft models beside a quantized target run in its kernel family, with 8-bit weights under dot8:
    # drafting then streams a quarter of the float bytes, and the bundled head's acceptance is unchanged.
    # A draft needs no more than one activation digit (w4a8): the target's verify decides every token.
    fmt = "w4a8" if base.quantization == "w4a16" else base.quantization
    for model in (head, block):
        if model is not None:
            quantize_linears(model, fmt, bits=8)
        if isinstance(model, DFlashDrafter):  # its output rows are the target's, borrowed, not a layer of its own
            model.serve_in(fmt, bits=8)
    datastore = None
    if spec.datastore is not None and (parallel is None or parallel.shard.rank == 0):  # only rank 0 drafts
        started = time.perf_counter()
        datastore = Datastore.load(spec.datastore)
        if len(datastore) and int(datastore.tokens.max()) >= base.config.vocab_size:
            raise InputError(f"{spec.datastore}: holds token id {int(datastore.tokens.max())}, past {spec.name}'s "
                             f"vocabulary ({base.config.vocab_size}): answers of another model?")
        log.info("datastore %s: %d answers, %d tokens, indexed in %.2fs", spec.datastore, datastore.answers,
                 len(datastore), time.perf_counter() - started)
    decoder = EagleDecoder(runner, engine.pool, head, cost=verify_cost(base, device, format_table), block=block,
                           datastore=datastore)
    if compile is not None and compile.background and runner.compiled is not None and decoder.aux_layers:
        runner.compiled.prewarm(decoder.aux_layers)
    if compile is not None and compile.background:
        decoder.prewarm()  # the head's graph, queued after the target's
    engine.add_decoder(spec.name, decoder, base.tokenizer, base.config.vocab_size)


def verify_cost(model: LoadedModel, device: str, table: FormatTable | None) -> "CostCurve":
    """The prior of the verify cost curve: the measured 1- and 8-token costs of the model's format,
    else flat on a GPU and twice the one-token cost at 8 tokens on a CPU (``eagle.decoder``'s note)."""
    from .eagle.budget import CostCurve

    if device.startswith("cuda"):
        return CostCurve.flat()
    fmt = model.quantization if model.quantization != "none" else (
        "bf16" if next(model.model.parameters()).dtype == torch.bfloat16 else "fp32")
    if table is not None and fmt in table.ms:
        return CostCurve(table.ms[fmt]["1"] / 1e3, table.ms[fmt]["8"] / 1e3)
    return CostCurve()


def build_deployment(models: list[LoadedModel] | list[ServedSpec], engine_config: EngineConfig | None = None,
                     pool: PoolSpec = PoolSpec(), device: str = "cpu",
                     compile: CompileSpec | None = None, parallel: ParallelGroup | None = None,
                     format_table: FormatTable | None = None, engine: Engine | None = None) -> Deployment:
    """One pool for all models; each served name gets the decoders its parts allow. With ``parallel``,
    every rank builds the same deployment over its shard of the weights; rank 0's sizes win.
    ``format_table``: the start-up format measurement, if it ran. ``engine``: join a running
    engine and its pool (a model loaded on first use) instead of building them."""
    specs = [m if isinstance(m, ServedSpec) else ServedSpec(m.name, m) for m in models]
    if engine is not None:
        if parallel is not None:
            raise ValueError("a tensor-parallel deployment cannot join another one's engine")
        return join_deployment(engine, specs, device, compile, format_table)
    loaded = kv_models(specs)
    kv_dtype = kv_dtype_of(loaded[0])
    if parallel is not None:
        compile = None  # collectives are not traced into compiled graphs: tensor-parallel steps run eagerly
        parallel.shard_models([m.model for m in loaded],
                              keep_head_for=[s.base.model for s in specs
                                             if isinstance(s.eagle_head, Path) or s.dflash is not None])
    num_blocks = blocks_for(loaded, pool, kv_dtype, device)  # after sharding: a rank measures its own shard
    if parallel is not None:
        num_blocks = parallel.agree(num_blocks)
    cfg = engine_config or EngineConfig()
    cfg = dataclasses.replace(cfg, num_blocks=num_blocks, block_size=pool.block_size)
    engine = Engine(cfg)
    dep = Deployment(engine=engine, models={s.name: s.base for s in specs}, format_table=format_table,
                     parallel=parallel, compile=compile)
    before = set(engine.decoders)
    for spec in specs:
        register(engine, spec, num_blocks, pool.block_size, device, dep.runners, compile, parallel, format_table)
    dep.engine_models = added_models(engine, before)
    if parallel is not None and parallel.shard.rank == 0:
        parallel.start()
    trim_heap()  # loading's temporaries: about 180 MB on the default model
    return dep


def join_deployment(engine: Engine, specs: list[ServedSpec], device: str, compile: CompileSpec | None,
                    format_table: FormatTable | None) -> Deployment:
    """Register ``specs`` on a running engine: their runners hold KV tensors for the pool's block
    ids (the pool's size was decided once, by the first deployment), and their decoders join
    through ``Engine.add_decoder``, which is safe beside the engine thread."""
    taken = [s.name for s in specs if engine.decoders_for(s.name)]
    if taken:
        raise ValueError(f"the engine already serves {', '.join(taken)}")
    dep = Deployment(engine=engine, models={s.name: s.base for s in specs}, format_table=format_table,
                     compile=compile)
    before = set(engine.decoders)
    for spec in specs:
        register(engine, spec, engine.pool.num_blocks, engine.pool.block_size, device, dep.runners, compile,
                 None, format_table)
    dep.engine_models = added_models(engine, before)
    trim_heap()
    return dep


def added_models(engine: Engine, before: set[tuple[str, str]]) -> list[str]:
    """The engine's model keys of the decoders registered since ``before``."""
    return list(dict.fromkeys(key[0] for key in engine.decoders if key not in before))


def deployment_bytes(dep: Deployment) -> int:
    """The memory a deployment holds: its weights (a tensor shared by two models, such as a twin's
    base weights, counted once) and its runners' KV tensors."""
    seen: dict[tuple[int, str], int] = {}
    tensors = [t for m in dep.models.values() for t in (*m.model.parameters(), *m.model.buffers())]
    for runner in dep.runners.values():
        tensors += [*runner.kv.k, *runner.kv.v]
    for t in tensors:
        seen[(t.data_ptr(), str(t.device))] = max(seen.get((t.data_ptr(), str(t.device)), 0),
                                                  t.numel() * t.element_size())
    return sum(seen.values())


def unload_deployment(dep: Deployment) -> None:
    """Take a joined deployment's models out of its engine (their requests have ended: the caller
    unloads only idle models), then let its weights and KV tensors go: the engine drops its
    decoders and prefix-cache entries, and this drops the deployment's own references."""
    import gc

    for name in dep.engine_models or list(dep.models):
        dep.engine.remove_model(name)
    dep.models.clear()
    dep.runners.clear()
    gc.collect()  # decoders and runners refer to each other: free the cycle now, not at some later collection
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    trim_heap()
