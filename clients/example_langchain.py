"""LangChain's ChatOpenAI against dualserve: ``with_structured_output`` (json_schema) and a
``bind_tools`` tool loop, over chat completions or, with ``use_responses_api``, /v1/responses.

    python -m dualserve.clients.example_langchain --base-url http://127.0.0.1:8000/v1 [--responses]
"""

from __future__ import annotations

import argparse

from pydantic import BaseModel, Field

MODEL = "SmolLM2-135M-Instruct"


class Location(BaseModel):
    city: str = Field(description="the city")
    country: str = Field(description="the country")


def chat_model(base_url: str, model: str = MODEL, api_key: str = "unused", use_responses_api: bool = False):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=base_url, api_key=api_key, model=model, temperature=0, max_tokens=64,
                      use_responses_api=use_responses_api)


def run(base_url: str, model: str = MODEL, api_key: str = "unused", use_responses_api: bool = False) -> Location:
    structured = chat_model(base_url, model, api_key, use_responses_api).with_structured_output(
        Location, method="json_schema")
    return structured.invoke("Paris is the capital of France. Extract the city and the country.")


def tool_loop(base_url: str, model: str = MODEL, api_key: str = "unused", use_responses_api: bool = False):
    """Two turns: the model calls ``get_weather`` (forced by naming it in ``tool_choice``, which the
    server enforces with a grammar), the tool runs, and the model answers from its result.

    Returns (the tool-calling AIMessage, the final AIMessage)."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Return the weather for a city."""
        return f"It is sunny and 21 C in {city}."

    llm = chat_model(base_url, model, api_key, use_responses_api)
    messages = [HumanMessage("What is the weather in Paris?")]
    call = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(messages)
    results = [ToolMessage(get_weather.invoke(c["args"]), tool_call_id=c["id"]) for c in call.tool_calls]
    answer = llm.bind_tools([get_weather], tool_choice="none").invoke([*messages, call, *results])
    return call, answer


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--responses", action="store_true", help="use the Responses API (/v1/responses)")
    args = parser.parse_args()
    print(run(args.base_url, args.model, use_responses_api=args.responses))
    print(tool_loop(args.base_url, args.model, use_responses_api=args.responses)[1].text)
