"""Suffix drafts: continuations of text the request, or an earlier request, already holds.

Agents, code edits and extraction tasks repeat long spans of their prompt, of their own
output, and of answers given before. Suffix decoding (Oliaro et al., "SuffixDecoding", 2024;
Arctic Inference's ``suffix_decoding``, which vLLM uses) drafts those spans at no model cost:
match the longest suffix of the current context against the sources, and propose what
followed the matches, as a tree weighted by how often each continuation followed.

Arctic keeps suffix trees in C++ and ships no CPU wheel for this Python/torch, so this is a
small equivalent in plain Python:

* a ``TokenIndex`` is a token sequence plus, for each key length in ``KEY_LENGTHS``, a map
  from the k tokens ending at a position to the positions that follow them. A lookup tries
  the longest key first, scans the newest ``max_candidates`` positions holding it, extends
  each match backwards (up to ``max_match`` tokens), and keeps the positions whose match is
  longest;
* the draft is the trie of the continuations after those positions. A node's score is the
  share of matches that pass through it (the product of its path's child frequencies), so a
  child never scores above its parent; the best ``max_nodes`` nodes with score at least
  ``min_prob`` are kept, in trie order, which keeps parents before children. Its depth is at
  most ``spec_factor`` times the match length (Arctic's ``max_spec_factor``): a one-token
  match earns a short draft, a long one a long draft;
* the sources are the request's own prompt and output (one index, extended as tokens are
  committed) and a ``SuffixCache`` of the outputs of recent requests, bounded in entries and
  tokens, evicted least recently used (a lookup that drafts from an entry refreshes it); and,
  where one is loaded, a datastore of answers to other prompts (``datastore.py``), drafted from
  only where it matches longer than the others and weighed by its own acceptance.

``SuffixSource`` is the ``DraftSource`` (``source.py``) the decoder drives: it looks the
context up when the budget asks what it can draft, and cuts that draft to the budget.

Every source is deterministic given the tokens so far, so a draft is a point mass and the
acceptance rules in ``tree.py`` stay exact for it.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

from ..engine.request import Request
from .budget import NO_REACH, Reach, Source
from .matching import NO_MATCH, Corpus, Match, SuffixConfig
from .tree import DraftTree

# Key lengths indexed, longest first: a hit on a long key starts a long match without a scan
# over every position of a frequent token.
KEY_LENGTHS = (4, 2, 1)
# Key lengths the cache indexes across its entries (``SuffixCache.holding``): an entry whose match
# of a context reaches k tokens holds the context's last k tokens.
CACHE_KEYS = (2, 1)
# The most nodes, and the deepest path, offered per step (the budget picks less).
MAX_NODES = 16
# A datastore's match drafts only where it is longer than the longest in the request's text and
# the cache: a shared phrase is accepted less often than a copy of the same length (first drafted
# token, held-out chat: 0.31 / 0.47 after datastore matches of 2 / 4 tokens, 0.42 / 0.69 after the
# request's own). Measured in one process, alternating per prompt against no datastore, a lead of
# 1 token gained most (chat 2.3-4.6%, agentic 3.9-4.8%; 2: 2.9% / 1.5%; 0 or 3 lost on agentic).
DATASTORE_LEAD = 1


class TokenIndex:
    """A growing token sequence indexed by its short n-grams (see the module docstring); a
    ``Corpus``."""

    def __init__(self, ids: Sequence[int] = ()):
        self.tokens: list[int] = []
        self.follows: dict[int, dict[tuple[int, ...], list[int]]] = {k: {} for k in KEY_LENGTHS}
        self.extend(ids)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, ids: Sequence[int]) -> None:
        toks = self.tokens
        for t in ids:
            toks.append(t)
            n = len(toks)
            for k, table in self.follows.items():
                if n >= k:
                    table.setdefault(tuple(toks[n - k:]), []).append(n)  # n: where the next token goes

    def sync(self, ids: Sequence[int]) -> None:
        """Index the tail of ``ids`` this index has not seen (``ids`` extends ``tokens``)."""
        if len(ids) > len(self.tokens):
            self.extend(ids[len(self.tokens):])

    def match(self, context: Sequence[int], config: SuffixConfig) -> Match:
        """The positions following the longest suffix of ``context`` found here.

        A position with nothing after it yet (the context's own end, when this index is the
        request's own sequence) is never a match.
        """
        toks, end = self.tokens, len(self.tokens)
        for k, table in self.follows.items():
            if len(context) < k:
                continue
            positions = table.get(tuple(context[-k:]))
            if not positions:
                continue
            best, starts = 0, []
            for p in reversed(positions[-config.max_candidates - 1:]):
                if p >= end:
                    continue
                length = k
                limit = min(config.max_match, p, len(context))
                while length < limit and toks[p - length - 1] == context[-length - 1]:
                    length += 1
                if length > best:
                    best, starts = length, [p]
                elif length == best:
                    starts.append(p)
            if starts:
                return Match(best, tuple(starts))
        return NO_MATCH

    def continuation(self, start: int, depth: int) -> list[int]:
        return self.tokens[start: start + depth]


class SuffixCache:
    """Outputs of recent requests, each its own ``TokenIndex``; LRU within entry and token bounds.

    Which entries hold each token and each pair of tokens is indexed across the cache, so a lookup
    matches only the entries that can reach the longest match (``holding``), not every entry:
    with 256 entries, every entry's own lookup cost about 0.2 ms a step, per request."""

    def __init__(self, config: SuffixConfig):
        self.config = config
        self.entries: OrderedDict[int, TokenIndex] = OrderedDict()
        self.num_tokens = 0
        self._next = 0
        self._holders: dict[tuple[int, ...], set[int]] = {}  # a token or pair -> the entries holding it

    def add(self, ids: Sequence[int]) -> None:
        ids = list(ids)[-self.config.cache_tokens:]
        if len(ids) < 2:
            return
        key, entry = self._next, TokenIndex(ids)
        self.entries[key] = entry
        self._next += 1
        self.num_tokens += len(ids)
        for k in CACHE_KEYS:
            for gram in entry.follows[k]:
                self._holders.setdefault(gram, set()).add(key)
        while len(self.entries) > self.config.cache_entries or self.num_tokens > self.config.cache_tokens:
            self.remove(next(iter(self.entries)))

    def touch(self, key: int) -> None:
        if key in self.entries:
            self.entries.move_to_end(key)

    def remove(self, key: int) -> None:
        entry = self.entries.pop(key, None)
        if entry is None:
            return
        self.num_tokens -= len(entry)
        for k in CACHE_KEYS:
            for gram in entry.follows[k]:
                holders = self._holders.get(gram)
                if holders is not None:
                    holders.discard(key)
                    if not holders:
                        del self._holders[gram]

    def holding(self, gram: tuple[int, ...]) -> set[int]:
        """The entries that hold ``gram`` (a token or a pair of tokens, ``CACHE_KEYS``)."""
        return self._holders.get(gram, set())


@dataclass
class SuffixDraft:
    """A suffix draft: the tree (root first) and the cache entries it drew from."""

    tree: DraftTree
    match_length: int
    cache_keys: tuple[int, ...] = ()
    lookup: Source | None = None  # "datastore" where the datastore's match drafted it

    @property
    def num_nodes(self) -> int:
        return len(self.tree) - 1


def continuation_tree(root: int, continuations: list[list[int]], max_nodes: int, min_prob: float) -> DraftTree:
    """The trie of ``continuations`` cut to its ``max_nodes`` most travelled nodes (share >= min_prob).

    Trie nodes are numbered in insertion order, so a parent's number is below its children's,
    and a child's count never exceeds its parent's: a stable sort by count keeps a tree.
    """
    tokens, parents, counts = [root], [-1], [len(continuations)]
    children: dict[tuple[int, int], int] = {}
    # Equal continuations (common where many places follow one phrase) go in once, with their count;
    # in order of first appearance, so the nodes are numbered as one by one.
    for seq, weight in Counter(map(tuple, continuations)).items():
        node = 0
        for t in seq:
            child = children.get((node, t))
            if child is None:
                child = children[(node, t)] = len(tokens)
                tokens.append(t)
                parents.append(node)
                counts.append(0)
            counts[child] += weight
            node = child
    total = max(len(continuations), 1)
    ranked = sorted(range(1, len(tokens)), key=lambda i: -counts[i])  # stable: ties keep trie order
    kept = sorted(i for i in ranked[:max_nodes] if counts[i] / total >= min_prob)
    index = {old: new for new, old in enumerate([0] + kept)}
    return DraftTree([root] + [tokens[i] for i in kept], [-1] + [index[parents[i]] for i in kept])


@dataclass
class SuffixState:
    """A request's suffix lookup state (``EagleState.drafts``)."""

    index: TokenIndex = field(default_factory=TokenIndex)  # prompt + output, extended as it grows
    draft: SuffixDraft | None = None  # this step's lookup, made by ``offer``, cut by ``propose``


class SuffixSource:
    """Suffix lookup as a ``DraftSource``: the request's own tokens and the cache of earlier outputs
    (one cache per decoder). It reads no target features and costs no forward to draft."""

    name: Source = "suffix"

    def __init__(self, config: SuffixConfig | None = None, datastore: Corpus | None = None):
        """``datastore``: answers to other prompts (``datastore.py``), drafted from where they match the
        context ``DATASTORE_LEAD`` tokens longer than the request's text and the cache do."""
        self.config = config or SuffixConfig()
        self.cache = SuffixCache(self.config)
        self.datastore = datastore

    # ---- the DraftSource contract ------------------------------------------------------

    def start(self, req: Request) -> SuffixState:
        return SuffixState()

    def offer(self, req: Request, st: SuffixState, cap: int) -> Reach:
        """Look the context up now (the draft is kept for ``propose``); node counts by depth."""
        st.index.sync(req.all_ids)
        limit = min(MAX_NODES, cap)
        draft = self.lookup(st.index, req.all_ids, limit, limit)
        st.draft = draft if draft.num_nodes else None
        if st.draft is None:
            return NO_REACH
        depths = draft.tree.depths[1:]
        return Reach(tuple(sum(1 for x in depths if x <= d) for d in range(1, max(depths) + 1)), match=draft.match_length,
                     lookup=draft.lookup)

    def due(self, st: SuffixState, drafting: bool, stale: bool) -> bool:
        return False  # nothing to catch up: it reads tokens, which are committed already

    def catch_up(self, reqs: list[Request], states: list[SuffixState]) -> int:
        return 0

    def propose(self, req: Request, st: SuffixState, depth: int, nodes: int) -> DraftTree:
        """This step's lookup cut to the budget; the cache entries it drew from are refreshed."""
        if st.draft is None:
            return DraftTree([req.all_ids[-1]], [-1])
        for key in st.draft.cache_keys:
            self.cache.touch(key)
        return st.draft.tree.cut(nodes, depth)

    def observe(self, st: SuffixState, final, aux) -> None:
        """Nothing: the index catches up with the request's tokens when it next drafts."""

    def release(self, req: Request, st: SuffixState | None) -> None:
        """A request finished (whether or not it drafted from here): its output joins the cache."""
        self.cache.add(req.output_ids)

    # ---- the lookup ----------------------------------------------------------------------

    def lookup(self, own: TokenIndex, context: Sequence[int], max_nodes: int, max_depth: int) -> SuffixDraft:
        """The draft after ``context`` (whose last token is the root) from ``own`` and the cache, or
        from the datastore where it matches ``DATASTORE_LEAD`` tokens longer than both.

        The longest match wins; sources that tie on it pool their continuations.
        """
        cfg = self.config
        root = context[-1]
        if max_nodes < 1 or max_depth < 1:
            return SuffixDraft(DraftTree([root], [-1]), 0)
        found = self._found(own, context)
        best = max(m.length for _, m, _ in found)
        lookup: Source | None = None
        if self.datastore is not None and best + DATASTORE_LEAD <= min(len(context), cfg.max_match):
            # A phrase of other answers must match longer than a copy (here it still can).
            m = self.datastore.match(context, cfg)
            if m.length >= best + DATASTORE_LEAD:
                found, best, lookup = [(self.datastore, m, None)], m.length, "datastore"
        if best == 0:
            return SuffixDraft(DraftTree([root], [-1]), 0)
        depth = min(max_depth, cfg.max_depth, math.ceil(cfg.spec_factor * best))
        continuations, keys = [], []
        for index, m, key in found:
            if m.length == best:
                continuations += [index.continuation(p, depth) for p in m.starts]
                if key is not None:
                    keys.append(key)
        tree = continuation_tree(root, continuations, max_nodes, cfg.min_prob)
        return SuffixDraft(tree, best, tuple(keys), lookup)

    def _found(self, own: TokenIndex, context: Sequence[int]) -> list[tuple[TokenIndex, Match, int | None]]:
        """Each index's match of ``context``, with its cache key (None: not a cache entry)."""
        found: list[tuple[TokenIndex, Match, int | None]] = [(own, own.match(context, self.config), None)]
        return found + self._cache_matches(context, found[0][1].length)

    def _cache_matches(self, context: Sequence[int], best: int) -> list[tuple[TokenIndex, Match, int]]:
        """The cache entries' matches of ``context`` that can tie or beat ``best`` (the request's
        own), in LRU order: the same as matching every entry, where an entry that does not hold the
        context's last k tokens matches fewer than k. The entries holding its last pair are matched
        first; those holding only its last token, only when no match reached two tokens."""
        cfg, matched = self.config, {}
        for k in CACHE_KEYS:
            if len(context) < k:
                continue
            for key in self.cache.holding(tuple(context[-k:])) - matched.keys():
                matched[key] = m = self.cache.entries[key].match(context, cfg)
                best = max(best, m.length)
            if best >= k:
                break
        if not matched:
            return []
        return [(entry, matched[key], key) for key, entry in self.cache.entries.items()
                if key in matched and matched[key].length]
