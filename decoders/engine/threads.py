"""How many CPU threads the engine's steps use, chosen by timing real steps on this machine.

On a shared machine the best thread count changes while the server runs. With
every core in use, a CPU-bound neighbour deschedules one of our threads and
each parallel region waits for it: on 2 cores, decoding fell from 85 to 19
tok/s beside one busy process, where one thread kept 59-63 tok/s alone and
beside it. Passive OpenMP waiting avoids the collapse but halves the speed of a
quiet machine (42 tok/s), because every parallel region then pays a wake-up.

So the engine keeps OpenMP's default waiting and lets ``ThreadTuner`` pick the
count: every ``period`` steps it times a few steps at each candidate count (all
cores, and one fewer, down to one) and keeps the faster for the next period.
Steps are compared per token they compute, so a prefill step and a decode step
weigh alike. A quiet machine settles on all cores; a busy one on fewer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class ThreadTuner:
    max_threads: int
    period: int = 128                  # steps between two trials
    trial_steps: int = 6               # steps timed per candidate in a trial
    set_threads: Callable[[int], None] = torch.set_num_threads
    threads: int = 0                   # in use now
    _step: int = 0
    _trial: dict[int, list[float]] = field(default_factory=dict)
    _started: float = 0.0

    def __post_init__(self) -> None:
        self.threads = self.max_threads
        self.set_threads(self.threads)

    @property
    def candidates(self) -> list[int]:
        return sorted({self.max_threads, max(1, self.max_threads - 1)}, reverse=True)

    def _in_trial(self) -> int | None:
        """The count this step tries, or None outside a trial."""
        offset = self._step % self.period
        cands = self.candidates
        if len(cands) < 2 or offset >= self.trial_steps * len(cands):
            return None
        return cands[offset // self.trial_steps]

    def before_step(self) -> None:
        trying = self._in_trial()
        want = trying if trying is not None else self.threads
        if want != torch.get_num_threads():
            self.set_threads(want)
        self._started = time.perf_counter()

    def after_step(self, tokens: int) -> None:
        """Record the step just run (``tokens`` it computed); end a trial when it is complete."""
        trying = self._in_trial()
        if trying is not None and tokens > 0:
            self._trial.setdefault(trying, []).append((time.perf_counter() - self._started) / tokens)
        self._step += 1
        if trying is not None and self._in_trial() is None:
            self._decide()

    def _decide(self) -> None:
        medians = {n: sorted(t)[len(t) // 2] for n, t in self._trial.items() if t}
        if medians:
            self.threads = min(medians, key=medians.get)
        self._trial.clear()
        if self.threads != torch.get_num_threads():
            self.set_threads(self.threads)
