"""The servers under test as processes: their start commands (dualserve, llama.cpp's
``llama-server``, llama-cpp-python's server), starting one in its own session so its whole group
can be stopped, waiting until it answers, and waiting until dualserve has built every step graph.

llama-cpp-python is not a dependency; ``clients/bench_llamacpp.py``'s docstring says how to build it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal, Sequence

from dualserve.clients.llamacpp_build import Binaries

BaselineKind = Literal["cpp", "python"]
BASELINE_SERVERS: dict[BaselineKind, str] = {"cpp": "llama-server", "python": "llama-cpp-python"}


# ---------------------------------------------------------------------------------------------
# Server commands


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dualserve_command(threads: int, port: int, extra: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "dualserve.server.cli", "serve", "--threads", str(threads),
            "--host", "127.0.0.1", "--port", str(port), *extra]


def names_model(argv: Sequence[str]) -> bool:
    return any(a.split("=")[0] in ("--model", "--ar") for a in argv)


def dualserve_extra(args: argparse.Namespace, gguf: Path | None) -> list[str]:
    """``--dualserve-args``, with ``--model GGUF`` first when a file is named and they name none."""
    if gguf is None or names_model(args.dualserve_argv):
        return list(args.dualserve_argv)
    return ["--model", str(gguf), *args.dualserve_argv]


def llama_server_command(server: Path, gguf: Path, threads: int, port: int, slots: int, ctx: int,
                         extra: Sequence[str] = ()) -> list[str]:
    """llama-server with ``slots`` parallel sequences; it splits ``-c`` over them, so ``ctx`` a slot."""
    return [str(server), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-np", str(slots),
            "--port", str(port), "--host", "127.0.0.1", "-c", str(ctx * slots), *extra]


def llama_cpp_python_command(gguf: Path, threads: int, port: int, ctx: int, extra: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf),
            "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(ctx),
            "--host", "127.0.0.1", "--port", str(port), "--interrupt_requests", "False", *extra]


# ---------------------------------------------------------------------------------------------
# Server processes


@dataclass
class Server:
    """A server process this command started (own session, so its whole group can be stopped)."""

    name: str
    url: str
    proc: subprocess.Popen
    log_path: Path
    ready_url: str = ""  # answers 200 once the model is loaded; the url's /models when empty

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def start_server(name: str, cmd: Sequence[str], port: int, log_dir: Path, ready_path: str = "/v1/models") -> Server:
    log_path = log_dir / f"{name}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    root = f"http://127.0.0.1:{port}"
    return Server(name, f"{root}/v1", proc, log_path, root + ready_path)


def wait_ready(server: Server, timeout: float) -> None:
    """Poll the server's ready URL until it answers 200; fail early if the process exits."""
    ready = server.ready_url or server.url + "/models"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited with code {server.proc.returncode} while starting; "
                               f"log {server.log_path}:\n{server.log_tail()}")
        try:
            with urllib.request.urlopen(ready, timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass  # not listening yet, or llama-server's 503 while it loads the model
        time.sleep(0.5)
    raise RuntimeError(f"{server.name} did not answer {ready} within {timeout:.0f}s; "
                       f"log {server.log_path}:\n{server.log_tail()}")


@contextlib.contextmanager
def running(name: str, cmd: Sequence[str], port: int, log_dir: Path, timeout: float,
            ready_path: str = "/v1/models") -> Iterator[str]:
    """Start a server, wait until it is ready, yield its …/v1 URL; stop it on exit."""
    server = start_server(name, cmd, port, log_dir, ready_path)
    try:
        print(f"starting {name}: {shlex.join(cmd)}  (log {server.log_path})", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        wait_ready(server, timeout)
        print(f"{name} ready in {time.monotonic() - t0:.1f}s at {server.url}", file=sys.stderr, flush=True)
        yield server.url
    finally:
        server.stop()


@dataclass(frozen=True)
class Baseline:
    """One baseline server to compare against: a running one (``url``) or one this command starts."""

    kind: BaselineKind
    gguf: Path | None
    binaries: Binaries | None = None  # for kind "cpp", set by main from clients/llamacpp_build.py
    url: str | None = None

    @property
    def server(self) -> str:
        return BASELINE_SERVERS[self.kind]

    def command(self, args: argparse.Namespace, port: int, slots: int, ctx: int) -> list[str]:
        """The start command for ``slots`` parallel requests of ``ctx`` tokens each."""
        assert self.gguf is not None
        if self.kind == "cpp":
            assert self.binaries is not None
            return llama_server_command(self.binaries.server, self.gguf, args.threads, port, slots, ctx,
                                        args.llamacpp_argv)
        return llama_cpp_python_command(self.gguf, args.threads, port, ctx, args.llamacpp_argv)


@contextlib.contextmanager
def baseline_server(b: Baseline, args: argparse.Namespace, slots: int, ctx: int, log_dir: Path,
                    commands: list[list[str]] | None = None) -> Iterator[str]:
    """The baseline's …/v1 URL, started for ``slots`` parallel requests of ``ctx`` tokens unless it
    is already running (the command it was started with is appended to ``commands``)."""
    if b.url:
        yield b.url
        return
    if b.kind == "python":
        try:
            import llama_cpp  # noqa: F401  (only to fail early with a useful message)
        except ImportError:
            raise SystemExit("llama-cpp-python is not installed; see clients/bench_llamacpp.py's docstring for "
                             "how to build it, or pass --llamacpp-url") from None
    port = free_port()
    ready = "/health" if b.kind == "cpp" else "/v1/models"
    cmd = b.command(args, port, slots, ctx)
    if commands is not None:
        commands.append(cmd)
    with running(b.server, cmd, port, log_dir, args.startup_timeout, ready) as url:
        yield url


@contextlib.contextmanager
def dualserve_server(args: argparse.Namespace, gguf: Path | None, log_dir: Path) -> Iterator[str]:
    if args.dualserve_url:
        yield args.dualserve_url
        return
    port = free_port()
    cmd = dualserve_command(args.threads, port, dualserve_extra(args, gguf))
    with running("dualserve", cmd, port, log_dir, args.startup_timeout) as url:
        wait_compiled(url, args.startup_timeout)
        yield url


def wait_compiled(url: str, timeout: float) -> None:
    """Wait until dualserve has built or loaded every step graph (``/status.json``'s ``compile``
    entry is gone): a server building graphs serves eagerly, and its build children take the
    cores both servers are measured on (llama.cpp's turns beside a build read 2-7 tok/s)."""
    root = url.rstrip("/").removesuffix("/v1")
    t0, said = time.monotonic(), None
    while time.monotonic() - t0 < timeout:
        try:
            with urllib.request.urlopen(f"{root}/status.json", timeout=10) as r:
                compiling = json.loads(r.read()).get("compile")
        except (OSError, ValueError):
            return  # no status page to read: measure as it is
        if compiling is None:
            if said is not None:
                print(f"dualserve: every step graph ready after {time.monotonic() - t0:.0f}s", file=sys.stderr,
                      flush=True)
            return
        if said != compiling["built"]:
            said = compiling["built"]
            print(f"dualserve: building step graphs ({said} of {compiling['total']} ready); waiting",
                  file=sys.stderr, flush=True)
        time.sleep(2.0)
    raise SystemExit(f"dualserve still building step graphs after {timeout:.0f}s")
