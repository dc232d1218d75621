"""Anthropic Messages API wire types: the request, its content blocks, the message, the stream events.

Shapes follow Anthropic's API reference and the ``anthropic`` SDK's types
(``anthropic/types/message_create_params.py``, ``message.py``, ``raw_message_stream_event.py``).
Requests tolerate unknown fields (``cache_control``, ``citations``, ``thinking``,
``service_tier``, betas...), as msgspec ignores them; content blocks are a tagged union on
``type``, so an unknown block type is a 400 naming its place. Image and document blocks decode
so that ``to_chat`` can refuse them with a message that says why (no vision). dualserve's routing
hints (``decoder``, ``priority``, ``latency_budget_ms``, ``draft``) ride along as on chat.

Responses and events are tagged Structs: the tag is the ``type`` field, and for a stream event
also its SSE event name. ``Usage`` omits ``cache_read_input_tokens`` until it is known (at the
end of a stream). Error bodies are made in ``server.errors``, which serves every path.
"""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec
from msgspec import Struct

from ..protocol import MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_TOOLS, bounded

# ---- request ------------------------------------------------------------------------


class TextBlock(Struct, kw_only=True, tag="text", tag_field="type"):
    text: str


class ImageBlock(Struct, kw_only=True, tag="image", tag_field="type"):
    source: dict[str, Any] | None = None


class DocumentBlock(Struct, kw_only=True, tag="document", tag_field="type"):
    source: dict[str, Any] | None = None


class ToolUseBlock(Struct, kw_only=True, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(Struct, kw_only=True, tag="tool_result", tag_field="type"):
    tool_use_id: str
    content: str | bounded(list[Union[TextBlock, ImageBlock, DocumentBlock]], MAX_CONTENT_PARTS) | None = None
    is_error: bool = False


class ThinkingBlock(Struct, kw_only=True, tag="thinking", tag_field="type"):
    """Reasoning echoed back from an earlier turn: accepted, and left out of the prompt."""

    thinking: str = ""
    signature: str | None = None


class RedactedThinkingBlock(Struct, kw_only=True, tag="redacted_thinking", tag_field="type"):
    data: str = ""


ContentBlock = Union[TextBlock, ImageBlock, DocumentBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock,
                     RedactedThinkingBlock]


class InputMessage(Struct, kw_only=True):
    """A turn of ``messages``; a ``system`` one (text only) gives instructions mid-conversation."""

    role: Literal["user", "assistant", "system"]
    content: str | bounded(list[ContentBlock], MAX_CONTENT_PARTS)


class Tool(Struct, kw_only=True):
    """A client tool. Anthropic's server tools (web search, bash, text editor...) carry a versioned
    ``type`` and no ``input_schema``; ``to_chat`` refuses them."""

    name: str
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = None


class ToolChoice(Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class OutputFormat(Struct, kw_only=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(Struct, kw_only=True):
    """``format``: structured output, a JSON schema the answer follows (the SDK's ``messages.parse``
    sends it); ``effort`` is tolerated and ignored."""

    format: OutputFormat | None = None


class MessagesInput(Struct, kw_only=True):
    """What is templated into the prompt: the body of ``/v1/messages/count_tokens``."""

    model: str | None = None
    messages: bounded(list[InputMessage], MAX_MESSAGES)
    system: str | bounded(list[TextBlock], MAX_CONTENT_PARTS) | None = None
    tools: bounded(list[Tool], MAX_TOOLS) | None = None
    tool_choice: ToolChoice | None = None


class MessagesRequest(MessagesInput, kw_only=True):
    """POST /v1/messages."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    # dualserve's routing hints, as on /v1/chat/completions
    decoder: str | None = None
    priority: str | None = None
    latency_budget_ms: float | None = None
    draft: str | None = None


# ---- response -----------------------------------------------------------------------


class TextOut(Struct, kw_only=True, tag="text", tag_field="type"):
    text: str


class ToolUseOut(Struct, kw_only=True, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded"]


class Usage(Struct, kw_only=True, omit_defaults=True):
    input_tokens: int                         # prompt tokens not read from the prefix cache
    output_tokens: int
    cache_read_input_tokens: int | None = None  # prompt tokens read from the prefix cache


class Message(Struct, kw_only=True, tag="message", tag_field="type"):
    id: str
    model: str
    content: list[Union[TextOut, ToolUseOut]]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: Usage
    role: str = "assistant"


class TokenCount(Struct, kw_only=True):
    input_tokens: int


# ---- stream events (the tag is also the SSE event name) -------------------------------


class MessageStart(Struct, kw_only=True, tag="message_start", tag_field="type"):
    message: Message


class Ping(Struct, kw_only=True, tag="ping", tag_field="type"):
    pass


class BlockStart(Struct, kw_only=True, tag="content_block_start", tag_field="type"):
    index: int
    content_block: Union[TextOut, ToolUseOut]


class TextDelta(Struct, kw_only=True, tag="text_delta", tag_field="type"):
    text: str


class InputJsonDelta(Struct, kw_only=True, tag="input_json_delta", tag_field="type"):
    partial_json: str


class BlockDelta(Struct, kw_only=True, tag="content_block_delta", tag_field="type"):
    index: int
    delta: Union[TextDelta, InputJsonDelta]


class BlockStop(Struct, kw_only=True, tag="content_block_stop", tag_field="type"):
    index: int


class StopInfo(Struct, kw_only=True):
    stop_reason: StopReason
    stop_sequence: str | None


class MessageDelta(Struct, kw_only=True, tag="message_delta", tag_field="type"):
    delta: StopInfo
    usage: Usage   # totals, which the SDK writes over message_start's


class MessageStop(Struct, kw_only=True, tag="message_stop", tag_field="type"):
    pass


StreamEvent = Union[MessageStart, Ping, BlockStart, BlockDelta, BlockStop, MessageDelta, MessageStop]

messages_decoder = msgspec.json.Decoder(MessagesRequest)
count_decoder = msgspec.json.Decoder(MessagesInput)
