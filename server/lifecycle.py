"""The server's life around the app: the port first, a start-up summary, and a drain on SIGTERM.

* ``bind_port`` claims the port before the model loads, so a second server on a busy port
  fails in a moment with one line instead of after loading. Connections that arrive while the
  model loads wait in the listen backlog and are served once it is ready.
* ``startup_lines`` tell the operator what runs: model and weight format, decoders, device,
  dtype and threads, the KV pool, the project's CPU kernels, the compiled graphs still to be
  built (and how long a first start's building takes), the URL, and how to stop.
* ``DrainingServer`` is uvicorn's server with its own signal handling. The first SIGTERM or
  SIGINT starts ``Drain``: new requests get 503 with Retry-After (``/health`` too, so a load
  balancer stops sending work), running requests finish for up to ``--shutdown-timeout``
  seconds, whatever remains is ended with a final chunk (``finish_reason: "abort"``) and
  ``[DONE]``, and the process exits 0. A second signal ends what remains at once.
  uvicorn's own handling would stop listening at once, cut streams after its graceful timeout,
  and re-raise the signal, so the exit status would not be 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from types import FrameType

import uvicorn

from .service import Service

log = logging.getLogger("dualserve.server")

# After the drain has ended every stream, how long writers get to flush their last events.
FLUSH_SECONDS = 5.0


class CannotListen(OSError):
    """The host and port cannot be listened on (busy, or a host that does not resolve); the message is
    the one line to print."""


def bind_port(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port), for uvicorn to serve on later."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except OSError as e:
        raise CannotListen(f"cannot listen on {host}:{port}: {e.strerror or e} (choose another with --host)") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart beside old TIME_WAIT connections
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise CannotListen(f"cannot listen on {host}:{port}: {e.strerror or e} (is another server running there? "
                        "choose another with --port)") from None
    return sock


def startup_lines(dep, served: dict, url: str, device: str, threads: int, shutdown_timeout: float,
                  kernels: str | None = None) -> list[str]:
    """What runs, in a few lines: ``dep`` is the loaded deployment, ``served`` the API's models,
    ``kernels`` the kernels' own report (``models.kernels.describe``), if there is one."""
    lines = []
    for name, loaded in dep.models.items():
        dtype = next((p.dtype for p in loaded.model.parameters() if p.is_floating_point()), None)
        dtype = str(dtype).removeprefix("torch.")
        source = "GGUF" if loaded.path.suffix == ".gguf" else "safetensors"
        weights = loaded.quantization if loaded.quantization != "none" else dtype
        lines.append(f"model {name} ({source}, {weights} weights, {dtype} compute), decoders: "
                     f"{', '.join(served[name].decoders)}; context {served[name].max_model_len} tokens")
    kv_bytes = sum(t.numel() * t.element_size() for r in dep.runners.values() for t in (*r.kv.k, *r.kv.v))
    cfg = dep.engine.config
    dtypes = sorted({str(r.kv.dtype).removeprefix("torch.") for r in dep.runners.values()})
    lines.append(f"device {device}, {threads} torch threads; KV pool {cfg.num_blocks} blocks of "
                 f"{cfg.block_size} tokens ({kv_bytes / 2**20:.0f} MB of {'/'.join(dtypes)} over "
                 f"{len(dep.runners)} runner{'s' if len(dep.runners) != 1 else ''})")
    if kernels:
        lines.append(f"kernels: {kernels}")
    note = compile_note(dep)
    if note:
        lines.append(note)
    lines.append(f"serving {url}/v1 (status page {url}/, health {url}/health)")
    lines.append(f"stop with Ctrl+C or SIGTERM: running requests get up to {shutdown_timeout:g} s to finish")
    return lines


def compile_note(dep) -> str | None:
    """The compiled graphs still queued at start-up and what they cost (``decoders/engine/compile/compiled.py``),
    or None when there are none."""
    spec = dep.compile
    pending = spec.worker.pending if spec is not None and spec.background else 0
    if not pending:
        return None
    graphs = f"{pending} graph{'s' if pending != 1 else ''}"
    if any(r.compiled is not None and r.compiled.packaged for r in dep.runners.values()):
        cost = (f"a first start on this host builds each once, 40-70 s per graph on 2 cores, the decode graph "
                f"first, then {spec.worker.workers} at a time (logged as it goes: graph k of n, elapsed), and later "
                f"starts load them in seconds")
    else:
        cost = "torch.compile compiles them on every start"
    return f"compiled steps: {graphs} to build or load in the background; {cost}; until then steps run eagerly"


class Drain:
    """Refuse new work, let running requests finish within ``timeout``, end the rest, then ``done()``."""

    def __init__(self, app_state, timeout: float, done):
        self.app_state = app_state  # server.app.AppState
        self.timeout = timeout
        self.done = done
        self.started = False
        self._task: asyncio.Task | None = None
        self._hurry = asyncio.Event()

    def start(self) -> None:
        """On the event loop (the signal handler schedules it there)."""
        if self.started:
            self._hurry.set()
            return
        self.started = True
        self._task = asyncio.ensure_future(self.run())  # held: the loop keeps only weak references to tasks

    async def run(self) -> None:
        service: Service = self.app_state.service
        self.app_state.draining = True
        log.warning("draining: %d requests running get up to %g s; new requests are refused with 503",
                    len(service.live), self.timeout)
        try:
            await asyncio.wait_for(self._until_idle(service), self.timeout)
        except asyncio.TimeoutError:
            pass
        if service.live:
            log.warning("drain: ending %d requests still running", len(service.live))
            for job in list(service.live):
                service.close(job)
            try:
                await asyncio.wait_for(self._until_idle(service, hurry=False), FLUSH_SECONDS)
            except asyncio.TimeoutError:
                pass
        self.done()

    async def _until_idle(self, service: Service, hurry: bool = True) -> None:
        while service.live and not (hurry and self._hurry.is_set()):
            await asyncio.sleep(0.05)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose SIGTERM / SIGINT start a ``Drain`` instead of an immediate shutdown."""

    def __init__(self, config: uvicorn.Config, app_state, shutdown_timeout: float):
        super().__init__(config)
        self.drain = Drain(app_state, shutdown_timeout, self._exit)
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def _exit(self) -> None:
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded as a captured signal: uvicorn would re-raise it after shutting down.
        if self._loop is None or not self.started:
            self.should_exit = True
        elif self.drain.started and sig == signal.SIGINT and self.should_exit:
            self.force_exit = True
        else:
            self._loop.call_soon_threadsafe(self.drain.start)
