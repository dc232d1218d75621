"""OpenMP waiting on a CPU host: spin while the cores are ours, back off while a neighbour is busy.

PyTorch's CPU kernels run in GNU OpenMP (libgomp) teams. A decode step opens hundreds of
short parallel regions, and between them a worker spins (``GOMP_SPINCOUNT``, a few ms by
default) before it sleeps on a futex. Spinning is what makes a step fast on idle cores. It is
also what makes it collapse when another process holds a core: the team's barrier then waits
for a worker that the kernel has descheduled. Measured on a 2-core host (AVX-512, no AMX), the
default model in int4, eager, 2 threads, on the engine's thread, 3 x 64 tokens:

  =====================  ===========  ==================
  waiting                cores idle   one busy neighbour
  =====================  ===========  ==================
  spinning (default)     55-60 tok/s  3-12 tok/s
  throttled (~100 spins) 36 tok/s     28-38 tok/s
  passive (no spin)      35 tok/s     18-24 tok/s
  =====================  ===========  ==================

libgomp switches every team to its short "throttled" spin while it manages more OpenMP threads
than the machine has CPUs (GCC manual, ``GOMP_SPINCOUNT``), and a thread that has run a
parallel region keeps its worker pool until it exits. So:

- torch work outside the engine (loading, measuring formats, calibrating, compiling) runs on
  threads that exit afterwards (``run_on_own_thread``, the compile worker), and the engine's
  thread holds the one long-lived pool: its teams spin;
- ``SpinGovernor`` watches how much CPU other processes use (``/proc/stat`` minus this
  process) and, while they leave fewer free cores than torch has threads, parks one extra
  thread that owns a pool. That throttles spinning in every team; the thread exits (and
  spinning resumes) once the neighbour has gone.

Only Linux hosts running torch's OpenMP backend are governed; elsewhere this is a no-op.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable, TypeVar

import torch

from dualserve.models.host import machine_busy_ticks, own_ticks

log = logging.getLogger("dualserve.openmp")

T = TypeVar("T")


def run_on_own_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    """Call ``fn`` on a new thread and wait: its OpenMP pool ends with the thread, so the
    caller's thread never owns one (see the module docstring). Exceptions propagate."""
    result: dict[str, object] = {}

    def body() -> None:
        try:
            result["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            result["error"] = e

    thread = threading.Thread(target=body, name="dualserve-setup")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    return result["value"]  # type: ignore[return-value]


def governed() -> bool:
    """Whether this host's torch runs GNU OpenMP teams that a governor can throttle."""
    return (os.path.exists("/proc/stat") and torch.get_num_threads() > 1
            and "OpenMP" in torch.__config__.parallel_info())


class SpinGovernor:
    """Throttles OpenMP spinning while other processes keep the cores busy (module docstring).

    A daemon thread samples every ``interval`` seconds. ``neighbour_load`` is the number of
    cores other processes used, averaged over about ``smoothing`` seconds (an exponential
    average of the samples). Throttling starts when the cores left free (cpus - average load)
    fall below torch's threads by more than ``margin``. It stops when two *samples* in a row
    are back within ``margin / 2``, and the average restarts from the latest sample: a
    neighbour's burst that has ended then costs about two intervals, not the average's decay
    (about a second after a two-core burst, a whole short request decoded throttled).

    The average and the margin tell a CPU-bound neighbour (a core, all the time) from the
    server's own streaming clients: a client reading 60 chunks a second uses 0.3-0.7 of a core
    in bursts, and throttling for it cost more than the stolen time (the governor switched
    about twice a second, and single-stream decode through the server lost a quarter).
    """

    def __init__(self, interval: float = 0.1, margin: float = 0.6, smoothing: float = 0.5):
        self.interval = interval
        self.margin = margin
        self.cpus = os.cpu_count() or 1
        self.threads = torch.get_num_threads()
        self.neighbour_load = 0.0
        self._weight = min(1.0, interval / smoothing)  # of each new sample in the average
        self.throttled = False
        self.switches = 0
        self._stop = threading.Event()
        self._release: threading.Event | None = None
        self._thread: threading.Thread | None = None
        self._calm = 0

    def start(self) -> "SpinGovernor":
        if not governed():
            return self
        self._thread = threading.Thread(target=self._watch, name="dualserve-openmp", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._unthrottle()

    def _watch(self) -> None:
        ticks = os.sysconf("SC_CLK_TCK")
        busy, own = machine_busy_ticks(), own_ticks()
        while not self._stop.wait(self.interval):
            busy2, own2 = machine_busy_ticks(), own_ticks()
            # Clamped: the two counters are sampled a moment apart, and per-thread times are rounded.
            other = ((busy2 - busy) - (own2 - own)) / ticks / self.interval
            busy, own = busy2, own2
            self.observe(min(float(self.cpus), max(0.0, other)))

    def observe(self, sample: float) -> None:
        """One interval's measurement: ``sample`` cores used by other processes. Throttling starts
        on the average and ends on the samples themselves."""
        self.neighbour_load += self._weight * (sample - self.neighbour_load)
        if not self.throttled:
            self.update(self.neighbour_load)
            return
        self.update(sample)
        if not self.throttled:
            self.neighbour_load = sample

    def update(self, load: float) -> None:
        """Throttle or release for an average ``load`` of cores used by other processes."""
        shortfall = self.threads - (self.cpus - load)
        if not self.throttled and shortfall > self.margin:
            self._throttle()
            log.info("other processes use %.1f of %d cores: OpenMP threads stop spinning", load, self.cpus)
        elif self.throttled:
            self._calm = self._calm + 1 if shortfall <= self.margin / 2 else 0
            if self._calm >= 2:
                self._unthrottle()
                log.info("cores free again (others use %.1f): OpenMP threads spin", load)

    def _throttle(self) -> None:
        release = threading.Event()
        started = threading.Event()

        def hold() -> None:
            # One parallel region gives this thread a libgomp pool: more managed threads than
            # CPUs, so every team throttles its spinning until this thread exits.
            torch.ones(1 << 18).add_(1)  # above the grain size of add_: run as a parallel region
            started.set()
            release.wait()

        threading.Thread(target=hold, name="dualserve-openmp-hold", daemon=True).start()
        started.wait()
        self._release, self.throttled, self._calm = release, True, 0
        self.switches += 1

    def _unthrottle(self) -> None:
        if self._release is not None:
            self._release.set()
        self._release, self.throttled, self._calm = None, False, 0
