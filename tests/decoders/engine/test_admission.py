"""The wait estimate admission refuses on (``admission.py``), in plain Python: places free at the
measured finish rate, nothing is estimated before a second of busy time, and a rate of 0 is an
infinite wait."""

from __future__ import annotations

import math

from dualserve.decoders.engine.admission import WaitEstimator


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
