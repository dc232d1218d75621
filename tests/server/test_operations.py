"""Operations and IDE surface: status page (headless Chromium), auth, metrics, /infill, keystroke aborts."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from litestar.testing import TestClient

from dualserve.decoders.deployment import PoolSpec, build_deployment
from dualserve.decoders.engine.engine import EngineSnapshot
from dualserve.models.loader import load_model
from dualserve.server.app import AppState, create_app
from dualserve.server.metrics import Metrics
from dualserve.server.router import Router
from dualserve.server.service import ServedModel, Service

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def secured_app(default_gguf: Path, cache_dir: Path):
    """The real app and engine in-process, with an API key and a node cost."""
    loaded = load_model(default_gguf, name="SmolLM2-135M-Instruct", cache_dir=cache_dir)
    dep = build_deployment([loaded], pool=PoolSpec(num_blocks=256))
    served = {"SmolLM2-135M-Instruct": ServedModel("SmolLM2-135M-Instruct", loaded.tokenizer, 2048,
                                                   dep.engine.decoders_for("SmolLM2-135M-Instruct"))}
    metrics = Metrics(node_cost_per_hour=3.0)
    service = Service(dep.engine, served, Router(), metrics=metrics)
    dep.engine.start()
    app = create_app(AppState(service=service, metrics=metrics, api_key="sk-local", body_limit=64 * 1024))
    with TestClient(app) as client:
        yield client
    dep.engine.shutdown()


def test_api_key_required_with_openai_shape(secured_app):
    r = secured_app.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 401
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
    r = secured_app.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                         headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    ok = secured_app.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 0},
                          headers={"Authorization": "Bearer sk-local"})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    for header in ("Bearer  sk-local", "bearer sk-local", "Bearer sk-local ", "Bearer sk-local\t", "sk-local",
                   "Bearer sk-loca", "Bearer sk-local2", "Basic sk-local"):  # exactly "Bearer KEY"
        r = secured_app.get("/v1/models", headers={"Authorization": header})
        assert r.status_code == 401, header
    assert secured_app.get("/v1/models", headers={"Authorization": "Bearer sk-local"}).status_code == 200
    assert secured_app.get("/health").status_code == 200  # probes stay open
    assert secured_app.get("/metrics").status_code == 401


def test_body_limit_is_a_4xx(secured_app):
    r = secured_app.post("/v1/completions", content=b'{"prompt": "' + b"x" * 100_000 + b'"}',
                         headers={"Authorization": "Bearer sk-local", "Content-Type": "application/json"})
    assert r.status_code == 413
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_metrics_cover_requests_tokens_latency_pool_and_cost(secured_app):
    auth = {"Authorization": "Bearer sk-local"}
    secured_app.post("/v1/chat/completions", headers=auth, json={
        "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "temperature": 0})
    text = secured_app.get("/metrics", headers=auth).text
    assert metric(text, "dualserve_requests_total", decoder="ar") >= 1
    assert metric(text, "dualserve_generation_tokens_total", decoder="ar") >= 4
    assert metric(text, "dualserve_prompt_tokens_total", decoder="ar") > 0
    assert metric(text, "dualserve_time_to_first_token_seconds_count", decoder="ar") >= 1
    assert metric(text, "dualserve_inter_token_latency_seconds_count", decoder="ar") >= 1
    assert metric(text, "dualserve_forward_passes_count", decoder="ar") >= 1
    assert metric(text, "dualserve_tokens_per_forward_count", decoder="ar") >= 1
    assert "dualserve_kv_pool_usage" in text and "dualserve_device_utilisation" in text
    assert metric(text, "dualserve_cost_per_million_tokens", decoder="ar") > 0
    content_type = secured_app.get("/metrics", headers=auth).headers["content-type"]
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"  # the charset once
    assert secured_app.get("/status.json").status_code == 401  # utilisation and cost are behind the key
    status = secured_app.get("/status.json", headers=auth).json()
    assert "ar" in status["now"]["decoders"] and status["history"]
    assert secured_app.get("/").status_code == 200  # the page is open, and asks for the key


def test_metrics_read_the_engine_snapshot_alone():
    """Metrics see the engine through ``snapshot()`` only: a stand-in with nothing else renders."""
    class Snapshotted:
        def snapshot(self) -> EngineSnapshot:
            return EngineSnapshot(running=3, waiting=5, capacity=7, pool_blocks=64, pool_usage=0.25,
                                  busy_seconds=1.0)

    metrics = Metrics()
    text = metrics.render(Snapshotted()).decode()
    assert metric(text, "dualserve_requests_running") == 3 and metric(text, "dualserve_requests_waiting") == 5
    assert metric(text, "dualserve_running_capacity") == 7 and metric(text, "dualserve_kv_pool_blocks") == 64
    assert metric(text, "dualserve_kv_pool_usage") == 0.25
    assert metrics.refresh(Snapshotted())["pool_usage"] == 0.25


def test_infill_llamacpp_shape(server_url):
    r = httpx.post(f"{server_url}/infill", json={
        "input_prefix": "def add(a, b):\n    ", "input_suffix": "\n\nprint(add(1, 2))\n", "n_predict": 8,
        "input_extra": [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}],
        "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert isinstance(body["content"], str) and body["stop"] is True and body["tokens_predicted"] >= 1
    assert r.headers["x-dualserve-decoder"]
    # Routed by auto, the reason says the request is infill (natively, or with FIM tokens).
    assert r.headers["x-dualserve-route-reason"].startswith("infill"), r.headers["x-dualserve-route-reason"]


def test_newer_keystroke_aborts_older_request_at_once(server_url):
    """An IDE cancels the in-flight completion when the user types: it must stop using compute at once."""
    long_body = {"model": "SmolLM2-135M-Instruct", "prompt": "def main():\n", "max_tokens": 2000, "stream": True,
                 "temperature": 0.8, "ignore_eos": True, "extra_body": None}
    long_body.pop("extra_body")
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", f"{server_url}/v1/completions", json=long_body) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: ") and '"text"' in line:
                    break  # the first token arrived; the user types again
        aborted_at = time.monotonic()
        newer = client.post(f"{server_url}/v1/completions", json={
            "prompt": "def main():\n    pri", "max_tokens": 4, "temperature": 0})
        assert newer.status_code == 200
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            text = client.get(f"{server_url}/metrics").text
            if metric(text, "dualserve_requests_running") == 0 and metric(
                    text, "dualserve_requests_total", status="abort") >= 1:
                break
            time.sleep(0.1)
        assert metric(text, "dualserve_requests_running") == 0
        assert metric(text, "dualserve_requests_total", status="abort") >= 1
        # The 2000-token request is gone long before it could have finished.
        assert time.monotonic() - aborted_at < 10


def ar_in_status_window(server_url: str) -> None:
    """Decode a few ar tokens, then wait until /status.json counts them (its window is 60 s, so
    each browser run starts from fresh data however slowly a loaded machine gets there)."""
    httpx.post(f"{server_url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "decoder": "ar"},
               timeout=300).raise_for_status()
    deadline = time.monotonic() + 60
    while "ar" not in httpx.get(f"{server_url}/status.json", timeout=60).json()["now"]["decoders"]:
        assert time.monotonic() < deadline, "the ar tokens never reached /status.json"
        time.sleep(0.2)


def headless_chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,800",
             # Virtual time waits for the page's fetch of /status.json (pending network pauses it), then
             # runs the page's 2 s refresh timer twice: no wall-clock sleep to outrun on a loaded machine.
             "--virtual-time-budget=5000"]
    # Generous: Chromium itself can take a minute to start while the machine is saturated.
    return subprocess.run([CHROMIUM, *flags, *args], check=True, timeout=300, capture_output=True, text=True)


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_status_page_renders_in_headless_chromium(server_url, tmp_path):
    ar_in_status_window(server_url)
    shot = tmp_path / "status.png"
    headless_chromium(tmp_path, f"--screenshot={shot}", f"{server_url}/")
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    ar_in_status_window(server_url)
    dom = headless_chromium(tmp_path, "--dump-dom", f"{server_url}/").stdout
    assert "dualserve" in dom and dom.count("<canvas") == 3
    assert "start with --node-cost-per-hour" in dom  # the fixture's server runs without a node cost
    # The page's script filled the "Now" table from /status.json ...
    assert re.search(r"<td>ar</td>", dom), re.findall(r'<table id="now">.*?</table>', dom)
    # ... and drew the throughput and utilisation charts from its history, with ar in the legend.
    points = {re.search(r'id="(\w+)"', tag)[1]: int(re.search(r'data-points="(\d+)"', tag)[1])
              for tag in re.findall(r"<canvas[^>]*data-points[^>]*>", dom)}
    assert points.get("tput", 0) >= 1 and points.get("util", 0) >= 1, (points, re.findall(r"<canvas[^>]*>", dom))
    assert re.search(r'id="lg1">.*?&#9632; ar|id="lg1">.*?\u25a0 ar', dom), re.findall(r'id="lg1">.*?</div>', dom)
