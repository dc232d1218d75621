"""Anthropic's Messages API through the real ``anthropic`` SDK against the real server.

Replies, streams, tool use, stop sequences, structured output and token counts, checked against
what the chat endpoint gives for the same conversation; bad input in Anthropic's error shape; a
failing stream's ``error`` event; a client leaving a stream; the ``x-api-key`` header; and Claude
Code in print mode where it is installed. The SDK sends no
sampling parameters of its own, so greedy requests pass ``temperature`` in ``extra_body``.
Outputs are cut short with ``max_tokens`` to keep the module fast.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from types import SimpleNamespace

import anthropic
import httpx
import jsonschema
import pytest
from litestar.testing import TestClient
from server_fixture import sdk_client

from dualserve.decoders.engine.request import Delta
from dualserve.server.anthropic.protocol import MessagesRequest
from dualserve.server.anthropic.stream import EventStream
from dualserve.server.app import AppState, create_app
from dualserve.server.errors import APIError, ErrorKind

MODEL = "SmolLM2-135M-Instruct"
GREEDY = {"temperature": 0}
SYSTEM = "You are a geography teacher."
QUESTION = "What is the capital of France?"
WEATHER = {"name": "get_weather", "description": "Weather for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                             "unit": {"enum": ["C", "F"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}
TIME = {"name": "get_time", "description": "Local time in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                         "required": ["city"]}}


@pytest.fixture(scope="module")
def client(server_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server_url, api_key="unused", timeout=300, max_retries=0)


def ask(client: anthropic.Anthropic, max_tokens: int = 16, **kw):
    return client.messages.create(model=MODEL, max_tokens=max_tokens, system=SYSTEM,
                                  messages=[{"role": "user", "content": QUESTION}], extra_body=GREEDY, **kw)


def test_reply_equals_chat_token_for_token(client, server_url):
    raw = client.messages.with_raw_response.create(
        model=MODEL, max_tokens=16, system=[{"type": "text", "text": SYSTEM}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                               {"type": "text", "text": " of France?", "cache_control":
                                                {"type": "ephemeral"}}]}],
        metadata={"user_id": "u1"}, extra_body={**GREEDY, "decoder": "ar", "future_field": 1})
    assert raw.headers["x-dualserve-decoder"] == "ar" and raw.headers["x-dualserve-route-reason"]
    m = raw.parse()
    chat = sdk_client(server_url).chat.completions.create(
        model=MODEL, max_tokens=16, temperature=0, extra_body={"decoder": "ar"},
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == chat.choices[0].message.content
    assert m.usage.output_tokens == chat.usage.completion_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    assert m.stop_sequence is None


def sse_events(server_url: str, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of a raw stream; checks that each name is its data's type."""
    events = []
    with httpx.stream("POST", f"{server_url}/v1/messages", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name
                events.append((name, data))
    return events


def test_stream_equals_create_and_events_come_in_order(client, server_url):
    whole = ask(client)
    with client.messages.stream(model=MODEL, max_tokens=16, system=SYSTEM, extra_body=GREEDY,
                                messages=[{"role": "user", "content": QUESTION}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert (final.stop_reason, final.stop_sequence) == (whole.stop_reason, whole.stop_sequence)
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": QUESTION}], **GREEDY}
    names = [name for name, _ in sse_events(server_url, body)]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    blocks = [n for n in names if n.startswith("content_block")]
    assert blocks[0] == "content_block_start" and blocks[-1] == "content_block_stop"
    assert set(blocks[1:-1]) == {"content_block_delta"}


def test_forced_tool_use_then_tool_result(client):
    question = [{"role": "user", "content": "What is the weather in Oslo?"}]
    m = client.messages.create(model=MODEL, max_tokens=60, messages=question, tools=[WEATHER, TIME],
                               tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    assert m.stop_reason == "tool_use" and m.content[-1].type == "tool_use"
    call = m.content[-1]
    assert call.id.startswith("toolu_") and call.name == "get_weather" and isinstance(call.input, dict)
    jsonschema.validate(call.input, WEATHER["input_schema"])
    follow = question + [{"role": "assistant", "content": m.content},
                         {"role": "user", "content": [
                             {"type": "tool_result", "tool_use_id": call.id,
                              "content": [{"type": "text", "text": "Sunny, 21 C."}]},
                             {"type": "text", "text": "Thanks. Summarise it."}]}]
    answer = client.messages.create(model=MODEL, max_tokens=8, messages=follow, tools=[WEATHER, TIME],
                                    tool_choice={"type": "none"}, extra_body=GREEDY)
    assert [b.type for b in answer.content] == ["text"] and answer.stop_reason in ("end_turn", "max_tokens")


def test_streamed_tool_use_arrives_as_input_json(client):
    with client.messages.stream(model=MODEL, max_tokens=60, tools=[WEATHER, TIME], extra_body=GREEDY,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                messages=[{"role": "user", "content": "Weather and time in Oslo?"}]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds and final.stop_reason == "tool_use"
    calls = [b for b in final.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name in ("get_weather", "get_time")
    jsonschema.validate(calls[0].input, {"get_weather": WEATHER, "get_time": TIME}[calls[0].name]["input_schema"])


def test_stop_sequence_is_reported(client):
    whole = ask(client)
    text = whole.content[0].text
    stop = " " + text.split()[2]  # a word the greedy answer is known to reach
    cut = ask(client, stop_sequences=["zzz-never", stop])
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert cut.content[0].text == text[:text.index(stop)]
    with client.messages.stream(model=MODEL, max_tokens=16, system=SYSTEM, stop_sequences=[stop],
                                extra_body=GREEDY, messages=[{"role": "user", "content": QUESTION}]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def test_count_tokens_is_the_prompt_the_request_templates(client):
    kw = {"system": SYSTEM, "messages": [{"role": "user", "content": QUESTION}]}
    with_tools = client.messages.count_tokens(model=MODEL, tools=[WEATHER], **kw).input_tokens
    plain = client.messages.count_tokens(model=MODEL, **kw).input_tokens
    assert with_tools > plain  # the tool prompt is part of the template
    m = client.messages.create(model=MODEL, max_tokens=1, tools=[WEATHER], extra_body=GREEDY, **kw)
    # Anthropic's usage splits the prompt into tokens read from the prefix cache and the rest.
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == with_tools
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 1


def test_structured_output_follows_the_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}
    m = client.messages.create(model=MODEL, max_tokens=40, messages=[{"role": "user", "content": QUESTION}],
                               output_config={"format": {"type": "json_schema", "schema": schema}},
                               extra_body=GREEDY)
    jsonschema.validate(json.loads(m.content[0].text), schema)


def test_mid_conversation_system_turn_and_thinking_blocks_are_accepted(client):
    """Claude Code sends ``system`` turns inside ``messages`` and echoes thinking blocks back."""
    m = client.messages.create(model=MODEL, max_tokens=4, extra_body=GREEDY, messages=[
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "greet", "signature": "x"},
                                          {"type": "text", "text": "Hello!"}]},
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": QUESTION}])
    assert m.usage.output_tokens == 4


BAD_BODIES = {
    "missing max_tokens": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    "bad role": {"model": MODEL, "max_tokens": 4, "messages": [{"role": "tool", "content": "hi"}]},
    "image block": {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]},
    "unknown tool in tool_choice": {"model": MODEL, "max_tokens": 4, "tools": [WEATHER],
                                    "tool_choice": {"type": "tool", "name": "nope"},
                                    "messages": [{"role": "user", "content": "hi"}]},
    "unknown block type": {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "hologram"}]}]},
    "server tool": {"model": MODEL, "max_tokens": 4, "tools": [{"type": "web_search_20250305", "name": "web_search"}],
                    "messages": [{"role": "user", "content": "hi"}]},
    "zero max_tokens": {"model": MODEL, "max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]},
}


@pytest.mark.parametrize("case", [*BAD_BODIES, "bad JSON"])
def test_bad_input_is_a_400_in_anthropic_shape(server_url, case):
    body = b'{"model": "' + MODEL.encode() + b'", "max_tokens": ' if case == "bad JSON" \
        else json.dumps(BAD_BODIES[case]).encode()
    r = httpx.post(f"{server_url}/v1/messages", content=body, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert set(r.json()["error"]) == {"type", "message"} and r.json()["error"]["message"]


def test_sdk_raises_on_bad_input_and_unknown_model(client):
    with pytest.raises(anthropic.BadRequestError, match="no vision"):
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1/x.png"}}]}])
    with pytest.raises(anthropic.BadRequestError, match="not in tools"):
        client.messages.create(model=MODEL, max_tokens=4, tools=[WEATHER], tool_choice={"type": "tool", "name": "x"},
                               messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.BadRequestError, match="prompt is too long"):
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "word " * 9000}])
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="claude-haiku-4-5", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["error"]["type"] == "not_found_error"


def test_max_tokens_past_the_context_is_served_to_the_context_end(client):
    """Claude Code asks for 32000 whatever the model: served, as Anthropic serves it, not refused."""
    m = client.messages.create(model=MODEL, max_tokens=32000, messages=[{"role": "user", "content": "Say hi."}],
                               stop_sequences=[" "], extra_body=GREEDY)
    assert m.stop_reason in ("end_turn", "stop_sequence")


def test_x_api_key_authenticates():
    """Anthropic's clients send the key as ``x-api-key``. The check runs before any handler, so an
    app without an engine shows it: a request let through is the handler's 400 (its body is not
    JSON), one refused is a 401."""
    app = create_app(AppState(service=None, api_key="sk-local"))

    def status(headers: dict[str, str]) -> int:
        return http.post("/v1/messages", content=b"{", headers={"content-type": "application/json",
                                                                **headers}).status_code

    with TestClient(app) as http:
        assert status({"x-api-key": "sk-local"}) == 400
        assert status({"Authorization": "Bearer sk-local"}) == 400
        for headers in ({"x-api-key": "sk-loca"}, {"x-api-key": "Bearer sk-local"}, {"x-api-key": ""}, {}):
            assert status(headers) == 401, headers


CLAUDE = shutil.which("claude")


@pytest.mark.skipif(CLAUDE is None, reason="Claude Code is not installed (npm install -g @anthropic-ai/claude-code)")
def test_claude_code_print_mode(server_url, tmp_path):
    """Claude Code answers through dualserve. Its default prompt (about 20k tokens of system prompt
    and tools) does not fit the default model's 8k context, so the session is bare, without tools;
    Claude Code sends no temperature, so its output is bounded by CLAUDE_CODE_MAX_OUTPUT_TOKENS."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_"))}
    env.update(HOME=str(tmp_path), ANTHROPIC_BASE_URL=server_url, ANTHROPIC_API_KEY="unused",
               DISABLE_TELEMETRY="1", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
               CLAUDE_CODE_MAX_OUTPUT_TOKENS="64")
    run = subprocess.run([CLAUDE, "-p", "Say hello.", "--model", MODEL, "--bare", "--tools", "",
                          "--system-prompt", "You are a friendly assistant. Answer in one sentence.",
                          "--no-session-persistence"], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=180)
    # Either an answer, or Claude Code's own report that the answer reached max_tokens: both mean it
    # read the stream to its message_delta.
    assert (run.returncode == 0 and run.stdout.strip()) or "output token maximum" in run.stdout, \
        (run.returncode, run.stdout, run.stderr)


def aborted(server_url: str) -> float:
    lines = httpx.get(f"{server_url}/metrics").text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith("dualserve_requests_total{") and 'status="abort"' in line)


def test_a_client_leaving_a_stream_aborts_its_request(server_url):
    before = aborted(server_url)
    body = {"model": MODEL, "max_tokens": 2000, "stream": True, **GREEDY,
            "messages": [{"role": "user", "content": "Write a long story about a dragon and a knight."}]}
    with httpx.stream("POST", f"{server_url}/v1/messages", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line == "event: content_block_delta":
                break  # generation is under way; leave
    deadline = time.monotonic() + 30
    while aborted(server_url) == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert aborted(server_url) == before + 1


async def test_a_failure_mid_stream_ends_with_an_error_event():
    """After the 200 has gone out, a failure (here a reader too slow, as ``Service.deltas`` raises
    it) is Anthropic's ``error`` event, the stream's last."""
    class Failing:
        async def deltas(self, job):
            yield 0, Delta("Hi", [1], None)
            raise APIError(ErrorKind.OVERLOADED, "the client read the stream too slowly")

    job = SimpleNamespace(id="x", model=SimpleNamespace(name=MODEL), prompts=[[1, 2, 3]])
    chat = SimpleNamespace(use_tools=False)
    body = MessagesRequest(messages=[], max_tokens=4)
    raw = b"".join([event async for event in EventStream(Failing(), body, chat, job).events()])
    events = [(block.split(b"\n")[0][len(b"event: "):].decode(), json.loads(block.split(b"\n")[1][len(b"data: "):]))
              for block in raw.strip().split(b"\n\n")]
    assert [name for name, _ in events] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                            "error"]
    assert events[-1][1] == {"type": "error", "error": {"type": "rate_limit_error",
                                                        "message": "the client read the stream too slowly"}}
