"""What else this host is doing: CPU time used by the whole machine and by this process.

Timings taken while another process holds a core are not this host's speed: on a 2-core
machine an OpenMP team whose worker is descheduled waits for it at every barrier, and a GEMM
that takes 0.1 ms alone can take 4 ms (a scheduler time slice). Whatever measures the host
(the weight-format table, the thread governor) reads these counters to know how much CPU
the neighbours took meanwhile. Linux only (``/proc``); elsewhere nothing is known and the
neighbours count as idle.
"""

from __future__ import annotations

import glob
import os
import time


def machine_busy_ticks() -> int:
    """Busy CPU time of the whole machine, in clock ticks: everything but idle and iowait.
    Steal counts as busy: the hypervisor took the core."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4]


def own_ticks() -> int:
    """CPU time of this process (all its threads), in clock ticks."""
    with open("/proc/self/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return int(rest[11]) + int(rest[12])  # utime, stime (fields 14 and 15 of proc(5))


def neighbours_running() -> int:
    """Threads of other processes running or runnable at this moment: the kernel's
    ``procs_running`` (every runnable thread on the machine) less this process's threads in state R.
    This process's count is read before and after the kernel's, and the smaller is taken, so a
    thread of ours that wakes in between never hides a neighbour (the reading errs towards busy).
    One reading is still noisy (a client thread runnable for a millisecond counts): read it a few
    times in a row. About 0.2-0.5 ms."""
    before = _own_running()
    with open("/proc/stat") as f:
        running = next(int(line.split()[1]) for line in f if line.startswith("procs_running"))
    return max(0, running - min(before, _own_running()))


def _own_running() -> int:
    own = 0
    for path in glob.glob("/proc/self/task/*/stat"):
        try:
            with open(path) as f:
                own += f.read().rsplit(")", 1)[1].split()[0] == "R"
        except OSError:  # the thread ended meanwhile
            continue
    return own


class NeighbourLoad:
    """A context manager: ``cores`` is the average number of cores other processes used while
    it was open (0.0 where ``/proc`` is missing)."""

    def __init__(self) -> None:
        self.cores = 0.0
        self._start: tuple[float, int, int] | None = None

    def __enter__(self) -> "NeighbourLoad":
        if os.path.exists("/proc/stat"):
            self._start = (time.monotonic(), machine_busy_ticks(), own_ticks())
        return self

    def __exit__(self, *exc) -> None:
        if self._start is None:
            return
        t0, busy0, own0 = self._start
        seconds = max(time.monotonic() - t0, 1e-3)
        other = ((machine_busy_ticks() - busy0) - (own_ticks() - own0)) / os.sysconf("SC_CLK_TCK")
        self.cores = max(0.0, other / seconds)
