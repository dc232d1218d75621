"""Loading what the settings name: the weight format (picked once per host), the model, its bundled
parts (EAGLE head, DFlash drafter, datastore, diffusion twin), and the deployment over them.

The CLI's commands and every tensor-parallel rank (``tensor_parallel.run_worker``) load through
``load_deployment``, so a rank builds exactly what rank 0 builds.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dualserve.models.hub import resolve_model

from .settings import ModelSpec, Settings

if TYPE_CHECKING:
    from dualserve.decoders.engine.engine import Engine
    from dualserve.decoders.engine.parallel import ParallelGroup
    from dualserve.models.formats import HostProbe

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def pick_dtype(name: str, device: str) -> torch.dtype:
    """fp32 on CPU (measured faster than bf16 for batch-1 GEMV here, see README); bf16 on GPU."""
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return DTYPES[name]


def bundled(choice: str, model_name: str, finder) -> Path | None:
    """Resolve --eagle / --twin / --datastore: a path, 'none', or 'auto' (the bundled artifact for this
    model, if any)."""
    if choice == "none":
        return None
    if choice == "auto":
        return finder(model_name)
    path = Path(choice).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    return path


def load_deployment(settings: Settings, parallel: ParallelGroup | None = None, engine: Engine | None = None):
    """Load the models ``settings.model`` names and build their deployment. Under tensor parallelism
    each rank loads onto its group's device (``tensor_parallel.init``: its own GPU). ``engine``: join
    that running engine and its block pool (a model loaded on first use)."""
    from dualserve.decoders.deployment import ServedSpec, build_deployment, kv_dtype_of, kv_models
    from dualserve.decoders.engine.attention.paged_attention import KVCache
    from dualserve.models.assets import default_datastore, default_eagle_head, default_twin
    from dualserve.models.loader import load_model, load_twin

    log = logging.getLogger("dualserve")
    spec = settings.model if parallel is None else dataclasses.replace(settings.model, device=str(parallel.device))
    if settings.threads:
        torch.set_num_threads(settings.threads)
    cache = spec.cache_dir
    if settings.compile is not None and settings.compile.cache_dir is not None:
        # Inductor reads its cache location once, when it first needs it (loading may already
        # do): set it before anything loads, unless the environment names one.
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(settings.compile.cache_dir))
    dtype = pick_dtype(spec.dtype, spec.device)
    name, path = resolve_model(spec.model, cache)
    name = spec.served_name if spec.name else name
    quantization, dtype, table = pick_format(spec, Path(path), cache, dtype)
    loaded = load_model(path, name=name, dtype=dtype, device=spec.device, cache_dir=cache,
                        quantization=quantization)
    log.info("loaded %s in %.2fs (weights: %s)", name, loaded.load_seconds, loaded.quantization)
    specs = [ServedSpec(name, loaded, pooling=spec.pooling)]
    if not loaded.config.is_diffusion:
        specs[0].eagle_head = "suffix" if spec.eagle == "suffix" else bundled(spec.eagle, name, default_eagle_head)
        if specs[0].eagle_head is not None:
            log.info("EAGLE head %s", specs[0].eagle_head)
        if spec.dflash != "none":
            specs[0].dflash = bundled(spec.dflash, name, lambda _: None)
            log.info("DFlash drafter %s (eagle's draft: \"block\")", specs[0].dflash)
        if specs[0].eagle_head is not None or specs[0].dflash is not None:  # eagle is served: suffix lookup's answers
            specs[0].datastore = bundled(spec.datastore, name, default_datastore)
        twin_path = bundled(spec.twin, name, default_twin)
        if twin_path is not None:
            specs[0].twin = load_twin(twin_path, name=name, base=loaded)
            log.info("loaded diffusion twin %s in %.2fs", twin_path, specs[0].twin.load_seconds)
    if spec.diffusion:
        dname, dpath = resolve_model(spec.diffusion, cache)
        diff = load_model(dpath, name=dname, dtype=dtype, device=spec.device, cache_dir=cache)
        log.info("loaded %s in %.2fs", dname, diff.load_seconds)
        specs.append(ServedSpec(dname, diff))
    pool = settings.pool
    dep = build_deployment(specs, settings.engine, pool, device=spec.device, compile=settings.compile,
                           parallel=parallel, format_table=table, engine=engine)
    if engine is None:
        blocks, loaded = dep.engine.config.num_blocks, kv_models(specs)
        per_block = pool.bytes_per_block or sum(KVCache.bytes_per_block_of_layers(
            m.config.kv_shapes, pool.block_size, kv_dtype_of(loaded[0])) for m in loaded)
        log.info("KV pool: %d blocks of %d tokens (%.2f GB)", blocks, pool.block_size, blocks * per_block / 2**30)
    return dep


def pick_format(model: ModelSpec, path: Path, cache: Path, dtype: torch.dtype, probe: HostProbe | None = None):
    """``model.quantization``, or with ``auto`` on a CPU, this host's format for the model: decided
    once per host and kept (``models.formats.decide``). Returns (quantization, dtype, the measured
    table or None). ``probe``: what the decision asks of the host (tests pass their own)."""
    from dualserve.models.families import read_config
    from dualserve.models.formats import HostProbe, decide, off_cpu_choice
    from dualserve.models.loader import is_twin_dir, prepare_source, stored_quantization

    probe = probe or HostProbe()
    if model.quantization != "auto" or is_twin_dir(path):
        if model.quantization != "auto" and model.device.startswith("cpu"):
            note_explicit(model.quantization, path, cache, probe)
        return model.quantization, dtype, None
    source = prepare_source(path, cache)
    raw = core_config(source)
    if raw is None:  # a network with its own layers: float weights only
        return "none", dtype, None
    stored = stored_quantization(source)
    if not model.device.startswith("cpu"):  # nothing timed off the CPU: a format the device runs
        return off_cpu_choice(stored, model.device), dtype, None
    if model.dtype != "auto":
        return stored, dtype, None
    decision = decide(read_config(raw), stored, cache / "host", probe)
    log_decision(decision, cache / "host")
    candidate = decision.choice.candidate
    return decision.choice.quantization, torch.bfloat16 if candidate == "bf16" else dtype, decision.table


def core_config(source: Path) -> dict | None:
    """The checkpoint's config.json where the transformer core runs it (the formats apply), else None."""
    import json

    from dualserve.models.families import of_hf

    raw = json.loads((source / "config.json").read_text())
    return raw if of_hf(raw).core else None


def log_decision(decision, where: Path) -> None:
    """The start-up lines of ``auto``'s format: the cost table, the format and how it was reached
    (recorded, decided now, or decided again, saying why: a changed host key's parts, or a CPU
    that now decides)."""
    from dualserve.models.formats import BASIS_TEXT

    log = logging.getLogger("dualserve")
    table, choice, previous = decision.table, decision.choice, decision.previous
    log.info("forward GEMM cost on this host (ms, 1 token / 8 tokens): %s",
             ", ".join(f"{f} {a:.1f}/{b:.1f}" for f, a, b in table.as_rows()))
    if not table.quiet:
        log.info("the cost table was measured while other processes used %.1f cores: not cached (a later "
                 "quiet start measures it again for the router's costs, and keeps the format)", table.neighbour_cores)
    how = BASIS_TEXT[choice.basis]
    if decision.recorded:
        log.info("weight format %s: this host's recorded choice (from %s)", choice.candidate, how)
    elif previous is None:
        log.info("weight format %s, from %s: recorded in %s, and kept by later starts", choice.candidate, how,
                 where / "format-choices.json")
    elif previous.candidate != choice.candidate:
        log.warning("weight format changed from %s to %s (from %s): %s",
                    previous.candidate, choice.candidate, how, decision.why)
    else:
        log.info("weight format %s kept: %s and %s chose it again", choice.candidate, decision.why, how)


def note_explicit(quantization: str, path: Path, cache: Path, probe) -> None:
    """Log an explicit ``--quantization`` that differs from this host's recorded ``auto`` choice
    (the record stays)."""
    from dualserve.models.families import read_config
    from dualserve.models.formats import recorded_choice
    from dualserve.models.loader import prepare_source, stored_quantization

    source = prepare_source(path, cache)
    raw = core_config(source)
    if raw is None:
        return
    choice = recorded_choice(read_config(raw), stored_quantization(source), cache / "host", probe.key)
    if choice is not None and choice.quantization != quantization:
        logging.getLogger("dualserve").info("weight format %s (--quantization %s), not this host's recorded "
                                            "auto choice %s", quantization, quantization, choice.candidate)
