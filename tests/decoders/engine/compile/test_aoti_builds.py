"""A package build leaves nothing behind however its process ends, and says where it stands.

The builds here are real (a one-layer module through ``aoti_build.build``'s child process), stopped
while the child runs: by the process exiting (``atexit``), or by SIGKILL, when only the child's
watch on its parent can clean up. Leftovers of dead processes are swept at the next start.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from dualserve.decoders.engine.compile import aoti, aoti_build
from dualserve.decoders.engine.compile.compile_worker import CompileWorker
from polling import gone, until

posix = pytest.mark.skipif(os.name != "posix", reason="process liveness is asked of POSIX only")

# A script that starts a build of a tiny module on a daemon thread (as the compile worker does),
# prints the child's pid and the build directory once the child runs, then does what it is told.
BUILDER = textwrap.dedent("""
    import sys, threading, time
    from pathlib import Path
    import torch
    from dualserve.decoders.engine.compile import aoti_build

    out, then = Path(sys.argv[1]), sys.argv[2]
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    example = (torch.randn(3, 8),)
    dims = ({0: torch.export.Dim.AUTO},)
    threading.Thread(target=aoti_build.build, args=(module, example, dims, out / "step.pt2", {}), daemon=True).start()
    while not any(child is not None for child in aoti_build._builds.values()):
        time.sleep(0.05)
    work, child = next(iter(aoti_build._builds.items()))
    print(child.pid, work, flush=True)
    if then == "exit":
        time.sleep(0.5)
        sys.exit(0)
    time.sleep(600)
""")


def start_builder(tmp_path: Path, then: str) -> tuple[subprocess.Popen, int, Path]:
    proc = subprocess.Popen([sys.executable, "-c", BUILDER, str(tmp_path), then], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split()
    assert line, f"the builder ended early (exit {proc.wait()})"
    return proc, int(line[0]), Path(line[1])


@posix
def test_a_process_exiting_mid_build_ends_its_child_and_removes_the_build(tmp_path):
    proc, child, work = start_builder(tmp_path, "exit")
    assert proc.wait(timeout=60) == 0
    assert not work.exists() and gone(child)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@posix
def test_a_killed_server_s_child_removes_the_build_and_exits(tmp_path):
    proc, child, work = start_builder(tmp_path, "wait")
    proc.kill()
    proc.wait()
    assert until(lambda: not work.exists() and gone(child)), "the orphaned child kept running or left its files"
    assert list(tmp_path.iterdir()) == []


@posix
def test_the_next_start_sweeps_what_dead_processes_left(tmp_path, monkeypatch):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    live = str(os.getppid())
    made = {
        f".build-{dead}-x1": True, f".build-{live}-x2": True,            # build directories
        f".step-rows-abc.{dead}.job.pt": False, f".step-rows-abc.{dead}.tmp.pt2": False,  # the older layout
        f".step-rows-abc.{live}.job.pt": False, "step-rows-abc.pt2": False, ".hidden": False,
    }
    for name, is_dir in made.items():
        (tmp_path / name).mkdir() if is_dir else (tmp_path / name).write_bytes(b"x")
    old = tmp_path / f".build-{live}-x3"  # alive, but older than any build: its pid was reused
    old.mkdir()
    os.utime(old, (time.time() - 2 * aoti_build.STALE_BUILD_SECONDS,) * 2)
    monkeypatch.setattr(aoti_build, "_swept", set())
    aoti_build.sweep(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f".build-{live}-x2", f".step-rows-abc.{live}.job.pt", "step-rows-abc.pt2", ".hidden"])


def test_a_running_build_reports_its_elapsed_time(monkeypatch):
    monkeypatch.setattr(aoti_build, "PROGRESS_SECONDS", 0.2)
    seen: list[float] = []
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1); print('done')"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, _ = aoti_build._wait(child, seen.append)
    assert out.strip() == "done" and len(seen) >= 2 and seen == sorted(seen)


def test_the_compile_worker_says_which_job_of_how_many_runs():
    worker = CompileWorker()
    seen: list[tuple[int, int]] = []
    for _ in range(3):
        worker.submit(lambda: (time.sleep(0.05), seen.append(worker.position())))
    assert worker.pending == 3
    assert until(lambda: not worker.busy, 10)
    assert seen == [(1, 3), (2, 3), (3, 3)] and worker.pending == 0
    worker.submit(lambda: seen.append(worker.position()))  # a later burst counts afresh
    assert until(lambda: not worker.busy, 10) and seen[-1] == (1, 1)


class _TwoLayers(torch.nn.Module):
    """A step-like module: its outputs a tuple, as the step graphs' are."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.net(x),)


def test_a_stored_package_that_cannot_load_is_built_again(tmp_path, caplog):
    """A package file cut short (an empty or truncated ``.pt2`` in the cache) is removed and built
    again, once, instead of leaving its shape eager on every start."""
    torch.manual_seed(0)
    module = _TwoLayers().eval()
    path = tmp_path / "step.pt2"
    path.write_bytes(b"PK\x03\x04 cut short")
    announced = []
    with caplog.at_level("WARNING", logger="dualserve.aoti"):
        graph, how = aoti.load_or_build(module, path, lambda n: (torch.randn(n, 8),), ({0: torch.export.Dim.AUTO},),
                                        {}, example=3, checks=(2, 5), tolerance=1e-5,
                                        announce=lambda: announced.append(True))
    assert how == "built" and announced == [True]
    assert "does not load" in caplog.text and "building it again" in caplog.text
    x = torch.randn(4, 8)
    with torch.inference_mode():
        assert torch.allclose(graph(x)[0], module(x)[0], atol=1e-5)
    graph, how = aoti.load_or_build(module, path, lambda n: (torch.randn(n, 8),), ({0: torch.export.Dim.AUTO},),
                                    {}, example=3, checks=(2,), tolerance=1e-5)
    assert how == "loaded"


class _TwoLayersTanh(_TwoLayers):
    """The same weights as ``_TwoLayers``, another function of them."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.tanh(self.net(x)),)


def test_a_stored_package_that_loads_but_does_not_match_is_kept_and_not_rebuilt(tmp_path):
    """Matching is what a package's key pins (its model, its code): a package that loads but does not
    match would not match when built again either, so it is refused, not rebuilt at every start."""
    torch.manual_seed(0)
    path = tmp_path / "step.pt2"
    dims = ({0: torch.export.Dim.AUTO},)
    aoti.load_or_build(_TwoLayers().eval(), path, lambda n: (torch.randn(n, 8),), dims, {}, example=3, checks=(2,),
                       tolerance=1e-5)
    other = _TwoLayersTanh().eval()
    for _ in range(2):
        with pytest.raises(RuntimeError, match="does not match the eager forward"):
            aoti.load_or_build(other, path, lambda n: (torch.randn(n, 8),), dims, {}, example=3, checks=(2,),
                               tolerance=1e-5, announce=lambda: pytest.fail("built again"))
        assert path.exists()


def test_two_builds_at_once_share_no_files(tmp_path, monkeypatch):
    """A first start builds two graphs at once, whose generated code inductor may name alike: each
    child writes it in its build's own directory, never in the process's inductor cache, so both
    packages load and each matches its own module."""
    import threading

    shared = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(shared))
    torch.manual_seed(0)
    modules = {"rows": _TwoLayers().eval(), "chunks": _TwoLayersTanh().eval()}
    dims = ({0: torch.export.Dim.AUTO},)
    results, errors = {}, []

    def build(name: str) -> None:
        try:
            results[name] = aoti.load_or_build(modules[name], tmp_path / f"{name}.pt2", lambda n: (torch.randn(n, 8),),
                                               dims, {}, example=3, checks=(2, 5), tolerance=1e-5)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=build, args=(name,)) for name in modules]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert {name: how for name, (_, how) in results.items()} == {"rows": "built", "chunks": "built"}
    assert not shared.exists() or not any(shared.iterdir())
    assert not list(tmp_path.glob(".build-*"))  # each build's directory went with it
