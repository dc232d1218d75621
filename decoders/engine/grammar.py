"""Constrained decoding through llguidance: JSON schemas, JSON objects, regexes and Lark grammars.

llguidance (the Low-level Guidance library) compiles a grammar against the
model's vocabulary and answers, at each step, which tokens may come next as a
bitmask; we turn that into -inf logits before sampling. A ``Constraint`` is
owned by one request; the compiled ``GrammarCompiler`` (the tokenizer index,
about a second to build) is owned by the deployment, one per model.

Greedy acceptance under a constraint stays exact: a decoder masks the target
logits at each position, so the chosen token is the best *allowed* token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

GrammarKind = Literal["json_schema", "json_object", "regex", "lark"]

# One fixed JSON layout (``{"a": 1, "b": [2, 3]}``, as ``json.dumps`` writes it): with no free
# whitespace between tokens, keys and punctuation become forced tokens (``Constraint.forced``).
JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


class GrammarError(ValueError):
    """The grammar or schema is invalid; the server answers 400."""


@dataclass(frozen=True)
class GrammarSpec:
    kind: GrammarKind
    source: str = ""   # the schema (JSON text), regex or Lark text; empty for json_object


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
            return ll.grammar_from("json_schema", json.dumps({"type": "object", "x-guidance": JSON_LAYOUT}))
        if spec.kind == "json_schema":
            schema = json.loads(spec.source)
            if isinstance(schema, dict) and "x-guidance" not in schema:
                schema = {**schema, "x-guidance": JSON_LAYOUT}
            return ll.grammar_from("json_schema", json.dumps(schema))
        if spec.kind == "regex":
            return ll.grammar_from("regex", spec.source)
        return ll.grammar_from("lark", spec.source)

    def constraint(self, spec: GrammarSpec) -> Constraint:
        matcher = self._ll.LLMatcher(self.tokenizer, self.grammar(spec), log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return Constraint(matcher, self.vocab_size)
