"""End to end: the real ``openai`` SDK (and raw httpx for malformed bodies) against a live server.

One server on the default model serves the whole module (see ``conftest.py``). Generations are
greedy and short so the module stays fast on 2 CPU cores. Checked:

* the happy paths: completions, chat, streaming with ``include_usage``, the prompt forms
  (string, list of strings, token ids, list of token-id lists), stop strings, ``n``,
  logprobs in both formats, ``/v1/models``, the ``x-dualserve-decoder`` header;
* greedy chat knows the capital of France;
* ``/health`` answers while a generation runs; a client that drops a stream midway (or times out
  on a non-streamed request) has its request leave the engine (``/metrics`` shows nothing
  running), and the server stays healthy and serving;
* every bad request gets OpenAI's error shape with a 4xx status, never a 500.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from dualserve.models.loader import converted_dir
from dualserve.models.tokenizer import Tokenizer

SHORT = 8  # max_tokens for most generations
VALID_DECODERS = ("ar", "eagle", "diffusion", "auto")


@pytest.fixture(scope="module")
def client(server_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def http(server_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tokenizer(server_url: str, default_gguf: Path, cache_dir: Path) -> Tokenizer:
    """The served tokenizer, read from the conversion the server made of the default GGUF."""
    return Tokenizer.from_hf_dir(converted_dir(default_gguf, cache_dir))


def greedy_completion(client: openai.OpenAI, model: str, prompt: Any, max_tokens: int = SHORT, **kw):
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, **kw)


def chat(client: openai.OpenAI, model: str, text: str, max_tokens: int = SHORT, **kw):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                          max_tokens=max_tokens, temperature=0, **kw)


# ---- happy paths -----------------------------------------------------------------------------


def test_models(client: openai.OpenAI, http: httpx.Client) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]
    assert models[0].object == "model" and isinstance(models[0].created, int)
    raw = http.get("/v1/models").json()
    assert raw["object"] == "list" and "ar" in raw["data"][0]["decoders"]
    assert raw["data"][0]["max_model_len"] > 0
    one = client.models.retrieve("SmolLM2-135M-Instruct")  # GET /v1/models/{model}
    assert one.id == models[0].id and one.created == models[0].created and one.object == "model"
    for missing in ("nope", "default"):  # only a served name: no default stands in for it here
        with pytest.raises(openai.NotFoundError) as err:
            client.models.retrieve(missing)
        assert err.value.body["code"] == "model_not_found" and missing in err.value.body["message"]


def test_an_endpoint_not_served_is_named_in_openai_s_shape(http: httpx.Client) -> None:
    for method, path, status in [("POST", "/v1/audio/transcriptions", 404), ("GET", "/v1/chat/completions", 405)]:
        r = http.request(method, path, json={})
        error = r.json()["error"]
        assert r.status_code == status and error["message"] == f"Invalid URL ({method} {path})", r.text
        assert error["type"] == "invalid_request_error"


def test_health(http: httpx.Client) -> None:
    r = http.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_completion(client: openai.OpenAI, model: str) -> None:
    out = greedy_completion(client, model, "The capital of France is")
    assert out.object == "text_completion" and out.model == model and out.id
    (choice,) = out.choices
    assert choice.index == 0 and choice.text.strip()
    assert choice.finish_reason in ("length", "stop")
    u = out.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= SHORT
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    if choice.finish_reason == "length":
        assert u.completion_tokens == SHORT


def test_chat_mentions_paris(client: openai.OpenAI, model: str) -> None:
    # (asked bare, the default model answers in French about the Étoile in w4a8, as llama.cpp's
    # server does on the same file; in one sentence it answers in every format)
    out = chat(client, model, "What is the capital of France? Answer in one sentence.", max_tokens=24)
    (choice,) = out.choices
    assert out.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert "Paris" in choice.message.content, choice.message.content


def test_streamed_chat_with_usage(client: openai.OpenAI, model: str) -> None:
    question = "Name a color."
    plain = chat(client, model, question)
    stream = chat(client, model, question, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)  # the SDK consumes `data: [DONE]` itself
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    content = [c for c in chunks if c.choices]
    assert all(c.usage is None for c in content)
    assert content[0].choices[0].delta.role == "assistant"
    assert content[-1].choices[0].finish_reason in ("stop", "length")
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in content)
    assert text == plain.choices[0].message.content  # greedy: streaming changes nothing
    assert content[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    assert usage_chunk.usage.completion_tokens == plain.usage.completion_tokens
    assert usage_chunk.usage.prompt_tokens == plain.usage.prompt_tokens


def test_streamed_completion_with_usage(client: openai.OpenAI, model: str) -> None:
    plain = greedy_completion(client, model, "Once upon a time")
    chunks = list(greedy_completion(client, model, "Once upon a time", stream=True,
                                    stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == plain.usage.total_tokens
    content = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in content) == plain.choices[0].text
    assert content[-1].choices[0].finish_reason == plain.choices[0].finish_reason


def test_stream_without_usage_has_no_usage_chunk(client: openai.OpenAI, model: str) -> None:
    chunks = list(chat(client, model, "Hi", max_tokens=3, stream=True))
    assert chunks and all(c.choices for c in chunks)
    assert chunks[-1].choices[0].finish_reason is not None


def test_decoder_header(client: openai.OpenAI, model: str) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0)
    served = {m.id: m for m in client.models.list().data}[model].decoders
    assert raw.headers["x-dualserve-decoder"] in served  # auto: whichever the policy picks
    assert raw.headers["x-dualserve-route-reason"]
    assert raw.parse().choices[0].message.content is not None
    raw = client.completions.with_raw_response.create(model=model, prompt="Hi", max_tokens=2,
                                                      extra_body={"decoder": "ar"})
    assert raw.headers["x-dualserve-decoder"] == "ar"
    raw = client.completions.with_raw_response.create(model=model, prompt="Hi", max_tokens=2,
                                                      extra_headers={"X-Dualserve-Decoder": "ar"})
    assert raw.headers["x-dualserve-decoder"] == "ar"
    with client.chat.completions.with_streaming_response.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, stream=True,
            extra_body={"decoder": "ar"}) as resp:
        assert resp.headers["x-dualserve-decoder"] == "ar"
        assert resp.headers["content-type"].startswith("text/event-stream")


def test_prompt_forms(client: openai.OpenAI, model: str, tokenizer: Tokenizer) -> None:
    texts = ["The sky is", "One, two,"]
    ids = [tokenizer.encode(t, add_special_tokens=True) for t in texts]
    single = [greedy_completion(client, model, t, max_tokens=4).choices[0].text for t in texts]

    batch = greedy_completion(client, model, texts, max_tokens=4)
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == single
    assert batch.usage.prompt_tokens == sum(len(i) for i in ids)

    one = greedy_completion(client, model, ids[0], max_tokens=4)
    assert [c.text for c in one.choices] == single[:1]

    many = greedy_completion(client, model, ids, max_tokens=4)
    assert [c.text for c in many.choices] == single


def test_stop_strings(client: openai.OpenAI, model: str) -> None:
    prompt = "Count: 1, 2, 3, 4,"
    full = greedy_completion(client, model, prompt, max_tokens=16).choices[0].text
    assert len(full) >= 6, full
    stop = full[len(full) // 2:len(full) // 2 + 2]
    expected = full[:full.index(stop)]
    out = greedy_completion(client, model, prompt, max_tokens=16, stop=[stop, "never-appears"])
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == "stop"
    streamed = greedy_completion(client, model, prompt, max_tokens=16, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected  # nothing past the stop


def test_n_choices(client: openai.OpenAI, model: str) -> None:
    out = client.completions.create(model=model, prompt="My favourite food is", max_tokens=4, n=2,
                                    temperature=0.9, seed=1)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert all(c.finish_reason in ("stop", "length") for c in out.choices)
    assert out.usage.completion_tokens <= 2 * 4
    greedy = greedy_completion(client, model, "My favourite food is", max_tokens=4, n=2)
    assert greedy.choices[0].text == greedy.choices[1].text  # greedy: both choices are the same
    c = chat(client, model, "Say hi", max_tokens=3, n=2)
    assert sorted(ch.index for ch in c.choices) == [0, 1]


def test_completion_logprobs(client: openai.OpenAI, model: str) -> None:
    out = greedy_completion(client, model, "The capital of France is", max_tokens=4, logprobs=2)
    (choice,) = out.choices
    lp = choice.logprobs
    n = out.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 1 <= len(top) <= 2
        assert all(v <= 0 for v in top.values())
        assert max(top.values()) == pytest.approx(value, abs=1e-5)  # greedy picks the top token
        assert token in top


def test_chat_logprobs(client: openai.OpenAI, model: str) -> None:
    out = chat(client, model, "Say hello", max_tokens=4, logprobs=True, top_logprobs=3)
    (choice,) = out.choices
    content = choice.logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert "".join(e.token for e in content) == choice.message.content
    for e in content:
        assert e.logprob <= 0 and bytes(e.bytes).decode("utf-8", "replace") == e.token
        assert len(e.top_logprobs) == 3
        assert e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-5)
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True)
    plain = chat(client, model, "Say hello", max_tokens=4)
    assert plain.choices[0].logprobs is None


# ---- concurrency and disconnects ----------------------------------------------------------------


def test_health_answers_during_generation(client: openai.OpenAI, model: str, http: httpx.Client) -> None:
    started = threading.Event()
    finished = threading.Event()
    errors: list[BaseException] = []

    def generate() -> None:
        try:
            stream = client.completions.create(model=model, prompt="Write a long story:", max_tokens=64,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True})
            for _ in stream:
                started.set()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
        finally:
            started.set()
            finished.set()

    worker = threading.Thread(target=generate, daemon=True)
    worker.start()
    assert started.wait(120)
    latencies = []
    for _ in range(3):
        t = time.perf_counter()
        assert http.get("/health", timeout=10).status_code == 200
        latencies.append(time.perf_counter() - t)
    answered_while_running = not finished.is_set()
    worker.join(180)
    assert not errors, errors
    assert answered_while_running, "the generation ended before /health was asked; raise max_tokens"
    assert max(latencies) < 5.0, latencies  # decode steps run off the event loop


def engine_load(http: httpx.Client) -> tuple[float, float]:
    """(requests running, requests waiting) from the Prometheus endpoint."""
    values = {}
    for line in http.get("/metrics").text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("dualserve_requests_running", "dualserve_requests_waiting"):
            values[name] = float(value)
    return values["dualserve_requests_running"], values["dualserve_requests_waiting"]


def assert_aborted(http: httpx.Client) -> None:
    """The engine drops a dropped request within a few steps; left running, it would take minutes."""
    deadline = time.monotonic() + 20
    while engine_load(http) != (0, 0):
        assert time.monotonic() < deadline, f"still running after the client left: {engine_load(http)}"
        time.sleep(0.1)


LONG = {"max_tokens": 2000, "extra_body": {"ignore_eos": True}}  # minutes of decoding if never aborted


def test_disconnect_midway_leaves_server_serving(client: openai.OpenAI, model: str, http: httpx.Client) -> None:
    for _ in range(2):
        stream = chat(client, model, "Tell me a very long story.", stream=True, **LONG)
        for i, _chunk in enumerate(stream):
            if i == 1:
                break
        stream.close()
        assert_aborted(http)
    assert http.get("/health").status_code == 200
    after = greedy_completion(client, model, "Hello", max_tokens=3)
    assert after.choices[0].finish_reason in ("stop", "length")


def test_client_timeout_on_non_streamed_request(client: openai.OpenAI, model: str, http: httpx.Client) -> None:
    """A non-streamed request whose client gives up is aborted; the server keeps serving."""
    body = {"model": model, "prompt": "Tell me a very long story.", "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=body, timeout=httpx.Timeout(30, read=1.0))
    assert_aborted(http)
    assert http.get("/health").status_code == 200
    after = greedy_completion(client, model, "Hello", max_tokens=3)
    assert after.choices[0].finish_reason in ("stop", "length")


# ---- errors --------------------------------------------------------------------------------------


def assert_error(r: httpx.Response, status: int, param: str | None = "<any>", code: str | None = "<any>") -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert "Traceback" not in err["message"]
    if param != "<any>":
        assert err["param"] == param, err
    if code != "<any>":
        assert err["code"] == code, err
    return err


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("body", [b'{"model": "x", "prompt": ', b"{not json}", b"\xff\xfe", b"[1, 2"],
                         ids=["truncated", "garbage", "bytes", "array"])
def test_malformed_json(http: httpx.Client, path: str, body: bytes) -> None:
    assert_error(http.post(path, content=body, headers={"content-type": "application/json"}), 400)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_empty_and_non_object_bodies(http: httpx.Client, path: str) -> None:
    assert_error(http.post(path, content=b""), 400)
    for body in (b"null", b"[]", b"42", b'"text"'):
        assert_error(http.post(path, content=body), 400)


def test_wrong_types(http: httpx.Client, model: str) -> None:
    err = assert_error(http.post("/v1/completions", json={"model": model, "prompt": "a", "max_tokens": "x"}), 400,
                       param="max_tokens")
    assert "max_tokens" in err["message"]
    assert_error(http.post("/v1/chat/completions", json={"model": model, "messages": "hi"}), 400,
                 param="messages")
    assert_error(http.post("/v1/completions", json={"model": model, "prompt": "a", "temperature": "hot"}), 400,
                 param="temperature")
    assert_error(http.post("/v1/completions", json={"model": model, "prompt": "a", "stream": "yes"}), 400,
                 param="stream")
    assert_error(http.post("/v1/chat/completions",
                      json={"model": model, "messages": [{"role": "wizard", "content": "hi"}]}), 400)
    for prompt in ([], [1, "a"], [[1], "a"], [[]], {"text": "a"}, 3):
        assert_error(http.post("/v1/completions", json={"model": model, "prompt": prompt}), 400, param="prompt")


def test_missing_prompt_and_messages(http: httpx.Client, model: str) -> None:
    assert_error(http.post("/v1/completions", json={"model": model}), 400, param="prompt")
    assert_error(http.post("/v1/chat/completions", json={"model": model}), 400, param="messages")
    assert_error(http.post("/v1/chat/completions", json={"model": model, "messages": []}), 400, param="messages")


def test_unknown_model(client: openai.OpenAI, http: httpx.Client) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert exc.value.status_code == 404
    assert exc.value.body["param"] == "model" and exc.value.body["code"] == "model_not_found"
    assert_error(http.post("/v1/completions", json={"model": "no-such-model", "prompt": "a"}), 404,
                 param="model", code="model_not_found")


@pytest.mark.parametrize("max_tokens", [-5, 0])
def test_non_positive_max_tokens(client: openai.OpenAI, model: str, max_tokens: int) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        greedy_completion(client, model, "a", max_tokens=max_tokens)
    assert exc.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        chat(client, model, "a", max_tokens=max_tokens, stream=True)


def test_oversize_max_tokens(http: httpx.Client, model: str) -> None:
    for path, extra in (("/v1/completions", {"prompt": "a"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]})):
        r = http.post(path, json={"model": model, "max_tokens": 10**7, **extra})
        assert_error(r, 400, param="max_tokens", code="context_length_exceeded")


def test_prompt_longer_than_context(http: httpx.Client, model: str) -> None:
    context = http.get("/v1/models").json()["data"][0]["max_model_len"]
    r = http.post("/v1/completions", json={"model": model, "prompt": [5] * (context + 10), "max_tokens": 1})
    assert_error(r, 400, code="context_length_exceeded")
    r = http.post("/v1/chat/completions",
             json={"model": model, "messages": [{"role": "user", "content": "hello " * (context + 10)}]})
    assert_error(r, 400, code="context_length_exceeded")


@pytest.mark.parametrize("where", ["body", "header"])
def test_unknown_decoder_hint(http: httpx.Client, model: str, where: str) -> None:
    body: dict[str, Any] = {"model": model, "prompt": "a", "max_tokens": 1}
    headers = {}
    if where == "body":
        body["decoder"] = "turbo"
    else:
        headers["X-Dualserve-Decoder"] = "turbo"
    for path in ("/v1/completions", "/v1/chat/completions"):
        payload = body if path == "/v1/completions" else {
            **{k: v for k, v in body.items() if k != "prompt"}, "messages": [{"role": "user", "content": "a"}]}
        err = assert_error(http.post(path, json=payload, headers=headers), 400, param="decoder")
        assert "turbo" in err["message"]
        assert all(name in err["message"] for name in VALID_DECODERS), err["message"]


def test_unknown_decoder_via_sdk(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        chat(client, model, "a", extra_body={"decoder": "turbo"})
    assert exc.value.body["param"] == "decoder"


@pytest.mark.parametrize("field,value", [("temperature", 5.0), ("temperature", -1.0), ("top_p", 0.0),
                                         ("top_p", 1.5), ("n", 100), ("n", 0), ("logprobs", 100),
                                         ("presence_penalty", 3.0)])
def test_invalid_sampling_values(http: httpx.Client, model: str, field: str, value: Any) -> None:
    r = http.post("/v1/completions", json={"model": model, "prompt": "a", "max_tokens": 1, field: value})
    assert_error(r, 400, param=field)


def test_token_ids_out_of_vocabulary(http: httpx.Client, model: str, tokenizer: Tokenizer) -> None:
    for bad in ([tokenizer.vocab_size], [-1]):
        assert_error(http.post("/v1/completions", json={"model": model, "prompt": bad}), 400, param="prompt")


def test_deeply_nested_json(http: httpx.Client) -> None:
    body = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert_error(http.post("/v1/completions", content=body), 400)


def test_seed_out_of_range(http: httpx.Client, model: str) -> None:
    r = http.post("/v1/completions", json={"model": model, "prompt": "a", "max_tokens": 1, "seed": 2**70})
    assert_error(r, 400, param="seed")


def test_unknown_route_and_method(http: httpx.Client) -> None:
    assert_error(http.get("/v1/nothing-here"), 404)
    assert_error(http.get("/v1/completions"), 405)


def test_errors_left_server_healthy(client: openai.OpenAI, model: str, http: httpx.Client) -> None:
    """Run last in the module: after every bad request above, the server still serves."""
    assert http.get("/health").status_code == 200
    assert greedy_completion(client, model, "Hi", max_tokens=2).choices[0].text is not None
