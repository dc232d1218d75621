"""A datastore of the model's own answers, for suffix drafts on text no request has shown yet.

Retrieval-based drafting (He et al., "REST: Retrieval-Based Speculative Decoding", 2023): keep a
large corpus of text like the model's output, find the longest suffix of the context in it, and
draft what followed there. A small model's answers reuse their own phrasing across prompts
("Here's a ...", the shape of a list, a code idiom), so its greedy answers to other prompts predict
its next tokens on a new chat where neither the prompt nor earlier requests hold the text.

The corpus is one token array, answers apart by a separator no context holds. For each key length
k in ``KEYS`` every window of k tokens with a token of its answer after it is hashed (a polynomial
over 64-bit integers), and the windows are sorted by hash, so the places that follow a k-gram are
one ``searchsorted`` range. A lookup tries the longest key first; it reads at most
``max_candidates`` of the range's places, spread evenly over it, extends each match backwards
(which also drops a hash collision), and keeps the places whose match is longest, as
``TokenIndex`` does for a request's own text. A lookup costs microseconds whatever the corpus
size; the index about 56 bytes a token (52 MB for the bundled 921k tokens).

``Datastore`` has ``TokenIndex``'s two reads (``match``, ``continuation``): both are a ``Corpus``
(``matching.py``). Suffix lookup (``suffix.py``) drafts from it where its match is
``DATASTORE_LEAD`` tokens longer than the request's text and the cache reach, and says so
(``Reach.lookup``), so the budget weighs those drafts by the datastore's own acceptance by match
length.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from dualserve.models.errors import InputError

from .matching import NO_MATCH, Match, SuffixConfig

KEYS = (8, 4, 2, 1)  # key lengths indexed, longest first; a match extends past its key backwards
SEPARATOR = -1       # between answers: no token id, so no context matches across it
PAD = 64             # separators before the corpus: a match extends at most this far back
# A key's sorted hashes are cut into 2**BUCKET_BITS buckets by their top bits, and where each bucket
# starts is kept: a lookup reads its bucket's bounds and searches only it. A binary search over the
# whole array touches about 20 cache lines, each a miss when the model's weights have just streamed
# through the cache (about 130 us a lookup against 31 us warm); a bucket, two or three.
BUCKET_BITS = 16
UNMATCHED = -2      # compared after a match's last possible token: no token and no separator equals it
_BACK = np.arange(PAD + 1)  # offsets back from a candidate, the one past a match's longest included
_B, _MASK = 0x9E3779B97F4A7C15, (1 << 64) - 1
_BASE = np.uint64(_B)


class Datastore:
    """Answers as one token array, indexed by the hashes of their short n-grams (module docstring)."""

    def __init__(self, tokens: np.ndarray):
        """``tokens``: the answers, each followed by ``SEPARATOR`` (``from_answers`` builds it)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        ids = tokens[tokens != SEPARATOR]
        if len(ids) and (ids.min() < 0 or ids.max() >= np.iinfo(np.int32).max):
            raise InputError(f"a datastore holds a token id outside 0 .. 2**31 - 2: {ids.min()} .. {ids.max()}")
        self.tokens = tokens.astype(np.int32)
        self.answers = int((self.tokens == SEPARATOR).sum())
        self._padded = np.concatenate([np.full(PAD, SEPARATOR, np.int32), self.tokens])
        self._keys: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        sep = np.concatenate([[0], np.cumsum(self.tokens == SEPARATOR)])
        for k in KEYS:
            # Windows of one answer with a token of it after them: where a continuation starts.
            start = np.arange(len(self.tokens) - k)
            start = start[sep[start + k + 1] == sep[start]]
            h = _hash_windows(self.tokens, k)[start]
            order = np.argsort(h, kind="stable")  # positions ascending within one hash
            h = h[order]
            bounds = np.arange(1 << BUCKET_BITS, dtype=np.uint64) << np.uint64(64 - BUCKET_BITS)
            buckets = np.append(np.searchsorted(h, bounds), len(h)).astype(np.int64)
            self._keys[k] = (h, (start[order] + k).astype(np.int32), buckets)  # where the token after goes

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_answers(cls, answers: Iterable[Sequence[int]]) -> "Datastore":
        """Answers of fewer than two tokens hold nothing to draft and are left out."""
        arrays = [np.asarray(a, dtype=np.int64) for a in answers if len(a) >= 2]
        if arrays and min(a.min() for a in arrays) < 0:  # the separator among them too
            raise InputError("a datastore answer holds a token id outside 0 .. 2**31 - 2 (a negative one)")
        parts = [np.append(a, SEPARATOR) for a in arrays]
        return cls(np.concatenate(parts) if parts else np.zeros(0, np.int64))

    @classmethod
    def load(cls, path: Path | str) -> "Datastore":
        """A datastore from a file ``save`` wrote, or a directory of distilled shards (``*.jsonl``
        records with ``answer_ids``, as ``decoders.training.distil`` writes them)."""
        path = Path(path)
        if path.is_dir():
            answers = []
            for f in sorted(path.glob("*.jsonl")):
                try:
                    lines = f.read_text().splitlines()
                except (OSError, UnicodeDecodeError) as e:
                    raise InputError(f"{f}: cannot be read as text ({e})") from None
                for i, line in enumerate(lines, 1):
                    try:
                        answers += [[int(t) for t in json.loads(line)["answer_ids"]]] if line.strip() else []
                    except (ValueError, KeyError, TypeError) as e:
                        raise InputError(f"{f}:{i}: not a distilled record with answer_ids ({e})") from None
            if not answers:
                raise InputError(f"{path}: no answers (no *.jsonl records with answer_ids)")
            return cls.from_answers(answers)
        try:
            with np.load(path) as f:
                stored = f["tokens"]
        except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as e:
            raise InputError(f"{path}: not a datastore (an .npz of tokens, as Datastore.save writes): {e}") from None
        if stored.dtype.kind != "u":
            raise InputError(f"{path}: not a datastore (its tokens are {stored.dtype}, not unsigned integers)")
        tokens = stored.astype(np.int64)
        tokens[stored == np.iinfo(stored.dtype).max] = SEPARATOR
        return cls(tokens)

    def save(self, path: Path | str) -> None:
        """The answers, compressed, in the narrowest unsigned type that holds them and the separator
        (its largest value)."""
        dtype = np.uint16 if self.tokens.max(initial=0) < np.iinfo(np.uint16).max else np.uint32
        stored = self.tokens.astype(dtype)
        stored[self.tokens == SEPARATOR] = np.iinfo(dtype).max
        with open(path, "wb") as f:
            np.savez_compressed(f, tokens=stored)

    def match(self, context: Sequence[int], config: SuffixConfig) -> Match:
        """The positions following the longest suffix of ``context`` found here (at most
        ``config.max_match`` tokens long), as ``TokenIndex.match``."""
        for k in KEYS:
            if len(context) < k:
                continue
            hashes, follows, buckets = self._keys[k]
            key = _hash(context[-k:])
            b = key >> (64 - BUCKET_BITS)
            first, last = buckets[b], buckets[b + 1]
            if first == last:
                continue
            bucket, key = hashes[first:last], np.uint64(key)
            lo, hi = first + bucket.searchsorted(key, "left"), first + bucket.searchsorted(key, "right")
            if lo == hi:
                continue
            cand = follows[lo:hi]
            if len(cand) > config.max_candidates:  # spread over the range: the whole corpus, not one part
                cand = cand[np.arange(config.max_candidates) * (len(cand) - 1) // max(config.max_candidates - 1, 1)]
            # Extend backwards: the tokens before each candidate against the context's, newest first,
            # and one more that differs from every token (the padding and the separators end a run;
            # so does a hash collision, at once): the first difference is the match's length.
            n = min(len(context), config.max_match, PAD)
            tail = np.asarray([*context[-1: -n - 1: -1], UNMATCHED], dtype=np.int32)
            before = self._padded[(cand + (PAD - 1))[:, None] - _BACK[: n + 1]]  # cand >= 1: in range
            length = (before != tail).argmax(1)
            best = int(length.max())
            if best >= k:  # below k: a hash collision
                return Match(best, tuple(cand[length == best].tolist()))
        return NO_MATCH

    def continuation(self, start: int, depth: int) -> list[int]:
        out = self.tokens[start: start + depth].tolist()
        return out[: out.index(SEPARATOR)] if SEPARATOR in out else out


def _hash_windows(tokens: np.ndarray, k: int) -> np.ndarray:
    """The hash of every window of ``k`` tokens, directly (k small)."""
    n = max(len(tokens) - k + 1, 0)
    t = tokens.astype(np.uint64) + np.uint64(1)
    h = np.zeros(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i in range(k):
            h = h * _BASE + t[i: i + n]
    return h


def _hash(window: Sequence[int]) -> int:
    """``_hash_windows``'s hash of one window."""
    h = 0
    for t in window:
        h = (h * _B + int(t) + 1) & _MASK
    return h
