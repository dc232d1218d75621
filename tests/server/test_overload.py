"""Overload is bounded, through a real server and the real openai SDK (issue 15).

The app and a real engine on the default model run in this process behind uvicorn on 127.0.0.1,
with room for one running request (``max_num_seqs=1``), so a long stream makes every other
request queue. The wait estimator's thresholds are set per test, so each case is decided by
the rule under test, not by the machine's speed.

* A request still waiting after ``max_queue_wait`` ends: a 429 (``queue_timeout``, Retry-After)
  when collected; when streamed, an error event of the same shape and then ``data: [DONE]``.
  Nothing stays queued.
* A request whose estimated wait exceeds the bound is refused at once with a 429 and Retry-After,
  and counted in /metrics.
* Running work is bounded too (``--max-run-time``): on a host modelled as slow, a request that
  would slow a running stream past its promise waits and ends with a 429, while a short one that
  keeps every promise starts beside it and is answered.
* Arrays in request bodies are bounded: too many messages, tools, logit_bias entries, token-id
  prompts or content parts are a 400 naming the field.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from dualserve.decoders.deployment import PoolSpec, build_deployment
from collections import Counter

from dualserve.decoders.engine.admission import RunEstimator, WaitEstimator
from dualserve.decoders.engine.engine import Engine, EngineConfig
from dualserve.models.loader import load_model
from dualserve.server.app import AppState, create_app
from dualserve.server.metrics import Metrics
from dualserve.server.router import Router
from dualserve.server.service import ServedModel, Service, ServiceLimits
from server_fixture import serve_in_thread

MODEL = "SmolLM2-135M-Instruct"
QUEUE_WAIT = 1.5
HI = [{"role": "user", "content": "Hi"}]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def live(default_gguf: Path, cache_dir: Path) -> Iterator[tuple[str, Engine]]:
    loaded = load_model(default_gguf, name=MODEL, cache_dir=cache_dir)
    dep = build_deployment([loaded], EngineConfig(max_num_seqs=1, max_queue_wait=QUEUE_WAIT),
                           pool=PoolSpec(num_blocks=256))
    served = {MODEL: ServedModel(MODEL, loaded.tokenizer, 2048, dep.engine.decoders_for(MODEL))}
    metrics = Metrics()
    service = Service(dep.engine, served, Router(), ServiceLimits(), metrics=metrics)
    dep.engine.start()
    with serve_in_thread(create_app(AppState(service=service, metrics=metrics))) as url:
        yield url, dep.engine
    dep.engine.shutdown()


class Modelled(RunEstimator):
    """A slow host for the run bound: each step costs 0.2 s per running choice, one token a step."""

    def __init__(self) -> None:
        super().__init__(max_run_time=20.0, min_token_rate=4.0, max_batched_tokens=512)

    def observe(self, sample, seconds: float) -> None:
        pass

    def step_seconds(self, batch: Counter) -> float:
        return 0.2 * sum(batch.values())

    def tokens_per_step(self, key) -> float:
        return 1.0


@pytest.fixture(scope="module")
def bounded(default_gguf: Path, cache_dir: Path) -> Iterator[tuple[str, Engine]]:
    """Room for four running requests, on a host the run bound is told is slow."""
    loaded = load_model(default_gguf, name=MODEL, cache_dir=cache_dir)
    config = EngineConfig(max_num_seqs=4, max_queue_wait=QUEUE_WAIT, max_run_time=20.0)
    dep = build_deployment([loaded], config, pool=PoolSpec(num_blocks=256))
    dep.engine.run_bound = Modelled()
    dep.engine.door.admission = WaitEstimator(min_busy=math.inf)  # no wait estimate: the run bound decides
    served = {MODEL: ServedModel(MODEL, loaded.tokenizer, 2048, dep.engine.decoders_for(MODEL))}
    service = Service(dep.engine, served, Router(), ServiceLimits(), metrics=Metrics())
    dep.engine.start()
    with serve_in_thread(create_app(AppState(service=service, metrics=service.metrics))) as url:
        yield url, dep.engine
    dep.engine.shutdown()


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@contextlib.contextmanager
def long_stream(url: str) -> Iterator[None]:
    """A stream that holds the only place to run until the block exits (then the client leaves)."""
    started, leave = threading.Event(), threading.Event()

    def run() -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "temperature": 0,
                "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    started.set()
                if leave.is_set():
                    return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(120), "the long stream never started"
    try:
        yield
    finally:
        leave.set()
        thread.join(timeout=60)


def settle(engine: Engine, seconds: float = 30.0) -> None:
    """Wait until nothing runs, waits or holds a block."""
    deadline = time.monotonic() + seconds
    while engine.has_work() or engine.pool.num_used_blocks:
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.05)


def estimator(engine: Engine, min_busy: float) -> None:
    engine.door.admission = WaitEstimator(min_busy=min_busy)


def test_a_request_that_waits_too_long_ends_with_a_429(live) -> None:
    url, engine = live
    estimator(engine, min_busy=math.inf)  # no estimate: admitted, then it waits
    with long_stream(url):
        started = time.monotonic()
        with pytest.raises(openai.RateLimitError) as err:
            sdk(url).chat.completions.create(model=MODEL, messages=HI, max_tokens=4)
        assert QUEUE_WAIT <= time.monotonic() - started < QUEUE_WAIT + 30
        error = err.value.body
        assert error["code"] == "queue_timeout" and error["type"] == "rate_limit_error", error
        assert int(err.value.response.headers["Retry-After"]) >= 1
        with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=120,
                          json={"messages": HI, "max_tokens": 4, "stream": True}) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "queue_timeout"
        with pytest.raises(openai.APIError, match="waited"):
            for _ in sdk(url).completions.create(model=MODEL, prompt="Hi", max_tokens=4, stream=True):
                pass
        deadline = time.monotonic() + 10  # the count is published at the end of the engine's step
        while engine.num_queued():
            assert time.monotonic() < deadline, "a request stayed queued"
            time.sleep(0.05)
    settle(engine)
    assert sdk(url).completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text is not None
    metrics = httpx.get(f"{url}/metrics").text
    assert 'dualserve_requests_total{decoder="ar",status="queue_timeout"}' in metrics


def test_a_request_whose_estimated_wait_is_too_long_is_refused_at_once(live) -> None:
    url, engine = live
    settle(engine)
    with long_stream(url):
        estimator(engine, min_busy=0.0)  # measured from now: busy, and nothing finishes
        time.sleep(0.5)
        started = time.monotonic()
        with pytest.raises(openai.RateLimitError) as err:
            sdk(url).completions.create(model=MODEL, prompt="Hi", max_tokens=4)
        assert time.monotonic() - started < 5
        assert err.value.body["code"] == "server_overloaded" and "wait" in err.value.body["message"]
        assert 1 <= int(err.value.response.headers["Retry-After"]) <= 30
        r = httpx.post(f"{url}/infill", json={"input_prefix": "def f(x):\n", "n_predict": -1, "stream": True})
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    settle(engine)
    estimator(engine, min_busy=math.inf)
    assert sdk(url).completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices  # room again
    assert 'dualserve_requests_rejected_total{reason="queue_wait"} 2.0' in httpx.get(f"{url}/metrics").text


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": HI * 2049}, "messages"),
    ("/v1/chat/completions", {"messages": HI, "tools": [{"type": "function", "function": {"name": f"f{i}"}}
                                                         for i in range(129)]}, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 257}]},
     "messages"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {str(i): 1.0 for i in range(301)}}, "logit_bias"),
    ("/v1/completions", {"prompt": [[1, 2]] * 65}, "prompt"),
    ("/v1/completions", {"prompt": ["a"] * 65}, "prompt"),
    ("/v1/completions", {"prompt": [5] * 5000}, "prompt"),
    ("/v1/responses", {"input": [{"role": "user", "content": "hi"}] * 2049}, "input"),
    ("/infill", {"input_prefix": "x", "input_extra": [{"text": "a"}] * 257}, "input_extra"),
])
def test_arrays_in_request_bodies_are_bounded(live, path: str, body: dict, param: str) -> None:
    url, _ = live
    r = httpx.post(f"{url}{path}", json={"max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_the_sdk_reports_a_bound(live) -> None:
    url, _ = live
    with pytest.raises(openai.BadRequestError) as err:
        sdk(url).chat.completions.create(model=MODEL, messages=HI * 2049, max_tokens=2)
    assert err.value.body["code"] == "array_above_max_length" and "2048" in err.value.body["message"]


def test_a_request_that_would_slow_a_running_stream_past_its_promise_waits_then_gets_a_429(bounded) -> None:
    url, engine = bounded
    with long_stream(url):  # 2000 tokens, promised 500 s (4 tokens/s); modelled alone: 400 s
        started = time.monotonic()
        # 1000 more tokens beside it: the stream would take 600 s. It waits, and the wait bound ends it.
        with pytest.raises(openai.RateLimitError) as err:
            sdk(url).completions.create(model=MODEL, prompt="Hi", max_tokens=1000,
                                        extra_body={"ignore_eos": True})
        assert QUEUE_WAIT <= time.monotonic() - started < QUEUE_WAIT + 30
        assert err.value.body["code"] == "queue_timeout" and int(err.value.response.headers["Retry-After"]) >= 1
        # 4 tokens beside it keep both promises (1.6 s; the stream 400.8 s): it starts and is answered.
        reply = sdk(url).completions.create(model=MODEL, prompt="Hi", max_tokens=4, extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 4
        assert len(engine.scheduler.running) <= 2
    settle(engine)
    assert "dualserve_running_capacity" in httpx.get(f"{url}/metrics").text
