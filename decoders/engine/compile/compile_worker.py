"""The compile threads: background threads that build or load every runner's step graphs.

Shared by every runner of a deployment (``deployment.CompileSpec``). Jobs start in the order they
were asked for, on at most ``workers`` threads at once: one where a job builds in this process
(``torch.compile`` on CUDA), so compiles never compete with each other or with a CUDA graph
capture; on a CPU host with two or more cores, two, each a package build in a child process of
its own (``aoti_build``: the lowest priority, the engine's thread never waits for it), so a first
start's graphs build side by side (on 2 cores, its three graphs took 121 s one after another).
It counts its jobs, so a job can say where it stands ("graph 2 of 4") and a start-up line can
say how many graphs are still to come. With one worker a job holds ``device_lock`` while it runs,
so a CUDA graph capture never overlaps one (``cuda_graphs``). ``stop`` ends it for good: the jobs
not started are dropped and the running package builds are ended with their child processes and
compilers (``aoti_build.end_builds``), so none outlives the server.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from dualserve.models.heap import trim_heap

from . import aoti_build

log = logging.getLogger("dualserve.compile")


def cpu_workers() -> int:
    """Build threads for packages on this CPU host: two where there are two cores or more."""
    return 2 if (os.cpu_count() or 1) >= 2 else 1


@dataclass(frozen=True)
class CompileProgress:
    """Where the compile thread stands since its queue last ran dry (the status page shows it)."""

    done: int              # jobs finished
    total: int             # jobs asked for
    running: str | None    # the running job's name, as its submitter gave it


class CompileWorker:
    """Background threads that run compile jobs, started in the order they were asked for, at most
    ``workers`` at once (module docstring).

    A thread runs one job and exits, a new one taking the next: a thread that ran torch work keeps
    an OpenMP worker pool while it lives, and an extra pool throttles the engine's OpenMP spinning
    (see ``openmp``). A job's checks of its package run the eager forward, so a thread kept for the
    next job held a pool through that job's whole build: a first start decoded at 85-99 tok/s with
    its rows graph ready while the thread that built it built the EAGLE head's, and at 163-175 once
    that thread had exited (a 2-core AMD EPYC, ``bench_first_start``)."""

    def __init__(self, workers: int = 1) -> None:
        self.workers = max(1, workers)
        self._queue: deque[tuple[Callable[[], None], str | None]] = deque()  # (job, its name)
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        # Held while a job runs (one worker): a CUDA graph capture on the engine thread takes it too,
        # since a capture fails when another thread launches work meanwhile (``cuda_graphs``).
        self.device_lock = threading.Lock()
        # Since the queue last ran dry: jobs asked for, jobs finished, and when the first was asked for.
        self._asked = 0
        self._finished = 0
        self._since = 0.0
        self._stopped = False  # set by ``stop``: no job runs past it
        self._running: list[str | None] = []  # the running jobs' names, in the order they started
        self._mine = threading.local()  # on a compile thread: its running job's place in the queue

    def __reduce__(self):
        """A worker is its process's own: a copy sent to another process (a tensor-parallel rank's
        settings) is a fresh worker there."""
        return CompileWorker, (self.workers,)

    def submit(self, job: Callable[[], None], name: str | None = None) -> None:
        """Run ``job`` on a compile thread once the jobs before it have started; after ``stop``,
        never. ``name``: what ``progress`` calls it while it runs (a graph's shape, say)."""
        with self._lock:
            if self._stopped:
                return
            self._queue.append((job, name))
            if not self._asked:
                self._since = time.monotonic()
            self._asked += 1
            if len(self._threads) < self.workers and len(self._queue) > len(self._threads) - len(self._running):
                self._start_thread()

    def _start_thread(self) -> None:
        """A new compile thread (with ``_lock`` held)."""
        thread = threading.Thread(target=self._work, name="dualserve-compile", daemon=True)
        self._threads.append(thread)
        thread.start()

    def stop(self) -> None:
        """End the work for good (the server shuts down): drop the jobs not started and end the
        running jobs' package builds, killing their children and the compilers under them (each job
        then sees ``aoti_build.BuildCancelled``). A job that builds in this process (torch.compile) runs on."""
        with self._lock:
            self._stopped = True
            self._asked -= len(self._queue)
            self._queue.clear()
            threads = list(self._threads)
        for thread in threads:
            aoti_build.end_builds(thread.ident)

    @property
    def stopped(self) -> bool:
        """Whether ``stop`` has ended the work (a job that waited for another starts no build)."""
        with self._lock:
            return self._stopped

    @property
    def busy(self) -> bool:
        with self._lock:
            return bool(self._threads)

    @property
    def pending(self) -> int:
        """Jobs asked for and not finished (the running ones included)."""
        with self._lock:
            return self._asked - self._finished

    def position(self) -> tuple[int, int]:
        """(k, n): the calling job (elsewhere, the latest to start) is the k-th of the n asked for
        since the queue last ran dry."""
        with self._lock:
            return getattr(self._mine, "place", None) or self._asked - len(self._queue), self._asked

    def progress(self) -> CompileProgress:
        with self._lock:
            running = ", ".join(name for name in self._running if name) or None
            return CompileProgress(self._finished, self._asked, running)

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            with self._lock:
                job, name = self._queue.popleft() if self._queue else (None, None)
                if job is None:
                    self._threads.remove(me)
                    last = not self._threads
                    done, seconds = self._finished, time.monotonic() - self._since
                    if last:
                        self._asked = self._finished = 0
                else:
                    self._running.append(name)
                    self._mine.place = self._asked - len(self._queue)
            if job is None:
                if last and done > 1:
                    log.info("compile jobs done: %d graphs in %.1f s", done, seconds)
                trim_heap()  # what tracing and code generation freed
                return
            handed = False
            try:
                with self.device_lock if self.workers == 1 else contextlib.nullcontext():
                    job()
            finally:
                with self._lock:
                    self._finished += 1
                    self._running.remove(name)
                    self._mine.place = None
                    if self._queue and not self._stopped:  # the next job on a new thread (class docstring)
                        self._threads.remove(me)
                        self._start_thread()
                        handed = True
            if handed:
                return
