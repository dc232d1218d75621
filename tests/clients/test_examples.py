"""The framework examples against a real server: LangChain (chat completions and the Responses API) and
the OpenAI Agents SDK (its default Responses provider, and chat-completions mode)."""

from __future__ import annotations

import asyncio

import pytest


def test_langchain_with_structured_output(server_url):
    pytest.importorskip("langchain_openai", reason="installed by the dev extra")
    from dualserve.clients.example_langchain import Location, run

    loc = run(f"{server_url}/v1")
    assert isinstance(loc, Location) and loc.city and loc.country


def test_agents_sdk_calls_the_tool(server_url):
    pytest.importorskip("agents", reason="installed by the dev extra")
    from dualserve.clients.example_agents import run

    result = asyncio.run(run(f"{server_url}/v1"))
    kinds = [type(item).__name__ for item in result.new_items]
    assert "ToolCallItem" in kinds and "ToolCallOutputItem" in kinds
    assert str(result.final_output).strip()


@pytest.mark.parametrize("stream", [False, True])
def test_agents_sdk_default_provider_runs_the_tool_loop(server_url, stream):
    """The SDK's default (Responses) provider, unchanged: a tool call, its output, then the answer."""
    pytest.importorskip("agents", reason="installed by the dev extra")
    from dualserve.clients.example_agents import run_responses

    result = asyncio.run(run_responses(f"{server_url}/v1", stream=stream))
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"] and kinds[-1] == "MessageOutputItem"
    assert "Paris" in result.new_items[1].output
    assert len(result.raw_responses) >= 2 and all(r.response_id.startswith("resp_") for r in result.raw_responses)
    assert str(result.final_output).strip()


def test_langchain_responses_api_structured_output_and_tool_loop(server_url):
    pytest.importorskip("langchain_openai", reason="installed by the dev extra")
    from dualserve.clients.example_langchain import Location, run, tool_loop

    loc = run(f"{server_url}/v1", use_responses_api=True)
    assert isinstance(loc, Location) and loc.city and loc.country
    call, answer = tool_loop(f"{server_url}/v1", use_responses_api=True)
    assert call.response_metadata["id"].startswith("resp_")  # served by /v1/responses
    assert call.tool_calls[0]["name"] == "get_weather" and call.tool_calls[0]["args"]["city"]
    assert answer.text.strip() and not answer.tool_calls


def test_hint_helper_reports_the_route(server_url):
    from openai import OpenAI

    from dualserve.clients.hints import Hints, routed

    client = OpenAI(base_url=f"{server_url}/v1", api_key="unused")
    raw = client.chat.completions.with_raw_response.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        **Hints(decoder="ar").kwargs())
    reply, route = routed(raw)
    assert route.decoder == "ar" and route.reason == "requested" and reply.choices
