"""Incremental detokenization and stop strings, shared by every decoder.

A decoder produces token ids one (or, for speculative and diffusion decoders, a few) at a time;
`TextStream` turns them into the text that is final so far. Two things make that harder than
decoding each token alone:

1. A token need not decode to whole characters (byte-level BPE splits an emoji over several
   tokens) and some decoders look at neighbours (sentencepiece drops the space of the first
   token only). We use the prefix/read offset technique of TGI and vLLM (vLLM
   `detokenize_incrementally`, TGI `decode_token`): decode a short window that begins a few
   tokens back, and emit what it has beyond the text of its first part, unless that ends in
   U+FFFD, an incomplete UTF-8 sequence. Each push costs a decode of a window, not of the
   whole sequence, and the concatenated output equals `tokenizer.decode(all_ids)` whenever the
   ids spell valid UTF-8. (Sentencepiece byte fallback turns a whole run of byte tokens into
   U+FFFD once any of it is invalid, which no stream can know in advance.)
2. A stop string may span tokens or begin inside one. Text is held back while its end could
   still be the start of a stop string; once one is complete (the one that ends first, as
   token-by-token generation would have met it), the text before it is emitted, the stream
   stops, and nothing after it is ever emitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Detokenizer(Protocol):
    """What `TextStream` needs of a tokenizer (`dualserve.models.tokenizer.Tokenizer` has it)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


_INCOMPLETE = "\ufffd"  # what a decoder yields for a UTF-8 sequence cut short


class TextStream:
    """Final text of a growing token sequence, cut at the first stop string.

    `push` returns the newly final text; `flush` releases what was held back once the sequence
    has ended. `stopped` is the stop string that ended the stream, or None. `text` is all the
    text emitted so far.
    """

    def __init__(
        self,
        tokenizer: Detokenizer,
        stop: Sequence[str] | None = (),
        skip_special_tokens: bool = True,
        include_stop_str: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._include_stop = include_stop_str
        self._stops = tuple(dict.fromkeys(s for s in stop or () if s))
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._ids: list[int] = []
        # ids[prefix_offset:read_offset] were decoded into text already emitted (or held);
        # `_prefix_text` is their decoding, kept so each push decodes one window only.
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""
        self._pending = ""  # decoded text held back because a stop string may start in it
        self.stopped: str | None = None
        self.text = ""

    @property
    def token_ids(self) -> list[int]:
        """Every id pushed so far (a copy)."""
        return list(self._ids)

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became final (possibly "")."""
        if self.stopped is not None:
            return ""
        self._ids.append(token_id)
        return self._release(self._decode_new(final=False), final=False)

    def flush(self) -> str:
        """The sequence has ended: release all held-back text unless a stop string was hit."""
        if self.stopped is not None:
            return ""
        return self._release(self._decode_new(final=True), final=True)

    def _decode_new(self, final: bool) -> str:
        """Text the ids after `read_offset` add, or "" while it ends in an incomplete character."""
        if self._read_offset == len(self._ids):
            return ""
        window = self._tokenizer.decode(self._ids[self._prefix_offset:], skip_special_tokens=self._skip_special)
        if len(window) <= len(self._prefix_text) or (window.endswith(_INCOMPLETE) and not final):
            return ""
        new = window[len(self._prefix_text):]
        # The next window starts at the tokens just decoded: enough context for the decoder.
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._tokenizer.decode(
            self._ids[self._prefix_offset:self._read_offset], skip_special_tokens=self._skip_special)
        return new

    def _release(self, new: str, final: bool) -> str:
        """Append decoded text, cut it at a stop string, hold back a possible stop prefix."""
        pending = self._pending + new
        hit = self._find_stop(pending)
        if hit is not None:
            at, stop = hit
            out = pending[:at + len(stop)] if self._include_stop else pending[:at]
            self.stopped, self._pending = stop, ""
        else:
            hold = 0 if final else self._stop_prefix_len(pending)
            out, self._pending = pending[:len(pending) - hold], pending[len(pending) - hold:]
        self.text += out
        return out

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """The stop string in `text` that ends first, the longer one on a tie.

        Generation would have stopped token by token at the first completed stop string, so
        ranking by end (not by start) gives the same cut however the text arrived in chunks.
        Text already emitted can hold no stop string: its possible beginnings were held back.
        """
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            at = text.find(stop)
            if at >= 0 and (best is None or (at + len(stop), at) < best[:2]):
                best = (at + len(stop), at, stop)
        return None if best is None else (best[1], best[2])

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest end of `text` that is the beginning of some stop string."""
        for size in range(min(len(text), self._max_hold), 0, -1):
            tail = text[-size:]
            if any(stop.startswith(tail) for stop in self._stops):
                return size
        return 0
