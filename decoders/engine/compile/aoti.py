"""Ahead-of-time compiled steps on the CPU: each step graph exported once, built by AOTInductor
into a shared library kept under the model cache, and called with no Python in between.

A ``torch.compile``'d step has two costs that a CPU decode step feels:

- every call runs dynamo's guards and AOT autograd's Python wrappers over the lifted weights:
  about 1 ms of a 10 ms step on the default model;
- every start traces the model again (dynamo and AOT autograd: 40-50 s per graph on two
  cores) even when inductor's cache already holds the generated code.

An AOTInductor package is the same inductor code, compiled into a ``.so`` with a C++ runner
(``torch.export`` + ``torch._inductor.aoti_compile_and_package``). A call is one C++ function
call without guards (it holds the GIL throughout: torch's package runner does not release it),
and loading a package from the cache takes a fraction of a second.

**Keyed by what the code depends on** (``package_key``): torch's version, the host's CPU
capability, the model's config, every weight's name, shape and dtype, every module's settings
(its ``extra_repr``: a dot8 layer's activation digits, say), the KV cache's dtype
and block size, the step shape, the feature layers, and the source of the modules the graph is
traced from. Before a package is used it must match the eager forward at two sizes of its
shape; a stored package that does not load is built again, and one that fails to build, load or
match is not used: that shape runs eagerly, with a log line saying why.

**Pruned when unused.** Loading a package marks it used (its modification time); the first
package a process loads or builds removes the packages of the same directory that no process
has used for ``STALE_DAYS`` (those of an older torch, model or dualserve, mostly).

A package is built in a child process (``aoti_build``), and a graph is traced while no step runs
(``tracing``).
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import logging
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from .aoti_build import BuildCancelled, build, named_weights  # noqa: F401 - load_or_build raises BuildCancelled

log = logging.getLogger("dualserve.aoti")
FORMAT = 1  # bump when the package layout or the graph's signature changes
STALE_DAYS = 14  # a package no process has loaded for this long is removed
_pruned: set[Path] = set()  # directories pruned by this process


def available(device: torch.device) -> bool:
    """Whether steps on ``device`` build as AOTInductor packages (the CPU; a build that fails,
    for want of a C++ compiler say, leaves its shape eager); elsewhere they go through
    torch.compile."""
    return device.type == "cpu" and hasattr(torch._inductor, "aoti_compile_and_package")


def package_key(model: torch.nn.Module, sources: Sequence[object], *parts: object) -> str:
    """A digest of everything a step package's code depends on (see the module docstring)."""
    h = hashlib.sha256()
    for part in (FORMAT, torch.__version__, sys.version_info[:2], torch.backends.cpu.get_cpu_capability(),
                 getattr(model, "config", None), *parts):
        h.update(repr(part).encode())
    for name, t in sorted(named_weights(model).items()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
    # What each module bakes into the graph as a constant: a w4a8 and a w4a16 model have the same
    # tensors and differ only in their dot8 layers' activation digits.
    for name, module in model.named_modules():
        h.update(f"{name}:{type(module).__name__}:{module.extra_repr()}".encode())
    for source in sources:
        h.update(_code(inspect.getsource(source)).encode())
    return h.hexdigest()[:24]


def _code(source: str) -> str:
    """The source's syntax tree without docstrings (comments are not in it): what the graph is
    traced from, so editing documentation does not rebuild every package."""
    tree = ast.parse(textwrap.dedent(source))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def mark_used(path: Path) -> None:
    """Note that ``path`` is in use (its modification time) and, once per process and directory,
    remove the packages next to it that nothing has used for ``STALE_DAYS``."""
    try:
        path.touch(exist_ok=True)
    except OSError:  # a read-only cache: nothing is pruned by age then
        return
    directory = path.parent
    if directory in _pruned:
        return
    _pruned.add(directory)
    cutoff = time.time() - STALE_DAYS * 86400
    for old in directory.glob("*.pt2"):
        try:
            if old.stat().st_mtime < cutoff:
                old.unlink()
        except OSError:  # another process removed or replaced it
            pass


class PackagedGraph:
    """One loaded step package, fed the live module's weights on every call (no copy is made).
    Call with the step's input tensors; returns the flat output tensors."""

    def __init__(self, path: Path, module: torch.nn.Module):
        self.path = path
        compiled = torch._inductor.aoti_load_package(str(path))
        tensors = named_weights(module)
        self.weights = [tensors[name] for name in sorted(tensors)]
        self._run: Callable[[list[torch.Tensor]], list[torch.Tensor]] = compiled.loader.boxed_run
        self._compiled = compiled  # keeps the runner (and its library) alive

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        return self._run([*inputs, *self.weights])


def traced_sources(module: torch.nn.Module, *extra: object) -> list[object]:
    """What a graph of ``module`` is traced from, for ``package_key``: the project's modules that
    define its submodules' classes (by name), then ``extra`` (the step's own classes)."""
    from dualserve.models.kernels import c_shims, ops  # every graph calls the kernels through them

    return [*sorted({inspect.getmodule(type(m)) for m in module.modules()
                     if type(m).__module__.startswith("dualserve.")} | {ops, c_shims}, key=lambda m: m.__name__),
            *extra]


def load_or_build(module: torch.nn.Module, path: Path, inputs: Callable[[int], tuple[torch.Tensor, ...]],
                  dynamic: tuple[dict[int, object], ...], inductor: dict[str, object], *, example: int,
                  checks: Sequence[int], tolerance: float,
                  announce: Callable[[], None] = lambda: None,
                  progress: Callable[[float], None] | None = None,
                  before_build: Callable[[], object] | None = None) -> tuple[PackagedGraph, str]:
    """``module``'s package at ``path``, loaded, or built there first (``build`` on ``inputs(example)``,
    after ``before_build()`` and ``announce()``), and used only once it matches the eager module on
    ``inputs(n)`` for each n of ``checks`` (``matches`` at ``tolerance``). Returns the graph and how it
    came: "loaded" or "built"; raises ``BuildCancelled`` when its build is ended
    (``aoti_build.end_builds``)."""
    graph, how = _stored(path, module), "loaded"
    if graph is None:
        if before_build is not None:
            before_build()
        announce()
        build(module, inputs(example), dynamic, path, inductor, progress=progress)
        mark_used(path)
        graph, how = PackagedGraph(path, module), "built"
    with torch.inference_mode():
        for n in checks:
            step = inputs(n)
            problem = matches(graph(*step), module(*step), tolerance)
            if problem:
                raise RuntimeError(f"the package {path.name} does not match the eager forward: {problem}")
    return graph, how


def _stored(path: Path, module: torch.nn.Module) -> PackagedGraph | None:
    """The package at ``path``, loaded, or None: absent, or a file that does not load, which is
    removed to be built again (a file cut short by a full disk or a host that died mid-copy would
    otherwise keep its shape eager on every start). A package that loads but does not match is not
    removed: its key pins what it was built from, so a new build would not match either."""
    try:
        seen = path.stat()
    except FileNotFoundError:
        return None
    mark_used(path)
    try:
        return PackagedGraph(path, module)
    except Exception as e:  # noqa: BLE001 - any failure to load means building it again
        log.warning("the stored package %s does not load (%s); building it again",
                    path.name, str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
        try:
            if path.stat().st_ino == seen.st_ino:  # not a package another process has put there since
                path.unlink()
        except FileNotFoundError:
            pass
        return None


def matches(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], tolerance: float = 0.2) -> str | None:
    """None when a package's outputs agree with the eager forward's, else what differs. Agreement
    is a relative L2 error of at most ``tolerance`` per output. Inductor fuses and reorders float
    math and, with int4 weights, keeps in fp32 some values that eager rounds to bf16 between ops. On
    the default model the two differ by 1-4% on the check inputs, and by up to 11% in batched
    multi-token steps (repeated tokens over scratch context: the worst case for bf16). A package
    traced from other code is off by far more. ``tolerance`` 0: the same bits (``torch.equal``)."""
    if len(got) != len(want):
        return f"{len(got)} outputs, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape:
            return f"output {i} has shape {tuple(g.shape)}, expected {tuple(w.shape)}"
        if tolerance == 0:
            if not torch.equal(g, w):
                return f"output {i} differs from the eager bits"
            continue
        err = (g.float() - w.float()).norm().item() / max(w.float().norm().item(), 1e-12)
        if not err <= tolerance:
            return f"output {i} differs by {err:.2%} (relative L2)"
    return None
