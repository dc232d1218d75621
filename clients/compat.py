"""OpenAI-compatibility check: the request shapes dualserve's own tests use, replayed against any base URL.

    python -m dualserve.clients.compat --base-url http://127.0.0.1:8000/v1 [--base-url URL2 ...] [--markdown]

Each check sends one request (or a short sequence, for stored responses) over plain HTTP, so any
server can be measured, and checks the answer's shape as the openai SDK and agent frameworks read
it: bodies, stream chunks or typed events, usage, and OpenAI's error shape for bad input. It does
not judge what a model says. Several URLs give a side-by-side table (dualserve and llama.cpp's
server in the README). A check passes, fails with the reason, or reports the HTTP status it got.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any, Callable

import httpx

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
RESPONSES_TOOL = {"type": "function", **TOOL["function"]}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
          "required": ["city"], "additionalProperties": False}
CHAT = [{"role": "user", "content": "Name a city."}]


class Refused(Exception):
    """The server answered an HTTP error where the check expected success."""


@dataclass
class Server:
    client: httpx.Client
    model: str

    def post(self, path: str, body: dict[str, Any], ok: bool = True) -> httpx.Response:
        r = self.client.post(path, json={"model": self.model, **body})
        if ok and r.status_code != 200:
            raise Refused(f"HTTP {r.status_code}")
        return r

    def json(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.post(path, body).json()

    def events(self, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        """The JSON payloads of an SSE stream (``[DONE]`` dropped)."""
        with self.client.stream("POST", path, json={"model": self.model, **body, "stream": True}) as r:
            if r.status_code != 200:
                raise Refused(f"HTTP {r.status_code}")
            return [json.loads(line[5:]) for line in r.iter_lines()
                    if line.startswith("data:") and line[5:].strip() != "[DONE]"]


def error_shape(r: httpx.Response, status: int) -> None:
    assert r.status_code == status, f"HTTP {r.status_code}, expected {status}"
    error = r.json().get("error")
    assert isinstance(error, dict) and {"message", "type"} <= set(error), f"not OpenAI's error shape: {r.text[:80]}"


# ---- completions and chat --------------------------------------------------------------


def completion_basic(s: Server) -> None:
    body = s.json("/completions", {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
    assert body["choices"][0]["text"] and body["usage"]["completion_tokens"] > 0


def completion_stream(s: Server) -> None:
    chunks = s.events("/completions", {"prompt": "Once upon", "max_tokens": 4})
    assert "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")), "no text"


def completion_logprobs(s: Server) -> None:
    lp = s.json("/completions", {"prompt": "Hi", "max_tokens": 2, "logprobs": 2})["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) >= 1 and len(lp["top_logprobs"][0]) >= 1


def chat_basic(s: Server) -> None:
    body = s.json("/chat/completions", {"messages": CHAT, "max_tokens": 8, "temperature": 0, "seed": 1})
    assert body["choices"][0]["message"]["content"] and body["usage"]["total_tokens"] > 0


def chat_stream_usage(s: Server) -> None:
    chunks = s.events("/chat/completions", {"messages": CHAT, "max_tokens": 8,
                                            "stream_options": {"include_usage": True}})
    text = "".join((c["choices"][0]["delta"].get("content") or "") for c in chunks if c.get("choices"))
    assert text and chunks[-1].get("usage"), "no text or no final usage chunk"


def chat_n(s: Server) -> None:
    body = s.json("/chat/completions", {"messages": CHAT, "max_tokens": 4, "n": 2})
    assert sorted(c["index"] for c in body["choices"]) == [0, 1]


def chat_logprobs(s: Server) -> None:
    body = s.json("/chat/completions", {"messages": CHAT, "max_tokens": 3, "logprobs": True, "top_logprobs": 2})
    content = body["choices"][0]["logprobs"]["content"]
    assert content and len(content[0]["top_logprobs"]) == 2


def chat_stop(s: Server) -> None:
    body = s.json("/chat/completions", {"messages": [{"role": "user", "content": "Count: 1, 2, 3, 4, 5"}],
                                        "max_tokens": 32, "temperature": 0, "stop": [","]})
    assert "," not in body["choices"][0]["message"]["content"]


def chat_json_object(s: Server) -> None:
    body = s.json("/chat/completions", {"messages": [{"role": "user", "content": "A JSON object with a city."}],
                                        "max_tokens": 40, "temperature": 0, "response_format": {"type": "json_object"}})
    assert body["choices"][0]["message"]["content"].lstrip().startswith("{")


def chat_json_schema(s: Server) -> None:
    body = s.json("/chat/completions", {
        "messages": CHAT, "max_tokens": 40, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA, "strict": True}}})
    assert isinstance(json.loads(body["choices"][0]["message"]["content"]).get("city"), str)


def chat_tool_required(s: Server) -> None:
    body = s.json("/chat/completions", {"messages": [{"role": "user", "content": "Weather in Oslo?"}],
                                        "max_tokens": 60, "temperature": 0, "tools": [TOOL], "tool_choice": "required"})
    call = body["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and "city" in json.loads(call["function"]["arguments"])


def chat_tool_stream(s: Server) -> None:
    chunks = s.events("/chat/completions", {
        "messages": [{"role": "user", "content": "Weather in Oslo?"}], "max_tokens": 60, "temperature": 0,
        "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    calls = [tc for c in chunks if c.get("choices") for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    assert calls, "no tool_calls deltas"
    json.loads("".join(tc["function"].get("arguments") or "" for tc in calls))


def chat_bad_input(s: Server) -> None:
    error_shape(s.post("/chat/completions", {"messages": CHAT, "temperature": 5}, ok=False), 400)


# ---- the Responses API ------------------------------------------------------------------


def responses_basic(s: Server) -> None:
    body = s.json("/responses", {"input": "Name a city.", "instructions": "Be brief.", "max_output_tokens": 8})
    message = body["output"][0]
    assert body["object"] == "response" and message["type"] == "message"
    assert message["content"][0]["type"] == "output_text" and body["usage"]["output_tokens"] > 0


def responses_incomplete(s: Server) -> None:
    body = s.json("/responses", {"input": "Tell me a long story.", "max_output_tokens": 4})
    assert body["status"] == "incomplete" and body["incomplete_details"]["reason"] == "max_output_tokens"


def responses_stream(s: Server) -> None:
    events = s.events("/responses", {"input": "Name a city.", "max_output_tokens": 8})
    kinds = [e["type"] for e in events]
    for kind in ("response.created", "response.output_item.added", "response.output_text.delta",
                 "response.output_item.done"):
        assert kind in kinds, f"no {kind}"
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds[-1]


def responses_tool_loop(s: Server) -> None:
    first = s.json("/responses", {"input": "Weather in Oslo?", "tools": [RESPONSES_TOOL], "tool_choice": "required",
                                  "max_output_tokens": 60, "temperature": 0})
    call = next(item for item in first["output"] if item["type"] == "function_call")
    second = s.json("/responses", {"input": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": call["call_id"], "name": call["name"], "arguments": call["arguments"]},
        {"type": "function_call_output", "call_id": call["call_id"], "output": "Sunny"}],
        "tools": [RESPONSES_TOOL], "tool_choice": "none", "max_output_tokens": 8})
    assert second["output"][0]["type"] == "message"


def responses_tool_stream(s: Server) -> None:
    events = s.events("/responses", {"input": "Weather in Oslo?", "tools": [RESPONSES_TOOL],
                                     "tool_choice": {"type": "function", "name": "get_weather"},
                                     "max_output_tokens": 60, "temperature": 0})
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert done and "city" in json.loads(done[0]["arguments"])


def responses_json_schema(s: Server) -> None:
    body = s.json("/responses", {"input": "Name a city as JSON.", "max_output_tokens": 40, "temperature": 0,
                                 "text": {"format": {"type": "json_schema", "name": "c", "schema": SCHEMA,
                                                     "strict": True}}})
    assert isinstance(json.loads(body["output"][0]["content"][0]["text"]).get("city"), str)


def responses_state(s: Server) -> None:
    first = s.json("/responses", {"input": "My name is Ada.", "max_output_tokens": 4, "store": True})
    follow = s.json("/responses", {"input": "My name?", "previous_response_id": first["id"], "max_output_tokens": 4})
    assert follow["usage"]["input_tokens"] > first["usage"]["input_tokens"], "previous turn not in the prompt"
    got = s.client.get(f"/responses/{first['id']}")
    assert got.status_code == 200 and got.json()["id"] == first["id"], f"GET: HTTP {got.status_code}"
    assert s.client.delete(f"/responses/{first['id']}").status_code == 200, "DELETE failed"
    error_shape(s.client.get(f"/responses/{first['id']}"), 404)


def responses_refusal(s: Server) -> None:
    error_shape(s.post("/responses", {"input": "x", "tools": [{"type": "web_search"}]}, ok=False), 400)


CHECKS: list[tuple[str, Callable[[Server], None]]] = [
    ("completions: basic", completion_basic), ("completions: stream", completion_stream),
    ("completions: logprobs", completion_logprobs), ("chat: basic, seed", chat_basic),
    ("chat: stream + include_usage", chat_stream_usage), ("chat: n=2", chat_n), ("chat: logprobs", chat_logprobs),
    ("chat: stop", chat_stop), ("chat: json_object", chat_json_object), ("chat: json_schema strict", chat_json_schema),
    ("chat: tool_choice required", chat_tool_required), ("chat: named tool, streamed", chat_tool_stream),
    ("chat: bad input is a 400 in OpenAI's shape", chat_bad_input), ("responses: basic", responses_basic),
    ("responses: max_output_tokens -> incomplete", responses_incomplete),
    ("responses: stream events", responses_stream), ("responses: function call loop", responses_tool_loop),
    ("responses: named tool, streamed", responses_tool_stream), ("responses: json_schema", responses_json_schema),
    ("responses: previous_response_id, GET, DELETE, 404", responses_state),
    ("responses: built-in tool is a 400", responses_refusal),
]


def run(base_url: str, api_key: str = "unused", timeout: float = 300.0) -> dict[str, str]:
    """{check name: "pass" | the reason it failed} for the server at ``base_url`` (ending in /v1)."""
    with httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout,
                      headers={"Authorization": f"Bearer {api_key}"}) as client:
        models = client.get("/models").json()["data"]
        server = Server(client, models[0]["id"])
        results = {}
        for name, check in CHECKS:
            try:
                check(server)
                results[name] = "pass"
            except Refused as e:
                results[name] = str(e)
            except (AssertionError, KeyError, IndexError, TypeError, StopIteration, ValueError) as e:
                results[name] = f"fail: {type(e).__name__} {e}"[:100]
        return results


def table(columns: dict[str, dict[str, str]]) -> str:
    names = list(columns)
    lines = ["| check | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for check, _ in CHECKS:
        lines.append(f"| {check} | " + " | ".join(columns[n][check] for n in names) + " |")
    passed = [sum(v == "pass" for v in columns[n].values()) for n in names]
    lines.append("| **passed** | " + " | ".join(f"{p}/{len(CHECKS)}" for p in passed) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", action="append", help="a server's /v1 URL; repeat for a side-by-side table")
    parser.add_argument("--name", action="append", help="a column name per --base-url")
    args = parser.parse_args()
    urls = args.base_url or ["http://127.0.0.1:8000/v1"]
    names = args.name or urls
    print(table({name: run(url) for name, url in zip(names, urls)}))
