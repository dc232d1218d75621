"""/v1/chat/completions: messages -> chat template -> prompt ids -> a plan, and results -> chat bodies.

The model's own chat template (from tokenizer_config.json or the GGUF file) is
rendered by ``dualserve.models.chat_template`` in a sandbox; a template error
is the client's 400, not our 500. Tools and ``response_format`` become a grammar
the engine enforces, and the routing knows the request is structured.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, AsyncIterator

from dualserve.decoders.engine.grammar import GrammarSpec

from .errors import bad_request
from .protocol import ChatCompletion, ChatCompletionRequest
from .router import RequestTraits
from .bodies import chat_body, chat_stream
from .service import ChoiceResult, Job, Plan, Service
from .shapes import check_depth, check_tool_calls, template_kwargs
from .streaming import ended_cleanly
from .tools import ToolStream, family_for, inject_tools, template_renders_tools

DEFAULT_MAX_TOKENS: int | None = None  # OpenAI's: the rest of the context, unless the decoder has its own

def message_dicts(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    if not body.messages:
        raise bad_request("messages must be a non-empty list", "messages", "missing_required_parameter")
    out = []
    for i, m in enumerate(body.messages):
        content = m.content
        if isinstance(content, list):  # content parts: keep the text ones
            texts = []
            for part in content:
                if part.get("type") not in ("text", "input_text"):
                    raise bad_request(f"messages[{i}].content: only text parts are supported, got "
                                      f"{part.get('type')!r}", f"messages[{i}].content", "unsupported_content")
                texts.append(str(part.get("text", "")))
            content = "".join(texts)
        d: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.name:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = check_tool_calls(m.tool_calls, f"messages[{i}].tool_calls")
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def forced_tool(body: ChatCompletionRequest) -> tuple[bool, str | None]:
    """(use tools at all, name of a forced function) from tools + tool_choice."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice requires tools", "tool_choice")
        return False, None
    for i, tool in enumerate(body.tools):
        check_depth(tool, f"tools[{i}]")
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict) or not fn.get("name"):
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}",
                              f"tools[{i}]")
    names = [t["function"]["name"] for t in body.tools]
    if choice is None or choice == "auto" or choice == "required":
        return True, None
    if choice == "none":
        return False, None
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise bad_request(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
        return True, name
    raise bad_request("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                      "{'name': ...}}", "tool_choice")


def response_grammar(body: ChatCompletionRequest) -> GrammarSpec | None:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return GrammarSpec("json_object")
    schema = (fmt.json_schema or {}).get("schema")
    if not isinstance(schema, dict):
        raise bad_request("response_format.json_schema.schema must be a JSON schema object",
                          "response_format.json_schema")
    check_depth(schema, "response_format.json_schema.schema")
    return GrammarSpec("json_schema", json.dumps(schema), strict=fmt.json_schema.get("strict") is True)


class ChatHandler:
    def __init__(self, service: Service, body: ChatCompletionRequest, header_decoder: str | None):
        self.service = service
        self.body = body
        self.header_decoder = header_decoder
        self.model = service.model(body.model)
        self.use_tools, self.forced = forced_tool(body)
        self.family = family_for(self.model.tokenizer.chat_template)

    def prompt_text(self) -> str:
        """The conversation rendered by the model's chat template, with the generation prompt: the
        text the chat path tokenizes (also llama.cpp's ``/apply-template`` answer)."""
        from dualserve.models.chat_template import ChatTemplateError

        tok = self.model.tokenizer
        messages = message_dicts(self.body)
        tools = self.body.tools if self.use_tools else None
        if tools and not template_renders_tools(tok.chat_template):
            messages, tools = inject_tools(messages, tools, self.family), None
        try:
            extra = template_kwargs(self.body.chat_template_kwargs)
            text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, **extra)
        except ChatTemplateError as e:
            raise bad_request(f"could not apply the chat template: {e}", "messages", "invalid_messages") from None
        self.service.check_length(self.model, [text], "messages")
        return text

    def prompt_ids(self) -> list[int]:
        return self.model.tokenizer.encode(self.prompt_text(), add_special_tokens=False)

    def plan(self) -> Plan:
        body = self.body
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
        return self.plan_for(self.prompt_ids())

    def plan_for(self, ids: list[int]) -> Plan:
        """The plan over ``ids``, this request's prompt as ``prompt_ids`` made it: for a caller that
        reads the prompt first (``anthropic.handler`` fits max_tokens to the context left)."""
        body = self.body
        grammar = response_grammar(body)
        if self.use_tools and (self.forced or body.tool_choice == "required"):
            max_calls = 1 if body.parallel_tool_calls is False else None
            grammar = GrammarSpec("lark", self.family.call_grammar(body.tools or [], self.forced, max_calls))
        agent = self.use_tools or any(m.role == "tool" or m.tool_calls for m in body.messages)
        route = self.service.route(self.model, RequestTraits.of(body, body.decoder or self.header_decoder,
                                                                structured=grammar is not None, agent=agent))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = self.service.sampling_params(body, max_tokens, logprobs, len(ids), self.model,
                                              default_max=route.default_max_tokens(DEFAULT_MAX_TOKENS))
        params = dataclasses.replace(params, grammar=grammar)
        return Plan(self.model, route, [ids], params, body.n)

    def respond(self, job: Job, results: list[ChoiceResult]) -> ChatCompletion:
        parser = self.family.parse if self.use_tools else None
        return chat_body(self.service, job, results, self.body.logprobs, results[0].stats if results else None,
                         parser)

    def stream(self, job: Job) -> AsyncIterator[bytes]:
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        tool_stream = (lambda: ToolStream(self.family)) if self.use_tools else None
        return ended_cleanly(chat_stream(self.service, job, self.body.logprobs, include_usage, tool_stream))
