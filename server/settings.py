"""The configuration of one ``dualserve`` process: frozen objects, built once from the command line.

``cli`` parses the flags; ``Settings.from_args`` turns them into one frozen object per component,
here and nowhere else, and everything below receives its own object:

  model     ModelSpec          which models to load and how (--model, --eagle, --twin, --dtype, ...): the first one
  catalog   Catalog            every model served (each --model, --models-dir, --models-preset), and the
                               loaded-models budget (``server/model_manager.py``)
  engine    EngineConfig       the scheduler's bounds (``decoders/engine/engine.py``)
  pool      PoolSpec           the KV block pool's size (``decoders/deployment.py``)
  compile   CompileSpec        compiled steps (``decoders/deployment.py``); None with --no-compile
  parallel  ParallelSpec       tensor parallelism (``server/tensor_parallel.py``)
  server    ServerSettings     HTTP, limits and routing (``serve`` only)
  generate  GenerateSettings   the prompt and its sampling (``generate`` only)

The environment is read here as well, for its documented knobs alone: ``DUALSERVE_CACHE`` (the
model cache, through ``models.hub.default_cache_dir``), ``DUALSERVE_ATTEND_KERNEL=0`` (compiled
steps keep inductor's attention loops, for comparison), ``DUALSERVE_CUDA_SHAPED=1`` (tests: the
CPU makes the CUDA path's choices, ``decoders/engine/compile/cuda_shaped.py``; the CLI applies it, once,
before any model loads) and torchrun's ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``. Nothing under
``decoders/`` or ``server/`` reads it elsewhere.

The flags' value types (``positive``, ``count``, ``port_number`` ...) are here too: a value out of
its range is refused by argparse in one line, before anything loads.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Mapping

from dualserve.decoders.deployment import CompileSpec, PoolSpec
from dualserve.decoders.engine.compile.compile_worker import CompileWorker, cpu_workers
from dualserve.decoders.engine.engine import EngineConfig
from dualserve.models.formats import check_device
from dualserve.models.errors import InputError
from dualserve.models.hub import ALIASES, DEFAULT_MODEL_NAME, default_cache_dir


@dataclass(frozen=True)
class ModelSpec:
    """Which models one served model loads, and how (the flags of ``cli.add_model_args``)."""

    cache_dir: Path                    # the model cache: --cache-dir, else $DUALSERVE_CACHE, else ~/.cache/dualserve
    model: str | None = None           # the AR model (None: the embedded default)
    name: str | None = None            # the name it is served under (None: the file's or directory's, ``served_name``)
    eagle: str = "auto"                # a draft head directory, "auto" (bundled), "suffix" or "none"
    dflash: str = "none"               # a DFlash drafter directory, or "none"
    twin: str = "auto"                 # a diffusion twin directory, "auto" (bundled) or "none"
    datastore: str = "auto"            # answers for eagle's suffix drafts: a file or directory, "auto" or "none"
    diffusion: str | None = None       # a diffusion model served beside the AR model
    dtype: str = "auto"                # a name of ``cli.DTYPES``, or "auto" (by device)
    device: str = "cpu"                # a rank's own device is its group's (``cli.load_deployment``)
    quantization: str = "auto"         # a weight format of ``models.quant.QUANTIZATIONS``, or "auto"
    pooling: str | None = None         # --pooling: how embeddings pool (None: as the checkpoint declares)


    @property
    def served_name(self) -> str:
        return self.name or served_name(self.model)


@dataclass(frozen=True)
class Catalog:
    """Every model one server serves, by name, and how many may be in memory at once: a model not
    loaded loads on first use, and the least recently used idle one unloads to stay within
    ``max_loaded`` models and ``memory_gb`` of weights and KV tensors (``server/model_manager.py``)."""

    specs: tuple[ModelSpec, ...]       # the first one is the default model, named by requests without one
    preload: tuple[str, ...] = ()      # loaded at start (the first preloaded one sizes the KV pool)
    max_loaded: int | None = None      # --max-loaded-models (None: no bound)
    memory_gb: float | None = None     # --models-memory (None: no bound)

    @property
    def names(self) -> list[str]:
        return [s.served_name for s in self.specs]

    def spec(self, name: str) -> ModelSpec:
        return next(s for s in self.specs if s.served_name == name)


@dataclass(frozen=True)
class ParallelSpec:
    """Tensor parallelism: how many ranks, how they combine, and how a fault is noticed."""

    size: int = 1
    reduction: Literal["exact", "sum"] = "exact"
    timeout: float = 60.0              # seconds a collective may wait before its rank is failed
    heartbeat: float = 5.0             # idle seconds between liveness checks
    launched: tuple[int, int] | None = None  # (rank, world size) when torchrun started this process
    local_rank: int | None = None      # torchrun's LOCAL_RANK: the GPU of this rank on its node

    @classmethod
    def from_env(cls, env: Mapping[str, str], **flags) -> "ParallelSpec":
        """The flags, with what an ``env://`` launcher (torchrun) says of this process."""
        launched = (int(env["RANK"]), int(env["WORLD_SIZE"])) if "RANK" in env and "WORLD_SIZE" in env else None
        local = int(env["LOCAL_RANK"]) if "LOCAL_RANK" in env else None
        return cls(launched=launched, local_rank=local, **flags)


@dataclass(frozen=True)
class ServerSettings:
    """``dualserve serve``: where it listens, what it allows, how it routes and reports."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_model_len: int = 8192
    request_timeout: float = 600.0
    shutdown_timeout: float = 30.0
    # Idle keep-alive connections are closed after this many seconds: longer than clients keep them
    # pooled (httpx, which the openai SDK uses, 5 s; aiohttp 15 s; proxies often 60 s), or a request
    # sent on a connection as the server closes it fails (uvicorn's own default is 5 s).
    timeout_keep_alive: float = 75.0
    log_level: str = "warning"
    api_key: str | None = None
    node_cost_per_hour: float = 0.0
    max_body_mb: float = 8.0
    response_store_size: int | None = None
    response_store_mb: float | None = None
    router_policy: str | None = None   # a JSON file of routing policy overrides
    calibrate_router: bool = False


@dataclass(frozen=True)
class GenerateSettings:
    """``dualserve generate``: one prompt, decoded locally."""

    prompt: str
    max_tokens: int = 64
    temperature: float = 0.0
    seed: int | None = None
    decoder: str = "ar"
    chat: bool = False


@dataclass(frozen=True)
class Settings:
    """Everything one ``serve`` or ``generate`` process is configured with (the module docstring)."""

    command: Literal["serve", "generate"]
    model: ModelSpec                   # the first model of ``catalog``: the one ``generate`` and most tools load
    engine: EngineConfig
    pool: PoolSpec
    compile: CompileSpec | None
    parallel: ParallelSpec = ParallelSpec()
    threads: int | None = None         # torch's CPU threads (None: all cores, shared out between ranks)
    server: ServerSettings | None = None
    generate: GenerateSettings | None = None
    catalog: Catalog | None = None     # every served model; None: ``model`` alone
    cuda_shaped: bool = False          # DUALSERVE_CUDA_SHAPED=1 (tests): the CLI applies it before any model loads

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str] | None = None) -> "Settings":
        """The settings of a parsed ``serve`` or ``generate`` command line; ``env``: the process's
        environment unless given (tests)."""
        env = os.environ if env is None else env
        cache = default_cache_dir(args.cache_dir)
        catalog = catalog_of(args, cache)
        for spec in catalog.specs:  # a format with no kernel on the device: one line now, not a failed first forward
            check_device(spec.quantization, spec.device)
        model = catalog.specs[0]
        engine = EngineConfig(max_num_seqs=args.max_num_seqs, max_batched_tokens=args.max_batched_tokens,
                              max_waiting=args.max_waiting, enable_prefix_caching=not args.no_prefix_caching,
                              max_queue_wait=args.max_queue_wait or None, max_run_time=args.max_run_time or None,
                              min_token_rate=args.min_token_rate)
        # flash-attn's paged kernel needs blocks of 256 tokens; small blocks share more prefix on a CPU
        block_size = args.block_size or (256 if args.device.startswith("cuda") else 16)
        pool = PoolSpec(block_size=block_size, num_blocks=args.num_blocks, memory_gb=args.kv_memory_gb)
        # On a CPU each graph builds in a child process of its own, two at a time where there are
        # two cores (``compile_worker``); on CUDA (or shaped like it) torch.compile builds in this
        # process, one at a time.
        cuda_shaped = env.get("DUALSERVE_CUDA_SHAPED") == "1"
        in_process = args.device.startswith("cuda") or cuda_shaped
        compile_spec = None if args.no_compile else CompileSpec(
            cache_dir=cache / "compile", background=args.command == "serve",
            attend_kernel=env.get("DUALSERVE_ATTEND_KERNEL", "1") != "0",
            worker=CompileWorker(1 if in_process else cpu_workers()))
        parallel = ParallelSpec.from_env(env, size=args.tensor_parallel_size, reduction=args.tp_reduction,
                                         timeout=args.tp_timeout, heartbeat=args.tp_heartbeat)
        server = generate = None  # the serve and generate commands' own flags, where parsed
        if hasattr(args, "host"):
            server = ServerSettings(
                host=args.host, port=args.port, max_model_len=args.max_model_len, request_timeout=args.request_timeout,
                shutdown_timeout=args.shutdown_timeout, timeout_keep_alive=args.timeout_keep_alive,
                log_level=args.log_level, api_key=args.api_key,
                node_cost_per_hour=args.node_cost_per_hour, max_body_mb=args.max_body_mb,
                response_store_size=args.response_store_size, response_store_mb=args.response_store_mb,
                router_policy=args.router_policy, calibrate_router=args.calibrate_router)
        elif hasattr(args, "prompt"):
            generate = GenerateSettings(prompt=args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                                        seed=args.seed, decoder=args.decoder, chat=args.chat)
        if len(catalog.specs) > 1 and (generate is not None or parallel.size > 1 or parallel.launched is not None):
            raise InputError("several models are served by 'dualserve serve' on one rank only: give one --model "
                             f"to {'generate' if generate is not None else 'a tensor-parallel server'}")
        return cls(command=args.command, model=model, engine=engine, pool=pool, compile=compile_spec,
                   parallel=parallel, threads=args.threads, server=server, generate=generate, catalog=catalog,
                   cuda_shaped=cuda_shaped)


# ---- the served models ---------------------------------------------------------------------

# What a presets entry may set besides ``name`` and ``model``: the per-model flags.
PRESET_OPTIONS = ("eagle", "dflash", "twin", "datastore", "diffusion", "dtype", "quantization", "preload")


def served_name(model: str | None) -> str:
    """The name a model is served under: the known name, or the .gguf file's stem, or the directory's name."""
    if model is None or model in ALIASES:
        return DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    return path.stem if path.suffix == ".gguf" else path.name


def catalog_of(args: argparse.Namespace, cache: Path) -> Catalog:
    """Every model the command line names: each ``--model [NAME=]PATH`` in order, then the presets
    file's entries, then the models folder's; the embedded default when none is named. The flags
    --dtype, --quantization and --device apply to every model; --eagle, --dflash, --twin,
    --datastore and --diffusion to the first ``--model`` only (a head or twin fits one model)."""
    common = dict(cache_dir=cache, dtype=args.dtype, device=args.device, quantization=args.quantization,
                  pooling=getattr(args, "pooling", None))
    own = dict(eagle=args.eagle, dflash=args.dflash, twin=args.twin, datastore=args.datastore,
               diffusion=args.diffusion)
    given = args.model if isinstance(args.model, list) else [args.model] if args.model is not None else []
    specs, preload = [], list(getattr(args, "preload", None) or [])
    for i, text in enumerate(given):
        name, model = named_model(text)
        specs.append(ModelSpec(model=model, name=name, **common, **(own if i == 0 else {})))
    if getattr(args, "models_preset", None):
        for entry in read_presets(Path(args.models_preset).expanduser()):
            if entry.pop("preload", False) and entry["name"] not in preload:
                preload.append(entry["name"])
            specs.append(ModelSpec(**{**common, **entry}))
    if getattr(args, "models_dir", None):
        specs += [ModelSpec(model=str(p), **common) for p in models_in(Path(args.models_dir).expanduser())]
    if not specs:
        specs = [ModelSpec(**common, **own)]
    names = [s.served_name for s in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise InputError(f"two models are served as {twice[0]!r}: name each one, e.g. --model NAME=PATH")
    unknown = [n for n in preload if n not in names]
    if unknown:
        raise InputError(f"--preload {unknown[0]!r}: no such model (served: {', '.join(names)})")
    return Catalog(specs=tuple(specs), preload=tuple(preload or names[:1]),
                   max_loaded=getattr(args, "max_loaded_models", None),
                   memory_gb=getattr(args, "models_memory", None))


def named_model(text: str) -> tuple[str | None, str]:
    """``--model NAME=PATH`` -> (NAME, PATH); a plain path or known name -> (None, it)."""
    name, sep, model = text.partition("=")
    if not sep or not name or not model or Path(text).expanduser().exists() or "/" in name:
        return None, text
    return name, model


def models_in(folder: Path) -> list[Path]:
    """A models folder's models, by name: every .gguf file and every directory holding a config.json
    (as llama.cpp's --models-dir)."""
    if not folder.is_dir():
        raise InputError(f"--models-dir {folder}: not a directory")
    found = sorted(p for p in folder.iterdir()
                   if (p.is_file() and p.suffix == ".gguf") or (p.is_dir() and (p / "config.json").exists()))
    if not found:
        raise InputError(f"--models-dir {folder}: holds no .gguf file and no model directory (with a config.json)")
    return found


def read_presets(path: Path) -> list[dict]:
    """A presets file: JSON (a list, or ``{"models": [...]}``) or TOML (``[[models]]`` tables), each
    entry ``{name, model, ...}`` with the per-model options of ``PRESET_OPTIONS``."""
    import json
    import tomllib

    try:
        text = path.read_text()
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (OSError, ValueError) as e:  # tomllib's and json's errors are ValueErrors
        raise InputError(f"--models-preset {path}: {e}") from None
    entries = data.get("models") if isinstance(data, dict) else data
    if not isinstance(entries, list) or not entries:
        raise InputError(f"--models-preset {path}: expected a list of models ({{name, model, ...}})")
    out = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not isinstance(
                entry.get("model"), str):
            raise InputError(f"--models-preset {path}: entry {i + 1} needs a 'name' and a 'model' (strings)")
        extra = sorted(set(entry) - {"name", "model", *PRESET_OPTIONS})
        if extra:
            raise InputError(f"--models-preset {path}: entry {entry['name']!r} sets {extra[0]!r}; an entry may set "
                             f"name, model, {', '.join(PRESET_OPTIONS)}")
        out.append(dict(entry))
    return out


# ---- flag values ----------------------------------------------------------------------------


def number(text: str, least: float, strict: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, not {text!r}") from None
    if not math.isfinite(value) or value < least or (strict and value == least):
        raise argparse.ArgumentTypeError(f"must be {'above' if strict else 'at least'} {least:g} and finite, "
                                         f"not {text}")
    return value


def positive(text: str) -> float:
    return number(text, 0, strict=True)


def non_negative(text: str) -> float:
    return number(text, 0, strict=False)


def whole(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, not {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, not {text}")
    return value


def count(text: str) -> int:
    return whole(text, 1)


def count_or_zero(text: str) -> int:
    return whole(text, 0)


def port_number(text: str) -> int:
    """A TCP port; 0 asks the system for a free one (the start-up lines name it)."""
    value = whole(text, 0)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port, 0 to 65535, not {text}")
    return value
