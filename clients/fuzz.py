"""Fuzzed request bodies for the three generation endpoints, and the check every answer must pass.

Shared by the seeded hypothesis test (``tests/server/test_fuzz.py``) and the soak tool
(``clients/soak.py``). Bodies mix valid values with the ones that once broke a decoder or the
server (issue 15): extreme penalties, empty prompts, colliding template kwargs, malformed past
tool calls, deep schemas, out-of-vocabulary ids, wrong types. Generation stays short
(``max_tokens`` of a few tokens whenever a body is valid) so a campaign measures robustness,
not speed.

``verdict`` reads one HTTP answer: a 5xx other than a deliberate 503 / 504, an error body
that is not OpenAI-shaped, a stream that does not end with its end marker, or a stream that
carries a server error, is a failure.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/infill")


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


text = st.one_of(st.sampled_from(["", "Hi", "Once upon a time", "def f(x):\n    return", "<|im_start|>",
                                  "\u00e9\u0301\U0001f600", "\x00\x01", "a" * 300]),
                 st.text(max_size=40))
unit = st.one_of(st.sampled_from([0.0, 1e-300, 0.5, 1.0]), st.floats(0, 1))
penalty = st.one_of(st.sampled_from([-2.0, 0.0, 2.0]), st.floats(-2, 2))
token_ids = st.lists(st.integers(0, 49151), min_size=1, max_size=6)
bad_ids = st.lists(st.sampled_from([-1, 49152, 2**40]), min_size=1, max_size=2)
huge = st.sampled_from([-1e300, -3.0, 3.0, 1e300])

# Each body takes valid values for any of its fields, then (half the time) one field from the
# invalid pool: so about half the requests are served and the rest probe one refusal each.
SAMPLING = {
    "model": st.sampled_from(["SmolLM2-135M-Instruct", "default", "", None]),
    "temperature": st.one_of(st.sampled_from([0.0, 2.0]), st.floats(0, 2)),
    "top_p": unit.filter(lambda v: v > 0), "top_k": st.sampled_from([-1, 0, 1, 5, 10**6]), "min_p": unit,
    "n": st.sampled_from([1, 1, 2]), "stream": st.booleans(),
    "stop": st.one_of(st.none(), text.filter(bool), st.lists(text.filter(bool), max_size=3)),
    "stop_token_ids": token_ids, "presence_penalty": penalty, "frequency_penalty": penalty,
    "repetition_penalty": st.sampled_from([None, 0.01, 0.5, 1.0, 1.3, 10.0]),
    "logit_bias": st.dictionaries(st.sampled_from(["0", "2", "100"]), st.floats(-100, 100), max_size=2),
    "seed": st.sampled_from([0, 1, 2**63 - 1, -1, None]), "ignore_eos": st.booleans(),
    "decoder": st.sampled_from(["ar", "eagle", "diffusion", "auto", None]),
    "priority": st.sampled_from(["interactive", "batch", "high_value", None]),
    "latency_budget_ms": st.sampled_from([1, 100, 1e9, None]),
}
SAMPLING_BAD = {
    "model": st.just("no-such-model"), "max_tokens": st.sampled_from([0, -1, 10**9, "4", 1.5]),
    "temperature": huge, "top_p": st.sampled_from([0.0, -1.0, 1.5]), "top_k": st.just(-2),
    "min_p": huge, "n": st.sampled_from([0, 17, -1]),
    "stop": st.sampled_from([[""], [5], ["x"] * 17]), "stop_token_ids": st.one_of(
        bad_ids, st.just([2] * 65)), "presence_penalty": huge, "frequency_penalty": huge,
    "repetition_penalty": st.sampled_from([0.0, -1.0, 1e-300, 1e300]),
    "logit_bias": st.sampled_from([{"-1": 1.0}, {"49152": 1.0}, {"x": 1.0}, {"0": 101.0}]),
    "seed": st.sampled_from([2**63, "x"]), "decoder": st.just("bogus"), "stream": st.just("yes"),
}
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "user", "system", "assistant", "developer"]), "content": text},
    optional={"name": st.just("bob")})
BAD_MESSAGE = st.sampled_from([
    {"role": "robot", "content": "hi"}, {"role": "user", "content": [{"type": "image_url", "image_url": {}}]},
    {"role": "assistant", "tool_calls": [{}]}, {"role": "assistant", "tool_calls": [{"function": "x"}]},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function", "function": {
        "name": "get_weather", "arguments": "{}"}}]}, {"role": "tool", "content": "sunny", "tool_call_id": "1"},
    {"content": "hi"}])
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CHAT = {
    "messages": st.lists(MESSAGE, min_size=1, max_size=3), "logprobs": st.booleans(),
    "top_logprobs": st.sampled_from([None, 0, 2]),
    "response_format": st.sampled_from([None, {"type": "text"}, {"type": "json_object"}, {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"n": {"type": "number"}}, "required": ["n"]}}}]),
    "tools": st.just([TOOL]), "tool_choice": st.sampled_from([None, "auto", "none", "required", {
        "type": "function", "function": {"name": "get_weather"}}]),
    "chat_template_kwargs": st.sampled_from([None, {}, {"enable_thinking": False}]),
}
CHAT_BAD = {
    "messages": st.one_of(st.just([]), st.just("hi"), st.lists(BAD_MESSAGE, min_size=1, max_size=2)),
    "top_logprobs": st.just(21), "max_completion_tokens": st.just(0),
    "response_format": st.sampled_from([{"type": "json_schema", "json_schema": {"schema": nested(970)}},
                                        {"type": "json_schema", "json_schema": {"schema": "nope"}},
                                        {"type": "xml"}]),
    "tools": st.sampled_from([[{"type": "function"}], [{"type": "function", "function": {
        "name": "deep", "parameters": nested(970)}}], "x"]),
    "tool_choice": st.sampled_from([{"type": "function", "function": {"name": "x"}}, 5]),
    "chat_template_kwargs": st.sampled_from([{"self": 1}, {"messages": 1}, {"add_generation_prompt": False}]),
}
COMPLETION = {
    "prompt": st.one_of(text, st.lists(text, min_size=1, max_size=3), token_ids,
                        st.lists(token_ids, min_size=1, max_size=2)),
    "suffix": st.one_of(st.none(), text), "echo": st.booleans(), "logprobs": st.sampled_from([None, 0, 2]),
}
COMPLETION_BAD = {
    "prompt": st.one_of(st.sampled_from([None, 5, [], [[]], [1, "a"], [["a"]]]), bad_ids),
    "logprobs": st.just(21), "best_of": st.just("x"),
}
INFILL = {
    "input_prefix": text, "input_suffix": text, "prompt": text,
    "input_extra": st.sampled_from([[], [{"filename": "a.py", "text": "x = 1\n"}]]),
    "temperature": st.floats(0, 2), "top_k": st.sampled_from([None, 0, 5]), "top_p": unit.filter(lambda v: v > 0),
    "stream": st.booleans(), "stop": st.sampled_from([None, [], ["\n"]]), "seed": st.sampled_from([None, 0, 7]),
    "model": st.sampled_from(["SmolLM2-135M-Instruct", None]),
    "decoder": st.sampled_from(["ar", "eagle", "diffusion", "auto", None]),
}
INFILL_BAD = {
    "n_predict": st.sampled_from([0, -1]), "input_extra": st.sampled_from([[{"text": 5}], [{}], "x"]),
    "temperature": huge, "top_p": st.just(0.0), "stop": st.just([""]), "model": st.just("nope"),
    "decoder": st.just("bogus"), "input_prefix": st.just(5),
}
ENDPOINT_FIELDS = {
    "/v1/completions": ({**SAMPLING, **COMPLETION}, {**SAMPLING_BAD, **COMPLETION_BAD}),
    "/v1/chat/completions": ({**SAMPLING, **CHAT}, {**SAMPLING_BAD, **CHAT_BAD}),
    "/infill": (INFILL, INFILL_BAD),
}


def body(endpoint: str) -> st.SearchStrategy[dict[str, Any]]:
    """Request bodies for one endpoint: valid values, then at most one invalid field; a valid body
    always asks for a few tokens at most."""
    valid, invalid = ENDPOINT_FIELDS[endpoint]
    required = {"n_predict" if endpoint == "/infill" else "max_tokens": st.integers(1, 4)}
    if endpoint == "/v1/chat/completions":
        required["messages"] = CHAT["messages"]
    if endpoint == "/v1/completions":
        required["prompt"] = COMPLETION["prompt"]
    base = st.fixed_dictionaries(required, optional={k: v for k, v in valid.items() if k not in required})
    bad = st.one_of(st.none(), st.sampled_from(sorted(invalid)).flatmap(
        lambda key: invalid[key].map(lambda value: (key, value))))
    return st.tuples(base, bad).map(lambda pair: {**pair[0], **dict([pair[1]] if pair[1] else [])})


def raw_bodies() -> st.SearchStrategy[bytes]:
    """Bodies that are not what the endpoint expects at all."""
    return st.sampled_from([b"", b"{", b"[]", b"null", b'"x"', b"{" * 2000, b'{"prompt": "\xff"}',
                            b'{"max_tokens": 1e999}', b'{"n": 1.5}'])


def verdict(status: int, content: bytes, streamed: bool, endpoint: str) -> str | None:
    """None if the answer is acceptable, else what is wrong with it."""
    if status >= 500 and status not in (503, 504):
        return f"{status}: {content[:300]!r}"
    if status != 200:
        try:
            error = json.loads(content)["error"]
        except (ValueError, KeyError, TypeError):
            return f"{status} without an OpenAI-shaped error: {content[:300]!r}"
        if set(error) != {"message", "type", "param", "code"}:
            return f"{status} error with fields {sorted(error)}"
        return None
    if not streamed:
        try:
            json.loads(content)
        except ValueError:
            return f"200 with a body that is not JSON: {content[:300]!r}"
        return None
    events = [line[6:] for line in content.decode("utf-8", "replace").split("\n") if line.startswith("data: ")]
    if not events:
        return "a stream without events"
    end_ok = events[-1] == "[DONE]" if endpoint != "/infill" else json.loads(events[-1]).get("stop") is True
    if not end_ok:
        return f"a stream that does not end cleanly: {events[-3:]}"
    for event in events:
        if event.startswith('{"error"') and json.loads(event)["error"]["type"] == "server_error":
            return f"a stream with a server error: {event[:300]}"
    return None


def request(endpoint: str) -> st.SearchStrategy[tuple[str, bytes]]:
    """(endpoint, encoded body): mostly fuzzed JSON objects, sometimes not JSON objects at all."""
    return st.one_of(body(endpoint).map(lambda b: json.dumps(b).encode()), raw_bodies()).map(
        lambda raw: (endpoint, raw))


def any_request() -> st.SearchStrategy[tuple[str, bytes]]:
    return st.sampled_from(ENDPOINTS).flatmap(request)


def sample(n: int, seed: int) -> list[tuple[str, bytes]]:
    """``n`` fuzzed requests across the endpoints, the same ones for the same seed (for the soak tool)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as seeded

    out: list[tuple[str, bytes]] = []

    @seeded(seed)
    @settings(max_examples=n, phases=[Phase.generate], database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(any_request())
    def collect(item: tuple[str, bytes]) -> None:
        out.append(item)

    collect()
    return out


def is_stream(raw: bytes) -> bool:
    try:
        parsed = json.loads(raw)
    except (ValueError, RecursionError):
        return False
    return isinstance(parsed, dict) and parsed.get("stream") is True
