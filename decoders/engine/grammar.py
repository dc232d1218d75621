"""Constrained decoding through llguidance: JSON schemas, JSON objects, regexes and Lark grammars.

llguidance (the Low-level Guidance library) compiles a grammar against the
model's vocabulary and answers, at each step, which tokens may come next as a
bitmask; we turn that into -inf logits before sampling. A ``Constraint`` is
owned by one request; the compiled ``GrammarCompiler`` (the tokenizer index,
about a second to build) is kept by the engine, one per model (``GrammarCompilers``).

Greedy acceptance under a constraint stays exact: a decoder masks the target
logits at each position, so the chosen token is the best *allowed* token.

Free values are bounded (``bounded_schema``) so that constrained decoding always ends: JSON
allows numbers and strings of any length, and a small model at temperature 0 writes digits
forever ("31212222312344444..."). As other engines bound digit counts, numbers get at most
15 integer digits and 6 decimals (and no exponent), strings at most ``MAX_STRING_LENGTH``
characters, unless the schema sets its own bounds; values with no schema (extra keys,
``{}``) get the same bounds. An object that lists its properties takes no other keys unless
it says so (``additionalProperties``); a ``strict`` schema (OpenAI's structured outputs)
takes no other keys even then.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

GrammarKind = Literal["json_schema", "json_object", "regex", "lark"]

# One fixed JSON layout (``{"a": 1, "b": [2, 3]}``, as ``json.dumps`` writes it): with no free
# whitespace between tokens, keys and punctuation become forced tokens (``Constraint.forced``).
JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


# Bounds on free JSON values (see the module docstring). 10^15 keeps integers exact in a double.
MAX_NUMBER = 10 ** 15
NUMBER_STEP = 1e-6           # multipleOf: at most 6 decimals
MAX_STRING_LENGTH = 1024
ANY_VALUE = "__dualserve_value"  # the $defs entry for a value with no schema of its own
ANY_REF = {"$ref": f"#/$defs/{ANY_VALUE}"}

_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("items", "additionalItems", "additionalProperties", "contains", "propertyNames", "not", "if",
               "then", "else", "unevaluatedItems", "unevaluatedProperties")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf", "items")
_DEFINES_VALUE = ("type", "enum", "const", "$ref", "anyOf", "oneOf", "allOf", "not", "properties", "items",
                  "prefixItems")


def _any_value() -> dict:
    """A JSON value of any type, with bounded numbers and strings (extra keys, ``{}`` schemas)."""
    number = {"type": "number", "minimum": -MAX_NUMBER, "maximum": MAX_NUMBER, "multipleOf": NUMBER_STEP}
    return {"anyOf": [{"type": "string", "maxLength": MAX_STRING_LENGTH}, number, {"type": "boolean"},
                      {"type": "null"}, {"type": "array", "items": ANY_REF},
                      {"type": "object", "additionalProperties": ANY_REF}]}


def _bound(node, strict: bool):
    if node is True or node == {}:
        return dict(ANY_REF)
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _bound(v, strict) for k, v in out[key].items()}
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), (dict, bool)):
            out[key] = _bound(out[key], strict)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_bound(v, strict) for v in out[key]]
    if not any(k in out for k in _DEFINES_VALUE):  # a description only: any value
        return {**out, **ANY_REF}
    types = out.get("type")
    types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
    free = "enum" not in out and "const" not in out
    if free and types & {"number", "integer"}:
        lo, hi = _limit(out, "minimum", "exclusiveMinimum"), _limit(out, "maximum", "exclusiveMaximum")
        if lo is None:
            out["minimum"] = -MAX_NUMBER if hi is None else min(-MAX_NUMBER, hi - MAX_NUMBER)
        if hi is None:
            out["maximum"] = MAX_NUMBER if lo is None else max(MAX_NUMBER, lo + MAX_NUMBER)
        if "integer" not in types and "multipleOf" not in out:
            out["multipleOf"] = NUMBER_STEP
    if free and "string" in types and "maxLength" not in out and "format" not in out:
        least = out.get("minLength")
        out["maxLength"] = least if isinstance(least, int) and least > MAX_STRING_LENGTH else MAX_STRING_LENGTH
    if types & {"object"} or "properties" in out:
        extra = out.get("additionalProperties")
        if strict or (extra is None and "properties" in out):
            # Only the listed keys: xgrammar's and outlines' default too, since a small model at
            # temperature 0 otherwise invents keys until max_tokens.
            out["additionalProperties"] = False
        elif extra is None or extra is True or extra == ANY_REF:
            out["additionalProperties"] = dict(ANY_REF)
    return out


def _limit(schema: dict, inclusive: str, exclusive: str) -> float | None:
    """A numeric bound the schema sets (draft 4's boolean exclusiveMinimum/Maximum sets none)."""
    for key in (inclusive, exclusive):
        value = schema.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
    return None


def bounded_schema(schema: dict, strict: bool = False) -> dict:
    """``schema`` with every free number and string bounded, extra keys' values too, and (``strict``)
    no keys beyond those listed; see the module docstring."""
    try:
        out = _bound(schema, strict)
    except RecursionError:
        raise GrammarError("the schema is nested too deeply") from None
    if not isinstance(out, dict):
        return out
    return {**out, "$defs": {**out.get("$defs", {}), ANY_VALUE: _any_value()}}


class GrammarError(ValueError):
    """The grammar or schema is invalid; the server answers 400."""


@dataclass(frozen=True)
class GrammarSpec:
    kind: GrammarKind
    source: str = ""   # the schema (JSON text), regex or Lark text; empty for json_object
    strict: bool = False  # json_schema: refuse keys the schema does not list (OpenAI's ``strict``)


class Constraint:
    """One request's grammar state: the allowed-token mask and the tokens consumed so far."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.consumed = 0  # tokens accepted so far
        self._bits = np.full(((vocab_size + 31) // 32,), -1, dtype=np.int32)

    def allowed(self) -> torch.Tensor:
        """(vocab,) bool: tokens the grammar allows next."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.size * 4)
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.vocab_size]
        return torch.from_numpy(bits.astype(bool))

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Return a copy of (vocab,) logits with disallowed tokens at -inf."""
        allowed = self.allowed().to(logits.device)
        n = min(logits.shape[-1], allowed.shape[-1])
        out = torch.full_like(logits, float("-inf"))
        out[..., :n] = torch.where(allowed[:n], logits[..., :n], out[..., :n])
        return out

    def consume(self, token_id: int) -> bool:
        ok = bool(self.matcher.consume_token(token_id))
        self.consumed += ok
        return ok

    def consume_prefix(self, token_ids: list[int]) -> int:
        """Consume the longest allowed prefix of ``token_ids``; returns its length."""
        n = int(self.matcher.try_consume_tokens(token_ids))
        self.consumed += n
        return n

    def forced(self) -> list[int]:
        """Tokens the grammar forces next, whatever the model says (not consumed).

        A JSON schema's keys and punctuation between values are forced: the skeleton
        a diffusion decoder places without denoising. A lone allowed token (the EOS
        after a finished document) counts as forced too."""
        if self.done:
            return []
        tokens = list(self.matcher.compute_ff_tokens())
        if tokens:
            return tokens
        allowed = torch.nonzero(self.allowed())[:, 0]
        return [int(allowed[0])] if allowed.numel() == 1 else []

    def copy(self) -> "Constraint":
        """An independent copy of this state (to look ahead without consuming)."""
        twin = Constraint(self.matcher.deep_copy(), self.vocab_size)
        twin.consumed = self.consumed
        return twin

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)
        self.consumed -= num_tokens

    @property
    def done(self) -> bool:
        return bool(self.matcher.is_stopped())


class GrammarCompiler:
    """Per-model index of the vocabulary for llguidance (built once, shared by all requests)."""

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance

        self._ll = llguidance
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                                eos_token=list(tokenizer.eos_token_ids) or None)

    def grammar(self, spec: GrammarSpec) -> str:
        ll = self._ll
        if spec.kind == "json_object":
            schema = {**bounded_schema({"type": "object"}), "x-guidance": JSON_LAYOUT}
            return ll.grammar_from("json_schema", json.dumps(schema))
        if spec.kind == "json_schema":
            schema = json.loads(spec.source)
            if isinstance(schema, dict):
                schema = bounded_schema(schema, spec.strict)
                schema.setdefault("x-guidance", JSON_LAYOUT)
            return ll.grammar_from("json_schema", json.dumps(schema))
        if spec.kind == "regex":
            return ll.grammar_from("regex", spec.source)
        return ll.grammar_from("lark", spec.source)

    def constraint(self, spec: GrammarSpec) -> Constraint:
        matcher = self._ll.LLMatcher(self.tokenizer, self.grammar(spec), log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return Constraint(matcher, self.vocab_size)


class GrammarCompilers:
    """Each model's ``GrammarCompiler``, built on first use and kept until its model is removed;
    safe from any thread (the engine warms them off the server's event loop)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_model: dict[str, GrammarCompiler] = {}

    def get(self, model: str, tokenizer, vocab_size: int) -> GrammarCompiler:
        with self._lock:
            if model not in self._by_model:
                self._by_model[model] = GrammarCompiler(tokenizer, vocab_size)
            return self._by_model[model]

    def drop(self, model: str) -> None:
        with self._lock:
            self._by_model.pop(model, None)
