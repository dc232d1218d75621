"""A model as the server serves it (``ServedModel``): its name, tokenizer, context length and
decoders with their traits. The service reads one for every request; the model manager
(``model_manager.py``) hands one out under a lease, loading the model first where it must."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from .router import DecoderTraits


@dataclass
class ServedModel:
    name: str
    tokenizer: Any
    max_model_len: int
    decoders: list[str]
    traits: dict[str, DecoderTraits] = field(default_factory=dict)  # by decoder; absent: the defaults
    created: int = field(default_factory=lambda: int(time.time()))

    @cached_property
    def max_prompt_chars(self) -> int:
        """Characters beyond which a text cannot fit the context, whatever it says: no token spells more
        than the longest vocabulary entry (doubled for normalizers that fold several characters into
        one). Checked before tokenizing, so an 8 MB prompt is refused at once."""
        longest = max((len(t) for t in self.tokenizer.backend.get_vocab()), default=1)
        return self.max_model_len * (2 * longest + 1)
