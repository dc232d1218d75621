"""llama.cpp's native endpoints and the FIM endpoint, against the session's real server.

Checked, each with values: ``/tokenize`` <-> ``/detokenize`` round trips (``add_special``,
``parse_special``, ``with_pieces`` with byte-list pieces); ``/apply-template`` and
``/v1/chat/completions/input_tokens`` count what the chat path counts (the SDK's
``usage.prompt_tokens``, tools included); ``/infill`` and ``/completion`` with ``n_predict: 0``
answer an empty completion and fill the prefix cache, so the next request of that prefix reports
``tokens_cached``; ``/completion`` greedy equals ``/v1/completions`` greedy, streamed or not, with
llama.cpp's bookkeeping (``generation_settings.n_ctx``, ``timings``, ``stop_type``); and
``/v1/fim/completions`` equals ``/v1/completions`` with ``suffix`` at temperature 0, streamed or not,
in Mistral's chat-completion shape. Every bad request is a 4xx in OpenAI's error shape.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Iterator

import httpx
import openai
import pytest

from server_fixture import sdk_client

TIMING_KEYS = {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
               "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}
RESULT_KEYS = {"index", "content", "tokens", "stop", "model", "tokens_predicted", "tokens_evaluated",
               "generation_settings", "prompt", "has_new_line", "truncated", "stop_type", "stopping_word",
               "tokens_cached", "timings"}
HI = [{"role": "user", "content": "What is the capital of France?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def http(server_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def client(server_url: str) -> openai.OpenAI:
    return sdk_client(server_url)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> Any:
    return client.models.list().data[0]


def ok(response: httpx.Response) -> Any:
    assert response.status_code == 200, response.text
    return response.json()


def sse(http: httpx.Client, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def unique_code() -> str:
    """A file no earlier request has sent, so its blocks are not in the prefix cache yet."""
    tag = uuid.uuid4().hex
    return (f"# module {tag}\n\ndef subtract_{tag[:8]}(a, b):\n    \"\"\"Return a minus b for any two numbers.\"\"\"\n"
            "    return a - b\n\n\ndef multiply(a, b):\n    return a * b\n")


# ---- /tokenize, /detokenize ----------------------------------------------------------------------

def test_tokenize_detokenize_round_trip(http: httpx.Client) -> None:
    text = "def add(a, b):\n    return a + b  # sums <|im_start|>"
    ids = ok(http.post("/tokenize", json={"content": text}))["tokens"]
    assert ids and all(type(t) is int for t in ids)
    assert ok(http.post("/detokenize", json={"tokens": ids})) == {"content": text}
    literal = ok(http.post("/tokenize", json={"content": "<|im_start|>", "parse_special": False}))["tokens"]
    special = ok(http.post("/tokenize", json={"content": "<|im_start|>"}))["tokens"]
    assert len(special) == 1 and len(literal) > 1
    assert ok(http.post("/detokenize", json={"tokens": literal}))["content"] == "<|im_start|>"
    assert ok(http.post("/detokenize", json={})) == {"content": ""}


def test_tokenize_with_pieces_gives_bytes_where_a_piece_is_not_utf8(http: httpx.Client) -> None:
    text = "héllo 日本"
    plain = ok(http.post("/tokenize", json={"content": text, "add_special": True}))["tokens"]
    pieces = ok(http.post("/tokenize", json={"content": text, "with_pieces": True, "add_special": True}))["tokens"]
    assert [p["id"] for p in pieces] == plain
    assert any(isinstance(p["piece"], list) for p in pieces)  # 日 is split into byte tokens
    joined = b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode() for p in pieces)
    assert joined.decode() == text


# ---- /apply-template, /v1/chat/completions/input_tokens --------------------------------------------

@pytest.mark.parametrize("tools", [None, TOOLS])
def test_template_and_input_tokens_count_what_chat_counts(http: httpx.Client, client: openai.OpenAI,
                                                          tools: list | None) -> None:
    body: dict[str, Any] = {"messages": HI, **({"tools": tools} if tools else {})}
    prompt = ok(http.post("/apply-template", json=body))["prompt"]
    assert prompt.rstrip().endswith("assistant")  # the generation prompt is there
    counted = ok(http.post("/v1/chat/completions/input_tokens", json=body))
    tokens = ok(http.post("/tokenize", json={"content": prompt}))["tokens"]
    chat = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=1, temperature=0,
                                          **body)
    assert counted == {"input_tokens": chat.usage.prompt_tokens} and len(tokens) == chat.usage.prompt_tokens


# ---- n_predict 0: the prompt goes into the prefix cache ----------------------------------------------

def test_infill_n_predict_0_warms_the_cache_for_the_next_infill(http: httpx.Client) -> None:
    """llama.vscode's ``updateExtraContext``: the extra files, prefilled; the next request reuses them."""
    extra = [{"filename": "util.py", "text": unique_code()}]
    r = http.post("/infill", json={"input_prefix": "", "input_suffix": "", "input_extra": extra, "prompt": "",
                                   "n_predict": 0, "samplers": [], "cache_prompt": True})
    warm = ok(r)
    assert r.headers["x-dualserve-decoder"] == "ar" and set(warm) == RESULT_KEYS
    assert warm["content"] == "" and warm["tokens_predicted"] == 0 and warm["stop"] is True
    assert warm["tokens_cached"] == 0 and warm["timings"]["predicted_n"] == 0
    nxt = ok(http.post("/infill", json={"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n",
                                        "input_extra": extra, "n_predict": 4, "temperature": 0}))
    assert nxt["tokens_cached"] >= 16 and nxt["timings"]["cache_n"] == nxt["tokens_cached"]
    assert nxt["timings"]["prompt_n"] == nxt["tokens_evaluated"] - nxt["tokens_cached"]
    assert nxt["generation_settings"]["n_ctx"] > 0 and nxt["tokens_predicted"] == 4


def test_completion_n_predict_0_then_the_same_prompt_is_cached(http: httpx.Client) -> None:
    prompt = unique_code()
    warm = ok(http.post("/completion", json={"prompt": prompt, "n_predict": 0}))
    assert warm["content"] == "" and warm["tokens_predicted"] == 0 and warm["stop_type"] == "limit"
    again = ok(http.post("/completion", json={"prompt": prompt, "n_predict": 2, "temperature": 0}))
    assert again["tokens_cached"] >= 16 and again["tokens_evaluated"] == warm["tokens_evaluated"]


# ---- /completion -----------------------------------------------------------------------------------

def test_completion_greedy_equals_v1_completions(http: httpx.Client, client: openai.OpenAI, model: Any) -> None:
    prompt = "The capital of France is"
    ours = ok(http.post("/completion", json={"prompt": prompt, "n_predict": 6, "temperature": 0,
                                             "return_tokens": True}))
    openai_text = client.completions.create(model=model.id, prompt=prompt, max_tokens=6, temperature=0)
    assert set(ours) == RESULT_KEYS and ours["content"] == openai_text.choices[0].text
    assert len(ours["tokens"]) == ours["tokens_predicted"] == 6 and ours["stop_type"] == "limit"
    assert ours["generation_settings"]["n_ctx"] == model.max_model_len
    assert set(ours["timings"]) == TIMING_KEYS and ours["timings"]["predicted_n"] == 6
    assert ours["model"] == model.id and ours["prompt"] == prompt and ours["truncated"] is False
    events = sse(http, "/completion", {"prompt": prompt, "n_predict": 6, "temperature": 0, "stream": True})
    *partials, last = events
    assert all(e["stop"] is False and set(e) >= {"content", "tokens"} for e in partials)
    assert "".join(e["content"] for e in partials) == ours["content"]
    assert last["stop"] is True and last["content"] == "" and set(last) == RESULT_KEYS
    assert last["generation_settings"]["n_ctx"] == model.max_model_len and last["tokens_predicted"] == 6


def test_completion_token_prompts_and_stop_words(http: httpx.Client) -> None:
    ids = ok(http.post("/tokenize", json={"content": "The capital of France is", "add_special": True}))["tokens"]
    by_text = ok(http.post("/completion", json={"prompt": "The capital of France is", "n_predict": 6,
                                                "temperature": 0, "stop": ["."]}))
    # Two prompts (answered as a list): token ids, and token ids mixed with text.
    by_ids, mixed = ok(http.post("/completion", json={"prompt": [ids, ids[:3] + [" France is"]], "n_predict": 6,
                                                      "temperature": 0, "stop": ["."]}))
    assert by_text["stop_type"] == "word" and by_text["stopping_word"] == "."
    assert by_ids["content"] == mixed["content"] == by_text["content"]
    assert (by_ids["index"], mixed["index"]) == (0, 1)


def running(http: httpx.Client) -> float:
    lines = [line for line in http.get("/metrics").text.splitlines() if line.startswith("dualserve_requests_running")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


@pytest.mark.parametrize("path,body", [("/completion", {"prompt": "def main():\n"}),
                                       ("/infill", {"input_prefix": "def main():\n"})])
def test_a_client_that_leaves_a_stream_frees_its_request(http: httpx.Client, path: str, body: dict) -> None:
    with http.stream("POST", path, json={**body, "n_predict": 2000, "ignore_eos": True, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"stop":false' in line:
                break  # the first token arrived; the client goes away
    deadline = time.monotonic() + 10
    while running(http) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert running(http) == 0


# ---- /v1/fim/completions ---------------------------------------------------------------------------

def test_fim_equals_completions_with_suffix(http: httpx.Client, client: openai.OpenAI, model: Any) -> None:
    body = {"model": model.id, "prompt": "def add(a, b):\n    ", "suffix": "\n\nprint(add(1, 2))\n",
            "max_tokens": 8, "temperature": 0}
    expected = client.completions.create(**body).choices[0].text
    fim = ok(http.post("/v1/fim/completions", json={**body, "random_seed": 7}))
    assert fim["object"] == "chat.completion" and fim["choices"][0]["message"]["content"] == expected
    assert fim["choices"][0]["finish_reason"] in ("stop", "length") and fim["usage"]["completion_tokens"] >= 1
    chunks = sse(http, "/v1/fim/completions", {**body, "stream": True})
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


# ---- bad input -------------------------------------------------------------------------------------

@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, None),
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"content": "x", "with_pieces": "yes"}, "with_pieces"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, "tokens"),
    ("/apply-template", {"messages": []}, "messages"),
    ("/apply-template", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions/input_tokens", {}, "messages"),
    ("/v1/chat/completions/input_tokens", {"messages": HI, "tool_choice": "required"}, "tool_choice"),
    ("/completion", {}, "prompt"),
    ("/completion", {"prompt": []}, "prompt"),
    ("/completion", {"prompt": [10**9]}, "prompt"),
    ("/completion", {"prompt": [[1, 2], [True]]}, "prompt"),
    ("/completion", {"prompt": "x", "n_predict": "many"}, "n_predict"),
    ("/completion", {"prompt": "x", "temperature": 9}, "temperature"),
    ("/infill", {"n_predict": 0}, "input_prefix"),
    ("/infill", {"input_prefix": "x", "n_predict": 0, "top_p": 7}, "top_p"),
    ("/v1/fim/completions", {}, "prompt"),
    ("/v1/fim/completions", {"prompt": [1, 2]}, "prompt"),
    ("/v1/fim/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/fim/completions", {"prompt": "x", "min_tokens": 4}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),  # OpenAI's rule stays
])
def test_bad_input_is_a_4xx_in_the_error_shape(http: httpx.Client, path: str, body: dict,
                                               param: str | None) -> None:
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/apply-template", "/v1/chat/completions/input_tokens",
                                  "/completion", "/completions", "/infill", "/v1/fim/completions"])
def test_malformed_json_and_unknown_model(http: httpx.Client, path: str) -> None:
    r = http.post(path, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    body = {"model": "no-such-model", "content": "x", "tokens": [1], "messages": HI, "prompt": "x",
            "input_prefix": "x"}
    r = http.post(path, json=body)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
