"""Admission checks on free-form request values: what a template, a tool prompt or a grammar would
otherwise trip over with a 500.

msgspec types the bodies, but several fields are free JSON (tool schemas, past tool calls,
template arguments). Each check here answers 400 with the offending field named:

- **nesting depth**: msgspec accepts about 990 levels, while ``json.dumps`` and grammar
  compilation recurse once per level; real schemas nest a handful of levels;
- **past tool calls** on assistant messages must be OpenAI's shape,
  ``{"id", "type": "function", "function": {"name": str, "arguments": str}}``, since the
  tool prompt renders them (``tools.inject_tools``);
- **chat_template_kwargs** may not name the arguments the template is rendered with.
"""

from __future__ import annotations

from typing import Any

from .errors import bad_request

# Deep enough for any real JSON schema or tool definition; shallow enough for every recursive
# walk (json.dumps, jinja's tojson, llguidance's schema compiler) to stay far from the stack limit.
MAX_NESTING = 64

# Names the chat template is rendered with (``Tokenizer.apply_chat_template``, ``ChatTemplate.render``).
RESERVED_TEMPLATE_KWARGS = frozenset({"self", "messages", "tools", "add_generation_prompt"})


def nesting_depth(value: Any, limit: int = MAX_NESTING) -> int:
    """How deeply ``value`` nests lists and dicts (a scalar is 0), counted without recursion;
    stops counting once past ``limit``."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth + 1)
        if deepest > limit:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest


def check_depth(value: Any, param: str, limit: int = MAX_NESTING) -> None:
    if nesting_depth(value, limit) > limit:
        raise bad_request(f"{param} is nested more than {limit} levels deep", param, "invalid_value")


def check_tool_calls(calls: Any, param: str) -> list[dict[str, Any]]:
    """Past tool calls in OpenAI's shape; ``arguments`` may also be an object (some clients send one)."""
    if not isinstance(calls, list):
        raise bad_request(f"{param} must be a list of tool calls", param, "invalid_type")
    for j, call in enumerate(calls):
        where = f"{param}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"{where} must be {{'type': 'function', 'function': {{'name': ..., 'arguments': "
                              "...}}}}", where, "invalid_value")
        if call.get("type", "function") != "function":
            raise bad_request(f"{where}.type must be 'function'", f"{where}.type", "invalid_value")
        if not isinstance(fn.get("arguments", ""), (str, dict)):
            raise bad_request(f"{where}.function.arguments must be a JSON string", f"{where}.function.arguments",
                              "invalid_type")
    check_depth(calls, param)
    return calls


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """chat_template_kwargs, refused when they would replace a render argument."""
    kwargs = kwargs or {}
    clash = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if clash:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(clash)}: the server sets "
                          f"{', '.join(sorted(RESERVED_TEMPLATE_KWARGS - {'self'}))}", "chat_template_kwargs",
                          "invalid_value")
    check_depth(kwargs, "chat_template_kwargs")
    return kwargs
