"""Grammar bounds: free JSON numbers and strings end, and ``strict`` schemas refuse extra keys.

``bounded_schema`` is checked as a pure function on schemas; what the bounded grammar accepts
is checked by feeding text through llguidance with the default model's tokenizer.
"""

from __future__ import annotations

import json

import pytest

from dualserve.decoders.engine.grammar import (ANY_REF, MAX_NUMBER, MAX_STRING_LENGTH, GrammarCompiler, GrammarSpec,
                                               bounded_schema)
from dualserve.models.loader import converted_dir, load_model
from dualserve.models.tokenizer import Tokenizer

PARIS = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                                          "population_millions": {"type": "number"}},
         "required": ["city", "country", "population_millions"]}


@pytest.fixture(scope="module")
def compiler(default_gguf, cache_dir) -> tuple[GrammarCompiler, Tokenizer]:
    target = converted_dir(default_gguf, cache_dir)
    if not target.exists():
        load_model(default_gguf, cache_dir=cache_dir)
    tok = Tokenizer.from_hf_dir(target)
    return GrammarCompiler(tok, tok.vocab_size), tok


def accepted(compiler: tuple[GrammarCompiler, Tokenizer], spec: GrammarSpec, text: str) -> str:
    """The longest prefix of ``text`` (in whole tokens) the grammar accepts."""
    grammars, tok = compiler
    ids = tok.encode(text, add_special_tokens=False)
    n = grammars.constraint(spec).consume_prefix(ids)
    return tok.decode(ids[:n])


def test_free_numbers_and_strings_get_bounds_and_set_bounds_are_kept():
    out = bounded_schema(PARIS)
    props = out["properties"]
    assert props["city"]["maxLength"] == MAX_STRING_LENGTH
    assert props["population_millions"] == {"type": "number", "minimum": -MAX_NUMBER, "maximum": MAX_NUMBER,
                                            "multipleOf": 1e-6}
    assert out["additionalProperties"] is False  # listed properties: no others unless the schema says so
    assert bounded_schema({"type": "object"})["additionalProperties"] == ANY_REF  # free keys, bounded values
    own = bounded_schema({"type": "integer", "minimum": 0, "maximum": 9})
    assert (own["minimum"], own["maximum"], "multipleOf" in own) == (0, 9, False)
    assert bounded_schema({"enum": ["a", "b"]}) == {"enum": ["a", "b"], "$defs": {"__dualserve_value": out["$defs"][
        "__dualserve_value"]}}
    assert bounded_schema({**PARIS, "additionalProperties": True})["additionalProperties"] == ANY_REF
    assert bounded_schema({**PARIS, "additionalProperties": True}, strict=True)["additionalProperties"] is False
    assert PARIS["properties"]["city"] == {"type": "string"}  # the caller's schema is not changed


def test_nested_and_untyped_values_are_bounded():
    schema = {"type": "object", "properties": {"list": {"type": "array", "items": {"type": "number"}},
                                               "any": {}, "described": {"description": "anything"},
                                               "either": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
              "$defs": {"n": {"type": ["number", "null"]}}}
    out = bounded_schema(schema)
    props = out["properties"]
    assert props["list"]["items"]["multipleOf"] == 1e-6
    assert props["any"] == ANY_REF and props["described"]["$ref"] == ANY_REF["$ref"]
    assert props["either"]["anyOf"][0]["maxLength"] == MAX_STRING_LENGTH
    assert out["$defs"]["n"]["maximum"] == MAX_NUMBER


def test_the_bounded_grammar_ends_numbers_and_strings(compiler):
    spec = GrammarSpec("json_schema", json.dumps(PARIS))
    head = '{"city": "Paris", "country": "France", "population_millions": '
    assert accepted(compiler, spec, head + "2.1}") == head + "2.1}"
    # The digits the issue saw at temperature 0 stop after 15; decimals after 6; no exponent.
    assert accepted(compiler, spec, head + "31212222312344444") == head + "312122223123444"
    assert accepted(compiler, spec, head + "2.12345678") == head + "2.123456"
    assert accepted(compiler, spec, head + "2e99999") == head + "2"
    long = '{"city": "' + "ab" * MAX_STRING_LENGTH
    assert len(accepted(compiler, spec, long)) == len('{"city": "') + MAX_STRING_LENGTH
    free = accepted(compiler, GrammarSpec("json_object"), '{"a": [1, 0.12345678]}')
    assert free == '{"a": [1, 0.123456'


def test_extra_keys_only_where_the_schema_allows_them_and_never_when_strict(compiler):
    doc = '{"city": "Paris", "country": "France", "population_millions": 2.1, "mayor": "Hidalgo"}'
    listed = '{"city": "Paris", "country": "France", "population_millions": 2.1'
    open_schema = json.dumps({**PARIS, "additionalProperties": True})
    assert accepted(compiler, GrammarSpec("json_schema", json.dumps(PARIS)), doc) == listed
    assert accepted(compiler, GrammarSpec("json_schema", open_schema), doc) == doc
    assert accepted(compiler, GrammarSpec("json_schema", open_schema, strict=True), doc) == listed
