"""The ``dualserve`` command: serve, pull, generate (and the training tools).

The flags are parsed here and turned into frozen settings once (``settings.Settings.from_args``,
the one place that also reads the environment's documented knobs); everything below receives
its own frozen object, and no ``argparse.Namespace`` goes past this module.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dualserve.decoders.engine.openmp import ThreadGovernor, run_on_own_thread
from dualserve.models.errors import InputError, one_line
from dualserve.models.hub import default_cache_dir, pull_default_model, resolve_model
from dualserve.models.quant import QUANTIZATIONS

from .loading import DTYPES, bundled, load_deployment, pick_dtype, pick_format  # noqa: F401 - bundled: for clients
from .router import DECODERS
from .settings import ModelSpec, Settings, count, count_or_zero, non_negative, port_number, positive

if TYPE_CHECKING:
    from dualserve.decoders.engine.decoder import Decoder

    from .model_manager import ModelManager
    from .router import DecoderTraits, RoutingPolicy
    from .service import ServedModel


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "--ar", dest="model", default=None, action="append",
                   help="the AR model: HF directory, .gguf file, or a known name (default: the embedded "
                   "SmolLM2-135M-Instruct); serve takes it more than once, each as [NAME=]PATH, served under "
                   "NAME or the file's or directory's name (see README: Several models)")
    p.add_argument("--eagle", default="auto", help="EAGLE draft head directory for the AR model; 'auto' uses "
                   "the bundled head for the default model; 'suffix' serves eagle from suffix drafts alone "
                   "(no head); 'none' disables. A DFlash drafter directory is accepted too")
    p.add_argument("--dflash", default="none", help="a DFlash block-diffusion drafter directory, loaded beside the "
                   "EAGLE head as eagle's second model draft source (request field draft: \"block\")")
    p.add_argument("--datastore", default="auto", help="answers that eagle's suffix lookup drafts from where a "
                   "request's own text does not match: a file written by Datastore.save or a directory of distilled "
                   "shards; 'auto' uses the bundled one for the default model; 'none' disables")
    p.add_argument("--twin", default="auto", help="diffusion twin (adapter directory) of the AR model, served as "
                   "its 'diffusion' decoder; 'auto' uses the bundled twin for the default model; 'none' disables")
    p.add_argument("--diffusion", default=None, help="a diffusion model (LLaDA, Dream, block diffusion, "
                   "DiffusionGemma) to serve beside the AR model, under its own name")
    p.add_argument("--cache-dir", default=None, help="model cache (default: $DUALSERVE_CACHE or ~/.cache/dualserve)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--kv-memory-gb", type=positive, default=None,
                   help="memory for the shared KV block pool (default: 1/64 of the machine's memory, 0.25-1 GB)")
    p.add_argument("--quantization", default="auto", choices=["auto", *QUANTIZATIONS],
                   help="weight format: int8 (per channel) or int4 (groups of 32) weight-only, w4a8 / w4a16 (the "
                   "project's CPU kernel), or none (--dtype); auto: the format this host serves best, decided at "
                   "the first start and kept (docs/formats.md)")
    p.add_argument("--pooling", default=None, choices=["mean", "cls", "last"],
                   help="how /v1/embeddings pools token states, over what the checkpoint declares (its "
                   "sentence-transformers Pooling module or GGUF pooling_type; else mean)")
    p.add_argument("--no-compile", action="store_true",
                   help="stay in eager mode (default: steps run through compiled graphs, AOTInductor packages on "
                   "the CPU: built once in the background, cached under the model cache, loaded in seconds later)")
    p.add_argument("--num-blocks", type=count, default=None, help="KV blocks in the pool (overrides --kv-memory-gb)")
    p.add_argument("--block-size", type=count, default=None,
                   help="tokens per KV block (default 16 on CPU, 256 on CUDA, as flash-attn's paged kernel needs)")
    p.add_argument("--max-num-seqs", type=count, default=64)
    p.add_argument("--max-batched-tokens", type=count, default=512)
    p.add_argument("--max-waiting", type=count, default=256,
                   help="choices (prompts x n) that may wait to start; beyond, new requests get 429")
    p.add_argument("--max-queue-wait", type=non_negative, default=30.0,
                   help="seconds a request may wait to start: one whose estimated wait is longer gets 429 with "
                   "Retry-After, and one still waiting after this long ends with a 429 error (0: no bound)")
    p.add_argument("--max-run-time", type=non_negative, default=20.0,
                   help="seconds a started request is promised to finish in: one starts only while every running "
                   "request, and itself, is estimated (from measured step times) to finish within its promise; "
                   "else it waits, bounded by --max-queue-wait (0: no bound, --max-num-seqs alone)")
    p.add_argument("--min-token-rate", type=positive, default=4.0,
                   help="tokens/s: a request asking for more than --max-run-time x this many tokens is promised "
                   "max_tokens / this instead, so a running stream is never slowed below it on average")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--threads", type=count, default=None, help="CPU threads for torch (default: all cores); on a "
                   "machine shared with busy processes, one fewer than the cores (see README: Threads)")
    p.add_argument("--tensor-parallel-size", type=count, default=1,
                   help="ranks the model is sharded over (spawned here, or started by torchrun; see README: "
                   "Tensor parallelism)")
    p.add_argument("--tp-reduction", default="exact", choices=["exact", "sum"],
                   help="how row-parallel layers combine ranks: exact (gather, output identical to one rank) or "
                   "sum (one all-reduce per block half, Megatron's; sums in another order)")
    p.add_argument("--tp-timeout", type=positive, default=60.0,
                   help="seconds a tensor-parallel collective may wait before its rank is declared failed")
    p.add_argument("--tp-heartbeat", type=positive, default=5.0,
                   help="idle seconds between tensor-parallel liveness checks")


def model_settings(argv: list[str], command: str = "generate") -> Settings:
    """The settings of ``add_model_args``' flags alone (tests and benchmarks that load a deployment
    as ``command`` would: ``serve`` builds compiled graphs in the background, ``generate`` on use)."""
    p = argparse.ArgumentParser()
    add_model_args(p)
    args = p.parse_args(argv)
    args.command = command
    return Settings.from_args(args)


def settle_format(settings: Settings) -> Settings:
    """``settings`` with ``--quantization auto`` resolved once, here, under tensor parallelism: every
    rank then loads the format rank 0 picked (the one a single rank picks on this host), never one
    it measured for itself beside the others."""
    model, launched = settings.model, settings.parallel.launched
    if model.quantization != "auto" or settings.parallel.size <= 1:
        return settings
    if launched is not None and launched[0] != 0:  # a torchrun rank takes rank 0's (``tensor_parallel.rank0_format``)
        return settings
    _, path = resolve_model(model.model, model.cache_dir)
    quantization, dtype, _ = pick_format(model, Path(path), model.cache_dir, pick_dtype(model.dtype, model.device))
    bf16 = quantization == "none" and dtype == torch.bfloat16
    return dataclasses.replace(settings, model=dataclasses.replace(
        model, quantization=quantization, dtype="bfloat16" if bf16 else model.dtype))


def dtype_of(loaded) -> torch.dtype:
    return next(loaded.model.parameters()).dtype


def decoder_traits(decoder: Decoder) -> DecoderTraits:
    """What routing and the handlers must know of one registered decoder, as it declares it."""
    from .router import FIM_DECODERS, DecoderTraits

    infill = "native" if decoder.supports_infill else "fim" if decoder.name in FIM_DECODERS else "none"
    return DecoderTraits(infill=infill, default_max_tokens=decoder.default_max_tokens,
                         drafts=tuple(decoder.draft_choices))


def served_models(dep, max_model_len: int) -> dict[str, ServedModel]:
    """The API's view of each served model: tokenizer, context length, decoders and their traits."""
    from .service import ServedModel

    served = {}
    for name, m in dep.models.items():
        decoders = dep.engine.decoders_for(name)
        served[name] = ServedModel(
            name=name, tokenizer=m.tokenizer,
            max_model_len=min(m.config.max_position_embeddings, max_model_len),
            decoders=decoders, traits={d: decoder_traits(dep.engine.decoders[(name, d)]) for d in decoders})
    return served


def cmd_serve(settings: Settings) -> int:
    import uvicorn

    from .app import create_app
    from .lifecycle import DrainingServer, CannotListen, bind_port, startup_lines
    from .router import load_policy
    from .tensor_parallel import exit_on_failure, start as start_group

    cfg = settings.server
    launched = settings.parallel.launched
    if launched is not None and launched[0] != 0:
        start_group(settings)  # a torchrun rank other than 0 takes rank 0's format, replays its steps, then exits
    # The port is bound before any rank starts: a busy port fails in a moment, not after the model
    # has loaded, and the ranks' own sockets (ephemeral ports) cannot take it meanwhile.
    try:
        sock = bind_port(cfg.host, cfg.port)
    except CannotListen as e:
        print(f"dualserve: {e}", file=sys.stderr)
        return 2
    policy = load_policy(cfg.router_policy)  # a policy file that cannot be used fails now, not after loading
    settings = settle_format(settings)
    group = start_group(settings)
    # Torch work before serving runs on a thread that exits, so the engine's thread owns the one
    # long-lived OpenMP pool and its teams spin (decoders/engine/openmp.py). The first preloaded
    # model builds the engine and sizes its block pool; the others join it.
    catalog = settings.catalog
    settings = run_on_own_thread(shared_pool, settings)
    first = settings if catalog is None else for_model(settings, catalog.preload[0])
    dep = run_on_own_thread(load_deployment, first, *([group] if group is not None else []))
    app_state = serving_state(first, dep, policy)
    dep.engine.start()
    manager = app_state.service.manager
    if manager is not None:
        for name in catalog.preload[1:]:
            manager.load(name)
    device = str(group.device) if group is not None else settings.model.device
    if device == "cpu":
        governor = ThreadGovernor().start()
        dep.engine.pace_with(governor.apply, governor.resumed)
        app_state.threads = governor.state
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    for line in startup_lines(dep, app_state.service.models, f"http://{host}:{sock.getsockname()[1]}", device,
                              torch.get_num_threads(), cfg.shutdown_timeout,
                              kernels_in_use() if device == "cpu" else None):  # CUDA uses none of them
        # One write a line: the compile worker's threads already log, and print's separate
        # newline let their lines land inside this one.
        sys.stderr.write(f"dualserve: {line}\n")
    if manager is not None:
        sys.stderr.write(f"dualserve: {catalog_line(catalog, list(manager.loaded))}\n")
    # uvicorn's graceful timeout only bounds the last flush: the drain has already ended every stream.
    config = uvicorn.Config(create_app(app_state), log_level=cfg.log_level, loop="auto", timeout_graceful_shutdown=5,
                            timeout_keep_alive=cfg.timeout_keep_alive)
    server = DrainingServer(config, app_state, cfg.shutdown_timeout)
    if group is not None:  # a failed rank: /health says so, in-flight requests fail, then the server exits 1
        app_state.on_shutdown.append(group.shutdown)
        exit_on_failure(group, app_state, server)
    server.run(sockets=[sock])
    if group is not None:
        group.shutdown()
        return 1 if group.failure else 0
    return 0


def shared_pool(settings: Settings) -> Settings:
    """``settings`` with the KV pool sized, once, for several models: ``--kv-memory-gb`` over the
    block bytes of the models that may be loaded together (the ``--max-loaded-models`` largest,
    else all), so that the pool stays within its budget whichever of them are loaded. A model
    whose shape cannot be read here counts as none (its load reports why)."""
    catalog, pool = settings.catalog, settings.pool
    if catalog is None or len(catalog.specs) == 1 or pool.num_blocks:
        return settings
    log = logging.getLogger("dualserve")
    costs = []
    for spec in catalog.specs:
        try:
            costs.append(block_bytes(spec, pool.block_size))
        except Exception as e:  # noqa: BLE001 - a broken model fails its own load, not the start
            log.warning("%s: cannot read its shape to size the KV pool (%s)", spec.served_name, one_line_text(e))
    together = sorted(costs, reverse=True)[:catalog.max_loaded or len(costs)]
    return dataclasses.replace(settings, pool=dataclasses.replace(pool, bytes_per_block=sum(together) or None))


def block_bytes(spec: ModelSpec, block_size: int) -> int:
    """One KV block's bytes for ``spec``'s model, from its config alone (a GGUF's metadata, read
    without converting it), at the KV dtype it may take (the compute dtype: never less)."""
    import json

    from dualserve.decoders.engine.attention.paged_attention import KVCache
    from dualserve.models.families import read_config, read_gguf_config

    _, path = resolve_model(spec.model, spec.cache_dir)
    if Path(path).suffix == ".gguf":
        import gguf

        from dualserve.models.loader import gguf_metadata

        config = read_gguf_config(gguf_metadata(gguf.GGUFReader(str(path))))
    else:
        config = read_config(json.loads((Path(path) / "config.json").read_text()))
    return KVCache.bytes_per_block_of_layers(config.kv_shapes, block_size, pick_dtype(spec.dtype, spec.device))


def one_line_text(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def for_model(settings: Settings, name: str) -> Settings:
    """``settings`` for loading the catalog's model ``name`` (``settings.model`` is the one loaded)."""
    return dataclasses.replace(settings, model=settings.catalog.spec(name))


def catalog_line(catalog, loaded: list[str]) -> str:
    """The start-up line of a server with several models: which are loaded, and the budget."""
    names = [f"{n} ({'loaded' if n in loaded else 'on first use'})" for n in catalog.names]
    bounds = [f"at most {catalog.max_loaded} loaded"] if catalog.max_loaded else []
    bounds += [f"{catalog.memory_gb:g} GB of weights and KV"] if catalog.memory_gb else []
    return f"models: {', '.join(names)}" + (f"; {', '.join(bounds)}" if bounds else "")


def model_manager(settings: Settings, dep) -> ModelManager:
    """The loaded-models manager of a server with several models: ``dep`` (the first preloaded
    model) is in memory; the others load into its engine and block pool on first use."""
    from dualserve.decoders.deployment import deployment_bytes, unload_deployment

    from .model_manager import Loaded, ModelManager
    from .model_pool import ModelPool

    catalog, cfg = settings.catalog, settings.server

    def served_of(d) -> dict[str, ServedModel]:
        served = served_models(d, cfg.max_model_len)
        for m in served.values():
            _ = m.max_prompt_chars  # reads the whole vocabulary: once, while loading
        return served

    def load(name: str) -> Loaded:
        joined = run_on_own_thread(load_deployment, for_model(settings, name), engine=dep.engine)
        return Loaded(joined, served_of(joined), deployment_bytes(joined))

    memory = int(catalog.memory_gb * 2**30) if catalog.memory_gb else None
    manager = ModelManager(ModelPool(catalog.names, catalog.max_loaded, memory), load, unload_deployment,
                           paths={s.served_name: s.model or s.served_name for s in catalog.specs},
                           wait_seconds=settings.engine.max_queue_wait or 30.0)
    manager.add(settings.model.served_name, Loaded(dep, served_of(dep), deployment_bytes(dep)))
    return manager


def serving_state(settings: Settings, dep, policy: RoutingPolicy):
    """The app's state over a loaded deployment: its models as the API shows them (with several
    models, through the loaded-models manager), metrics, the router (``policy``, the file's or the
    defaults, fitted to this host's measured costs unless a file gave it), the service."""
    from .app import AppState
    from .metrics import Metrics
    from .responses.store import ResponseStore
    from .router import Router
    from .service import Service, ServiceLimits

    cfg = settings.server
    several = settings.catalog is not None and len(settings.catalog.specs) > 1
    manager = model_manager(settings, dep) if several else None
    served = manager.loaded if manager is not None else served_models(dep, cfg.max_model_len)
    metrics = Metrics(node_cost_per_hour=cfg.node_cost_per_hour)
    metrics.record_formats(dep.format_table, {n: m.quantization for n, m in dep.models.items()})
    name = next(iter(dep.models))
    if dep.format_table is not None and cfg.router_policy is None:
        from .calibrate import fit_to_forward_costs

        fmt = dep.models[name].quantization
        fmt = fmt if fmt != "none" else ("bf16" if dtype_of(dep.models[name]) == torch.bfloat16 else "fp32")
        policy = fit_to_forward_costs(policy, dep.format_table, fmt, dep.engine.decoders_for(name))
    if cfg.calibrate_router:
        from .calibrate import calibrate

        policy, _ = run_on_own_thread(calibrate, dep.engine, name, dep.models[name].tokenizer, policy)
    service = Service(dep.engine, served, Router(policy), ServiceLimits(request_timeout=cfg.request_timeout), metrics,
                      manager=manager)
    worker = settings.compile.worker if settings.compile is not None else None
    # A SIGTERM ends the compile worker's build (and its compilers) before the process exits.
    return AppState(service=service, metrics=metrics, api_key=cfg.api_key,
                    on_shutdown=[dep.engine.shutdown, *([worker.stop] if worker is not None else [])],
                    body_limit=int(cfg.max_body_mb * 2**20),
                    response_store=ResponseStore.sized(cfg.response_store_size, cfg.response_store_mb),
                    compile_progress=worker.progress if worker is not None else None)


def kernels_in_use() -> str | None:
    """The project's CPU kernels as ``models.kernels.describe`` reports them (which kernels and
    instruction set run, or why none do), where that report exists."""
    from dualserve.models import kernels

    describe = getattr(kernels, "describe", None)
    return describe() if describe is not None else None


def cmd_pull(args: argparse.Namespace) -> int:
    path = pull_default_model(default_cache_dir(args.cache_dir))
    print(path)
    return 0


def generate_loads(settings: Settings) -> Settings:
    """What ``generate`` loads: the model and only the part its --decoder uses (the diffusion twin
    for ``diffusion``, the EAGLE head for ``eagle``), never a second --diffusion model."""
    decoder, model = settings.generate.decoder, settings.model
    trimmed = dataclasses.replace(model, diffusion=None, twin=model.twin if decoder == "diffusion" else "none")
    if decoder != "eagle":
        trimmed = dataclasses.replace(trimmed, eagle="none", dflash="none")
    return dataclasses.replace(settings, model=trimmed)


def cmd_generate(settings: Settings) -> int:
    from dualserve.decoders.engine.sampling import SamplingParams

    from .tensor_parallel import start as start_group

    gen = settings.generate
    settings = settle_format(generate_loads(settings))
    group = start_group(settings)  # every rank loads what rank 0 loads
    dep = load_deployment(settings) if group is None else load_deployment(settings, group)
    name = next(iter(dep.models))
    tok = dep.models[name].tokenizer
    if gen.decoder not in dep.engine.decoders_for(name):
        raise InputError(f"{name} is served by {', '.join(dep.engine.decoders_for(name))}, not {gen.decoder}: "
                         "choose one with --decoder")
    if (str(group.device) if group is not None else settings.model.device) == "cpu":
        governor = ThreadGovernor().start()
        dep.engine.pace_with(governor.apply, governor.resumed)
    if gen.chat:
        text = tok.apply_chat_template([{"role": "user", "content": gen.prompt}], add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
    else:
        ids = tok.encode(gen.prompt, add_special_tokens=True)
    params = SamplingParams(max_tokens=gen.max_tokens, temperature=gen.temperature, seed=gen.seed)
    # A two-token run first: it builds (or loads) the compiled graphs, so the timing below is decoding only.
    dep.engine.submit(name, gen.decoder, ids, SamplingParams(max_tokens=2, ignore_eos=True), lambda *_: None)
    dep.engine.run_until_idle()
    start = time.perf_counter()
    out = []

    def sink(_: int, delta) -> None:
        out.append(delta)
        sys.stdout.write(delta.text)
        sys.stdout.flush()

    dep.engine.submit(name, gen.decoder, ids, params, sink)
    dep.engine.run_until_idle()
    elapsed = time.perf_counter() - start
    n = sum(len(d.token_ids) for d in out)
    print(f"\n[{n} tokens in {elapsed:.2f}s, {n / elapsed:.1f} tok/s, decoder={gen.decoder}]", file=sys.stderr)
    if group is not None:
        group.shutdown()
    return 0


TRAINERS = {
    "train-eagle": ("dualserve.decoders.training.eagle_train", "train an EAGLE draft head for a model (self-distilled)"),
    "train-dflash": ("dualserve.decoders.training.dflash_train", "train a DFlash block-diffusion drafter for a model (self-distilled)"),
    "train-diffusion": ("dualserve.decoders.training.diffusion_train", "adapt an AR model into a block-diffusion twin"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in TRAINERS:  # the trainers own their flags
        import importlib

        trainer = importlib.import_module(TRAINERS[argv[0]][0])
        return one_line(lambda: trainer.main(argv[1:]), f"dualserve {argv[0]}")
    parser = argparse.ArgumentParser(prog="dualserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible server")
    add_model_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=port_number, default=8000,
                       help="TCP port (0: one the system picks, named in the start-up lines)")
    serve.add_argument("--max-model-len", type=count, default=8192)
    serve.add_argument("--models-dir", default=None, help="serve every .gguf file and Hugging Face model directory "
                       "in this folder too, each under its file's or directory's name")
    serve.add_argument("--models-preset", default=None, help="a JSON or TOML file listing models to serve too: "
                       "{name, model, and per-model options: quantization, dtype, eagle, twin, ..., preload}")
    serve.add_argument("--max-loaded-models", type=count, default=None, help="with several models: at most this "
                       "many in memory; loading another unloads the least recently used idle one (default: no bound)")
    serve.add_argument("--models-memory", type=positive, default=None, help="with several models: GB of weights "
                       "and KV tensors they may hold together; the least recently used idle ones unload to fit")
    serve.add_argument("--preload", action="append", default=None, metavar="NAME",
                       help="a model to load at start (repeatable; default: the first one given)")
    serve.add_argument("--request-timeout", type=positive, default=600.0,
                       help="seconds a request may run; a stream that times out ends with an error event and [DONE]")
    serve.add_argument("--shutdown-timeout", type=non_negative, default=30.0,
                       help="on SIGTERM / Ctrl+C, seconds running requests get to finish before they are ended")
    serve.add_argument("--timeout-keep-alive", type=positive, default=75.0,
                       help="seconds an idle keep-alive connection stays open (above clients' pool expiry)")
    serve.add_argument("--log-level", default="warning")
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on the API")
    serve.add_argument("--node-cost-per-hour", type=non_negative, default=0.0,
                       help="node cost (any currency) per hour, for cost-per-token metrics")
    serve.add_argument("--max-body-mb", type=positive, default=8.0, help="request body size limit")
    serve.add_argument("--response-store-size", type=count_or_zero, default=None,
                       help="stored /v1/responses kept at most, least recently used evicted first (default 1024)")
    serve.add_argument("--response-store-mb", type=positive, default=None,
                       help="memory for stored /v1/responses, counted as their JSON (default 64)")
    serve.add_argument("--router-policy", default=None, help="JSON file with routing policy overrides "
                       "(see README: Routing)")
    serve.add_argument("--calibrate-router", action="store_true",
                       help="measure every decoder once at start-up; auto then sends latency-bound work to the "
                            "fastest and high-value work to the fastest lossless one")
    serve.set_defaults(func=cmd_serve)

    pull = sub.add_parser("pull", help="download the embedded default model into the cache")
    pull.add_argument("--cache-dir", default=None)
    pull.set_defaults(func=cmd_pull)

    gen = sub.add_parser("generate", help="generate from a prompt locally (no server)")
    add_model_args(gen)
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=count, default=64)
    gen.add_argument("--temperature", type=non_negative, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--decoder", default="ar", choices=DECODERS)
    gen.add_argument("--chat", action="store_true", help="apply the chat template")
    gen.set_defaults(func=cmd_generate)

    for name, (_, help_text) in TRAINERS.items():
        sub.add_parser(name, help=help_text, add_help=False)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if args.command == "pull":
        return one_line(lambda: cmd_pull(args), "dualserve")
    return one_line(lambda: run_command(args), "dualserve")


def run_command(args: argparse.Namespace) -> int:
    """``serve`` or ``generate`` with the settings of its flags, after the process-wide profile they name."""
    settings = Settings.from_args(args)
    if settings.cuda_shaped:
        from dualserve.decoders.engine.compile import cuda_shaped

        cuda_shaped.activate()
    return args.func(settings)


if __name__ == "__main__":
    sys.exit(main())
