"""Suffix drafts and the draft budget as pure pieces, then suffix drafting inside the engine.

The engine tests reuse test_eagle's tiny targets: output must equal plain AR (greedy) or be
distributed like it (sampling), whatever the sources propose, and every block comes back.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dualserve.decoders.eagle.budget import (EXPLORE_AFTER, LEARNED_EMA, Batch, CostCurve, DraftBudget, Offer, Reach,
                                             SourceRate, choose_budget, expected_accepted, match_prior)
from dualserve.decoders.eagle.suffix import SuffixCache, SuffixConfig, SuffixSource, TokenIndex, continuation_tree
from dualserve.decoders.eagle.tree import DraftTree, TreeConfig, merge_trees, source_outcome
from dualserve.decoders.engine.engine import Engine
from dualserve.decoders.engine.sampling import SamplingParams
from test_eagle import (GREEDY, PROMPTS, assert_first_two_tokens_follow, make_engine, oracle_head, run, tiny_target,
                        tokens)

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- the index, the cache, the lookup ----------------------------------------------

def test_longest_match_wins_and_own_end_is_skipped() -> None:
    cfg = SuffixConfig()
    idx = TokenIndex([1, 2, 3, 9, 5, 2, 3, 7, 8, 2, 3])
    m = idx.match(idx.tokens, cfg)  # the context is the sequence itself: its end has no continuation
    assert m.length == 2 and set(m.starts) == {3, 7}
    m = idx.match([5, 2, 3], cfg)  # "5 2 3" occurs once, followed by 7
    assert m.length == 3 and m.starts == (7,)
    assert idx.match([42], cfg).length == 0


def test_continuation_tree_ranks_by_frequency_and_keeps_parents() -> None:
    tree = continuation_tree(0, [[1, 2, 3], [1, 2, 4], [1, 5], [6]], max_nodes=3, min_prob=0.2)
    assert tree.tokens == [0, 1, 2, 3]  # ties (3, 4, 5, 6 once each) go to the first seen: the newest match
    assert all(p < i for i, p in enumerate(tree.parents) if i)
    assert continuation_tree(0, [[1], [2], [3], [4], [5]], max_nodes=8, min_prob=0.3).tokens == [0]


def test_lookup_pools_sources_and_refreshes_the_cache() -> None:
    cfg = SuffixConfig(spec_factor=4.0)
    source = SuffixSource(cfg)
    source.cache.add([10, 11, 12, 13, 14, 15])
    own = TokenIndex([1, 2, 10, 11])
    draft = source.lookup(own, own.tokens, max_nodes=8, max_depth=8)
    assert draft.match_length == 2 and draft.tree.tokens == [11, 12, 13, 14, 15]
    assert draft.cache_keys == (0,)
    # The request's own text matches longer than the cache: it wins.
    own = TokenIndex([7, 10, 11, 40, 41, 7, 10, 11])
    draft = source.lookup(own, own.tokens, max_nodes=8, max_depth=8)
    assert draft.tree.tokens[:3] == [11, 40, 41] and draft.cache_keys == ()
    # Depth follows the match length (spec_factor * length).
    short = SuffixSource(SuffixConfig(spec_factor=1.0))
    one = TokenIndex([4, 5, 6, 7, 4])
    assert short.lookup(one, one.tokens, 8, 8).tree.tokens == [4, 5]


def test_the_cache_index_finds_what_matching_every_entry_finds() -> None:
    """A lookup matches only the entries holding the context's last tokens: on random texts over a
    small vocabulary, with evictions and refreshes, the drafts equal those of matching every entry
    (in LRU order, as the lookup pools them)."""
    import math
    import random

    from dualserve.decoders.eagle.suffix import SuffixDraft, continuation_tree as trie

    rng = random.Random(3)
    cfg = SuffixConfig(cache_entries=40, cache_tokens=3000)
    source = SuffixSource(cfg)

    def every_entry(own: TokenIndex, context: list[int], limit: int) -> SuffixDraft:
        found = [(own, own.match(context, cfg), None)]
        found += [(e, e.match(context, cfg), key) for key, e in source.cache.entries.items()]
        best = max(m.length for _, m, _ in found)
        if best == 0:
            return SuffixDraft(DraftTree([context[-1]], [-1]), 0)
        depth = min(limit, cfg.max_depth, math.ceil(cfg.spec_factor * best))
        conts, keys = [], []
        for index, m, key in found:
            if m.length == best:
                conts += [index.continuation(p, depth) for p in m.starts]
                keys += [key] if key is not None else []
        return SuffixDraft(trie(context[-1], conts, limit, cfg.min_prob), best, tuple(keys))

    checked = 0
    for step in range(300):
        source.cache.add([rng.randrange(12) for _ in range(rng.randrange(2, 120))])
        if step % 7 == 0 and source.cache.entries:
            source.cache.touch(rng.choice(list(source.cache.entries)))
        context = [rng.randrange(12) for _ in range(rng.randrange(1, 40))]
        own = TokenIndex(context)
        got, want = source.lookup(own, context, 16, 16), every_entry(own, context, 16)
        assert (got.tree.tokens, got.tree.parents, got.match_length, got.cache_keys) == \
            (want.tree.tokens, want.tree.parents, want.match_length, want.cache_keys), step
        checked += bool(want.cache_keys)
    assert checked > 100  # most lookups drew from the cache
    assert len(source.cache.entries) <= 40 and source.cache.num_tokens <= 3000


def test_cache_is_bounded_and_lru() -> None:
    cache = SuffixCache(SuffixConfig(cache_entries=3, cache_tokens=10))
    for i in range(3):
        cache.add([i, i + 100, i + 200])
    assert list(cache.entries) == [0, 1, 2] and cache.num_tokens == 9
    cache.touch(0)
    cache.add([7, 8, 9])  # over both bounds: the least recently used entry (1) goes
    assert list(cache.entries) == [2, 0, 3] and cache.num_tokens == 9
    cache.add(list(range(50)))  # longer than the whole cache: its tail is kept, alone
    assert list(cache.entries) == [4] and cache.num_tokens == 10
    cache.add([1])  # too short to draft from
    assert list(cache.entries) == [4]


# ---- merged trees ----------------------------------------------------------------

def test_merge_dedupes_shared_prefixes_and_tracks_sources() -> None:
    head = DraftTree([9, 1, 2, 3], [-1, 0, 0, 1])      # 9 -> 1 -> 3, 9 -> 2
    suffix = DraftTree([9, 1, 3, 4], [-1, 0, 1, 2])    # 9 -> 1 -> 3 -> 4
    tree = merge_trees([head, suffix])
    assert tree.tokens == [9, 1, 2, 3, 4] and tree.parents == [-1, 0, 0, 1, 3]
    assert tree.sources == [3, 3, 1, 3, 2]
    assert source_outcome(tree, [1, 3, 4], 0) == (2, False)  # head's path fully accepted
    assert source_outcome(tree, [1, 3, 4], 1) == (3, False)
    assert source_outcome(tree, [2], 1) == (0, True)         # suffix proposed 1, the target took 2
    assert source_outcome(merge_trees([head, DraftTree([9], [-1])]), [1], 1) is None
    cut = tree.cut(2)
    assert cut.tokens == [9, 1, 2] and cut.sources == [3, 3, 1]
    assert tree.cut(8, max_depth=1).tokens == [9, 1, 2]


# ---- the budget ------------------------------------------------------------------

def test_budget_drafts_when_it_pays_and_not_otherwise() -> None:
    cpu = CostCurve()  # 8 tokens cost twice one
    head = Offer((2, 4, 4), 0.35, (0.1, 0.15, 0.2))
    # A weak head alone on a CPU: a plain step is faster.
    assert choose_budget(cpu, [Offer((2, 4, 4), 0.1, (0.1, 0.15, 0.2)), None]).depths == (0, 0)
    # A strong suffix match: draft deep.
    long = choose_budget(cpu, [None, Offer((1, 2, 3, 4, 5, 6, 7, 8), 0.9)])
    assert long.depths[1] >= 6 and long.depths[0] == 0
    # On a flat (GPU) curve with free drafting, every offered level pays.
    flat = choose_budget(CostCurve.flat(), [Offer((2, 4, 4), 0.35), None])
    assert (flat.depths, flat.nodes) == ((3, 0), (4, 0))
    assert choose_budget(CostCurve.flat(), [Offer((2, 4, 4), 0.35)]).depths == (3,)  # one source alone
    # A large batch: each extra token costs its share of a GEMM-bound forward; drafting stops.
    big = Batch(tokens=255, emitted=255)
    assert choose_budget(CostCurve(1.0, 8.0), [Offer((1, 2, 3), 0.7), None], big).num_nodes == 0
    # The node cap is respected.
    assert choose_budget(CostCurve.flat(), [head, Offer((1, 2, 3), 0.9)], max_nodes=3).num_nodes <= 3


def test_choose_budget_scores_every_pair_as_the_plain_formula_does() -> None:
    """The shared-prefix scoring picks the pair a direct evaluation of every pair picks."""
    import random

    rng = random.Random(0)
    for _ in range(300):
        curve = CostCurve(rng.uniform(0.5, 2), rng.uniform(0.5, 20))
        depth = rng.randint(1, 15)  # the lookup's levels, each at its own rate (as by match length)
        offers = [Offer(tuple(sorted(rng.randint(1, 12) for _ in range(rng.randint(1, 4)))), rng.random(),
                        tuple(sorted(rng.uniform(0, 2) for _ in range(4)))),
                  Offer(tuple(range(1, depth + 1)), tuple(rng.random() for _ in range(depth)))]
        offers = [o if rng.random() > 0.2 else None for o in offers]
        cap = rng.randint(1, 30)

        def speed(da: int, db: int) -> float:
            a, b = offers
            rates = [1 - (1 - a.level(level) if a and level < da else 1.0) * (1 - b.level(level) if b and level < db else 1.0)
                     for level in range(max(da, db))]
            nodes = (a.nodes[da - 1] if da else 0) + (b.nodes[db - 1] if db else 0)
            return (1 + expected_accepted(rates)) / (curve(1 + nodes) + (a.cost(da) if da else 0.0))

        got = choose_budget(curve, offers, max_nodes=cap)
        pairs = [(da, db) for da in range(len(offers[0].nodes) + 1 if offers[0] else 1)
                 for db in range(len(offers[1].nodes) + 1 if offers[1] else 1)
                 if (da or db) and (offers[0].nodes[da - 1] if da else 0) + (offers[1].nodes[db - 1] if db else 0) <= cap]
        best = max([speed(*p) for p in pairs] + [1 / curve(1)])
        picked = speed(*got.depths) if any(got.depths) else 1 / curve(1)  # no depth: a plain step
        assert picked == pytest.approx(best, rel=1e-9)


def test_draft_budget_probes_a_stale_model_and_learns_its_rate() -> None:
    budget = DraftBudget(CostCurve(1.0, 100.0))  # extra tokens are dear: no draft pays
    rates = budget.rates()
    reaches = [Reach((1, 2), (1, 2)), Reach((1, 2, 3))]
    assert budget.choose(["head", "suffix"], reaches, rates, cap=8).num_nodes == 0
    for _ in range(EXPLORE_AFTER):
        budget.record("head", rates["head"], None)
    probe = budget.choose(["head", "suffix"], reaches, rates, cap=8)
    assert probe.depths == (1, 0) and probe.units == (1, 0)  # the model drafts one level; suffix lookup is free
    before = budget.learned["head"].rate
    budget.record("head", rates["head"], (1, False))
    assert rates["head"].idle_steps == 0 and budget.learned["head"].rate > before
    fixed = DraftBudget(None).choose(["head", "suffix"], reaches, rates, cap=8)
    assert (fixed.depths, fixed.nodes, fixed.units) == ((2, 3), (2, 3), (2, 0))  # everything on offer


def test_a_lookup_drafts_by_its_match_length_and_learns_each_lengths_rate() -> None:
    """A long match continues a copy: it drafts deep where a one-token match drafts little or
    nothing; each level is learned at the match length it continued."""
    budget = DraftBudget(CostCurve(1.0, 4.5))  # each drafted token costs half a forward
    rates = budget.rates()
    short = budget.choose(["suffix"], [Reach((1, 2, 3, 4), match=1)], rates, cap=16)
    long = budget.choose(["suffix"], [Reach((1, 2, 3, 4), match=12)], rates, cap=16)
    assert short.depths == (0,) and long.depths == (4,) and long.matches == (12,)
    learned = budget.by_match["suffix"]
    assert learned.rate(1) == pytest.approx(match_prior(1)) and learned.rate(13) == learned.rate(12)
    for _ in range(40):  # drafts from two-token matches: two levels pass (lengths 2 and 3), the next fails
        budget.record("suffix", rates["suffix"], (2, True), match=2)
    assert learned.rate(2) > match_prior(2) and learned.rate(3) > match_prior(3) and learned.rate(4) < match_prior(4)
    assert learned.rate(1) == pytest.approx(match_prior(1))  # a length no draft continued keeps its prior
    budget.record("head", rates["head"], (0, True))  # a model's rate is its own: no match
    assert set(budget.by_match) == {"suffix"}


def test_expected_accepted_and_rates() -> None:
    assert expected_accepted([0.5, 0.5]) == pytest.approx(0.75)
    rate = SourceRate(0.5)
    for _ in range(20):
        rate.observe(0, True)
    assert rate.rate < 0.01
    for _ in range(400):
        rate.idle()  # unused: drifts back towards the prior, so the source is tried again
    assert rate.rate > 0.45


def test_cost_curve_learns_the_host() -> None:
    curve = CostCurve()
    assert curve(8) == pytest.approx(2 * curve(1))
    for _ in range(30):
        curve.observe(1, 0.010)
        curve.observe(8, 0.012)
    assert curve(1) == pytest.approx(0.010, rel=0.01) and curve(8) == pytest.approx(0.012, rel=0.01)
    assert 0.010 < curve(6) < 0.012  # between the measured counts
    for _ in range(30):
        curve.observe(100, 0.05)
    assert curve(120) == pytest.approx(0.05 * curve.prior(120) / curve.prior(100), rel=0.01)  # same bucket
    curve.observe(1, 0.040)  # one stalled forward moves the estimate as a 1.5x slower one would
    assert curve(1) == pytest.approx(0.010 * (1 + 0.3 * 0.5), rel=0.01)
    for _ in range(30):  # a lasting change is followed
        curve.observe(1, 0.030)
    assert curve(1) == pytest.approx(0.030, rel=0.01)


def test_cost_curve_interpolates_between_measured_buckets() -> None:
    curve = CostCurve(0.003, 0.007)  # a start-up prior much steeper than the served forward
    for _ in range(30):
        curve.observe(1, 0.0074)
        curve.observe(4, 0.0079)
        curve.observe(8, 0.0103)
    costs = [curve(n) for n in range(1, 9)]
    assert all(a <= b for a, b in zip(costs, costs[1:]))  # 2 tokens no dearer than 3 (they were 25%)
    assert 0.0074 < curve(2) < 0.0079


# ---- inside the engine ---------------------------------------------------------------

REPEAT = [5, 6, 7, 8, 9, 10, 11] * 4  # the bigram target continues periodic text periodically


def same_as_ar(engine: Engine, prompts, params: SamplingParams = GREEDY) -> list[list]:
    jobs = [(d, p, params) for p in prompts for d in ("ar", "eagle")]
    outs = run(engine, jobs)
    for i in range(0, len(jobs), 2):
        assert tokens(outs[i + 1]) == tokens(outs[i])
        assert "".join(d.text for d in outs[i + 1]) == "".join(d.text for d in outs[i])
        assert outs[i + 1][-1].finish_reason == outs[i][-1].finish_reason
    engine.pool.check()
    return outs[1::2]


@pytest.mark.parametrize("bigram", [0.0, 0.3])
def test_suffix_alone_greedy_identical(bigram: float) -> None:
    """No head: eagle drafts from suffix lookup alone; blocks all come back without a prefix cache."""
    target = tiny_target(2, bigram)
    engine = make_engine(target, None, enable_prefix_caching=False)
    outs = same_as_ar(engine, PROMPTS + [REPEAT])
    assert engine.pool.num_used_blocks == 0
    if bigram == 0.0:
        stats = outs[-1][-1].stats
        assert stats["suffix_steps"] > 0 and stats["mean_accept_length"] > 1.5


@pytest.mark.parametrize("draft", ["auto", "head", "suffix", "both"])
def test_head_and_suffix_in_one_tree(draft: str) -> None:
    target = tiny_target(3, 0.2)
    engine = make_engine(target, oracle_head(target, noise=0.05, seed=2), TreeConfig(3, 2, 5))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, draft=draft)
    outs = same_as_ar(engine, PROMPTS + [REPEAT], params)
    used = {k.removesuffix("_steps") for o in outs for k in o[-1].stats if k.endswith("_steps") and k != "plain_steps"}
    assert used <= {"head", "suffix"} and used
    if draft in ("head", "suffix"):
        assert used == {draft}


def test_cost_budget_greedy_identical_and_degrades_to_plain_steps() -> None:
    target = tiny_target(4, 0.3)
    head = oracle_head(target, noise=0.3, seed=5)  # weak: the budget should stop drafting from it
    curve = CostCurve(1.0, 100.0)  # a host where every extra token is dear
    engine = make_engine(target, head, TreeConfig(3, 2, 4), cost=curve)
    outs = same_as_ar(engine, PROMPTS)
    assert all(o[-1].stats["plain_steps"] > 0 for o in outs)
    assert curve.measured  # the decode steps were timed
    engine = make_engine(target, oracle_head(target), TreeConfig(3, 2, 4), cost=CostCurve.flat())
    same_as_ar(engine, PROMPTS + [REPEAT])


def test_stops_and_logprobs_exact_with_suffix() -> None:
    target = tiny_target(1)
    engine = make_engine(target, None)
    ar_text = "".join(d.text for d in run(engine, [("ar", REPEAT, GREEDY)])[0])
    for params in [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=(ar_text[9:11],)),
                   SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True, logprobs=2)]:
        ar, eagle = run(engine, [("ar", REPEAT, params), ("eagle", REPEAT, params)])
        assert tokens(eagle) == tokens(ar)
        assert "".join(d.text for d in eagle) == "".join(d.text for d in ar)
        if params.logprobs is not None:
            assert [lp.token_id for d in eagle for lp in d.logprobs] == tokens(ar)


def test_sampling_exact_with_suffix_and_cache() -> None:
    """First two sampled tokens after a periodic prompt, drawn by suffix drafts (the request's own
    text and, request after request, the cache of earlier outputs), follow the target's joint law."""
    vocab = 8
    target = tiny_target(6, 0.3, vocab=vocab)
    engine = make_engine(target, None, num_blocks=1024, max_num_seqs=64, max_waiting=4096, max_batched_tokens=4096)
    params = SamplingParams(max_tokens=3, temperature=0.9, top_k=6, ignore_eos=True, seed=0)
    prompt = [3, 1, 4, 3, 1, 4, 3, 1]
    n = 600
    outs = run(engine, [("eagle", prompt, SamplingParams(**{**params.__dict__, "seed": i})) for i in range(n)])
    assert sum(o[-1].stats.get("suffix_steps", 0) for o in outs) > n // 2
    assert_first_two_tokens_follow(target, prompt, params, outs)


# ---- the real default model ------------------------------------------------------------

def test_default_model_repetitive_prompt_greedy_identical(default_gguf: Path, cache_dir: Path) -> None:
    """The default model (int4) copying code: head + suffix and suffix alone give AR's tokens, and
    suffix drafts are accepted at length."""
    from dualserve.decoders.deployment import PoolSpec, ServedSpec, build_deployment
    from dualserve.models.assets import default_eagle_head
    from dualserve.models.loader import load_model

    loaded = load_model(default_gguf, name="SmolLM2-135M-Instruct", cache_dir=cache_dir, quantization="int4")
    head = default_eagle_head(loaded.name) or "suffix"  # as `dualserve serve` picks it
    dep = build_deployment([ServedSpec(loaded.name, loaded, eagle_head=head)], pool=PoolSpec(num_blocks=256))
    code = "def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"
    tok = loaded.tokenizer
    ids = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": f"Rename w to width in this code and show all of it:\n{code}"}],
        add_generation_prompt=True), add_special_tokens=False)
    outs = {}
    for decoder, draft in (("ar", "auto"), ("eagle", "auto"), ("eagle", "suffix")):
        deltas: list = []
        dep.engine.submit(loaded.name, decoder, ids, SamplingParams(max_tokens=48, temperature=0.0, draft=draft),
                          lambda _, x: deltas.append(x))
        dep.engine.run_until_idle()
        outs[(decoder, draft)] = deltas
    want = tokens(outs[("ar", "auto")])
    assert tokens(outs[("eagle", "auto")]) == want and tokens(outs[("eagle", "suffix")]) == want
    stats = outs[("eagle", "suffix")][-1].stats
    assert stats["suffix_steps"] > 0 and stats["mean_accept_length"] > 1.3, json.dumps(stats)
    dep.engine.pool.check()


def test_a_source_its_prior_rules_out_is_probed_and_its_rate_learned() -> None:
    """A model source whose rate says it cannot pay still drafts one level every EXPLORE_AFTER steps,
    so a good one is found; the decoder-wide rate it learns seeds the next request's."""
    target = tiny_target(1)  # a bigram target: the oracle head's drafts are all accepted
    engine = make_engine(target, oracle_head(target), TreeConfig(3, 2, 4), cost=CostCurve(1.0, 2.5))
    decoder = engine.decoders[("m", "eagle")]
    # The costs stay the stated curve: the tiny model's measured step times (microseconds, mostly
    # Python) would otherwise decide, and vary from run to run, whether drafting pays.
    decoder.cost.observe = lambda n, seconds: None
    for timing in decoder.budget.timing.values():
        timing.observe_units = timing.observe_catch_up = lambda *args: None
    decoder.budget.learned["head"] = SourceRate(0.0, weight=LEARNED_EMA)  # rules the head out
    params = SamplingParams(max_tokens=3 * EXPLORE_AFTER + 8, temperature=0.0, ignore_eos=True, draft="head")
    first = same_as_ar(engine, [PROMPTS[0]], params)[0][-1].stats
    # Probes, each accepted in full (once one has raised the request's rate, the budget may draft deeper).
    assert first["head_steps"] >= 2 and first["head_accept_length"] >= 1.0
    assert decoder.budget.learned["head"].rate > 0.05
    decoder.budget.learned["head"] = SourceRate(0.95, weight=LEARNED_EMA)  # as if many requests had shown it
    second = same_as_ar(engine, [PROMPTS[1]], params)[0][-1].stats
    assert second["head_steps"] > 4 * second["plain_steps"]
