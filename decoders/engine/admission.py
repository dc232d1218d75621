"""How long a new request would wait for a place to run: the estimate admission refuses on.

Continuous batching runs up to ``max_num_seqs`` choices at once; a new choice starts at the
next step if a place is free and nobody queues ahead of it, and otherwise once enough running
choices have finished to make room for it and for every choice queued before it. Places free at
the rate running choices finish, which this module measures (Little's law): finished choices per
busy second of the engine, decayed over the last ``horizon`` busy seconds, so the estimate
follows the current mix of short and long generations without guessing from ``max_tokens``
(most requests stop long before it).

    wait(n) = max(0, queued + n - free places) / finish rate

Until ``min_busy`` busy seconds have been seen there is no rate and the estimate is 0: the
waiting-queue bound and the queue timeout (``EngineConfig.max_queue_wait``) still hold. A rate
of 0 after that (long generations running, none finished for a while) is an infinite wait.

The engine owns one estimator and updates it at the end of each step, under its lock; the
server reads ``estimate`` through ``Engine.estimated_wait`` from its own thread. Plain Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


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
        """Seconds until the last of ``n`` new choices starts, behind ``queued`` waiting ones."""
        short = queued + n - max(max_num_seqs - running, 0)
        if short <= 0:
            return 0.0
        rate = self.finish_rate
        if rate is None:
            return 0.0
        return math.inf if rate <= 0 else short / rate
