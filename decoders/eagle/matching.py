"""What a suffix lookup asks of each text it searches, and what it gets back.

A suffix draft (``suffix.py``) looks for the longest suffix of the context in several texts: the
request's own tokens and the outputs of earlier requests (``suffix.TokenIndex``), and a datastore
of answers to other prompts (``datastore.Datastore``). Each is a ``Corpus``: ``match`` gives the
places that follow the longest suffix of the context it holds, within ``SuffixConfig``'s limits,
and ``continuation`` the tokens from one such place on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence


@dataclass(frozen=True)
class SuffixConfig:
    """A suffix lookup's limits: how far a match is compared and how many places are scanned, how
    deep and how wide a draft grows, and what the cache of earlier outputs keeps."""

    max_match: int = 24          # longest suffix compared
    max_candidates: int = 32     # newest matching positions scanned per source and key
    max_depth: int = 16          # longest continuation drafted
    spec_factor: float = 2.0     # draft depth <= spec_factor * match length
    min_prob: float = 0.1        # smallest share of matches a drafted node must carry
    cache_entries: int = 256     # outputs kept from earlier requests
    cache_tokens: int = 1 << 16  # and their tokens in all

    def __post_init__(self) -> None:
        if min(self.max_match, self.max_candidates, self.max_depth, self.cache_entries, self.cache_tokens) < 1:
            raise ValueError("suffix limits must be positive")


@dataclass(frozen=True)
class Match:
    """The longest match of a context in one source: its length and where continuations start."""

    length: int
    starts: tuple[int, ...]


NO_MATCH = Match(0, ())


class Corpus(Protocol):
    """A text a suffix lookup searches (the module docstring)."""

    def match(self, context: Sequence[int], config: SuffixConfig) -> Match:
        """The places following the longest suffix of ``context`` found here (``NO_MATCH``: none)."""

    def continuation(self, start: int, depth: int) -> list[int]:
        """Up to ``depth`` tokens from place ``start`` on."""
