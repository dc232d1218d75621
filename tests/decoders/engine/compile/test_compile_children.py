"""A package build's compilers end with the server, however it stops.

The build is ``aoti_build.build``'s real child process, given a stand-in module (``compile_standin``)
whose unpickling starts ``sleep 300`` in the child, standing in for ``cc1plus`` under ``g++``:
the grandchild must be gone within seconds when the compile worker is stopped, when the server
exits (``atexit``), and when the server is killed outright (SIGKILL: only the child can act).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from compile_standin import Compiler

from dualserve.decoders.engine.compile import aoti_build
from dualserve.decoders.engine.compile.compile_worker import CompileWorker
from polling import gone, until

posix = pytest.mark.skipif(os.name != "posix", reason="process groups are POSIX's")

# A server stand-in: starts a build on a daemon thread (as the compile worker does), prints the
# compiler's and the build child's pids and the build directory once the compiler runs, then
# exits or waits, as told.
SERVER = textwrap.dedent("""
    import sys, threading, time
    from pathlib import Path
    from compile_standin import Compiler
    from dualserve.decoders.engine.compile import aoti_build

    out, then = Path(sys.argv[1]), sys.argv[2]
    pidfile = out / "compiler.pid"
    threading.Thread(target=aoti_build.build, args=(Compiler(pidfile), (), (), out / "step.pt2", {}), daemon=True).start()
    while not pidfile.exists():
        time.sleep(0.05)
    work, child = next(iter(aoti_build._builds.items()))
    print(pidfile.read_text(), child.pid, work, flush=True)
    if then == "exit":
        sys.exit(0)
    time.sleep(600)
""")


def start_server(out: Path, then: str) -> tuple[subprocess.Popen, int, int, Path]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(out), then], stdout=subprocess.PIPE, text=True,
                            env=env)
    line = proc.stdout.readline().split()
    assert line, f"the server stand-in ended early (exit {proc.wait()})"
    return proc, int(line[0]), int(line[1]), Path(line[2])


@posix
def test_stopping_the_compile_worker_ends_the_build_and_its_compiler(tmp_path):
    worker, outcome = CompileWorker(), []
    pidfile = tmp_path / "compiler.pid"

    def job() -> None:
        try:
            aoti_build.build(Compiler(pidfile), (), (), tmp_path / "step.pt2", {})
        except aoti_build.BuildCancelled:
            outcome.append("cancelled")

    worker.submit(job)
    worker.submit(lambda: outcome.append("queued job ran"))
    assert until(pidfile.exists, 60), "the build child never started its compiler"
    compiler = int(pidfile.read_text())
    assert not gone(compiler)
    worker.stop()
    assert until(lambda: gone(compiler), 5), "the compiler outlived the stopped worker"
    assert until(lambda: not worker.busy, 10) and outcome == ["cancelled"]
    worker.submit(lambda: outcome.append("ran after stop"))
    time.sleep(0.2)
    assert outcome == ["cancelled"] and worker.pending == 0
    assert [p.name for p in tmp_path.iterdir()] == ["compiler.pid"]  # the build's directory is removed


@posix
def test_a_server_that_exits_mid_build_ends_its_compiler(tmp_path):
    proc, compiler, child, work = start_server(tmp_path, "exit")
    assert proc.wait(timeout=60) == 0
    assert until(lambda: gone(compiler) and gone(child), 5), "the compiler outlived its server"
    assert not work.exists()


@posix
def test_a_killed_server_s_compiler_ends_with_it(tmp_path):
    proc, compiler, child, work = start_server(tmp_path, "wait")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert until(lambda: gone(compiler) and gone(child), 5), "the compiler outlived its killed server"
    assert until(lambda: not work.exists(), 5)


@posix
def test_a_build_child_leads_its_own_process_group(tmp_path):
    """What lets a build be ended as a group without touching the server's own group."""
    proc, compiler, child, _ = start_server(tmp_path, "wait")
    try:
        assert os.getpgid(child) == child != os.getpgid(proc.pid)
        assert os.getpgid(compiler) == child
    finally:
        proc.kill()
        proc.wait()
        assert until(lambda: gone(compiler), 5)


def test_the_compile_worker_reports_its_progress_for_the_status_page():
    from dualserve.decoders.engine.compile.compile_worker import CompileProgress
    from dualserve.server.status import compile_status

    worker, seen, both_asked = CompileWorker(), [], threading.Event()
    worker.submit(lambda: (both_asked.wait(10), seen.append(worker.progress())), name="rows-8")
    worker.submit(lambda: seen.append(worker.progress()), name="rows-16")
    both_asked.set()  # the first job reads its progress once both are asked for, however busy the host
    assert until(lambda: not worker.busy, 10)
    assert seen == [CompileProgress(0, 2, "rows-8"), CompileProgress(1, 2, "rows-16")]
    assert compile_status(seen[1]) == {"built": 1, "total": 2, "building": "rows-16"}
    assert worker.progress() == CompileProgress(0, 0, None) and compile_status(worker.progress()) is None


def test_two_workers_run_two_jobs_at_once_in_the_order_asked():
    """A CPU host's worker runs two builds side by side; the third starts when one ends, and the
    progress names both running jobs."""
    worker, started, release = CompileWorker(2), [], threading.Event()
    places = {}

    def job(name: str):
        return lambda: (places.setdefault(name, worker.position()), started.append(name), release.wait(10))

    for name in ("rows", "chunks", "head"):
        worker.submit(job(name), name=name)
    assert until(lambda: len(started) == 2, 10)
    time.sleep(0.1)
    assert set(started) == {"rows", "chunks"} and worker.progress().running == "rows, chunks"
    assert worker.position() == (2, 3) and worker.pending == 3
    release.set()
    assert until(lambda: not worker.busy, 10)
    assert started[2] == "head" and worker.pending == 0
    # each job's own place, for its log line ("graph k of n"; n is what was asked for by then)
    assert {name: k for name, (k, _) in places.items()} == {"rows": 1, "chunks": 2, "head": 3}


@posix
def test_stopping_two_workers_ends_both_builds_and_their_compilers(tmp_path):
    worker, outcome = CompileWorker(2), []
    pidfiles = [tmp_path / "a.pid", tmp_path / "b.pid"]

    def job(pidfile: Path):
        def run() -> None:
            try:
                aoti_build.build(Compiler(pidfile), (), (), tmp_path / f"{pidfile.stem}.pt2", {})
            except aoti_build.BuildCancelled:
                outcome.append("cancelled")
        return run

    for pidfile in pidfiles:
        worker.submit(job(pidfile))
    assert until(lambda: all(p.exists() for p in pidfiles), 60), "both builds start their compilers"
    compilers = [int(p.read_text()) for p in pidfiles]
    worker.stop()
    assert until(lambda: all(gone(c) for c in compilers), 5), "a compiler outlived the stopped worker"
    assert until(lambda: not worker.busy, 10) and outcome == ["cancelled", "cancelled"]


@pytest.mark.parametrize("cores, workers", [(1, 1), (None, 1), (2, 2), (16, 2)])
def test_a_cpu_host_builds_two_graphs_at_a_time_from_two_cores(monkeypatch, cores, workers):
    from dualserve.decoders.engine.compile import compile_worker

    monkeypatch.setattr(compile_worker.os, "cpu_count", lambda: cores)
    assert compile_worker.cpu_workers() == workers
