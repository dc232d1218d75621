"""Stop conditions as a client sees them: ``Request.commit`` over scripted tokens of the real tokenizer.

``Request.commit`` is the one place every decoder's committed tokens become output, so the
edge cases are checked there directly, one token at a time (AR) and several at a time (a
speculative or diffusion step): stop strings spanning tokens, starting inside a token or at
the first token, several stops, stop token ids, EOS, max_tokens, and the rule that tokens
after a stop are neither emitted nor counted. An exhaustive check compares every short
substring of a sentence, used as a stop, against a brute-force answer.
"""

from __future__ import annotations

import pytest

from dualserve.decoders.engine.detokenize import TextStream
from dualserve.decoders.engine.request import Delta, Request
from dualserve.decoders.engine.sampling import SamplingParams, TokenLogprob
from dualserve.models.loader import converted_dir, load_model
from dualserve.models.tokenizer import Tokenizer

SENTENCE = "Hello world, hello there. Goodbye!"


@pytest.fixture(scope="module")
def tok(default_gguf, cache_dir) -> Tokenizer:
    """The default model's tokenizer, read from its converted directory (converted on first use)."""
    target = converted_dir(default_gguf, cache_dir)
    if not target.exists():
        load_model(default_gguf, cache_dir=cache_dir)
    return Tokenizer.from_hf_dir(target)


@pytest.fixture(scope="module")
def ids(tok) -> list[int]:
    out = tok.encode(SENTENCE)
    assert tok.decode(out) == SENTENCE and len(out) == 9  # 'Hello' ' world' ',' ' hello' ' there' ...
    return out


def make_request(tok: Tokenizer, **params) -> Request:
    p = SamplingParams(**{"max_tokens": 100, **params})
    stream = TextStream(tok, p.stop, skip_special_tokens=p.skip_special_tokens)
    return Request("r", [1, 2, 3], p, "ar", stream, frozenset(tok.eos_token_ids), sink=lambda i, d: None)


def feed(req: Request, token_ids: list[int], chunk: int = 1) -> list[Delta]:
    """Commit `chunk` tokens at a time (with fake logprobs) until the request finishes."""
    deltas = []
    for i in range(0, len(token_ids), chunk):
        part = token_ids[i:i + chunk]
        deltas.append(req.commit(part, [TokenLogprob(t, -1.0, []) for t in part]))
        if deltas[-1].finish_reason is not None:
            break
    return deltas


def outcome(deltas: list[Delta]) -> tuple[str, list[int], str | None]:
    for d in deltas:
        assert d.logprobs is not None and [lp.token_id for lp in d.logprobs] == d.token_ids
    return "".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids], deltas[-1].finish_reason


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("stop, text, kept", [
    (["world, hello"], "Hello ", 4),           # spans three tokens
    (["Hello"], "", 1),                        # the very first token
    (["orl"], "Hello w", 2),                   # inside one token
    (["ld, he"], "Hello wor", 4),              # starts and ends inside tokens
    (["Goodbye", "hello", "there"], "Hello world, ", 4),  # the earliest in the text wins, not the first listed
    (["!"], "Hello world, hello there. Goodbye", 9),       # at the very end
])
def test_stop_strings(tok, ids, chunk, stop, text, kept):
    req = make_request(tok, stop=tuple(stop))
    got_text, got_ids, finish = outcome(feed(req, ids, chunk))
    assert (got_text, got_ids, finish) == (text, ids[:kept], "stop")
    assert req.output_ids == ids[:kept], "tokens after the stop are not kept, so usage never counts them"


@pytest.mark.parametrize("chunk", [1, 4])
def test_every_short_substring_as_a_stop(tok, ids, chunk):
    """Brute force: the text is cut right before the stop's first occurrence, and the tokens kept are
    exactly those needed to produce it."""
    for size in (1, 2, 3, 5):
        for at in range(len(SENTENCE) - size + 1):
            stop = SENTENCE[at:at + size]
            first = SENTENCE.index(stop)
            need = next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]))
            got_text, got_ids, finish = outcome(feed(make_request(tok, stop=(stop,)), ids, chunk))
            assert (got_text, got_ids, finish) == (SENTENCE[:first], ids[:need], "stop"), stop


def test_no_text_past_a_stop_in_any_delta(tok, ids):
    req = make_request(tok, stop=("there",))
    deltas = feed(req, ids + ids)
    assert all("there" not in d.text for d in deltas)
    assert outcome(deltas)[0] == "Hello world, hello "


def test_stop_token_ids_end_the_stream_without_their_text(tok, ids):
    comma = ids[2]
    got = outcome(feed(make_request(tok, stop_token_ids=(comma,)), ids))
    assert got == ("Hello world", ids[:3], "stop")


def test_eos_stops_unless_ignored(tok, ids):
    eos = tok.eos_token_id
    seq = ids[:3] + [eos] + ids[3:]
    assert outcome(feed(make_request(tok), seq)) == ("Hello world,", seq[:4], "stop")
    text, got_ids, finish = outcome(feed(make_request(tok, ignore_eos=True, max_tokens=len(seq)), seq))
    assert (text, got_ids, finish) == (SENTENCE, seq, "length")  # the special token's text is skipped


def test_max_tokens_finishes_with_length_and_releases_held_text(tok, ids):
    # " there" could still grow into the stop " there!", so it is held back until the end.
    req = make_request(tok, stop=(" there!",), max_tokens=5)
    deltas = feed(req, ids)
    assert outcome(deltas) == ("Hello world, hello there", ids[:5], "length")
    assert "there" not in "".join(d.text for d in deltas[:-1]) and deltas[-1].text == " there"


def test_multi_byte_characters_are_never_split(tok):
    ids = tok.encode("I like 😀 emoji.")
    deltas = feed(make_request(tok, stop=("emoji",)), ids)
    assert all("\ufffd" not in d.text for d in deltas)
    assert outcome(deltas)[0] == "I like 😀 "


def test_finish_flushes_held_text_once(tok, ids):
    req = make_request(tok, stop=(" hello!",))
    deltas = feed(req, ids[:4])  # " hello" is held: it may begin the stop string
    assert "".join(d.text for d in deltas) == "Hello world,"
    tail = req.finish("length")
    assert tail.text == " hello" and tail.finish_reason == "length" and tail.token_ids == []
    aborted = make_request(tok, stop=(" hello!",))
    feed(aborted, ids[:4])
    assert aborted.finish("abort").text == "", "an aborted request does not release held text"


def test_prompt_logprobs_ride_on_the_first_delta_only(tok, ids):
    req = make_request(tok, prompt_logprobs=True, logprobs=0)
    assert req.prompt_logprobs == [None] and req.needs_prompt_logprobs and not req.uses_prefix_cache
    req.prompt_logprobs += [TokenLogprob(2, -0.5, []), TokenLogprob(3, -0.25, [])]
    assert not req.needs_prompt_logprobs and req.uses_prefix_cache
    first, second = req.commit(ids[:1]), req.commit(ids[1:2])
    assert first.prompt_logprobs == req.prompt_logprobs and second.prompt_logprobs is None
    assert make_request(tok).commit(ids[:1]).prompt_logprobs is None


def test_all_ids_follows_commits(tok, ids):
    req = make_request(tok)
    feed(req, ids[:3])
    assert req.all_ids == [1, 2, 3] + ids[:3] and req.num_tokens == 6
    req.output_ids.append(ids[3])  # a decoder that appends directly still sees a consistent list
    assert req.all_ids == [1, 2, 3] + ids[:4]
