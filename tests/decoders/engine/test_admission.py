"""Admission bounded in time (``admission.py``), in plain Python.

* The wait estimate: places free at the measured finish rate, nothing is estimated before a
  second of busy time, and a rate of 0 is an infinite wait.
* The run bound: finish times under a shared batch, the step cost fit (linear on a CPU, flat on
  a GPU), and the admission rule: a choice starts only while every running choice, and itself,
  is estimated to finish within its promise; so a slow host runs fewer at once, a fast one
  exactly as many as before, and a running choice is never slowed past its promise.
"""

from __future__ import annotations

import math
from collections import Counter

from dualserve.decoders.engine.admission import (Fit, Member, RunEstimator, StepSample, WaitEstimator,
                                                 finish_times, promise)

AR, EAGLE = ("m", "ar"), ("m", "eagle")


def test_a_free_place_means_no_wait() -> None:
    est = WaitEstimator()
    est.observe(5.0, 0)  # five busy seconds, nothing finished
    assert est.estimate(queued=0, running=3, max_num_seqs=4) == 0.0
    assert est.estimate(queued=2, running=1, max_num_seqs=4, n=1) == 0.0  # 3 places for 3 choices


def test_places_free_at_the_measured_finish_rate() -> None:
    est = WaitEstimator()
    for _ in range(10):
        est.observe(0.5, 1)  # two choices finish per busy second
    assert math.isclose(est.finish_rate, 2.0)
    # 4 running of 4, 5 queued: this choice is the 6th to need a place -> 3 s.
    assert math.isclose(est.estimate(queued=5, running=4, max_num_seqs=4), 3.0)
    assert math.isclose(est.estimate(queued=5, running=4, max_num_seqs=4, n=3), 4.0)


def test_no_estimate_before_min_busy_then_infinite_without_finishes() -> None:
    est = WaitEstimator(min_busy=1.0)
    est.observe(0.4, 0)
    assert est.finish_rate is None and est.estimate(queued=9, running=4, max_num_seqs=4) == 0.0
    est.observe(0.8, 0)
    assert est.estimate(queued=0, running=4, max_num_seqs=4) == math.inf


def test_old_steps_fade() -> None:
    est = WaitEstimator(horizon=10.0)
    est.observe(10.0, 100)   # a burst of short requests...
    for _ in range(60):
        est.observe(1.0, 0)  # ...then a minute of long generations, none finished
    assert est.finish_rate < 0.2


# ---- the run bound -----------------------------------------------------------------------

def measured(cost, tokens_per_step: float = 1.0, key=AR, sizes=range(1, 9), **bound) -> RunEstimator:
    """A run bound that has seen ``key``'s part of a step cost ``cost(b)`` for b running choices."""
    est = RunEstimator(**{"max_run_time": 20.0, "min_token_rate": 4.0, "max_batched_tokens": 512, **bound})
    for _ in range(20):
        for b in sizes:
            sample = StepSample(Counter({key: b}), {key: cost(b)}, Counter({key: round(tokens_per_step * b)}),
                                Counter({key: b}))
            est.observe(sample, cost(b))
    return est


def member(est: RunEstimator, tokens: int, deadline: float | None = None, prompt: int = 0, key=AR) -> Member:
    return est.member(key, prompt, tokens, est.promise(tokens) if deadline is None else deadline)


def test_a_shared_batch_finishes_its_shortest_first() -> None:
    def cost(batch: Counter) -> float:
        return 0.1 * sum(batch.values())

    # Both run at 0.2 s a step for 10 steps; then the longer alone at 0.1 s for 10 more.
    assert finish_times([Member(AR, 10, 0), Member(AR, 20, 0)], cost) == [2.0, 3.0]
    assert finish_times([], cost) == []


def test_the_promise_is_the_run_bound_or_the_token_rate_floor() -> None:
    assert promise(20.0, 4.0, 64) == 20.0       # a short request: within max_run_time
    assert promise(20.0, 4.0, 4096) == 1024.0   # a long one: never below 4 tokens/s on average


def test_step_cost_fit_is_linear_on_a_cpu_flat_on_a_gpu_and_cautious_without_spread() -> None:
    cpu, gpu, fixed = Fit(), Fit(), Fit()
    for b in range(1, 17):
        cpu.observe(b, 0.01 + 0.02 * b, keep=0.99)
        gpu.observe(b, 0.015, keep=0.99)
        fixed.observe(4, 0.08, keep=0.99)
    assert math.isclose(cpu.seconds(64), 0.01 + 0.02 * 64, rel_tol=1e-6)
    assert math.isclose(gpu.seconds(64), 0.015, rel_tol=1e-6)
    assert math.isclose(fixed.seconds(8), 0.16)  # one batch size seen: proportional


def test_tokens_per_step_and_step_cost_are_measured() -> None:
    est = measured(lambda b: 0.01 * b, tokens_per_step=2.0, key=EAGLE)
    assert math.isclose(est.tokens_per_step(EAGLE), 2.0)
    assert est.tokens_per_step(AR) is None
    assert math.isclose(est.step_seconds(Counter({EAGLE: 10})), 0.1, rel_tol=1e-6)
    assert math.isclose(member(est, tokens=100, prompt=1024, key=EAGLE).steps, 2 + 50)  # prefill, then decode


def test_a_slow_host_runs_fewer_at_once() -> None:
    est = measured(lambda b: 0.095 * b)  # a 100-token choice takes 9.5 s alone, 19 s beside one other
    running = [member(est, 100)]
    assert est.admits(member(est, 100), running)
    running.append(member(est, 100))
    assert not est.admits(member(est, 100), running)  # 3 x 0.095 x 100 = 28.5 s > 20 s
    assert est.admits(member(est, 4), running)         # a short one slows the others by 4 steps only


def test_a_fast_host_admits_as_before() -> None:
    est = measured(lambda b: 0.015)  # GPU-like: a step costs the same at any batch size
    running: list[Member] = []
    for _ in range(64):
        assert est.admits(member(est, 1000), running)
        running.append(member(est, 1000))
    assert est.admits(member(est, 4096), running)


def test_a_fast_host_seen_at_one_batch_size_grows_the_batch_over_steps() -> None:
    est = measured(lambda b: 0.015, sizes=[1])  # cost assumed to grow with the batch: 1.5 s per 100 tokens
    running: list[Member] = []
    while est.admits(member(est, 100), running):
        running.append(member(est, 100))
    assert len(running) == 16  # promised 25 s (100 tokens at 4 tokens/s): 16 x 0.015 x 100 = 24 s
    est = measured(lambda b: 0.015, sizes=[1, 13])  # then seen flat: the next step takes the rest
    assert est.admits(member(est, 100), [member(est, 100)] * 63)


def test_long_choices_keep_the_token_rate_floor() -> None:
    est = measured(lambda b: 0.045 * b)  # per-choice rate 1 / (0.045 b): 4.4 tokens/s at 5, 3.7 at 6
    running = [member(est, 4000) for _ in range(5)]
    assert est.admits(member(est, 4000), running[:4])
    assert not est.admits(member(est, 4000), running)


def test_a_newcomer_never_pushes_a_running_choice_past_its_promise() -> None:
    est = measured(lambda b: 0.1 * b)
    late = [member(est, 50, deadline=6.0)]  # started earlier: 6 s left of its promise, needs 5 s alone
    assert est.admits(member(est, 1), late)         # 0.2 + 4.9 = 5.1 s
    assert not est.admits(member(est, 20), late)    # 20 x 0.2 + 30 x 0.1 = 7 s, though it would itself fit


def test_a_choice_that_cannot_be_in_time_even_alone_keeps_the_floor() -> None:
    est = measured(lambda b: 0.1 * b)  # 10 tokens/s alone, 5 in a batch of 2, 3.3 in a batch of 3
    hopeless = [member(est, 100, deadline=5.0)]  # needs 10 s alone: late whatever happens
    assert est.admits(member(est, 1), hopeless)            # 5 tokens/s: at or above the floor of 4
    assert not est.admits(member(est, 1), hopeless * 2)    # 3.3 tokens/s: below it
    # A slow host where nothing is in time even alone: one at a time.
    slow = measured(lambda b: 10.0 * b)
    assert not slow.admits(member(slow, 50), [member(slow, 50, deadline=20.0)])


def test_an_empty_batch_admits_and_an_unmeasured_decoder_starts_slowly() -> None:
    est = measured(lambda b: 10.0 * b)
    assert est.admits(member(est, 100), [])  # an empty batch: the best a request can get
    cold = RunEstimator(20.0, 4.0, 512)
    first = cold.member(AR, 0, 100, 20.0)
    assert first.steps is None
    assert cold.admits(first, [])
    assert not cold.admits(cold.member(AR, 0, 100, 20.0), [first])  # until its decoder is measured
    eagle = est.member(EAGLE, 0, 100, 20.0)
    assert est.admits(eagle, [member(est, 10)])       # the first eagle choice beside measured ar
    assert not est.admits(est.member(EAGLE, 0, 100, 20.0), [member(est, 10), eagle])
    # a measured candidate beside an unmeasured one: the estimate covers what is measured
    assert est.admits(member(est, 1, deadline=100.0), [eagle])
