"""The OpenAI Agents SDK against dualserve, with one function tool: its default provider (the
Responses API, POST /v1/responses) or, by hand, chat-completions mode.

    python -m dualserve.clients.example_agents --base-url http://127.0.0.1:8000/v1
    python -m dualserve.clients.example_agents --api chat_completions
"""

from __future__ import annotations

import argparse
import asyncio

MODEL = "SmolLM2-135M-Instruct"
INSTRUCTIONS = "Answer weather questions by calling get_weather, then reply in one sentence."


def weather_agent(model, max_tokens: int):
    """An agent with one function tool. ``tool_choice="required"`` makes the first turn call the
    tool (enforced by a grammar on the server); the SDK resets tool_choice after a tool call, so
    the next turn answers in text."""
    from agents import Agent, ModelSettings, function_tool

    @function_tool
    def get_weather(city: str) -> str:
        """Return the weather for a city."""
        return f"It is sunny and 21 C in {city}."

    return Agent(name="weather", instructions=INSTRUCTIONS, model=model, tools=[get_weather],
                 model_settings=ModelSettings(temperature=0, max_tokens=max_tokens, tool_choice="required"))


async def run_responses(base_url: str, model: str = MODEL, api_key: str = "unused", question: str =
                        "What is the weather in Paris?", stream: bool = False):
    """The SDK's default model provider, unchanged: only its client points at dualserve.

    Returns the RunResult (final_output, new_items with the tool call and its output). The
    Responses path fails a run whose answer is cut by ``max_output_tokens``, so the budget here
    is larger than in chat-completions mode."""
    from agents import Runner, set_default_openai_client, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no network: traces would go to OpenAI
    set_default_openai_client(AsyncOpenAI(base_url=base_url, api_key=api_key), use_for_tracing=False)
    agent = weather_agent(model, max_tokens=256)   # a model name: the default provider picks the Responses model
    if not stream:
        return await Runner.run(agent, question, max_turns=4)
    result = Runner.run_streamed(agent, question, max_turns=4)
    async for _ in result.stream_events():
        pass
    return result


async def run(base_url: str, model: str = MODEL, api_key: str = "unused"):
    """Chat-completions mode, chosen by hand. Returns the Agents SDK RunResult."""
    from agents import OpenAIChatCompletionsModel, Runner, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=base_url, api_key=api_key)
    agent = weather_agent(OpenAIChatCompletionsModel(model=model, openai_client=client), max_tokens=64)
    return await Runner.run(agent, "What is the weather in Paris?", max_turns=4)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--api", choices=["responses", "chat_completions"], default="responses")
    args = parser.parse_args()
    runner = run_responses if args.api == "responses" else run
    print(asyncio.run(runner(args.base_url, args.model)).final_output)
