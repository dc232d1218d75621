"""The framework examples against a real server: LangChain structured output and the OpenAI Agents SDK."""

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


def test_hint_helper_reports_the_route(server_url):
    from openai import OpenAI

    from dualserve.clients.hints import Hints, routed

    client = OpenAI(base_url=f"{server_url}/v1", api_key="unused")
    raw = client.chat.completions.with_raw_response.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        **Hints(decoder="ar").kwargs())
    reply, route = routed(raw)
    assert route.decoder == "ar" and route.reason == "requested" and reply.choices
