"""Reliability through the real server: bad values are refused at admission, structured output
ends, and one bad request never hurts its neighbours (issue 15).

* Values that once answered 500 (and failed their batch) get a 400 in OpenAI's shape, or are
  served: penalties on diffusion, an extreme repetition_penalty, an empty /infill, template
  kwargs that collide with the render arguments, malformed past tool calls, schemas nested
  ~970 deep, unbounded stop_token_ids.
* The Paris-facts schema at temperature 0 ends in valid JSON within max_tokens on ar and eagle.
* Blast radius: on each decoder, one bad request beside three good streams; the good ones
  finish exactly as they do alone.
* An idle keep-alive connection stays open longer than clients keep it pooled.
"""

from __future__ import annotations

import json
import threading
import time
from http.client import HTTPConnection
from typing import Any, Iterator

import httpx
import jsonschema
import openai
import pytest
from server_fixture import sdk_client

MODEL = "SmolLM2-135M-Instruct"
PARIS = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                                          "population_millions": {"type": "number"}},
         "required": ["city", "country", "population_millions"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def client(server_url: str) -> openai.OpenAI:
    return sdk_client(server_url, needs="eagle")


@pytest.fixture(scope="module")
def http(server_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server_url, timeout=300) as c:
        yield c


def nested(depth: int) -> str:
    """JSON text of a schema nested ``depth`` objects deep (two JSON levels each); written as text,
    since json.dumps itself recurses once per level."""
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth


def post_text(http: httpx.Client, path: str, body: str) -> httpx.Response:
    return http.post(path, content=body, headers={"content-type": "application/json"})


def assert_400(response: httpx.Response, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error
    return error


# ---- refused at admission ----------------------------------------------------------------

@pytest.mark.parametrize("body", [{}, {"input_prefix": "", "input_suffix": ""}])
def test_empty_infill_is_a_400(http, body):
    assert_400(http.post("/infill", json=body), "input_prefix")


def test_infill_with_only_a_suffix_is_served(http):
    r = http.post("/infill", json={"input_suffix": "\nreturn x\n", "n_predict": 4, "temperature": 0})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("kwargs", [{"self": 1}, {"messages": []}, {"add_generation_prompt": False}])
def test_template_kwargs_that_collide_with_render_arguments_are_a_400(http, kwargs):
    body = {"messages": CHAT, "max_tokens": 2, "chat_template_kwargs": kwargs}
    assert_400(http.post("/v1/chat/completions", json=body), "chat_template_kwargs")


@pytest.mark.parametrize("calls", [[{}], [{"function": "x"}], [{"function": {"name": 3}}], "x",
                                   [{"type": "x", "function": {"name": "f", "arguments": "{}"}}]])
def test_malformed_past_tool_calls_are_a_400(http, calls):
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "1", "content": "sunny"}]
    r = http.post("/v1/chat/completions", json={"messages": messages, "tools": [TOOL], "max_tokens": 2})
    if calls == "x":
        assert r.status_code == 400  # msgspec refuses the type
        return
    assert assert_400(r)["param"].startswith("messages[1].tool_calls")


def test_well_formed_past_tool_calls_are_served(http):
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    r = http.post("/v1/chat/completions", json={"messages": messages, "tools": [TOOL], "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_schemas_nested_too_deep_are_a_400(http):
    deep = nested(480)  # ~960 levels, under msgspec's own limit
    tool = '{"type": "function", "function": {"name": "f", "parameters": %s}}' % deep
    head = '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, '
    assert_400(post_text(http, "/v1/chat/completions", head + '"tools": [%s]}' % tool), "tools[0]")
    fmt = '{"type": "json_schema", "json_schema": {"name": "x", "schema": %s}}' % deep
    assert_400(post_text(http, "/v1/chat/completions", head + '"response_format": %s}' % fmt),
               "response_format.json_schema.schema")


@pytest.mark.parametrize("field,value", [("repetition_penalty", 1e-300), ("repetition_penalty", 0),
                                         ("repetition_penalty", 1e6), ("presence_penalty", 2.5),
                                         ("frequency_penalty", -3), ("stop_token_ids", list(range(10_000))),
                                         ("stop_token_ids", [10 ** 9])])
def test_out_of_range_values_are_a_400(http, field, value):
    body = {"prompt": "Hi", "max_tokens": 2, field: value}
    assert_400(http.post("/v1/completions", json=body), field)


@pytest.mark.parametrize("decoder", ["ar", "eagle", "diffusion"])
def test_penalties_are_served_on_every_decoder(client, decoder):
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0.7, seed=1,
                                  presence_penalty=0.5, frequency_penalty=0.5,
                                  extra_body={"decoder": decoder, "repetition_penalty": 0.01})
    assert r.choices[0].finish_reason in ("length", "stop")


# ---- structured output ends ------------------------------------------------------------------

@pytest.mark.parametrize("decoder", ["ar", "eagle"])
@pytest.mark.parametrize("max_tokens", [60, None])
def test_paris_facts_end_in_valid_json(client, decoder, max_tokens):
    """The issue's case: greedy digits never ended. Bounded numbers (and the default max_tokens) end it."""
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give me facts about Paris as JSON."}], temperature=0,
        max_tokens=max_tokens, extra_body={"decoder": decoder},
        response_format={"type": "json_schema", "json_schema": {"name": "facts", "schema": PARIS}})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    jsonschema.validate(json.loads(r.choices[0].message.content), PARIS)


# ---- blast radius ----------------------------------------------------------------------------

BAD = {  # values that once failed their whole batch, and values the server refuses
    "ar": [{"logit_bias": {"0": 100}, "repetition_penalty": 0.01, "presence_penalty": -2},
           {"repetition_penalty": 1e-300}],
    "eagle": [{"repetition_penalty": 0.01, "temperature": 1.5, "top_p": 0.01},
              {"repetition_penalty": 1e-300}],
    "diffusion": [{"presence_penalty": 0.5, "frequency_penalty": 2, "repetition_penalty": 10},
                  {"stop_token_ids": [10 ** 9]}],
}


def stream_text(client: openai.OpenAI, prompt: str, decoder: str, extra: dict | None = None) -> tuple[str, str]:
    """(text, finish_reason) of a streamed greedy completion."""
    text, finish = [], None
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                       extra_body={"decoder": decoder, "ignore_eos": True, **(extra or {})})
    for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
    return "".join(text), finish


@pytest.mark.parametrize("decoder", ["ar", "eagle", "diffusion"])
def test_one_bad_request_beside_three_good_ones(client, decoder):
    prompts = ["The capital of France is", "def fib(n):", "Once upon a time"]
    alone = [stream_text(client, p, decoder) for p in prompts]
    results: dict[int, Any] = {}

    def good(i: int) -> None:
        results[i] = stream_text(client, prompts[i], decoder)

    def bad(j: int, extra: dict) -> None:
        try:
            results[10 + j] = stream_text(client, "Hi there", decoder, extra)
        except openai.BadRequestError as e:
            results[10 + j] = e.status_code

    threads = [threading.Thread(target=good, args=(i,)) for i in range(3)]
    threads += [threading.Thread(target=bad, args=(j, extra)) for j, extra in enumerate(BAD[decoder])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert [results.get(i) for i in range(3)] == alone
    assert all(f == "length" for _, f in alone)
    for j in range(len(BAD[decoder])):  # each bad one is served or refused, never a 5xx
        assert results.get(10 + j) == 400 or results[10 + j][1] in ("length", "stop")


def test_infill_n_predict_follows_llama_cpp(http) -> None:
    """n_predict -1 is llama.cpp's "no limit": the endpoint's default; 0 prefills the prompt into
    the cache and answers an empty completion, as llama.cpp does (llama.vscode warms its cache so)."""
    body = {"input_prefix": "def add(a, b):\n    return", "temperature": 0, "decoder": "ar"}
    r = http.post("/infill", json={**body, "n_predict": -1})
    assert r.status_code == 200 and r.json()["tokens_predicted"] <= 64
    r = http.post("/infill", json={**body, "n_predict": 0})
    assert r.status_code == 200 and r.json()["content"] == "" and r.json()["tokens_predicted"] == 0


def test_an_idle_connection_outlives_clients_connection_pools(server_url: str) -> None:
    """A client pools a connection after a response and sends its next request on it: httpx (the
    openai SDK's) for up to 5 s idle. A server that closed idle connections after 5 s, as uvicorn does
    by default, raced it: a request sent as the server closed failed with a connection error
    (`--timeout-keep-alive`, 75 s)."""
    host, port = server_url.removeprefix("http://").rsplit(":", 1)
    conn = HTTPConnection(host, int(port), timeout=30)
    try:
        for idle in (0.0, 6.0):
            time.sleep(idle)
            conn.request("GET", "/v1/models")
            response = conn.getresponse()
            assert response.status == 200 and json.loads(response.read())["data"]
    finally:
        conn.close()
