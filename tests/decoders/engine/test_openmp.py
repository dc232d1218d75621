"""OpenMP teams: torch work on threads that exit, and the thread governor's rule."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from dualserve.decoders.engine.compile.compile_worker import CompileWorker
from dualserve.decoders.engine.openmp import ThreadGovernor, governed, run_on_own_thread
from dualserve.models.host import Background, NeighbourLoad, background, neighbours_running
from polling import until


def test_run_on_own_thread_returns_and_raises():
    caller = threading.get_ident()
    assert run_on_own_thread(lambda a, b=0: (a + b, threading.get_ident() != caller), 2, b=3) == (5, True)
    with pytest.raises(ValueError, match="bad"):
        run_on_own_thread(lambda: (_ for _ in ()).throw(ValueError("bad")))


def rule(cpus: int, threads: int, **kw) -> ThreadGovernor:
    g = ThreadGovernor(**kw)
    g.cpus, g.threads, g.team = cpus, threads, threads
    return g


def test_team_shrinks_to_the_cores_neighbours_leave():
    g = rule(2, 2, smoothing=0.1)      # each reading is the average: the rule alone
    g.observe(0.1)                     # 1.9 free cores for 2 threads: within the margin
    assert g.team == 2
    g.observe(0.5)                     # a streaming client's share: still within the margin
    assert g.team == 2
    g.observe(1.0)                     # a busy neighbour: one core left
    assert g.team == 1 and g.switches == 1
    g.observe(2.0)                     # never below one thread
    assert g.team == 1
    g.observe(0.5)                     # a streaming client's share beside the short team: stays short
    assert g.team == 1
    g.observe(0.2)                     # an interval in which the others used under ``release``: restored
    assert g.team == 2 and g.restores == 1 and g.neighbour_load == 0.0


def test_starved_background_builds_get_a_core_until_they_end():
    """A build at the lowest priority runs only where the steps leave a core: one that got under a
    quarter of a core for 2 s in a row gets a core of its own until the last build ends."""
    g = rule(2, 2)
    g.observe_background(1, 0.9, 1.0)      # a build that gets its share
    g.observe_background(1, 0.1, 1.0)      # starved 1 s
    assert g.team == 2 and g.reserved == 0
    g.observe_background(1, 0.5, 1.0)      # not starved: the count starts again
    g.observe_background(2, 0.4, 1.0)      # two builds: 0.2 a build
    assert g.team == 2
    g.observe_background(2, 0.3, 1.0)      # starved 2 s in a row
    assert (g.team, g.reserved, g.full) == (1, 1, 1) and not g.short
    g.observe(0.2)                         # a calm interval restores the team without the reserved core
    assert g.team == 1
    g.observe_background(1, 0.9, 1.0)      # fed now: the reservation holds while builds run
    assert g.team == 1
    g.observe_background(0, 0.0, 1.0)      # the last build ended
    assert (g.team, g.reserved) == (2, 0)
    one = rule(1, 1)
    for _ in range(5):
        one.observe_background(1, 0.0, 1.0)
    assert (one.team, one.reserved) == (1, 0)  # a team of one is never emptied


def test_team_on_a_larger_host():
    g = rule(8, 4, smoothing=0.1, calm=3)
    g.observe(3.0)                     # 5 free cores for 4 threads
    assert g.team == 4
    g.observe(4.7)                     # 3.3 free: short of 4 by more than the margin
    assert g.team == 3
    g.observe(6.5)
    assert g.team == 2
    assert not g.observe_now(5)        # 3 free for 4 threads: not yet
    assert not g.observe_now(4) and not g.observe_now(4)
    assert g.observe_now(4) and g.team == 4  # 4 free for 4 threads, three readings in a row


def test_average_ignores_bursts():
    """One busy sample among idle ones (a client reading a chunk) does not shrink the team; a
    neighbour that stays busy does, within about half a second."""
    g = rule(2, 2, interval=0.1, smoothing=0.5)
    for load in (0.0, 1.0, 0.0, 0.0, 1.0, 0.0):
        g.observe(load)
    assert g.team == 2
    for _ in range(5):
        g.observe(1.0)
    assert g.team == 1


def test_team_grows_back_when_the_neighbour_stops():
    """A neighbour that kept both cores busy for a second (a burst of another server) gives the
    cores back after ``calm`` readings in a row find none of its threads runnable (tens of
    milliseconds), not after the average decays (about a second); the average restarts, so a
    later single busy sample does not shrink the team again, and a neighbour that stays runnable
    keeps it small."""
    g = rule(2, 2, interval=0.1, smoothing=0.5, calm=3)
    for _ in range(10):
        g.observe(2.0)
    assert g.team == 1 and g.neighbour_load > 1.5
    for runnable in (1, 1, 0, 0, 1, 0, 0):  # busy, then a reader's blip breaks the calm run
        assert not g.observe_now(runnable)
    assert g.team == 1
    assert g.observe_now(0)            # the third calm reading in a row
    assert g.team == 2 and g.neighbour_load == 0.0
    g.observe(1.0)                     # a client's chunk
    assert g.team == 2
    for _ in range(4):                 # a CPU-bound neighbour is back: one thread within half a second
        g.observe(1.0)
    assert g.team == 1 and g.switches == 2
    for _ in range(20):
        assert not g.observe_now(1)
    assert g.team == 1


def test_apply_sets_the_calling_threads_team_once_per_change():
    g = rule(2, 2)
    seen = []

    def engine_thread() -> None:
        g.apply()
        seen.append(torch.get_num_threads())
        g.team = 1
        g.apply()
        seen.append(torch.get_num_threads())
        g.team = 2
        g.apply()
        seen.append(torch.get_num_threads())

    t = threading.Thread(target=engine_thread)
    t.start()
    t.join()
    assert seen == [2, 1, 2]


def test_the_engine_thread_reads_while_the_team_is_short(monkeypatch):
    """A package call holds the GIL for its whole step, so the watcher's readings stall while steps
    run: the engine's thread takes them before each step instead (at most one per ``poll``), and
    restores the team with no watcher running; a full team takes no readings."""
    from dualserve.decoders.engine import openmp

    readings = []
    monkeypatch.setattr(openmp, "neighbours_running", lambda: readings.append(1) or 0)
    g = rule(2, 2, calm=3, poll=0.0)
    g.apply()
    assert readings == []                  # a full team: nothing read
    g.team = 1
    for _ in range(2):
        g.apply()
    assert g.team == 1 and len(readings) == 2
    g.apply()                              # the third calm reading in a row
    assert g.team == 2 and g.restores == 1 and len(readings) == 3
    g.apply()
    assert len(readings) == 3
    g.team, g.poll = 1, 60.0               # a reading younger than poll is not taken again
    g.apply()
    assert len(readings) == 3


def test_work_arriving_at_an_idle_engine_restores_the_team_on_two_calm_readings(monkeypatch):
    """Another server's threads stay runnable for a few milliseconds after its answer: ``resumed``
    reads up to ``arrival_readings`` times, 1 ms apart, and two calm readings in a row restore the
    team; calm readings that never come twice in a row, or a full team, leave it as it is."""
    from dualserve.decoders.engine import openmp

    def readings(values):
        it = iter(values)
        taken = []
        monkeypatch.setattr(openmp, "neighbours_running", lambda: taken.append(1) or next(it))
        return taken

    g = rule(2, 2)
    g.resumed()                            # a full team: nothing to read
    g.team = 1
    taken = readings([2, 1, 0, 0, 1])      # the other server's last threads, then none
    g.resumed()
    assert g.team == 2 and g.restores == 1 and len(taken) == 4
    g.team = 1
    taken = readings([0, 1] * 3)           # a neighbour that keeps coming back (a busy process)
    g.resumed()
    assert g.team == 1 and len(taken) == g.arrival_readings


def test_a_real_neighbour_shrinks_the_team_and_its_end_restores_it():
    """Through the host's counters: a busy process shrinks a started governor's team, and its
    end restores the team."""
    if not governed():
        pytest.skip("no /proc or no OpenMP threads to govern")
    g = rule(2, 2, interval=0.05, smoothing=0.1)
    g.start()
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert until(lambda: g.team == 1, 10), "a busy neighbour must shrink the team"
    finally:
        hog.kill()
        hog.wait()
    back = until(lambda: g.team == 2, 5)
    g.stop()
    if not back and neighbours_running() > 0:
        pytest.skip("other work on this host keeps a core busy: the full team cannot come back")
    assert back


def test_compile_worker_thread_exits_when_idle():
    worker = CompileWorker()
    done = []
    worker.submit(lambda: (time.sleep(0.05), done.append(1)))
    worker.submit(lambda: done.append(2))
    assert until(lambda: not worker.busy, 5)
    assert done == [1, 2]
    assert until(lambda: not any(t.name == "dualserve-compile" for t in threading.enumerate()), 5)
    worker.submit(lambda: done.append(3))  # a later job starts a new thread
    assert until(lambda: done == [1, 2, 3] and not worker.busy, 5)


def test_each_compile_job_runs_on_a_thread_of_its_own():
    """A job's thread exits when the job ends, a new one taking the next job: a thread that ran
    torch work keeps an OpenMP pool while it lives (``CompileWorker``)."""
    worker = CompileWorker(2)
    threads = []
    for _ in range(5):
        worker.submit(lambda: (threads.append(threading.current_thread()), time.sleep(0.02)))
    assert until(lambda: not worker.busy, 5)
    assert len(threads) == 5 and len(set(map(id, threads))) == 5
    assert until(lambda: not any(t.is_alive() for t in threads), 5)


def test_a_build_child_runs_at_the_lowest_priority():
    """``aoti_build``'s child lowers itself before it builds; what it starts inherits it."""
    if os.name != "posix":
        pytest.skip("POSIX priorities")
    code = ("import os; from dualserve.decoders.engine.compile import aoti_build as b; b._yield_to_serving(); "
            "print(os.nice(0), os.sched_getscheduler(0) == getattr(os, 'SCHED_IDLE', -1))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "19" and (out[1] == "True" or not hasattr(os, "SCHED_IDLE"))


def test_background_work_is_counted_apart_from_the_neighbours():
    """A registered child's CPU time, and that of the processes below it (one it has reaped
    included: a compiler that has exited), is this process's background work
    (``host.Background``); once the block ends the child is nobody's background."""
    if not os.path.exists("/proc/self/task"):
        pytest.skip("no /proc")
    burn = "import time\nwhile time.process_time() < 0.3: pass"
    code = (f"import subprocess, sys, time\nsubprocess.run([sys.executable, '-c', {burn!r}])\n{burn}\n"
            "print('done', flush=True)\nsys.stdin.read()\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    tick = os.sysconf("SC_CLK_TCK")
    try:
        with background(child.pid):
            used = Background()
            assert child.stdout.readline() == "done\n"
            assert used.ticks() / tick > 0.5  # both loops: 0.6 s of CPU
            assert used.ticks() / tick < 0.1  # idle now
        assert Background().ticks() == 0 and Background()._last == {}
    finally:
        child.stdin.close()
        child.wait()


def test_a_busy_build_child_leaves_the_team_whole():
    """A build child at the lowest priority, busy on a core, is background work: a started
    governor keeps its full team beside it (where nothing else on the host shrinks it)."""
    if not governed() or not hasattr(os, "SCHED_IDLE"):
        pytest.skip("no /proc, no OpenMP threads to govern, or no SCHED_IDLE")
    code = ("from dualserve.decoders.engine.compile import aoti_build as b; b._yield_to_serving()\n"
            "while True: pass")
    g = rule(2, 2, interval=0.05, smoothing=0.1)
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        with background(child.pid):
            g.start()
            with NeighbourLoad() as beside:
                shrank = until(lambda: g.team < 2, 1.5)
            g.stop()
    finally:
        child.kill()
        child.wait()
    if shrank and beside.cores > 0.4:
        pytest.skip(f"other work on this host used {beside.cores:.1f} cores meanwhile")
    assert not shrank


def test_a_build_child_leads_its_own_group_in_this_session():
    """Its compilers join its group, which ending a build kills; it stays in this session, so
    Linux's autogroups do not give it a share of the CPU as an equal (``aoti_build``)."""
    if os.name != "posix":
        pytest.skip("POSIX process groups")
    from dualserve.decoders.engine.compile.aoti_build import _own_process_group

    child = subprocess.Popen([sys.executable, "-c", "import os; print(os.getsid(0), os.getpgid(0))"],
                             stdout=subprocess.PIPE, text=True, **_own_process_group())
    sid, pgid = map(int, child.communicate()[0].split())
    assert sid == os.getsid(0) and pgid == child.pid
