"""Chat templates render as transformers renders them, in a sandbox, with clear errors."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models

from dualserve.models.chat_template import ChatTemplate, ChatTemplateError, compile_chat_template

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "Quatre."},
        {"role": "user", "content": "Et 3+3 ? 🤔 <b>bold</b>"},
    ],
    [{"role": "user", "content": "multi\nline\n\n  indented"}, {"role": "assistant", "content": ""}],
]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Météo <ville> & \"pays\"",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

# Exercises what HF templates use: tools with tojson (indent, non-ASCII, HTML characters),
# namespace, loop controls, whitespace control, raise_exception guard, extra variables.
TOOLS_TEMPLATE = """\
{%- set ns = namespace(system=none) -%}
{%- for message in messages -%}
  {%- if message['role'] == 'system' %}{% set ns.system = message['content'] %}{% endif -%}
{%- endfor -%}
{{ bos_token }}
{%- if tools %}
<tools>
{% for tool in tools %}{{ tool | tojson(indent=2) }}
{% endfor %}</tools>
{% endif %}
{%- if ns.system %}SYSTEM: {{ ns.system }}
{% endif %}
{%- for message in messages %}
  {%- if message['role'] == 'system' %}{% continue %}{% endif %}
  {%- if message['role'] not in ['user', 'assistant', 'tool'] %}{{ raise_exception('bad role') }}{% endif %}
  {{ message['role'] | upper }}: {{ message['content'] | trim }}
  {%- if message.tool_calls is defined %} CALLS {{ message.tool_calls | tojson }}{% endif %}
{{ eos_token }}
{% endfor %}
{%- if add_generation_prompt %}ASSISTANT{% if enable_thinking is defined and not enable_thinking %} /no_think{% endif %}:{% endif %}"""


@pytest.fixture(scope="module")
def reference(default_gguf: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast.from_pretrained(
        str(default_gguf.parent), gguf_file=default_gguf.name)


def test_default_template_matches_transformers(reference):
    template = ChatTemplate(reference.chat_template)
    for messages in CONVERSATIONS:
        for prompt in (True, False):
            expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            rendered = template.render(messages, add_generation_prompt=prompt,
                                       bos_token=reference.bos_token, eos_token=reference.eos_token)
            assert rendered == expected


def test_tools_template_matches_transformers(reference):
    template = ChatTemplate(TOOLS_TEMPLATE)
    calls = [{"role": "assistant", "content": "ok", "tool_calls": [{"name": "get_weather", "arguments": {"city": "Zürich"}}]}]
    for messages in CONVERSATIONS + [CONVERSATIONS[2] + calls]:
        for tools in (None, TOOLS):
            for extra in ({}, {"enable_thinking": False}):
                expected = reference.apply_chat_template(
                    messages, tools=tools, chat_template=TOOLS_TEMPLATE, tokenize=False,
                    add_generation_prompt=True, **extra)
                rendered = template.render(messages, tools=tools, bos_token=reference.bos_token,
                                           eos_token=reference.eos_token, **extra)
                assert rendered == expected


def test_none_fields_are_dropped():
    template = ChatTemplate("{% for m in messages %}{{ 'content' in m }}/{{ m.get('content') }};{% endfor %}")
    assert template.render([{"role": "assistant", "content": None}, {"role": "user", "content": "x"}]) == \
        "False/None;True/x;"


def test_missing_special_tokens_stay_undefined():
    assert ChatTemplate("[{{ bos_token }}]").render([], bos_token=None) == "[]"


def test_tojson_keeps_text_as_is():
    rendered = ChatTemplate("{{ x | tojson }}").render([], x={"a": "<é> & 'q'"})
    assert rendered == '{"a": "<é> & \'q\'"}'


def test_strftime_now_and_generation_block():
    rendered = ChatTemplate("{{ strftime_now('%Y') }}|{% generation %}gen{% endgeneration %}").render([])
    assert rendered == f"{datetime.now().year}|gen"


def test_trim_and_lstrip_blocks():
    assert ChatTemplate("  {% if true %}\nA\n  {% endif %}\nB").render([]) == "A\nB"


def test_raise_exception_is_a_chat_template_error():
    template = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok")
    assert template.render([{"role": "user", "content": ""}]) == "ok"
    with pytest.raises(ChatTemplateError, match="user first"):
        template.render([{"role": "system", "content": ""}])


def test_syntax_and_runtime_errors():
    with pytest.raises(ChatTemplateError, match="compile"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages[0]['content'] + 1 }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages[5]['content'] }}").render([])
    with pytest.raises(ChatTemplateError, match="object"):
        ChatTemplate("x").render(["not a message"])


def test_sandbox_blocks_escapes_and_mutation():
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}").render([])
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% set x = [] %}{{ x.append(1) }}").render([])
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages.pop() }}").render(messages)
    assert messages == [{"role": "user", "content": "x"}]


def test_compiled_once():
    source = "{{ messages | length }}"
    assert compile_chat_template(source) is compile_chat_template(source)
    assert compile_chat_template(source).render([{"role": "user", "content": "a"}]) == "1"


def test_tokenizer_passes_its_special_tokens():
    from dualserve.models.tokenizer import Tokenizer

    backend = Backend(models.BPE(vocab={"<s>": 0, "</s>": 1, "a": 2}, merges=[]))
    tok = Tokenizer(backend, bos_token_id=0, eos_token_id=1,
                    chat_template="{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}{{ extra }}")
    assert tok.apply_chat_template([{"role": "user", "content": "a"}], extra="!") == "<s>a</s>!"
    with pytest.raises(ChatTemplateError):
        Tokenizer(backend).apply_chat_template([])
