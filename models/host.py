"""What else this host is doing: CPU time used by the whole machine and by this process.

Timings taken while another process holds a core are not this host's speed: on a 2-core
machine an OpenMP team whose worker is descheduled waits for it at every barrier, and a GEMM
that takes 0.1 ms alone can take 4 ms (a scheduler time slice). Whatever measures the host
(the weight-format table, the thread governor) reads these counters to know how much CPU
the neighbours took meanwhile. Linux only (``/proc``); elsewhere nothing is known and the
neighbours count as idle.

**This process's background work is not a neighbour.** A process started to run behind this
one (a step graph's build: ``SCHED_IDLE`` and nice 19, and its compilers, which inherit both) is
registered with ``background`` for its life. The kernel runs it only on a core none of this
process's threads wants, so it never holds a core against a step: its CPU time and its runnable
threads, and those of every process below it, are left out of the neighbours' (``Background``,
``neighbours_running``). Counted as a neighbour, a first start's own builds halved the step's
thread team for the minutes they ran, and the compiled step, once built, ran on one thread.
"""

from __future__ import annotations

import contextlib
import glob
import os
import threading
import time
from typing import Iterator


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
    ``procs_running`` (every runnable thread on the machine) less this process's threads in state R
    and its background processes' (module docstring). This process's count is read before and
    after the kernel's, and the smaller is taken, so a thread of ours that wakes in between never
    hides a neighbour (the reading errs towards busy). One reading is still noisy (a client thread
    runnable for a millisecond counts): read it a few times in a row. About 0.2-0.5 ms."""
    before = _own_running()
    with open("/proc/stat") as f:
        running = next(int(line.split()[1]) for line in f if line.startswith("procs_running"))
    background = sum(_running(pid) for root in _background_roots() for pid in _tree(root))
    return max(0, running - min(before, _own_running()) - background)


def _own_running() -> int:
    return _running("self")


def _running(pid: int | str) -> int:
    """Threads of process ``pid`` in state R (0 once it has gone)."""
    count = 0
    for path in glob.glob(f"/proc/{pid}/task/*/stat"):
        try:
            with open(path) as f:
                count += f.read().rsplit(")", 1)[1].split()[0] == "R"
        except OSError:  # the thread ended meanwhile
            continue
    return count


_background_lock = threading.Lock()
_background_pids: set[int] = set()


@contextlib.contextmanager
def background(pid: int) -> Iterator[None]:
    """Process ``pid``, a child of this one that yields every core this process wants
    (``SCHED_IDLE``, nice 19), and every process below it are this process's background work while
    the block runs (module docstring)."""
    with _background_lock:
        _background_pids.add(pid)
    try:
        yield
    finally:
        with _background_lock:
            _background_pids.discard(pid)


def _background_roots() -> list[int]:
    with _background_lock:
        return sorted(_background_pids)


def _tree(pid: int) -> list[int]:
    """``pid`` and every living process below it (Linux's ``/proc/<pid>/task/<tid>/children``)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        for path in glob.glob(f"/proc/{p}/task/*/children"):
            try:
                with open(path) as f:
                    todo.extend(int(c) for c in f.read().split())
            except OSError:  # gone meanwhile
                continue
    return found


def _tree_ticks(pid: int) -> int:
    """CPU time, in clock ticks, that ``pid`` and every process below it have used: each living
    process's own and that of the children it has reaped (``cutime``, ``cstime``: a compiler that
    has exited is counted by the process that waited for it)."""
    total = 0
    for p in _tree(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(v) for v in rest[11:15])  # utime, stime, cutime, cstime (fields 14-17)
    return total


class Background:
    """CPU time of this process's background work (module docstring), read interval by interval:
    ``ticks`` returns the clock ticks it used since the previous call. A root that has ended
    loses its last interval (counted as a neighbour's for that interval); one that began within
    the interval counts whole."""

    def __init__(self) -> None:
        self._last: dict[int, int] = {}
        self.roots = 0  # background roots at the last reading
        self.ticks()

    def ticks(self) -> int:
        now = {pid: _tree_ticks(pid) for pid in _background_roots()}
        self.roots = len(now)
        used = sum(max(0, t - self._last.get(pid, 0)) for pid, t in now.items())
        self._last = now
        return used


class NeighbourLoad:
    """A context manager: ``cores`` is the average number of cores other processes used while
    it was open (0.0 where ``/proc`` is missing)."""

    def __init__(self) -> None:
        self.cores = 0.0
        self._start: tuple[float, int, int] | None = None

    def __enter__(self) -> "NeighbourLoad":
        if os.path.exists("/proc/stat"):
            self._background = Background()
            self._start = (time.monotonic(), machine_busy_ticks(), own_ticks())
        return self

    def __exit__(self, *exc) -> None:
        if self._start is None:
            return
        t0, busy0, own0 = self._start
        seconds = max(time.monotonic() - t0, 1e-3)
        other = (machine_busy_ticks() - busy0) - (own_ticks() - own0) - self._background.ticks()
        other /= os.sysconf("SC_CLK_TCK")
        self.cores = max(0.0, other / seconds)
