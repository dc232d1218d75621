"""LangChain's ChatOpenAI against dualserve, with ``with_structured_output`` (json_schema).

    python -m dualserve.clients.example_langchain --base-url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse

from pydantic import BaseModel, Field


class Location(BaseModel):
    city: str = Field(description="the city")
    country: str = Field(description="the country")


def run(base_url: str, model: str = "SmolLM2-135M-Instruct", api_key: str = "unused") -> Location:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=base_url, api_key=api_key, model=model, temperature=0, max_tokens=64)
    structured = llm.with_structured_output(Location, method="json_schema")
    return structured.invoke("Paris is the capital of France. Extract the city and the country.")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    args = parser.parse_args()
    print(run(args.base_url, args.model))
