"""/v1/responses requests -> the chat request the chat handler already serves.

A Responses request is a chat request in other clothes: ``input`` items become chat messages
(a ``function_call`` item joins the assistant message before it as a tool call, a
``function_call_output`` item becomes a ``tool`` message), ``instructions`` a leading system
message, function tools and ``tool_choice`` lose one level of nesting, and ``text.format``
becomes ``response_format``. The chat template, the tool prompt, the tool-call grammar and
parser, and the JSON-schema grammar are then the chat path's own (``server.chat``,
``server.tools``).

What dualserve cannot do is refused here with a 400 that says so: built-in tools (web search,
file search, computer use, MCP...), background mode, stored conversations and prompt templates,
and non-text input parts.
"""

from __future__ import annotations

from typing import Any

from msgspec import structs

from ..errors import APIError, ErrorKind, bad_request
from ..protocol import (MAX_CONTENT_PARTS, ChatCompletionRequest, ChatMessage, ResponseFormat, ResponsesRequest,
                        SamplingFields)

TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
ROLES = ("user", "assistant", "system", "developer")
LOGPROBS_INCLUDE = "message.output_text.logprobs"


def unsupported(message: str, param: str) -> APIError:
    return APIError(ErrorKind.INVALID_REQUEST, message, param, "unsupported_parameter")


def refuse_unsupported(body: ResponsesRequest) -> None:
    """Everything dualserve does not do, as a 400 naming the parameter."""
    if body.background:
        raise unsupported("background mode is not supported by dualserve; omit 'background' (responses are "
                          "generated while the request is open, or streamed with stream=true)", "background")
    if body.conversation is not None:
        raise unsupported("conversations are not supported by dualserve; chain responses with "
                          "previous_response_id instead", "conversation")
    if body.prompt is not None:
        raise unsupported("stored prompt templates are not supported by dualserve; send 'input' and "
                          "'instructions'", "prompt")
    if body.n != 1:
        raise unsupported("the Responses API makes one output; use /v1/chat/completions for n > 1", "n")
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise bad_request("max_output_tokens must be at least 1", "max_output_tokens", "invalid_value")


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools ``{type, name, parameters...}`` -> chat's ``{type, function: {...}}``."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise unsupported(f"tools[{i}]: built-in tools such as {kind!r} are not supported by dualserve; only "
                              "function tools ({'type': 'function', 'name': ..., 'parameters': ...}) are",
                              f"tools[{i}]")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_request(f"tools[{i}].name must be a non-empty string", f"tools[{i}].name",
                              "missing_required_parameter")
        function = {k: v for k, v in tool.items() if k != "type" and v is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise unsupported(f"tool_choice of type {choice.get('type')!r} is not supported by dualserve; use 'none', "
                      "'auto', 'required' or {'type': 'function', 'name': ...}", "tool_choice")


def chat_response_format(body: ResponsesRequest) -> ResponseFormat | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if not isinstance(fmt.schema, dict):
        raise bad_request("text.format.schema must be a JSON schema object", "text.format.schema",
                          "missing_required_parameter")
    return ResponseFormat(type="json_schema", json_schema={"name": fmt.name or "response", "schema": fmt.schema,
                                                           "strict": fmt.strict})


def part_text(content: Any, param: str) -> str:
    """A message's or tool output's content: a string, or a list of text parts joined."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string or a list of content parts", param, "invalid_type")
    if len(content) > MAX_CONTENT_PARTS:
        raise bad_request(f"{param} has more than {MAX_CONTENT_PARTS} content parts", param, "array_above_max_length")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise unsupported(f"{param}[{j}]: only text content parts are supported by dualserve, got {kind!r}",
                              f"{param}[{j}]")
        texts.append(str(part.get("refusal" if kind == "refusal" else "text", "")))
    return "".join(texts)


def input_messages(items: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """``input`` as chat message dicts (the shape ``server.chat.message_dicts`` makes)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise bad_request("input must be a non-empty string or list of items", "input", "missing_required_parameter")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        param = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad_request(f"{param}.role must be one of {', '.join(ROLES)}", f"{param}.role",
                                  "invalid_value")
            out.append({"role": role, "content": part_text(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise bad_request(f"{param}: a function_call item needs 'call_id' and 'name'", param,
                                  "missing_required_parameter")
            call = {"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": str(item.get("arguments") or "{}")}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)   # parallel calls share one assistant turn
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{param}: a function_call_output item needs 'call_id'", param,
                                  "missing_required_parameter")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": part_text(item.get("output"), f"{param}.output")})
        elif kind == "reasoning":
            continue  # dualserve's models emit no reasoning items; one echoed back from elsewhere is dropped
        else:
            raise unsupported(f"{param}: input items of type {kind!r} are not supported by dualserve; send "
                              "messages, function_call and function_call_output items", param)
    return out


def chat_request(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request that serves ``body``, over the whole conversation ``messages``."""
    if body.instructions:
        messages = [{"role": "system", "content": body.instructions}, *messages]
    want_logprobs = LOGPROBS_INCLUDE in (body.include or []) or body.top_logprobs is not None
    shared = {name: getattr(body, name) for name in SamplingFields.__struct_fields__}
    shared["max_tokens"] = body.max_output_tokens if body.max_output_tokens is not None else body.max_tokens
    return ChatCompletionRequest(
        **shared, messages=[ChatMessage(**m) for m in messages], logprobs=want_logprobs,
        top_logprobs=body.top_logprobs if want_logprobs else None, tools=chat_tools(body.tools),
        tool_choice=chat_tool_choice(body.tool_choice), parallel_tool_calls=body.parallel_tool_calls,
        response_format=chat_response_format(body))


def echo_text_config(body: ResponsesRequest) -> dict[str, Any]:
    """``text`` as the response object reports it."""
    fmt = body.text.format if body.text is not None else None
    if fmt is None:
        return {"format": {"type": "text"}}
    return {"format": {k: v for k, v in structs.asdict(fmt).items() if v is not None}}
