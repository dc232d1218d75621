"""/v1/responses without a server: the bounded store's eviction rule, and the stream's events
validated against the openai SDK's own pydantic types (strictly, unlike the SDK's lenient parse)
and fed through its stream accumulator, for text, tool calls and an engine failure mid-stream."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import typing

import pytest
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent

from dualserve.decoders.engine.request import Delta, FailureKind
from dualserve.server.errors import APIError, engine_error
from dualserve.server.protocol import ResponseObject, ResponsesRequest, encoder
from dualserve.server.responses.handler import ResponsesHandler
from dualserve.server.responses.store import ResponseStore
from dualserve.server.service import ChoiceResult

# The SDK's event classes by their ``type`` literal (its union is discriminated by the SDK, not by pydantic).
EVENTS = {typing.get_args(cls.model_fields["type"].annotation)[0]: cls
          for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}


def body(response_id: str, text: str = "") -> ResponseObject:
    return ResponseObject(id=response_id, created_at=0, model="m", status="completed", output=[])


def test_store_evicts_least_recently_used_by_count():
    store = ResponseStore(max_responses=2)
    store.put(body("a"), [])
    store.put(body("b"), [])
    store.get("a")                       # a read makes "a" the most recently used
    store.put(body("c"), [])
    assert list(store.entries) == ["a", "c"]
    with pytest.raises(APIError) as err:
        store.get("b")
    assert err.value.status == 404 and err.value.code == "response_not_found"
    assert ResponseStore.sized(None, 0.5).max_bytes == 2**19 and ResponseStore.sized(3, None).max_responses == 3
    off = ResponseStore.sized(0, None)
    assert not off.put(body("a"), []) and len(off) == 0   # --response-store-size 0 keeps nothing


def test_store_evicts_by_bytes_and_refuses_what_never_fits():
    one = len(encoder.encode(body("a"))) + len(json.dumps([{"role": "user", "content": "x" * 100}]))
    store = ResponseStore(max_responses=100, max_bytes=2 * one + 10)
    for rid in "abc":
        assert store.put(body(rid), [{"role": "user", "content": "x" * 100}])
    assert list(store.entries) == ["b", "c"] and store.bytes <= store.max_bytes
    assert not store.put(body("d"), [{"role": "user", "content": "x" * (3 * one)}])
    assert "d" not in store.entries and store.delete("b") and not store.delete("b")
    assert list(store.entries) == ["c"]


class FakeService:
    """Just what the handler asks of a service: the model, and a scripted run of deltas."""

    def __init__(self, deltas: list[Delta | APIError]):
        self.script = deltas
        self.served = SimpleNamespace(name="m", tokenizer=SimpleNamespace(chat_template=None))

    def model(self, name):
        return self.served

    async def deltas(self, job):
        for d in self.script:
            if isinstance(d, APIError):
                raise d
            yield 0, d


def run_stream(request: dict, script: list) -> list[dict]:
    service = FakeService(script)
    store = ResponseStore()
    handler = ResponsesHandler(service, ResponsesRequest(**request), None, store)
    job = SimpleNamespace(id="job1", model=service.served, prompts=[[1, 2, 3]])

    async def collect() -> list[bytes]:
        return [chunk async for chunk in handler.stream(job)]

    events = []
    for chunk in asyncio.run(collect()):
        head, data = chunk.decode().strip().split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        events.append(event)
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for event in events:
        state.handle_event(EVENTS[event["type"]].model_validate(event))  # strict types, then the SDK's accumulator
    return events


def delta(text: str, finish: str | None = None) -> Delta:
    return Delta(text=text, token_ids=[7], logprobs=None, finish_reason=finish,
                 stats={"decoder": "ar"} if finish else None)


def test_text_stream_matches_the_sdk_types_and_final_body():
    events = run_stream({"input": "hi"}, [delta("Hel"), delta("lo", "stop")])
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    final = Response.model_validate(events[-1]["response"])
    assert final.output_text == "Hello" and final.usage.output_tokens == 2 and final.status == "completed"


def test_tool_call_stream_matches_the_sdk_types():
    call = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    events = run_stream({"input": "hi", "tools": tools}, [delta(call[:20]), delta(call[20:], "stop")])
    assert [e["type"] for e in events][2:] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    item = Response.model_validate(events[-1]["response"]).output[0]
    assert item.type == "function_call" and item.name == "f" and json.loads(item.arguments) == {"x": 1}


def test_engine_failure_mid_stream_ends_with_response_failed():
    events = run_stream({"input": "hi"}, [delta("Hel"), engine_error(FailureKind.INTERNAL, "a step failed")])
    assert events[-1]["type"] == "response.failed"
    failed = Response.model_validate(events[-1]["response"])
    assert failed.status == "failed" and failed.error.code == "server_error" and "step failed" in failed.error.message


def test_body_cut_by_max_output_tokens_matches_the_sdk_type():
    service = FakeService([])
    handler = ResponsesHandler(service, ResponsesRequest(input="hi", max_output_tokens=2), None, ResponseStore())
    job = SimpleNamespace(id="job1", model=service.served, prompts=[[1, 2, 3]])
    r = Response.model_validate_json(encoder.encode(handler.respond(job, [ChoiceResult(
        text="Hello", token_ids=[5, 6], finish_reason="length", stats={"cached_prompt_tokens": 2})])))
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.output_text == "Hello"
    assert r.usage.input_tokens_details.cached_tokens == 2 and r.usage.total_tokens == 5
    assert handler.store.get(r.id).messages[-1] == {"role": "assistant", "content": "Hello"}
