"""Chat templates: the Jinja programs that turn a conversation into a model's prompt text.

A template comes with the model (tokenizer_config.json `chat_template`, chat_template.jinja, or GGUF
`tokenizer.chat_template`) and is untrusted code, so it runs in Jinja's immutable sandbox. The
environment matches transformers' (utils/chat_template_utils.py, `_compile_jinja_template`), so
a template renders here exactly as `apply_chat_template(tokenize=False)` renders it there:

- `trim_blocks` and `lstrip_blocks`, and the `loopcontrols` extension (`break`, `continue`);
- a `tojson` filter that keeps non-ASCII text and does not HTML-escape, with indent/separators;
- globals `raise_exception(message)` and `strftime_now(format)`;
- the `{% generation %}` block that training templates use to mark assistant text; here it
  simply renders its body.

Every failure, at compile time or while rendering, surfaces as `ChatTemplateError`, which the
server reports as a client error: a template usually fails because of what a request sent.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A chat template did not compile, or refused or failed to render a conversation."""


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}`: rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


def _plain_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as dicts without None values, as transformers passes them.

    OpenAI clients send `"content": null` beside tool calls; most templates test for a missing key
    and would print "None" for a present one.
    """
    plain = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"a chat message must be an object, got {type(message).__name__}")
        plain.append({k: v for k, v in message.items() if v is not None})
    return plain


class ChatTemplate:
    """One compiled chat template."""

    def __init__(self, source: str) -> None:
        self.source = source
        try:
            self._template = _ENV.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template does not compile (line {e.lineno}): {e.message}") from e

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        bos_token: str | None = None,
        eos_token: str | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text; special-token names that are None stay undefined in the template."""
        variables = {k: v for k, v in {"bos_token": bos_token, "eos_token": eos_token, **extra}.items()
                     if v is not None}
        try:
            return self._template.render(
                messages=_plain_messages(messages), tools=list(tools) if tools is not None else None,
                add_generation_prompt=add_generation_prompt, **variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e}") from e
        except Exception as e:  # a template's own operations on request data (TypeError, KeyError...)
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e


@lru_cache(maxsize=32)
def compile_chat_template(source: str) -> ChatTemplate:
    """The compiled template for a source string, compiled once per process."""
    return ChatTemplate(source)
