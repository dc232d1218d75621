"""Starting a tensor-parallel server: N ranks over torch.distributed, rank 0 serving.

Two launch forms, one code path after the rendezvous:

  * ``dualserve serve --tensor-parallel-size N``: this process is rank 0; it spawns ranks
    1..N-1 with torch.multiprocessing (spawn) and they meet over a TCP store on 127.0.0.1.
    Rank 0 watches their processes, so a rank that exits is noticed at once.
  * ``torchrun --nnodes M --nproc-per-node K ... -m dualserve.server.cli serve
    --tensor-parallel-size M*K``: torchrun's rendezvous sets RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT (``env://``; the settings read RANK, WORLD_SIZE and LOCAL_RANK,
    ``settings.ParallelSpec``); rank 0 serves, every other rank runs ``run_worker`` and exits
    with the server. Liveness then rests on the collectives and the heartbeat alone.

Every rank loads the same models from the same settings (rank 0's, sent to spawned ranks) through
``loading.load_deployment``, shards them (``models/sharding.py``: each by its family's sharder) and
builds the same deployment; the ranks other than 0 then replay rank 0's steps
(``decoders/engine/parallel.py``). The backend is NCCL on CUDA and gloo on
the CPU; ``--tp-timeout`` bounds every collective, so a hung rank is noticed within it; meeting at
start-up may take longer (``START_SECONDS``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

from dualserve.decoders.engine.parallel import ParallelGroup, serve_steps
from dualserve.models.sharding import Shard

from .loading import load_deployment
from .settings import Settings

log = logging.getLogger("dualserve.parallel")
START_SECONDS = 120.0  # the least time the ranks get to start and meet (imports, a cold disk)


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def init(settings: Settings, rank: int, world: int, init_method: str | None,
         store: dist.TCPStore | None = None) -> tuple[Shard, str]:
    """Join the group as ``rank``: (this rank's shard, its device). On CUDA each rank takes its
    own GPU, torchrun's LOCAL_RANK or else its rank, modulo the GPUs here."""
    device, parallel = settings.model.device, settings.parallel
    if device.startswith("cuda"):
        local = parallel.local_rank if parallel.local_rank is not None else rank
        torch.cuda.set_device(local % torch.cuda.device_count())
        device = f"cuda:{torch.cuda.current_device()}"
    try:
        # The rendezvous waits for every rank's start-up (a spawned interpreter importing torch on a
        # loaded host can take longer than a collective may); the collectives get their own group,
        # bounded by --tp-timeout.
        dist.init_process_group(backend_for(device), init_method=init_method, store=store, rank=rank,
                                world_size=world, timeout=start_timeout(settings))
        group = dist.new_group(list(range(world)), timeout=timedelta(seconds=parallel.timeout))
    except Exception:
        # A failed rendezvous leaves c10d's module-global group counter advanced: a later group in this
        # process would then wait for store keys that no freshly started rank writes.
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.distributed_c10d._world.group_count = 0
        raise
    if not settings.threads and device == "cpu":  # the ranks share this host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // min(world, os.cpu_count() or 1)))
    return Shard(rank, world, group=group, reduction=parallel.reduction), device


def check_fits(settings: Settings) -> None:
    """Refuse, in one line and before any rank starts, a --tensor-parallel-size a served model
    cannot be split over (a rank with no key/value head, MLP column or vocabulary row of its own)."""
    import json

    from dualserve.models.errors import InputError
    from dualserve.models.families import of_hf, read_config
    from dualserve.models.hub import resolve_model
    from dualserve.models.loader import prepare_source

    model, world = settings.model, settings.parallel.size
    for name in (model.model, *([model.diffusion] if model.diffusion else [])):
        _, path = resolve_model(name, model.cache_dir)
        raw = json.loads((prepare_source(path, model.cache_dir) / "config.json").read_text())
        reason = of_hf(raw).cannot_split(read_config(raw), world)
        if reason:
            raise InputError(f"--tensor-parallel-size {world} cannot split {path.name}: {reason}")


def rank0_format(settings: Settings) -> Settings:
    """``settings`` with rank 0's weight format and dtype, sent over the group: torchrun's ranks each
    start from the command line, so a rank other than 0 must not resolve ``--quantization auto``
    for itself (on another host, or beside the other ranks measuring, it could pick another
    format, and the shards would then compute another model than one rank does)."""
    import dataclasses

    model = settings.model
    sent = [(model.quantization, model.dtype)]
    dist.broadcast_object_list(sent, src=0)
    quantization, dtype = sent[0]
    return dataclasses.replace(settings, model=dataclasses.replace(model, quantization=quantization, dtype=dtype))


def start_timeout(settings: Settings) -> timedelta:
    """How long the ranks may take to meet: --tp-timeout, but never less than START_SECONDS."""
    return timedelta(seconds=max(settings.parallel.timeout, START_SECONDS))


def start(settings: Settings, force: bool = False) -> ParallelGroup | None:
    """Join or create the group for rank 0 (None without tensor parallelism; ``force``: a group even
    of one rank, to run its path on a single device). A torchrun rank other than 0 never returns:
    it serves steps, then exits the process."""
    parallel = settings.parallel
    world = parallel.size
    if world > 1:
        check_fits(settings)
    if parallel.launched is not None and parallel.launched[1] > 1:
        rank, env_world = parallel.launched
        if env_world != world:
            raise SystemExit(f"dualserve: --tensor-parallel-size {world} but torchrun started {env_world} ranks")
        shard, device = init(settings, rank, world, "env://")
        settings = rank0_format(settings)
        if rank != 0:
            sys.exit(run_worker(settings, shard, device))
        return ParallelGroup(shard, device, parallel.heartbeat)
    if world <= 1 and not force:
        return None
    # The store listens before any rank starts, on a port the OS picks as it binds: a port chosen
    # first and bound later can be taken meanwhile by another process on a busy host.
    store = dist.TCPStore("127.0.0.1", 0, world, True, start_timeout(settings), wait_for_workers=False)
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=worker_main, args=(settings, r, world, store.port), name=f"dualserve-rank{r}",
                         daemon=True) for r in range(1, world)]
    for p in procs:
        p.start()
    try:
        shard, device = init(settings, 0, world, None, store)
    except BaseException:
        for p in procs:  # ranks that never met rank 0 must not outlive it
            p.kill()
            p.join(5)
        raise
    group = ParallelGroup(shard, device, parallel.heartbeat)
    group.processes = procs
    threading.Thread(target=watch, args=(group,), name="dualserve-tp-watch", daemon=True).start()
    return group


def watch(group: ParallelGroup) -> None:
    """Fail the group as soon as a spawned rank's process ends (unless we are stopping it)."""
    pending = {p.sentinel: (r, p) for r, p in enumerate(group.processes, start=1)}
    while pending:
        for sentinel in wait(list(pending)):
            rank, p = pending.pop(sentinel)
            p.join(1)
            group.fail(f"tensor-parallel rank {rank} exited (code {p.exitcode})")


def worker_main(settings: Settings, rank: int, world: int, port: int) -> None:
    """A spawned rank: meet rank 0 at its store, load and shard, replay steps; exits non-zero on a failure."""
    logging.basicConfig(level=logging.INFO, format=f"rank{rank} %(name)s: %(message)s")
    store = dist.TCPStore("127.0.0.1", port, world, False, start_timeout(settings))
    code = run_worker(settings, *init(settings, rank, world, None, store))
    sys.exit(code)


def run_worker(settings: Settings, shard: Shard, device: str) -> int:
    """Build the same deployment as rank 0 over this rank's shards (its engine never runs), then
    replay rank 0's steps on its runners, which are registered in the same order."""
    try:
        dep = load_deployment(settings, ParallelGroup(shard, device, settings.parallel.heartbeat))
        serve_steps(list(dep.runners.values()), shard)
    except Exception:  # noqa: BLE001 - rank 0 died, hung or failed: this rank's work is over
        log.exception("rank %d stopped", shard.rank)
        return 1
    return 0


FAILURE_GRACE = 5.0  # seconds /health reports a failed rank before the server exits


def exit_on_failure(group: ParallelGroup, app_state, server) -> None:
    """When a rank fails: ``/health`` reports it at once (``app_state.failure``), in-flight and new
    requests fail with an error (every later step raises), and after ``FAILURE_GRACE`` seconds the
    server drains and exits; ``cmd_serve`` then returns 1 so a supervisor restarts it."""
    def failed(reason: str) -> None:
        app_state.failure = reason
        timer = threading.Timer(FAILURE_GRACE, server.handle_exit, (signal.SIGTERM, None))
        timer.daemon = True
        timer.start()
    group.on_failure(failed)
