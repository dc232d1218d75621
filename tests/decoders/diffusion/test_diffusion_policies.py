"""Unmasking policies, schedules, confidences and unit layout: pure functions, checked by hand.

The expected values are worked out from the upstream definitions quoted in each test
(LLaDA ``generate.py``, Fast-dLLM ``get_transfer_index`` / ``get_transfer_index_dynamic``,
Dream ``_sample``, SDAR ``low_confidence_dynamic``); no model is involved.
"""

from __future__ import annotations

import math

import pytest
import torch

from dualserve.decoders.diffusion.decoder import unit_spans
from dualserve.decoders.diffusion.cache import (CacheState, DualCache, ExactCache, Frame, NoCache, PrefixCache,
                                                Work, advance, prefill_chunk)
from dualserve.decoders.diffusion.policies import (DreamSchedule, DynamicThreshold, Factor, LinearSchedule,
                                                   LowConfidence, Threshold, confidence, dream_counts,
                                                   linear_counts, propose)
from dualserve.decoders.engine.sampling import SamplingParams


def as_set(t: torch.Tensor) -> set[int]:
    return set(t.tolist())


# ---- schedules ----------------------------------------------------------------------------


def test_linear_counts_put_the_remainder_first() -> None:
    assert linear_counts(10, 4) == [3, 3, 2, 2]
    assert linear_counts(8, 8) == [1] * 8
    assert linear_counts(3, 5) == [1, 1, 1, 0, 0]


def test_linear_schedule_drops_empty_steps_and_defaults_to_one_per_step() -> None:
    assert LinearSchedule(5).counts(3) == [1, 1, 1]
    assert LinearSchedule().counts(4) == [1, 1, 1, 1]
    assert LinearSchedule(2).counts(7) == [4, 3]


def dream_counts_by_hand(m: int, steps: int, eps: float = 1e-3) -> list[int]:
    """Dream's loop with one sequence: k = int(m_i * (1 - s/t)), the last step takes the rest."""
    ts = torch.linspace(1, eps, steps + 1)
    out = []
    for i in range(steps):
        num_mask = torch.tensor([True] * m).sum() / 1  # float32, as Dream divides by the batch size
        k = int(num_mask * (1 - ts[i + 1] / ts[i])) if i < steps - 1 else int(num_mask)
        out.append(k)
        m -= k
    return out


@pytest.mark.parametrize("m,steps", [(12, 12), (16, 4), (7, 3), (32, 32)])
def test_dream_counts_follow_dreams_float32_arithmetic(m: int, steps: int) -> None:
    counts = dream_counts(m, steps)
    assert counts == dream_counts_by_hand(m, steps)
    assert sum(counts) == m and len(counts) == steps
    assert DreamSchedule(steps).counts(m) == [c for c in counts if c]


# ---- confidences and proposals ----------------------------------------------------------


def test_confidences() -> None:
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.4, 0.4, 0.2]])
    tokens = torch.tensor([0, 2])
    assert torch.allclose(confidence("prob", probs, tokens), torch.tensor([0.7, 0.2]))
    assert torch.allclose(confidence("margin", probs, tokens), torch.tensor([0.5, 0.0]))
    neg_h = [sum(p * math.log(p + 1e-10) for p in row) for row in probs.tolist()]
    assert torch.allclose(confidence("neg_entropy", probs, tokens), torch.tensor(neg_h))
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(confidence("random", probs, tokens, g1), confidence("random", probs, tokens, g2))


def test_propose_greedy_and_seeded_samples() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(propose(logits, SamplingParams(temperature=0.0), torch.Generator()), logits.argmax(-1))
    params = SamplingParams(temperature=1.0, top_k=5)
    a = propose(logits, params, torch.Generator().manual_seed(1))
    b = propose(logits, params, torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    top5 = logits.topk(5, -1).indices
    assert all(int(t) in top5[i].tolist() for i, t in enumerate(a))


# ---- selection rules --------------------------------------------------------------------


def test_low_confidence_takes_the_k_most_confident() -> None:
    conf = torch.tensor([0.1, 0.9, 0.5, 0.7])
    assert as_set(LowConfidence().select(conf, 2)) == {1, 3}
    assert as_set(LowConfidence().select(conf, 9)) == {0, 1, 2, 3}


def test_threshold_is_inclusive_and_always_takes_the_best() -> None:
    conf = torch.tensor([0.95, 0.9, 0.3, 0.89])
    assert as_set(Threshold(0.9).select(conf, 1)) == {0, 1}
    assert as_set(Threshold(1.01).select(conf, 3)) == {0}  # tau > 1: one token per step
    assert as_set(Threshold(0.0).select(conf, 1)) == {0, 1, 2, 3}


@pytest.mark.parametrize("conf,factor,expected", [
    # sorted c = [.99, .9, .5]; n=2 needs c >= 1 - 1/3: .9 passes; n=3 needs >= .75: .5 fails at
    # the last index -> Fast-dLLM's quirk takes all three.
    ([0.5, 0.99, 0.9], 1.0, {0, 1, 2}),
    # c = [.99, .6, .5, .4]: n=2 fails (needs .667) -> index 1 -> one token.
    ([0.99, 0.6, 0.5, 0.4], 1.0, {0}),
    # c = [.99, .95, .9, .1]: n=2 (.667) ok, n=3 (.75) ok, n=4 (.8) fails at the last -> all four.
    ([0.99, 0.95, 0.9, 0.1], 1.0, {0, 1, 2, 3}),
    # c = [.99, .95, .7, .6, .5]: n=3 needs .75: fails at index 2 -> two tokens.
    ([0.99, 0.95, 0.7, 0.6, 0.5], 1.0, {0, 1}),
    # a larger factor is more permissive: n=3 needs 1 - 2/4 = .5 -> .7 ok; n=4 needs .6 -> ok;
    # n=5 needs 1 - 2/6 = .667 -> .5 fails at the last index -> all five.
    ([0.99, 0.95, 0.7, 0.6, 0.5], 2.0, {0, 1, 2, 3, 4}),
    ([0.2], 1.0, {0}),  # a single candidate is always taken
])
def test_factor_rule(conf: list[float], factor: float, expected: set[int]) -> None:
    assert as_set(Factor(factor).select(torch.tensor(conf), 1)) == expected


def test_dynamic_threshold() -> None:
    conf = torch.tensor([0.95, 0.2, 0.92, 0.1])
    assert as_set(DynamicThreshold(0.9).select(conf, 2)) == {0, 2}   # two above tau, k = 2
    assert as_set(DynamicThreshold(0.9).select(conf, 3)) == {0, 1, 2}  # too few above: top k
    assert as_set(DynamicThreshold(0.9).select(conf, 1)) == {0, 2}


# ---- units and cache strategies ---------------------------------------------------------


def test_units_bidirectional_and_block_causal() -> None:
    assert unit_spans(5, 21, 8, None) == [(5, 13), (13, 21)]
    assert unit_spans(5, 18, 8, None) == [(5, 13), (13, 18)]
    assert unit_spans(5, 18, None, None) == [(5, 18)]
    # Attention blocks of 8 at absolute multiples; sub-blocks of 4 from each block start.
    assert unit_spans(6, 24, 4, 8) == [(6, 8), (8, 12), (12, 16), (16, 20), (20, 24)]
    assert unit_spans(8, 14, 8, 8) == [(8, 14)]


def test_cache_strategies_pick_spans() -> None:
    frame = Frame(unit=(10, 14), horizon=20, exact_start=0, first_row=9)
    fresh = CacheState()
    assert NoCache().work(frame, fresh, 0) == Work((0, 20), (), store=False, refresh=True)
    for strategy in (PrefixCache(), DualCache(), ExactCache()):
        assert strategy.work(frame, fresh, 0).query == (0, 20)  # nothing stored yet: refresh
    warm = CacheState(since_refresh=1, refreshed_unit=0)
    assert PrefixCache().work(frame, warm, 0) == Work((9, 20), ((0, 9),), store=True)
    assert DualCache().work(frame, warm, 0) == Work((9, 14), ((0, 9), (14, 20)), store=True)
    assert DualCache().work(frame, warm, 1).refresh  # a new unit refreshes
    assert DualCache(refresh_every=1).work(frame, warm, 0).refresh
    assert not DualCache(refresh_every=2).work(frame, warm, 0).refresh


def test_exact_cache_on_a_block_causal_frame() -> None:
    # Unit (16, 20) in the attention block [16, 24); keys/values before 8 are exact.
    frame = Frame(unit=(16, 20), horizon=24, exact_start=16, first_row=15)
    state = CacheState(exact_upto=8)
    work = ExactCache().work(frame, state, 3)
    assert work == Work((8, 24), ((0, 8),), store=True, refresh=True)
    advance(state, work, frame, 3)
    assert state.exact_upto == 16  # the finished block [8, 16) was recomputed from final tokens
    assert ExactCache().work(frame, state, 3).query == (15, 24)  # the shifted row is recomputed


def test_prefill_chunks_whole_blocks() -> None:
    frame = Frame(unit=(40, 44), horizon=48, exact_start=40, first_row=39)
    state = CacheState()
    work = ExactCache().work(frame, state, 0)
    chunk = prefill_chunk(work, frame, state, budget=20, block_size=8)
    assert chunk == Work((0, 16), (), store=True, prefill_only=True)
    advance(state, chunk, frame, 0)
    assert state.exact_upto == 16 and state.since_refresh is None
    assert prefill_chunk(ExactCache().work(frame, state, 0), frame, state, budget=100, block_size=8) is None
