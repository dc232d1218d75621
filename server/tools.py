"""Tool calling: prompt formats and output parsers per chat-template family, as a plain table.

The default model's family is ChatML (``<|im_start|>role ... <|im_end|>``), whose
tool-calling convention is Hermes-style (NousResearch Hermes 2 Pro, Qwen2.5):
tools are described in the system prompt inside ``<tools></tools>`` and the
model answers with ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

When the model's own template renders ``tools`` we let it; when it does not
(SmolLM2's template ignores them) the family's system prompt is added. With
``tool_choice`` ``required`` or a named function, the call is *enforced* by a
grammar (see ``dualserve.decoders.engine.grammar``), so even a small model produces a
well-formed call.

To add a family: write a ``ToolFamily`` (system prompt, call grammar, parser)
and add it to ``FAMILIES``; ``family_for`` picks it from the template text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from dualserve.decoders.engine.grammar import bounded_schema

from .protocol import ChatDelta, DeltaToolCall, FunctionCall, ToolCall

HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
    "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions "
    "about what values to plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\n"
    "For each function call return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags as follows:\n<tool_call>\n{{\"name\": <function-name>, "
    "\"arguments\": <args-dict>}}\n</tool_call>")
CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolFamily:
    name: str
    open_tag: str
    system_prompt: Callable[[list[dict[str, Any]]], str]
    call_grammar: Callable[[list[dict[str, Any]], str | None, int | None], str]  # (tools, forced, max calls)
    parse: Callable[[str], tuple[str, list[ToolCall]]]


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def hermes_system(tools: list[dict[str, Any]]) -> str:
    return HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def hermes_parse(text: str) -> tuple[str, list[ToolCall]]:
    """Split model output into plain content and tool calls."""
    calls = []
    for raw in CALL_RE.findall(text):
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or "name" not in obj:
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append(ToolCall(id=_call_id(), function=FunctionCall(
            name=str(obj["name"]), arguments=args if isinstance(args, str) else json.dumps(args))))
    content = text.split("<tool_call>", 1)[0].strip() if calls else text
    return content, calls


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
    """ChatML templates (and anything unknown) use Hermes-style calls."""
    return FAMILIES["hermes"]


def template_renders_tools(chat_template: str | None) -> bool:
    return bool(chat_template and "tools" in chat_template)


def inject_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]], family: ToolFamily,
                 ) -> list[dict[str, Any]]:
    """Describe the tools in the system message; render past calls and results as the family expects."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = [f"<tool_call>\n{json.dumps({'name': c['function']['name'], 'arguments': _args(c)})}"
                     "\n</tool_call>" for c in m["tool_calls"]]
            m["content"] = "\n".join(filter(None, [m.get("content") or "", *calls]))
            m.pop("tool_calls")
        if m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content', '')}\n</tool_response>"}
        out.append(m)
    system = family.system_prompt(tools)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out


def _args(call: dict[str, Any]) -> Any:
    raw = call.get("function", {}).get("arguments", "{}")
    try:
        return json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError:
        return raw


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
