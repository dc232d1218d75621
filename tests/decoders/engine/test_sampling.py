"""Sampling rules on fixed logits: bias, penalties, temperature, top-k, top-p, min-p, seeds, logprobs.

Each rule is a pure function on tensors (``decoders/engine/sampling.py``), so each is checked here
against values worked out by hand, without a model.
"""

from __future__ import annotations

import math

import pytest
import torch

from dualserve.decoders.engine.sampling import (PenaltyState, SamplingParams, apply_logit_bias, apply_penalties,
                                         keyed_uniform, process_logits, sample_token, token_logprobs,
                                         truncated_probs)

# Probabilities 0.4, 0.3, 0.2, 0.1 at temperature 1.
PROBS = torch.tensor([0.4, 0.3, 0.2, 0.1])
LOGITS = PROBS.log()


def kept(probs: torch.Tensor) -> list[int]:
    return torch.nonzero(probs > 0).flatten().tolist()


def test_temperature_scales_logits():
    for t in (0.5, 1.0, 2.0):
        got = truncated_probs(LOGITS, SamplingParams(temperature=t))
        assert torch.allclose(got, torch.softmax(LOGITS / t, -1), atol=1e-6)


def test_greedy_is_argmax_whatever_the_uniform():
    params = SamplingParams(temperature=0.0)
    assert params.greedy
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert {sample_token(logits, params, keyed_uniform(s, 0)) for s in range(5)} == {1}


def test_top_k_keeps_the_k_best_and_renormalises():
    got = truncated_probs(LOGITS, SamplingParams(top_k=2))
    assert kept(got) == [0, 1]
    assert torch.allclose(got[:2], torch.tensor([0.4, 0.3]) / 0.7, atol=1e-6)
    assert torch.equal(truncated_probs(LOGITS, SamplingParams(top_k=10)) > 0, torch.ones(4, dtype=torch.bool))


def test_top_p_keeps_the_smallest_set_reaching_p():
    assert kept(truncated_probs(LOGITS, SamplingParams(top_p=0.7))) == [0, 1]      # 0.4 + 0.3 reaches 0.7
    assert kept(truncated_probs(LOGITS, SamplingParams(top_p=0.71))) == [0, 1, 2]
    assert kept(truncated_probs(LOGITS, SamplingParams(top_p=0.05))) == [0]       # the best always stays
    assert kept(truncated_probs(LOGITS, SamplingParams(top_p=1e-300))) == [0]     # 0 in float32: still stays
    got = truncated_probs(LOGITS, SamplingParams(top_p=0.9))
    assert torch.allclose(got[:3], torch.tensor([0.4, 0.3, 0.2]) / 0.9, atol=1e-6)


def test_top_p_applies_after_top_k():
    # Within the top 3 (renormalised to 4/9, 3/9, 2/9) a top_p of 0.8 needs all three.
    assert kept(truncated_probs(LOGITS, SamplingParams(top_k=3, top_p=0.8))) == [0, 1, 2]
    assert kept(truncated_probs(LOGITS, SamplingParams(top_k=3, top_p=0.7))) == [0, 1]


def test_min_p_is_relative_to_the_best_token():
    assert kept(truncated_probs(LOGITS, SamplingParams(min_p=0.45))) == [0, 1, 2]  # floor 0.18
    assert kept(truncated_probs(LOGITS, SamplingParams(min_p=0.7))) == [0, 1]      # floor 0.28
    # Temperature sharpens first: at t=0.5 the probabilities are 16:9:4:1, floor 0.5 * 16.
    assert kept(truncated_probs(LOGITS, SamplingParams(temperature=0.5, min_p=0.5))) == [0, 1]


def test_logit_bias_adds_and_can_ban_or_force():
    logits = torch.zeros(5)
    assert apply_logit_bias(logits.clone(), {1: 2.5, 3: -1.0}).tolist() == [0.0, 2.5, 0.0, -1.0, 0.0]
    params = SamplingParams(temperature=1.0, logit_bias={4: 100.0})
    assert {sample_token(process_logits(logits, [], [], params), params, keyed_uniform(0, t)) for t in range(20)} == {4}
    banned = SamplingParams(temperature=1.0, logit_bias={0: -100.0, 1: -100.0})
    draws = {sample_token(process_logits(logits, [], [], banned), banned, keyed_uniform(0, t)) for t in range(50)}
    assert draws <= {2, 3, 4}


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    logits = torch.zeros(5)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    # Token 1 appears twice in the output, token 2 once; token 3 only in the prompt.
    got = apply_penalties(logits.clone(), [3, 3], [1, 2, 1], params)
    assert got.tolist() == [0.0, -0.5 - 0.5, -0.5 - 0.25, 0.0, 0.0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([2.0, -2.0, 2.0, -2.0, 1.0])
    params = SamplingParams(repetition_penalty=2.0)
    got = apply_penalties(logits.clone(), [0, 1], [3], params)  # prompt and output both count
    assert got.tolist() == [1.0, -4.0, 2.0, -4.0, 1.0]


def test_penalty_state_updates_match_the_stateless_form():
    params = SamplingParams(presence_penalty=0.3, frequency_penalty=0.7, repetition_penalty=1.3)
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    prompt, output = [1, 5, 7, 7], [5, 9, 9, 9, 49]
    state = PenaltyState(prompt, output[:2], 50)
    state.add(output[2:])
    assert torch.allclose(state.apply(logits.clone(), params), apply_penalties(logits.clone(), prompt, output, params))
    via_state = process_logits(logits, [], [], params, penalties=state)
    assert torch.allclose(via_state, process_logits(logits, prompt, output, params))


def test_process_logits_leaves_its_input_alone():
    logits = torch.zeros(4)
    params = SamplingParams(logit_bias={0: 1.0}, presence_penalty=1.0)
    out = process_logits(logits, [], [2], params)
    assert logits.tolist() == [0.0] * 4 and out.tolist() == [1.0, 0.0, -1.0, 0.0]
    plain = SamplingParams()
    assert not plain.needs_processing and process_logits(logits, [], [2], plain) is logits


def test_seeded_sampling_is_reproducible_and_follows_the_distribution():
    params = SamplingParams(temperature=1.0)
    draws = [sample_token(LOGITS, params, keyed_uniform(123, 5)) for _ in range(3)]
    assert len(set(draws)) == 1
    seq_a = [sample_token(LOGITS, params, keyed_uniform(7, t)) for t in range(20)]
    assert seq_a == [sample_token(LOGITS, params, keyed_uniform(7, t)) for t in range(20)]
    assert seq_a != [sample_token(LOGITS, params, keyed_uniform(8, t)) for t in range(20)]
    counts = torch.bincount(torch.tensor([sample_token(LOGITS, params, keyed_uniform(0, t)) for t in range(4000)]),
                            minlength=4)
    freq = counts.float() / 4000
    assert torch.allclose(freq, PROBS, atol=0.03), freq


def test_sampling_never_picks_a_truncated_token():
    params = SamplingParams(temperature=1.5, top_k=2)
    edges = [0.0, 1 - 2**-24]  # the smallest and largest keyed uniforms
    assert {sample_token(LOGITS, params, u) for u in edges + [keyed_uniform(3, t) for t in range(300)]} == {0, 1}
    masked = torch.tensor([float("-inf"), 0.0, float("-inf"), 0.0])  # a grammar mask
    draws = {sample_token(masked, SamplingParams(), u) for u in edges + [keyed_uniform(3, t) for t in range(100)]}
    assert draws == {1, 3}


def test_token_logprobs_are_the_raw_log_softmax():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5], [0.0, 0.0, 0.0, 0.0]])
    out = token_logprobs(logits, [1, 3], top_n=2)
    ref = torch.log_softmax(logits, -1)
    assert [o.token_id for o in out] == [1, 3]
    assert out[0].logprob == pytest.approx(ref[0, 1].item(), abs=1e-6)
    assert out[1].logprob == pytest.approx(math.log(0.25), abs=1e-6)
    assert [t for t, _ in out[0].top] == [2, 1]
    assert out[0].top[0][1] == pytest.approx(ref[0, 2].item(), abs=1e-6)
    assert token_logprobs(logits, [0, 0], top_n=0)[0].top == []


# ---- robustness (issue 15: a request's own values never break sampling) -------------------

def test_penalty_state_built_in_inference_mode_is_updated_outside_it():
    """Diffusion builds the state inside its inference-mode step and commit updates it outside."""
    with torch.inference_mode():
        state = PenaltyState([1, 2], [3], 10)
        state.apply(torch.zeros(10), SamplingParams(presence_penalty=0.5))
    state.add([4, 4])
    assert state.counts[4] == 2 and state.counts[3] == 1
    with torch.inference_mode():
        state.add([5])
    assert state.counts[5] == 1


@pytest.mark.parametrize("penalty", [1e-300, 1e-30, 1e30, 1e300])
def test_extreme_repetition_penalty_keeps_logits_finite_and_sampling_defined(penalty):
    params = SamplingParams(temperature=0.7, repetition_penalty=penalty)
    logits = torch.tensor([2.0, -1.0, 0.5, float("-inf")])
    out = apply_penalties(logits.clone(), [0, 1, 3], [], params)
    assert torch.isfinite(out[:3]).all() and out[3] == float("-inf")  # a masked token stays masked
    probs = truncated_probs(out, params)
    assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1) < 1e-5 and probs[3] == 0
    assert sample_token(out, params, keyed_uniform(0, 0)) in (0, 1, 2)


def test_infinite_logits_share_the_mass_and_nan_is_never_sampled():
    logits = torch.tensor([float("inf"), 1.0, float("inf"), float("nan")])
    probs = truncated_probs(logits, SamplingParams(temperature=1e-3))
    assert torch.allclose(probs, torch.tensor([0.5, 0.0, 0.5, 0.0]))
    assert sample_token(torch.tensor([float("nan"), 1.0, 2.0]), SamplingParams(temperature=0.0), None) == 2
    huge = torch.tensor([3e38, 1e38, 0.0])
    assert torch.isfinite(truncated_probs(huge, SamplingParams(temperature=1e-5))).all()
