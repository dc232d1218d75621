"""The OpenAI Agents SDK in chat-completions mode against dualserve, with one function tool.

    python -m dualserve.clients.example_agents --base-url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse
import asyncio


async def run(base_url: str, model: str = "SmolLM2-135M-Instruct", api_key: str = "unused"):
    """Returns the Agents SDK RunResult (final_output, new_items with the tool call and its output)."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no network: traces would go to OpenAI

    @function_tool
    def get_weather(city: str) -> str:
        """Return the weather for a city."""
        return f"It is sunny and 21 C in {city}."

    client = AsyncOpenAI(base_url=base_url, api_key=api_key)
    agent = Agent(
        name="weather",
        instructions="Answer weather questions by calling get_weather, then reply in one sentence.",
        model=OpenAIChatCompletionsModel(model=model, openai_client=client),
        # "required" makes the first turn call the tool (enforced by a grammar on the server);
        # the SDK resets tool_choice after a tool call, so the second turn answers in text.
        model_settings=ModelSettings(temperature=0, max_tokens=64, tool_choice="required"),
        tools=[get_weather],
    )
    result = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    args = parser.parse_args()
    print(asyncio.run(run(args.base_url, args.model)).final_output)
