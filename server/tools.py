"""Tool calling: prompt formats, call grammars and output parsers per chat-template family, as a plain table.

The prompt side (how tools and past calls are written into the messages, and how calls are
read back out of text) lives below the server in ``dualserve.models.tool_prompt``, which the
offline distillation job renders with too; this module adds what only serving needs: the
grammar that enforces a call, parsing into the wire types, and streaming.

When the model's own template renders ``tools`` we let it; when it does not
(SmolLM2's template ignores them) the family's system prompt is added. With
``tool_choice`` ``required`` or a named function, the call is *enforced* by a
grammar (see ``dualserve.decoders.engine.grammar``), so even a small model produces a
well-formed call.

To add a family: write its ``ToolFormat`` in ``models/tool_prompt.py``, then a ``ToolFamily``
here (call grammar, parser) and add it to ``FAMILIES``; ``family_for`` picks it from the
template text.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from dualserve.decoders.engine.grammar import bounded_schema
from dualserve.models.tool_prompt import (CALL_RE, HERMES_SYSTEM, format_for, hermes_calls, hermes_system,  # noqa: F401
                                          inject_tools, template_renders_tools)

from .protocol import ChatDelta, DeltaToolCall, FunctionCall, ToolCall


@dataclass(frozen=True)
class ToolFamily:
    name: str
    open_tag: str
    system_prompt: Callable[[list[dict[str, Any]]], str]
    call_grammar: Callable[[list[dict[str, Any]], str | None, int | None], str]  # (tools, forced, max calls)
    parse: Callable[[str], tuple[str, list[ToolCall]]]


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def hermes_parse(text: str) -> tuple[str, list[ToolCall]]:
    """Split model output into plain content and tool calls."""
    content, calls = hermes_calls(text)
    return content, [ToolCall(id=_call_id(), function=FunctionCall(name=name, arguments=arguments))
                     for name, arguments in calls]


def hermes_call_grammar(tools: list[dict[str, Any]], forced: str | None, max_calls: int | None = None) -> str:
    """Lark grammar: <tool_call> blocks (one or more, at most ``max_calls``) whose JSON matches a tool's
    parameter schema."""
    alternatives = []
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool)
        if forced is not None and fn.get("name") != forced:
            continue
        # Arguments bounded as under response_format (grammar.bounded_schema); ``strict`` refuses extra keys.
        schema = bounded_schema({"type": "object", "properties": {
            "name": {"const": fn["name"]},
            "arguments": fn.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False}, strict=fn.get("strict") is True)
        alternatives.append((f"call{i}", json.dumps(schema)))
    rules = "\n".join(f"{name}: %json {schema}" for name, schema in alternatives)
    body = " | ".join(name for name, _ in alternatives)
    repeat = "" if max_calls == 1 else "+"
    return f'start: ("<tool_call>\\n" ({body}) "\\n</tool_call>"){repeat}\n{rules}\n'


HERMES = ToolFamily("hermes", "<tool_call>", hermes_system, hermes_call_grammar, hermes_parse)
FAMILIES: dict[str, ToolFamily] = {"hermes": HERMES}


def family_for(chat_template: str | None) -> ToolFamily:
    """The family of the template's tool format (``tool_prompt.format_for``)."""
    return FAMILIES[format_for(chat_template).name]


class ToolStream:
    """Streams content until a tool call starts, then emits the calls in OpenAI's delta format at the end."""

    def __init__(self, family: ToolFamily):
        self.family = family
        self.text = ""
        self.sent = 0           # characters of plain content already streamed
        self.in_call = False

    def feed(self, delta_text: str, final: bool) -> tuple[ChatDelta, bool]:
        self.text += delta_text
        tag = self.family.open_tag
        if not self.in_call:
            at = self.text.find(tag)
            if at >= 0:
                self.in_call = True
                safe = at
            else:
                # Hold back a suffix that could be the start of the tag.
                safe = len(self.text)
                for k in range(min(len(tag) - 1, len(self.text)), 0, -1):
                    if tag.startswith(self.text[-k:]):
                        safe = len(self.text) - k
                        break
                if final:
                    safe = len(self.text)
            content = self.text[self.sent:safe]
            self.sent = max(self.sent, safe)
        else:
            content = ""
        if not final:
            return ChatDelta(content=content) if content else ChatDelta(), False
        _, calls = self.family.parse(self.text) if self.in_call else ("", [])
        if not calls:
            rest = self.text[self.sent:]
            self.sent = len(self.text)
            text = content + rest
            return (ChatDelta(content=text) if text else ChatDelta()), False
        deltas = [DeltaToolCall(index=i, id=c.id, type="function",
                                function={"name": c.function.name, "arguments": c.function.arguments})
                  for i, c in enumerate(calls)]
        return ChatDelta(content=content or None, tool_calls=deltas), True
