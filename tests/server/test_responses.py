"""/v1/responses through the real openai SDK against the real server: create, stream, tools, formats, state.

The default model is tiny, so tool calls are forced (``tool_choice`` required or named, enforced by
the grammar) and JSON answers are schema-bound, as in the chat tests; outputs are cut short with
``max_output_tokens`` to keep the module fast.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel
from server_fixture import sdk_client

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
TIME = {"type": "function", "name": "get_time", "description": "Local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
        "required": ["city", "population"], "additionalProperties": False}


class City(BaseModel):
    city: str
    country: str


@pytest.fixture(scope="module")
def client(server_url: str) -> openai.OpenAI:
    return sdk_client(server_url)


def test_string_input_cut_by_max_output_tokens(client):
    raw = client.responses.with_raw_response.create(
        model=MODEL, input="Tell me about Paris.", instructions="Answer in French.", max_output_tokens=6,
        temperature=0.7, top_p=0.9, extra_body={"decoder": "ar", "seed": 1})
    assert raw.headers["x-dualserve-decoder"] == "ar" and raw.headers["x-dualserve-route-reason"]
    r = raw.parse()
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].type == "message" and r.output[0].status == "incomplete" and r.output_text
    assert (r.instructions, r.temperature, r.top_p, r.max_output_tokens) == ("Answer in French.", 0.7, 0.9, 6)
    assert r.usage.output_tokens == 6 and r.usage.total_tokens == r.usage.input_tokens + 6
    assert r.usage.input_tokens_details.cached_tokens >= 0 and r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.usage.model_extra["dualserve"]["decoder"] == "ar"


def test_function_call_loop_with_list_input(client):
    """Turn 1 calls the forced tool; turn 2 sends the whole history as items and gets text back."""
    first = client.responses.create(model=MODEL, input=[{"role": "user", "content": "Weather in Oslo?"}],
                                    tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
                                    max_output_tokens=60, temperature=0, store=False)
    assert first.status == "completed" and first.parallel_tool_calls is False
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name in ("get_weather", "get_time") and calls[0].call_id
    call = calls[0]
    jsonschema.validate(json.loads(call.arguments), {"get_weather": WEATHER, "get_time": TIME}[call.name]["parameters"])
    history = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C."}]
    second = client.responses.create(model=MODEL, input=history, tools=[WEATHER, TIME], tool_choice="none",
                                     max_output_tokens=24, temperature=0, store=False)
    assert [item.type for item in second.output] == ["message"] and second.output_text.strip()


def test_store_get_delete_and_previous_response_id(client):
    first = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=4, temperature=0)
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text and got.usage.output_tokens == 4
    follow = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=4, temperature=0)
    assert follow.previous_response_id == first.id
    # The follow-up's prompt holds the first turn (its input and output), not just the new message.
    assert follow.usage.input_tokens > first.usage.input_tokens + 4
    deleted = client.responses.delete(first.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    for call in (lambda: client.responses.retrieve(first.id), lambda: client.responses.delete(first.id),
                 lambda: client.responses.create(model=MODEL, input="x", previous_response_id=first.id,
                                                 max_output_tokens=1)):
        with pytest.raises(openai.NotFoundError) as err:
            call()
        assert err.value.body["code"] == "response_not_found" and first.id in err.value.body["message"]
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_stream_text_events(client):
    with client.responses.stream(model=MODEL, input="Count to three.", max_output_tokens=12, temperature=0,
                                 include=["message.output_text.logprobs"], top_logprobs=2) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    final = events[-1].response
    assert "".join(e.delta for e in deltas) == final.output_text == events[-4].text
    assert final.status == "incomplete" and final.usage.output_tokens == 12
    logprobs = final.output[0].content[0].logprobs
    assert len(logprobs) == 12 and all(len(lp.top_logprobs) == 2 for lp in logprobs)
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_stream_function_call_events_and_parsed_arguments(client):
    with client.responses.stream(model=MODEL, input="Weather in Oslo?", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60,
                                 temperature=0) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    call = final.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    jsonschema.validate(call.parsed_arguments, WEATHER["parameters"])  # strict tools are parsed by the SDK


@pytest.mark.parametrize("decoder", ["ar", "eagle", "diffusion"])
def test_every_decoder_json_schema_and_streamed_tools(client, decoder):
    r = client.responses.create(
        model=MODEL, input="Describe Paris as JSON.", max_output_tokens=60, temperature=0,
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}},
        extra_body={"decoder": decoder})
    assert r.status == "completed" and r.usage.model_extra["dualserve"]["decoder"] == decoder
    assert r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), CITY)
    events = list(client.responses.create(model=MODEL, input="Weather in Rome?", tools=[WEATHER],
                                          tool_choice="required", max_output_tokens=60, temperature=0, stream=True,
                                          extra_headers={"x-dualserve-decoder": decoder}))
    done = events[-1].response
    assert events[-1].type == "response.completed" and done.usage.model_extra["dualserve"]["decoder"] == decoder
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    jsonschema.validate(json.loads(arguments), WEATHER["parameters"])


def test_parse_with_pydantic_and_json_object(client):
    parsed = client.responses.parse(model=MODEL, input="Paris is in France. Name the city and its country.",
                                    text_format=City, max_output_tokens=40, temperature=0)
    assert isinstance(parsed.output_parsed, City) and parsed.output_parsed.city
    r = client.responses.create(model=MODEL, input="Reply with a JSON object.", max_output_tokens=12,
                                temperature=0, text={"format": {"type": "json_object"}})
    assert r.output_text.lstrip().startswith("{")


@pytest.mark.parametrize("kwargs, param", [
    (dict(tools=[{"type": "web_search"}]), "tools[0]"),
    (dict(tools=[WEATHER, {"type": "file_search", "vector_store_ids": ["vs"]}]), "tools[1]"),
    (dict(background=True), "background"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]),
     "input[0].content[0]"),
    (dict(input=[{"type": "item_reference", "id": "msg_1"}]), "input[0]"),
    (dict(input=[{"type": "reasoning", "summary": []}]), "input"),
    (dict(tools=[WEATHER], tool_choice={"type": "web_search_preview"}), "tool_choice"),
    (dict(extra_body={"conversation": "conv_1"}), "conversation"),
    (dict(temperature=3.0), "temperature"),
    (dict(max_output_tokens=0), "max_output_tokens"),
    (dict(text={"format": {"type": "json_schema", "name": "x"}}), "text.format.schema"),
])
def test_unsupported_or_invalid_is_a_400(client, kwargs, param):
    kwargs = {"model": MODEL, "input": "Hi", **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(**kwargs)
    body = err.value.body
    assert body["type"] == "invalid_request_error" and body["param"] == param and body["message"]
