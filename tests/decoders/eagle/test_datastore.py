"""The datastore of answers (``eagle/datastore.py``): its lookup against a plain scan, its file
forms, how suffix lookup weighs it, and drafting from it inside the engine (output equals ``ar``)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from dualserve.decoders.eagle.budget import CostCurve, DraftBudget, Reach, datastore_prior, match_prior
from dualserve.decoders.eagle.datastore import Datastore
from dualserve.decoders.eagle.suffix import DATASTORE_LEAD, SuffixConfig, SuffixSource, TokenIndex
from dualserve.decoders.engine.sampling import SamplingParams
from test_eagle import PROMPTS, make_engine, run, tiny_target, tokens

pytestmark = pytest.mark.usefixtures("one_thread")


def scan(answers: list[list[int]], context: list[int], max_match: int) -> tuple[int, set[int]]:
    """The longest suffix of ``context`` that some answer holds with a token after it, and where
    those tokens sit in the datastore's array (answers apart by one separator)."""
    best, starts, offset = 0, set(), 0
    for a in answers:
        for nxt in range(1, len(a)):
            n = 0
            while n < min(len(context), nxt, max_match) and a[nxt - 1 - n] == context[-1 - n]:
                n += 1
            if n > best:
                best, starts = n, {offset + nxt}
            elif n == best and n:
                starts.add(offset + nxt)
        offset += len(a) + 1
    return best, starts


def test_a_lookup_finds_what_a_scan_of_every_answer_finds() -> None:
    """Every key length, matches longer than the longest key, none across two answers, none at an
    answer's last token (nothing follows it)."""
    cfg = SuffixConfig(max_candidates=1 << 20, max_match=12)
    rng = random.Random(0)
    for _ in range(10):
        answers = [[rng.randrange(5) for _ in range(rng.randrange(2, 30))] for _ in range(15)]
        store = Datastore.from_answers(answers)
        for _ in range(100):
            context = [rng.randrange(5) for _ in range(rng.randrange(1, 30))]
            m = store.match(context, cfg)
            best, starts = scan(answers, context, cfg.max_match)
            assert m.length == best and set(m.starts) == starts


def test_token_ids_of_any_integer_type_and_no_negative_ones() -> None:
    import numpy as np

    from dualserve.models.errors import InputError

    store = Datastore.from_answers([np.array([10, 11, 12], dtype=np.int64), [13, 14]])
    assert store.match(list(np.array([10, 11], dtype=np.int32)), SuffixConfig()).length == 2
    with pytest.raises(InputError, match="outside 0"):
        Datastore.from_answers([[5, -2, 7]])


def test_a_continuation_stops_at_its_answers_end() -> None:
    store = Datastore.from_answers([[1, 2, 3, 4], [9, 8], [7]])  # a one-token answer holds nothing to draft
    cfg = SuffixConfig()
    m = store.match([5, 1, 2], cfg)
    assert m.length == 2 and [store.continuation(p, 8) for p in m.starts] == [[3, 4]]
    assert store.match([4], cfg).length == 0  # the last token of an answer: nothing follows
    assert store.match([7], cfg).length == 0 and store.answers == 2


def test_many_candidates_are_read_evenly_over_the_corpus() -> None:
    """A key held 1,000 times: ``max_candidates`` of its places are read, first to last answer."""
    store = Datastore.from_answers([[1, 2, i % 7 + 10] for i in range(1000)])
    m = store.match([1, 2], SuffixConfig(max_candidates=8))
    assert m.length == 2 and len(m.starts) == 8
    assert min(m.starts) < 0.01 * len(store) and max(m.starts) > 0.99 * len(store)


def test_saved_and_distilled_forms_load_the_same_answers(tmp_path: Path) -> None:
    answers = [[1, 2, 3], [70000, 5, 6, 7], [8, 9]]  # an id past 16 bits is stored in 32
    store = Datastore.from_answers(answers)
    store.save(tmp_path / "a.npz")
    again = Datastore.load(tmp_path / "a.npz")
    assert again.tokens.tolist() == store.tokens.tolist()
    shards = tmp_path / "distil"
    shards.mkdir()
    (shards / "shard-00000.jsonl").write_text("".join(json.dumps({"answer_ids": a}) + "\n" for a in answers))
    assert Datastore.load(shards).tokens.tolist() == store.tokens.tolist()
    small = Datastore.from_answers([[1, 2, 3]])
    small.save(tmp_path / "b.npz")
    assert Datastore.load(tmp_path / "b.npz").tokens.tolist() == small.tokens.tolist()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no answers"):
        Datastore.load(tmp_path / "empty")


def test_suffix_lookup_drafts_from_the_datastore_only_where_it_matches_longer() -> None:
    cfg = SuffixConfig(spec_factor=4.0)
    store = Datastore.from_answers([[20, 21, 22, 23, 50, 51, 52]])
    source = SuffixSource(cfg, store)
    shared = [20, 21, 22, 23]  # the datastore matches the context's last 4 tokens
    for own_match in range(1, 5):
        # The request's own text holds the context's last own_match tokens once before, then 70, 71.
        own = TokenIndex([9] + shared[-own_match:] + [70, 71, 9] + shared)
        draft = source.lookup(own, own.tokens, max_nodes=8, max_depth=8)
        if own_match <= len(shared) - DATASTORE_LEAD:
            assert draft.lookup == "datastore" and draft.match_length == 4 and draft.tree.tokens[:3] == [23, 50, 51]
        else:
            assert draft.lookup is None and draft.tree.tokens[:3] == [23, 70, 71]


def test_datastore_drafts_are_weighed_and_learned_apart() -> None:
    assert all(datastore_prior(m) < match_prior(m) for m in range(1, 30))
    budget = DraftBudget(CostCurve(1.0, 1.9))
    rates = budget.rates()
    mine = budget.choose(["suffix"], [Reach((1, 2, 3, 4), match=3)], rates, cap=16)
    theirs = budget.choose(["suffix"], [Reach((1, 2, 3, 4), match=3, lookup="datastore")], rates, cap=16)
    assert theirs.depths[0] < mine.depths[0] and theirs.lookups == ("datastore",) and mine.lookups == (None,)
    for _ in range(50):
        budget.record("suffix", rates["suffix"], (0, True), match=3, lookup="datastore")
    assert budget.by_match["datastore"].rate(3) < 0.1 and not budget.by_match["suffix"].rates  # learned apart


def test_eagle_drafting_from_a_datastore_gives_ar_s_tokens() -> None:
    """A datastore holding the answers (accepted at length) or unrelated text (rejected): greedy
    output equals ``ar``'s either way, and every block comes back."""
    target = tiny_target(2, 0.3)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, draft="suffix")
    plain = make_engine(target, None, enable_prefix_caching=False)
    ar = [tokens(o) for o in run(plain, [("ar", p, params) for p in PROMPTS])]
    rng = random.Random(1)
    noise = [[rng.randrange(64) for _ in range(30)] for _ in range(20)]
    for answers, accepted in ((ar, True), (noise, False)):
        engine = make_engine(target, None, datastore=Datastore.from_answers(answers), enable_prefix_caching=False)
        outs = run(engine, [("eagle", p, params) for p in PROMPTS])
        assert [tokens(o) for o in outs] == ar
        assert engine.pool.num_used_blocks == 0
        decoder = engine.decoders[("m", "eagle")]
        if accepted:
            assert "datastore" in decoder.budget.by_match
            assert max(o[-1].stats["mean_accept_length"] for o in outs) > 2
            assert sum(o[-1].stats.get("datastore_steps", 0) for o in outs) > 0
