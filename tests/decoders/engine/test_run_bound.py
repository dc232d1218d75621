"""The run bound through the engine (``admission.RunEstimator``), on a tiny random model.

A choice starts only while every running choice, and itself, is estimated to finish within its
promise. Most tests give the engine a modelled host (``Modelled``: each step costs a fixed time
per running choice, one token per step), so what starts is decided by the rule and not by this
machine's speed; the engine still runs the real model and real time passes for the deadlines.

* On a slow modelled host the engine starts only as many as finish in time, and at every step
  each running choice's estimated finish is within its promise; every request completes.
* A choice held back waits under the queue timeout: it ends as overloaded (the server's 429),
  and the wait estimate counts only the places the bound lets run.
* Measured from the engine's own steps, on a host fast enough for the promise, every request
  starts at once, as without the bound (after a cold start, which runs one choice until its
  decoder is measured).
"""

from __future__ import annotations

import time
from collections import Counter

import pytest

from dualserve.decoders.ar import ARDecoder
from dualserve.decoders.engine.admission import RunEstimator, WaitEstimator, finish_times
from dualserve.decoders.engine.engine import Engine, EngineConfig
from dualserve.decoders.engine.request import Delta, FailureKind
from dualserve.decoders.engine.runner import ModelRunner
from dualserve.decoders.engine.sampling import SamplingParams
from dualserve.models.transformer import Transformer
from test_fairness import VOCAB, Tok, model  # noqa: F401 - the tiny model fixture

pytestmark = pytest.mark.usefixtures("one_thread")

BUDGET = 256
KEY = ("m", "ar")


class Modelled(RunEstimator):
    """A host whose every step costs ``per_choice`` seconds per running choice, one token a step."""

    def __init__(self, per_choice: float, max_run_time: float = 20.0, min_token_rate: float = 4.0):
        super().__init__(max_run_time, min_token_rate, BUDGET)
        self.per_choice = per_choice

    def observe(self, sample, seconds: float) -> None:
        pass

    def step_seconds(self, batch: Counter) -> float:
        return self.per_choice * sum(batch.values())

    def tokens_per_step(self, key) -> float:
        return 1.0


def make_engine(model: Transformer, **config) -> Engine:
    engine = Engine(EngineConfig(num_blocks=512, block_size=4, max_batched_tokens=BUDGET, max_num_seqs=8, **config))
    engine.add_decoder("m", ARDecoder(ModelRunner(model, 512, 4, use_flash=False), engine.pool), Tok(), VOCAB)
    return engine


def submit(engine: Engine, n: int, max_tokens: int) -> list[list[Delta]]:
    outs: list[list[Delta]] = [[] for _ in range(n)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(n):
        engine.submit("m", "ar", [3 + i, 5, 7, 9], params, lambda _, d, out=outs[i]: out.append(d))
    return outs


def within_promise(engine: Engine) -> bool:
    """Every running choice's estimated finish, under the engine's run bound, is within its promise."""
    now = time.monotonic()
    members = [engine._member(r, now) for r in engine.scheduler.running]
    return all(f <= m.deadline for f, m in zip(finish_times(members, engine.run_bound.step_seconds), members))


def test_a_slow_host_starts_only_what_finishes_in_time(model) -> None:
    engine = make_engine(model, max_run_time=20.0)
    engine.run_bound = Modelled(per_choice=0.095)  # 80 tokens: 7.6 s alone, 15.2 s beside one, 22.8 beside two
    outs = submit(engine, 6, max_tokens=80)  # promised 20 s each
    engine.step()
    assert len(engine.scheduler.running) == 2 and engine.capacity() == 2  # --max-num-seqs 8 alone: all 6
    while engine.has_work():  # more start as the running ones near their end, each only when in time
        engine.step()
        assert within_promise(engine)
    assert all(out[-1].finish_reason == "length" and sum(len(d.token_ids) for d in out) == 80 for out in outs)
    assert engine.pool.num_used_blocks == 0


def test_a_choice_held_back_times_out_as_overloaded(model) -> None:
    engine = make_engine(model, max_run_time=20.0, max_queue_wait=0.2)
    engine.run_bound = Modelled(per_choice=10.0)  # nothing but a lone choice is ever in time
    engine.door.admission = WaitEstimator(min_busy=0.0)
    engine.door.admission.observe(1.0, 1)  # one place frees a second
    outs = submit(engine, 3, max_tokens=50)
    engine.step()
    assert len(engine.scheduler.running) == 1 and engine.capacity() == 1
    # 2 queued, no free place the bound allows: the third choice to come starts after 3 finishes.
    assert engine.estimated_wait() == pytest.approx(3 / engine.door.admission.finish_rate)
    time.sleep(0.25)
    engine.run_until_idle()
    assert outs[0][-1].finish_reason == "length"
    for out in outs[1:]:
        assert out[-1].finish_reason == "error" and out[-1].failure is FailureKind.OVERLOADED
        assert not any(d.token_ids for d in out)
    assert engine.pool.num_used_blocks == 0 and engine.num_queued() == 0


def test_a_fast_host_measured_from_the_steps_starts_everything_at_once(model) -> None:
    engine = make_engine(model, max_run_time=20.0)
    engine.run_bound = RunEstimator(1000.0, 4.0, BUDGET)  # measured: this host, a generous promise
    submit(engine, 3, max_tokens=20)
    engine.step()
    assert len(engine.scheduler.running) == 1  # slow start: one choice until its decoder is measured
    engine.run_until_idle()
    assert engine.run_bound.tokens_per_step(KEY) == pytest.approx(1.0, abs=0.1)
    assert 0 < engine.run_bound.step_seconds(Counter({KEY: 6})) < 5
    submit(engine, 6, max_tokens=20)
    engine.step()
    assert len(engine.scheduler.running) == 6 and engine.capacity() == 8
    engine.run_until_idle()
