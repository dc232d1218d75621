"""/v1/messages requests -> the chat request the chat handler already serves.

A Messages request is a chat request in other clothes, so it is translated and then templated,
routed and constrained by the chat path (``server.chat``, ``server.tools``):

- ``system`` (a string or text blocks) becomes a leading system message, and a ``system`` turn
  in ``messages`` (Claude Code sends them) a system message in its place;
- a message's text blocks become the chat message's text parts, joined as chat joins them;
- an assistant's ``tool_use`` blocks become its ``tool_calls`` (``input`` as JSON arguments);
- a user's ``tool_result`` blocks become ``tool`` messages, in order, around its text (a result
  with ``is_error`` is prefixed "Error: ", which is what the flag tells the model);
- ``thinking`` and ``redacted_thinking`` blocks echoed back are dropped: no model here reasons;
- ``tools`` become function tools (``input_schema`` as ``parameters``); ``tool_choice`` maps
  ``any`` -> ``required`` and ``tool`` -> a named function, and ``disable_parallel_tool_use``
  becomes ``parallel_tool_calls: false``;
- ``stop_sequences`` become ``stop``, and ``output_config.format`` (structured output) a strict
  ``json_schema`` response format, which the chat path enforces with a grammar.

What dualserve cannot do is refused with a 400 that says so: image and document blocks (no
model here has vision) and Anthropic's server tools (web search, code execution...).
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import APIError, ErrorKind, bad_request
from ..protocol import ChatCompletionRequest, ChatMessage, ResponseFormat
from ..shapes import check_depth
from .protocol import (DocumentBlock, ImageBlock, InputMessage, MessagesInput, MessagesRequest, RedactedThinkingBlock,
                       TextBlock, ThinkingBlock, ToolChoice, ToolResultBlock, ToolUseBlock)

TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def unsupported(message: str, param: str) -> APIError:
    return APIError(ErrorKind.INVALID_REQUEST, message, param, "unsupported_parameter")


def refuse_media(block: ImageBlock | DocumentBlock, param: str) -> APIError:
    kind = "image" if isinstance(block, ImageBlock) else "document"
    return unsupported(f"{param}: {kind} blocks are not supported: this server's models have no vision; send "
                       "text blocks", param)


def text_parts(blocks: list[TextBlock]) -> list[dict[str, Any]]:
    return [{"type": "text", "text": b.text} for b in blocks]


def result_text(block: ToolResultBlock, param: str) -> str:
    if isinstance(block.content, list):
        for j, part in enumerate(block.content):
            if not isinstance(part, TextBlock):
                raise refuse_media(part, f"{param}.content[{j}]")
        text = "".join(part.text for part in block.content)
    else:
        text = block.content or ""
    return f"Error: {text}" if block.is_error else text


def user_turn(message: InputMessage, param: str) -> list[ChatMessage]:
    """One user message: its text blocks as user messages, its tool results as tool messages, in order."""
    out: list[ChatMessage] = []
    texts: list[TextBlock] = []
    for j, block in enumerate(message.content):
        where = f"{param}.content[{j}]"
        if isinstance(block, TextBlock):
            texts.append(block)
            continue
        if texts:
            out.append(ChatMessage(role="user", content=text_parts(texts)))
            texts = []
        if isinstance(block, ToolResultBlock):
            out.append(ChatMessage(role="tool", tool_call_id=block.tool_use_id, content=result_text(block, where)))
        elif isinstance(block, (ImageBlock, DocumentBlock)):
            raise refuse_media(block, where)
        elif not isinstance(block, (ThinkingBlock, RedactedThinkingBlock)):
            raise bad_request(f"{where}: a user message cannot hold a {block.__struct_config__.tag} block", where,
                              "invalid_value")
    if texts or not out:
        out.append(ChatMessage(role="user", content=text_parts(texts)))
    return out


def assistant_turn(message: InputMessage, param: str) -> ChatMessage:
    """One assistant message: its text, and its tool_use blocks as OpenAI-shaped tool calls."""
    texts: list[TextBlock] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        where = f"{param}.content[{j}]"
        if isinstance(block, TextBlock):
            texts.append(block)
        elif isinstance(block, ToolUseBlock):
            check_depth(block.input, f"{where}.input")  # before json.dumps recurses into it
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif isinstance(block, (ImageBlock, DocumentBlock)):
            raise refuse_media(block, where)
        elif not isinstance(block, (ThinkingBlock, RedactedThinkingBlock)):
            raise bad_request(f"{where}: an assistant message cannot hold a {block.__struct_config__.tag} block",
                              where, "invalid_value")
    return ChatMessage(role="assistant", content=text_parts(texts) or "", tool_calls=calls or None)


def system_turn(message: InputMessage, param: str) -> ChatMessage:
    for j, block in enumerate(message.content):
        if not isinstance(block, TextBlock):
            raise bad_request(f"{param}.content[{j}]: a system message holds text blocks only", f"{param}.content[{j}]",
                              "invalid_value")
    return ChatMessage(role="system", content=text_parts(message.content))


def chat_messages(body: MessagesInput) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    if body.system:
        out.append(ChatMessage(role="system",
                               content=body.system if isinstance(body.system, str) else text_parts(body.system)))
    for i, message in enumerate(body.messages):
        if isinstance(message.content, str):
            out.append(ChatMessage(role=message.role, content=message.content))
        elif message.role == "user":
            out += user_turn(message, f"messages[{i}]")
        elif message.role == "system":
            out.append(system_turn(message, f"messages[{i}]"))
        else:
            out.append(assistant_turn(message, f"messages[{i}]"))
    return out


def chat_tools(body: MessagesInput) -> list[dict[str, Any]] | None:
    """Client tools ``{name, description, input_schema}`` -> chat's ``{type: function, function}``."""
    if not body.tools:
        return None
    out = []
    for i, tool in enumerate(body.tools):
        if tool.type not in (None, "custom"):
            raise unsupported(f"tools[{i}]: Anthropic's server tools such as {tool.type!r} are not supported by "
                              "dualserve; define client tools ({'name', 'description', 'input_schema'})",
                              f"tools[{i}]")
        if not tool.name:
            raise bad_request(f"tools[{i}].name must be a non-empty string", f"tools[{i}].name", "invalid_value")
        if tool.input_schema is None:
            raise bad_request(f"tools[{i}].input_schema: Field required", f"tools[{i}].input_schema",
                              "missing_required_parameter")
        function = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description:
            function["description"] = tool.description
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: ToolChoice | None) -> str | dict[str, Any] | None:
    if choice is None:
        return None
    if choice.type != "tool":
        return TOOL_CHOICES[choice.type]
    if not choice.name:
        raise bad_request("tool_choice.name: Field required when tool_choice.type is 'tool'", "tool_choice.name",
                          "missing_required_parameter")
    return {"type": "function", "function": {"name": choice.name}}


def sampling_fields(body: MessagesRequest) -> dict[str, Any]:
    """The generation fields of a Messages request, as chat names them."""
    if any(not s for s in body.stop_sequences or []):
        raise bad_request("stop_sequences must be non-empty strings", "stop_sequences", "invalid_value")
    return {"max_tokens": body.max_tokens, "temperature": body.temperature, "top_p": body.top_p,
            "top_k": body.top_k, "stream": body.stream, "stop": body.stop_sequences, "decoder": body.decoder,
            "priority": body.priority, "latency_budget_ms": body.latency_budget_ms, "draft": body.draft,
            "response_format": response_format(body)}


def response_format(body: MessagesRequest) -> ResponseFormat | None:
    fmt = body.output_config.format if body.output_config is not None else None
    if fmt is None:
        return None
    return ResponseFormat(type="json_schema", json_schema={"name": "output", "schema": fmt.schema, "strict": True})


def chat_request(body: MessagesInput) -> ChatCompletionRequest:
    """The chat request that serves ``body``: its prompt (all ``count_tokens`` needs) and, for a
    ``MessagesRequest``, its generation."""
    choice = body.tool_choice
    sampling = sampling_fields(body) if isinstance(body, MessagesRequest) else {}
    return ChatCompletionRequest(
        model=body.model, messages=chat_messages(body), tools=chat_tools(body), tool_choice=chat_tool_choice(choice),
        parallel_tool_calls=False if choice is not None and choice.disable_parallel_tool_use else None, **sampling)
