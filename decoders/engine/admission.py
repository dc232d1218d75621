"""Admission, bounded in time: how long a new request would wait for a place, and whether
starting it keeps every running choice within the time it was promised.

**Waiting** (``WaitEstimator``). Continuous batching runs up to ``capacity`` choices at once
(``max_num_seqs``, or fewer while the run bound below holds choices back); a new choice starts
at the next step if a place is free and nobody queues ahead of it, and otherwise once enough
running choices have finished to make room for it and for every choice queued before it. Places
free at the rate running choices finish, which is measured (Little's law): finished choices per
busy second of the engine, decayed over the last ``horizon`` busy seconds, so the estimate
follows the current mix of short and long generations without guessing from ``max_tokens``
(most requests stop long before it).

    wait(n) = max(0, queued + n - free places) / finish rate

Until ``min_busy`` busy seconds have been seen there is no rate and the estimate is 0: the
waiting-queue bound and the queue timeout (``EngineConfig.max_queue_wait``) still hold. A rate
of 0 after that (long generations running, none finished for a while) is an infinite wait.

**Running** (``RunEstimator``). Bounding the wait is not enough: on a small CPU, 64 choices
running together each get a couple of tokens a second, and a 64-token request admitted at once
can take minutes. So each admitted choice is *promised* a finish time,

    promise = max(max_run_time, max_tokens / min_token_rate)   seconds after it starts,

(a short request finishes within ``max_run_time``; a long one is never slowed, on average,
below ``min_token_rate`` tokens/s), and a waiting choice starts only while the estimated finish
of every running choice, and its own, stays within its promise. Otherwise it waits, and the
wait bound turns a too-long wait into a 429. A choice that cannot finish in time even alone
(the host slowed down under it, or a prompt too long for the promise) is held to the floor
instead: it starts, or lets others start, only while its tokens/s in the batch stay at or above
``min_token_rate``. Estimated finishes assume the batch shares each
step (processor sharing, ``finish_times``): a choice needs ``steps`` more steps (prompt left to
prefill over the step's token budget, plus tokens left, ``max_tokens`` less those made, over
its decoder's measured tokens per step), and a step of a given batch costs the measured time
(``Fit``: per decoder, seconds of its part of a step against its running choices, linear,
decayed least squares; plus the engine's own overhead). On a host fast enough that the
promise is never at risk (a GPU) every check passes and admission is exactly ``max_num_seqs``
places. A decoder not measured yet starts slowly: one choice runs until its first decoding step
has been timed (a step or two), and while the batch size has barely varied the fit assumes cost
grows in proportion to it, so a burst on a cold server grows the batch over a few steps instead
of starting ``max_num_seqs`` choices at once on a host that cannot carry them.

The engine owns one of each, updated at the end of each step on its own thread; the server
reads ``WaitEstimator.estimate`` through ``Engine.estimated_wait`` (under the engine's lock).
Plain Python.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable

Key = tuple[str, str]  # (model, decoder): one measured cost and token rate each


@dataclass
class WaitEstimator:
    horizon: float = 30.0   # busy seconds over which the finish rate is averaged (exponential decay)
    min_busy: float = 1.0   # busy seconds measured before the rate is trusted
    busy: float = 0.0       # decayed busy seconds
    finished: float = 0.0   # decayed count of running choices that finished (each freed a place)

    def observe(self, seconds: float, finished: int) -> None:
        """One engine step: it ran ``seconds`` and ``finished`` running choices ended in it."""
        keep = math.exp(-seconds / self.horizon)
        self.busy = self.busy * keep + seconds
        self.finished = self.finished * keep + finished

    @property
    def finish_rate(self) -> float | None:
        """Running choices finished per busy second, or None before ``min_busy`` seconds."""
        if self.busy < self.min_busy:
            return None
        return self.finished / self.busy

    def estimate(self, queued: int, running: int, max_num_seqs: int, n: int = 1) -> float:
        """Seconds until the last of ``n`` new choices starts, behind ``queued`` waiting ones
        (``max_num_seqs``: the places the engine currently lets run)."""
        short = queued + n - max(max_num_seqs - running, 0)
        if short <= 0:
            return 0.0
        rate = self.finish_rate
        if rate is None:
            return 0.0
        return math.inf if rate <= 0 else short / rate


# ---- the run bound: pure parts ---------------------------------------------------------

@dataclass(frozen=True)
class Member:
    """One choice of the batch as the run bound sees it."""

    key: Key
    steps: float | None  # engine steps it still needs (None: its decoder is not measured yet)
    deadline: float      # seconds from now by which it was promised to finish


def finish_times(members: list[Member], step_seconds: Callable[[Counter], float]) -> list[float]:
    """Seconds from now until each member finishes, if every member advances one step per engine
    step and each step costs ``step_seconds(batch)`` for the batch still running (by key): the
    batch shrinks as members finish, so the member with the k-th fewest steps finishes after
    sum over j <= k of (steps_j - steps_{j-1}) * step_seconds(batch_j)."""
    batch = Counter(m.key for m in members)
    out = [0.0] * len(members)
    now = done = 0.0
    for i in sorted(range(len(members)), key=lambda i: members[i].steps):
        now += (members[i].steps - done) * step_seconds(batch)
        done = members[i].steps
        out[i] = now
        batch[members[i].key] -= 1
    return out


def promise(max_run_time: float, min_token_rate: float, tokens: int) -> float:
    """Seconds a choice asking for ``tokens`` is promised, from its start."""
    return max(max_run_time, tokens / min_token_rate)


class Fit:
    """Seconds of one decoder's part of a step against its running choices: t(b) = a + slope * b,
    by least squares over decayed samples. Flat on a GPU (slope ~ 0), about linear on a CPU.
    While the batch size has barely varied, a proportional t(b) = b * mean(t) / mean(b) (no
    fixed cost: the cautious guess for a larger batch)."""

    def __init__(self) -> None:
        self.w = self.x = self.xx = self.y = self.xy = 0.0

    def observe(self, b: int, seconds: float, keep: float) -> None:
        self.w = self.w * keep + 1
        self.x = self.x * keep + b
        self.xx = self.xx * keep + b * b
        self.y = self.y * keep + seconds
        self.xy = self.xy * keep + b * seconds

    def seconds(self, b: int) -> float:
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        if var >= 0.25:
            slope = max(0.0, (self.xy / self.w - mx * my) / var)
            if my - slope * mx >= 0:
                return my + slope * (b - mx)
        return b * my / max(mx, 1e-9)


# ---- the run bound: measured -----------------------------------------------------------

@dataclass
class StepSample:
    """What one engine step did, gathered by the engine for ``RunEstimator.observe``."""

    batch: Counter                                                  # running choices by key
    seconds: dict[Key, float] = field(default_factory=dict)       # each key's part of the step
    tokens: Counter = field(default_factory=Counter)              # tokens committed by decoding choices
    decoding: Counter = field(default_factory=Counter)            # choices past their prompt


class RunEstimator:
    """The run bound: measures step costs and token rates, and says whether a choice may start.

    ``max_run_time``, ``min_token_rate``: the promise (module docstring). ``max_batched_tokens``:
    the step's token budget, over which a prompt is prefilled. ``horizon``: busy seconds the
    measurements are averaged over, shorter than a promise so that a host slowed by other work
    is seen while the choices it slows still run (on a shared 2-core host under a closed loop of
    24 clients, choices overran their promise by at most 1.6 s with 10 s; with 30 s, by up to
    10 s in one run)."""

    def __init__(self, max_run_time: float, min_token_rate: float, max_batched_tokens: int,
                 horizon: float = 10.0):
        self.max_run_time = max_run_time
        self.min_token_rate = min_token_rate
        self.max_batched_tokens = max_batched_tokens
        self.horizon = horizon
        self.outside = self.steps = 0.0                   # decayed step time outside decoders, steps
        self.fits: dict[Key, Fit] = {}
        self.rates: dict[Key, list[float]] = {}           # key -> [decayed tokens, decayed choice-steps]

    def observe(self, sample: StepSample, seconds: float) -> None:
        """One engine step of ``seconds``, doing ``sample``."""
        keep = math.exp(-seconds / self.horizon)
        self.outside = self.outside * keep + max(0.0, seconds - sum(sample.seconds.values()))
        self.steps = self.steps * keep + 1
        for key, b in sample.batch.items():
            if b > 0:
                self.fits.setdefault(key, Fit()).observe(b, sample.seconds.get(key, 0.0), keep)
        for key, steps in sample.decoding.items():
            rate = self.rates.setdefault(key, [0.0, 0.0])
            rate[0] = rate[0] * keep + sample.tokens[key]
            rate[1] = rate[1] * keep + steps

    def step_seconds(self, batch: Counter) -> float:
        """Measured seconds of one engine step running ``batch`` (choices by key)."""
        overhead = self.outside / self.steps if self.steps else 0.0  # scheduling, inbox, sinks
        return overhead + sum(self.fits[k].seconds(b) for k, b in batch.items() if b > 0)

    def tokens_per_step(self, key: Key) -> float | None:
        """A decoding choice's committed tokens per engine step (None: not measured yet)."""
        rate = self.rates.get(key)
        if rate is None or rate[1] < 1 or rate[0] <= 0 or key not in self.fits:
            return None
        return rate[0] / rate[1]

    def promise(self, tokens: int) -> float:
        return promise(self.max_run_time, self.min_token_rate, tokens)

    def member(self, key: Key, prompt_left: int, tokens_left: int, deadline: float) -> Member:
        """The bound's view of one choice."""
        per_step = self.tokens_per_step(key)
        if per_step is None:
            return Member(key, None, deadline)
        steps = prompt_left / self.max_batched_tokens + max(tokens_left, 0) / per_step
        return Member(key, steps, deadline)

    def admits(self, candidate: Member, running: Iterable[Member]) -> bool:
        """Whether ``candidate`` may start beside ``running``: every estimated finish, its own
        included, within its deadline. An empty batch has nothing to protect: it may. A candidate
        whose decoder is not measured may start only as the first of its decoder (slow start);
        running members not measured yet are left out of the estimate for the step or two until
        they are."""
        running = list(running)
        if not running:
            return True
        if candidate.steps is None:
            return all(m.key != candidate.key for m in running)
        members = [m for m in running if m.steps is not None] + [candidate]
        batch = Counter(m.key for m in members)
        done = finish_times(members, self.step_seconds)
        return all(self._keeps(m, f, batch) for f, m in zip(done, members))

    def _keeps(self, m: Member, finish: float, batch: Counter) -> bool:
        """Whether ``m``'s promise holds, finishing at ``finish`` in ``batch``. One that could not
        finish in time even alone (the host slowed down under it, or its prompt is too long for the
        promise) keeps the token-rate floor instead: vetoing every newcomer would stall admission
        for its whole run and still not bring it in time."""
        if finish <= m.deadline:
            return True
        if m.steps * self.step_seconds(Counter({m.key: 1})) <= m.deadline:
            return False  # in time alone: late only beside the others, so nobody more starts
        return self.tokens_per_step(m.key) / self.step_seconds(batch) >= self.min_token_rate
