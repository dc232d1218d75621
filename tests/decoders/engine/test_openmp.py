"""OpenMP waiting: torch work on threads that exit, and the governor's throttling rule."""

from __future__ import annotations

import threading
import time

import pytest

from dualserve.decoders.engine.compile.compile_worker import CompileWorker
from dualserve.decoders.engine.openmp import SpinGovernor, run_on_own_thread


def test_run_on_own_thread_returns_and_raises():
    caller = threading.get_ident()
    assert run_on_own_thread(lambda a, b=0: (a + b, threading.get_ident() != caller), 2, b=3) == (5, True)
    with pytest.raises(ValueError, match="bad"):
        run_on_own_thread(lambda: (_ for _ in ()).throw(ValueError("bad")))


def holders() -> int:
    return sum(t.name == "dualserve-openmp-hold" for t in threading.enumerate())


def wait_for(cond, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_governor_throttles_while_neighbours_leave_too_few_cores():
    g = SpinGovernor()
    g.cpus, g.threads = 2, 2
    g.update(0.1)                      # 1.9 free cores for 2 threads: within the margin
    assert not g.throttled and holders() == 0
    g.update(0.5)                      # a streaming client's share: still within the margin
    assert not g.throttled and holders() == 0
    g.update(1.0)                      # a busy neighbour: one core left
    assert g.throttled and g.switches == 1 and holders() == 1
    g.update(0.0)                      # one calm sample is not enough (hysteresis)
    assert g.throttled
    g.update(0.9)                      # busy again: the calm count restarts
    g.update(0.0)
    assert g.throttled
    g.update(0.05)
    assert not g.throttled
    assert wait_for(lambda: holders() == 0), "the thread holding the extra OpenMP pool must exit"
    g.update(1.5)
    assert g.throttled and g.switches == 2
    g.stop()
    assert not g.throttled and wait_for(lambda: holders() == 0)


def test_governor_leaves_spare_cores_alone():
    g = SpinGovernor()
    g.cpus, g.threads = 8, 4
    g.update(3.0)                      # 5 free cores for 4 threads
    assert not g.throttled
    g.update(4.7)                      # 3.3 free: short of 4 by more than the margin
    assert g.throttled
    g.stop()


def test_governor_averages_bursts():
    """One busy sample among idle ones (a client reading a chunk) does not throttle; a neighbour
    that stays busy does, within about half a second."""
    g = SpinGovernor(interval=0.1, smoothing=0.5)
    g.cpus, g.threads = 2, 2
    for load in (0.0, 1.0, 0.0, 0.0, 1.0, 0.0):
        g.observe(load)
    assert not g.throttled
    for _ in range(5):
        g.observe(1.0)
    assert g.throttled
    g.stop()


def test_governor_releases_when_the_neighbour_stops():
    """A neighbour that kept both cores busy for a second (a burst of another server) is let go
    two calm samples after it stops, not after the average decays (about a second); a later
    single busy sample does not throttle again."""
    g = SpinGovernor(interval=0.1, smoothing=0.5)
    g.cpus, g.threads = 2, 2
    for _ in range(10):
        g.observe(2.0)
    assert g.throttled and g.neighbour_load > 1.5
    g.observe(0.0)
    assert g.throttled                 # one calm sample is not enough (hysteresis)
    g.observe(0.05)
    assert not g.throttled and g.neighbour_load == 0.05
    g.observe(1.0)                     # a client's chunk
    assert not g.throttled
    for _ in range(3):                 # a CPU-bound neighbour is back: throttled within half a second
        g.observe(1.0)
    assert g.throttled and g.switches == 2
    g.observe(0.9)
    g.observe(1.0)
    assert g.throttled                 # it stays throttled while the neighbour runs
    g.stop()


def test_compile_worker_thread_exits_when_idle():
    worker = CompileWorker()
    done = []
    worker.submit(lambda: (time.sleep(0.05), done.append(1)))
    worker.submit(lambda: done.append(2))
    assert wait_for(lambda: not worker.busy)
    assert done == [1, 2]
    assert wait_for(lambda: not any(t.name == "dualserve-compile" for t in threading.enumerate()))
    worker.submit(lambda: done.append(3))  # a later job starts a new thread
    assert wait_for(lambda: done == [1, 2, 3] and not worker.busy)
