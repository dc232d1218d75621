"""The compile thread: one background thread that builds or loads every runner's step graphs in turn.

Shared by every runner of a deployment (``deployment.CompileSpec``), so compiles never compete
with each other for the cores. It counts its jobs, so a job can say where it stands ("graph 2
of 4") and a start-up line can say how many graphs are still to come. A job holds
``device_lock`` while it runs, so a CUDA graph capture never overlaps one (``cuda_graphs``).
``stop`` ends it for good: the jobs not started are dropped and a running package build is ended
with its child process and compilers (``aoti_build.end_builds``), so none outlives the server.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from dualserve.models.heap import trim_heap

from . import aoti_build

log = logging.getLogger("dualserve.compile")


@dataclass(frozen=True)
class CompileProgress:
    """Where the compile thread stands since its queue last ran dry (the status page shows it)."""

    done: int              # jobs finished
    total: int             # jobs asked for
    running: str | None    # the running job's name, as its submitter gave it


class CompileWorker:
    """One background thread that runs compile jobs in the order they were asked for.

    The thread exits as soon as its queue is empty (and a new one starts with the next job): a thread
    that ran torch work keeps an OpenMP worker pool while it lives, and an extra pool throttles the
    engine's OpenMP spinning (see ``openmp``)."""

    def __init__(self) -> None:
        self._queue: deque[tuple[Callable[[], None], str | None]] = deque()  # (job, its name)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        # Held while a job runs: a CUDA graph capture on the engine thread takes it too, since a
        # capture fails when another thread launches work meanwhile (``cuda_graphs``).
        self.device_lock = threading.Lock()
        # Since the queue last ran dry: jobs asked for, jobs finished, and when the first was asked for.
        self._asked = 0
        self._finished = 0
        self._since = 0.0
        self._stopped = False  # set by ``stop``: no job runs past it
        self._running: str | None = None  # the running job's name

    def __reduce__(self):
        """A worker is its process's own: a copy sent to another process (a tensor-parallel rank's
        settings) is a fresh worker there."""
        return CompileWorker, ()

    def submit(self, job: Callable[[], None], name: str | None = None) -> None:
        """Run ``job`` on the compile thread after the jobs before it; after ``stop``, never.
        ``name``: what ``progress`` calls it while it runs (a graph's shape, say)."""
        with self._lock:
            if self._stopped:
                return
            self._queue.append((job, name))
            if not self._asked:
                self._since = time.monotonic()
            self._asked += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="dualserve-compile", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        """End the work for good (the server shuts down): drop the jobs not started and end the
        running job's package build, killing its child and the compilers under it (the job then
        sees ``aoti_build.BuildCancelled``). A job that builds in this process (torch.compile) runs on."""
        with self._lock:
            self._stopped = True
            self._asked -= len(self._queue)
            self._queue.clear()
            thread = self._thread
        if thread is not None:
            aoti_build.end_builds(thread.ident)

    @property
    def busy(self) -> bool:
        with self._lock:
            return self._thread is not None

    @property
    def pending(self) -> int:
        """Jobs asked for and not finished (the running one included)."""
        with self._lock:
            return self._asked - self._finished

    def position(self) -> tuple[int, int]:
        """(k, n): the running job is the k-th of the n asked for since the queue last ran dry."""
        with self._lock:
            return self._finished + 1, self._asked

    def progress(self) -> CompileProgress:
        with self._lock:
            return CompileProgress(self._finished, self._asked, self._running)

    def _work(self) -> None:
        while True:
            with self._lock:
                job, self._running = self._queue.popleft() if self._queue else (None, None)
                if job is None:
                    self._thread = None
                    done, seconds = self._finished, time.monotonic() - self._since
                    self._asked = self._finished = 0
            if job is None:
                if done > 1:
                    log.info("compile jobs done: %d graphs in %.1f s", done, seconds)
                trim_heap()  # what tracing and code generation freed
                return
            try:
                with self.device_lock:
                    job()
            finally:
                with self._lock:
                    self._finished += 1
                    self._running = None
