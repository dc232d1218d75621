"""TextStream: streamed text equals the full decode, and stop strings cut it exactly."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import sentencepiece as spm
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, pre_tokenizers, trainers
from tokenizers import models as tk_models

from dualserve.decoders.engine.detokenize import TextStream
from dualserve.models.tokenizer import Tokenizer

WORDS = ("the quick brown fox jumps over the lazy dog hello world stop STOP end ### "
         "naïve café 日本語 テスト 🎉 👍🏽 \n \t  , . ! ? 123 4567").split(" ")

TEXTS = [
    "Hello world", "  leading and trailing  ", "multi\nline\n\ntext", "日本語のテキスト",
    "emoji 🎉🎉 and 👨‍👩‍👧 family 🥳", "naïve café", "x", "", "###STOP###", "a\u0301 combining",
]


def corpus(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 25))) for _ in range(n)]


class BytePieces:
    """A tokenizer whose token i is the byte string pieces[i]; ids in `special` are special."""

    def __init__(self, pieces: list[bytes | str], special: frozenset[int] = frozenset()) -> None:
        self.pieces = [p.encode() if isinstance(p, str) else p for p in pieces]
        self.special = special

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        kept = (self.pieces[i] for i in ids if not (skip_special_tokens and i in self.special))
        return b"".join(kept).decode("utf-8", "replace")


def stream(tokenizer, ids, **options) -> tuple[str, TextStream]:
    s = TextStream(tokenizer, **options)
    pieces = [s.push(i) for i in ids]
    pieces.append(s.flush())
    assert "".join(pieces) == s.text
    return s.text, s


@pytest.fixture(scope="module")
def byte_level() -> Tokenizer:
    backend = Backend(tk_models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(corpus(400, seed=0), trainer)
    return Tokenizer(backend, eos_token_id=backend.token_to_id("<eos>"))


@pytest.fixture(scope="module")
def sentencepiece_like(tmp_path_factory) -> Tokenizer:
    directory: Path = tmp_path_factory.mktemp("spm")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus(400, seed=1)), model_prefix=str(directory / "tokenizer"),
        vocab_size=400, model_type="bpe", byte_fallback=True, character_coverage=1.0,
        normalization_rule_name="identity", remove_extra_whitespaces=False, minloglevel=2)
    return Tokenizer.from_hf_dir(directory)


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece_like"])
@pytest.mark.parametrize("skip", [True, False])
def test_stream_equals_full_decode(request, kind, skip):
    tok: Tokenizer = request.getfixturevalue(kind)
    eos = tok.eos_token_id
    for text in TEXTS + corpus(150, seed=2):
        cut = text.find(" ", len(text) // 2) % (len(text) + 1)  # special tokens fall between characters
        ids = tok.encode(text[:cut], add_special_tokens=True)
        if eos is not None:
            ids += [eos, *tok.encode(text[cut:]), eos]
        out, s = stream(tok, ids, skip_special_tokens=skip)
        assert out == tok.decode(ids, skip_special_tokens=skip)
        assert s.stopped is None


def test_multibyte_characters_are_held_until_complete(byte_level):
    ids = byte_level.encode("🥳")
    assert len(ids) > 1  # not in the training text: spelled in bytes
    s = TextStream(byte_level)
    assert [s.push(i) for i in ids] == [""] * (len(ids) - 1) + ["🥳"]


def test_unicode_split_across_tokens():
    tok = BytePieces(["caf", b"\xc3", b"\xa9", " ", b"\xf0\x9f", b"\x8e", b"\x89", "!"])
    s = TextStream(tok)
    assert [s.push(i) for i in range(8)] == ["caf", "", "é", " ", "", "", "🎉", "!"]
    assert s.flush() == "" and s.text == "café 🎉!"


def test_incomplete_character_at_the_end_is_flushed_as_decoded():
    tok = BytePieces(["ok", b"\xf0\x9f"])
    out, _ = stream(tok, [0, 1])
    assert out == tok.decode([0, 1]) == "ok\ufffd"


def test_stop_spanning_tokens():
    tok = BytePieces(["Hel", "lo", " wor", "ld", "!"])
    s = TextStream(tok, stop=["o wo"])
    assert s.push(0) == "Hel"
    assert s.push(1) == "l"  # "o" could begin "o wo"
    assert s.push(2) == ""
    assert s.stopped == "o wo" and s.text == "Hell"
    assert s.push(3) == "" and s.push(4) == "" and s.flush() == ""
    assert s.text == "Hell"


def test_stop_at_very_start():
    tok = BytePieces(["STOP", "after"])
    out, s = stream(tok, [0, 1], stop=["STOP"])
    assert out == "" and s.stopped == "STOP"


def test_stop_inside_a_token():
    tok = BytePieces(["abc", "xxENDyy", "zz"])
    out, s = stream(tok, [0, 1, 2], stop=["END"])
    assert out == "abcxx" and s.stopped == "END"


def test_include_stop_str():
    tok = BytePieces(["abc", "xxENDyy"])
    out, s = stream(tok, [0, 1], stop=["END"], include_stop_str=True)
    assert out == "abcxxEND" and s.stopped == "END"


def test_partial_match_is_held_then_flushed():
    tok = BytePieces(["hello ", "wor"])
    s = TextStream(tok, stop=["world!"])
    assert s.push(0) == "hello "
    assert s.push(1) == ""
    assert s.flush() == "wor"
    assert s.stopped is None and s.text == "hello wor"


def test_held_text_released_when_match_breaks():
    tok = BytePieces(["a", "wor", "m"])
    s = TextStream(tok, stop=["world"])
    assert [s.push(0), s.push(1), s.push(2)] == ["a", "", "worm"]


def test_first_completed_stop_wins():
    tok = BytePieces(["a", "b", "c", "d"])
    out, s = stream(tok, [0, 1, 2, 3], stop=["abcd", "bc"])
    assert out == "a" and s.stopped == "bc"
    tok = BytePieces(["abcd"])
    out, s = stream(tok, [0], stop=["abcd", "bc"])  # same cut when it all comes in one token
    assert out == "a" and s.stopped == "bc"


def test_special_tokens_and_stops():
    tok = BytePieces(["<eos>", "hi", " there"], special=frozenset({0}))
    assert stream(tok, [1, 0, 2])[0] == "hi there"
    assert stream(tok, [1, 0, 2], skip_special_tokens=False)[0] == "hi<eos> there"
    out, s = stream(tok, [1, 0, 2], skip_special_tokens=False, stop=["<eos>"])
    assert out == "hi" and s.stopped == "<eos>"


def first_stop_cut(text: str, stops: list[str]) -> tuple[str, str | None]:
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not found:
        return text, None
    _, at, stop = min(found)
    return text[:at], stop


def test_stop_strings_on_real_token_streams(byte_level, sentencepiece_like):
    rng = random.Random(3)
    for tok in (byte_level, sentencepiece_like):
        for text in corpus(150, seed=4):
            ids = tok.encode(text)
            full = tok.decode(ids, skip_special_tokens=True)
            stops = ["zzz-absent"]
            for _ in range(rng.randint(1, 3)):
                if len(full) > 2:
                    start = rng.randrange(len(full) - 1)
                    stops.append(full[start:start + rng.randint(1, 6)])
            out, s = stream(tok, ids, stop=stops)
            expected, stop = first_stop_cut(full, stops)
            assert (out, s.stopped) == (expected, stop), (full, stops)
            assert not any(st in out for st in stops)


def test_decode_windows_stay_small(byte_level):
    sizes = []

    class Recording:
        def decode(self, ids, skip_special_tokens=False):
            sizes.append(len(ids))
            return byte_level.decode(ids, skip_special_tokens)

    ids = byte_level.encode(" ".join(corpus(60, seed=5)))
    assert len(ids) > 500
    out, _ = stream(Recording(), ids, stop=["never appears"])
    assert out == byte_level.decode(ids)
    assert max(sizes) <= 8
