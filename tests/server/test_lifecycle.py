"""The server's life as an operator sees it (issue 15): the start-up summary, a busy port, and the
SIGTERM drain, on real ``dualserve serve`` processes.

* A second server on a busy port fails before loading, with one line and exit status 2.
* The start-up log names the model and format, decoders, device, dtype/threads, the KV pool
  in blocks and MB, the kernels, the compiled graphs still to come, the URL and how to stop.
* SIGTERM with streams running: new requests get 503 with Retry-After, short streams finish
  normally, long ones are ended after --shutdown-timeout with a final chunk and [DONE], and
  the process exits 0.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from types import SimpleNamespace

import httpx
import pytest
import torch
from server_fixture import free_port, log_tail, wait_healthy

from dualserve.decoders.deployment import CompileSpec
from dualserve.decoders.engine.compile.compile_worker import CompileWorker
from dualserve.decoders.engine.engine import EngineConfig
from dualserve.server.lifecycle import compile_note, startup_lines

MODEL = "SmolLM2-135M-Instruct"


def serve_cmd(port: int, cache_dir: Path, policy: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "dualserve.server.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--cache-dir", str(cache_dir), "--no-compile", "--router-policy", str(policy), *extra]


@pytest.fixture
def policy(tmp_path: Path) -> Path:
    path = tmp_path / "policy.json"
    path.write_text("{}")
    return path


def test_busy_port_fails_at_once_with_one_line(default_gguf: Path, cache_dir: Path, policy: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        started = time.monotonic()
        done = subprocess.run(serve_cmd(port, cache_dir, policy), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "cannot listen on 127.0.0.1:" in lines[0] and "--port" in lines[0], done.stderr
    assert "loaded" not in done.stderr  # it failed before loading the model
    assert time.monotonic() - started < 60


def test_startup_lines_name_the_kernels_and_the_graphs_still_to_build() -> None:
    worker, release = CompileWorker(), threading.Event()
    worker.submit(lambda: release.wait(10))
    worker.submit(lambda: None)
    runner = SimpleNamespace(kv=SimpleNamespace(k=[torch.zeros(4)], v=[torch.zeros(4)], dtype=torch.float32),
                             compiled=SimpleNamespace(packaged=True))
    loaded = SimpleNamespace(model=torch.nn.Linear(2, 2), path=Path("m.gguf"), quantization="int4")
    dep = SimpleNamespace(models={"m": loaded}, runners={"m": runner}, compile=CompileSpec(worker=worker),
                          engine=SimpleNamespace(config=EngineConfig(num_blocks=8)))
    served = {"m": SimpleNamespace(decoders=["ar"], max_model_len=64)}
    try:
        lines = startup_lines(dep, served, "http://h:1", "cpu", 2, 30.0, "dot8 and attend_rows (AVX-512)")
    finally:
        release.set()
    assert "kernels: dot8 and attend_rows (AVX-512)" in lines
    note = next(line for line in lines if line.startswith("compiled steps:"))
    assert note.startswith("compiled steps: 2 graphs to build or load"), note
    assert "s per graph on 2 cores, the decode graph first, then 1 at a time" in note, note
    deadline = time.monotonic() + 10
    while worker.busy and time.monotonic() < deadline:
        time.sleep(0.05)
    assert compile_note(dep) is None  # nothing left to build: no note
    dep.compile = None
    assert not any(line.startswith(("kernels", "compiled")) for line in startup_lines(dep, served, "u", "cpu", 1, 1))


def stream(url: str, max_tokens: int, out: list, first: threading.Event) -> None:
    """One streamed completion: records its events, then "DONE" or the error that cut it."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True, "decoder": "ar"}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out.append(line[6:])
                    first.set()
    except httpx.HTTPError as e:
        out.append(f"cut: {type(e).__name__}")
    first.set()


def test_sigterm_drains_streams_and_exits_zero(default_gguf: Path, cache_dir: Path, policy: Path,
                                               tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "dualserve.log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen(serve_cmd(port, cache_dir, policy, "--shutdown-timeout", "8"), stdout=sink,
                                stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, proc, log)
        text = log.read_text()
        for needle in (f"model {MODEL} (GGUF", "decoders: ar", "eagle", "diffusion", "device cpu",
                       "torch threads", "KV pool", "blocks of 16 tokens", "MB", f"serving {url}/v1",
                       "stop with Ctrl+C or SIGTERM"):
            assert needle in text, f"start-up log lacks {needle!r}:\n{text}"

        # Two streams that finish within the drain, four that cannot.
        plan = [12, 12, 4000, 4000, 4000, 4000]
        outs: list[list[str]] = [[] for _ in plan]
        firsts = [threading.Event() for _ in plan]
        threads = [threading.Thread(target=stream, args=(url, n, out, ev), daemon=True)
                   for n, out, ev in zip(plan, outs, firsts)]
        for t in threads:
            t.start()
        for ev in firsts:
            assert ev.wait(120), log_tail(log)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        assert refused.status_code == 503 and refused.headers["Retry-After"]
        assert refused.json()["error"]["code"] == "server_shutting_down"
        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 503 and health.json() == {"status": "draining"}
        assert httpx.get(f"{url}/metrics", timeout=10).status_code == 200  # reads stay open
        assert proc.wait(timeout=60) == 0, log_tail(log)
        for t in threads:
            t.join(timeout=30)
        for n, out in zip(plan, outs):
            assert out and out[-1] == "[DONE]", (n, out[-3:], log_tail(log))
            finals = [c["finish_reason"] for c in (json.loads(e)["choices"][0] for e in out[:-1])
                      if c["finish_reason"]]
            assert finals == (["length"] if n == 12 else ["abort"]), (n, finals)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_an_unsupported_architecture_is_one_line(tmp_path: Path, command: str) -> None:
    """A GGUF of a family this build does not load: one line naming it and the supported list, exit 2."""
    import gguf
    import numpy as np

    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    args = [sys.executable, "-m", "dualserve.server.cli", command, "--model", str(path), "--cache-dir", str(tmp_path),
            "--no-compile", *(["hello"] if command == "generate" else ["--port", str(free_port())])]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("dualserve: unsupported GGUF architecture 'falcon'") and "llama" in last
    assert "Traceback" not in done.stderr
