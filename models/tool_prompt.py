"""Tool prompts: how a conversation's tools and past tool calls are written into its messages.

When a model's chat template renders ``tools`` it does so itself; when it does not (SmolLM2's
ignores them) the tools are described in the system message and past calls and results are
written the way the model's family was trained on. This module is that rendering, and the
reading of calls back out of model text, as plain data below everything that renders prompts:
the server (``server/tools.py`` adds call grammars, parsers into wire types and streaming) and
the offline self-distillation job (``decoders/training/distil.py``), whose prompts must match
the server's byte for byte (what a draft model learns to draft is what the server sends).

The default model's family is ChatML (``<|im_start|>role ... <|im_end|>``), whose tool-calling
convention is Hermes-style (NousResearch Hermes 2 Pro, Qwen2.5): tools are described inside
``<tools></tools>`` and the model answers with
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Protocol

HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
    "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions "
    "about what values to plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\n"
    "For each function call return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags as follows:\n<tool_call>\n{{\"name\": <function-name>, "
    "\"arguments\": <args-dict>}}\n</tool_call>")
CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolFormat:
    """One family's tool prompt: its system prompt, the tag that opens a call, and how calls are
    read from model text: (plain content, [(function name, arguments as JSON text)])."""

    name: str
    open_tag: str
    system_prompt: Callable[[list[dict[str, Any]]], str]
    read_calls: Callable[[str], tuple[str, list[tuple[str, str]]]]


class HasSystemPrompt(Protocol):
    system_prompt: Callable[[list[dict[str, Any]]], str]


def hermes_system(tools: list[dict[str, Any]]) -> str:
    return HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def hermes_calls(text: str) -> tuple[str, list[tuple[str, str]]]:
    """Split model output into plain content and the calls it makes (malformed ones are skipped)."""
    calls = []
    for raw in CALL_RE.findall(text):
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or "name" not in obj:
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append((str(obj["name"]), args if isinstance(args, str) else json.dumps(args)))
    content = text.split("<tool_call>", 1)[0].strip() if calls else text
    return content, calls


HERMES = ToolFormat("hermes", "<tool_call>", hermes_system, hermes_calls)
FORMATS: dict[str, ToolFormat] = {"hermes": HERMES}


def format_for(chat_template: str | None) -> ToolFormat:
    """ChatML templates (and anything unknown) use Hermes-style calls."""
    return FORMATS["hermes"]


def template_renders_tools(chat_template: str | None) -> bool:
    return bool(chat_template and "tools" in chat_template)


def inject_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]], family: HasSystemPrompt,
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
