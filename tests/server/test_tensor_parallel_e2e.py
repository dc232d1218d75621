"""``dualserve serve --tensor-parallel-size 2`` end to end, on a tiny checkpoint.

The server is started as a user starts it; the same greedy request is answered by a one-rank and
a two-rank server alike; SIGTERM stops every rank; and a rank killed mid-request gives the client
an OpenAI-shaped error, ``/health`` reports the failure, and the server exits non-zero.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from polling import gone
from server_fixture import free_port, log_tail, wait_healthy
from tiny_twin import write_tiny_llama


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("llama"))


def children(pid: int) -> list[int]:
    """Direct child processes of ``pid`` (Linux /proc)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out += [int(c) for c in text]
    return out


def rank_pids(pid: int) -> list[int]:
    """The spawned ranks among the server's children (not multiprocessing's resource tracker)."""
    return [c for c in children(pid) if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text(errors="replace")]


def serve(model: Path, tp: int, log: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "dualserve.server.cli", "serve", "--model", str(model), "--eagle", "none",
           "--twin", "none", "--quantization", "none", "--num-blocks", "64", "--threads", "1", "--port", str(port),
           "--tensor-parallel-size", str(tp), "--tp-timeout", "120", "--tp-heartbeat", "2", "--shutdown-timeout", "5",
           *extra]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, log)
    return proc, url


def complete(url: str, max_tokens: int = 16) -> list[int]:
    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    out = client.completions.create(model=client.models.list().data[0].id, prompt="the capital of",
                                    max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
    return out.choices[0].text


def test_two_ranks_answer_as_one_and_stop_together(llama, tmp_path):
    one, url = serve(llama, 1, tmp_path / "one.log")
    try:
        want = complete(url)
    finally:
        one.terminate()
        one.wait(30)
    proc, url = serve(llama, 2, tmp_path / "two.log")
    ranks = rank_pids(proc.pid)
    try:
        assert len(ranks) == 1
        assert complete(url) == want
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log_tail(tmp_path / "two.log")
    finally:
        if proc.poll() is None:
            proc.kill()
    for pid in ranks:  # a clean shutdown stops every rank
        assert gone(pid)


def test_a_killed_rank_errors_requests_reports_health_and_exits_nonzero(llama, tmp_path):
    log = tmp_path / "serve.log"
    proc, url = serve(llama, 2, log)
    try:
        (rank,) = rank_pids(proc.pid)
        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        stream = client.completions.create(model=model, prompt="the capital of", max_tokens=400, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        events = iter(stream)
        next(events)  # generation is under way
        os.kill(rank, signal.SIGKILL)
        with pytest.raises(Exception) as failed:  # the stream ends with an OpenAI-shaped error event
            for _ in events:
                pass
        assert "error" in str(failed.value).lower()
        health = httpx.get(f"{url}/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert proc.wait(60) == 1, log_tail(log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(15)


def test_a_busy_port_fails_before_any_rank_starts(llama, tmp_path):
    """The port is held before the ranks start, so their own sockets can never take it."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        cmd = [sys.executable, "-m", "dualserve.server.cli", "serve", "--model", str(llama), "--port",
               str(busy.getsockname()[1]), "--tensor-parallel-size", "2", "--threads", "1"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "cannot listen on 127.0.0.1:" in lines[0], done.stderr
