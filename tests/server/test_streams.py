"""Every stream ends cleanly, admission is fair, and a slow reader is bounded (issue 15, server side).

The app and a real engine run in this process behind a real uvicorn server on 127.0.0.1, so
a decoder can be made to fail on purpose: the ``ar`` decoder raises once a request with seed
``FAULT_SEED`` has produced a token. The openai SDK talks to it over HTTP.

* An engine failure or a request timeout after the first byte: an OpenAI error event, then
  ``data: [DONE]`` (infill: its stop chunk); the SDK raises ``APIError`` with the message.
* /metrics counts those requests as ``status="error"`` and ``status="timeout"``.
* A reader that falls more than ``max_buffered_deltas`` behind is ended (error event), its
  engine requests aborted.
* A grammar is compiled once per request, whatever its n.
* A client that leaves a non-streamed request aborts it without a server error in the log.
* Admission: one request may take at most half the waiting queue, several choices only while a
  quarter stays free for single-choice requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Iterator

import httpx
import msgspec
import openai
import pytest

from dualserve.decoders.deployment import PoolSpec, build_deployment
from dualserve.decoders.engine.engine import EngineConfig
from dualserve.models.loader import load_model
from dualserve.server.app import AppState, create_app
from dualserve.server.completions import CompletionHandler
from dualserve.server.errors import APIError
from dualserve.server.metrics import Metrics
from dualserve.server.protocol import CompletionRequest
from dualserve.server.router import Router
from dualserve.server.service import ServedModel, Service, ServiceLimits
from server_fixture import serve_in_thread

MODEL = "SmolLM2-135M-Instruct"
FAULT_SEED = 4242
LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0}

pytestmark = pytest.mark.usefixtures("one_thread")


@dataclasses.dataclass
class Live:
    url: str
    service: Service
    loaded: object


def inject_fault(engine) -> None:
    """The ar decoder raises for a request seeded FAULT_SEED once it has produced a token."""
    ar = engine.decoders[(MODEL, "ar")]
    step = ar.step

    def faulty(batch, emit):
        if any(s.request.params.seed == FAULT_SEED and len(s.request.output_ids) >= 1 for s in batch):
            raise RuntimeError("injected decoder failure")
        return step(batch, emit)

    ar.step = faulty


@pytest.fixture(scope="module")
def live(default_gguf: Path, cache_dir: Path) -> Iterator[Live]:
    loaded = load_model(default_gguf, name=MODEL, cache_dir=cache_dir)
    dep = build_deployment([loaded], pool=PoolSpec(num_blocks=256))
    inject_fault(dep.engine)
    served = {MODEL: ServedModel(MODEL, loaded.tokenizer, 2048, dep.engine.decoders_for(MODEL))}
    metrics = Metrics()
    service = Service(dep.engine, served, Router(), ServiceLimits(), metrics=metrics)
    dep.engine.start()
    with serve_in_thread(create_app(AppState(service=service, metrics=metrics))) as url:
        yield Live(url, service, loaded)
    dep.engine.shutdown()


@pytest.fixture
def limits(live: Live) -> Iterator[None]:
    saved = live.service.limits
    yield
    live.service.limits = saved


def events(url: str, path: str, body: dict) -> list[str]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def sdk(live: Live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "Once upon a time"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story"}]}),
])
def test_engine_failure_mid_stream_is_an_error_event_then_done(live: Live, path: str, body: dict) -> None:
    out = events(live.url, path, {**body, **LONG, "seed": FAULT_SEED})
    assert out[-1] == "[DONE]"
    error = json.loads(out[-2])["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "server_error"
    assert any("choices" in json.loads(e) for e in out[:-2])  # it had started: the failure came mid-stream


def test_infill_stream_ends_with_its_stop_chunk(live: Live) -> None:
    out = events(live.url, "/infill", {"input_prefix": "def f(x):\n    return ", "input_suffix": "\n",
                                       "n_predict": 400, "seed": FAULT_SEED, "decoder": "ar"})
    assert "error" in json.loads(out[-2]) and json.loads(out[-1]) == {"content": "", "stop": True}


def test_sdk_raises_on_the_error_event(live: Live) -> None:
    client = sdk(live)
    with pytest.raises(openai.APIError, match="internal error"):
        for _ in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                stream=True, seed=FAULT_SEED, max_tokens=400, temperature=0,
                                                extra_body={"ignore_eos": True}):
            pass
    with pytest.raises(openai.APIError, match="internal error"):
        for _ in client.completions.create(model=MODEL, prompt="Hi", stream=True, seed=FAULT_SEED, max_tokens=400,
                                           temperature=0, extra_body={"ignore_eos": True}):
            pass
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=3).choices[0].text  # still serving


def test_timeout_mid_stream_is_an_error_event_then_done(live: Live, limits: None) -> None:
    live.service.limits = dataclasses.replace(live.service.limits, request_timeout=1.0)
    started = time.monotonic()
    out = events(live.url, "/v1/completions", {"prompt": "Once upon a time", **LONG, "max_tokens": 1500})
    assert time.monotonic() - started < 30
    assert out[-1] == "[DONE]" and json.loads(out[-2])["error"]["type"] == "timeout_error"
    with pytest.raises(openai.APIError, match="timed out"):
        for _ in sdk(live).completions.create(model=MODEL, prompt="Hi", stream=True, max_tokens=1500,
                                              extra_body={"ignore_eos": True}):
            pass
    r = httpx.post(f"{live.url}/v1/completions", json={"prompt": "Hi", **LONG, "max_tokens": 1500}, timeout=60)
    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error"


def test_metrics_count_errors_and_timeouts_as_such(live: Live, limits: None) -> None:
    events(live.url, "/v1/completions", {"prompt": "Hi", **LONG, "seed": FAULT_SEED})
    live.service.limits = dataclasses.replace(live.service.limits, request_timeout=0.5)
    events(live.url, "/v1/completions", {"prompt": "Hi", **LONG, "max_tokens": 1500})
    text = httpx.get(f"{live.url}/metrics").text
    assert 'dualserve_requests_total{decoder="ar",status="error"}' in text
    assert 'dualserve_requests_total{decoder="ar",status="timeout"}' in text


def plan_for(service: Service, **body):
    request = msgspec.convert({"model": MODEL, "max_tokens": 2, **body}, CompletionRequest)
    return service.prepare(CompletionHandler(service, request, None).plan())


def test_a_slow_reader_is_ended_with_its_buffer_bounded(live: Live, limits: None) -> None:
    service = live.service
    service.limits = dataclasses.replace(service.limits, max_buffered_deltas=4)
    pool = service.engine.pool

    async def run() -> tuple[int, APIError | None]:
        job = service.start(plan_for(service, prompt="Once upon a time", max_tokens=200, ignore_eos=True))
        while not job.overflowed:  # nobody reads: the engine outruns the reader
            await asyncio.sleep(0.05)
        got, error = 0, None
        try:
            async for _ in service.deltas(job):
                got += 1
        except APIError as e:
            error = e
        return got, error

    got, error = asyncio.run(run())
    assert got == 4 and error is not None and error.code == "slow_reader"
    deadline = time.monotonic() + 10
    while pool.num_used_blocks and time.monotonic() < deadline:  # its engine request was aborted
        time.sleep(0.05)
    assert pool.num_used_blocks == 0


def test_admission_is_fair_between_requests(live: Live) -> None:
    """An engine that is not running keeps whatever is submitted queued."""
    dep = build_deployment([live.loaded], EngineConfig(max_waiting=16), PoolSpec(num_blocks=64))
    served = {MODEL: ServedModel(MODEL, live.loaded.tokenizer, 2048, dep.engine.decoders_for(MODEL))}
    service = Service(dep.engine, served, Router())

    def status(**body) -> int:
        try:
            service.start(plan_for(service, **body))
            return 200
        except APIError as e:
            return e.status

    async def run() -> None:
        assert status(prompt=["a"] * 3, n=3) == 400  # 9 choices: more than half the queue
        assert status(prompt=["a", "b"], n=4) == 200  # 8 choices
        assert status(prompt="c", n=4) == 200  # 12 queued
        assert status(prompt="d", n=2) == 429  # several choices: a quarter of the queue stays free...
        assert [status(prompt=f"p{i}") for i in range(5)] == [200] * 4 + [429]  # ...for single choices

    asyncio.run(run())
    dep.engine.shutdown()


def test_a_grammar_is_compiled_once_per_request(live: Live) -> None:
    compiler = live.service.engine.grammar_compiler(MODEL)
    compile_ = compiler.constraint
    calls = []
    compiler.constraint = lambda spec: calls.append(spec) or compile_(spec)
    try:
        r = httpx.post(f"{live.url}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Give me a JSON object."}], "n": 3, "max_tokens": 4,
            "response_format": {"type": "json_object"}})
    finally:
        del compiler.constraint
    assert r.status_code == 200 and len(r.json()["choices"]) == 3
    assert len(calls) == 1  # not once per choice


def test_a_client_leaving_a_collected_request_aborts_it_quietly(live: Live,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    errors = logging.getLogger("uvicorn.error")
    errors.addHandler(caplog.handler)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{live.url}/v1/completions", json={"prompt": "Hi", **LONG, "max_tokens": 1500}, timeout=1.0)
        deadline = time.monotonic() + 10
        while live.service.live and time.monotonic() < deadline:  # its engine request is aborted
            time.sleep(0.05)
        assert not live.service.live
    finally:
        errors.removeHandler(caplog.handler)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text  # no "Exception in ASGI app"
