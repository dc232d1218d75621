"""The thread tuner keeps whichever thread count its timed steps found faster, and rechecks."""

from __future__ import annotations

import pytest

from dualserve.decoders.engine import threads as threads_mod
from dualserve.decoders.engine.threads import ThreadTuner


@pytest.mark.parametrize("busy", [False, True], ids=["quiet", "beside-a-busy-neighbour"])
def test_tuner_picks_the_faster_count_and_rechecks(monkeypatch, busy: bool) -> None:
    current = {"n": 0}
    clock = {"t": 0.0}

    def set_threads(n: int) -> None:
        current["n"] = n

    monkeypatch.setattr(threads_mod.torch, "get_num_threads", lambda: current["n"])
    monkeypatch.setattr(threads_mod.time, "perf_counter", lambda: clock["t"])
    tuner = ThreadTuner(max_threads=2, period=20, trial_steps=3, set_threads=set_threads)
    used = []
    for step in range(60):
        tuner.before_step()
        used.append(current["n"])
        # a quiet machine: 2 threads take 10 ms a token, 1 thread 15; beside a busy process 2 threads collapse
        clock["t"] += (0.050 if busy else 0.010) if current["n"] == 2 else 0.015
        tuner.after_step(tokens=1)
    want = 1 if busy else 2
    assert used[:6] == [2, 2, 2, 1, 1, 1], "a trial times each candidate"
    assert set(used[6:20]) == {want} and tuner.threads == want
    assert used[20:26] == [2, 2, 2, 1, 1, 1], "the next period tries again"


def test_one_core_has_nothing_to_tune() -> None:
    seen = []
    tuner = ThreadTuner(max_threads=1, set_threads=seen.append)
    for _ in range(10):
        tuner.before_step()
        tuner.after_step(tokens=4)
    assert tuner.threads == 1 and tuner.candidates == [1]
