"""The configuration of one ``dualserve`` process: frozen objects, built once from the command line.

``cli`` parses the flags; ``Settings.from_args`` turns them into one frozen object per component,
here and nowhere else, and everything below receives its own object:

  model     ModelSpec          which models to load and how (--model, --eagle, --twin, --dtype, ...)
  engine    EngineConfig       the scheduler's bounds (``decoders/engine/engine.py``)
  pool      PoolSpec           the KV block pool's size (``decoders/deployment.py``)
  compile   CompileSpec        compiled steps (``decoders/deployment.py``); None with --no-compile
  parallel  ParallelSpec       tensor parallelism (``server/tensor_parallel.py``)
  server    ServerSettings     HTTP, limits and routing (``serve`` only)
  generate  GenerateSettings   the prompt and its sampling (``generate`` only)

The environment is read here as well, for its documented knobs alone: ``DUALSERVE_CACHE`` (the
model cache, through ``models.hub.default_cache_dir``), ``DUALSERVE_ATTEND_KERNEL=0`` (compiled
steps keep inductor's attention loops, for comparison) and torchrun's ``RANK``, ``WORLD_SIZE``
and ``LOCAL_RANK``. Nothing under ``decoders/`` or ``server/`` reads it elsewhere.

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
from dualserve.decoders.engine.engine import EngineConfig
from dualserve.models.hub import default_cache_dir


@dataclass(frozen=True)
class ModelSpec:
    """Which models one process loads, and how (the flags of ``cli.add_model_args``)."""

    cache_dir: Path                    # the model cache: --cache-dir, else $DUALSERVE_CACHE, else ~/.cache/dualserve
    model: str | None = None           # the AR model (None: the embedded default)
    eagle: str = "auto"                # a draft head directory, "auto" (bundled), "suffix" or "none"
    dflash: str = "none"               # a DFlash drafter directory, or "none"
    twin: str = "auto"                 # a diffusion twin directory, "auto" (bundled) or "none"
    datastore: str = "auto"            # answers for eagle's suffix drafts: a file or directory, "auto" or "none"
    diffusion: str | None = None       # a diffusion model served beside the AR model
    dtype: str = "auto"                # a name of ``cli.DTYPES``, or "auto" (by device)
    device: str = "cpu"                # a rank's own device is its group's (``cli.load_deployment``)
    quantization: str = "auto"         # a weight format of ``models.quant.QUANTIZATIONS``, or "auto"


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
    model: ModelSpec
    engine: EngineConfig
    pool: PoolSpec
    compile: CompileSpec | None
    parallel: ParallelSpec = ParallelSpec()
    threads: int | None = None         # torch's CPU threads (None: all cores, shared out between ranks)
    server: ServerSettings | None = None
    generate: GenerateSettings | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str] | None = None) -> "Settings":
        """The settings of a parsed ``serve`` or ``generate`` command line; ``env``: the process's
        environment unless given (tests)."""
        env = os.environ if env is None else env
        cache = default_cache_dir(args.cache_dir)
        model = ModelSpec(cache_dir=cache, model=args.model, eagle=args.eagle, dflash=args.dflash, twin=args.twin,
                          datastore=args.datastore,
                          diffusion=args.diffusion, dtype=args.dtype, device=args.device,
                          quantization=args.quantization)
        engine = EngineConfig(max_num_seqs=args.max_num_seqs, max_batched_tokens=args.max_batched_tokens,
                              max_waiting=args.max_waiting, enable_prefix_caching=not args.no_prefix_caching,
                              max_queue_wait=args.max_queue_wait or None, max_run_time=args.max_run_time or None,
                              min_token_rate=args.min_token_rate)
        # flash-attn's paged kernel needs blocks of 256 tokens; small blocks share more prefix on a CPU
        block_size = args.block_size or (256 if args.device.startswith("cuda") else 16)
        pool = PoolSpec(block_size=block_size, num_blocks=args.num_blocks, memory_gb=kv_memory_gb(args.kv_memory_gb))
        compile_spec = None if args.no_compile else CompileSpec(
            cache_dir=cache / "compile", background=args.command == "serve",
            attend_kernel=env.get("DUALSERVE_ATTEND_KERNEL", "1") != "0")
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
        return cls(command=args.command, model=model, engine=engine, pool=pool, compile=compile_spec,
                   parallel=parallel, threads=args.threads, server=server, generate=generate)


def kv_memory_gb(choice: float | None) -> float:
    """The KV pool's memory: as given, else 1/64 of this machine's memory, between 0.25 and 1 GB
    (0.25 GB where the machine's memory cannot be asked: no ``os.sysconf`` on Windows)."""
    if choice is not None:
        return choice
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (AttributeError, ValueError, OSError):
        total = 0.0
    return min(1.0, max(0.25, total / 64))


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
