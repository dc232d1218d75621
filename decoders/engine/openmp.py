"""OpenMP teams on a CPU host: as many threads as the cores other programs leave free.

PyTorch's CPU kernels run in GNU OpenMP (libgomp) teams. A decode step opens hundreds of short
parallel regions (the GEMMs), and between them a worker spins (``GOMP_SPINCOUNT``) before it sleeps
on a futex. On idle cores that spinning is what makes a step fast. Beside a program that holds a
core it is what makes a step collapse: every region ends in a barrier, and the barrier waits for
a worker the kernel has descheduled for a whole time slice. Measured on a 2-core host (AVX-512
VNNI, no AMX), the default model in w4a16 with its compiled step graphs, ``dualserve generate``,
128 tokens (``python -m dualserve.clients.bench_neighbour``):

  ===========================================  ===========  ==================
  team                                         cores idle   one busy neighbour
  ===========================================  ===========  ==================
  2 threads, spinning                          124-139      34 tok/s
  2 threads, spinning throttled by libgomp     -            46 tok/s
  1 thread                                     98 tok/s     83 tok/s
  ===========================================  ===========  ==================

No way of waiting saves a team that is larger than the free cores; a smaller team has no one to
wait for. So:

- torch work outside the engine (loading, measuring formats, calibrating, compiling) runs on
  threads that exit afterwards (``run_on_own_thread``, the compile worker), so the engine's
  thread holds the one long-lived pool: libgomp throttles every team's spinning while it manages
  more threads than the machine has CPUs (GCC manual, ``GOMP_SPINCOUNT``), and a thread that has
  run a parallel region keeps its pool until it exits;
- ``ThreadGovernor`` watches how much CPU other processes use and sizes the engine's team to the
  cores they leave free (this process's background work, its graph builds at the lowest priority,
  is not another process's: ``host``); the engine's thread applies the size before each step
  (``torch.set_num_threads`` there sets that thread's team only, and costs microseconds). The
  result does not depend on the team size: every kernel a step runs gives each output element to
  one thread, whatever their number (tested bit for bit through the server).

Only Linux hosts running torch's OpenMP backend are governed; elsewhere this is a no-op.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import Callable, TypeVar

import torch

from dualserve.models.host import Background, machine_busy_ticks, neighbours_running, own_ticks

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
    """Whether this host's torch runs GNU OpenMP teams on several threads, which a governor sizes."""
    return (os.path.exists("/proc/stat") and torch.get_num_threads() > 1
            and "OpenMP" in torch.__config__.parallel_info())


class ThreadGovernor:
    """Sizes the engine's OpenMP team to the cores other processes leave free (module docstring).

    ``team`` is the number of threads the next step uses: torch's configured ``threads`` while
    the cores are free, fewer while neighbours hold some. Two readings, one for each direction:

    - **Shrinking, from CPU time.** Every ``interval`` seconds a daemon thread reads how many cores
      other processes used since the last reading (``/proc/stat`` less this process), and keeps an
      exponential average over about ``smoothing`` seconds (``neighbour_load``). The team shrinks
      to the free cores (cpus - average) when they fall short of ``threads`` by more than
      ``margin``. The average and the margin tell a CPU-bound neighbour (a core, all the time) from
      the server's own streaming clients: a client reading 60 chunks a second uses 0.3-0.7 of a
      core in bursts, and a smaller team for it costs more than the time it takes.
    - **Growing back, whichever comes first** (the average then restarts from zero):

      - *from what is runnable now*: while the team is short, the thread reads the number of
        other processes' runnable threads (``host.neighbours_running``) every ``poll`` seconds,
        and restores ``threads`` after ``calm`` readings in a row leave a core per thread. A
        neighbour's burst that has ended (another server's request, a build step) then costs a few
        tens of milliseconds on a small team, not the average's decay. The engine's thread takes
        the reading too, before a step, when the last is older than ``poll`` (``apply``): a step
        package's call holds the GIL for the whole step, so while steps run the watcher's readings
        came about 130 ms apart (measured);
      - *from CPU time*: an interval in which other processes used less than ``release`` of a
        core. The runnable count is a snapshot, and a streaming server's host is full of threads
        that are runnable for a moment (the client reading a chunk, the kernel's network work,
        this process's own threads between the two counts): a request sent straight after
        another server's turn found one in most runs of five readings and decoded on one thread
        to its end (a third of such requests, measured). CPU time tells a neighbour that is gone
        from one that is still running, within one interval.

      - *from work arriving at an idle engine* (``resumed``): two readings in a row, 1 ms apart,
        that find a core per thread, within the first ``arrival_readings`` ms. A request sent
        straight after another server's answer otherwise ran its first 5-13 steps on one thread
        while calm readings accumulated (measured). The other server's threads are runnable for
        1-3 ms after its answer's last byte, so the first reading alone seldom finds the cores
        free. A reading errs towards busy (``host.neighbours_running``) and a CPU-bound neighbour
        is runnable at every reading, so two calm ones in a row are good evidence.

      A CPU-bound neighbour is runnable at every reading and uses a core in every interval.
    """

    def __init__(self, interval: float = 0.1, margin: float = 0.6, smoothing: float = 0.5,
                 poll: float = 0.01, calm: int = 5, release: float = 0.4, arrival_readings: int = 6,
                 starved: float = 0.25, starved_for: float = 2.0):
        self.interval = interval
        self.margin = margin
        self.poll = poll
        self.calm = calm
        self.release = release
        self.arrival_readings = arrival_readings
        self.starved = starved
        self.starved_for = starved_for
        self.reserved = 0                 # cores left to this process's starved background work
        self._starving = 0.0              # seconds its background work has been starved in a row
        self.cpus = os.cpu_count() or 1
        self.threads = torch.get_num_threads()
        self.team = self.threads          # written by the watcher, read by the engine's thread
        self.neighbour_load = 0.0
        self._weight = min(1.0, interval / smoothing)  # of each new sample in the average
        self.switches = 0
        self._applied: int | None = None  # the engine thread's team size, as it last set it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._calm = 0
        self._reading = threading.Lock()   # one runnable reading at a time: the watcher's or the engine's
        self._last_reading = 0.0           # when the last runnable reading was taken (monotonic)
        self.restores = 0                  # times the full team came back; the watcher restarts its interval

    @property
    def full(self) -> int:
        """The team without neighbours: every thread, less a core reserved for starved background work."""
        return max(1, self.threads - self.reserved)

    @property
    def short(self) -> bool:
        return self.team < self.full

    def start(self) -> "ThreadGovernor":
        if not governed():
            return self
        self._thread = threading.Thread(target=self._watch, name="dualserve-openmp", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.team = self.threads

    def state(self) -> dict:
        """``/status.json``'s ``threads`` entry."""
        return {"team": self.team, "threads": self.threads, "cpus": self.cpus, "reserved": self.reserved,
                "neighbour_load": round(self.neighbour_load, 2), "switches": self.switches}

    def apply(self) -> None:
        """On the engine's thread, before a step: give the step ``team`` threads, after taking the
        runnable reading while the team is short and the last is older than ``poll`` (class
        docstring; about 0.1 ms, only while short)."""
        self.read_if_due()
        team = self.team
        if team != self._applied:
            torch.set_num_threads(team)
            self._applied = team

    def resumed(self) -> None:
        """On the engine's thread, when work arrives at an idle engine: while the team is short, two
        readings in a row, at most ``arrival_readings`` 1 ms apart, that find a core per thread
        restore it (class docstring)."""
        if not self.short:
            return
        with self._reading:
            calm = 0
            for i in range(self.arrival_readings):
                if i:
                    time.sleep(0.001)
                self._last_reading = time.monotonic()
                calm = calm + 1 if self._calm_reading(neighbours_running()) else 0
                if calm == 2:
                    self._restore("work arrived and no other process was runnable")
                    return

    def _watch(self) -> None:
        ticks = os.sysconf("SC_CLK_TCK")
        background = Background()  # this process's own builds: not neighbours (``host``)
        t, busy, own = time.monotonic(), machine_busy_ticks(), own_ticks()
        restores = self.restores
        while not self._stop.wait(self.poll if self.short else self.interval):
            self.read_if_due()
            if self.restores != restores:  # the full team is back: the CPU-time interval starts now
                restores = self.restores
                t, busy, own = time.monotonic(), machine_busy_ticks(), own_ticks()
                background.ticks()
                continue
            if self.short and time.monotonic() - t < self.interval:
                continue
            t2, busy2, own2 = time.monotonic(), machine_busy_ticks(), own_ticks()
            # Clamped: the counters are sampled a moment apart, and per-thread times are rounded.
            mine = background.ticks()
            other = ((busy2 - busy) - (own2 - own) - mine) / ticks / max(t2 - t, 1e-3)
            self.observe_background(background.roots, mine / ticks / max(t2 - t, 1e-3), t2 - t)
            t, busy, own = t2, busy2, own2
            self.observe(min(float(self.cpus), max(0.0, other)))

    def observe(self, sample: float) -> None:
        """One interval's CPU-time reading: ``sample`` cores used by other processes. Feeds the
        average, which shrinks the team; while the team is short, an interval in which the others
        used less than ``release`` of a core restores it."""
        if self.short and sample < self.release:
            with self._reading:
                self._restore(f"other processes used {sample:.1f} of {self.cpus} cores for {self.interval:g} s")
            return
        self.neighbour_load += self._weight * (sample - self.neighbour_load)
        free = self.cpus - self.neighbour_load
        if self.full - free > self.margin:
            team = max(1, min(self.full, math.floor(free + self.margin)))
            if team < self.team:
                self.team, self._calm = team, 0
                self.switches += 1
                log.info("other processes use %.1f of %d cores: steps run on %d of %d threads",
                         self.neighbour_load, self.cpus, team, self.threads)

    def observe_background(self, roots: int, cores: float, seconds: float) -> None:
        """One interval's reading of this process's background work (``host.Background``): ``roots``
        builds running, which used ``cores``. Being at the lowest priority, a build runs only on
        cores the steps leave; a server whose steps leave none would never finish its graphs. So
        builds that used less than ``starved`` of a core each for ``starved_for`` seconds in a row
        get a core of their own (``reserved``: the team runs one thread fewer) until the last ends."""
        if not roots:
            self._starving = 0.0
            if self.reserved:
                self.reserved = 0
                if self.team == self.threads - 1 and self.neighbour_load < self.margin:
                    self.team = self.threads
                log.info("background builds done: steps may run on %d threads", self.threads)
            return
        if self.reserved or self.threads < 2:
            return
        self._starving = self._starving + seconds if cores < self.starved * roots else 0.0
        if self._starving >= self.starved_for:
            self.reserved = 1
            self.team = min(self.team, self.full)
            self.switches += 1
            log.info("this server's %d background build%s used %.2f of a core for %.0f s: steps leave them a core "
                     "(%d of %d threads) until they end", roots, "s" if roots > 1 else "", cores, self._starving,
                     self.full, self.threads)

    def read_if_due(self) -> None:
        """While the team is short and the last runnable reading is older than ``poll``: take one
        (``host.neighbours_running``) and apply it (``observe_now``). The watcher's and the engine's."""
        if not self.short or time.monotonic() - self._last_reading < self.poll:
            return
        with self._reading:
            self._last_reading = time.monotonic()
            self.observe_now(neighbours_running())

    def observe_now(self, runnable: int) -> bool:
        """One reading of other processes' runnable threads while the team is short; True when
        it restored the full team."""
        if not self.short:
            return False
        self._calm = self._calm + 1 if self._calm_reading(runnable) else 0
        if self._calm < self.calm:
            return False
        self._restore(f"{self.calm} readings in a row found a core per thread")
        return True

    def _calm_reading(self, runnable: int) -> bool:
        """Whether a reading of ``runnable`` other processes' threads leaves a core per thread."""
        return self.cpus - runnable >= self.full

    def _restore(self, why: str) -> None:
        if not self.short:
            return
        self.team, self._calm, self.neighbour_load = self.full, 0, 0.0
        self.restores += 1
        log.info("cores free again (%s): steps run on %d threads", why, self.full)
