"""Structured output and tool calls through the real server, validated with jsonschema.

Every check runs on the AR path (llguidance masks each step's logits) and on the diffusion
twin (the grammar's forced tokens are placed as a skeleton, values are denoised under the
grammar's mask)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from server_fixture import sdk_client

MODEL = "SmolLM2-135M-Instruct"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3}},
          "required": ["city", "population"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                                               "required": ["city", "unit"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def client(server_url: str) -> openai.OpenAI:
    return sdk_client(server_url, needs="diffusion")


DECODERS = ["ar", "diffusion"]


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates(client, temperature, decoder):
    r = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe Paris as JSON."}], max_tokens=80,
        temperature=temperature, seed=3, extra_body={"decoder": decoder},
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}})
    assert r.headers["x-dualserve-decoder"] == decoder
    body = r.parse()
    assert body.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(body.choices[0].message.content), SCHEMA)


def test_diffusion_places_the_schema_skeleton_without_forwards(client):
    """Keys and punctuation are forced tokens: fewer forwards than output tokens, streamed or not."""
    schema = {"type": "object", "properties": {k: {"type": "integer"} for k in ("alpha", "beta", "gamma", "delta")},
              "required": ["alpha", "beta", "gamma", "delta"], "additionalProperties": False}
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Give four small numbers as JSON."}],
                  max_tokens=60, temperature=0, extra_body={"decoder": "diffusion"},
                  response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    r = client.chat.completions.create(**kwargs)
    doc = json.loads(r.choices[0].message.content)
    jsonschema.validate(doc, schema)
    assert list(doc) == ["alpha", "beta", "gamma", "delta"]
    stats = r.usage.model_extra["dualserve"]
    assert stats["forward_passes"] < r.usage.completion_tokens, stats
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True)
                       if c.choices)
    assert streamed == r.choices[0].message.content


def test_json_object_output_parses(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Ada is 36. Reply with her name and age in JSON."}],
        max_tokens=200, temperature=0, response_format={"type": "json_object"},
        extra_body={"repetition_penalty": 1.3})  # a 135M model otherwise nests objects forever
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
        return
    # Cut by max_tokens: the text must be a truncated object, never a malformed one.
    assert text.lstrip().startswith("{")
    with pytest.raises(json.JSONDecodeError) as err:
        json.loads(text)
    truncated = err.value.msg.startswith("Unterminated string") or err.value.pos >= len(text.rstrip()) - 1
    assert truncated, f"malformed before the cut: {text!r}"


def test_invalid_schema_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nope"}}})
    assert err.value.body["param"] == "response_format"


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_call_arguments_validate(client, choice, decoder):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                       max_tokens=60, temperature=0, tools=TOOLS, tool_choice=choice,
                                       extra_body={"decoder": decoder})
    assert r.choices[0].finish_reason == "tool_calls"
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id and call.type == "function"
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])


@pytest.mark.parametrize("decoder", DECODERS)
def test_streamed_tool_call_deltas(client, decoder):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}], max_tokens=60, temperature=0,
        tools=TOOLS, tool_choice="required", stream=True, extra_body={"decoder": decoder}))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls and calls[0].function.name == "get_weather" and calls[0].index == 0
    jsonschema.validate(json.loads("".join(tc.function.arguments or "" for tc in calls)),
                        TOOLS[0]["function"]["parameters"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_an_agent_turn_routes_to_lossless_speculation(client):
    """Tools offered (no grammar: the model may answer in text) or a tool's result in the
    conversation: ``auto`` picks eagle, whose suffix drafts verify the input the answer copies."""
    tool_result = [{"role": "user", "content": "Weather in Oslo?"},
                   {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                       "name": "get_weather", "arguments": json.dumps({"city": "Oslo", "unit": "C"})}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature": 4, "sky": "rain"})}]
    for kw in ({"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": TOOLS},
               {"messages": tool_result}):
        r = client.chat.completions.with_raw_response.create(model=MODEL, max_tokens=8, temperature=0, **kw)
        assert r.headers["x-dualserve-decoder"] == "eagle", r.headers["x-dualserve-route-reason"]
        assert r.headers["x-dualserve-route-reason"].startswith("agent turn")
    plain = client.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=8, temperature=0, messages=[{"role": "user", "content": "Weather in Oslo?"}])
    assert not plain.headers["x-dualserve-route-reason"].startswith("agent turn")


def test_tool_choice_naming_an_unknown_function_is_a_400(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
