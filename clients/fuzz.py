"""Fuzzed request bodies for every endpoint that takes one, and the check every answer must pass.

Shared by the seeded hypothesis test (``tests/server/test_fuzz.py``) and the soak tool
(``clients/soak.py``, which fuzzes the three generation endpoints of ``ENDPOINTS``). Bodies mix
valid values with the ones that once broke a decoder or the server: extreme penalties, empty
prompts, colliding template kwargs, malformed past tool calls, deep schemas, out-of-vocabulary
ids, wrong types, bodies that are not JSON objects. Generation stays short (``max_tokens`` or
``n_predict`` of a few tokens whenever a body is valid) so a campaign measures robustness, not
speed.

Each endpoint's ``Fields`` name the fields every valid body has, the valid values of the others
and a pool of invalid values; a body takes valid values, then (half the time) one invalid field,
so about half the requests are served and the rest probe one refusal each.

``verdict`` reads one HTTP answer: a 5xx other than a deliberate 503 / 504, an error body not in
the endpoint's shape (Anthropic's under ``/v1/messages``, OpenAI's elsewhere), a 200 without the
endpoint's answer, a stream that does not end with its end marker, or a stream that carries a
server error, is a failure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

# The generation endpoints: the soak tool's fuzzed requests and cut streams go to these.
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/infill")
ANTHROPIC = "/v1/messages"
MODEL = "SmolLM2-135M-Instruct"
VOCAB = 49152  # the default model's vocabulary


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


text = st.one_of(st.sampled_from(["", "Hi", "Once upon a time", "def f(x):\n    return", "<|im_start|>",
                                  "\u00e9\u0301\U0001f600", "\x00\x01", "a" * 300]),
                 st.text(max_size=40))
words = text.filter(bool)
unit = st.one_of(st.sampled_from([0.0, 1e-300, 0.5, 1.0]), st.floats(0, 1))
penalty = st.one_of(st.sampled_from([-2.0, 0.0, 2.0]), st.floats(-2, 2))
token_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)
bad_ids = st.lists(st.sampled_from([-1, VOCAB, 2**40, 2**64]), min_size=1, max_size=2)
huge = st.sampled_from([-1e300, -3.0, 3.0, 1e300])
few_tokens = st.integers(1, 4)
stops = st.one_of(st.none(), words, st.lists(words, max_size=3))
bad_stops = st.sampled_from([[""], [5], ["x"] * 17, 5])
models = st.sampled_from([MODEL, "default", "", None])
decoders = st.sampled_from(["ar", "eagle", "diffusion", "auto", None])


@dataclass(frozen=True)
class Fields:
    """One endpoint's body: the fields every valid body has, valid values of the others, invalid values."""

    required: dict[str, st.SearchStrategy]
    valid: dict[str, st.SearchStrategy]
    invalid: dict[str, st.SearchStrategy]


# ---- OpenAI's completions and chat, llama.cpp's /infill ---------------------------------

SAMPLING = {
    "model": models,
    "temperature": st.one_of(st.sampled_from([0.0, 2.0]), st.floats(0, 2)),
    "top_p": unit.filter(lambda v: v > 0), "top_k": st.sampled_from([-1, 0, 1, 5, 10**6]), "min_p": unit,
    "n": st.sampled_from([1, 1, 2]), "stream": st.booleans(), "stop": stops,
    "stop_token_ids": token_ids, "presence_penalty": penalty, "frequency_penalty": penalty,
    "repetition_penalty": st.sampled_from([None, 0.01, 0.5, 1.0, 1.3, 10.0]),
    "logit_bias": st.dictionaries(st.sampled_from(["0", "2", "100"]), st.floats(-100, 100), max_size=2),
    "seed": st.sampled_from([0, 1, 2**63 - 1, -1, None]), "ignore_eos": st.booleans(), "decoder": decoders,
    "priority": st.sampled_from(["interactive", "batch", "high_value", None]),
    "latency_budget_ms": st.sampled_from([1, 100, 1e9, None]),
}
SAMPLING_BAD = {
    "model": st.just("no-such-model"), "max_tokens": st.sampled_from([0, -1, 10**9, "4", 1.5]),
    "temperature": huge, "top_p": st.sampled_from([0.0, -1.0, 1.5]), "top_k": st.just(-2),
    "min_p": huge, "n": st.sampled_from([0, 17, -1]),
    "stop": bad_stops, "stop_token_ids": st.one_of(bad_ids, st.just([2] * 65)),
    "presence_penalty": huge, "frequency_penalty": huge,
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
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}}
# What the chat template reads: the body of /apply-template and of input token counting too.
CONVERSATION = {
    "messages": st.lists(MESSAGE, min_size=1, max_size=3), "model": models, "tools": st.just([TOOL]),
    "tool_choice": st.sampled_from([None, "auto", "none", "required", {
        "type": "function", "function": {"name": "get_weather"}}]),
    "chat_template_kwargs": st.sampled_from([None, {}, {"enable_thinking": False}]),
}
CONVERSATION_BAD = {
    "messages": st.one_of(st.just([]), st.just("hi"), st.lists(BAD_MESSAGE, min_size=1, max_size=2)),
    "model": st.just("no-such-model"),
    "tools": st.sampled_from([[{"type": "function"}], [{"type": "function", "function": {
        "name": "deep", "parameters": nested(970)}}], "x"]),
    "tool_choice": st.sampled_from([{"type": "function", "function": {"name": "x"}}, 5]),
    "chat_template_kwargs": st.sampled_from([{"self": 1}, {"messages": 1}, {"add_generation_prompt": False}]),
}
CHAT = {
    **CONVERSATION, "logprobs": st.booleans(), "top_logprobs": st.sampled_from([None, 0, 2]),
    "response_format": st.sampled_from([None, {"type": "text"}, {"type": "json_object"}, {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"n": {"type": "number"}}, "required": ["n"]}}}]),
}
CHAT_BAD = {
    **CONVERSATION_BAD, "top_logprobs": st.just(21), "max_completion_tokens": st.just(0),
    "response_format": st.sampled_from([{"type": "json_schema", "json_schema": {"schema": nested(970)}},
                                        {"type": "json_schema", "json_schema": {"schema": "nope"}},
                                        {"type": "xml"}]),
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
    "model": st.sampled_from([MODEL, None]), "decoder": st.sampled_from(["ar", "eagle", "auto", None]),
}
INFILL_BAD = {
    "n_predict": st.sampled_from([0, -1]), "input_extra": st.sampled_from([[{"text": 5}], [{}], "x"]),
    "temperature": huge, "top_p": st.just(0.0), "stop": st.just([""]), "model": st.just("nope"),
    # diffusion: the default model's diffusion twin attends block-causally and cannot see a suffix
    "decoder": st.sampled_from(["bogus", "diffusion"]), "input_prefix": st.just(5),
}

# ---- llama.cpp's /completion and the FIM completions of Mistral and DeepSeek ------------------

# One llama.cpp prompt: a string, token ids, or token ids with strings mixed in.
llama_prompt = st.one_of(text, token_ids, st.tuples(token_ids, words, token_ids).map(lambda p: [*p[0], p[1], *p[2]]))
LLAMA_COMPLETION = {
    "temperature": st.floats(0, 2), "top_k": st.sampled_from([-1, 0, 1, 40]), "top_p": unit.filter(lambda v: v > 0),
    "min_p": unit, "stop": stops, "seed": st.sampled_from([None, -1, 0, 7, 0xFFFFFFFF]), "stream": st.booleans(),
    "cache_prompt": st.booleans(), "id_slot": st.sampled_from([-1, 0]), "presence_penalty": penalty,
    "frequency_penalty": penalty, "repeat_penalty": st.sampled_from([None, 1.0, 1.1]),
    "ignore_eos": st.booleans(), "return_tokens": st.booleans(), "model": models, "decoder": decoders,
}
LLAMA_COMPLETION_BAD = {
    "prompt": st.one_of(st.sampled_from([None, 5, [], [[]], [1.5], [["a"]], [1, None], {"a": 1}, [[-1]]]), bad_ids),
    "n_predict": st.sampled_from(["4", 1.5, 10**9, 2**64]), "temperature": huge,
    "top_p": st.sampled_from([-1.0, 1.5]), "top_k": st.just("x"), "min_p": huge, "stop": bad_stops,
    "seed": st.sampled_from(["x", 2**64]), "stream": st.just("yes"), "model": st.just("no-such-model"),
    "decoder": st.just("bogus"), "repeat_penalty": st.sampled_from([0.0, -1.0]), "presence_penalty": huge,
    "id_slot": st.just("x"),
}
FIM = {
    "suffix": st.one_of(st.none(), text), "stop": stops, "temperature": st.floats(0, 1.5),
    "top_p": unit.filter(lambda v: v > 0), "random_seed": st.sampled_from([None, 0, 7]),
    "seed": st.sampled_from([None, 3]), "stream": st.booleans(),
    "stream_options": st.sampled_from([None, {"include_usage": True}]), "min_tokens": st.sampled_from([None, 0]),
    "presence_penalty": penalty, "model": models, "decoder": decoders,
}
FIM_BAD = {
    "prompt": st.sampled_from([None, 5, ["a"]]), "suffix": st.just(5),
    "max_tokens": st.sampled_from([0, -1, 10**9, "4"]), "min_tokens": st.just(1), "temperature": huge,
    "top_p": st.sampled_from([0.0, 1.5]), "stop": bad_stops, "random_seed": st.sampled_from(["x", 2**64]),
    "stream": st.just("yes"), "stream_options": st.just({"include_usage": "x"}), "model": st.just("no-such-model"),
    "decoder": st.just("bogus"),
}

# ---- embeddings, rerank, tokenizer ----------------------------------------------------------

EMBEDDINGS = {
    "encoding_format": st.sampled_from(["float", "base64"]), "dimensions": st.sampled_from([None, 576]),
    "model": models, "user": st.just("u"),
}
EMBEDDINGS_BAD = {
    "input": st.one_of(st.sampled_from([None, [], "", ["a", ""], [[]], [1.5], {"text": "a"}, ["a", 1],
                                        [[1, 2], "a"], [[3] * 9000], "cat " * 9000, ["a"] * 2049]),
                       bad_ids, bad_ids.map(lambda ids: [ids])),
    "encoding_format": st.sampled_from(["hex", 1]),
    "dimensions": st.sampled_from([0, -1, 64, 10**6, "8", 1.5]),  # 64: the default model is not Matryoshka
    "model": st.just("no-such-model"),
}
RERANK = {
    "top_n": st.sampled_from([None, 1, 2, 10]), "return_documents": st.booleans(), "model": models,
    "instruction": st.sampled_from([None, "Judge whether the document answers the query"]),
}
RERANK_BAD = {
    "query": st.sampled_from(["", 5, None, ["q"]]),
    "documents": st.sampled_from([[], "x", [5], [{}], [{"text": 5}], None, ["a"] * 2049]),
    "top_n": st.sampled_from([0, -1, "2"]), "return_documents": st.just("yes"), "model": st.just("no-such-model"),
    "instruction": st.just(5),
}
TOKENIZE = {
    "add_special": st.booleans(), "parse_special": st.booleans(), "with_pieces": st.booleans(), "model": models,
}
TOKENIZE_BAD = {
    "content": st.sampled_from([5, None, ["a"], "a " * 200_000]), "add_special": st.just("yes"),
    "with_pieces": st.just(1), "model": st.just("no-such-model"),
}

# ---- Anthropic's Messages API -------------------------------------------------------------

text_block = text.map(lambda t: {"type": "text", "text": t})
anthropic_turn = st.fixed_dictionaries({"role": st.sampled_from(["user", "user", "assistant"]),
                                        "content": st.one_of(text, st.lists(text_block, min_size=1, max_size=2))})
# A question, the tool call it led to and the call's result (is_error marks a failed call).
tool_exchange = st.tuples(words, st.booleans()).map(lambda p: [
    {"role": "user", "content": p[0]},
    {"role": "assistant", "content": [{"type": "text", "text": "Let me check."}, {
        "type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny",
                                  "is_error": p[1]}]}])
anthropic_messages = st.one_of(st.lists(anthropic_turn, min_size=1, max_size=3), tool_exchange)
ANTHROPIC_TOOL = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER_SCHEMA}
# What is templated into the prompt: the body of /v1/messages/count_tokens too.
MESSAGES_INPUT = {
    "model": st.sampled_from([MODEL, "default", None]),
    "system": st.one_of(text, st.lists(text_block, min_size=1, max_size=2)), "tools": st.just([ANTHROPIC_TOOL]),
    "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"},
                                    {"type": "tool", "name": "get_weather"},
                                    {"type": "auto", "disable_parallel_tool_use": True}]),
}
MESSAGES = {
    **MESSAGES_INPUT, "stop_sequences": st.lists(words, max_size=3), "temperature": unit,
    "top_p": unit.filter(lambda v: v > 0), "top_k": st.sampled_from([1, 5, 40]), "stream": st.booleans(),
    "metadata": st.just({"user_id": "u"}), "decoder": decoders,
}
MESSAGES_INPUT_BAD = {
    "model": st.just("no-such-model"),
    "messages": st.sampled_from([
        [], "hi", [{"role": "robot", "content": "hi"}], [{"role": "user"}],
        [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                    "data": ""}}]}],
        [{"role": "user", "content": [{"type": "video"}]}],
        [{"role": "user", "content": [{"type": "tool_use", "id": "1", "name": "get_weather", "input": {}}]}],
        [{"role": "assistant", "content": [{"type": "tool_use", "id": "1", "name": "x", "input": nested(970)}]}],
        [{"role": "system", "content": [{"type": "tool_result", "tool_use_id": "1"}]}],
        [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "1", "content": [{"type": "image"}]}]}],
    ]),
    "system": st.sampled_from([5, [{"type": "image"}]]),
    "tools": st.sampled_from([[{"name": "web_search", "type": "web_search_20250305"}], [{}], "x",
                              [{"name": "deep", "input_schema": nested(970)}]]),
    "tool_choice": st.sampled_from([{"type": "tool"}, {"type": "tool", "name": "nope"}, {"type": "bogus"}, "auto"]),
}
MESSAGES_BAD = {
    **MESSAGES_INPUT_BAD, "max_tokens": st.sampled_from([0, -1, "4", 1.5, None]),
    "stop_sequences": st.sampled_from([[""], [5], "x"]), "temperature": huge,
    "top_p": st.sampled_from([0.0, -1.0, 1.5]), "top_k": st.just(-2), "stream": st.just("yes"),
    "output_config": st.just({"format": {"type": "json_schema", "schema": "nope"}}),
}

FIELDS = {
    "/v1/completions": Fields({"prompt": COMPLETION["prompt"], "max_tokens": few_tokens},
                              {**SAMPLING, **COMPLETION}, {**SAMPLING_BAD, **COMPLETION_BAD}),
    "/v1/chat/completions": Fields({"messages": CHAT["messages"], "max_tokens": few_tokens},
                                   {**SAMPLING, **CHAT}, {**SAMPLING_BAD, **CHAT_BAD}),
    "/infill": Fields({"input_prefix": words, "n_predict": few_tokens}, INFILL, INFILL_BAD),
    # n_predict 0 prefills the prompt and answers empty.
    "/completion": Fields({"prompt": st.one_of(llama_prompt, st.lists(llama_prompt, min_size=2, max_size=3)),
                           "n_predict": st.integers(0, 4)}, LLAMA_COMPLETION, LLAMA_COMPLETION_BAD),
    "/v1/fim/completions": Fields({"prompt": text, "max_tokens": few_tokens}, FIM, FIM_BAD),
    ANTHROPIC: Fields({"model": st.sampled_from([MODEL, "default"]), "max_tokens": few_tokens,
                       "messages": anthropic_messages}, MESSAGES, MESSAGES_BAD),
    "/v1/messages/count_tokens": Fields({"messages": anthropic_messages}, MESSAGES_INPUT, MESSAGES_INPUT_BAD),
    "/v1/embeddings": Fields({"input": st.one_of(words, st.lists(words, min_size=1, max_size=3), token_ids,
                                                 st.lists(token_ids, min_size=1, max_size=3))},
                             EMBEDDINGS, EMBEDDINGS_BAD),
    "/v1/rerank": Fields({"query": words, "documents": st.lists(st.one_of(words, words.map(lambda t: {"text": t})),
                                                                min_size=1, max_size=3)}, RERANK, RERANK_BAD),
    "/tokenize": Fields({"content": text}, TOKENIZE, TOKENIZE_BAD),
    "/detokenize": Fields({"tokens": st.lists(st.integers(0, VOCAB - 1), max_size=8)}, {"model": models},
                          {"tokens": st.one_of(bad_ids, st.sampled_from(["x", [1.5], [[1]], None])),
                           "model": st.just("no-such-model")}),
    "/apply-template": Fields({"messages": CONVERSATION["messages"]}, CONVERSATION, CONVERSATION_BAD),
    "/v1/chat/completions/input_tokens": Fields({"messages": CONVERSATION["messages"]}, CONVERSATION,
                                                CONVERSATION_BAD),
}


def body(endpoint: str) -> st.SearchStrategy[dict[str, Any]]:
    """Request bodies for one endpoint: valid values, then at most one invalid field; a valid body
    always asks for a few tokens at most."""
    fields = FIELDS[endpoint]
    base = st.fixed_dictionaries(fields.required,
                                 optional={k: v for k, v in fields.valid.items() if k not in fields.required})
    invalid = fields.invalid
    bad = st.one_of(st.none(), st.sampled_from(sorted(invalid)).flatmap(
        lambda key: invalid[key].map(lambda value: (key, value))))
    return st.tuples(base, bad).map(lambda pair: {**pair[0], **dict([pair[1]] if pair[1] else [])})


def raw_bodies() -> st.SearchStrategy[bytes]:
    """Bodies that are not what the endpoint expects at all."""
    return st.sampled_from([b"", b"{", b"[]", b"null", b'"x"', b"{" * 2000, b'{"prompt": "\xff"}',
                            b'{"max_tokens": 1e999}', b'{"n": 1.5}'])


# ---- verdict ----------------------------------------------------------------------------------

# What every 200 answer that is not a stream holds, by endpoint.
ANSWER_KEYS = {
    "/v1/completions": "choices", "/v1/chat/completions": "choices", "/v1/fim/completions": "choices",
    "/infill": "content", "/completion": "content", ANTHROPIC: "content", "/v1/embeddings": "data",
    "/v1/rerank": "results", "/tokenize": "tokens", "/detokenize": "content", "/apply-template": "prompt",
    "/v1/chat/completions/input_tokens": "input_tokens", "/v1/messages/count_tokens": "input_tokens",
}
# How each streaming endpoint's stream ends: OpenAI's [DONE], or llama.cpp's last chunk with "stop": true.
STREAM_ENDS = {"/v1/completions": "[DONE]", "/v1/chat/completions": "[DONE]", "/v1/fim/completions": "[DONE]",
               "/infill": "stop", "/completion": "stop"}
# Anthropic's error type for a server failure (a 500); overloaded_error and timeout_error are deliberate.
ANTHROPIC_SERVER_ERROR = "api_error"


def verdict(status: int, content: bytes, streamed: bool, endpoint: str, raw: bytes | None = None) -> str | None:
    """None if the answer is acceptable, else what is wrong with it; given the request body ``raw``,
    also what the body promised (an ``n_predict: 0`` /completion generates nothing)."""
    if status >= 500 and status not in (503, 504):
        return f"{status}: {content[:300]!r}"
    if status != 200:
        return error_problem(status, content, endpoint)
    if streamed and endpoint == ANTHROPIC:
        return anthropic_stream_problem(content)
    streamed = streamed and endpoint in STREAM_ENDS
    problem = stream_problem(content, endpoint) if streamed else answer_problem(content, endpoint)
    if problem is None and raw is not None and endpoint == "/completion" and prefill_only(raw):
        return prefill_problem(content, streamed)
    return problem


def error_problem(status: int, content: bytes, endpoint: str) -> str | None:
    """An error body in OpenAI's shape, or Anthropic's under /v1/messages."""
    anthropic = endpoint == ANTHROPIC or endpoint.startswith(ANTHROPIC + "/")
    try:
        answer = json.loads(content)
        error = answer["error"]
        fields = set(error)
    except (ValueError, KeyError, TypeError):
        shape = "an Anthropic" if anthropic else "an OpenAI"
        return f"{status} without {shape}-shaped error: {content[:300]!r}"
    if anthropic:
        if set(answer) != {"type", "error"} or answer["type"] != "error" or fields != {"type", "message"}:
            return f"{status} error not in Anthropic's shape: {content[:300]!r}"
    elif fields != {"message", "type", "param", "code"}:
        return f"{status} error with fields {sorted(fields)}"
    return None


def answer_problem(content: bytes, endpoint: str) -> str | None:
    """A 200 JSON answer with the endpoint's own field (a list of them for several llama.cpp prompts)."""
    try:
        answer = json.loads(content)
    except ValueError:
        return f"200 with a body that is not JSON: {content[:300]!r}"
    answers = answer if isinstance(answer, list) and endpoint == "/completion" else [answer]
    key = ANSWER_KEYS.get(endpoint)
    if key is not None and not all(isinstance(a, dict) and key in a for a in answers):
        return f"200 without {key!r}: {content[:300]!r}"
    return None


def stream_problem(content: bytes, endpoint: str) -> str | None:
    """An OpenAI or llama.cpp stream: its end marker last, and no server error on the way."""
    events = [line[6:] for line in content.decode("utf-8", "replace").split("\n") if line.startswith("data: ")]
    if not events:
        return "a stream without events"
    if STREAM_ENDS[endpoint] == "[DONE]":
        end_ok = events[-1] == "[DONE]"
    else:
        try:
            end_ok = json.loads(events[-1]).get("stop") is True
        except (ValueError, AttributeError):
            end_ok = False
    if not end_ok:
        return f"a stream that does not end cleanly: {events[-3:]}"
    for event in events:
        if event.startswith('{"error"') and json.loads(event)["error"]["type"] == "server_error":
            return f"a stream with a server error: {event[:300]}"
    return None


def prefill_only(raw: bytes) -> bool:
    try:
        parsed = json.loads(raw)
    except (ValueError, RecursionError):
        return False
    return isinstance(parsed, dict) and type(parsed.get("n_predict")) is int and parsed["n_predict"] == 0


def prefill_problem(content: bytes, streamed: bool) -> str | None:
    """An ``n_predict: 0`` answer (already checked to be well formed): the prompt prefilled, no text,
    no tokens, in every chunk or every prompt's answer."""
    if streamed:
        lines = content.decode("utf-8", "replace").split("\n")
        answers = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    else:
        answer = json.loads(content)
        answers = answer if isinstance(answer, list) else [answer]
    made = [a for a in answers if "error" not in a and (a.get("content") or a.get("tokens_predicted"))]
    return f"n_predict 0 generated: {str(made[:2])[:300]}" if made else None


def anthropic_stream_problem(content: bytes) -> str | None:
    """Anthropic's ``event: NAME`` / ``data: JSON`` pairs (``type`` is NAME), from ``message_start`` to
    ``message_stop``, or to an ``error`` event that is not a server failure (server.anthropic.stream)."""
    events: list[tuple[str, Any]] = []
    for block in content.decode("utf-8", "replace").split("\n\n"):
        if not block.strip():
            continue
        lines = block.split("\n")
        if len(lines) != 2 or not lines[0].startswith("event: ") or not lines[1].startswith("data: "):
            return f"a malformed event: {block[:300]!r}"
        try:
            name, data = lines[0][7:], json.loads(lines[1][6:])
        except ValueError:
            return f"an event whose data is not JSON: {block[:300]!r}"
        if not isinstance(data, dict) or data.get("type") != name:
            return f"an event whose type is not its name: {block[:300]!r}"
        events.append((name, data))
    if not events:
        return "a stream without events"
    if events[0][0] != "message_start":
        return f"a stream that does not open with message_start: {events[0]}"
    name, data = events[-1]
    if name not in ("message_stop", "error"):
        return f"a stream that does not end cleanly: {[e[0] for e in events[-3:]]}"
    if name == "error" and data.get("error", {}).get("type") == ANTHROPIC_SERVER_ERROR:
        return f"a stream with a server error: {data}"
    return None


# ---- requests ---------------------------------------------------------------------------------


def request(endpoint: str) -> st.SearchStrategy[tuple[str, bytes]]:
    """(endpoint, encoded body): mostly fuzzed JSON objects, sometimes not JSON objects at all."""
    return st.one_of(body(endpoint).map(lambda b: json.dumps(b).encode()), raw_bodies()).map(
        lambda raw: (endpoint, raw))


def any_request() -> st.SearchStrategy[tuple[str, bytes]]:
    """A request to one of the generation endpoints (the soak tool's)."""
    return st.sampled_from(ENDPOINTS).flatmap(request)


def sample(n: int, seed: int) -> list[tuple[str, bytes]]:
    """``n`` fuzzed requests across the generation endpoints, the same ones for the same seed (for the soak tool)."""
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
