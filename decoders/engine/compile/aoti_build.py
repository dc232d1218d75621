"""Building a step package: exported and compiled in a short-lived child process.

**Built in a child process.** ``build`` saves the module (its weights included) and the example
step (the KV pool as its shape only) to a temporary file, and a short-lived child process (``python -m
dualserve.decoders.engine.compile.aoti_build``) exports, lowers and compiles it. In the server, the export
alone raised the default deployment's resident memory from 0.7 to 1.7 GB, and glibc kept what it
freed: its first start held 1.5 GB after building its four packages, its later starts 0.65 GB.
In a child all of it goes back to the machine when the child exits.

**One copy of the weights.** The graph is exported with the model's weights as inputs after the
step's own, so a package holds code only (a few MB) and every call passes the live model's tensors:
nothing is copied, and the one copy in memory stays the one in the model.

**No temporaries outlive their build.** Each build works in a directory of its own next to the
packages (``.build-<pid>-*``: the saved job, 130 MB on the default model, inductor's generated
code, and the package being written). The child deletes the job once it has read it; the parent
removes the directory when the build ends, fails, or its process exits (``atexit``, which also
ends the child). A server killed outright runs no cleanup: its child notices its parent is gone,
removes the directory and exits, and the next start in that cache removes whatever a dead process
left (``sweep``). While the child runs, ``build`` reports its elapsed time every
``PROGRESS_SECONDS``.

**No compiler outlives its server.** The child runs inductor's C++ compiler (``g++``, under it
``cc1plus``) and its compile workers as processes of its own, which ending the child alone would
orphan: a server stopped mid-build would leave ``cc1plus`` running after it exits. So (POSIX) the
child starts in a process group of its own, and its build is ended as a group: the
parent kills the group when a build is ended (``end_builds``: the compile worker's ``stop`` and
``atexit``), and a child whose parent died kills its own group: on Linux the kernel tells it at
once (``prctl(PR_SET_PDEATHSIG)``, SIGTERM), elsewhere its watch on ``getppid`` notices.

**Builds share no files.** Inductor names a package's generated code by a hash that two graphs of
one model can share (the rows and the chunks forward of the default model wrote the same wrapper
and kernel names into one directory), and a first start builds two graphs at once. In one
inductor cache the second build rewrote the first's files while the first packaged them: its
package did not load (an empty JSON file inside), and its shape stayed eager for the server's
life (the rows forward: `ar` at 26 tok/s where its graph decodes at 60), and on the next start
too until that start built it again. So each child's ``TORCHINDUCTOR_CACHE_DIR`` is a directory
of its build's own, removed with it.

**The instruction-set check once per host.** Before generating code inductor checks which vector
instruction sets (AVX-512, AVX2, AMX, ...) the compiler builds for and this CPU loads, by compiling
and loading a small library for each, in its cache. In a build's own new cache every build paid
it: 7.6 s of an 18 s build of the test model on a 2-core Xeon. The check runs first, in inductor's
default cache (``/tmp/torchinductor_<user>``, where any other use of torch on the host does it
too: its files are named by their code and flags, and inductor locks each while it writes it),
so only a host's first build compiles anything; the build's own code still goes to its own
directory.

**A build yields to serving.** The child and every compiler it starts run at the lowest priority
(``SCHED_IDLE`` on Linux, and nice 19), in this process's session: the engine's threads never
wait for a build's process, and the thread governor does not count a build as a neighbour
(``host.background``). The session matters: Linux's autogroups (``sched_autogroup_enabled``, on
by default on desktop kernels and on this project's hosts) give each session a group that the
scheduler shares the CPU with as an equal, whatever the priority of the processes inside it. A
child in a session of its own therefore took half of a core from the step's second thread, and
a team of two beside it decoded eagerly at 6-20 tok/s on a 2-core host where one thread gave
35-60; a decode-sized dot8 GEMM on two threads took 1082 us beside a ``SCHED_IDLE`` busy loop in
its own session, 30 us beside one in this session and 22 us alone (docs/threads.md).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from dualserve.models.host import background

from .tracing import TRACING, size_oblivious

PROGRESS_SECONDS = 60.0  # how often a running build reports its elapsed time
# No build takes this long: a build's leftovers this old are stale whatever became of its process.
STALE_BUILD_SECONDS = 86400.0
_swept: set[Path] = set()  # directories swept of dead builds' leftovers by this process
_builds: dict[Path, subprocess.Popen | None] = {}  # this process's build directories -> their child
_builders: dict[Path, int] = {}  # this process's build directories -> the thread that runs the build
_builds_lock = threading.Lock()


def named_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` by name: what a package takes as inputs after the step's."""
    named = dict(model.named_parameters())
    named.update((name, t) for name, t in model.named_buffers() if t is not None)
    return named


class WeightsAsInputs(torch.nn.Module):
    """``module`` with its weights passed in after the step's inputs, in sorted name order: the
    exported graph then holds no weights, and a package is a few MB of code."""

    def __init__(self, module: torch.nn.Module, names: list[str], inputs: int):
        super().__init__()
        self.module, self.names, self.inputs = module, names, inputs

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        weights = dict(zip(self.names, args[self.inputs:]))
        return torch.func.functional_call(self.module, weights, args[: self.inputs])


class BuildCancelled(RuntimeError):
    """The build was ended because its process is exiting (``atexit``) or its compile worker was
    stopped (``end_builds``); nothing to report."""


def build(module: torch.nn.Module, example: tuple[torch.Tensor, ...], dynamic: tuple[dict[int, object], ...],
          path: Path, inductor: dict[str, object], progress: Callable[[float], None] | None = None) -> None:
    """Build ``module``'s package at ``path`` in a child process (the module docstring): exported on
    ``example`` with ``dynamic`` dims (sizes of one included, ``size_oblivious``) and its weights as
    inputs, then compiled. Written in the build's own directory and renamed, so a reader never sees
    half a file; raises with the child's last words if it fails.

    ``progress``: called with the seconds elapsed every ``PROGRESS_SECONDS`` while the child runs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep(path.parent)
    work = Path(tempfile.mkdtemp(prefix=f".build-{os.getpid()}-", dir=path.parent))
    with _builds_lock:
        _builds[work] = None
        _builders[work] = threading.get_ident()
    job, tmp = work / "job.pt", work / "package.pt2"
    try:
        torch.save({"module": module, "example": [_shape_only(t) for t in example], "dynamic": dynamic,
                    "inductor": dict(inductor)}, job)
        # The child unpickles the module's classes, so it imports what this process can.
        # Inductor's files in the build's own directory (module docstring: builds share no files).
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
               "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor")}
        # A process group of its own, which its compilers join, in this session (module docstring).
        child = subprocess.Popen([sys.executable, "-m", __name__, str(job), str(tmp), str(os.getpid())],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                 **_own_process_group())
        with _builds_lock:
            ended = work not in _builds  # the build was ended while the child started
            if not ended:
                _builds[work] = child
        if ended:
            _kill(child)
            raise BuildCancelled(f"building {path.name} was ended: the server is stopping")
        with background(child.pid):  # it yields to serving: not a neighbour of the steps (``host``)
            out, err = _wait(child, progress)
        with _builds_lock:
            if work not in _builds:
                raise BuildCancelled(f"building {path.name} was ended: the server is stopping")
        if child.returncode < 0:  # killed (out of memory, say): its compilers may still run
            _kill_group(child.pid)
        if child.returncode != 0:
            tail = "\n".join((err or out).strip().splitlines()[-12:])
            raise RuntimeError(f"building {path.name} failed in its child process (exit {child.returncode}):\n{tail}")
        os.replace(tmp, path)
    except Exception as e:
        with _builds_lock:
            ended = work not in _builds
        if ended and not isinstance(e, BuildCancelled):  # its directory went while the job was being saved
            raise BuildCancelled(f"building {path.name} was ended: the server is stopping") from e
        raise
    finally:
        _end_build(work)


def _own_process_group() -> dict[str, object]:
    """``Popen``'s arguments for a child that leads a process group of its own in this session
    (the module docstring: not ``start_new_session``)."""
    if os.name != "posix":
        return {}
    if sys.version_info >= (3, 11):
        return {"process_group": 0}
    return {"preexec_fn": os.setpgrp}


def _wait(child: subprocess.Popen, progress: Callable[[float], None] | None) -> tuple[str, str]:
    """The child's output once it exits, reporting the time elapsed while it runs."""
    start = time.monotonic()
    while True:
        try:
            return child.communicate(timeout=PROGRESS_SECONDS)
        except subprocess.TimeoutExpired:  # retried, nothing of the output is lost
            if progress is not None:
                progress(time.monotonic() - start)


def _end_build(work: Path) -> None:
    """End a build of this process: its child and the child's compilers, if still running, and its
    directory."""
    with _builds_lock:
        child = _builds.pop(work, None)
        _builders.pop(work, None)
    if child is not None and child.poll() is None:
        _kill(child)
    shutil.rmtree(work, ignore_errors=True)


def _kill(child: subprocess.Popen) -> None:
    """Kill a running build child with its process group (its compilers), then reap it. The group
    is killed before the child is reaped, so its id cannot have been given to another process."""
    _kill_group(child.pid)
    child.kill()  # where the child leads no group of its own (not POSIX)
    child.wait()


def _kill_group(pgid: int) -> None:
    if os.name != "posix":
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is gone
        pass


def end_builds(thread: int | None = None) -> None:
    """End this process's running builds (those started on ``thread``, an ident, if given): their
    children and compilers are killed, their directories removed, and each ``build`` raises
    ``BuildCancelled``. The compile worker's ``stop`` ends its own thread's builds."""
    with _builds_lock:
        running = [work for work in _builds if thread is None or _builders.get(work) == thread]
    for work in running:
        _end_build(work)


@atexit.register
def _end_builds() -> None:
    """A process that exits mid-build (a server stopped during its first start) ends its children
    and removes their directories: the compile thread is a daemon, and no ``finally`` of its runs."""
    end_builds()


# What a build leaves next to the packages, and the id of the process that made it: a build's
# directory, or the single files of the layout before build directories.
_LEFTOVER = re.compile(r"^\.build-(\d+)-|^\..+\.(\d+)\.(?:job\.pt|tmp\.pt2)$")


def sweep(directory: Path) -> None:
    """Remove, once per process and directory, what builds of processes now gone left in
    ``directory`` (killed outright, they ran no cleanup): build directories and partial files
    whose process no longer runs, or older than ``STALE_BUILD_SECONDS`` (a pid may be reused)."""
    if directory in _swept:
        return
    _swept.add(directory)
    now = time.time()
    for entry in directory.glob(".*"):
        found = _LEFTOVER.match(entry.name)
        if found is None:
            continue
        pid = int(found.group(1) or found.group(2))
        try:
            age = now - entry.stat().st_mtime
        except OSError:  # removed meanwhile
            continue
        if pid != os.getpid() and (age > STALE_BUILD_SECONDS or not _running(pid)):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs. Only POSIX can ask without side effects (Windows's
    ``os.kill`` ends the process); elsewhere every process counts as running, and age decides."""
    if os.name != "posix":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


# Example inputs of at least this many elements (the KV pool) travel to the child as their shape:
# the export reads only their sizes, and saving the pool itself (190 MB per runner on the default
# deployment) made its pages resident in the server, 180 MB that stayed.
SHAPE_ONLY_NUMEL = 1 << 20


def _shape_only(t: torch.Tensor) -> torch.Tensor | dict:
    if t.numel() < SHAPE_ONLY_NUMEL:
        return t
    return {"shape": tuple(t.shape), "stride": t.stride(), "dtype": t.dtype}


def _example(saved: object) -> torch.Tensor:
    """An example input as ``build`` saved it: itself, or an uninitialised tensor of its shape."""
    if isinstance(saved, dict):
        return torch.empty_strided(saved["shape"], saved["stride"], dtype=saved["dtype"])
    return saved


def build_here(module: torch.nn.Module, example: tuple[torch.Tensor, ...], dynamic: tuple[dict[int, object], ...],
               package: Path, inductor: dict[str, object]) -> None:
    """Export and compile in this process: the body of ``build``'s child. The project's ops are
    called through their C entry points (``models/kernels/c_shims.py``) where the kernels load."""
    from dualserve.models import kernels
    from dualserve.models.kernels import c_shims

    if kernels.available():
        inductor = {**inductor, "aot_inductor.custom_ops_to_c_shims": c_shims.declarations()}
    tensors = named_weights(module)
    names = sorted(tensors)
    wrapped = WeightsAsInputs(module, names, len(example))
    args = (*example, *(tensors[name] for name in names))
    with TRACING.export(), size_oblivious(), torch.inference_mode(False), torch.no_grad():
        program = torch.export.export(wrapped, args, dynamic_shapes=((*dynamic, *({} for _ in names)),), strict=False)
    torch._inductor.aoti_compile_and_package(program, package_path=str(package), inductor_configs=dict(inductor))


def _child(job: str, package: str, parent: str | None = None) -> None:
    """``build``'s child process: the saved job, exported and compiled into ``package``. The job is
    deleted once read; a package not finished is deleted on the way out; and when ``parent`` exits
    first (killed), the build's directory goes with this process."""
    work = Path(job).parent
    if parent is not None:
        _exit_with(int(parent), work)
    _yield_to_serving()
    done = False
    try:
        spec = torch.load(job, weights_only=False)
        Path(job).unlink(missing_ok=True)  # the module's weights: not needed past here
        example = tuple(_example(saved) for saved in spec["example"])
        _check_vector_isas()
        build_here(spec["module"], example, spec["dynamic"], Path(package), spec["inductor"])
        done = True
    finally:
        if not done:
            Path(package).unlink(missing_ok=True)
        # This thread may end the process (an error, say its job removed by the watch) while the
        # watch is still removing the directory; interpreter exit would stop the watch half-way.
        if parent is not None and os.name == "posix" and os.getppid() != int(parent):
            shutil.rmtree(work, ignore_errors=True)


def _check_vector_isas() -> None:
    """Inductor's check of the vector instruction sets, in its default cache (the module
    docstring); the answer stays in this process for the build (``valid_vec_isa_list`` is
    cached). Where that cache cannot be written, the build checks in its own directory."""
    from torch._inductor import cpu_vec_isa

    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir, temporary_cache_dir

        with temporary_cache_dir(default_cache_dir()):
            cpu_vec_isa.valid_vec_isa_list()
    except (ImportError, OSError):  # an older torch, or no such cache here
        cpu_vec_isa.valid_vec_isa_list.cache_clear()


def _yield_to_serving() -> None:
    """This process, and every process it starts, at the lowest priority (module docstring):
    ``SCHED_IDLE`` where Linux offers it, and nice 19."""
    if os.name != "posix":
        return
    try:
        os.nice(19 - os.nice(0))
    except OSError:
        pass
    if hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:  # not permitted here: nice 19 alone
            pass


def _exit_with(parent: int, work: Path) -> None:
    """End this build when the parent is gone: remove the build's directory, kill this process's
    group (its compilers) and exit (``_abandon``). Linux signals it at once (SIGTERM, asked for by
    ``PR_SET_PDEATHSIG``); a watch on ``getppid`` (POSIX: a child whose parent died is handed to
    another) covers the rest, and a main thread deep in a C call that takes no signal meanwhile.
    Elsewhere the next start's ``sweep`` removes the directory."""
    if os.name != "posix":
        return
    signal.signal(signal.SIGTERM, lambda *_: _abandon(work))
    _signal_on_parent_death(signal.SIGTERM)

    def watch() -> None:
        while os.getppid() == parent:  # also true when the parent died before the signal was asked for
            time.sleep(0.25)
        _abandon(work)

    threading.Thread(target=watch, name="dualserve-build-watch", daemon=True).start()


def _signal_on_parent_death(sig: int) -> None:
    """Linux: have the kernel send ``sig`` to this process when its parent dies (prctl(2),
    ``PR_SET_PDEATHSIG``; the parent is the thread that started it, which waits for it)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG = 1 (linux/prctl.h)
    except (OSError, AttributeError):  # no libc to ask: the watch alone notices
        pass


def _abandon(work: Path) -> None:
    """The parent is gone: remove the build's directory, then end this process and, where it leads
    its own group (``build`` starts it so), every compiler it started."""
    shutil.rmtree(work, ignore_errors=True)
    if os.getpgrp() == os.getpid():
        os.killpg(0, signal.SIGKILL)
    os._exit(1)


if __name__ == "__main__":
    _child(*sys.argv[1:4])
