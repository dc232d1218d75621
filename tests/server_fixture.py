"""A real dualserve server in a subprocess, shared by the server tests of one session.

The server runs ``python -m dualserve.server.cli serve`` on the embedded default model, on a
free port of 127.0.0.1, exactly as a user would start it. The fixture waits for ``/health``,
yields the base URL, and stops the process (terminate, then kill). If the server dies or
never answers, the test fails with the tail of its log.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import torch

from dualserve.models import kernels
from tiny_dflash import write_tiny_dflash

# Loading takes a few seconds on an idle machine; a first run also converts the GGUF (~20 s),
# and a busy 2-core CI runner can be several times slower.
STARTUP_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 40) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"dualserve exited with {proc.returncode} during start-up:\n{log_tail(log)}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    pytest.fail(f"dualserve did not answer /health within {STARTUP_TIMEOUT_S:.0f} s:\n{log_tail(log)}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=15)


@contextlib.contextmanager
def serving(args: list[str], log: Path) -> Iterator[str]:
    """``dualserve serve ARGS`` in a subprocess on a free port of 127.0.0.1, its output in ``log``:
    yields the base URL (no /v1) once ``/health`` answers, and stops the server on exit."""
    port = free_port()
    cmd = [sys.executable, "-m", "dualserve.server.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log)
        yield url
    finally:
        stop(proc)


@pytest.fixture(scope="session")
def server_url(default_gguf: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL (no /v1) of a dualserve server on the default model."""
    log = tmp_path_factory.mktemp("server") / "dualserve.log"
    # The routing defaults as written, on every host: without a policy file the server fits the
    # policy to this host's measured forward costs (tests/server/test_router.py covers that).
    policy = log.parent / "policy.json"
    policy.write_text("{}")
    # An untrained DFlash drafter in the default model's geometry, beside the bundled head: requests
    # with draft "block" run the side-by-side path (its drafts are rarely accepted; output is exact).
    dflash = log.parent / "dflash"
    write_tiny_dflash(dflash, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536,
                      vocab_size=49152, num_layers=1, target_layer_ids=[1, 14, 26], num_target_layers=30,
                      block_size=4, mask_token_id=0, dtype=torch.float16)
    args = ["--cache-dir", str(cache_dir),
           # Eager: building the default model's compiled graphs takes minutes of CPU on a cold cache, which
           # would compete with the tests; tests/decoders/engine/compile/test_compiled.py covers the compiled
           # step.
           "--no-compile", "--router-policy", str(policy), "--dflash", str(dflash),
           # The format `auto` picks on a quiet AVX-512 host, pinned: a table measured beside the
           # suite would otherwise decide it, and the greedy answers the tests read depend on it.
            "--quantization", "w4a16" if kernels.available() else "int4"]
    with serving(args, log) as url:
        yield url


def sdk_client(server_url: str, needs: str | None = None):
    """The real openai SDK pointed at the test server; fails the test if the default model
    does not offer decoder ``needs`` (its bundled EAGLE head or diffusion twin went missing)."""
    import openai

    client = openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", timeout=300, max_retries=0)
    if needs is not None:
        decoders = {m.id: m for m in client.models.list().data}["SmolLM2-135M-Instruct"].decoders
        if needs not in decoders:
            pytest.fail(f"the default model should offer {needs!r}; it serves {decoders}")
    return client


@contextlib.contextmanager
def serve_in_thread(app) -> Iterator[str]:
    """Serve ``app`` (an in-process deployment's ASGI app) with uvicorn on a free port, on a
    thread; yields the base URL and stops the server on exit. The engine is the caller's."""
    import uvicorn

    from dualserve.server.lifecycle import bind_port

    sock = bind_port("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
